"""Renewal throughput of a real control plane against the crypto floor of one renewal,
and the time from revokeIdentity to a real ``bcd node`` process exiting.

Run from the repository root::

    .venv/bin/python bench/renew.py [--nodes K] [--rounds R] [--concurrency C]
                                    [--store sqlite|postgres|both] [--trials T] [--batch B]

It prints figures and judges nothing; it is not part of the test suite. It shares
its helpers with ``bench/join.py`` through ``bench/common.py``.

What it measures:

1. **Renewal throughput of a real control plane**, per store (SQLite file;
   PostgreSQL at ``BCD_TEST_PG``, default ``postgresql://postgres@127.0.0.1:5432/test``,
   in a fresh schema dropped afterwards). A real ``better-compute serve`` is started
   as ``tests/e2e.py`` starts it, with the default certificate lifetime. K nodes
   (default 100) join first through the gateway exactly as ``bench/join.py`` joins
   them; the bench keeps each node's key and chain in memory. The gateway allows 6
   renewals per node and hour (``control.renewal.RENEWALS_PER_HOUR``), so each node
   renews R times (default 5, at most 5) and the K*R renewals are spread over the
   nodes: C concurrent trio tasks (default 8) take nodes from one round-robin queue,
   so no node ever renews twice at once, and each renewal presents the node's
   *current* chain and key, both as the TLS client certificate and in the request,
   as ``bcd.renew.gateway_renew_sender`` does: one mutual-TLS connection per renewal
   (``bcd.transport.pinned_transport`` with ``client_cert``), ``POST /v1/renew``.

   Pre-built before the clock starts, for every renewal: the next key, its CSR and
   the proof of possession (``bcd.renew.build_request``; the proof covers the CSR,
   the node id and the client time, not the chain, so only the chain is filled in
   at send time), and the keys' PEM. Client times are taken at build time and the
   control plane accepts them for 60 s: keep a run shorter than that. During the
   run an answer's new chain is read from the signed response without checking it;
   every answer is verified afterwards as bcd verifies it
   (``bcd.renew.verify_renewed``), and the renewals are counted in the database.
   A few separate warm-up nodes renew once each first (imports, connections).

   - ``wall s`` / ``renewals/s``: from the first connect to the last answer.
   - ``CPU ms/renewal``: the serve process's utime + stime (``/proc/<pid>/stat``)
     over the run, divided by the renewals: the TLS handshake with the client
     certificate, HTTP, JSON, the gateway's three transactions (the live-certificate
     check, the rate check, JoinService.Renew) and the database driver or engine.
     PostgreSQL's own backends are printed apart, as in ``bench/join.py``.

2. **The raw crypto floor of one renewal**, timed in-process in the same run
   (``time.process_time``, median of 5 rounds), with ``cryptography`` alone: the
   proof of possession's ECDSA verify, the CSR parsed and verified, the new leaf
   built and signed, the answer's JWS signing input signed, the proof's SHA-256, the
   server's share of checking the TLS client certificate (the leaf's signature under
   the node CA, the node CA's under the node root, the handshake's CertificateVerify
   under the leaf's key: three ECDSA verifies) and of the TLS 1.3 handshake (X25519,
   P-256 sign). Their sum is the floor; ``CPU/floor`` is control-plane CPU (serve
   plus PostgreSQL backends) over it. The project's own calls are printed beside it
   for reference. ``RenewService.renew`` alone in process (SQLite file) is printed
   too, with ``--profile`` (cProfile) and ``--instructions`` (callgrind, as in
   ``bench/join.py``).

3. **Revocation latency**, on SQLite only (the path under test is the gateway's
   revocation poller and the session, not the store's speed; one store is enough).
   T trials (default 100): each is a real ``bcd node`` subprocess with its own data
   directory and config (its node joined through the gateway by this bench, the
   identity stored with ``bcd.identity.persist_join``). B trials run at a time
   (default 10): their processes start, each is waited for until it logs
   ``session open`` on stderr; then each trial, at its own random instant within
   two poll intervals (so the revocations fall at random phases of the gateway's
   revocation poll), calls revokeIdentity through the API
   (``control.client.ApiClient``, ``POST /v1/tenants/{t}/nodes/{id}/revoke-identity``)
   and waits for the process to exit. The latency is from the start of that call to
   the process's exit (trio's process wait); the exit code must be 1 with
   ``agent: this node's certificate was revoked``. It covers the API call and its
   transaction, the wait for the gateway's next revocation poll, the
   RevocationNotice on the session stream, and bcd stopping its nursery, closing its
   journal and exiting. The certificates live the default lifetime here, so no
   renewal interferes.

On a small machine the bench client, PostgreSQL and the ``bcd node`` processes share
the cores with the server; each process's CPU and how many cores it kept busy are
printed. ``/proc`` counts CPU in clock ticks (10 ms): CPU per renewal is exact to
about 1% only from a few hundred renewals on.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature  # noqa: E402

from bcd import pki, wire  # noqa: E402
from bcd.config import Config, render_config  # noqa: E402
from bcd.identity import LoadedState, make_identity, persist_join  # noqa: E402
from bcd.issued import issued_identity  # noqa: E402
from bcd.join import verify_joined  # noqa: E402
from bcd.keys.file import generate_file_key, key_to_pem  # noqa: E402
from bcd.node import REVOKED_MESSAGE  # noqa: E402
from bcd.renew import RENEW_PATH, build_request, verify_renewed  # noqa: E402
from bench.common import (  # noqa: E402
    SERVER_NAME,
    Floor,
    Outcome,
    Throughput,
    build_bodies,
    count_failures,
    cprofile_shares,
    drive,
    instructions_per_op,
    make_tls_server_share,
    per_call_us,
    pg_backends_cpu_s,
    post_gateway,
    print_cpu,
    print_environment,
    print_floor,
    print_inprocess,
    print_instructions,
    print_table,
    proc_cpu_s,
    raw_csr_verify,
    raw_leaf,
    raw_sign,
    store_url,
)
from control import pki as cpki  # noqa: E402
from control.admission import CLOCK_SKEW_MS  # noqa: E402
from control.errors import ControlError  # noqa: E402
from control.gateway import REVOCATION_POLL_S  # noqa: E402
from control.proofs import proof_sha256  # noqa: E402
from control.renewal import RENEWALS_PER_HOUR  # noqa: E402
from tests.e2e import BIN, SECRET, TRUST_DOMAIN, ControlPlane, cli_env, make_pki  # noqa: E402

MAX_ROUNDS = RENEWALS_PER_HOUR - 1  # leave one renewal of the hour's budget unused
WARMUP_NODES = 8
CALLGRIND_SMALL, CALLGRIND_LARGE = 4, 24
JOIN_CONCURRENCY = 8
LEAF_TTL_S = 86_400
OPEN_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0


# --- joined nodes -------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One pre-built renewal: the request (its chain is filled in at send time)."""

    request: wire.RenewRequest = field(repr=False)
    next_key: ec.EllipticCurvePrivateKey = field(repr=False)
    next_key_pem: bytes = field(repr=False)


