"""Join throughput of a real control plane, against the crypto floor of one join.

Run from the repository root::

    .venv/bin/python bench/join.py [--joins N] [--store sqlite|postgres|both]
                                   [--concurrency C]

It prints figures and judges nothing; it is not part of the test suite.

What it measures, per store (SQLite file; PostgreSQL at ``BCD_TEST_PG``, default
``postgresql://postgres@127.0.0.1:5432/test``, in a fresh schema dropped afterwards):

1. **Throughput of a real control plane.** A real ``better-compute serve``
   subprocess is started the way ``tests/e2e.py`` starts it (PKI made by the real
   CLI). The bench creates a site, a pool and one join token with ``maxUses=N``,
   then drives N joins over real TLS to the gateway from this process with C
   concurrent trio tasks (default 8), using bcd's own client pieces
   (``bcd.gatewayclient.GatewayClient`` over ``bcd.transport.pinned_transport``), one TLS connection per
   join, as ``bcd join`` does. Each request body is built as ``bcd.join`` builds it
   (fresh P-256 key, CSR, sealed token bound to the CSR, JoinRequest with distinct
   trusted hardware claims) *before* the clock starts: client crypto is not the
   server's cost. A separate one-use-per-join warm-up token first makes a few joins
   (lazy imports, database connections) outside the measurement.

   - ``wall s`` / ``joins/s``: wall time from the first connect to the last answer.
   - ``CPU ms/join``: the serve process's utime + stime (``/proc/<pid>/stat``, all
     its threads) over the run, divided by N. It covers everything the control
     plane does for a join: the TLS handshake, HTTP, JSON, the JoinService
     transaction, the SQLite engine (in process) or the PostgreSQL driver (the
     PostgreSQL server's own CPU is *not* in it; it is printed separately as
     ``postgres backends CPU``, read from the serve process's backends, found by
     ``application_name``).

   Every answer is then verified as bcd verifies it (``bcd.join.verify_joined``)
   and the nodes are counted in the database, so a fast run of refusals cannot
   pass for throughput.

2. **The raw crypto floor**, timed in-process in the same run with
   ``time.process_time`` over many iterations (median of 5 rounds): the per-join
   cryptography the server cannot avoid, done with ``cryptography`` alone (no
   jwcrypto, no project code): the seal opened step by step (ECDH P-256, Concat KDF,
   AES key unwrap, AES-256-GCM), the CSR parsed and its signature verified, a leaf
   with PROTOCOL.md's extensions built and signed, the response's JWS signing input
   (its real size) signed, the SHA-256 of the token secret, and the server's share
   of a TLS 1.3 handshake (X25519 keygen and agreement, a P-256 signature), which
   every join over a fresh connection pays. Their sum is the floor. The project's
   own calls for the same work are printed beside it, for reference only.

3. **JoinService alone, in process**: CPU per ``JoinService.join`` on a SQLite file
   (no TLS, HTTP or gateway), over the same floor; ``--profile`` adds its cProfile
   (share of its time per function), ``--py-spy`` samples the running serve with
   py-spy during the run (a sampling profile of its non-idle threads: waits the
   sampler cannot tell from work, a lock or a database reply, count too), and
   ``--instructions`` counts instructions with valgrind's callgrind (``perf stat``
   has no instructions counter on a VM without a PMU): the bench runs itself under
   callgrind with 4 and with 24 joins (or floors) after the same set-up, and the
   difference over 20 is one operation's instructions, which repeat run to run.

How to read it: ``CPU/floor`` says how many times the unavoidable crypto the
control plane (serve, plus its PostgreSQL backends) spends per join; what is above 1 is TLS, Python, HTTP, JSON, the
database and the thread hand-offs. ``joins/s`` is bounded by the serve process's
CPU (one process; the GIL makes it roughly one core) and by the database's
serialisation: every join here uses the *same* token, whose row is locked
(``FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite) for the whole join
transaction, leaf issuance included, so joins on one token are serial by design.
On a small machine the bench's client (TLS handshakes and chain checks) and
PostgreSQL share the cores with the server; the client's CPU per join is printed
too, and for each process how many cores it kept busy over the run (CPU time
over wall time): when none is near 1 (or the core count), the run is bound by
serialisation and latency rather than by CPU. ``/proc`` counts CPU in clock
ticks (10 ms), so CPU per join is exact to about 1% only from a few hundred
joins on. Sealed tokens carry ``iat`` from build time and are refused after 5
minutes, so keep N such that a run lasts less than that.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bcd import pki, wire  # noqa: E402
from bcd.join import verify_joined  # noqa: E402
from bcd.signed import Issued  # noqa: E402
from bench.common import (  # noqa: E402
    Floor,
    Throughput,
    build_bodies,
    collapsed_shares,
    count_failures,
    cprofile_shares,
    drive,
    instructions_per_op,
    make_tls_server_share,
    open_seal_bare,
    per_call_us,
    pg_backends_cpu_s,
    print_cpu,
    print_environment,
    print_floor,
    print_inprocess,
    print_instructions,
    print_table,
    proc_cpu_s,
    py_spy,
    raw_csr_verify,
    raw_leaf,
    raw_sign,
    store_url,
)
from control import pki as cpki  # noqa: E402
from control.issuance import JoinCrypto  # noqa: E402
from control.server import join_crypto  # noqa: E402
from tests.e2e import SECRET, TRUST_DOMAIN, ControlPlane, make_pki  # noqa: E402

WARMUP_JOINS = 8
CALLGRIND_SMALL, CALLGRIND_LARGE = 4, 24
PY_SPY_OUT: dict[str, Path] = {}


# --- driving joins ------------------------------------------------------------------


@dataclass
class StoreResult:
    store: str
    joins: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    pg_cpu_s: float | None
    ok: int
    verified: int
    nodes_in_db: int
    uses_left: int
    failures: dict[str, int]

    @property
    def joins_per_s(self) -> float:
        return self.joins / self.wall_s

    @property
    def cpu_ms_per_join(self) -> float:
        return self.server_cpu_s * 1000 / self.joins

    @property
    def cp_ms_per_join(self) -> float:
        """The control plane's CPU per join: serve, and its PostgreSQL backends."""
        return (self.server_cpu_s + (self.pg_cpu_s or 0.0)) * 1000 / self.joins


