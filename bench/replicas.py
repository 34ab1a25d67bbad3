"""Joins, renewals and revocations through the fleet shape: an API replica and
gateways as separate processes on one PostgreSQL.

Run from the repository root::

    .venv/bin/python bench/replicas.py [--joins N] [--nodes N] [--concurrency C]
                                       [--interval-ms MS]

It prints figures and judges nothing; it is not part of the test suite. It shares
its helpers with ``bench/join.py`` and ``bench/renew.py`` (``bench/common.py``,
``bench.renew``) and starts the fleet with the test harness's pieces
(``tests/fleet.py``).

The fleet: PostgreSQL at ``BCD_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/test``), a fresh schema dropped afterwards;
one API replica (``better-compute serve --role api --relay-listen``, holding the
PKI) and two gateways (``serve --role gateway --gateway-dir BUNDLE --api-upstream``
the replica's relay, logged in to PostgreSQL as a member of the read-only gateway
role), each a real process started as ``tests/fleet.py`` starts them. Every
process connects with its own ``application_name``, so the CPU of its PostgreSQL
backends can be read apart. One API replica only: a gateway's relay sends every
call to the last upstream that answered (failover, not load balancing), so more
replicas would not share the load.

What it measures:

1. **Joins/s through 1 gateway and through 2.** N joins (``--joins``, default 200)
   per run, driven from this process with C concurrent trio tasks (default 16),
   with bcd's own client pieces as ``bench/join.py`` drives them
   (``bench.common.join_once``: ``bcd.gatewayclient.GatewayClient`` over ``bcd.transport.pinned_transport``,
   one TLS connection per join). The bodies are built as ``bcd.join`` builds them
   before the clock starts. Through 2 gateways, join i goes to gateway i mod 2 (a
   round-robin load balancer). The joins use C join tokens (join i uses token
   i mod C): JoinService locks a token's row for the whole join, so joins on one
   token are serial by design and one token would measure that lock, not the
   processes. A few warm-up joins and renewals through each gateway come first.
   Every answer is verified as bcd verifies it (``bcd.join.verify_joined``) and the
   nodes are counted in the database.

2. **Renewals/s through 1 gateway and through 2.** Each node joined in (1) renews
   once (the gateway allows 6 per node and hour, so many nodes renew once rather
   than few many times): the nodes of the 1-gateway join run through gateway 1,
   those of the 2-gateway run through gateway i mod 2; C at a time, one mutual-TLS
   connection per renewal as ``bench/renew.py`` makes it
   (``bench.renew.renew_next``), requests pre-built before the clock starts, every
   answer verified afterwards (``bcd.renew.verify_renewed``), counted in the
   database.

   For (1) and (2), ``CPU ms/op`` per role is its process's utime + stime
   (``/proc/<pid>/stat``, all threads) over the run divided by the operations; the
   PostgreSQL backends of each process, and this bench client, are printed apart.
   ``busy`` is CPU time over wall time: how many cores the process kept busy. The
   crypto floor of one join and of one renewal (``bench.join.crypto_floor``,
   ``bench.renew.renew_floor``: the unavoidable server-side cryptography, timed
   in-process; their breakdown is printed by those benches) is printed with the
   ratio of the role processes' summed CPU to it.

3. **Revocation latency across gateways.** ``--nodes`` nodes (default 200: the
   renewed nodes of (2), more joined if needed) each open a session from this
   process, node i on gateway i mod 2, as ``bcd.session`` opens it: ``POST
   /v1/session`` over mutual TLS with the node's current certificate, the NDJSON
   stream read with ``bcd.gatewayclient.GatewayClient.stream_lines``. Once every session has had its
   welcome, the nodes are revoked one after another through the API replica
   (``control.client.ApiClient``, ``POST /api/compute/v1/tenants/{t}/nodes/{id}/
   revoke-identity``, what ``better-compute nodes revoke-identity`` calls), one
   call started every ``--interval-ms`` (default 20 ms; later if the previous call
   took longer). The API replica pokes no gateway: the revocation reaches a gateway
   by PostgreSQL ``NOTIFY bc_revoked`` at the commit (``control.revocations``), or
   else by its revocation poll every second. The latency is from the revoke call's
   **return** to the moment this process read that node's ``{"type":"revocation"}``
   line; it is printed also from the call's start (it can be negative from the
   return: the notice can beat the HTTP answer). It covers the commit's
   notification, the gateway's poll query, the push on the stream and this
   process's trio loop reading it; all 200 sessions and the revoking thread share
   this one process.

Keep a run within a few minutes: sealed tokens are refused 5 minutes after they
are built and renewal proofs after 60 s (both are built right before their run).
``/proc`` counts CPU in clock ticks (10 ms): CPU per operation is exact to about
1% only from a few hundred operations on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import trio  # noqa: E402

from bcd import __version__, pki, wire  # noqa: E402
from bcd.errors import BcdError  # noqa: E402
from bcd.gatewayclient import GatewayClient  # noqa: E402
from bcd.identity import LoadedState  # noqa: E402
from bcd.issued import issued_identity  # noqa: E402
from bcd.join import verify_joined  # noqa: E402
from bcd.keys.file import key_to_pem  # noqa: E402
from bcd.transport import pinned_transport  # noqa: E402
from bench.common import (  # noqa: E402
    PG_URL,
    SERVER_NAME,
    Outcome,
    Prepared,
    build_bodies,
    count_failures,
    join_once,
    pg_backends_cpu_s,
    print_environment,
    proc_cpu_s,
    serving_anchor,
)
from bench.join import crypto_floor  # noqa: E402
from bench.renew import (  # noqa: E402
    Member,
    prepare_steps,
    renew_floor,
    renew_next,
    verified_renewals,
)
from control import pki as cpki  # noqa: E402
from control.errors import ControlError  # noqa: E402
from control.gateway import REVOCATION_POLL_S  # noqa: E402
from tests.e2e import SECRET, make_pki  # noqa: E402
from tests.fleet import (  # noqa: E402
    Fleet,
    gateway_login,
    issue_bundle,
    pg_schema,
    pg_schema_url,
    relay_url,
    start_api,
)

WARMUP_PER_GATEWAY = 4
OPEN_TIMEOUT_S = 60.0
ARRIVAL_TIMEOUT_S = 15.0  # after the last revoke call: a notice later than this is lost


# --- the fleet ------------------------------------------------------------------------


@dataclass
class Roles:
    """The fleet and, per role process, its pid and its PostgreSQL application_name."""

    fleet: Fleet
    pids: dict[str, int]
    apps: dict[str, str]

    @property
    def gateway_ports(self) -> list[int]:
        return [gw.port for gw in self.fleet.gateways]


@contextlib.contextmanager
def bench_fleet(
    root: Path,
    template: Path,
    gateways: int,
    *,
    api_extra: Sequence[str] = (),
    gateway_extra: Sequence[str] = (),
) -> Iterator[Roles]:
    """``tests.fleet.fleet`` with an application_name per process (one API replica);
    ``api_extra`` and ``gateway_extra`` are more ``serve`` flags for those roles."""
    tag = f"bcdbench_{secrets.token_hex(4)}"
    apps = {"api": f"{tag}_api", **{f"gw{i + 1}": f"{tag}_gw{i + 1}" for i in range(gateways)}}
    with pg_schema() as schema:
        api_url = f"{pg_schema_url(schema)}&application_name={apps['api']}"
        api = start_api(root / "api1", template, api_url, api_extra)
        f: Fleet | None = None
        try:
            bundle = issue_bundle(api.home, root / "gateway-bundle")
            f = Fleet(root, schema, [api], [], gateway_login(schema), bundle)
            for i in range(gateways):
                name = f"gw{i + 1}"
                f.add_gateway(
                    name,
                    [relay_url(api)],
                    db_url=f"{f.gateway_db_url}&application_name={apps[name]}",
                    extra=gateway_extra,
                )
            pids = {
                "api": api.proc.pid,
                **{f"gw{i + 1}": g.proc.pid for i, g in enumerate(f.gateways)},
            }
            yield Roles(f, pids, apps)
        finally:
            if f is not None:
                f.stop()
            else:
                api.stop()


# --- CPU accounting -----------------------------------------------------------------


@dataclass
class Spent:
    """CPU seconds over one run: role processes, their PostgreSQL backends, the bench."""

    wall_s: float
    procs: dict[str, float]
    pg: dict[str, float | None]
    client_s: float


class Meter:
    def __init__(self, roles: Roles) -> None:
        self.roles = roles
        self._procs: dict[str, float] = {}
        self._pg: dict[str, dict[int, float] | None] = {}
        self._client = 0.0
        self._wall = 0.0

    def start(self) -> None:
        self._pg = {k: pg_backends_cpu_s(app) for k, app in self.roles.apps.items()}
        self._procs = {k: proc_cpu_s(pid) for k, pid in self.roles.pids.items()}
        self._client = time.process_time()
        self._wall = time.perf_counter()

    def stop(self, wall_s: float | None = None) -> Spent:
        wall = time.perf_counter() - self._wall
        client = time.process_time() - self._client
        procs = {k: proc_cpu_s(pid) - self._procs[k] for k, pid in self.roles.pids.items()}
        pg: dict[str, float | None] = {}
        for k, app in self.roles.apps.items():
            before, after = self._pg[k], pg_backends_cpu_s(app)
            pg[k] = (
                None
                if before is None or after is None
                else sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
            )
        return Spent(wall_s if wall_s is not None else wall, procs, pg, client)


# --- joins --------------------------------------------------------------------------


def build_join_bodies(roles: Roles, pool: str, n: int, tokens: int, seed: int) -> list[Prepared]:
    """N join bodies as bcd.join builds them; body i carries token i mod ``tokens``."""
    api = roles.fleet.api
    encryption_key = wire.public_key_of_jwk(api.well_known()["join"]["encryptionJwk"])
    tokens = max(1, min(tokens, n))
    per_token: list[list[Prepared]] = []
    for k in range(tokens):
        uses = len(range(k, n, tokens))
        token = api.token(pool, maxUses=uses)["token"]
        per_token.append(build_bodies(uses, token, encryption_key, seed * 1000 + k))
    return [per_token[i % tokens][i // tokens] for i in range(n)]


async def drive_joins(
    ports: list[int], pin: str, bodies: list[Prepared], concurrency: int
) -> tuple[list[Outcome], float]:
    """Every join, ``concurrency`` at a time, join i through ``ports[i % len(ports)]``."""
    outcomes = [Outcome() for _ in bodies]
    indexes = iter(range(len(bodies)))

    async def worker() -> None:
        for i in indexes:  # shared: each index is taken by exactly one task
            outcomes[i] = await join_once(ports[i % len(ports)], pin, bodies[i].body)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return outcomes, time.perf_counter() - start


def members_of(
    bodies: list[Prepared], outcomes: list[Outcome], signing_pin: str, site: str
) -> list[Member]:
    """The verified joins as ``bench.renew`` holds a node: key and chain in memory."""
    members = []
    for prepared, outcome in zip(bodies, outcomes, strict=True):
        if outcome.status != 200:
            continue
        body = verify_joined(
            outcome.body.decode("ascii"),
            signing_pin=signing_pin,
            csr_der=prepared.csr_der,
            key=prepared.key.public_key(),
            role="node",
        )
        if not isinstance(body, wire.Issued) or body.kind != "joined" or body.site_id != site:
            continue
        identity = issued_identity(body, "file")
        leaf = identity.leaf()
        state = LoadedState(Path("."), identity, prepared.key, leaf, pki.leaf_info(leaf))
        members.append(Member(state, key_to_pem(prepared.key), identity.chain))
    return members


async def drive_renewals(
    ports: list[int], pin: str, members: list[Member], concurrency: int
) -> float:
    """Each member's next pre-built renewal, member i through ``ports[i % len(ports)]``."""
    indexes = iter(range(len(members)))

    async def worker() -> None:
        for i in indexes:
            await renew_next(ports[i % len(ports)], pin, members[i])

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - start