@dataclass
class Member:
    """A joined node as the bench holds it: its state at join, then its current chain."""

    state: LoadedState = field(repr=False)
    key_pem: bytes = field(repr=False)  # the current key
    chain: str = field(repr=False)  # the current chain
    steps: list[Step] = field(default_factory=list, repr=False)
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    @property
    def node_id(self) -> str:
        return self.state.identity.node_id


def join_members(
    cp: ControlPlane, pins: dict[str, str], pool: str, n: int, seed: int
) -> list[Member]:
    """Join ``n`` nodes through the gateway as bench/join.py does; keep key and chain."""
    jwk = cp.well_known()["join"]["encryptionJwk"]
    encryption_key = wire.public_key_of_jwk(jwk)
    token = cp.token(pool, maxUses=n)["token"]
    bodies = build_bodies(n, token, encryption_key, seed)
    outcomes, _ = trio.run(
        drive, cp.gateway_port, pins["serving_ca_spki_pin"], bodies, JOIN_CONCURRENCY
    )
    if any(o.status != 200 for o in outcomes):
        raise RuntimeError(f"joins failed: {count_failures(outcomes)}")
    members = []
    for prepared, outcome in zip(bodies, outcomes, strict=True):
        body = verify_joined(
            outcome.body.decode("ascii"),
            signing_pin=pins["join_signing_key_pin"],
            csr_der=prepared.csr_der,
            key=prepared.key.public_key(),
            role="node",
        )
        assert isinstance(body, wire.Issued), "the join did not answer joined"
        identity = issued_identity(body, "file")
        leaf = identity.leaf()
        state = LoadedState(
            data_dir=Path("."),  # held in memory only
            identity=identity,
            key=prepared.key,
            leaf=leaf,
            leaf_info=pki.leaf_info(leaf),
        )
        members.append(Member(state, key_to_pem(prepared.key), identity.chain))
    return members