def run_store(kind: str, n: int, concurrency: int, tmp: Path, template: Path) -> StoreResult:
    home = tmp / f"cp-{kind}"
    home.mkdir()
    app_name = f"bcdbench_{secrets.token_hex(4)}"
    with store_url(kind, tmp, app_name) as url:
        cp = ControlPlane.start(home, template, url)
        try:
            return _measure(kind, cp, n, concurrency, app_name if kind == "postgres" else None)
        finally:
            cp.stop()


def _measure(
    kind: str, cp: ControlPlane, n: int, concurrency: int, app_name: str | None
) -> StoreResult:
    pins = cp.pins()
    jwk = cp.well_known()["join"]["encryptionJwk"]
    encryption_key = wire.public_key_of_jwk(jwk)
    if not pki.pins_equal(pki.spki_pin(encryption_key), pins["join_encryption_key_pin"]):
        raise RuntimeError("the well-known encryption key does not match its pin")
    site, pool = cp.site_and_pool()
    warm_token = cp.token(pool, maxUses=WARMUP_JOINS)["token"]
    token = cp.token(pool, maxUses=n)
    serving_pin = pins["serving_ca_spki_pin"]

    warm = build_bodies(WARMUP_JOINS, warm_token, encryption_key, seed=1)
    bodies = build_bodies(n, token["token"], encryption_key, seed=2)
    warm_out, _ = trio.run(drive, cp.gateway_port, serving_pin, warm, concurrency)
    if any(o.status != 200 for o in warm_out):
        raise RuntimeError(f"warm-up joins failed: {count_failures(warm_out)}")

    pg_before = pg_backends_cpu_s(app_name) if app_name else None
    server_before = proc_cpu_s(cp.proc.pid)
    client_before = time.process_time()
    with py_spy(cp.proc.pid, PY_SPY_OUT.get(kind)):
        outcomes, wall = trio.run(drive, cp.gateway_port, serving_pin, bodies, concurrency)
    client_cpu = time.process_time() - client_before
    server_cpu = proc_cpu_s(cp.proc.pid) - server_before
    pg_after = pg_backends_cpu_s(app_name) if app_name else None
    pg_cpu = None
    if pg_before is not None and pg_after is not None:
        pg_cpu = sum(cpu - pg_before.get(pid, 0.0) for pid, cpu in pg_after.items())

    verified = 0
    for prepared, outcome in zip(bodies, outcomes, strict=True):
        if outcome.status != 200:
            continue
        body = verify_joined(
            outcome.body.decode("ascii"),
            signing_pin=pins["join_signing_key_pin"],
            csr_der=prepared.csr_der,
            key=prepared.key.public_key(),
            role="node",
        )
        if isinstance(body, Issued) and body.kind == "joined" and body.site_id == site:
            verified += 1
    nodes = cp.one("SELECT COUNT(*) AS n FROM nodes WHERE pool_id = ?", (pool,))
    left = cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (token["id"],))
    return StoreResult(
        store=kind,
        joins=n,
        wall_s=wall,
        server_cpu_s=server_cpu,
        client_cpu_s=client_cpu,
        pg_cpu_s=pg_cpu,
        ok=sum(1 for o in outcomes if o.status == 200),
        verified=verified,
        nodes_in_db=int(nodes["n"]) - WARMUP_JOINS if nodes else -1,
        uses_left=int(left["uses_left"]) if left else -1,
        failures=count_failures(outcomes),
    )


