"""What the benches share: CPU accounting, stores, joins over the gateway, timing.

Imported by ``bench/join.py``, ``bench/renew.py``, ``bench/tpm.py`` and
``bench/sightings.py`` once they have put the repository root on ``sys.path``; not a
script of its own. The join and renewal benches print their floor, CPU, throughput
table, in-process cost and instruction counts through the same helpers here.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import random
import re
import secrets
import shutil
import ssl
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cryptography
import psycopg
import trio
from cryptography import x509
from cryptography.hazmat.backends.openssl import backend as openssl_backend
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcd import __version__, pki, wire
from bcd.errors import BcdError
from bcd.gatewayclient import GatewayClient
from bcd.tls import Anchor, probe_anchor
from bcd.transport import pinned_transport
from control.store import Store, Tx, open_store
from tests.fakesys import random_mac

PG_URL = os.environ.get("BCD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
SERVER_NAME = "127.0.0.1"
FLOOR_ROUNDS = 5
FLOOR_ROUND_S = 0.2
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- CPU accounting -----------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After "pid (comm)": state is field 3, utime field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pg_backends_cpu_s(app_name: str) -> dict[int, float] | None:
    """CPU seconds of each PostgreSQL backend of ``app_name``; None if unreadable."""
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            pids = [
                int(r[0])
                for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app_name,)
                ).fetchall()
            ]
        out: dict[int, float] = {}
        for pid in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                out[pid] = proc_cpu_s(pid)
        return out
    except (psycopg.Error, OSError, ValueError):
        return None


# --- stores -----------------------------------------------------------------------


@contextlib.contextmanager
def store_url(kind: str, tmp: Path, app_name: str) -> Iterator[str]:
    """A fresh database: a SQLite file, or a new PostgreSQL schema dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'store.db'}"
        return
    schema = f"bench_{secrets.token_hex(6)}"
    with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}&application_name={app_name}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextlib.contextmanager
def opened_store(kind: str, tmp: Path, app_name: str) -> Iterator[Store]:
    """:func:`store_url`'s fresh database, opened (and closed at the end)."""
    with store_url(kind, tmp, app_name) as url:
        store = open_store(url)
        try:
            yield store
        finally:
            store.close()


@dataclass
class Recorded:
    """The statements (their SQL texts) and transactions a store ran while recorded;
    ``deferred``: how many of the statements were :meth:`~control.store.Tx.defer`'s."""

    statements: list[str] = field(default_factory=list)
    transactions: int = 0
    deferred: int = 0

    def round_trips(self, dialect: str) -> int | None:
        """PostgreSQL's round trips: each transaction's BEGIN (with its time) and COMMIT,
        each statement not deferred (a deferred one rides with the next statement or
        the COMMIT, in one pipeline); None on SQLite, which has none."""
        if dialect != "postgres":
            return None
        return 2 * self.transactions + len(self.statements) - self.deferred


@contextlib.contextmanager
def recorded_statements(store: Store) -> Iterator[Recorded]:
    """Record every statement and transaction of ``store`` (all its connections) until
    the block ends: its dialect's ``Tx.execute`` / ``query`` / ``defer`` and
    ``Store._tx`` wrapped, and put back afterwards. A bench's count, never a test's."""
    recorded = Recorded()
    with store.tx() as tx:  # the dialect's Tx class
        tx_class = type(tx)
    execute, query, defer, inner = tx_class.execute, tx_class.query, tx_class.defer, type(store)._tx
    own_defer = "defer" in vars(tx_class)  # else Tx.defer, which calls execute

    def counted_execute(self: Tx, sql: str, params: Any = ()) -> int:
        recorded.statements.append(sql)
        return execute(self, sql, params)

    def counted_query(self: Tx, sql: str, params: Any = ()) -> list[Any]:
        recorded.statements.append(sql)
        return query(self, sql, params)

    def counted_defer(self: Tx, sql: str, params: Any = ()) -> None:
        if own_defer:
            recorded.statements.append(sql)
            recorded.deferred += 1
        defer(self, sql, params)

    @contextlib.contextmanager
    def counted_tx(self: Store) -> Iterator[Tx]:
        recorded.transactions += 1
        with inner(self) as tx:
            yield tx

    tx_class.execute, tx_class.query = counted_execute, counted_query  # type: ignore[method-assign]
    tx_class.defer = counted_defer  # type: ignore[method-assign]
    type(store)._tx = counted_tx  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        tx_class.execute, tx_class.query = execute, query  # type: ignore[method-assign]
        if own_defer:
            tx_class.defer = defer  # type: ignore[method-assign]
        else:  # inherited: put no copy on the dialect's class
            del tx_class.defer
        type(store)._tx = inner  # type: ignore[method-assign]