def prepare_steps(members: list[Member], rounds: int) -> None:
    """Pre-build every renewal of every member, as bcd.renew.build_request builds it."""
    client_time_ms = int(time.time() * 1000)
    for member in members:
        key = member.state.key
        for _ in range(rounds):
            next_key = generate_file_key()
            _csr, req = build_request(
                dataclasses.replace(member.state, key=key), next_key, client_time_ms
            )
            member.steps.append(Step(req, next_key, key_to_pem(next_key)))
            key = next_key


def unverified_chain(signed: bytes) -> str:
    """The chain of a renewal answer, read without checking (that comes after the run)."""
    payload = signed.decode("ascii").split(".")[1]
    chain = json.loads(pki.b64url_decode(payload))["chain"]
    assert isinstance(chain, str)
    return chain


# --- driving renewals ---------------------------------------------------------------


async def renew_next(port: int, pin: str, member: Member) -> bool:
    """The member's next renewal over mutual TLS as its current identity; True if 200."""
    step = member.steps[len(member.outcomes)]
    body = wire.dumps(dataclasses.replace(step.request, chain=member.chain).to_json())
    outcome = await post_gateway(
        port, pin, RENEW_PATH, body, client_cert=(member.chain, member.key_pem)
    )
    member.outcomes.append(outcome)
    if outcome.status != 200:
        return False
    member.chain = unverified_chain(outcome.body)
    member.key_pem = step.next_key_pem
    return True


async def drive_renewals(port: int, pin: str, members: list[Member], concurrency: int) -> float:
    """Every pre-built renewal, ``concurrency`` at a time; return the wall time.

    One round-robin queue of nodes: a task takes a node, renews it once and puts it
    back at the end while it has renewals left, so a node never renews twice at once.
    A node whose renewal failed is not renewed again.
    """
    queue = collections.deque(i for i, m in enumerate(members) if m.steps)

    async def worker() -> None:
        while queue:
            i = queue.popleft()
            member = members[i]
            if await renew_next(port, pin, member) and len(member.outcomes) < len(member.steps):
                queue.append(i)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - start


def verified_renewals(members: list[Member], signing_pin: str) -> int:
    """Check every 200 answer as bcd does (bcd.renew.verify_renewed); count them."""
    verified = 0
    for member in members:
        for step, outcome in zip(member.steps, member.outcomes, strict=False):
            if outcome.status != 200:
                continue
            verify_renewed(
                outcome.body.decode("ascii"),
                signing_pin=signing_pin,
                csr_der=step.request.csr_der,
                key=step.next_key.public_key(),
                current=member.state.leaf_info,
            )
            verified += 1
    return verified


@dataclass
class StoreResult:
    store: str
    nodes: int
    renewals: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    pg_cpu_s: float | None
    ok: int
    verified: int
    in_db: int
    failures: dict[str, int]

    @property
    def renewals_per_s(self) -> float:
        return self.renewals / self.wall_s

    @property
    def cpu_ms_per_renewal(self) -> float:
        return self.server_cpu_s * 1000 / self.renewals

    @property
    def cp_ms_per_renewal(self) -> float:
        """The control plane's CPU per renewal: serve, and its PostgreSQL backends."""
        return (self.server_cpu_s + (self.pg_cpu_s or 0.0)) * 1000 / self.renewals


def run_store(
    kind: str, n_nodes: int, rounds: int, concurrency: int, tmp: Path, template: Path
) -> StoreResult:
    home = tmp / f"cp-{kind}"
    home.mkdir()
    app_name = f"bcdbench_{secrets.token_hex(4)}"
    db_dir = tmp / f"db-{kind}"
    db_dir.mkdir()
    with store_url(kind, db_dir, app_name) as url:
        cp = ControlPlane.start(home, template, url)
        try:
            return _measure(
                kind, cp, n_nodes, rounds, concurrency, app_name if kind == "postgres" else None
            )
        finally:
            cp.stop()


