"""What an idle node session costs the gateway: memory, CPU at open, CPU while idle.

Run from the repository root::

    .venv/bin/python bench/sessions.py [--sessions 1000,5000,10000] [--ping-s 1]
                                       [--window-pings 5] [--profile]

It prints figures and judges nothing; it is not part of the test suite.

The gateway: one real ``better-compute serve --role all`` on a SQLite file (the
tenant API and the gateway in one process, as ``bench/join.py`` starts it: a
``--role gateway`` process needs PostgreSQL and an API replica, and holds a
session the same way), started with ``--session-ping-seconds PING`` so a
measured window covers several pings in seconds. Its nodes are real: the largest
N of ``--sessions`` join through the gateway first (``bench.common``: bcd's join
bodies, one pinned TLS connection per join, chunks of 2,000 so no sealed token
outlives its 5 minutes), each with its own key and certificate. A node holds at
most ``MAX_SESSIONS_PER_NODE`` sessions (a newer one replaces the older), so N
sessions are N nodes.

The sessions are opened by separate client processes (this file with
``--worker``), at most 1,000 each, so no process nears the 20,000 open files
and no source address the gateway listener's 1,024 connections per source: worker
k dials from 127.0.0.(k + 2). Each opens its sessions as ``bcd.session`` does
(``bcd.gatewayclient.GatewayClient.session`` over a ``bcd.transport.DialTransport``
whose dial is ``bcd.tls.pinned_context`` with the node's chain and key, bound to
the worker's source address), 8 handshakes at a time, reads every line, and
counts the pings.

For each N (ascending; the sessions of a smaller N stay open):

- ``RSS/session``: the serve process's RSS (``/proc/PID/status`` VmRSS, and
  Anonymous from ``/proc/PID/smaps_rollup``) with N sessions open, less the same
  with none (after the joins), divided by N;
- ``CPU/open``: serve's utime + stime (``/proc/PID/stat``, all threads) spent while
  the sessions were opened, per session opened (TLS handshake with a client
  certificate, the store's certificate check, the Hello, the welcome), less what
  the sessions already open spent idle meanwhile (from the idle figure below; the
  raw figure is printed beside it);
- ``CPU/idle session-s``: serve's CPU over a window of ``--window-pings`` ping
  intervals with the N sessions idle, less its CPU over the same window with no
  session (the revocation poll, the reporter), divided by N × the window; and
  per ping (the same CPU divided by the pings the workers counted), and what that
  is per idle session-second at the default 15 s ping interval;
- ``node µs/ping``: the worker processes' CPU over the same window per ping they
  read: bcd's client side of a session (``GatewayClient.session``'s lines over its
  transport and trio's TLS), the bench's own JSON parse of each line and the
  workers' own idle CPU (no baseline taken: an idle trio loop with no timer) included.

``--profile memory|idle|open`` runs serve with tracemalloc or a sampling profiler
(SIGPROF, 1 ms of CPU; figures not comparable): the bench puts a ``sitecustomize``
module on serve's ``PYTHONPATH`` that, on SIGUSR1, starts tracemalloc (the first
time, with no session open) and writes a tracemalloc snapshot
grouped by file and line, and on SIGUSR2 starts / stops the sampler and writes
the stacks it saw. The snapshot is taken with no session and with the largest N;
the top differences are printed (``memory``). The sampler covers the idle
window of the largest N (``idle``) or the opening of its sessions (``open``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bcd import __version__, wire  # noqa: E402
from bcd.errors import BcdError  # noqa: E402
from bcd.gatewayclient import GatewayClient  # noqa: E402
from bcd.join import verify_joined  # noqa: E402
from bcd.keys.file import key_to_pem  # noqa: E402
from bcd.signed import Issued  # noqa: E402
from bcd.tls import Anchor, pinned_context  # noqa: E402
from bcd.transport import DialTransport  # noqa: E402
from bench.common import (  # noqa: E402
    SERVER_NAME,
    build_bodies,
    count_failures,
    drive,
    print_environment,
    proc_cpu_s,
    serving_anchor,
)
from control.gateway import MAX_SESSIONS_PER_NODE  # noqa: E402
from tests.e2e import ControlPlane, make_pki  # noqa: E402

PER_WORKER = 1_000  # under the gateway listener's 1,024 connections per source address
JOIN_CHUNK = 2_000  # sealed tokens are refused 5 minutes after they are built
JOIN_CONCURRENCY = 8
OPEN_CONCURRENCY = 8  # per worker: the gateway gives a handshake 5 s
OPEN_TIMEOUT_S = 600.0
SETTLE_S = 2.0

SITECUSTOMIZE = '''
"""bench/sessions.py --profile: tracemalloc snapshots and a SIGPROF sampler for serve."""
import collections, os, signal, sys, tracemalloc

_DIR = os.environ.get("SESSIONS_BENCH_PROFILE_DIR")
if _DIR and "serve" in sys.argv:
    _count = [0]
    _stacks = collections.Counter()
    _on = [False]

    def _snap(signum, frame):
        if not tracemalloc.is_tracing():  # the first: from now on (not at start: slow)
            tracemalloc.start(1)
        _count[0] += 1
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        snap.dump(os.path.join(_DIR, "snap-%d.pickle" % _count[0]))
        open(os.path.join(_DIR, "snap-%d.done" % _count[0]), "w").close()

    def _sample(signum, frame):
        try:  # never raise into the code it interrupted
            stack = []
            while frame is not None and len(stack) < 40:
                code = frame.f_code
                where = code.co_filename.rsplit("/site-packages/", 1)[-1].rsplit("/wt14/", 1)[-1]
                stack.append("%s:%s %s" % (where, frame.f_lineno or 0, code.co_name))
                frame = frame.f_back
            _stacks[tuple(stack)] += 1
        except Exception:
            pass

    def _toggle(signum, frame):
        if not _on[0]:
            _on[0] = True
            _stacks.clear()
            signal.signal(signal.SIGPROF, _sample)
            signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
            return
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        _on[0] = False
        with open(os.path.join(_DIR, "stacks.json"), "w") as f:
            import json
            json.dump([[list(k), v] for k, v in _stacks.most_common()], f)
        open(os.path.join(_DIR, "stacks.done"), "w").close()

    signal.signal(signal.SIGUSR1, _snap)
    signal.signal(signal.SIGUSR2, _toggle)
'''


# --- the worker: sessions from one source address -------------------------------------


async def _hold(
    member: dict[str, str],
    port: int,
    anchor: Anchor,
    source: str,
    opening: trio.Semaphore,
    counts: dict[str, int],
    all_open: trio.Event,
    total: int,
) -> None:
    ctx = pinned_context(anchor, (member["chain"], member["key_pem"].encode("ascii")))

    async def dial(host: str, dport: int) -> trio.abc.Stream:
        tcp = await trio.open_tcp_stream(host, dport, local_address=source)
        tls = trio.SSLStream(tcp, ctx, server_hostname=SERVER_NAME, https_compatible=True)
        try:
            with trio.fail_after(30):
                await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        return tls

    hello = wire.Hello(
        node_id=member["node_id"],
        journal_id=str(uuid.uuid4()),
        boot_id=str(uuid.uuid4()),
        daemon_version=__version__,
    )
    released = False

    def done(kind: str) -> None:
        nonlocal released
        if not released:
            released = True
            counts[kind] += 1
            opening.release()
            if counts["welcomed"] + counts["failed"] == total:
                all_open.set()

    await opening.acquire()
    client = GatewayClient(
        DialTransport(dial), host=SERVER_NAME, port=port, server_name=SERVER_NAME
    )
    try:
        async with client.session(wire.dumps(hello.to_json()), idle_timeout=None) as lines:
            if lines.status != 200:
                counts["refused"] += 1
                return
            async for line in lines:
                kind = json.loads(line).get("type")
                if kind == "welcome":
                    done("welcomed")
                elif kind == "ping":
                    counts["pings"] += 1
            counts["ended"] += 1
    except BcdError as exc:
        counts["errors"] += 1
        if counts["errors"] <= 3:
            print(f"worker {source}: {exc}", file=sys.stderr, flush=True)
    finally:
        done("failed")
        await client.aclose()


async def _worker(members: list[dict[str, str]], port: int, pin: str, source: str) -> None:
    anchor = await serving_anchor(port, pin)
    counts = {k: 0 for k in ("welcomed", "failed", "refused", "errors", "ended", "pings")}
    opening = trio.Semaphore(OPEN_CONCURRENCY)
    all_open = trio.Event()
    async with trio.open_nursery() as nursery:
        for m in members:
            nursery.start_soon(_hold, m, port, anchor, source, opening, counts, all_open,
                               len(members))  # fmt: skip
        await all_open.wait()
        print(json.dumps({"open": counts}), flush=True)
        # Each line on stdin asks for the counts; end of stdin ends the worker.
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while data := await stdin.receive_some():
            buf += data
            while b"\n" in buf:
                _, buf = buf.split(b"\n", 1)
                print(json.dumps({"counts": counts}), flush=True)
        nursery.cancel_scope.cancel()


# --- the bench ------------------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    n: int

    def ask(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(b"?\n")
        self.proc.stdin.flush()
        got: dict[str, int] = json.loads(self.proc.stdout.readline())["counts"]
        return got


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, Anonymous of smaps_rollup) of ``pid`` in KiB."""
    rss = anon = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                anon = int(line.split()[1])
    return rss, anon