# --- the crypto floor ---------------------------------------------------------------


@dataclass
class FloorCase:
    """One realistic join's inputs, for the floor and the in-process loops."""

    loaded: cpki.Pki
    sealed: str
    csr_der: bytes
    secret: str
    stored_hash: str
    spiffe: pki.SpiffeId
    body: dict[str, object]
    signing_input: bytes


def floor_case(loaded: cpki.Pki) -> FloorCase:
    now = datetime.now(UTC)
    node_key = pki.generate_key()
    csr_der = pki.make_csr(node_key)
    token = wire.JoinToken("jt_" + "0" * 26, base64.urlsafe_b64encode(os.urandom(32))[:43].decode())
    enc_key = loaded.join_encryption_key
    enc_pin = pki.spki_pin(enc_key.public_key())
    sealed = wire.seal_token(token, enc_key.public_key(), csr_der, int(now.timestamp()))
    opened = wire.open_seal(sealed, enc_key, enc_pin)
    if opened.token != token or open_seal_bare(sealed, enc_key) != token.bearer.encode():
        raise RuntimeError("the seal does not open to the token it sealed")
    site_id, node_id = "site_" + "1" * 26, "node_" + "2" * 26
    spiffe = pki.SpiffeId(loaded.trust_domain, site_id, node_id)
    public = pki.csr_public_key(pki.parse_csr(csr_der))
    leaf = cpki.issue_node_leaf(loaded, public, spiffe, "node", (), now, 86_400)
    body: dict[str, object] = {
        "kind": "joined",
        "node_id": node_id,
        "site_id": site_id,
        "role": "node",
        "trust_domain": loaded.trust_domain,
        "chain": pki.cert_pem(leaf) + loaded.chain_tail_pem(),
        "bundle": loaded.bundle_pem(),
        "trust_version": loaded.trust_version,
        "csr_sha256": pki.sha256_hex(csr_der),
        "server_time": int(now.timestamp() * 1000),
        "identity_generation": 1,
    }
    signed = wire.sign_response(body, loaded.join_signing_key)
    wire.verify_response(signed, pki.spki_pin(loaded.join_signing_key.public_key()))
    return FloorCase(
        loaded,
        sealed,
        csr_der,
        token.secret,
        wire.secret_hash(token.secret),
        spiffe,
        body,
        signed.rsplit(".", 1)[0].encode("ascii"),
    )