def _measure(
    kind: str, cp: ControlPlane, n_nodes: int, rounds: int, concurrency: int, app_name: str | None
) -> StoreResult:
    pins = cp.pins()
    serving_pin = pins["serving_ca_spki_pin"]
    _site, pool = cp.site_and_pool()
    warm = join_members(cp, pins, pool, WARMUP_NODES, seed=1)
    members = join_members(cp, pins, pool, n_nodes, seed=2)

    prepare_steps(warm, 1)
    trio.run(drive_renewals, cp.gateway_port, serving_pin, warm, concurrency)
    warm_outcomes = [o for m in warm for o in m.outcomes]
    if any(o.status != 200 for o in warm_outcomes):
        raise RuntimeError(f"warm-up renewals failed: {count_failures(warm_outcomes)}")

    prepare_steps(members, rounds)
    pg_before = pg_backends_cpu_s(app_name) if app_name else None
    server_before = proc_cpu_s(cp.proc.pid)
    client_before = time.process_time()
    wall = trio.run(drive_renewals, cp.gateway_port, serving_pin, members, concurrency)
    client_cpu = time.process_time() - client_before
    server_cpu = proc_cpu_s(cp.proc.pid) - server_before
    pg_after = pg_backends_cpu_s(app_name) if app_name else None
    pg_cpu = None
    if pg_before is not None and pg_after is not None:
        pg_cpu = sum(cpu - pg_before.get(pid, 0.0) for pid, cpu in pg_after.items())

    outcomes = [o for m in members for o in m.outcomes]
    rows = cp.one("SELECT COUNT(*) AS n FROM renewals")
    return StoreResult(
        store=kind,
        nodes=n_nodes,
        renewals=len(outcomes),
        wall_s=wall,
        server_cpu_s=server_cpu,
        client_cpu_s=client_cpu,
        pg_cpu_s=pg_cpu,
        ok=sum(1 for o in outcomes if o.status == 200),
        verified=verified_renewals(members, pins["join_signing_key_pin"]),
        in_db=int(rows["n"]) - WARMUP_NODES if rows else -1,
        failures=count_failures(outcomes),
    )


# --- the crypto floor ---------------------------------------------------------------


Ops = list[tuple[str, Callable[[], object]]]