@dataclass
class Run:
    what: str  # "join" or "renewal"
    gateways: int
    ops: int
    ok: int
    verified: int
    in_db: int
    spent: Spent
    failures: dict[str, int]

    @property
    def per_s(self) -> float:
        return self.ops / self.spent.wall_s


@dataclass
class Context:
    roles: Roles
    site: str
    pool: str
    serving_pin: str
    signing_pin: str
    concurrency: int
    seed: int = 10

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def count(self, sql: str) -> int:
        row = self.roles.fleet.api.one(sql)
        return int(row["n"]) if row else -1


def join_run(
    ctx: Context, ports: list[int], n: int, *, measured: bool = True
) -> tuple[Run, list[Member]]:
    bodies = build_join_bodies(ctx.roles, ctx.pool, n, ctx.concurrency, ctx.next_seed())
    nodes_before = ctx.count("SELECT COUNT(*) AS n FROM nodes")
    meter = Meter(ctx.roles)
    if measured:
        meter.start()
    outcomes, wall = trio.run(drive_joins, ports, ctx.serving_pin, bodies, ctx.concurrency)
    spent = meter.stop(wall) if measured else Spent(wall, {}, {}, 0.0)
    members = members_of(bodies, outcomes, ctx.signing_pin, ctx.site)
    run = Run(
        "join",
        len(ports),
        n,
        sum(1 for o in outcomes if o.status == 200),
        len(members),
        ctx.count("SELECT COUNT(*) AS n FROM nodes") - nodes_before,
        spent,
        count_failures(outcomes),
    )
    return run, members


