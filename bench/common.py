"""What the benches share: CPU accounting, stores, joins over the gateway, timing.

Imported by ``bench/join.py``, ``bench/renew.py`` and ``bench/tpm.py`` once they have put the
repository root on ``sys.path``; not a script of its own.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import random
import secrets
import ssl
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cryptography
import psycopg
import trio
from cryptography.hazmat.backends.openssl import backend as openssl_backend
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, x25519

from bcd import __version__, pki, wire
from bcd.errors import BcdError
from bcd.gatewayclient import GatewayClient
from bcd.tls import Anchor, probe_anchor
from bcd.transport import pinned_transport
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
        sealed = wire.seal_token(parsed, encryption_key, csr_der, int(time.time()))
        claims = machine_claims(rng, seed, i)
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
        out.append(Prepared(wire.dumps(req.to_json()), csr_der, key))
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