def renew_ops(loaded: cpki.Pki) -> tuple[Ops, Ops]:
    """The raw floor's pieces of one realistic renewal, and the project's calls for them."""
    now = datetime.now(UTC)
    site_id, node_id = "site_" + "1" * 26, "node_" + "2" * 26
    spiffe = pki.SpiffeId(loaded.trust_domain, site_id, node_id)
    node_key = generate_file_key()
    leaf = cpki.issue_node_leaf(loaded, node_key.public_key(), spiffe, "node", (), now, LEAF_TTL_S)
    joined = {
        "chain": pki.cert_pem(leaf) + loaded.chain_tail_pem(),
        "bundle": loaded.bundle_pem(),
        "trust_version": loaded.trust_version,
        "server_time": int(now.timestamp() * 1000),
        "identity_generation": 1,
    }
    identity = make_identity(
        chain=str(joined["chain"]),
        bundle=str(joined["bundle"]),
        trust_version=loaded.trust_version,
        server_time=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        key="file",
        identity_generation=1,
    )
    state = LoadedState(Path("."), identity, node_key, leaf, pki.leaf_info(leaf))
    next_key = generate_file_key()
    csr_der, req = build_request(state, next_key, int(now.timestamp() * 1000))
    leaf_key = leaf.public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
    new_public = pki.csr_public_key(pki.parse_csr(csr_der))
    new_leaf = cpki.issue_node_leaf(loaded, new_public, spiffe, "node", (), now, LEAF_TTL_S)
    body = {
        **joined,
        "kind": "renewed",
        "node_id": node_id,
        "site_id": site_id,
        "role": "node",
        "trust_domain": loaded.trust_domain,
        "chain": pki.cert_pem(new_leaf) + loaded.chain_tail_pem(),
        "csr_sha256": pki.sha256_hex(csr_der),
    }
    signing_pin = pki.spki_pin(loaded.join_signing_key.public_key())
    verify_renewed(
        wire.sign_response(body, loaded.join_signing_key),
        signing_pin=signing_pin,
        csr_der=csr_der,
        key=next_key.public_key(),
        current=state.leaf_info,
    )

    def verify_pop() -> None:
        message = pki.renew_pop_message(req.csr_der, node_id, req.client_time_ms)
        pki.verify_p1363(leaf_key, req.pop_sig, message)

    verify_pop()  # raises if the proof does not verify
    node_ca, node_root = loaded.node_ca, loaded.node_root_ca
    transcript = b"\x20" * 64 + b"TLS 1.3, client CertificateVerify\x00" + bytes(32)
    certificate_verify = node_key.sign(transcript, ec.ECDSA(hashes.SHA256()))

    def tls_client_cert_share() -> None:
        leaf.verify_directly_issued_by(node_ca)
        node_ca.verify_directly_issued_by(node_root)
        leaf_key.verify(certificate_verify, transcript, ec.ECDSA(hashes.SHA256()))

    tls_client_cert_share()  # raises if the chain does not verify
    pop_der = encode_dss_signature(
        int.from_bytes(req.pop_sig[:32], "big"), int.from_bytes(req.pop_sig[32:], "big")
    )
    pop_message = pki.renew_pop_message(req.csr_der, node_id, req.client_time_ms)
    signed = wire.sign_response(body, loaded.join_signing_key)
    signing_input = signed.rsplit(".", 1)[0].encode("ascii")

    def raw_pop() -> None:
        leaf_key.verify(pop_der, pop_message, ec.ECDSA(hashes.SHA256()))

    uri = str(spiffe)
    items: Ops = [
        ("verify the proof (ECDSA P-256 verify over the pop message)", raw_pop),
        (
            "verify the CSR (parse, ECDSA P-256 verify)",
            (lambda: raw_csr_verify(csr_der)),
        ),
        (
            "issue the leaf (x509 builder, ECDSA P-256 sign)",
            (lambda: raw_leaf(node_ca, loaded.node_ca_key, new_public, uri, "bc-role:node")),
        ),
        (
            f"sign the response ({len(signing_input)} B: SHA-256, ECDSA P-256 sign)",
            (lambda: raw_sign(loaded.join_signing_key, signing_input)),
        ),
        (
            "SHA-256 of the proof",
            (lambda: hashlib.sha256(req.pop_sig).hexdigest()),
        ),
        (
            "TLS client certificate, server's share (leaf and node CA signatures, "
            "CertificateVerify: 3 ECDSA verifies)",
            tls_client_cert_share,
        ),
        (
            "TLS 1.3 handshake, server's share (X25519 keygen + agree, P-256 sign)",
            make_tls_server_share(),
        ),
    ]
    extras: Ops = [
        (
            "bcd.pki.renew_pop_message + verify_p1363",
            verify_pop,
        ),
        ("bcd.pki.parse_csr", (lambda: pki.parse_csr(csr_der))),
        (
            "control.pki.issue_node_leaf",
            (lambda: cpki.issue_node_leaf(loaded, new_public, spiffe, "node", (), now, LEAF_TTL_S)),
        ),
        (
            "bcd.wire.sign_response (with its JSON)",
            (lambda: wire.sign_response(body, loaded.join_signing_key)),
        ),
        ("control.renewal.proof_sha256", (lambda: proof_sha256(req.pop_sig))),
    ]
    return items, extras


def renew_floor(loaded: cpki.Pki) -> Floor:
    """Time each piece of the raw floor, and the project's calls, in this process."""
    items, extras = renew_ops(loaded)
    return Floor(
        [(name, per_call_us(fn)) for name, fn in items],
        [(name, per_call_us(fn)) for name, fn in extras],
    )


# --- revocation latency -------------------------------------------------------------


@dataclass(frozen=True)
class AgentNode:
    node_id: str
    root: Path
    config: Path


def make_agent_nodes(cp: ControlPlane, root: Path, n: int) -> list[AgentNode]:
    """Join ``n`` nodes; give each a data directory with its identity and a config.toml."""
    pins = cp.pins()
    site, pool = cp.site_and_pool()
    members = join_members(cp, pins, pool, n, seed=3)
    now = datetime.now(UTC)
    nodes = []
    for i, member in enumerate(members):
        home = root / f"node-{i:03d}"
        data = home / "data"
        persist_join(data, member.state.identity, member.key_pem, now)
        cfg = Config(
            path=home / "config.toml",
            gateway_url=f"https://{SERVER_NAME}:{cp.gateway_port}",
            site=site,
            serving_ca_spki_pin=pins["serving_ca_spki_pin"],
            join_signing_key_pin=pins["join_signing_key_pin"],
            join_encryption_key_pin=pins["join_encryption_key_pin"],
            server_name=SERVER_NAME,
            data_dir=data,
        )
        cfg.path.write_text(render_config(cfg))
        nodes.append(AgentNode(member.node_id, home, cfg.path))
    return nodes