# --- join request bodies ------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    body: bytes = field(repr=False)
    csr_der: bytes = field(repr=False)
    key: ec.EllipticCurvePrivateKey = field(repr=False)


def machine_claims(rng: random.Random, seed: int, i: int) -> wire.Claims:
    """Distinct trusted hardware claims for machine ``i`` of a run seeded ``seed``."""
    return wire.Claims(
        product_uuid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        product_serial=f"BENCH{seed:03d}{i:07d}{rng.getrandbits(32):08X}",
        macs=(random_mac(rng),),
        hostname=f"bench-{seed}-{i}",
        boot_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    )


def join_body(
    parsed: wire.JoinToken,
    encryption_key: ec.EllipticCurvePublicKey,
    csr_der: bytes,
    claims: wire.Claims,
) -> bytes:
    """A JoinRequest body as bcd.join builds it: the token sealed now, to this CSR."""
    sealed = wire.seal_token(parsed, encryption_key, csr_der, int(time.time()))
    req = wire.JoinRequest(
        role="node",
        attestor="",
        sealed_token=sealed,
        csr_der=csr_der,
        claims=claims,
        evidence={},
        node_id=None,
        daemon_version=__version__,
    )
    return wire.dumps(req.to_json())


def build_bodies(
    n: int, token: str, encryption_key: ec.EllipticCurvePublicKey, seed: int
) -> list[Prepared]:
    """N JoinRequest bodies as bcd.join builds them, each with its own machine."""
    rng = random.Random(seed)
    parsed = wire.parse_token(token)
    out = []
    for i in range(n):
        key = pki.generate_key()
        csr_der = pki.make_csr(key)
        body = join_body(parsed, encryption_key, csr_der, machine_claims(rng, seed, i))
        out.append(Prepared(body, csr_der, key))
    return out


# --- requests to the gateway ----------------------------------------------------------


_anchors: dict[tuple[int, str], Anchor] = {}


async def serving_anchor(port: int, pin: str) -> Anchor:
    """The gateway's serving CA, checked against ``pin`` (fetched once, as a node
    without serving-ca.pem does; a node with the file never probes)."""
    if (port, pin) not in _anchors:
        _anchors[(port, pin)] = await probe_anchor(SERVER_NAME, port, SERVER_NAME, pin)
    return _anchors[(port, pin)]


@dataclass
class Outcome:
    status: int | None = None
    body: bytes = field(default=b"", repr=False)
    error: str | None = None


async def post_gateway(
    port: int,
    pin: str,
    path: str,
    body: bytes,
    client_cert: tuple[str, bytes] | None = None,
) -> Outcome:
    """One POST as bcd's senders make it: a pinned connection (mutual TLS with
    ``client_cert``: chain PEM, key PEM) per attempt, closed after the answer."""
    try:
        transport = pinned_transport(SERVER_NAME, await serving_anchor(port, pin), client_cert)
        async with GatewayClient(
            transport, host=SERVER_NAME, port=port, server_name=SERVER_NAME
        ) as client:
            resp = await client.post(path, body)
    except BcdError as exc:
        return Outcome(error=str(exc))
    return Outcome(resp.status, resp.body)


async def join_once(port: int, pin: str, body: bytes) -> Outcome:
    """One join as bcd.join.gateway_sender does it: a pinned connection per attempt."""
    return await post_gateway(port, pin, "/v1/join", body)