def renew_run(ctx: Context, ports: list[int], members: list[Member]) -> Run:
    prepare_steps(members, 1)
    before = ctx.count("SELECT COUNT(*) AS n FROM renewals")
    meter = Meter(ctx.roles)
    meter.start()
    wall = trio.run(drive_renewals, ports, ctx.serving_pin, members, ctx.concurrency)
    spent = meter.stop(wall)
    outcomes = [m.outcomes[-1] for m in members if m.outcomes]
    return Run(
        "renewal",
        len(ports),
        len(outcomes),
        sum(1 for o in outcomes if o.status == 200),
        verified_renewals(members, ctx.signing_pin),
        ctx.count("SELECT COUNT(*) AS n FROM renewals") - before,
        spent,
        count_failures(outcomes),
    )


def warm_up(ctx: Context) -> None:
    """A few joins and renewals through each gateway (imports, connections, relay)."""
    ports = ctx.roles.gateway_ports
    run, members = join_run(ctx, ports, WARMUP_PER_GATEWAY * len(ports), measured=False)
    if run.failures or len(members) != run.ops:
        raise RuntimeError(f"warm-up joins failed: {run.failures}")
    prepare_steps(members, 1)
    trio.run(drive_renewals, ports[::-1], ctx.serving_pin, members, ctx.concurrency)
    failed = count_failures([m.outcomes[-1] for m in members])
    if failed:
        raise RuntimeError(f"warm-up renewals failed: {failed}")


