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

2. **The crypto floor**, timed in-process in the same run with
   ``time.process_time`` over many iterations (median of 5 rounds): the per-join
   cryptography the server cannot avoid, as the code does it — opening the sealed
   token (``bcd.wire.open_seal``: ECDH-ES, AES key unwrap, AES-GCM), parsing the
   CSR and verifying its ECDSA signature (``bcd.pki.parse_csr``), issuing the leaf
   (``control.pki.issue_node_leaf``: build and ECDSA-sign), signing the response
   (``bcd.wire.sign_response``: SHA-256 and ECDSA sign) and the SHA-256 of the
   token secret (``bcd.wire.secret_matches``). Their sum is the floor. Two
   reference lines are printed but are *not* in the floor: the seal's bare
   primitives without jwcrypto (how much of ``open_seal`` is library overhead),
   and the server's share of a TLS 1.3 handshake (X25519 keygen and agreement,
   P-256 signature), which every join over a fresh connection also pays.

How to read it: ``CPU/floor`` says how many times the unavoidable crypto the
control plane spends per join; what is above 1 is TLS, Python, HTTP, JSON, the
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
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash  # noqa: E402
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap  # noqa: E402

from bcd import pki, wire  # noqa: E402
from bcd.join import verify_joined  # noqa: E402
from bench.common import (  # noqa: E402
    Floor,
    build_bodies,
    count_failures,
    drive,
    make_tls_server_share,
    per_call_us,
    pg_backends_cpu_s,
    print_environment,
    proc_cpu_s,
    store_url,
)
from control import pki as cpki  # noqa: E402
from tests.e2e import SECRET, TRUST_DOMAIN, ControlPlane, make_pki  # noqa: E402

WARMUP_JOINS = 8


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
        if body.get("kind") == "joined" and body.get("site_id") == site:
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


def _len_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def open_seal_bare(sealed: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """The seal's primitives alone (RFC 7518 ECDH-ES+A256KW, A256GCM), no jwcrypto."""
    h64, ek64, iv64, ct64, tag64 = sealed.split(".")
    header = json.loads(pki.b64url_decode(h64))
    epk = wire.public_key_of_jwk({k: header["epk"][k] for k in ("kty", "crv", "x", "y")})
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


def crypto_floor(loaded: cpki.Pki) -> Floor:
    """Time each piece of the server's per-join crypto on a realistic join."""
    now = datetime.now(UTC)
    node_key = pki.generate_key()
    csr_der = pki.make_csr(node_key)
    token = wire.JoinToken("jt_" + "0" * 26, base64.urlsafe_b64encode(os.urandom(32))[:43].decode())
    stored_hash = wire.secret_hash(token.secret)
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
    body = {
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
    wire.verify_response(
        wire.sign_response(body, loaded.join_signing_key),
        pki.spki_pin(loaded.join_signing_key.public_key()),
    )

    tls_server_share = make_tls_server_share()

    items = [
        (
            "open the seal (bcd.wire.open_seal: ECDH-ES, AES-KW unwrap, AES-GCM)",
            per_call_us(lambda: wire.open_seal(sealed, enc_key, enc_pin)),
        ),
        (
            "verify the CSR (bcd.pki.parse_csr: parse, ECDSA verify)",
            per_call_us(lambda: pki.parse_csr(csr_der)),
        ),
        (
            "issue the leaf (control.pki.issue_node_leaf: build, ECDSA sign)",
            per_call_us(
                lambda: cpki.issue_node_leaf(loaded, public, spiffe, "node", (), now, 86_400)
            ),
        ),
        (
            "sign the response (bcd.wire.sign_response: SHA-256, ECDSA sign)",
            per_call_us(lambda: wire.sign_response(body, loaded.join_signing_key)),
        ),
        (
            "token secret (bcd.wire.secret_matches: SHA-256, compare)",
            per_call_us(lambda: wire.secret_matches(token.secret, stored_hash)),
        ),
    ]
    extras = [
        (
            "seal primitives alone, no jwcrypto (ECDH, Concat KDF, AES-KW, AES-GCM)",
            per_call_us(lambda: open_seal_bare(sealed, enc_key)),
        ),
        (
            "TLS 1.3 handshake, server's share (X25519 keygen + agree, P-256 sign)",
            per_call_us(tls_server_share),
        ),
    ]
    return Floor(items, extras)


# --- output -------------------------------------------------------------------------


def print_floor(floor: Floor) -> None:
    print("\nCrypto floor per join (CPU µs, median of 5 rounds, in-process):")
    for name, us in floor.items:
        print(f"  {us:8.1f}  {name}")
    print(f"  {floor.total_us:8.1f}  = floor (sum)")
    print("  not in the floor, for reference:")
    for name, us in floor.extras:
        print(f"  {us:8.1f}  {name}")


def print_store(res: StoreResult) -> None:
    print(f"\n[{res.store}] {res.joins} joins, {res.ok} answered 200, {res.verified} verified")
    print(f"  nodes in the database: {res.nodes_in_db}; token uses left: {res.uses_left}")
    cpu = [("serve process", res.server_cpu_s), ("bench client", res.client_cpu_s)]
    if res.pg_cpu_s is not None:
        cpu.append(("postgres backends", res.pg_cpu_s))
    for what, spent in cpu:
        print(
            f"  {what} CPU: {spent * 1000 / res.joins:.3f} ms/join, "
            f"busy {spent / res.wall_s:.2f} cores over the run"
        )
    for what, count in res.failures.items():
        print(f"  FAILED x{count}: {what}")


def print_table(results: list[StoreResult], floor: Floor, concurrency: int) -> None:
    floor_ms = floor.total_us / 1000
    print(f"\nJoin throughput ({concurrency} concurrent clients, one TLS connection per join):")
    head = (
        f"{'store':<9} {'joins':>6} {'wall s':>8} {'joins/s':>8} "
        f"{'CPU ms/join':>12} {'floor ms/join':>14} {'CPU/floor':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.store:<9} {r.joins:>6} {r.wall_s:>8.2f} {r.joins_per_s:>8.1f} "
            f"{r.cpu_ms_per_join:>12.3f} {floor_ms:>14.3f} {r.cpu_ms_per_join / floor_ms:>10.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--joins", type=int, default=300, help="joins per store (default 300)")
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    args = parser.parse_args(argv)
    if not 1 <= args.joins <= 10_000:
        parser.error("--joins must be from 1 to 10000 (a token's maxUses limit)")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    kinds = ["sqlite", "postgres"] if args.store == "both" else [args.store]

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
        print_floor(floor)
        for kind in kinds:
            res = run_store(kind, args.joins, args.concurrency, tmp, template)
            print_store(res)
            results.append(res)
    print_table(results, floor, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