async def drive(
    port: int, pin: str, bodies: list[Prepared], concurrency: int
) -> tuple[list[Outcome], float]:
    """Run every join with ``concurrency`` tasks; return the outcomes and the wall time."""
    outcomes = [Outcome() for _ in bodies]
    indexes = iter(range(len(bodies)))

    async def worker() -> None:
        for i in indexes:  # shared: each index is taken by exactly one task
            outcomes[i] = await join_once(port, pin, bodies[i].body)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return outcomes, time.perf_counter() - start


def count_failures(outcomes: list[Outcome]) -> dict[str, int]:
    """How many outcomes failed, by what the gateway (or the transport) said."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.status == 200:
            continue
        what = o.error or f"HTTP {o.status}: {o.body[:120].decode('utf-8', 'replace')}"
        counts[what] = counts.get(what, 0) + 1
    return counts


# --- wall-time samples ----------------------------------------------------------------


def p90(samples: list[float]) -> float:
    """The 90th percentile of ``samples`` (nearest rank, as the benches print it)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


def ms_summary(samples: list[float]) -> str:
    """``median X ms, p90 Y ms`` of wall-time samples in seconds."""
    return f"median {statistics.median(samples) * 1000:8.2f} ms, p90 {p90(samples) * 1000:8.2f} ms"


# --- the crypto floor ---------------------------------------------------------------


def per_call_us(fn: Callable[[], object]) -> float:
    """Median CPU µs per call over FLOOR_ROUNDS rounds of about FLOOR_ROUND_S each."""
    n = 1
    while True:
        start = time.process_time()
        for _ in range(n):
            fn()
        spent = time.process_time() - start
        if spent >= 0.02:
            break
        n *= 2
    iterations = max(n, int(n * FLOOR_ROUND_S / spent))
    samples = []
    for _ in range(FLOOR_ROUNDS):
        start = time.process_time()
        for _ in range(iterations):
            fn()
        samples.append((time.process_time() - start) / iterations)
    return statistics.median(samples) * 1e6


@dataclass
class Floor:
    items: list[tuple[str, float]]
    extras: list[tuple[str, float]]

    @property
    def total_us(self) -> float:
        return sum(us for _, us in self.items)


def make_tls_server_share() -> Callable[[], None]:
    """The server's share of a TLS 1.3 handshake: X25519 keygen + agreement, P-256 sign."""
    tls_key = ec.generate_private_key(ec.SECP256R1())
    peer_share = x25519.X25519PrivateKey.generate().public_key()
    transcript = os.urandom(130)

    def tls_server_share() -> None:
        x25519.X25519PrivateKey.generate().exchange(peer_share)
        tls_key.sign(transcript, ec.ECDSA(hashes.SHA256()))

    return tls_server_share


# --- the raw floor: ``cryptography`` primitives only --------------------------------
#
# What a join or renewal cannot avoid, done with nothing but ``cryptography`` (and
# hashlib): no jwcrypto, no project code. The project's own calls are timed beside it
# for reference; the ratio the benches print is always to this.


def _len_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def open_seal_bare(sealed: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """The seal's primitives alone (RFC 7518 ECDH-ES+A256KW, A256GCM), no jwcrypto."""
    h64, ek64, iv64, ct64, tag64 = sealed.split(".")
    header = json.loads(pki.b64url_decode(h64))
    epk = ec.EllipticCurvePublicNumbers(
        int.from_bytes(pki.b64url_decode(header["epk"]["x"]), "big"),
        int.from_bytes(pki.b64url_decode(header["epk"]["y"]), "big"),
        ec.SECP256R1(),
    ).public_key()
    shared = key.exchange(ec.ECDH(), epk)
    other = (
        _len_prefixed(header["alg"].encode("ascii"))
        + _len_prefixed(pki.b64url_decode(header.get("apu", "")))
        + _len_prefixed(pki.b64url_decode(header.get("apv", "")))
        + (256).to_bytes(4, "big")
    )
    kek = ConcatKDFHash(hashes.SHA256(), 32, other).derive(shared)
    cek = aes_key_unwrap(kek, pki.b64url_decode(ek64))
    ciphertext = pki.b64url_decode(ct64) + pki.b64url_decode(tag64)
    return AESGCM(cek).decrypt(pki.b64url_decode(iv64), ciphertext, h64.encode("ascii"))


def raw_csr_verify(der: bytes) -> ec.EllipticCurvePublicKey:
    """Parse a DER CSR and check its self-signature (cryptography alone)."""
    csr = x509.load_der_x509_csr(der)
    if not csr.is_signature_valid:
        raise ValueError("the CSR's signature does not verify")
    key = csr.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key


def raw_leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    public_key: ec.EllipticCurvePublicKey,
    uri: str,
    role: str,
) -> x509.Certificate:
    """A node leaf with the extensions PROTOCOL.md names, built and signed directly."""
    now = datetime.now(UTC)
    aki = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
        .issuer_name(ca.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(hours=24))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(aki), critical=False
        )
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), True
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )


