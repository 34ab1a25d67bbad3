"""The node's half in process: a joined node's files, a gateway faked for its renewal
loop, and ``bcd helper`` served in a task.

:func:`joined_state` stores and loads a node joined at a given time (real leaves from
``control.pki``); :class:`FakeGateway` checks a RenewRequest as JoinService would and
answers with a real signed leaf (``failures`` first, ``tamper`` to bend the answer);
:func:`wall` is unix time tied to trio's clock (MockClock makes hours take no time).
:func:`running` serves the real ``bcd helper`` in this process, :func:`wrong_helper`
is a fake one that answers what a test says.
"""

from __future__ import annotations

import functools
import pwd
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from tpm2_pytss import ESAPI
from tpm2_pytss.constants import TPM2_CAP, TPM2_HC

from bcd import pki, wire
from bcd.config import TpmMode
from bcd.helper.client import HelperClient
from bcd.helper.protocol import LineBuffer, Request, parse_request
from bcd.helper.server import HelperSettings, serve_helper
from bcd.identity import LoadedState, load_state, make_identity, persist_join
from bcd.keys.file import key_to_pem
from control.pki import Pki, issue_node_leaf
from tests.swtpm import SwTpm

SITE = "site_" + "a" * 26
NODE = "node_" + "b" * 26
TTL_S = 3600
T0 = float(int(time.time()))
NOBODY = pwd.getpwnam("nobody")


def wall() -> float:
    """Unix seconds tied to trio's clock: T0 when the (mock) clock reads 0."""
    return T0 + trio.current_time()


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def joined_state(
    data_dir: Path, memory_pki: Pki, now: float, *, role: str = "node", ttl_s: int = TTL_S
) -> LoadedState:
    """A node joined at ``now`` (unix seconds), stored in ``data_dir`` and loaded."""
    key = pki.generate_key()
    spiffe = pki.SpiffeId("td.example", SITE, NODE)
    leaf = issue_node_leaf(memory_pki, key.public_key(), spiffe, role, (), at(now), ttl_s)
    identity = make_identity(
        chain=pki.cert_pem(leaf) + memory_pki.chain_tail_pem(),
        bundle=memory_pki.bundle_pem(),
        trust_version=1,
        server_time="2025-01-01T00:00:00Z",
        key="file",
        identity_generation=1,
    )
    persist_join(data_dir, identity, key_to_pem(key), at(now))
    state = load_state(data_dir)
    assert state is not None
    return state


