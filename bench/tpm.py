"""Join and renewal times with the node key in a TPM beside the file-key path, and
the round trip of one signature through ``bcd helper``.

Run from the repository root (as root: ``bcd helper`` runs as root)::

    .venv/bin/python bench/tpm.py [--joins N] [--renewals R] [--signs S]

It prints figures and judges nothing; it is not part of the test suite. Everything
runs against a swtpm it provisions in a temporary directory (``tests/swtpm.py``: a
local EK CA, EK certificates in NV) and a real ``better-compute serve`` on SQLite
started as ``tests/test_e2e_tpm.py`` starts it (``--tpm-ek-ca`` the swtpm's CA
bundle, ``--tpm-pool`` a pool made before the start). The swtpm serves one
connection at a time, so the phases below use it one after the other. All figures
are wall time (``time.perf_counter``) of sequential calls: no concurrency.

1. **Join**, N sequential joins each (default 25, after 2 warm-up joins each),
   driven in-process with bcd's own functions (``bcd.join.join`` with the loaded
   attestor plugins, ``bcd.join.gateway_sender``: one pinned TLS connection per
   request) against the real gateway:

   - *token, file key*: ``bench/join.py``'s path, one request: a fresh P-256 key
     (``bcd.keys.file.generate_file_key``), then ``join`` (CSR, sealed token,
     distinct hardware claims per join, verify the answer);
   - *tpm*: ``bcd join --attestor tpm`` as ``bcd.joinplan`` does it: the node key made
     in the TPM (``bcd.joinplan._tpm_node_key``: a new record, the key derived, pinned,
     derived again, the CSR signed by the TPM), then ``join``: the evidence (EK
     kind, EK certificate from NV, EK and AK public areas), the gateway's
     JoinChallenge (MakeCredential), ActivateCredential and TPM2_Certify of the node
     key over sha256(csr), the second request. The same machine joins every time, so
     every join after the first reclaims its node (as a machine joining again does).

   The TPM's share is the time spent inside ``bcd.tpm.device.open_tpm`` blocks (the
   ESAPI connection and its leftover flush included), counted by wrapping that one
   function for the run; everything the node does with the TPM runs in such a block.

2. **Renewal**, measured end to end with ``bcd.renew.renew_once`` as ``bcd node``'s
   renewal task calls it (``gateway_renew_sender``: a new mutual-TLS connection per
   renewal; the answer verified; the new identity stored on disk), M sequential
   renewals each (default 20, after 2 warm-up renewals) of two nodes, one after the
   other:

   - *file key*: a node token-joined with a file key, renewing with a file key;
   - *tpm*: the swtpm's machine tpm-joined once more (the AK-bound leaf names the
     AK, ``urn:bc:tpm-ak:``), renewing through a real ``bcd helper`` subprocess
     (root) as ``bcd node`` under ``[helper]`` does (``HelperKeys``, ``load_identity``
     through the helper): the AK checked, the next key derived and its CSR signed in
     the TPM, the proof of possession signed by the current TPM key, the next key
     certified by the AK, and the TLS handshake's CertificateVerify signed by the
     current TPM key through the helper (``bcd.tls_signer``).

   The control plane allows 6 renewals per node and hour
   (``control.renewal.RENEWALS_PER_HOUR``): between rounds of 6 the bench deletes the
   node's rows from the ``renewals`` table of its own SQLite store (outside the timed
   calls). Split out: the mutual-TLS handshake (``bcd.session.open_gateway``, wrapped
   for the run) and the time inside helper calls (``HelperClient`` methods of the
   node's client, wrapped), before the request and within the handshake.

   Kept beside it, as parts: the file-key renewal as ``bench/renew.py`` times it (R
   nodes joined through the gateway, each renewing once, over mutual TLS with the
   request pre-built, ``--renewals``), the file-key client work it pre-builds
   (``bcd.renew.build_request``), and each TPM operation of a TPM renewal through
   ``bcd helper``, one kind at a time: deriving the next key (``tpm.nodekey``),
   signing its CSR and the proof of possession (``tpm.sign``), loading the AK
   (``tpm.ak``) and certifying the next key (``tpm.certify``), plus the server's check
   of that attestation (``bcd.tpm.verify.verify_certify``).

3. **One signature through the helper**: S calls (default 200) of
   ``HelperClient.sign`` against a real ``bcd helper`` subprocess on a Unix socket
   (the client checks each signature, as ``bcd node`` does), beside
   ``bcd.tpm.nodekey.sign`` called directly on one open connection to the same swtpm
   and a software P-256 sign of the same digest (``cryptography``), so the socket,
   JSON and process hop overhead is the difference. Every TPM signature derives the
   key (CreatePrimary) before signing and flushes it after, in both paths.

swtpm is a software TPM on the same machine: a hardware TPM is much slower per
command (tens to hundreds of milliseconds for CreatePrimary of an ECC key), so the
TPM shares here are a lower bound.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed  # noqa: E402

import bcd.renew  # noqa: E402
import bcd.tpm.device  # noqa: E402
from bcd import pki, wire  # noqa: E402
from bcd.attestor_api import JOIN_TOKEN  # noqa: E402
from bcd.config import Config, HelperConfig, TpmConfig, render_config  # noqa: E402
from bcd.helper.client import HelperClient  # noqa: E402
from bcd.helper.nodekeys import HelperKeys  # noqa: E402
from bcd.identity import AnyState, LoadedTpmState, persist_join  # noqa: E402
from bcd.join import join  # noqa: E402
from bcd.joinplan import _tpm_node_key  # noqa: E402
from bcd.keys.file import generate_file_key, key_to_pem  # noqa: E402
from bcd.node import load_identity  # noqa: E402
from bcd.plugins import Plugins, load_plugins  # noqa: E402
from bcd.renew import build_request, gateway_renew_sender, renew_once  # noqa: E402
from bcd.tpm.ak import ak_public, certify  # noqa: E402
from bcd.tpm.nodekey import (  # noqa: E402
    create_node_key_record,
    derive_node_key,
    public_key_of,
    sign,
)
from bcd.tpm.record import NodeKeyRecord  # noqa: E402
from bcd.tpm.verify import verify_certify  # noqa: E402
from bench.common import (  # noqa: E402
    SERVER_NAME,
    machine_claims,
    ms_summary,
    print_environment,
)
from bench.renew import Member, join_members, prepare_steps, renew_next  # noqa: E402
from control.renewal import RENEWALS_PER_HOUR  # noqa: E402
from tests.e2e import BIN, ControlPlane, cli_env, make_pki  # noqa: E402
from tests.swtpm import QUIET_TSS2_LOG, SwTpm, missing_tools  # noqa: E402
from tests.world import E2EWorld  # noqa: E402

WARMUP = 2
TPM_ATTESTOR = "tpm"
HELPER_START_S = 20.0
PHASES = {
    "_tpm_node_key": "key, pin, key, CSR sign",
    "bcd_node_evidence": "evidence, per request",
    "bcd_node_answer": "activate + certify",
}


def collect(n: int, fn: Callable[[], object]) -> list[float]:
    """Wall seconds of ``n`` sequential calls of ``fn``."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