def raw_floor_ops(case: FloorCase) -> list[tuple[str, Callable[[], object]]]:
    """The floor: each piece of a join's unavoidable crypto, ``cryptography`` alone."""
    loaded = case.loaded
    enc_key = loaded.join_encryption_key
    public = raw_csr_verify(case.csr_der)
    uri = str(case.spiffe)
    return [
        (
            "open the seal (ECDH P-256, Concat KDF, AES-KW unwrap, AES-256-GCM)",
            lambda: open_seal_bare(case.sealed, enc_key),
        ),
        ("verify the CSR (parse, ECDSA P-256 verify)", lambda: raw_csr_verify(case.csr_der)),
        (
            "issue the leaf (x509 builder, ECDSA P-256 sign)",
            lambda: raw_leaf(loaded.node_ca, loaded.node_ca_key, public, uri, "bc-role:node"),
        ),
        (
            f"sign the response ({len(case.signing_input)} B: SHA-256, ECDSA P-256 sign)",
            lambda: raw_sign(loaded.join_signing_key, case.signing_input),
        ),
        (
            "token secret (SHA-256, constant-time compare)",
            lambda: hmac.compare_digest(
                hashlib.sha256(case.secret.encode()).hexdigest(), case.stored_hash
            ),
        ),
        (
            "TLS 1.3 handshake, server's share (X25519 keygen + agree, P-256 sign)",
            make_tls_server_share(),
        ),
    ]


def crypto_floor(loaded: cpki.Pki) -> Floor:
    """Time the raw floor and, for reference, the project's own calls for the same work."""
    case = floor_case(loaded)
    enc_key = loaded.join_encryption_key
    enc_pin = pki.spki_pin(enc_key.public_key())
    public = pki.csr_public_key(pki.parse_csr(case.csr_der))
    now = datetime.now(UTC)
    items = [(name, per_call_us(fn)) for name, fn in raw_floor_ops(case)]
    extras = []
    if JoinCrypto is not None and hasattr(JoinCrypto, "seal_opener"):
        opener = join_crypto(loaded).seal_opener
        extras.append(
            (
                "control.pkiseal.SealOpener.open (what JoinService opens seals with)",
                per_call_us(lambda: opener.open(case.sealed)),
            )
        )
    extras += [
        (
            "bcd.wire.open_seal (jwcrypto; the server's opener before)",
            per_call_us(lambda: wire.open_seal(case.sealed, enc_key, enc_pin)),
        ),
        ("bcd.pki.parse_csr", per_call_us(lambda: pki.parse_csr(case.csr_der))),
        (
            "control.pki.issue_node_leaf",
            per_call_us(
                lambda: cpki.issue_node_leaf(loaded, public, case.spiffe, "node", (), now, 86_400)
            ),
        ),
        (
            "bcd.wire.sign_response (with its JSON)",
            per_call_us(lambda: wire.sign_response(case.body, loaded.join_signing_key)),
        ),
    ]
    return Floor(items, extras)


# --- in process: JoinService alone on a SQLite file ----------------------------------


def inprocess_world(tmp: Path, n: int) -> tuple[Any, list[bytes]]:
    """A World (tests/world/joins.py) on a fresh SQLite file, one token, n bodies."""
    from control.store import open_store
    from tests.world.joins import machine, make_world

    store = open_store(f"sqlite:///{tmp / 'inprocess.db'}")
    store.migrate()
    world = make_world(store, cpki.build_pki(TRUST_DOMAIN, datetime.now(UTC)))
    token = world.mint(max_uses=min(n + WARMUP_JOINS, 10_000))
    bodies = [world.body(token, machine(i)).body for i in range(n + WARMUP_JOINS)]
    for body in bodies[:WARMUP_JOINS]:
        world.svc.join(body)
    return world, bodies[WARMUP_JOINS:]


def inprocess_joins(tmp: Path, n: int, profile: bool) -> tuple[float, list[Any]]:
    """CPU ms per JoinService.join in this process; with ``profile``, its cProfile."""
    world, bodies = inprocess_world(tmp, n)
    start = time.process_time()
    for body in bodies:
        world.svc.join(body)
    ms = (time.process_time() - start) * 1000 / n
    shares: list[Any] = []
    if profile:
        (tmp / "profiled").mkdir()
        world2, bodies2 = inprocess_world(tmp / "profiled", n)

        def run() -> None:
            for body in bodies2:
                world2.svc.join(body)

        shares = cprofile_shares(run)
    return ms, shares


