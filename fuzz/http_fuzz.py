"""HTTP-level property-based fuzzing of a real ``better-compute serve``.

Run from the repository root (``make fuzz`` runs the default size)::

    .venv/bin/python fuzz/http_fuzz.py [--per-family N] [--concurrency C] [--fleet]
                                       [--families a,b,...] [--attack-seconds S] ...

It starts ``better-compute serve`` as tests/e2e.py does (role all, SQLite, a PKI
made with ``tests.e2e.make_pki`` in a temporary directory, the tpm, x509pop and
discovery attestors configured, a downloads tree), joins the fuzzer's identities for
real, and with ``--fleet`` also a fleet on PostgreSQL (tests/fleet.py: ``--role api``
with its relay listener, and a ``--role gateway``). Then, per path family, hypothesis
strategies (fuzz/strategies.py) draw at least N inputs inside ``@given(st.data())``
(generation only, every health check off) in a thread, and C concurrent senders write
them over real sockets (fuzz/client.py), keep-alive where a case allows it.

Checked throughout, every ``--check-every`` inputs and at the end, each counted:

1. a control client (fuzz/control_client.py, its own process) mints a token through
   the API, joins through the gateway and GETs the well-known document: each call
   must answer within 1 s (``--bound``);
2. no answer with status >= 500, except 503 UNAVAILABLE with ``retry-pushback-ms``
   (documented: a database or upstream outage, a drain) and a 503 ``/readyz``;
3. no ``Traceback`` in any serve log (attributed to the input by the client port
   the log line names, when it names one);
4. each serve process's RSS (VmRSS) stays under ``--rss-limit-mb``.

Then, with the caps in place, the connection-exhaustion attack (idle TCP connections
and slowloris heads from 127.0.0.2, with this process's RLIMIT_NOFILE raised) and
the session attack (one certificate opening hundreds of sessions), while the control
client checks every half second. A summary table is printed; the exit status is 1
when any check failed. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import HypothesisException  # noqa: E402

from control import gatewaypki, tenancy  # noqa: E402
from control.pki import load_chain  # noqa: E402
from control.store import open_store  # noqa: E402
from fuzz import attacks, strategies  # noqa: E402
from fuzz.client import Conn, ConnectError, Endpoint, client_context, connect, exchange  # noqa: E402
from fuzz.world import (  # noqa: E402
    World,
    foreign_identity,
    join_identity,
    make_identities,
    write_downloads,
)
from tests.e2e import ControlPlane, make_pki  # noqa: E402

FAMILIES = [
    "gw-join",
    "gw-renew",
    "gw-session",
    "gw-vouch",
    "gw-raw",
    "api-raw",
    "api-tenant",
    "api-static",
    "health",
]
FLEET_FAMILIES = ["relay", "fleet-gw"]
BATCH = 32
DRAWS_PER_EXAMPLE = 6
EXAMPLES_PER_RUN = 2_000
COMPLETE_WAIT_S = 40.0  # past the server's 30 s request timeout
INCOMPLETE_WAIT_S = 0.25
HEALTH_PATHS = ("/healthz", "/readyz")


# --- bookkeeping ------------------------------------------------------------------


@dataclass
class FamilyStats:
    name: str
    inputs: int = 0
    started: float = 0.0
    ended: float = 0.0
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    documented_5xx: collections.Counter[str] = field(default_factory=collections.Counter)
    failures_5xx: int = 0
    transport: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    retries: int = 0

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.ended or time.monotonic()) - self.started)


@dataclass
class Failure:
    check: str
    detail: str
    case: str | None = None


@dataclass
class CheckRecord:
    at_inputs: int
    phase: str
    target: str
    mint_s: float | None
    join_s: float | None
    wk_s: float | None
    errors: list[str]


class PortMap:
    """Client port -> the last cases sent from it (a serve log line names the port, and
    for a handler's failure the method and path, which pick the case on a keep-alive
    connection)."""

    def __init__(self, size: int = 40_000) -> None:
        self.size = size
        self.cases: collections.OrderedDict[int, collections.deque[tuple[str, str]]] = (
            collections.OrderedDict()
        )

    def record(self, port: int, case: strategies.Case) -> None:
        seen = self.cases.get(port)
        if seen is None:
            seen = self.cases[port] = collections.deque(maxlen=8)
        seen.append((case.data.split(b"\r\n", 1)[0].decode("latin-1"), case.describe(1500)))
        self.cases.move_to_end(port)
        while len(self.cases) > self.size:
            self.cases.popitem(last=False)

    def lookup(self, port: int, request_line: str | None) -> str | None:
        seen = self.cases.get(port)
        if not seen:
            return None
        if request_line:
            method, _, path = request_line.partition(" ")
            for line, described in reversed(seen):
                parts = line.split(" ")
                if len(parts) >= 2 and parts[0] == method and parts[1].split("?")[0] == path:
                    return described
        return seen[-1][1] + ("" if not request_line else "  (the last case on that port)")


class LogWatch:
    """New records of a serve log since the last look (a record: a line and the
    indented or traceback lines under it)."""

    START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")

    def __init__(self, label: str, path: Path) -> None:
        self.label, self.path = label, path
        self.offset = 0
        self.pending = ""
        self.levels: collections.Counter[str] = collections.Counter()
        self.tracebacks = 0
        self.samples: dict[str, list[str]] = {}

    def scan(self, final: bool = False) -> list[str]:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
            self.offset += len(data)
            self.pending += data.decode("utf-8", "replace")
        if not final:
            cut = self.pending.rfind("\n")
            if cut < 0:
                return []
            text, self.pending = self.pending[: cut + 1], self.pending[cut + 1 :]
        else:
            text, self.pending = self.pending, ""
        records: list[list[str]] = []
        for line in text.splitlines():
            if self.START.match(line) or not records:
                records.append([line])
            else:
                records[-1].append(line)
        if records and not final and self.pending == "":
            # the last record may still grow (a traceback being written): keep it back
            last = "\n".join(records.pop()) + "\n"
            self.pending = last + self.pending
        found = []
        for rec in records:
            head = rec[0]
            m = re.match(r"^\S+ \S+ (\w+) ([\w.]+): (.*)$", head)
            if m:
                self.levels[m.group(1)] += 1
                if m.group(1) in ("WARNING", "ERROR", "CRITICAL"):
                    key = f"{m.group(1)} {m.group(2)}: {re.sub(r'[0-9]+', 'N', m.group(3))[:90]}"
                    self.samples.setdefault(key, []).append(head)
            whole = "\n".join(rec)
            if "Traceback" in whole:
                self.tracebacks += whole.count("Traceback")
                found.append(whole)
        return found


@dataclass
class Rss:
    label: str
    pid: int
    start_kb: int = 0
    peak_kb: int = 0
    end_kb: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)
    fds_peak: int = 0

    def sample(self) -> int:
        try:
            with open(f"/proc/{self.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1])
                        self.peak_kb = max(self.peak_kb, kb)
                        self.end_kb = kb
                        return kb
        except OSError:
            return -1
        return -1


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(len(ordered) * q) - 1)]


# --- the run --------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.endpoints: dict[str, Endpoint] = {}
        self.stats: dict[str, FamilyStats] = {}
        self.failures: list[Failure] = []
        self.failure_keys: collections.Counter[str] = collections.Counter()
        self.total_inputs = 0
        self.phase = "setup"
        self.ports = PortMap()
        self.logs: list[LogWatch] = []
        self.rss: list[Rss] = []
        self.procs: dict[str, Any] = {}
        self.checks: list[CheckRecord] = []
        self.control: Any = None
        self._control_buf = b""
        self.attack_report: list[str] = []
        self.lock = trio.Lock()
        self.anomalies: dict[str, list[str]] = {}
        self.anomaly_counts: collections.Counter[str] = collections.Counter()
        self.worlds: dict[str, World] = {}
        """endpoint name -> the world (control plane) behind it"""
        self.nursery: trio.Nursery | None = None
        self.replacing: set[tuple[str, str]] = set()
        self.replaced = 0

    def fail(
        self, check: str, detail: str, case: str | None = None, *, key: str | None = None
    ) -> None:
        """Record a failure; only the first few of one kind keep their input."""
        k = key or f"{check}|{detail[:80]}"
        self.failure_keys[k] += 1
        if self.failure_keys[k] <= 3:
            self.failures.append(Failure(check, detail, case))
            where = f" (after {self.total_inputs} inputs, {self.phase})"
            print(f"FAIL {check}: {detail[:300]}{where}", flush=True)
            if case:
                print(f"     input: {case.split(chr(10))[0][:600]}", flush=True)

    # --- one case ---------------------------------------------------------------

    async def send_case(
        self, case: strategies.Case, conns: dict[tuple[str, str | None], Conn]
    ) -> None:
        stats = self.stats[case.family]
        if self.args.generate_only:
            self._count(stats, case)
            return
        endpoint = self.endpoints[case.endpoint]
        key = (case.endpoint, case.identity)
        for attempt in (0, 1):
            conn = None if case.fresh else conns.pop(key, None)
            reused = conn is not None
            if conn is None:
                try:
                    conn = await connect(endpoint, case.identity)
                except ConnectError as exc:
                    self._count(stats, case)
                    stats.transport[str(exc)] += 1
                    if case.identity != "foreign" and "tls" not in str(exc):
                        self.fail(
                            "transport", f"{case.endpoint}: {exc}", case.describe(), key="connect"
                        )
                    return
            self.ports.record(conn.local_port, case)
            wait = COMPLETE_WAIT_S if case.complete else INCOMPLETE_WAIT_S
            ex = await exchange(conn, case.pieces(), case.methods, delays=case.delays, wait=wait)
            first = ex.answers[0] if ex.answers else None
            stale = reused and (first is None or first.error == "no-answer-close")
            if any(a.status == 429 for a in ex.answers):
                conn.broken = True  # its certificate's budget ran out: a new one next time
                self.replace(case)
            if conn.broken or case.fresh:
                await conn.aclose()
            else:
                conns[key] = conn
            if stale and attempt == 0:
                stats.retries += 1  # a keep-alive connection the server had closed: again
                continue
            self._record(stats, case, ex)
            return

    def replace(self, case: strategies.Case) -> None:
        """Join a new node into a renewal or site-agent slot whose budget ran out."""
        slot = case.identity or ""
        world = self.worlds.get(case.endpoint)
        if world is None or not (slot[:1] in "rs" and slot[1:].isdigit()) or self.nursery is None:
            return
        if (world.label, slot) in self.replacing:
            return
        self.replacing.add((world.label, slot))
        self.nursery.start_soon(self._replace, world, slot)

    async def _replace(self, world: World, slot: str) -> None:
        try:
            role = world.identities[slot].role
            made = await trio.to_thread.run_sync(
                lambda: world.token(world.pools["fuzz"], maxUses=1, role=role)["token"]
            )
            new = await join_identity(world, slot, made, role=role)
            ctx = client_context()
            load_chain(ctx, new.chain, new.key)
            world.identities[slot] = new
            for name, owner in self.worlds.items():
                endpoint = self.endpoints.get(name)
                if owner is world and endpoint is not None and endpoint.contexts is not None:
                    endpoint.contexts[slot] = ctx
            self.replaced += 1
        except Exception as exc:  # the slot keeps its old identity
            print(f"fuzz: replacing {world.label} {slot} failed: {exc}", flush=True)
        finally:
            await trio.sleep(2)  # answers already in flight for the old one
            self.replacing.discard((world.label, slot))

    def anomaly(
        self, stats: FamilyStats, what: str, case: strategies.Case, extra: str = ""
    ) -> None:
        """Not a failed check, but worth a look: printed with a few inputs."""
        key = f"{stats.name}: {what}"
        self.anomaly_counts[key] += 1
        found = self.anomalies.setdefault(key, [])
        if len(found) < 4:
            found.append(case.describe(900) + (f" -> {extra}" if extra else ""))

    def _count(self, stats: FamilyStats, case: strategies.Case) -> None:
        stats.inputs += 1
        stats.kinds[case.kind.split("/")[0]] += 1
        self.total_inputs += 1

    def _record(self, stats: FamilyStats, case: strategies.Case, ex: Any) -> None:
        self._count(stats, case)
        if not ex.answers:
            stats.transport["no-answer"] += 1
            return
        for index, answer in enumerate(ex.answers):
            if answer.status is None:
                label = answer.error or "no-answer"
                stats.transport[label] += 1
                if index == 0 and case.complete and label == "no-answer-timeout":
                    self.fail(
                        "hang",
                        f"no answer within {COMPLETE_WAIT_S:.0f} s to a complete "
                        f"request on {case.endpoint} {case.path}",
                        case.describe(),
                    )
                elif index == 0 and label == "no-answer-close" and self._tls_refused(case):
                    stats.transport["tls-refused (a client certificate it does not take)"] += 1
                    stats.transport[label] -= 1
                elif index == 0 and case.complete:
                    self.anomaly(
                        stats, f"complete request, {label}", case, f"after {ex.elapsed:.1f} s"
                    )
                continue
            code = answer.code
            label = f"{answer.status} {code}" if code else str(answer.status)
            if answer.streamed:
                label += " (stream)"
            stats.answers[label] += 1
            if answer.status >= 500:
                documented = self._documented(case, answer)
                if documented:
                    stats.documented_5xx[f"{case.endpoint} {label}: {documented}"] += 1
                else:
                    stats.failures_5xx += 1
                    self.fail(
                        "5xx",
                        f"{case.endpoint} {case.path}: {answer.status} {code} "
                        f"{answer.message[:200]!r}",
                        case.describe(),
                        key=f"5xx|{case.family}|{answer.status}|{code}|{answer.message[:60]}",
                    )
        if ex.answers[0].status is not None and case.complete and len(stats.latencies) < 200_000:
            stats.latencies.append(ex.elapsed)
            if ex.elapsed > 5.0:
                first = ex.answers[0]
                self.anomaly(
                    stats,
                    "answered after more than 5 s",
                    case,
                    f"{first.status} {first.code} after {ex.elapsed:.1f} s",
                )

    @staticmethod
    def _tls_refused(case: strategies.Case) -> bool:
        """TLS 1.3 finishes the client's handshake before the server checks the client
        certificate: a refused one shows as a close before any answer."""
        if case.identity == "foreign":
            return True
        return case.endpoint == "relay" and case.identity not in (None, "relay")

    def _documented(self, case: strategies.Case, answer: Any) -> str | None:
        """Why a 5xx is a documented answer (None: it is a failure)."""
        if answer.status == 503 and case.path in HEALTH_PATHS:
            obj = answer.json()
            if isinstance(obj, dict) and obj.get("status") == "unavailable":
                return f"readyz: {obj.get('reason')}"
        if (
            answer.status == 503
            and answer.code == "UNAVAILABLE"
            and "retry-pushback-ms" in answer.headers
            and answer.message != "internal error"
        ):
            return f"pushback {answer.headers['retry-pushback-ms']} ms: {answer.message[:60]}"
        return None

    # --- checks -----------------------------------------------------------------

    async def check(self, note: str = "") -> None:
        async with self.lock:
            await self._check(note)

    async def _check(self, note: str) -> None:
        for rss in self.rss:
            kb = rss.sample()
            if kb < 0 or self.procs[rss.label].poll() is not None:
                self.fail(
                    "serve", f"the {rss.label} serve process is gone", key=f"gone|{rss.label}"
                )
        results = await self.control_check()
        for r in results:
            rec = CheckRecord(
                self.total_inputs,
                self.phase,
                r["target"],
                r.get("mint_s"),
                r.get("join_s"),
                r.get("wk_s"),
                r["errors"],
            )
            self.checks.append(rec)
            for what in ("join_s", "wk_s", "mint_s"):
                value = r.get(what)
                if value is not None and value > self.args.bound:
                    self.fail(
                        "control",
                        f"{r['target']} {what[:-2]} took {value:.3f} s "
                        f"(bound {self.args.bound} s){note}",
                        key=f"control|{r['target']}|{what}|{self.phase}",
                    )
            for err in r["errors"]:
                self.fail("control", f"{r['target']}: {err}{note}", key=f"control-err|{err[:40]}")
        for watch in self.logs:
            for record in watch.scan():
                self._traceback(watch, record)

    def _traceback(self, watch: LogWatch, record: str) -> None:
        first_line = record.splitlines()[0]
        m = re.search(r"from (?:\d+\.\d+\.\d+\.\d+|\[[^\]]*\]):(\d+)", first_line)
        on = re.search(r"handler failed on (\S+ \S+) from", first_line)
        case = self.ports.lookup(int(m.group(1)), on.group(1) if on else None) if m else None
        head = record.splitlines()[0][:200]
        last = [ln for ln in record.splitlines() if ln and not ln.startswith(" ")][-1][:200]
        self.fail(
            "traceback",
            f"{watch.label} log: {head} ... {last}",
            (case or "(no client port in the log line)") + "\n--- log ---\n" + record[-4000:],
            key=f"tb|{watch.label}|{last[:80]}",
        )

    async def control_check(self) -> list[dict[str, Any]]:
        proc = self.control
        await proc.stdin.send_all(b"check\n")
        with trio.move_on_after(120) as waited:
            while b"\n" not in self._control_buf:
                data = await proc.stdout.receive_some(65536)
                if not data:
                    break
                self._control_buf += data
        line, _, self._control_buf = self._control_buf.partition(b"\n")
        if waited.cancelled_caught or not line:
            self.fail("control", "the control client did not answer within 120 s", key="ctl-gone")
            return []
        out: list[dict[str, Any]] = json.loads(line)
        return out

    async def checker(self, done: trio.Event) -> None:
        next_at = self.total_inputs + self.args.check_every
        while not done.is_set():
            with trio.move_on_after(0.1):
                await done.wait()
            if self.total_inputs >= next_at:
                next_at = self.total_inputs + self.args.check_every
                await self.check()

    async def rss_sampler(self) -> None:
        while True:
            for rss in self.rss:
                rss.sample()
                rss.fds_peak = max(rss.fds_peak, attacks.fd_count(rss.pid))
            await trio.sleep(0.25)

    # --- a family -----------------------------------------------------------------

    async def family(
        self, name: str, strategy: st.SearchStrategy[strategies.Case], n: int, concurrency: int
    ) -> None:
        self.phase = name
        stats = self.stats.setdefault(name, FamilyStats(name))
        stats.started = time.monotonic()
        send, recv = trio.open_memory_channel[list[strategies.Case]](8)
        stop = threading.Event()
        print(f"--- {name}: {n} inputs, {concurrency} senders", flush=True)

        def emit(batch: list[strategies.Case]) -> None:
            trio.from_thread.run(send.send, batch)

        async def produce() -> None:
            async with send:
                try:
                    await trio.to_thread.run_sync(
                        generate, strategy, n, emit, stop, abandon_on_cancel=True
                    )
                finally:
                    stop.set()

        async def sender(channel: trio.MemoryReceiveChannel[list[strategies.Case]]) -> None:
            conns: dict[tuple[str, str | None], Conn] = {}
            async with channel:
                async for batch in channel:
                    for case in batch:
                        await self.send_case(case, conns)
            for conn in conns.values():
                await conn.aclose()

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            nursery.start_soon(self.checker, done)
            async with trio.open_nursery() as senders:
                for _ in range(concurrency):
                    senders.start_soon(sender, recv.clone())
                await recv.aclose()
            done.set()
        stats.ended = time.monotonic()
        for rss in self.rss:
            rss.by_phase[name] = rss.sample()
        await self.check(f" (end of {name})")
        print(
            f"    {name}: {stats.inputs} inputs in {stats.seconds:.1f} s "
            f"({stats.inputs / stats.seconds:.0f}/s); {dict(stats.answers.most_common(6))}",
            flush=True,
        )


class _Stop(BaseException):
    pass


def generate(
    strategy: st.SearchStrategy[strategies.Case],
    n: int,
    emit: Callable[[list[strategies.Case]], None],
    stop: threading.Event,
) -> None:
    """Draw ``n`` cases with hypothesis (generation only), ``emit`` them in batches."""
    produced = 0
    batch: list[strategies.Case] = []

    def flush() -> None:
        if batch:
            try:
                emit(list(batch))
            except (
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                trio.RunFinishedError,
                trio.Cancelled,
            ) as exc:
                stop.set()
                raise _Stop from exc
            batch.clear()

    while produced < n and not stop.is_set():
        examples = min(EXAMPLES_PER_RUN, max(1, math.ceil((n - produced) / DRAWS_PER_EXAMPLE)))

        @settings(
            max_examples=examples,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )
        @given(st.data())
        def run(data: st.DataObject) -> None:
            nonlocal produced
            for _ in range(DRAWS_PER_EXAMPLE):
                if stop.is_set():
                    raise _Stop
                case = data.draw(strategy)  # drawn even past n: the same draws every time
                if produced < n:
                    batch.append(case)
                    produced += 1
                if len(batch) >= BATCH:
                    flush()

        before = produced
        try:
            run()
        except _Stop:
            return
        except HypothesisException as exc:  # e.g. every example overran: draw again
            if produced == before:
                raise
            print(
                f"fuzz: hypothesis stopped a run early ({type(exc).__name__}: {str(exc)[:300]}); going on"
            )
    flush()


# --- setting up -------------------------------------------------------------------------


def tls_contexts(world: World, foreign: tuple[str, Any]) -> dict[str | None, Any]:
    out: dict[str | None, Any] = {None: client_context()}
    for name, ident in world.identities.items():
        ctx = client_context()
        load_chain(ctx, ident.chain, ident.key)
        out[name] = ctx
    ctx = client_context()
    load_chain(ctx, foreign[0], foreign[1])
    out["foreign"] = ctx
    return out


def start_main(tmp: Path, template: Path) -> tuple[ControlPlane, World]:
    """serve --role all on SQLite, with every attestor configured and downloads."""
    db_url = f"sqlite:///{tmp / 'store.db'}"
    store = open_store(db_url)
    store.migrate()
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        disc_site = str(tenancy.create_site(tx, root, "fuzz-disc")["id"])
        disc = str(tenancy.create_pool(tx, root, disc_site, "disc", "bcd", {})["id"])
        tpm = str(tenancy.create_pool(tx, root, disc_site, "tpm", "bcd", {})["id"])
    store.close()
    home = tmp / "cp"
    home.mkdir()
    downloads = write_downloads(tmp / "downloads")
    cp = ControlPlane.start(
        home,
        template,
        db_url,
        gateway_url="https://127.0.0.1:{port}",
        extra_args=[
            "--downloads",
            str(downloads),
            "--x509pop-ca",
            str(home / "pki" / "node-root-ca.crt"),
            "--discovery-pool",
            disc,
            "--tpm-pool",
            tpm,
            "--attestor-setting",
            "tpm.enrollment=true",
        ],
    )
    world = make_world("main", cp, {"disc": disc, "tpm": tpm}, {"disc": disc_site})
    return cp, world


def make_world(
    label: str,
    cp: ControlPlane,
    pools: dict[str, str],
    sites: dict[str, str],
    gateway_port: int | None = None,
) -> World:
    doc = cp.well_known()
    world = World(
        label=label,
        api_url=cp.api,
        gateway_port=gateway_port or cp.gateway_port,
        root_tenant=cp.root_tenant,
        credential=cp.root_credential_file.read_text().strip(),
        pins=cp.pins(),
        encryption_jwk=doc["join"]["encryptionJwk"],
        pools=dict(pools),
        sites=dict(sites),
    )
    for purpose in ("fuzz", "ctrl", "sac", *(p for p in ("disc", "tpm") if p not in pools)):
        site, pool = cp.site_and_pool()
        world.pools[purpose], world.sites[purpose] = pool, site
    world.other_tenant, other_file = cp.tenant("other")
    world.other_credential = other_file.read_text().strip()
    make_identities(world)
    return world


def control_target(world: World) -> dict[str, Any]:
    return {
        "label": world.label,
        "api": world.api_url,
        "tenant": world.root_tenant,
        "pool": world.pools["ctrl"],
        "credential": world.credential,
        "gateway_port": world.gateway_port,
        "serving_pin": world.pins["serving_ca_spki_pin"],
        "signing_pin": world.pins["join_signing_key_pin"],
        "encryption_jwk": world.encryption_jwk,
    }


def build_strategies(
    run: Run, main: World, fleet: World | None
) -> dict[str, st.SearchStrategy[strategies.Case]]:
    mat = strategies.Material(main)
    gw_ids: list[str | None] = [None, None, "node0", "foreign"]
    out: dict[str, st.SearchStrategy[strategies.Case]] = {
        "gw-join": strategies.gw_join(main, mat),
        "gw-renew": strategies.gw_renew(main, mat),
        "gw-session": strategies.gw_session(main, mat),
        "gw-vouch": strategies.gw_vouch(main, mat),
        "gw-raw": strategies.raw_framing(
            "gw-raw",
            "gw",
            [
                "/v1/join",
                "/v1/renew",
                "/v1/session",
                "/v1/discovery/vouch",
                "/healthz",
                "/readyz",
                "/nope",
            ],
            gw_ids,
        ),
        "api-raw": strategies.raw_framing(
            "api-raw",
            "api",
            [
                *strategies.STATIC_PATHS[:2],
                "/healthz",
                "/readyz",
                f"/api/compute/v1/tenants/{main.root_tenant}/nodes",
                f"/api/compute/v1/tenants/{main.root_tenant}/sites",
            ],
            [None],
        ),
        "api-tenant": strategies.api_tenant(main),
        "api-static": strategies.api_static(),
    }
    health_eps: list[tuple[str, list[str | None]]] = [("api", [None]), ("gw", [None, "node0"])]
    if fleet is not None:
        fmat = strategies.Material(fleet)
        health_eps += [("relay", [None, "relay"]), ("fgw", [None]), ("fapi", [None])]
        relay = strategies.relay(fleet, fmat)
        relay_raw = strategies.raw_framing(
            "relay",
            "relay",
            ["/v1/join", "/v1/renew", "/v1/discovery/vouch", "/readyz"],
            ["relay", None],
        )
        out["relay"] = mix([(8, relay), (2, relay_raw)])
        out["fleet-gw"] = mix(
            [
                (4, strategies.gw_join(fleet, fmat, "fgw", "fleet-gw")),
                (2, strategies.gw_renew(fleet, fmat, "fgw", "fleet-gw")),
                (1, strategies.gw_session(fleet, fmat, "fgw", "fleet-gw")),
                (1, strategies.gw_vouch(fleet, fmat, "fgw", "fleet-gw")),
                (
                    2,
                    strategies.raw_framing(
                        "fleet-gw", "fgw", ["/v1/join", "/v1/renew", "/v1/session"], [None]
                    ),
                ),
            ]
        )
    out["health"] = strategies.health(health_eps)
    return out


def mix(
    weighted: list[tuple[int, st.SearchStrategy[strategies.Case]]],
) -> st.SearchStrategy[strategies.Case]:
    table = [s for w, s in weighted for _ in range(w)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


@contextlib.contextmanager
def maybe_fleet(enabled: bool, tmp: Path, template: Path) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from tests.fleet import fleet

    with fleet(tmp / "fleet", template, apis=1, gateways=1) as f:
        yield f


# --- attacks ----------------------------------------------------------------------------


async def attack_phase(run: Run, main: World, cp_home: Path | None = None) -> None:
    args = run.args
    run.phase = "attack"
    print(
        f"--- attack: {args.idle} idle connections to the gateway and {args.idle // 2} to "
        f"the API, {args.slowloris} slowloris heads to each, from {args.attack_source}; "
        f"{args.sessions} sessions of one certificate; {args.attack_seconds:.0f} s",
        flush=True,
    )
    until = trio.current_time() + args.attack_seconds
    gw_idle, api_idle = attacks.FloodStats(), attacks.FloodStats()
    gw_slow, api_slow = attacks.FloodStats(), attacks.FloodStats()
    sessions = attacks.SessionStats()
    src = args.attack_source
    sess = main.identities["sess"]

    async def control_loop() -> None:
        while trio.current_time() < until:
            await run.check(" (under attack)")
            await trio.sleep(0.5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial_call(
                attacks.idle_flood,
                main.gateway_port,
                args.idle,
                gw_idle,
                source=src,
                reopen_s=2.0,
                until=until,
                start_s=1.0,
            )
        )
        nursery.start_soon(
            partial_call(
                attacks.idle_flood,
                main.api_port,
                args.idle // 2,
                api_idle,
                source=src,
                reopen_s=2.0,
                until=until,
                start_s=1.0,
            )
        )
        nursery.start_soon(
            partial_call(
                attacks.slowloris,
                run.endpoints["api"],
                args.slowloris,
                api_slow,
                source=src,
                until=until,
            )
        )
        nursery.start_soon(
            partial_call(
                attacks.slowloris,
                run.endpoints["gw"],
                args.slowloris,
                gw_slow,
                source=src,
                until=until,
            )
        )
        nursery.start_soon(
            partial_call(
                attacks.session_attack,
                run.endpoints["gw"],
                "sess",
                sess.node_id,
                args.sessions,
                20,
                sessions,
                until=until,
            )
        )
        nursery.start_soon(control_loop)
    for label, s in (
        ("gateway idle", gw_idle),
        ("API idle", api_idle),
        ("API slowloris", api_slow),
        ("gateway slowloris", gw_slow),
    ):
        held = f"held p50 {pct(s.held_s, 0.5):.1f} s, max {max(s.held_s, default=0):.1f} s"
        run.attack_report.append(
            f"{label}: opened {s.opened}, peak open {s.peak_open}, closed by the server "
            f"{s.closed_by_server} ({held}), connect failures {s.connect_failed}"
        )
    run.attack_report.append(
        f"sessions: {sessions.opened} opened, {sessions.ended_cleanly} ended cleanly by a newer "
        f"one, {sessions.ended_otherwise} ended otherwise, {sessions.still_open} still open at "
        f"the end, refused {sessions.refused}, errors {sessions.errors}"
    )
    if sessions.not_opened:
        run.attack_report.append(
            f"  {sessions.not_opened} sessions not opened: the last {attacks.SETTLE_S:.0f} s "
            "of the attack had begun"
        )
    if sessions.opened_at:
        ends = sessions.open_at_end
        run.attack_report.append(
            f"  sessions opened from {min(sessions.opened_at):.1f} s to "
            f"{max(sessions.opened_at):.1f} s into the attack"
            + (
                f"; those still open had opened at {min(ends):.1f}..{max(ends):.1f} s"
                if ends
                else ""
            )
        )
    log_text = (cp_home / "serve.log").read_text(errors="replace") if cp_home else ""
    run.attack_report.append(
        f"  serve log so far: {log_text.count(' open for ')} sessions opened, "
        f"{log_text.count('replaced by a newer one')} replaced, {log_text.count(' closed')} closed"
    )
    if sessions.still_open > 2:
        run.fail("sessions", f"{sessions.still_open} sessions of one certificate were open at once")
    main_rss = run.rss[0]
    run.attack_report.append(f"serve fds peak during the attack: {main_rss.fds_peak}")
    slow_held = [h for s in (gw_slow, api_slow) for h in s.held_s]
    if slow_held and max(slow_held) > 45:
        run.fail("slowloris", f"a slowloris head was held {max(slow_held):.0f} s")
    run.phase = "after attack"
    await trio.sleep(12)  # past the handshake and first-request timeouts
    fds = attacks.fd_count(main_rss.pid)
    run.attack_report.append(f"serve fds 12 s after the attack: {fds}")
    if fds > 400:
        run.fail("fds", f"the serve process still holds {fds} fds 12 s after the attack")


def partial_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    async def call() -> None:
        await fn(*args, **kwargs)

    return call


# --- the summary --------------------------------------------------------------------------


def summary(run: Run, wall_s: float) -> None:
    line = "=" * 118
    print("\n" + line)
    print(f"HTTP fuzz summary ({wall_s:.0f} s wall, {run.total_inputs} inputs)")
    print(line)
    print(
        f"{'family':<12} {'inputs':>8} {'secs':>7} {'in/s':>6} {'5xx':>5} {'5xx-doc':>7} "
        f"{'no-answer':>9} {'retry':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>9}"
    )
    for s in run.stats.values():
        noans = sum(s.transport.values())
        print(
            f"{s.name:<12} {s.inputs:>8} {s.seconds:>7.1f} {s.inputs / s.seconds:>6.0f} "
            f"{s.failures_5xx:>5} {sum(s.documented_5xx.values()):>7} {noans:>9} {s.retries:>5} "
            f"{pct(s.latencies, 0.5) * 1000:>8.1f} {pct(s.latencies, 0.99) * 1000:>8.1f} "
            f"{max(s.latencies, default=0) * 1000:>9.1f}"
        )
    print("\nstatuses seen (status code: count), and how answers were missing:")
    for s in run.stats.values():
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(s.answers.items()))
        print(f"  {s.name}: {shown}")
        if s.transport:
            print(
                f"  {'':<{len(s.name)}}  no answer: "
                + ", ".join(f"{k}: {v}" for k, v in s.transport.most_common())
            )
        for k, v in s.documented_5xx.items():
            print(f"  {'':<{len(s.name)}}  documented 5xx: {k}: {v}")
        kinds = ", ".join(f"{k}: {v}" for k, v in s.kinds.most_common(12))
        print(f"  {'':<{len(s.name)}}  inputs by kind: {kinds}")
    print("\ncontrol checks (mint a token, join through the gateway, GET the well-known document):")
    for target in sorted({c.target for c in run.checks}):
        mine = [c for c in run.checks if c.target == target]
        over = sum(
            1
            for c in mine
            for v in (c.mint_s, c.join_s, c.wk_s)
            if v is not None and v > run.args.bound
        )
        errs = sum(1 for c in mine if c.errors)
        print(
            f"  {target}: {len(mine)} checks ({sum(1 for c in mine if c.phase == 'attack')} under "
            f"attack), {over} calls over {run.args.bound} s, {errs} with errors"
        )
        for what in ("join_s", "wk_s", "mint_s"):
            vals = [getattr(c, what) for c in mine if getattr(c, what) is not None]
            if vals:
                print(
                    f"    {what[:-2]:<5} p50 {pct(vals, 0.5) * 1000:7.1f} ms  p99 "
                    f"{pct(vals, 0.99) * 1000:7.1f} ms  max {max(vals) * 1000:7.1f} ms"
                )
        attack = [c for c in mine if c.phase == "attack"]
        for what in ("join_s", "wk_s"):
            vals = [getattr(c, what) for c in attack if getattr(c, what) is not None]
            if vals:
                print(
                    f"    {what[:-2]:<5} under attack: p50 {pct(vals, 0.5) * 1000:7.1f} ms  "
                    f"max {max(vals) * 1000:7.1f} ms"
                )
    print("\nserve logs:")
    for w in run.logs:
        levels = ", ".join(f"{k} {v}" for k, v in sorted(w.levels.items()))
        print(f"  {w.label}: {w.tracebacks} tracebacks; lines by level: {levels}")
        for key, samples in sorted(w.samples.items(), key=lambda kv: -len(kv[1]))[:12]:
            print(f"    {len(samples):>6} x {key}")
    print("\nRSS (VmRSS) and open fds of the serve processes:")
    for r in run.rss:
        phases = ", ".join(f"{k} {v / 1024:.0f}" for k, v in r.by_phase.items())
        print(
            f"  {r.label}: start {r.start_kb / 1024:.1f} MiB, peak {r.peak_kb / 1024:.1f} MiB, "
            f"end {r.end_kb / 1024:.1f} MiB (limit {run.args.rss_limit_mb} MiB); fds peak "
            f"{r.fds_peak}"
        )
        print(f"    after each family (MiB): {phases}")
    if run.anomaly_counts:
        print("\nanomalies (not failed checks; the first inputs of each):")
        for key, count in run.anomaly_counts.most_common():
            print(f"  {count:>6} x {key}")
            for example in run.anomalies[key][:2]:
                print(f"           {example[:600]}")
    if run.replaced:
        print(f"\nrenewal and site-agent slots refilled with a newly joined node: {run.replaced}")
    if run.attack_report:
        print("\nattacks:")
        for item in run.attack_report:
            print(f"  {item}")
    print(f"\nfailures: {sum(run.failure_keys.values())} ({len(run.failure_keys)} distinct)")
    by_check = collections.Counter(f.split("|")[0] for f in run.failure_keys.elements())
    for check, count in by_check.most_common():
        print(f"  {check}: {count}")
    for f in run.failures[:40]:
        print(f"  - [{f.check}] {f.detail[:400]}")
        if f.case:
            print("      " + f.case[:1200].replace("\n", "\n      "))
    print(line)


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--per-family", type=int, default=100_000, help="inputs per family (default 100000)"
    )
    p.add_argument("--concurrency", type=int, default=12, help="senders per family (default 12)")
    p.add_argument(
        "--families", help="comma list (default: all; with --fleet also relay, fleet-gw)"
    )
    p.add_argument(
        "--fleet", action="store_true", help="also --role api + --role gateway on PostgreSQL"
    )
    p.add_argument("--check-every", type=int, default=1_000, help="inputs between checks")
    p.add_argument("--bound", type=float, default=1.0, help="control-check bound in seconds")
    p.add_argument("--rss-limit-mb", type=int, default=512)
    p.add_argument("--attack-seconds", type=float, default=30.0, help="0: no attack phase")
    p.add_argument("--idle", type=int, default=3_000, help="idle connections to the gateway")
    p.add_argument("--slowloris", type=int, default=200)
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--attack-source", default="127.0.0.2")
    p.add_argument("--report", help="write the failures and counts as JSON here")
    p.add_argument(
        "--generate-only", action="store_true", help="draw the inputs, send none (timing)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    names = (
        args.families.split(",")
        if args.families
        else FAMILIES + (FLEET_FAMILIES if args.fleet else [])
    )
    tmp = Path(tempfile.mkdtemp(prefix="bcd-fuzz-"))
    print(f"fuzz: working in {tmp}; RLIMIT_NOFILE {soft} -> {hard}", flush=True)
    run = Run(args)
    started = time.monotonic()
    try:
        template = tmp / "template"
        template.mkdir()
        make_pki(template)
        cp, main_world = start_main(tmp, template)
        try:
            with maybe_fleet(args.fleet, tmp, template) as fleet:
                fleet_world = None
                if fleet is not None:
                    fleet_world = make_world(
                        "fleet", fleet.api, {}, {}, gateway_port=fleet.gateways[0].port
                    )
                    fleet_world.relay_port = int(fleet.api.ready["relay_port"])
                code = trio.run(drive, run, cp, main_world, fleet, fleet_world, names, tmp)
        finally:
            cp.stop()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    summary(run, time.monotonic() - started)
    if args.report:
        report = {
            "inputs": {s.name: s.inputs for s in run.stats.values()},
            "answers": {s.name: dict(s.answers) for s in run.stats.values()},
            "failures": [f.__dict__ for f in run.failures],
            "failure_counts": dict(run.failure_keys),
        }
        Path(args.report).write_text(json.dumps(report, indent=1))
    return code


async def drive(
    run: Run,
    cp: ControlPlane,
    main: World,
    fleet: Any,
    fleet_world: World | None,
    names: list[str],
    tmp: Path,
) -> int:
    args = run.args
    foreign = foreign_identity()
    run.endpoints["gw"] = Endpoint(
        "gw", "127.0.0.1", main.gateway_port, tls_contexts(main, foreign)
    )
    run.endpoints["api"] = Endpoint("api", "127.0.0.1", main.api_port)
    run.worlds.update(gw=main, api=main)
    run.logs.append(LogWatch("main", cp.home / "serve.log"))
    run.rss.append(Rss("main", cp.proc.pid))
    run.procs["main"] = cp.proc
    targets = [control_target(main)]
    if fleet is not None and fleet_world is not None:
        bundle = gatewaypki.load_bundle(fleet.bundle)
        relay_ctx = client_context()
        load_chain(relay_ctx, bundle.relay_chain_pem, bundle.relay_key)
        contexts = tls_contexts(fleet_world, foreign)
        run.endpoints["fgw"] = Endpoint("fgw", "127.0.0.1", fleet_world.gateway_port, contexts)
        run.endpoints["relay"] = Endpoint(
            "relay", "127.0.0.1", int(fleet_world.relay_port or 0), {**contexts, "relay": relay_ctx}
        )
        run.endpoints["fapi"] = Endpoint("fapi", "127.0.0.1", fleet_world.api_port)
        run.worlds.update(fgw=fleet_world, relay=fleet_world, fapi=fleet_world)
        run.logs += [
            LogWatch("fleet-api", fleet.api.home / "serve.log"),
            LogWatch("fleet-gw", fleet.gateways[0].home / "serve.log"),
        ]
        run.rss += [
            Rss("fleet-api", fleet.api.proc.pid),
            Rss("fleet-gw", fleet.gateways[0].proc.pid),
        ]
        run.procs["fleet-api"], run.procs["fleet-gw"] = fleet.api.proc, fleet.gateways[0].proc
        targets.append(control_target(fleet_world))
    config = tmp / "control.json"
    config.write_text(json.dumps({"targets": targets}))
    strategies_by_name = build_strategies(run, main, fleet_world)
    unknown = [n for n in names if n not in strategies_by_name]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(strategies_by_name)}")
    async with trio.open_nursery() as nursery:
        run.nursery = nursery
        run.control = await trio.lowlevel.open_process(
            [sys.executable, str(ROOT / "fuzz" / "control_client.py"), str(config)],
            stdin=-1,
            stdout=-1,
            cwd=str(ROOT),
        )
        nursery.start_soon(run.rss_sampler)
        for rss in run.rss:
            rss.start_kb = rss.sample()
        await run.check(" (before fuzzing)")
        for name in names:
            concurrency = args.concurrency * (3 if name.endswith("raw") else 1)
            await run.family(name, strategies_by_name[name], args.per_family, concurrency)
        if args.attack_seconds > 0:
            await attack_phase(run, main, cp.home)
        run.phase = "end"
        await run.check(" (at the end)")
        for watch in run.logs:
            for record in watch.scan(final=True):
                run._traceback(watch, record)
        for rss in run.rss:
            rss.sample()
            if rss.peak_kb > args.rss_limit_mb * 1024:
                run.fail(
                    "rss",
                    f"{rss.label} serve peaked at {rss.peak_kb / 1024:.0f} MiB "
                    f"(limit {args.rss_limit_mb} MiB)",
                )
        with contextlib.suppress(OSError):
            await run.control.stdin.aclose()
        with trio.move_on_after(5):
            await run.control.wait()
        if run.control.returncode is None:
            run.control.kill()
        nursery.cancel_scope.cancel()
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