async def acollect(n: int, fn: Callable[[], object]) -> list[float]:
    """Wall seconds of ``n`` sequential awaits of ``fn()``."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()  # type: ignore[misc]
        out.append(time.perf_counter() - start)
    return out


# --- the TPM's share ---------------------------------------------------------------


@dataclass
class TpmClock:
    """Wall seconds spent inside ``open_tpm`` blocks, by the function that opened them."""

    blocks: list[tuple[str, float]] = field(default_factory=list)

    def take(self) -> list[tuple[str, float]]:
        out, self.blocks = self.blocks, []
        return out


@contextlib.contextmanager
def counting_tpm_time(clock: TpmClock) -> Iterator[None]:
    """Wrap ``bcd.tpm.device.open_tpm`` (its callers import it at call time)."""
    original = bcd.tpm.device.open_tpm

    @contextlib.contextmanager
    def block(tcti: str, caller: str) -> Iterator[bcd.tpm.device.Tpm]:
        start = time.perf_counter()
        try:
            with original(tcti) as tpm:
                yield tpm
        finally:
            clock.blocks.append((caller, time.perf_counter() - start))

    def timed(tcti: str) -> contextlib.AbstractContextManager[bcd.tpm.device.Tpm]:
        return block(tcti, sys._getframe(1).f_code.co_name)

    bcd.tpm.device.open_tpm = timed  # type: ignore[assignment]
    try:
        yield
    finally:
        bcd.tpm.device.open_tpm = original  # type: ignore[assignment]


# --- joins ------------------------------------------------------------------------


@dataclass
class JoinRun:
    total: list[float] = field(default_factory=list)  # key + join()
    key: list[float] = field(default_factory=list)  # making the key (and CSR for the TPM)
    tpm: list[float] = field(default_factory=list)  # inside open_tpm, key + join()
    by_caller: dict[str, list[float]] = field(default_factory=dict)  # per join, summed
    blocks_by_caller: dict[str, int] = field(default_factory=dict)  # over the run
    opens: int = 0
    reclaims: int = 0


def node_config(cp: ControlPlane, site: str, pins: dict[str, str], tmp: Path, tcti: str) -> Config:
    return Config(
        path=tmp / "node" / "config.toml",
        gateway_url=f"https://{SERVER_NAME}:{cp.gateway_port}",
        site=site,
        serving_ca_spki_pin=pins["serving_ca_spki_pin"],
        join_signing_key_pin=pins["join_signing_key_pin"],
        join_encryption_key_pin=pins["join_encryption_key_pin"],
        server_name=SERVER_NAME,
        data_dir=tmp / "node" / "data",
        tpm=TpmConfig(mode="required", tcti=tcti),
    )


async def token_joins(
    cfg: Config,
    plugins: Plugins,
    token: str,
    encryption_key: ec.EllipticCurvePublicKey,
    n: int,
    seed: int,
) -> JoinRun:
    rng = random.Random(seed)
    run = JoinRun()
    for i in range(n):
        start = time.perf_counter()
        key = generate_file_key()
        keyed = time.perf_counter()
        joined = await join(
            cfg,
            plugins,
            attestor=JOIN_TOKEN,
            role="node",
            credential=token,
            encryption_key=encryption_key,
            claims=machine_claims(rng, seed, i),
            key=key,
            attempts=1,
        )
        end = time.perf_counter()
        run.total.append(end - start)
        run.key.append(keyed - start)
        run.reclaims += joined.identity.identity_generation > 1
    return run


async def tpm_joins(cfg: Config, plugins: Plugins, n: int, clock: TpmClock) -> JoinRun:
    claims = machine_claims(random.Random(7), 7, 0)  # one machine, joining again and again
    run = JoinRun()
    clock.take()
    for _ in range(n):
        start = time.perf_counter()
        held = _tpm_node_key(cfg)
        keyed = time.perf_counter()
        joined = await join(
            cfg,
            plugins,
            attestor=TPM_ATTESTOR,
            role="node",
            credential=None,
            encryption_key=None,
            claims=claims,
            key=held,
            attempts=1,
        )
        end = time.perf_counter()
        blocks = clock.take()
        run.total.append(end - start)
        run.key.append(keyed - start)
        run.tpm.append(sum(spent for _, spent in blocks))
        run.opens += len(blocks)
        per_join: dict[str, float] = {}
        for caller, spent in blocks:
            per_join[caller] = per_join.get(caller, 0.0) + spent
            run.blocks_by_caller[caller] = run.blocks_by_caller.get(caller, 0) + 1
        for caller, spent in per_join.items():
            run.by_caller.setdefault(caller, []).append(spent)
        run.reclaims += joined.identity.identity_generation > 1
        if joined.identity.key != "tpm":
            raise RuntimeError("a tpm join did not give a TPM-keyed identity")
    return run


def run_joins(
    cp: ControlPlane, site: str, pool: str, tmp: Path, tcti: str, n: int
) -> tuple[JoinRun, JoinRun]:
    pins = cp.pins()
    cfg = node_config(cp, site, pins, tmp, tcti)
    plugins = load_plugins()
    if plugins.failures:
        raise RuntimeError(f"attestor plugins did not load: {plugins.failures}")
    encryption_key = wire.public_key_of_jwk(cp.well_known()["join"]["encryptionJwk"])
    if not pki.pins_equal(pki.spki_pin(encryption_key), pins["join_encryption_key_pin"]):
        raise RuntimeError("the well-known encryption key does not match its pin")
    token = cp.token(pool, maxUses=n + WARMUP)["token"]
    clock = TpmClock()
    trio.run(token_joins, cfg, plugins, token, encryption_key, WARMUP, 1)
    token_run = trio.run(token_joins, cfg, plugins, token, encryption_key, n, 2)
    with counting_tpm_time(clock):
        trio.run(tpm_joins, cfg, plugins, WARMUP, clock)
        tpm_run = trio.run(tpm_joins, cfg, plugins, n, clock)
    return token_run, tpm_run


# --- file-key renewals --------------------------------------------------------------


@dataclass
class RenewRun:
    round_trip: list[float]  # the request pre-built, as bench/renew.py times it
    client_build: list[float]  # next key, CSR, proof of possession
    ok: int


def run_file_renewals(cp: ControlPlane, pool: str, n: int) -> RenewRun:
    """``n`` nodes join, then each renews once, one after the other, timed one by one."""
    pins = cp.pins()
    serving_pin = pins["serving_ca_spki_pin"]
    warm = join_members(cp, pins, pool, WARMUP, seed=11)
    members = join_members(cp, pins, pool, n, seed=12)
    prepare_steps(warm, 1)
    prepare_steps(members, 1)

    async def renew_all(group: list[Member]) -> list[float]:
        out = []
        for member in group:
            start = time.perf_counter()
            await renew_next(cp.gateway_port, serving_pin, member)
            out.append(time.perf_counter() - start)
        return out

    trio.run(renew_all, warm)
    round_trip = trio.run(renew_all, members)
    ok = sum(1 for m in members for o in m.outcomes if o.status == 200)
    if ok != n:
        failed = [o for m in members for o in m.outcomes if o.status != 200]
        print(f"  file-key renewals: {n - ok} failed, first: {failed[0]}")
    state = members[0].state
    client_time_ms = int(time.time() * 1000)
    client_build = collect(
        max(n, 50), lambda: build_request(state, generate_file_key(), client_time_ms)
    )
    return RenewRun(round_trip, client_build, ok)


# --- renewals measured with renew_once ----------------------------------------------


@dataclass
class RenewNodes:
    file_cfg: Config
    tpm_cfg: Config


def join_renew_nodes(
    cp: ControlPlane, site: str, pool: str, tmp: Path, tcti: str, helper_socket: Path
) -> RenewNodes:
    """A file-key node (token join) and the swtpm's machine (tpm join, its AK-bound
    leaf), each stored on disk as ``bcd join`` stores it, for renew_once to renew."""
    pins = cp.pins()
    base = node_config(cp, site, pins, tmp, tcti)
    helper = HelperConfig(user="root", socket=helper_socket, hostconfig_dir=tmp / "hostconfig")
    file_cfg = replace(
        base, data_dir=tmp / "renew-file" / "data", tpm=TpmConfig(mode="off", tcti=tcti)
    )
    tpm_cfg = replace(base, data_dir=tmp / "renew-tpm" / "data", helper=helper)
    plugins = load_plugins()
    encryption_key = wire.public_key_of_jwk(cp.well_known()["join"]["encryptionJwk"])
    token = cp.token(pool, maxUses=1)["token"]

    async def both() -> None:
        key = generate_file_key()
        joined = await join(
            file_cfg,
            plugins,
            attestor=JOIN_TOKEN,
            role="node",
            credential=token,
            encryption_key=encryption_key,
            claims=machine_claims(random.Random(21), 21, 0),
            key=key,
            attempts=1,
        )
        persist_join(file_cfg.data_dir, joined.identity, key_to_pem(key), datetime.now(UTC))
        held = _tpm_node_key(tpm_cfg)
        joined = await join(
            tpm_cfg,
            plugins,
            attestor=TPM_ATTESTOR,
            role="node",
            credential=None,
            encryption_key=None,
            claims=machine_claims(random.Random(7), 7, 0),  # the join phase's machine
            key=held,
            attempts=1,
        )
        record_json = NodeKeyRecord.from_dict(held.record).to_json()
        persist_join(tpm_cfg.data_dir, joined.identity, record_json, datetime.now(UTC))

    trio.run(both)
    return RenewNodes(file_cfg, tpm_cfg)


@dataclass
class Measured:
    total: list[float] = field(default_factory=list)  # renew_once, wall
    handshake: list[float] = field(default_factory=list)  # open_gateway (mutual TLS)
    helper_before: list[float] = field(default_factory=list)  # helper calls, before the request
    helper_tls: list[float] = field(default_factory=list)  # helper calls inside the handshake
    helper_calls: dict[str, int] = field(default_factory=dict)  # over the timed renewals
    resets: int = 0
    certs: int = 0  # the node's certificates in the store at the end
    ak_bound: bool = False  # every timed renewal's leaf still names the AK
    kind: str = ""


async def renew_loop(
    cp: ControlPlane, cfg: Config, tpm: HelperKeys | None, n: int, warm: int
) -> Measured:
    """``warm`` + ``n`` sequential renew_once calls of ``cfg``'s node, the last n timed."""
    state: AnyState = await trio.to_thread.run_sync(load_identity, cfg, datetime.now(UTC), tpm)
    node_id = state.identity.node_id
    statements = state.leaf_info.statements
    out = Measured(kind=state.identity.key, ak_bound=True)
    spans: dict[str, float] = {"handshake": 0.0, "before": 0.0, "tls": 0.0}
    in_handshake = False
    original_open = getattr(bcd.renew, "open_gateway")  # noqa: B009 - patched for the run

    async def timed_open(*args: object) -> trio.abc.Stream:
        nonlocal in_handshake
        start = time.perf_counter()
        in_handshake = True
        try:
            return await original_open(*args)  # type: ignore[no-any-return]
        finally:
            in_handshake = False
            spans["handshake"] += time.perf_counter() - start

    counting = False
    if tpm is not None:
        client = tpm.client
        for name in ("ak", "nodekey", "sign", "certify"):
            method = getattr(client, name)

            async def timed_call(*args: object, _m: Any = method, _name: str = name) -> object:
                start = time.perf_counter()
                try:
                    return await _m(*args)
                finally:
                    spans["tls" if in_handshake else "before"] += time.perf_counter() - start
                    if counting:
                        out.helper_calls[_name] = out.helper_calls.get(_name, 0) + 1

            setattr(client, name, timed_call)

    done = 0  # renewals since the node's rows were last deleted
    setattr(bcd.renew, "open_gateway", timed_open)  # noqa: B010
    try:
        for i in range(warm + n):
            if done == RENEWALS_PER_HOUR:
                with cp.store.tx() as tx:
                    tx.execute("DELETE FROM renewals WHERE node_id = ?", (node_id,))
                out.resets += 1
                done = 0
            counting = i >= warm
            for k in spans:
                spans[k] = 0.0
            start = time.perf_counter()
            state = await renew_once(
                state,
                gateway_renew_sender(cfg, state, tpm),
                signing_pin=cfg.join_signing_key_pin,
                wall=time.time,
                tpm=tpm,
                tpm_mode=cfg.tpm.mode,
            )
            spent = time.perf_counter() - start
            done += 1
            if counting:
                out.total.append(spent)
                out.handshake.append(spans["handshake"])
                out.helper_before.append(spans["before"])
                out.helper_tls.append(spans["tls"])
                out.ak_bound &= state.leaf_info.statements == statements
    finally:
        setattr(bcd.renew, "open_gateway", original_open)  # noqa: B010
    if state.identity.key != out.kind or (tpm is not None) != isinstance(state, LoadedTpmState):
        raise RuntimeError(f"the {out.kind} node renewed into a {state.identity.key} key")
    row = cp.one("SELECT COUNT(*) AS n FROM node_certs WHERE node_id = ?", (node_id,))
    out.certs = int(row["n"]) if row else 0
    return out