def callgrind_loop(what: str, n: int) -> None:
    """What ``--callgrind`` runs under valgrind: set up, then n joins or n floors.

    Set-up is the same whatever n is (a fixed 24 bodies are built), so the difference
    of two runs is n joins' (or floors') instructions alone."""
    with tempfile.TemporaryDirectory(prefix="bcd-bench-cg-") as name:
        world, bodies = inprocess_world(Path(name), CALLGRIND_LARGE)
        if what == "join":
            for body in bodies[:n]:
                world.svc.join(body)
            return
        ops = raw_floor_ops(floor_case(world.pki))
        for _ in range(n):
            for _name, fn in ops:
                fn()


# --- output -------------------------------------------------------------------------


def print_store(res: StoreResult) -> None:
    print(f"\n[{res.store}] {res.joins} joins, {res.ok} answered 200, {res.verified} verified")
    print(f"  nodes in the database: {res.nodes_in_db}; token uses left: {res.uses_left}")
    cpu = [("serve process", res.server_cpu_s), ("bench client", res.client_cpu_s)]
    if res.pg_cpu_s is not None:
        cpu.append(("postgres backends", res.pg_cpu_s))
    print_cpu(cpu, res.joins, "join", res.wall_s, res.failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--joins", type=int, default=300, help="joins per store (default 300)")
    parser.add_argument("--store", choices=("sqlite", "postgres", "both", "none"), default="both")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile JoinService.join in process"
    )
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions under callgrind"
    )
    parser.add_argument(
        "--py-spy", action="store_true", help="sample the serve process with py-spy"
    )
    parser.add_argument("--callgrind", nargs=2, metavar=("WHAT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.callgrind:
        callgrind_loop(args.callgrind[0], int(args.callgrind[1]))
        return 0
    if not 1 <= args.joins <= 10_000:
        parser.error("--joins must be from 1 to 10000 (a token's maxUses limit)")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    kinds = {"both": ["sqlite", "postgres"], "none": []}.get(args.store, [args.store])

    print_environment()
    results: list[StoreResult] = []
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        loaded = cpki.load_pki(template / "pki", SECRET.encode("utf-8"))
        assert loaded.trust_domain == TRUST_DOMAIN
        floor = crypto_floor(loaded)
        print_floor(floor, "join")
        (tmp / "inprocess").mkdir()
        ms, shares = inprocess_joins(tmp / "inprocess", args.joins, args.profile)
        print_inprocess("JoinService.join", "SQLite file, no TLS/HTTP", "join", ms, floor, shares)
        for kind in kinds:
            if args.py_spy:
                PY_SPY_OUT[kind] = Path(tempfile.gettempdir()) / f"bcd-bench-py-spy-{kind}.txt"
            res = run_store(kind, args.joins, args.concurrency, tmp, template)
            print_store(res)
            if args.py_spy and PY_SPY_OUT[kind].exists():
                print("  py-spy, serve process, % of its busy samples (inclusive):")
                for share, where in collapsed_shares(PY_SPY_OUT[kind]):
                    print(f"  {share:6.1f}%  {where}")
            results.append(res)
    if results:
        print_table(
            f"Join throughput ({args.concurrency} concurrent clients, one TLS connection per join)",
            [
                Throughput(r.store, r.joins, r.wall_s, r.joins_per_s, r.cp_ms_per_join)
                for r in results
            ],
            floor,
            "join",
            "TLS share included",
        )
    if args.instructions:
        script = str(Path(__file__).resolve())
        print_instructions(
            "JoinService.join (SQLite, no TLS/HTTP)",
            instructions_per_op(script, "join", CALLGRIND_SMALL, CALLGRIND_LARGE),
            instructions_per_op(script, "floor", CALLGRIND_SMALL, CALLGRIND_LARGE),
            "TLS share included",
            (CALLGRIND_LARGE, CALLGRIND_SMALL),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