@dataclass
class FakeGateway:
    """Checks a RenewRequest as JoinService would and answers with a real signed leaf.

    ``failures`` are raised first, one per call. ``tamper`` changes the answer:
    ``signer``, ``csr_sha256``, ``spiffe``, ``role``, ``leaf_key``, ``kind``.
    """

    memory_pki: Pki
    data_dir: Path
    ttl_s: int = TTL_S
    failures: list[BaseException] = field(default_factory=list)
    tamper: dict[str, Any] = field(default_factory=dict)
    calls: list[float] = field(default_factory=list)  # wall time of each call
    senders: list[LoadedState] = field(default_factory=list)  # the state each was made from
    requests: list[wire.RenewRequest] = field(default_factory=list)
    next_key_at_send: list[bytes] = field(default_factory=list)
    issued: list[x509.Certificate] = field(default_factory=list)  # the leaves it answered with
    on_call: Callable[[int], None] | None = None
    clock: Callable[[], float] = wall

    def factory(self, state: LoadedState) -> Callable[[bytes], Any]:
        """The sender ``renewal_task`` builds from ``state`` (its TLS identity)."""
        self.senders.append(state)
        return functools.partial(self.send, state.leaf)

    async def send(self, peer: x509.Certificate, body: bytes) -> str:
        """Answer ``body`` from a caller whose (mutual TLS) certificate is ``peer``."""
        wall = self.clock
        self.calls.append(wall())
        if self.on_call is not None:
            self.on_call(len(self.calls))
        self.next_key_at_send.append((self.data_dir / "node.key.next").read_bytes())
        if self.failures:
            raise self.failures.pop(0)
        req = wire.parse_renew_request(wire.loads_object(body))
        self.requests.append(req)
        # What JoinService checks: the presented leaf is the caller's, the proof
        # verifies under the current key, the client time is close.
        assert pki.load_pem_chain(req.chain)[0] == peer
        current = pki.load_pem_chain(req.chain)[0]
        info = pki.leaf_info(current)
        current_key = current.public_key()
        assert isinstance(current_key, pki.ec.EllipticCurvePublicKey)
        message = pki.renew_pop_message(req.csr_der, info.spiffe.node_id, req.client_time_ms)
        pki.verify_p1363(current_key, req.pop_sig, message)
        assert abs(req.client_time_ms / 1000 - wall()) < 1
        csr = pki.parse_csr(req.csr_der)
        spiffe = self.tamper.get("spiffe", info.spiffe)
        role = self.tamper.get("role", info.role)
        leaf_key = self.tamper.get("leaf_key", pki.csr_public_key(csr))
        leaf = issue_node_leaf(self.memory_pki, leaf_key, spiffe, role, (), at(wall()), self.ttl_s)
        self.issued.append(leaf)
        answer = {
            "kind": self.tamper.get("kind", "renewed"),
            "node_id": spiffe.node_id,
            "site_id": spiffe.site_id,
            "role": role,
            "trust_domain": spiffe.trust_domain,
            "chain": pki.cert_pem(leaf) + self.memory_pki.chain_tail_pem(),
            "bundle": self.memory_pki.bundle_pem(),
            "trust_version": 2,
            "csr_sha256": self.tamper.get("csr_sha256", pki.sha256_hex(req.csr_der)),
            "server_time": int(wall() * 1000),
            "identity_generation": 1,
        }
        return wire.sign_response(
            answer, self.tamper.get("signer", self.memory_pki.join_signing_key)
        )


def pin(memory_pki: Pki) -> str:
    return memory_pki.pins()["join_signing_key_pin"]


# --- bcd helper ---------------------------------------------------------------------


def transients(tcti: str) -> list[int]:
    esapi = ESAPI(tcti)
    try:
        handles: list[int] = []
        for first in (TPM2_HC.TRANSIENT_FIRST, TPM2_HC.LOADED_SESSION_FIRST):
            _, data = esapi.get_capability(TPM2_CAP.HANDLES, first, 64)
            handles += [int(h) for h in data.data.handles]
        return handles
    finally:
        esapi.close()


def helper_settings(
    swtpm: SwTpm,
    sockdir: Path,
    *,
    allowed: frozenset[int] = frozenset({0}),
    gid: int = NOBODY.pw_gid,
    mode: TpmMode = "required",
) -> HelperSettings:
    return HelperSettings(
        socket=sockdir / "run" / "helper.sock",
        allowed_uids=allowed,
        socket_gid=gid,
        tcti=swtpm.tcti,
        tpm_mode=mode,
    )


@asynccontextmanager
async def running(settings: HelperSettings, *, tpm: bool = True) -> AsyncIterator[HelperClient]:
    """bcd helper served in this process; afterwards the TPM holds no transient object."""
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_helper, settings)
        yield HelperClient(path)
        nursery.cancel_scope.cancel()
    assert not settings.socket.exists()
    if tpm and settings.tpm_mode != "off":
        assert transients(settings.tcti) == []


@asynccontextmanager
async def wrong_helper(
    path: Path, answer: Callable[[Request], bytes | None]
) -> AsyncIterator[HelperClient]:
    """A fake helper: ``answer`` gives the bytes sent back (None: close without a word)."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen()

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            buffer = LineBuffer()
            line = None
            while line is None:
                data = await stream.receive_some(4096)
                if not data:
                    return
                buffer.feed(data)
                line = buffer.next_line()
            reply = answer(parse_request(line))
            if reply == b"hang":
                await trio.sleep_forever()
            if reply is not None:
                await stream.send_all(reply)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, [trio.SocketListener(sock)])
        yield HelperClient(path, timeout=2)
        nursery.cancel_scope.cancel()