def run_measured(
    cp: ControlPlane, nodes: RenewNodes, socket_path: Path, n: int
) -> tuple[Measured, Measured]:
    file_run = trio.run(renew_loop, cp, nodes.file_cfg, None, n, WARMUP)
    keys = HelperKeys(HelperClient(socket_path))
    tpm_run = trio.run(renew_loop, cp, nodes.tpm_cfg, keys, n, WARMUP)
    return file_run, tpm_run


# --- the TPM directly ---------------------------------------------------------------


@dataclass
class Direct:
    sign: list[float]
    derive: list[float]
    certify: list[float]
    ak: list[float]
    software_sign: list[float]


def run_direct(tcti: str, signs: int, n: int) -> Direct:
    """bcd.tpm calls on one open connection, as bcd helper makes them."""
    digest = hashlib.sha256(b"bench").digest()
    with bcd.tpm.device.open_tpm(tcti) as tpm:
        record = create_node_key_record()
        record = record.pinned(derive_node_key(tpm, record))
        sign(tpm, record, digest)  # warm
        signed = collect(signs, lambda: sign(tpm, record, digest))
        derived = collect(n, lambda: derive_node_key(tpm, create_node_key_record()))
        certified = collect(n, lambda: certify(tpm, record, digest))
        aks = collect(n, lambda: ak_public(tpm))
    software = ec.generate_private_key(ec.SECP256R1())
    algorithm = ec.ECDSA(Prehashed(hashes.SHA256()))
    software_signed = collect(signs, lambda: software.sign(digest, algorithm))
    return Direct(signed, derived, certified, aks, software_signed)