def join_nodes(cp: ControlPlane, n: int) -> list[dict[str, str]]:
    """``n`` nodes joined through the gateway: node id, chain, key (PEM) of each."""
    pins = cp.pins()
    encryption_key = wire.public_key_of_jwk(cp.well_known()["join"]["encryptionJwk"])
    _site, pool = cp.site_and_pool()
    out: list[dict[str, str]] = []
    for start in range(0, n, JOIN_CHUNK):
        k = min(JOIN_CHUNK, n - start)
        token = cp.token(pool, maxUses=k)["token"]
        bodies = build_bodies(k, token, encryption_key, seed=start + 1)
        outcomes, _ = trio.run(
            drive, cp.gateway_port, pins["serving_ca_spki_pin"], bodies, JOIN_CONCURRENCY
        )
        if any(o.status != 200 for o in outcomes):
            raise RuntimeError(f"joins failed: {count_failures(outcomes)}")
        for prepared, outcome in zip(bodies, outcomes, strict=True):
            body = verify_joined(
                outcome.body.decode("ascii"),
                signing_pin=pins["join_signing_key_pin"],
                csr_der=prepared.csr_der,
                key=prepared.key.public_key(),
                role="node",
            )
            if not isinstance(body, Issued) or body.node_id is None or body.chain is None:
                raise RuntimeError(f"a join did not answer joined: {body!r}")
            out.append({
                "node_id": body.node_id,
                "chain": body.chain,
                "key_pem": key_to_pem(prepared.key).decode("ascii"),
            })  # fmt: skip
    return out