# --- revocation latency ---------------------------------------------------------------


@dataclass
class Session:
    member: Member = field(repr=False)
    gateway: int
    welcomed: bool = False
    call_start: float | None = None
    call_end: float | None = None
    arrived: float | None = None
    error: str | None = None

    @property
    def call_s(self) -> float:
        assert self.call_start is not None
        assert self.call_end is not None
        return self.call_end - self.call_start

    def latency_s(self, since: str) -> float:
        """From the revoke call's ``end`` (its return) or ``start`` to the arrival."""
        ref = self.call_end if since == "end" else self.call_start
        assert self.arrived is not None
        assert ref is not None
        return self.arrived - ref


async def hold_session(
    s: Session,
    port: int,
    pin: str,
    opening: trio.Semaphore,
    opened: trio.Event,
    finished: trio.Event,
) -> None:
    """One session as bcd.session opens it; note when its revocation line arrives."""
    member = s.member
    hello = wire.Hello(
        node_id=member.node_id,
        journal_id=str(uuid.uuid4()),
        boot_id=str(uuid.uuid4()),
        daemon_version=__version__,
    )
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            opening.release()
            opened.set()

    await opening.acquire()
    try:
        anchor = await serving_anchor(port, pin)
        transport = pinned_transport(SERVER_NAME, anchor, (member.chain, member.key_pem))
        client = GatewayClient(transport, host=SERVER_NAME, port=port, server_name=SERVER_NAME)
        try:
            async with client.stream_lines(
                "POST", "/v1/session", wire.dumps(hello.to_json()), idle_timeout=None
            ) as lines:
                status = lines.status
                if status != 200:
                    first = b"".join([line async for line in lines])
                    s.error = f"session refused: HTTP {status}: {first[:120]!r}"
                    return
                async for line in lines:
                    msg = json.loads(line)
                    kind = msg.get("type") if isinstance(msg, dict) else None
                    if kind == "welcome":
                        s.welcomed = True
                        release()
                    elif kind == "revocation":
                        s.arrived = time.perf_counter()
                        return
                s.error = "the stream ended without a revocation"
        finally:
            await client.aclose()
    except BcdError as exc:
        s.error = f"session: {exc}"
    finally:
        release()
        finished.set()