def raw_sign(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """ECDSA P-256 / SHA-256 over ``data`` (a JWS signing input, a TLS transcript)."""
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


# --- in process: the service alone, and instruction counts ---------------------------


def cprofile_shares(fn: Callable[[], None], top: int = 22) -> list[tuple[float, float, str]]:
    """Run ``fn`` under cProfile; (% of its time, own %, function) by cumulative time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_cc, _nc, tt, ct, _callers) in raw.items():
        where = filename.replace(str(Path(__file__).resolve().parent.parent) + "/", "")
        if "site-packages/" in where:
            where = where.split("site-packages/", 1)[1]
        rows.append((ct / total * 100, tt / total * 100, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    return rows[:top]


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """Sample ``pid`` with py-spy (collapsed stacks to ``out``) while the block runs."""
    exe = Path(sys.executable).parent / "py-spy"
    if out is None or not exe.exists():
        yield
        return
    cmd = [str(exe), "record", "-p", str(pid), "-o", str(out), "--format", "raw"]
    proc = subprocess.Popen(
        [*cmd, "--rate", "200", "--nonblocking", "--threads"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        proc.send_signal(2)
        proc.wait(timeout=30)


def collapsed_shares(path: Path, top: int = 30) -> list[tuple[float, str]]:
    """Inclusive % of samples per function in py-spy's collapsed stacks (idle left out)."""
    counts: dict[str, int] = {}
    total = 0
    idle = ("epoll", "select", "wait", "_recv", "get_events", "run_idle", "acquire")
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or any(k in frames[-1] for k in idle):
            continue
        total += int(n)
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames}:
            counts[name] = counts.get(name, 0) + int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [(n * 100 / max(total, 1), name) for name, n in ranked]


def callgrind_instructions(argv: list[str]) -> int | None:
    """Instructions (Ir) of ``python argv`` under valgrind's callgrind; None without it."""
    if shutil.which("valgrind") is None:
        return None
    proc = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            *argv,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    found = re.findall(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or not found:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return int(found[-1])


def instructions_per_op(script: str, what: str, small: int, large: int) -> float | None:
    """Instructions per operation: the difference of two runs of ``script --callgrind
    WHAT N`` (N = small, large) over ``large - small``, so set-up and start-up cancel."""
    runs = [callgrind_instructions([script, "--callgrind", what, str(n)]) for n in (small, large)]
    if runs[0] is None or runs[1] is None:
        return None
    return (runs[1] - runs[0]) / (large - small)


# --- output -------------------------------------------------------------------------


def print_environment() -> None:
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0))
    print(f"Python {platform.python_version()} ({platform.python_implementation()})")
    print(f"{ssl.OPENSSL_VERSION} (ssl module: TLS on both ends)")
    print(
        f"cryptography {cryptography.__version__} with {openssl_backend.openssl_version_text()} "
        f"(seal, CSR, leaf, response), jwcrypto {importlib.metadata.version('jwcrypto')}"
    )
    print(f"trio {trio.__version__}, psycopg {psycopg.__version__}, bcd {__version__}")
    print(f"cores: {cores} (usable by this process: {usable}); {platform.platform()}")


