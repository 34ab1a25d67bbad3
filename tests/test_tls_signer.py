"""bcd.tls_signer: pinned mutual TLS whose client key signs through a callback.

Against the real gateway TLS setup (control.http.serve with
control.pki.server_ssl_context and the node CA as client CA): a software key's
callback, then the node key in swtpm through ``bcd helper``.
"""

from __future__ import annotations

import functools
import json
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, decode_dss_signature

from bcd import pki
from bcd.errors import PeerVerificationError, TransportError
from bcd.gatewayclient import GatewayClient, Response
from bcd.tls import anchor_of, connect_pinned
from bcd.tls_signer import SignDigest, connect_with_signer, request_with_signer
from bcd.tlsstream import SocketTLSStream
from bcd.transport import DialTransport
from control import http
from control.pki import Pki, issue_node_leaf, make_gateway_cert, server_ssl_context
from tests.swtpm import SwTpm

NAME = "gw.test"


def _p1363(key: ec.EllipticCurvePrivateKey, digest: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(digest, ec.ECDSA(Prehashed(hashes.SHA256()))))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


@dataclass
class Signer:
    """A software key's signing callback that records the digests it signed."""

    key: ec.EllipticCurvePrivateKey = field(default_factory=pki.generate_key)
    digests: list[bytes] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)

    def __call__(self, digest: bytes) -> bytes:
        self.digests.append(digest)
        self.threads.append(threading.current_thread().name)
        return _p1363(self.key, digest)


@dataclass
class Gateway:
    """The gateway's TLS front door on loopback, with a handler that reports the peer."""

    port: int
    pin: str
    node_chain: Callable[[ec.EllipticCurvePublicKey], str]
    peers: list[bytes | None] = field(default_factory=list)


async def _lines() -> AsyncIterator[bytes]:
    for n in range(3):
        yield json.dumps({"n": n}).encode() + b"\n"
        await trio.sleep(0.01)


async def _handler(gateway: list[Gateway], req: http.Request) -> http.Response:
    gateway[0].peers.append(req.peer_cert_der)
    if req.path == "/lines":
        return http.Response(200, stream=_lines())
    return http.json_response(200, {"path": req.path, "body": req.body.decode()})


def _node_chain(memory_pki: Pki, public_key: ec.EllipticCurvePublicKey, now: datetime) -> str:
    """A node's chain as JoinService answers it: its leaf, the node CA, the root."""
    spiffe = pki.SpiffeId("td.example", "site_" + "a" * 26, "node_" + "b" * 26)
    leaf = issue_node_leaf(memory_pki, public_key, spiffe, "node", (), now, 3600)
    return pki.cert_pem(leaf) + memory_pki.chain_tail_pem()


def _gateway_context(
    memory_pki: Pki, now: datetime, *, client_time_in_app: bool = False
) -> ssl.SSLContext:
    """The gateway's server context: its leaf and the serving CA, the node CA and root
    as the client CAs."""
    gw_key = pki.generate_key()
    gw_cert = make_gateway_cert(memory_pki, gw_key.public_key(), NAME, now)
    return server_ssl_context(
        pki.cert_pem(gw_cert) + pki.cert_pem(memory_pki.serving_ca),
        gw_key,
        client_ca_pem=memory_pki.chain_tail_pem(),
        client_time_in_app=client_time_in_app,
    )