def start_worker(tmp: Path, k: int, members: list[dict[str, str]], port: int, pin: str) -> Worker:
    path = tmp / f"worker-{k}.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps(members))
    env = {key: v for key, v in os.environ.items() if key not in ("PYTHONPATH",)}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", str(path), "--port", str(port), "--pin", pin,
         "--source", f"127.0.0.{k + 2}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )  # fmt: skip
    return Worker(proc, len(members))


def wait_file(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} was not written")
        time.sleep(0.1)


def print_snapshot_diff(prof: Path, before: int, after: int, n: int) -> None:
    import tracemalloc

    old = tracemalloc.Snapshot.load(str(prof / f"snap-{before}.pickle"))
    new = tracemalloc.Snapshot.load(str(prof / f"snap-{after}.pickle"))
    stats = new.compare_to(old, "lineno")
    total = sum(s.size_diff for s in stats)
    print(f"\n[tracemalloc] Python heap growth with {n} sessions: {total / n:,.0f} B/session")
    for s in stats[:25]:
        frame = s.traceback[0]
        where = frame.filename.rsplit("/site-packages/", 1)[-1].rsplit("/wt14/", 1)[-1]
        print(f"  {s.size_diff / n:8,.0f} B/session {s.count_diff / n:6.1f} blocks  "
              f"{where}:{frame.lineno}")  # fmt: skip
    by_file = new.compare_to(old, "filename")
    print("  by file:")
    for s in by_file[:12]:
        where = s.traceback[0].filename.rsplit("/site-packages/", 1)[-1].rsplit("/wt14/", 1)[-1]
        print(f"  {s.size_diff / n:8,.0f} B/session  {where}")