@dataclass
class Trial:
    node_id: str
    api_s: float | None = None  # the revokeIdentity call, start to answer
    exit_s: float | None = None  # the call's start to the process's exit
    notice_at: float | None = None  # when ``certificate revoked`` reached its stderr
    code: int | None = None
    error: str | None = None
    start: float = 0.0  # perf_counter at the call's start
    stderr: bytes = field(default=b"", repr=False)


class Arrivals:
    """A one-shot barrier: everyone waits until ``n`` have arrived."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.all_here = trio.Event()

    def arrive(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.all_here.set()


async def one_trial(
    node: AgentNode,
    trial: Trial,
    cp: ControlPlane,
    arrivals: Arrivals,
    delay_s: float,
) -> None:
    """Start ``bcd node``, wait for its session, revoke it after ``delay_s``, time its exit."""
    api = cp.client()
    path = f"/v1/tenants/{cp.root_tenant}/nodes/{node.node_id}/revoke-identity"
    proc = await trio.lowlevel.open_process(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(node.root),
    )
    stderr = bytearray()
    opened = trio.Event()

    async def pump() -> None:
        assert proc.stderr is not None
        async for chunk in proc.stderr:
            stderr.extend(chunk)
            if b"session open" in stderr:
                opened.set()
            if trial.notice_at is None and b"certificate revoked" in stderr:
                trial.notice_at = time.perf_counter()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            try:
                with trio.move_on_after(OPEN_TIMEOUT_S):
                    await opened.wait()
            finally:
                arrivals.arrive()
            if not opened.is_set():
                trial.error = "the session did not open"
                proc.kill()
                return
            await arrivals.all_here.wait()
            await trio.sleep(delay_s)
            start = trial.start = time.perf_counter()
            try:
                await trio.to_thread.run_sync(api.call, "POST", path, {"reason": "bench"})
            except ControlError as exc:
                trial.error = f"revokeIdentity failed: {exc.code}: {exc}"
                proc.kill()
                return
            trial.api_s = time.perf_counter() - start
            with trio.move_on_after(EXIT_TIMEOUT_S):
                trial.code = await proc.wait()
                trial.exit_s = time.perf_counter() - start
            if trial.code is None:
                trial.error = "the process did not exit"
                proc.kill()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        trial.stderr = bytes(stderr)
    if trial.code != 1:
        trial.error = f"exit code {trial.code}, not 1"
    elif REVOKED_MESSAGE.encode() not in trial.stderr:
        trial.error = "exited 1 without the revocation message"


async def run_trials(
    cp: ControlPlane, nodes: list[AgentNode], batch: int, seed: int
) -> tuple[list[Trial], float]:
    """Every node's trial, ``batch`` at a time; return the trials and the wall time."""
    rng = random.Random(seed)
    trials = [Trial(node.node_id) for node in nodes]
    start = time.perf_counter()
    for first in range(0, len(nodes), batch):
        group = range(first, min(first + batch, len(nodes)))
        arrivals = Arrivals(len(group))
        async with trio.open_nursery() as nursery:
            for i in group:
                delay = rng.uniform(0, 2 * REVOCATION_POLL_S)
                nursery.start_soon(one_trial, nodes[i], trials[i], cp, arrivals, delay)
    return trials, time.perf_counter() - start


@dataclass
class LatencyResult:
    trials: list[Trial]
    batch: int
    wall_s: float
    serve_cpu_s: float

    @property
    def good(self) -> list[Trial]:
        return [t for t in self.trials if t.error is None and t.exit_s is not None]