async def _gateway(nursery: trio.Nursery, memory_pki: Pki, *, tls12_only: bool = False) -> Gateway:
    now = datetime.now(UTC)
    ctx = _gateway_context(memory_pki, now)
    if tls12_only:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    holder: list[Gateway] = []
    port = await nursery.start(
        functools.partial(
            http.serve, functools.partial(_handler, holder), "127.0.0.1", 0, ssl_context=ctx
        )
    )

    gateway = Gateway(
        port,
        memory_pki.pins()["serving_ca_spki_pin"],
        functools.partial(_node_chain, memory_pki, now=now),
    )
    holder.append(gateway)
    return gateway


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A directory for bcd helper's socket (pytest's temp paths are too long)."""
    path = Path(tempfile.mkdtemp(prefix="bcd-tls-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
async def gateway(nursery: trio.Nursery, memory_pki: Pki) -> Gateway:
    return await _gateway(nursery, memory_pki)


def _over(stream: trio.abc.Stream) -> GatewayClient:
    """The gateway client on this one handshaken stream (not closed with the client)."""

    async def dial(host: str, port: int) -> trio.abc.Stream:
        return stream

    return GatewayClient(DialTransport(dial), host="127.0.0.1", port=443, server_name=NAME)


async def request(
    stream: trio.abc.Stream, method: str, path: str, name: str, body: bytes | None = None
) -> Response:
    """One request on ``stream`` through the gateway client; the stream stays open."""
    assert name == NAME
    return await _over(stream).request(method, path, body)


def _leaf_der(chain_pem: str) -> bytes:
    return pki.load_pem_chain(chain_pem)[0].public_bytes(serialization.Encoding.DER)


async def test_request_with_a_callback_key_over_tls13(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    resp = await request_with_signer(
        "127.0.0.1",
        gateway.port,
        NAME,
        gateway.pin,
        chain,
        signer.key.public_key(),
        signer,
        "POST",
        "/v1/renew",
        b'{"a": 1}',
    )
    assert resp.status == 200
    assert json.loads(resp.body) == {"path": "/v1/renew", "body": '{"a": 1}'}
    assert gateway.peers == [_leaf_der(chain)]  # the gateway verified our certificate
    assert len(signer.digests) == 1
    assert len(signer.digests[0]) == 32
    assert signer.threads[0] != threading.main_thread().name


async def test_tls13_is_negotiated_and_the_stream_is_reused(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    stream = await connect_with_signer(
        "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), signer
    )
    async with stream:
        assert stream.version == (3, 4)
        for n in range(2):
            resp = await request(stream, "POST", f"/{n}", NAME, b"{}")
            assert resp.status == 200
    assert len(signer.digests) == 1


async def test_tls12_client_auth_works_too(nursery: trio.Nursery, memory_pki: Pki) -> None:
    gateway = await _gateway(nursery, memory_pki, tls12_only=True)
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    stream = await connect_with_signer(
        "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), signer
    )
    async with stream:
        assert stream.version == (3, 3)
        assert (await request(stream, "GET", "/x", NAME)).status == 200
    assert gateway.peers == [_leaf_der(chain)]
    assert len(signer.digests) == 1


async def test_lines_stream_through_the_gateway_client(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    stream = await connect_with_signer(
        "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), signer
    )
    async with stream, _over(stream).stream_lines("POST", "/lines", b"{}") as lines:
        assert lines.status == 200
        got = [json.loads(line) async for line in lines]
    assert got == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_an_idle_stream_times_out_and_breaks(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    stream = await connect_with_signer(
        "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), signer
    )
    async with stream:
        with trio.move_on_after(0.2) as scope:
            await stream.receive_some()  # the gateway sends nothing unasked
        assert scope.cancelled_caught
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"GET / HTTP/1.1\r\n\r\n")


async def test_another_pin_is_refused_before_the_node_key_signs(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    other = pki.spki_pin(pki.generate_key().public_key())
    with pytest.raises(PeerVerificationError, match="pinned serving CA"):
        await request_with_signer(
            "127.0.0.1",
            gateway.port,
            NAME,
            other,
            chain,
            signer.key.public_key(),
            signer,
            "GET",
            "/",
        )
    with pytest.raises(PeerVerificationError, match=r"not valid for gw\.other"):
        await connect_with_signer(
            "127.0.0.1",
            gateway.port,
            "gw.other",
            gateway.pin,
            chain,
            signer.key.public_key(),
            signer,
        )
    assert signer.digests == []
    assert gateway.peers == []


async def test_a_wrong_signature_fails_the_handshake(gateway: Gateway) -> None:
    signer = Signer()
    chain = gateway.node_chain(signer.key.public_key())
    other = Signer()  # signs with another key than the certificate's
    with pytest.raises(TransportError, match="TLS handshake"):
        await connect_with_signer(
            "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), other
        )

    def broken(digest: bytes) -> bytes:
        return b"\x00" * 10

    with pytest.raises(TransportError, match="TLS handshake"):
        await connect_with_signer(
            "127.0.0.1", gateway.port, NAME, gateway.pin, chain, signer.key.public_key(), broken
        )
    assert gateway.peers == []


async def test_unreachable_gateway(memory_pki: Pki) -> None:
    signer = Signer()
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransportError, match="cannot reach the gateway"):
        await connect_with_signer(
            "127.0.0.1",
            port,
            NAME,
            memory_pki.pins()["serving_ca_spki_pin"],
            "",
            signer.key.public_key(),
            signer,
        )


# --- what a node presents: its leaf alone -------------------------------------------------


async def test_a_node_presents_its_leaf_alone_and_the_gateway_verifies_it(
    nursery: trio.Nursery, memory_pki: Pki
) -> None:
    """A node's chain file holds its leaf, the node CA and the root; over mutual TLS it
    sends the leaf alone, with a file key (OpenSSL) and with a key that signs through a
    callback (tlslite-ng), and the gateway's own context (the node CA and root as its
    anchors, RFC 5280 strict) verifies it: the CAs sent cost the gateway CPU and
    memory per connection and verified nothing it does not hold."""
    now = datetime.now(UTC)
    ctx = _gateway_context(memory_pki, now, client_time_in_app=True)  # as serve builds it
    received: list[list[bytes]] = []
    built: list[int] = []  # the chain the gateway built from its own anchors

    async def raw(tcp: trio.SocketStream) -> None:
        tls = SocketTLSStream(tcp, ctx)  # the gateway's own TLS (control.http's)
        try:
            await tls.do_handshake()  # a chain that does not verify fails here
            received.append(tls.unverified_chain_der())
            ssl_socket: Any = tls._sock  # 3.13: public; 3.11: on _sslobj
            verified = getattr(ssl_socket, "get_verified_chain", None)
            built.append(len((verified or ssl_socket._sslobj.get_verified_chain)()))
            await tls.send_all(b"ok")
        except trio.BrokenResourceError:
            pass
        finally:
            tls.close()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, raw, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    pin = memory_pki.pins()["serving_ca_spki_pin"]
    file_key = pki.generate_key()
    file_chain = _node_chain(memory_pki, file_key.public_key(), now)
    key_pem = file_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert len(pki.load_pem_chain(file_chain)) == 3
    anchor = anchor_of(pki.cert_pem(memory_pki.serving_ca), pin)
    stream = await connect_pinned(
        "127.0.0.1", port, NAME, anchor, client_cert=(file_chain, key_pem)
    )
    async with stream:
        assert await stream.receive_some(2) == b"ok"
    signer = Signer()
    signed_chain = _node_chain(memory_pki, signer.key.public_key(), now)
    stream = await connect_with_signer(
        "127.0.0.1", port, NAME, pin, signed_chain, signer.key.public_key(), signer
    )
    async with stream:
        assert await stream.receive_some(2) == b"ok"
    assert received == [[_leaf_der(file_chain)], [_leaf_der(signed_chain)]]
    assert built == [3, 3]  # leaf, node CA, root: the CAs came from the gateway's anchors


# --- the node key in swtpm, through bcd helper ------------------------------------------


async def test_the_helper_signs_the_handshake_with_the_tpm_key(
    swtpm: SwTpm, gateway: Gateway, sockdir: Path
) -> None:
    from bcd.tpm.record import create_node_key_record
    from tests.world.agent import helper_settings, running

    async with running(helper_settings(swtpm, sockdir)) as client:
        record = create_node_key_record()
        key = await client.nodekey(record)
        record = record.pinned(key.public_key)
        signed: list[bytes] = []

        def sign(digest: bytes) -> bytes:  # in the handshake's worker thread
            signature = trio.from_thread.run(client.sign, record, key, digest)
            signed.append(signature)
            return signature

        helper_sign: SignDigest = sign
        chain = gateway.node_chain(key.public_key)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            stream = await connect_with_signer(
                "127.0.0.1", gateway.port, NAME, gateway.pin, chain, key.public_key, helper_sign
            )
            times.append(time.perf_counter() - start)
            async with stream:
                assert stream.version == (3, 4)
                assert (await request(stream, "POST", "/v1/session", NAME, b"{}")).status == 200
        await client.release(record)
    assert len(signed) == 3
    assert gateway.peers == [_leaf_der(chain)] * 3
    leaf = x509.load_der_x509_certificate(_leaf_der(chain))
    assert pki.same_public_key(leaf.public_key(), key.public_key)  # type: ignore[arg-type]
    print(f"handshake with the TPM key: {[f'{t * 1000:.0f} ms' for t in times]}")


# --- a gateway that drips bytes: the handshake has a total deadline ---------------------


async def _dripping_gateway(
    nursery: trio.Nursery, closed: trio.Event, interval: float = 0.1
) -> int:
    """A TCP server that starts a large TLS record and sends it a byte at a time."""

    async def drip(tcp: trio.SocketStream) -> None:
        try:
            await tcp.send_all(b"\x16\x03\x03\x40\x00")  # a handshake record of 16 KiB
            while True:
                await trio.sleep(interval)
                await tcp.send_all(b"\x00")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed.set()
        finally:
            await trio.aclose_forcefully(tcp)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, drip, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_a_dripping_gateway_hits_the_handshake_deadline(
    nursery: trio.Nursery, memory_pki: Pki
) -> None:
    signer, closed = Signer(), trio.Event()
    port = await _dripping_gateway(nursery, closed)
    start = time.monotonic()
    with pytest.raises(
        TransportError, match=rf"^TLS handshake with the gateway at 127.0.0.1:{port} timed out$"
    ):
        await connect_with_signer(
            "127.0.0.1",
            port,
            NAME,
            memory_pki.pins()["serving_ca_spki_pin"],
            "",
            signer.key.public_key(),
            signer,
            timeout=1.0,
        )
    assert time.monotonic() - start < 3.0  # each byte came well within the per-I/O timeout
    assert signer.digests == []


async def test_cancelling_the_handshake_shuts_its_socket_down(
    nursery: trio.Nursery, memory_pki: Pki
) -> None:
    signer, closed = Signer(), trio.Event()
    port = await _dripping_gateway(nursery, closed)
    start = time.monotonic()
    with trio.move_on_after(0.5) as scope:
        await connect_with_signer(
            "127.0.0.1",
            port,
            NAME,
            memory_pki.pins()["serving_ca_spki_pin"],
            "",
            signer.key.public_key(),
            signer,
            timeout=60.0,
        )
    assert scope.cancelled_caught
    assert time.monotonic() - start < 2.0
    with trio.fail_after(5):  # the gateway sees the connection end
        await closed.wait()