@dataclass
class Latency:
    sessions: list[Session]
    open_wall_s: float
    open_spent: Spent
    revoke_spent: Spent
    interval_s: float
    calls_wall_s: float

    def arrived(self) -> list[Session]:
        return [s for s in self.sessions if s.arrived is not None and s.call_end is not None]


async def revocation_trial(
    ctx: Context, sessions: list[Session], interval_s: float
) -> tuple[float, Spent, Spent, float]:
    roles = ctx.roles
    api = roles.fleet.api
    client = api.client()
    ports = roles.gateway_ports
    opening = trio.Semaphore(ctx.concurrency)
    opened = [trio.Event() for _ in sessions]
    finished = [trio.Event() for _ in sessions]
    meter = Meter(roles)
    async with trio.open_nursery() as nursery:
        meter.start()
        start = time.perf_counter()
        for s, ev, fin in zip(sessions, opened, finished, strict=True):
            nursery.start_soon(hold_session, s, ports[s.gateway], ctx.serving_pin, opening, ev, fin)
        with trio.move_on_after(OPEN_TIMEOUT_S):
            for ev in opened:
                await ev.wait()
        open_wall = time.perf_counter() - start
        open_spent = meter.stop(open_wall)
        for s in sessions:
            if not s.welcomed and s.error is None:
                s.error = "no welcome within the timeout"

        meter.start()
        t0 = trio.current_time()
        calls_start = time.perf_counter()
        for i, s in enumerate(sessions):
            if not s.welcomed:
                continue
            await trio.sleep_until(t0 + i * interval_s)
            path = f"/v1/tenants/{api.root_tenant}/nodes/{s.member.node_id}/revoke-identity"
            s.call_start = time.perf_counter()
            try:
                await trio.to_thread.run_sync(client.call, "POST", path, {"reason": "bench"})
            except ControlError as exc:
                s.error = f"revokeIdentity failed: {exc.code}: {exc}"
                continue
            s.call_end = time.perf_counter()
        calls_wall = time.perf_counter() - calls_start
        with trio.move_on_after(ARRIVAL_TIMEOUT_S):
            for s, ev in zip(sessions, finished, strict=True):
                if s.call_end is not None:
                    await ev.wait()
        revoke_spent = meter.stop()
        nursery.cancel_scope.cancel()
    for s in sessions:
        if s.welcomed and s.error is None and s.arrived is None:
            s.error = f"no revocation line within {ARRIVAL_TIMEOUT_S:g} s of the last call"
    return open_wall, open_spent, revoke_spent, calls_wall


def latency_run(ctx: Context, members: list[Member], interval_s: float) -> Latency:
    n_gw = len(ctx.roles.gateway_ports)
    sessions = [Session(m, i % n_gw) for i, m in enumerate(members)]
    open_wall, open_spent, revoke_spent, calls_wall = trio.run(
        revocation_trial, ctx, sessions, interval_s
    )
    return Latency(sessions, open_wall, open_spent, revoke_spent, interval_s, calls_wall)


# --- output -------------------------------------------------------------------------