def run_latency(trials: int, batch: int, tmp: Path, template: Path) -> LatencyResult:
    home = tmp / "cp-latency"
    home.mkdir()
    db_dir = tmp / "db-latency"
    db_dir.mkdir()
    with store_url("sqlite", db_dir, "unused") as url:
        cp = ControlPlane.start(home, template, url)
        try:
            nodes = make_agent_nodes(cp, tmp / "agents", trials)
            server_before = proc_cpu_s(cp.proc.pid)
            results, wall = trio.run(run_trials, cp, nodes, batch, 4)
            serve_cpu = proc_cpu_s(cp.proc.pid) - server_before
        finally:
            cp.stop()
    return LatencyResult(results, batch, wall, serve_cpu)


# --- output -------------------------------------------------------------------------


def print_store(res: StoreResult) -> None:
    print(
        f"\n[{res.store}] {res.nodes} nodes, {res.renewals} renewals, "
        f"{res.ok} answered 200, {res.verified} verified; renewals in the database: {res.in_db}"
    )
    cpu = [("serve process", res.server_cpu_s), ("bench client", res.client_cpu_s)]
    if res.pg_cpu_s is not None:
        cpu.append(("postgres backends", res.pg_cpu_s))
    print_cpu(cpu, res.renewals, "renewal", res.wall_s, res.failures)


# --- in process: RenewService alone on a SQLite file ---------------------------------


def inprocess_env(tmp: Path, n: int) -> tuple[Any, list[tuple[bytes, bytes]]]:
    """An Env (tests/world/renewals.py) on a fresh SQLite file; n joined nodes' bodies."""
    from control.store import open_store
    from tests.world.renewals import make_env

    store = open_store(f"sqlite:///{tmp / 'inprocess.db'}")
    store.migrate()
    env = make_env(store, cpki.build_pki(TRUST_DOMAIN, datetime.now(UTC)))
    nodes = [env.join(i) for i in range(n + WARMUP_NODES)]
    bodies = [(env.body(node).body, node.der) for node in nodes]
    for body, der in bodies[:WARMUP_NODES]:
        env.renewals.renew(body, der)
    return env, bodies[WARMUP_NODES:]


def inprocess_renewals(tmp: Path, n: int, profile: bool) -> tuple[float, list[Any]]:
    env, bodies = inprocess_env(tmp, n)
    start = time.process_time()
    for body, der in bodies:
        env.renewals.renew(body, der)
    ms = (time.process_time() - start) * 1000 / n
    shares: list[Any] = []
    if profile:
        (tmp / "profiled").mkdir()
        env2, bodies2 = inprocess_env(tmp / "profiled", n)

        def run() -> None:
            for body, der in bodies2:
                env2.renewals.renew(body, der)

        shares = cprofile_shares(run)
    return ms, shares


def callgrind_loop(what: str, n: int) -> None:
    """What ``--callgrind`` runs under valgrind: the same set-up, then n renewals or n
    floors (the floor's pieces once each, as ``renew_floor`` times them)."""
    with tempfile.TemporaryDirectory(prefix="bcd-bench-cg-") as name:
        env, bodies = inprocess_env(Path(name), CALLGRIND_LARGE)
        if what == "renew":
            for body, der in bodies[:n]:
                env.renewals.renew(body, der)
            return
        ops, _ = renew_ops(env.pki)
        for _ in range(n):
            for _name, fn in ops:
                fn()