def print_stacks(prof: Path, phase: str) -> None:
    stacks = json.loads((prof / "stacks.json").read_text())
    total = sum(v for _, v in stacks)
    print(f"\n[sampler] {total} samples (1 ms of serve CPU each) over the {phase} phase")
    leaf: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    for frames, v in stacks:
        if frames:
            leaf[frames[0]] = leaf.get(frames[0], 0) + v
        for f in {fr.split(" ", 1)[0].rsplit(":", 1)[0] + " " + fr.split(" ", 1)[1]
                  for fr in frames}:  # fmt: skip
            inclusive[f] = inclusive.get(f, 0) + v
    print("  self (innermost Python frame):")
    for f, v in sorted(leaf.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {100 * v / total:5.1f}%  {f}")
    print("  inclusive (function):")
    for f, v in sorted(inclusive.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {100 * v / total:5.1f}%  {f}")


def bench(sizes: list[int], ping_s: float, window_pings: int, profile: str | None) -> None:
    window_s = ping_s * window_pings
    print_environment()
    print(f"sessions: {sizes}; ping every {ping_s:g} s; idle window {window_s:g} s "
          f"({window_pings} pings); at most {MAX_SESSIONS_PER_NODE} sessions per node, "
          f"so one node per session; {PER_WORKER} sessions per worker process")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        home = tmp / "cp"
        home.mkdir()
        prof = tmp / "profile"
        saved = dict(os.environ)
        if profile:
            prof.mkdir()
            (tmp / "site").mkdir()
            (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
            os.environ["PYTHONPATH"] = str(tmp / "site")
            os.environ["SESSIONS_BENCH_PROFILE_DIR"] = str(prof)
        try:
            cp = ControlPlane.start(home, template, f"sqlite:///{tmp / 'store.db'}",
                                    extra_args=["--session-ping-seconds", str(ping_s)])  # fmt: skip
        finally:
            os.environ.clear()
            os.environ.update(saved)
        workers: list[Worker] = []
        try:
            pid = cp.proc.pid
            t0 = time.perf_counter()
            cpu0 = proc_cpu_s(pid)
            members = join_nodes(cp, max(sizes))
            print(f"joined {len(members)} nodes in {time.perf_counter() - t0:.1f} s "
                  f"(serve CPU {proc_cpu_s(pid) - cpu0:.1f} s)")  # fmt: skip
            time.sleep(SETTLE_S)
            rss0 = rss_kb(pid)
            c = proc_cpu_s(pid)
            time.sleep(window_s)
            base_cpu_s = (proc_cpu_s(pid) - c) / window_s
            print(f"no session: serve RSS {rss0[0] / 1024:.1f} MiB (anonymous "
                  f"{rss0[1] / 1024:.1f} MiB), CPU {base_cpu_s * 1000:.2f} ms/s")  # fmt: skip
            snaps = 0
            if profile == "memory":
                os.kill(pid, signal.SIGUSR1)
                snaps += 1
                wait_file(prof / f"snap-{snaps}.done")
            held = 0
            pin = cp.pins()["serving_ca_spki_pin"]
            rows = []
            for n in sizes:
                if profile == "open" and n == max(sizes):
                    os.kill(pid, signal.SIGUSR2)
                cpu_before = proc_cpu_s(pid)
                held_before = held
                t_open = time.perf_counter()
                new = []
                while held < n:
                    k = min(PER_WORKER, n - held)
                    new.append(start_worker(tmp, len(workers) + len(new),
                                            members[held:held + k], cp.gateway_port, pin))  # fmt: skip
                    held += k
                opened = {"welcomed": 0, "failed": 0, "refused": 0, "errors": 0}
                for w in new:
                    assert w.proc.stdout is not None
                    line = w.proc.stdout.readline()
                    if not line:
                        raise RuntimeError("a worker died while opening its sessions")
                    for key, v in json.loads(line)["open"].items():
                        if key in opened:
                            opened[key] += v
                workers += new
                if profile == "open" and n == max(sizes):
                    os.kill(pid, signal.SIGUSR2)
                open_wall = time.perf_counter() - t_open
                opened_n = sum(w.n for w in new)
                open_cpu = proc_cpu_s(pid) - cpu_before
                time.sleep(SETTLE_S)
                rss = rss_kb(pid)
                pings0 = sum(w.ask()["pings"] for w in workers)
                c = proc_cpu_s(pid)
                node_c = sum(proc_cpu_s(w.proc.pid) for w in workers)
                t = time.perf_counter()
                if profile == "idle" and n == max(sizes):
                    os.kill(pid, signal.SIGUSR2)
                time.sleep(window_s)
                if profile == "idle" and n == max(sizes):
                    os.kill(pid, signal.SIGUSR2)
                cpu = proc_cpu_s(pid) - c
                node_cpu = sum(proc_cpu_s(w.proc.pid) for w in workers) - node_c
                wall = time.perf_counter() - t
                counts = [w.ask() for w in workers]
                pings = sum(x["pings"] for x in counts) - pings0
                lost = sum(x["errors"] + x["ended"] + x["refused"] for x in counts)
                idle = max(0.0, cpu - base_cpu_s * wall)
                per_s_us = idle / (n * wall) * 1e6
                # the sessions already open pinged while these opened: not the opens' cost
                during = (held_before + opened_n / 2) * open_wall * idle / (n * wall)
                open_own = max(0.0, open_cpu - base_cpu_s * open_wall - during)
                per_ping_us = idle / max(1, pings) * 1e6
                row = {
                    "n": n,
                    "welcomed": opened["welcomed"],
                    "open_errors": opened["failed"] - 0,
                    "lost": lost,
                    "rss_kb": (rss[0] - rss0[0]) / n,
                    "anon_kb": (rss[1] - rss0[1]) / n,
                    "open_ms": open_own * 1000 / max(1, opened_n),
                    "open_raw_ms": open_cpu * 1000 / max(1, opened_n),
                    "open_rate": opened_n / open_wall,
                    "idle_us_s": per_s_us,
                    "ping_us": per_ping_us,
                    "at15_us_s": per_ping_us / 15,
                    # the worker processes: bcd's client reading each ping line
                    "node_ping_us": node_cpu / max(1, pings) * 1e6,
                    "pings": pings,
                }
                rows.append(row)
                print(f"N={n}: welcomed {opened['welcomed']}, open errors "
                      f"{opened['errors'] + opened['refused']}, lost while idle {lost}; "
                      f"RSS +{(rss[0] - rss0[0]) / 1024:.1f} MiB; opened {opened_n} in "
                      f"{open_wall:.1f} s; {pings} pings in {wall:.1f} s; idle CPU "
                      f"{cpu * 1000:.0f} ms (no-session share {base_cpu_s * wall * 1000:.0f} ms)",
                      flush=True)  # fmt: skip
                if profile == "memory" and n == max(sizes):
                    os.kill(pid, signal.SIGUSR1)
                    snaps += 1
                    wait_file(prof / f"snap-{snaps}.done")
            print("\n     N   RSS KB/sess  anon KB/sess  CPU ms/open (raw)  opens/s  "
                  "idle µs/sess-s  µs/ping  µs/sess-s at 15 s  node µs/ping")  # fmt: skip
            for r in rows:
                print(f"{r['n']:6d}  {r['rss_kb']:11.1f}  {r['anon_kb']:12.1f}  "
                      f"{r['open_ms']:6.2f} ({r['open_raw_ms']:6.2f})  {r['open_rate']:7.0f}  "
                      f"{r['idle_us_s']:14.1f}  {r['ping_us']:7.0f}  {r['at15_us_s']:18.2f}  {r['node_ping_us']:12.0f}")  # fmt: skip
            if profile == "memory":
                print_snapshot_diff(prof, 1, snaps, max(sizes))
            elif profile:
                wait_file(prof / "stacks.done")
                print_stacks(prof, profile)
        finally:
            for w in workers:
                with contextlib.suppress(OSError):
                    assert w.proc.stdin is not None
                    w.proc.stdin.close()
            for w in workers:
                try:
                    w.proc.wait(10)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
            cp.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sessions", default="1000,5000,10000",
                        help="comma-separated N, ascending (default 1000,5000,10000)")  # fmt: skip
    parser.add_argument("--ping-s", type=float, default=1.0,
                        help="serve's --session-ping-seconds (default 1)")  # fmt: skip
    parser.add_argument("--window-pings", type=int, default=5,
                        help="the idle window, in ping intervals (default 5)")  # fmt: skip
    parser.add_argument("--profile", choices=("memory", "idle", "open"),
                        help="tracemalloc and a CPU sampler in serve (figures not comparable)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pin", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        members = json.loads(Path(args.worker).read_text())
        trio.run(_worker, members, args.port, args.pin, args.source)
        return 0
    sizes = sorted(int(x) for x in args.sessions.split(","))
    if not sizes or sizes[0] < 1 or sizes[-1] > 10_000:
        parser.error("--sessions: each N from 1 to 10000")
    bench(sizes, args.ping_s, args.window_pings, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