def pct(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted samples, nearest rank."""
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def print_spent(spent: Spent, ops: int, unit: str) -> None:
    rows: list[tuple[str, float]] = [(f"{k} process", v) for k, v in spent.procs.items()]
    rows += [(f"{k}'s postgres backends", v) for k, v in spent.pg.items() if v is not None]
    rows.append(("bench client", spent.client_s))
    for what, cpu in rows:
        print(
            f"  {what + ' CPU:':<30} {cpu * 1000 / max(ops, 1):8.3f} ms/{unit}, "
            f"busy {cpu / spent.wall_s:.2f} cores"
        )


def print_run(run: Run) -> None:
    gws = "1 gateway" if run.gateways == 1 else f"{run.gateways} gateways"
    table = "nodes" if run.what == "join" else "renewals"
    print(
        f"\n[{run.what}s through {gws}] {run.ops} {run.what}s in {run.spent.wall_s:.2f} s, "
        f"{run.ok} answered 200, {run.verified} verified, {run.in_db} new rows in {table}"
    )
    print_spent(run.spent, run.ops, run.what)
    for what, count in run.failures.items():
        print(f"  FAILED x{count}: {what}")


def print_table(runs: list[Run], floor_ms: float, concurrency: int) -> None:
    what = runs[0].what
    roles = list(runs[0].spent.procs)
    print(f"\n{what.capitalize()}s ({concurrency} concurrent clients, one connection each):")
    head = f"{'gateways':>8} {what + 's':>9} {'wall s':>7} {what + 's/s':>11} " + " ".join(
        f"{r + ' ms':>9}" for r in roles
    )
    head += f" {'pg ms':>7} {'floor ms':>9} {'roles/floor':>12}"
    print(head)
    print("-" * len(head))
    for r in runs:
        per = [r.spent.procs[k] * 1000 / r.ops for k in roles]
        pg = [v for v in r.spent.pg.values() if v is not None]
        pg_ms = f"{sum(pg) * 1000 / r.ops:7.3f}" if pg else f"{'-':>7}"
        print(
            f"{r.gateways:>8} {r.ops:>9} {r.spent.wall_s:>7.2f} {r.per_s:>11.1f} "
            + " ".join(f"{v:>9.3f}" for v in per)
            + f" {pg_ms} {floor_ms:>9.3f} {sum(per) / floor_ms:>12.1f}"
        )
    print(
        f"(ms = CPU ms per {what} of each role process; pg = all their PostgreSQL "
        f"backends; roles/floor = the role processes' sum over the crypto floor)"
    )


def print_latency(lat: Latency) -> None:
    n_gw = max((s.gateway for s in lat.sessions), default=0) + 1
    print(
        f"\n[revocation latency across gateways] {len(lat.sessions)} sessions over "
        f"{n_gw} gateways, opened in {lat.open_wall_s:.2f} s "
        f"({sum(s.welcomed for s in lat.sessions)} welcomed)"
    )
    print_spent(lat.open_spent, len(lat.sessions), "session")
    called = [s for s in lat.sessions if s.call_end is not None]
    print(
        f"  {len(called)} revokeIdentity calls through the API replica, one started every "
        f"{lat.interval_s * 1000:g} ms (or when the previous returned): "
        f"{lat.calls_wall_s:.2f} s in all"
    )
    if called:
        calls = sorted(s.call_s for s in called)
        print(
            f"  the call itself: p50 {pct(calls, 0.5) * 1000:.1f} ms, "
            f"p99 {pct(calls, 0.99) * 1000:.1f} ms, max {calls[-1] * 1000:.1f} ms"
        )
    print_spent(lat.revoke_spent, len(called), "revocation")
    got = lat.arrived()
    print(
        f"  revocation lines arrived: {len(got)} of {len(called)} revoked sessions "
        f"(gateway poll fallback every {REVOCATION_POLL_S:g} s; PostgreSQL NOTIFY otherwise)"
    )
    if got:
        for label, ref in (("from the call's return", "end"), ("from the call's start", "start")):
            samples = sorted(s.latency_s(ref) for s in got)
            print(
                f"  latency {label + ':':<24} p50 {pct(samples, 0.5) * 1000:7.1f} ms, "
                f"p99 {pct(samples, 0.99) * 1000:7.1f} ms, max {samples[-1] * 1000:7.1f} ms, "
                f"min {samples[0] * 1000:7.1f} ms, mean {statistics.fmean(samples) * 1000:.1f} ms"
            )
        for g in range(n_gw):
            mine = sorted(s.latency_s("end") for s in got if s.gateway == g)
            if mine:
                print(
                    f"    via gw{g + 1} ({len(mine)}): p50 {pct(mine, 0.5) * 1000:.1f} ms, "
                    f"p99 {pct(mine, 0.99) * 1000:.1f} ms, max {mine[-1] * 1000:.1f} ms"
                )
        late = sum(1 for s in got if s.latency_s("end") > 1.0)
        if late:
            print(f"  {late} arrived more than 1 s after the call returned")
    failures: dict[str, int] = {}
    for s in lat.sessions:
        if s.error is not None:
            failures[s.error] = failures.get(s.error, 0) + 1
    for what, count in failures.items():
        print(f"  FAILED x{count}: {what}")


def print_postgres() -> None:
    try:
        with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        print(f"PostgreSQL server {row[0] if row else '?'} at {PG_URL}")
    except psycopg.Error as exc:
        print(f"PostgreSQL at {PG_URL}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--joins", type=int, default=200, help="joins per run (default 200)")
    parser.add_argument(
        "--nodes", type=int, default=200, help="sessions revoked for the latency (default 200)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    parser.add_argument(
        "--interval-ms", type=float, default=20.0, help="between revoke calls (default 20)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.joins <= 5000:
        parser.error("--joins must be from 1 to 5000")
    if not 0 <= args.nodes <= 5000:
        parser.error("--nodes must be from 0 to 5000")
    if args.concurrency < 1 or args.interval_ms < 0:
        parser.error("--concurrency must be at least 1, --interval-ms at least 0")

    print_environment()
    print_postgres()
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        loaded = cpki.load_pki(template / "pki", SECRET.encode("utf-8"))
        join_floor_ms = crypto_floor(loaded).total_us / 1000
        renew_floor_ms = renew_floor(loaded).total_us / 1000
        print(
            f"\nCrypto floor (in-process, breakdown in bench/join.py and bench/renew.py): "
            f"{join_floor_ms:.3f} ms/join, {renew_floor_ms:.3f} ms/renewal"
        )
        with bench_fleet(tmp / "fleet", template, gateways=2) as roles:
            api = roles.fleet.api
            pins = api.pins()
            site, pool = api.site_and_pool()
            ctx = Context(
                roles,
                site,
                pool,
                pins["serving_ca_spki_pin"],
                pins["join_signing_key_pin"],
                args.concurrency,
            )
            print(
                f"fleet: 1 API replica (pid {roles.pids['api']}), "
                + ", ".join(
                    f"{k} (pid {pid}, port {gw.port})"
                    for (k, pid), gw in zip(
                        list(roles.pids.items())[1:], roles.fleet.gateways, strict=True
                    )
                )
            )
            warm_up(ctx)
            ports = roles.gateway_ports
            joins: list[Run] = []
            renewals: list[Run] = []
            cohorts: list[list[Member]] = []
            for use in (ports[:1], ports):
                run, members = join_run(ctx, use, args.joins)
                print_run(run)
                joins.append(run)
                cohorts.append(members)
            for use, members in zip((ports[:1], ports), cohorts, strict=True):
                run = renew_run(ctx, use, members)
                print_run(run)
                renewals.append(run)
            lat = None
            if args.nodes:
                pool_members = [m for c in cohorts for m in c if m.outcomes[-1].status == 200]
                if len(pool_members) < args.nodes:
                    more = args.nodes - len(pool_members)
                    _run, extra = join_run(ctx, ports, more, measured=False)
                    pool_members += extra
                lat = latency_run(ctx, pool_members[: args.nodes], args.interval_ms / 1000)
                print_latency(lat)
    print_table(joins, join_floor_ms, args.concurrency)
    print_table(renewals, renew_floor_ms, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