def print_latency(res: LatencyResult) -> None:
    good = res.good
    print(
        f"\nRevocation latency, SQLite only (revokeIdentity call to `bcd node` exit; "
        f"{len(res.trials)} trials, {res.batch} at a time, gateway revocation poll every "
        f"{REVOCATION_POLL_S:g} s):"
    )
    if good:
        exits = sorted(t.exit_s for t in good if t.exit_s is not None)
        apis = sorted(t.api_s for t in good if t.api_s is not None)
        p90 = exits[min(len(exits) - 1, int(len(exits) * 0.9))]
        print(
            f"  to exit:  median {statistics.median(exits) * 1000:7.1f} ms, "
            f"worst {exits[-1] * 1000:7.1f} ms  (best {exits[0] * 1000:.1f} ms, "
            f"p90 {p90 * 1000:.1f} ms, mean {statistics.fmean(exits) * 1000:.1f} ms)"
        )
        print(
            f"  the API call alone: median {statistics.median(apis) * 1000:.1f} ms, "
            f"worst {apis[-1] * 1000:.1f} ms"
        )
        notices = sorted(t.notice_at - t.start for t in good if t.notice_at is not None)
        stops = sorted(
            t.start + t.exit_s - t.notice_at
            for t in good
            if t.notice_at is not None and t.exit_s is not None
        )
        if notices and stops:
            print(
                f"  call to bcd logging 'certificate revoked': median "
                f"{statistics.median(notices) * 1000:.1f} ms, worst {notices[-1] * 1000:.1f} ms"
            )
            print(
                f"  that log line to the process's exit: median "
                f"{statistics.median(stops) * 1000:.1f} ms, worst {stops[-1] * 1000:.1f} ms"
            )
    print(
        f"  {len(good)} of {len(res.trials)} exited 1 with {REVOKED_MESSAGE!r}; "
        f"wall {res.wall_s:.1f} s, serve process CPU {res.serve_cpu_s:.2f} s"
    )
    failures: dict[str, int] = {}
    for t in res.trials:
        if t.error is not None:
            failures[t.error] = failures.get(t.error, 0) + 1
    for what, count in failures.items():
        print(f"  FAILED x{count}: {what}")
    for t in res.trials:
        if t.error is not None:
            tail = t.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            print(f"  first failure ({t.node_id}): " + " | ".join(tail))
            break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=100, help="nodes that renew (default 100)")
    parser.add_argument(
        "--rounds", type=int, default=MAX_ROUNDS, help=f"renewals per node (1-{MAX_ROUNDS})"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent renewal clients")
    parser.add_argument("--store", choices=("sqlite", "postgres", "both", "none"), default="both")
    parser.add_argument(
        "--trials", type=int, default=100, help="revocation trials, 0 to skip (default 100)"
    )
    parser.add_argument("--batch", type=int, default=10, help="revocation trials at a time")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile RenewService.renew in process"
    )
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions under callgrind"
    )
    parser.add_argument("--callgrind", nargs=2, metavar=("WHAT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.callgrind:
        callgrind_loop(args.callgrind[0], int(args.callgrind[1]))
        return 0
    if not 1 <= args.nodes <= 2000:
        parser.error("--nodes must be from 1 to 2000")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(
            f"--rounds must be from 1 to {MAX_ROUNDS}: the gateway allows "
            f"{RENEWALS_PER_HOUR} renewals per node and hour"
        )
    if args.concurrency < 1 or args.batch < 1 or args.trials < 0:
        parser.error("--concurrency and --batch must be at least 1, --trials at least 0")
    kinds = {"both": ["sqlite", "postgres"], "none": []}.get(args.store, [args.store])

    print_environment()
    results: list[StoreResult] = []
    latency = None
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        loaded = cpki.load_pki(template / "pki", SECRET.encode("utf-8"))
        assert loaded.trust_domain == TRUST_DOMAIN
        floor = renew_floor(loaded)
        print_floor(floor, "renewal")
        (tmp / "inprocess").mkdir()
        ms, shares = inprocess_renewals(tmp / "inprocess", args.nodes, args.profile)
        print_inprocess(
            "RenewService.renew",
            "SQLite file, no TLS/HTTP, no gateway checks",
            "renewal",
            ms,
            floor,
            shares,
        )
        for kind in kinds:
            res = run_store(kind, args.nodes, args.rounds, args.concurrency, tmp, template)
            print_store(res)
            if res.wall_s * 1000 > CLOCK_SKEW_MS:
                print("  (the run outlasted the 60 s clock-skew window: use fewer renewals)")
            results.append(res)
        if args.trials:
            latency = run_latency(args.trials, args.batch, tmp, template)
    if results:
        print_table(
            f"Renewal throughput ({args.concurrency} concurrent clients, "
            "one mutual-TLS connection per renewal)",
            [
                Throughput(r.store, r.renewals, r.wall_s, r.renewals_per_s, r.cp_ms_per_renewal)
                for r in results
            ],
            floor,
            "renewal",
            "TLS shares included",
        )
    if latency is not None:
        print_latency(latency)
    if args.instructions:
        script = str(Path(__file__).resolve())
        print_instructions(
            "RenewService.renew (SQLite, no TLS/HTTP)",
            instructions_per_op(script, "renew", CALLGRIND_SMALL, CALLGRIND_LARGE),
            instructions_per_op(script, "floor", CALLGRIND_SMALL, CALLGRIND_LARGE),
            "TLS shares included",
            (CALLGRIND_LARGE, CALLGRIND_SMALL),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