# --- through bcd helper -------------------------------------------------------------


@dataclass
class ThroughHelper:
    sign: list[float]
    nodekey: list[float]
    ak: list[float]
    certify: list[float]
    csr: list[float]  # make_csr_with over helper sign, the next key's CSR


def helper_socket_path(tmp: Path) -> Path:
    return tmp / "helper" / "run" / "helper.sock"


@contextlib.contextmanager
def helper_process(tmp: Path, tcti: str, cp_pins: dict[str, str]) -> Iterator[Path]:
    """A real ``bcd helper`` (as root, [helper] user nobody) on a socket under ``tmp``."""
    home = tmp / "helper"
    home.mkdir()
    socket_path = helper_socket_path(tmp)
    cfg = Config(
        path=home / "config.toml",
        gateway_url=f"https://{SERVER_NAME}:1",
        site="site_" + "0" * 26,
        serving_ca_spki_pin=cp_pins["serving_ca_spki_pin"],
        join_signing_key_pin=cp_pins["join_signing_key_pin"],
        join_encryption_key_pin=cp_pins["join_encryption_key_pin"],
        server_name=SERVER_NAME,
        data_dir=home / "data",
        helper=HelperConfig(user="nobody", socket=socket_path, hostconfig_dir=home / "hostconfig"),
        tpm=TpmConfig(mode="required", tcti=tcti),
    )
    cfg.path.write_text(render_config(cfg))
    log = open(home / "helper.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(BIN / "bcd"), "helper", "--config", str(cfg.path)],
        env={**cli_env(home), "TSS2_LOG": QUIET_TSS2_LOG},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + HELPER_START_S
        while not socket_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("bcd helper did not start: " + (home / "helper.log").read_text())
            time.sleep(0.02)
        yield socket_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


async def through_helper(socket_path: Path, signs: int, n: int) -> ThroughHelper:
    client = HelperClient(socket_path)
    digest = hashlib.sha256(b"bench").digest()
    unpinned = create_node_key_record()
    public = await client.nodekey(unpinned)
    record = unpinned.pinned(public.public_key)
    await client.sign(record, public, digest)  # warm
    signed = await acollect(signs, lambda: client.sign(record, public, digest))
    nodekeys = await acollect(n, lambda: client.nodekey(create_node_key_record()))
    aks = await acollect(n, client.ak)
    ak = await client.ak()
    certified = await acollect(n, lambda: client.certify(record, public, digest, ak))

    def helper_signer(d: bytes) -> bytes:
        return trio.from_thread.run(client.sign, record, public, d)

    async def helper_csr() -> None:
        # make_csr_with takes a synchronous signer: it runs in a worker thread and
        # asks the helper from there, as a synchronous caller would.
        await trio.to_thread.run_sync(pki.make_csr_with, public.public_key, helper_signer)

    csrs = await acollect(n, helper_csr)
    return ThroughHelper(signed, nodekeys, aks, certified, csrs)


def server_attestation_check(tcti: str, n: int) -> list[float]:
    """The server's check of a key attestation (verify_certify), in-process."""
    with bcd.tpm.device.open_tpm(tcti) as tpm:
        record = create_node_key_record()
        public_key = derive_node_key(tpm, record)
        record = record.pinned(public_key)
        csr_der = pki.make_csr_with(public_key, lambda d: sign(tpm, record, d))
        qualifying = hashlib.sha256(csr_der).digest()
        attest, signature = certify(tpm, record, qualifying)
        ak_area, _ = ak_public(tpm)
        key_name = public_key_of(tpm, record).name
    verify_certify(attest, signature, ak_area, key_name, qualifying)
    return collect(
        max(n, 200), lambda: verify_certify(attest, signature, ak_area, key_name, qualifying)
    )


# --- output -------------------------------------------------------------------------


def med_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def print_joins(token_run: JoinRun, tpm_run: JoinRun) -> None:
    n = len(token_run.total)
    print(f"\n1. Join, wall per join ({n} sequential joins each, after {WARMUP} warm-up joins):")
    print(f"  token join, file key (1 request):      {ms_summary(token_run.total)}")
    print(f"    of which making the key:             {ms_summary(token_run.key)}")
    print(f"  tpm join (2 requests, TPM for all):    {ms_summary(tpm_run.total)}")
    print(
        f"    of which the key in the TPM + CSR:   {ms_summary(tpm_run.key)}  "
        "(bcd.joinplan._tpm_node_key: derive, pin, derive, sign)"
    )
    print(
        f"    TPM's share (inside bcd.tpm calls):  {ms_summary(tpm_run.tpm)}  "
        f"= {statistics.median(tpm_run.tpm) / statistics.median(tpm_run.total):.0%} of the "
        f"median join; {tpm_run.opens / len(tpm_run.tpm):.0f} TPM connections per join"
    )
    for caller, samples in tpm_run.by_caller.items():
        times = tpm_run.blocks_by_caller[caller] / len(samples)
        label = f"{PHASES.get(caller, caller)} (x{times:.0f})"
        print(f"      {label:<34} {ms_summary(samples)}")
    rest = [t - s for t, s in zip(tpm_run.total, tpm_run.tpm, strict=True)]
    print(f"    the rest (2 round trips, crypto):    {ms_summary(rest)}")
    print(
        f"  tpm/token, medians: {med_ms(tpm_run.total) / med_ms(token_run.total):.1f}x; "
        f"{tpm_run.reclaims} of {len(tpm_run.total)} tpm joins reclaimed the machine's node "
        "(same EK and AK every time)"
    )


def print_renewal(
    renew: RenewRun,
    measured: tuple[Measured, Measured],
    helper: ThroughHelper,
    direct: Direct,
    check: list[float],
) -> None:
    file_m, tpm_m = measured
    m = len(tpm_m.total)
    print(
        f"\n2. Renewal, measured: bcd.renew.renew_once, wall per renewal ({m} sequential "
        f"renewals of one node each, after {WARMUP} warm-up renewals; a new mutual-TLS "
        "connection each, the answer verified, the identity stored):"
    )
    print(f"  file key:                               {ms_summary(file_m.total)}")
    print(f"    of which the mutual-TLS handshake:    {ms_summary(file_m.handshake)}")
    rest = [t - h for t, h in zip(file_m.total, file_m.handshake, strict=True)]
    print(f"    the rest (key, CSR, PoP, request, store): {ms_summary(rest)}")
    print(f"  tpm key, AK-bound leaf, via bcd helper: {ms_summary(tpm_m.total)}")
    helper_all = [b + t for b, t in zip(tpm_m.helper_before, tpm_m.helper_tls, strict=True)]
    print(
        f"    of which inside helper calls (TPM):  {ms_summary(helper_all)}  = "
        f"{med_ms(helper_all) / med_ms(tpm_m.total):.0%} of the median renewal"
    )
    calls = ", ".join(f"{name} x{count / m:.0f}" for name, count in tpm_m.helper_calls.items())
    print(f"      per renewal: {calls}")
    print(
        f"      before the request (AK, key, CSR, PoP, certify): {ms_summary(tpm_m.helper_before)}"
    )
    print(f"      inside the handshake (CertificateVerify):       {ms_summary(tpm_m.helper_tls)}")
    print(f"    the mutual-TLS handshake, helper-signed: {ms_summary(tpm_m.handshake)}")
    tls_rest = [h - t for h, t in zip(tpm_m.handshake, tpm_m.helper_tls, strict=True)]
    print(f"      of which not the helper's sign:    {ms_summary(tls_rest)}")
    tpm_rest = [
        t - h - x for t, h, x in zip(tpm_m.total, tpm_m.handshake, tpm_m.helper_before, strict=True)
    ]
    print(f"    the rest (request, verify, store):   {ms_summary(tpm_rest)}")
    print(
        f"  tpm/file, medians: {med_ms(tpm_m.total) / med_ms(file_m.total):.1f}x; every "
        f"tpm renewal's leaf kept the AK statement: {tpm_m.ak_bound}; certificates in the "
        f"store: file node {file_m.certs}, tpm node {tpm_m.certs}"
    )
    print(
        f"  ({RENEWALS_PER_HOUR} renewals per node and hour: the bench deleted each node's "
        f"rows from the renewals table of its SQLite store between rounds, "
        f"{file_m.resets} + {tpm_m.resets} times, outside the timed calls)"
    )

    n = len(renew.round_trip)
    print(
        f"\n  Parts (file key as bench/renew.py times it: {n} nodes renewing once each, "
        f"sequentially, {renew.ok} answered 200):"
    )
    print(f"  file key, the round trip (pre-built):  {ms_summary(renew.round_trip)}")
    print(f"  file key, client build (key,CSR,PoP):  {ms_summary(renew.client_build)}")
    file_total = med_ms(renew.round_trip) + med_ms(renew.client_build)
    print(f"  file key, renewal (sum of medians):    {file_total:8.2f} ms")
    print("  the TPM operations of a TPM renewal, each measured through bcd helper alone:")
    parts = [
        ("derive the next key (tpm.nodekey)", helper.nodekey),
        ("sign the next key's CSR (tpm.sign + DER)", helper.csr),
        ("sign the proof of possession (tpm.sign)", helper.sign),
        ("load the AK, check its name (tpm.ak)", helper.ak),
        ("certify the next key (tpm.certify)", helper.certify),
        ("sign the TLS CertificateVerify (tpm.sign)", helper.sign),
        ("server: verify the attestation (in-process)", check),
    ]
    for name, samples in parts:
        print(f"    {name:<44} {ms_summary(samples)}")
    added = sum(med_ms(s) for _, s in parts)
    estimate = med_ms(renew.round_trip) + added
    print(f"    {'sum of the TPM parts (medians)':<44} {added:8.2f} ms")
    print(
        f"  file-key round trip + the TPM parts = {estimate:.2f} ms, against "
        f"{med_ms(tpm_m.total):.2f} ms measured (median)"
    )
    direct_parts = med_ms(direct.derive) + 3 * med_ms(direct.sign) + med_ms(direct.ak)
    direct_parts += med_ms(direct.certify)
    print(
        f"  the same TPM operations called directly (no helper): {direct_parts:.2f} ms "
        "(derive + 3 signs + AK + certify, medians)"
    )


def print_signature(helper: ThroughHelper, direct: Direct) -> None:
    n = len(helper.sign)
    print(f"\n3. One signature, wall per call ({n} sequential calls each):")
    rows = [
        ("HelperClient.sign via bcd helper (socket)", helper.sign),
        ("bcd.tpm.nodekey.sign, direct, same swtpm", direct.sign),
        ("software P-256 sign (cryptography)", direct.software_sign),
    ]
    for name, samples in rows:
        print(f"  {name:<44} {ms_summary(samples)}")
    overhead = med_ms(helper.sign) - med_ms(direct.sign)
    print(
        f"  helper overhead (socket, JSON, process hop, the client's signature check): "
        f"{overhead:.2f} ms per call, medians ({overhead / med_ms(helper.sign):.0%} of the "
        "helper call)"
    )
    print(
        f"  the TPM sign over software: {med_ms(direct.sign) / med_ms(direct.software_sign):.0f}x "
        "(each TPM sign derives the key with CreatePrimary, signs, flushes)"
    )
    print("  other bcd.tpm calls, direct:")
    for name, samples in (
        ("derive_node_key (new record)", direct.derive),
        ("ak.ak_public", direct.ak),
        ("ak.certify", direct.certify),
    ):
        print(f"    {name:<42} {ms_summary(samples)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--joins", type=int, default=25, help="joins of each kind (default 25)")
    parser.add_argument("--renewals", type=int, default=25, help="file-key renewals (default 25)")
    parser.add_argument(
        "--tpm-renewals",
        type=int,
        default=20,
        help="renew_once calls timed per node, file key and TPM key (default 20)",
    )
    parser.add_argument("--signs", type=int, default=200, help="signatures timed (default 200)")
    args = parser.parse_args(argv)
    counts = (args.joins, args.renewals, args.tpm_renewals)
    if not all(1 <= n <= 500 for n in counts) or args.signs < 1:
        parser.error(
            "--joins, --renewals and --tpm-renewals must be from 1 to 500, --signs at least 1"
        )
    if os.geteuid() != 0:
        parser.error("run as root: bcd helper runs as root")
    missing = missing_tools()
    if missing:
        parser.error(f"missing swtpm tools: {', '.join(missing)}")
    os.environ["TSS2_LOG"] = QUIET_TSS2_LOG

    print_environment()
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        swtpm = SwTpm.provision(tmp / "swtpm")
        swtpm.start()
        try:
            template = tmp / "pki-template"
            template.mkdir()
            make_pki(template)
            cp_root = tmp / "cp-root"
            cp_root.mkdir()
            # stopped below (cp.stop()), not by the world
            cp, site, pool = E2EWorld(cp_root, template).tpm_plane(swtpm.ca_bundle)
            try:
                pins = cp.pins()
                token_run, tpm_run = run_joins(cp, site, pool, tmp, swtpm.tcti, args.joins)
                renew = run_file_renewals(cp, pool, args.renewals)
                socket_path = helper_socket_path(tmp)
                nodes = join_renew_nodes(cp, site, pool, tmp, swtpm.tcti, socket_path)
                n_parts = max(args.joins, 25)
                direct = run_direct(swtpm.tcti, args.signs, n_parts)
                check = server_attestation_check(swtpm.tcti, n_parts)
                # the helper holds the swtpm's one connection from here on
                with helper_process(tmp, swtpm.tcti, pins) as started:
                    assert started == socket_path
                    measured = run_measured(cp, nodes, socket_path, args.tpm_renewals)
                    helper = trio.run(through_helper, socket_path, args.signs, n_parts)
            finally:
                cp.stop()
        finally:
            swtpm.stop()
    print(f"swtpm {swtpm_version()} on 127.0.0.1 (TCP, one connection at a time)")
    print_joins(token_run, tpm_run)
    print_renewal(renew, measured, helper, direct, check)
    print_signature(helper, direct)
    return 0


def swtpm_version() -> str:
    done = subprocess.run(["swtpm", "--version"], capture_output=True, text=True, check=False)
    first = (done.stdout or done.stderr).strip().splitlines()
    return first[0].replace("TPM emulator version ", "") if first else "?"


if __name__ == "__main__":
    sys.exit(main())