# --- output of the join and renewal benches -------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """One store's row of a throughput table: ``count`` operations in ``wall_s``,
    ``cp_ms`` of control-plane CPU per operation."""

    store: str
    count: int
    wall_s: float
    per_s: float
    cp_ms: float


def print_floor(floor: Floor, op: str) -> None:
    """The raw floor per ``op`` (``join``, ``renewal``), then the project's own calls."""
    print(f"\nRaw crypto floor per {op} (`cryptography` only; CPU µs, median of 5 rounds):")
    for name, us in floor.items:
        print(f"  {us:8.1f}  {name}")
    print(f"  {floor.total_us:8.1f}  = floor (sum)")
    print("  the project's own calls for the same work, for reference (not the floor):")
    for name, us in floor.extras:
        print(f"  {us:8.1f}  {name}")


def print_cpu(
    cpu: list[tuple[str, float]], count: int, op: str, wall_s: float, failures: dict[str, int]
) -> None:
    """Each process's CPU per ``op`` and how many cores it kept busy, then the failures."""
    for what, spent in cpu:
        print(
            f"  {what} CPU: {spent * 1000 / count:.3f} ms/{op}, "
            f"busy {spent / wall_s:.2f} cores over the run"
        )
    for what, n in failures.items():
        print(f"  FAILED x{n}: {what}")


def print_table(title: str, rows: list[Throughput], floor: Floor, op: str, shares: str) -> None:
    """The throughput table: per store, the control plane's CPU per ``op`` over the
    floor's. ``title`` heads it; ``shares``: what of TLS the floor counts."""
    floor_ms = floor.total_us / 1000
    plural = f"{op}s"
    widths = (max(len(plural), 6), len(plural) + 3, len(op) + 11, len(op) + 10)
    print(f"\n{title}:")
    head = (
        f"{'store':<9} {plural:>{widths[0]}} {'wall s':>8} {plural + '/s':>{widths[1]}} "
        f"{'CP CPU ms/' + op:>{widths[2]}} {'floor ms/' + op:>{widths[3]}} {'CPU/floor':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.store:<9} {r.count:>{widths[0]}} {r.wall_s:>8.2f} {r.per_s:>{widths[1]}.1f} "
            f"{r.cp_ms:>{widths[2]}.3f} {floor_ms:>{widths[3]}.3f} {r.cp_ms / floor_ms:>10.1f}"
        )
    print(
        "CP CPU = control plane: the serve process, plus its PostgreSQL backends where used;"
        f" floor = the raw `cryptography` floor above, {shares}, this run."
    )


def print_inprocess(
    call: str, where: str, op: str, ms: float, floor: Floor, shares: list[Any]
) -> None:
    """``call`` (``JoinService.join``) alone in process (``where``): CPU ms per ``op``
    over the floor, and its cProfile ``shares`` (:func:`cprofile_shares`) if any."""
    floor_ms = floor.total_us / 1000
    print(
        f"\n{call} in process ({where}): {ms:.3f} ms CPU per {op}, {ms / floor_ms:.1f}x the floor"
    )
    if shares:
        print(f"  cProfile, % of {call}'s time (cumulative, own):")
        for cum, own, name in shares:
            print(f"  {cum:6.1f}% {own:6.1f}%  {name}")


def print_instructions(
    call: str, op_ir: float | None, floor_ir: float | None, floor_note: str, runs: tuple[int, int]
) -> None:
    """Instructions per ``call`` and per raw floor (:func:`instructions_per_op`, the
    difference of ``runs`` = (large, small) operations), and their ratio."""
    if op_ir is None or floor_ir is None:
        print("\nInstructions: valgrind (callgrind) not usable here")
        return
    print(
        "\nInstructions (valgrind --tool=callgrind; perf stat has no instructions counter on"
        f" this VM), in process, difference of {runs[0]} and {runs[1]} operations:"
    )
    print(f"  {op_ir / 1e6:8.2f} M per {call}")
    print(f"  {floor_ir / 1e6:8.2f} M per raw floor ({floor_note})")
    print(f"  ratio {op_ir / floor_ir:.2f}")
