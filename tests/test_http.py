"""The HTTP/TLS layer: pinned TLS, the gateway client (httpx) and the h11 server, over real
TLS on loopback."""

from __future__ import annotations

import contextlib
import functools
import gc
import ipaddress
import json
import logging
import ssl
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcd import gatewayclient, pki, tls
from bcd.errors import PeerVerificationError, TransportError
from bcd.gatewayclient import GatewayClient
from bcd.tls import Anchor, anchor_of, connect_pinned, verify_server_chain
from bcd.tlsstream import SocketTLSStream
from bcd.transport import DialTransport
from control import http
from control.pki import make_ca

NOW = datetime.now(UTC)
DER = serialization.Encoding.DER
PEM = serialization.Encoding.PEM


# --- a throwaway PKI --------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _make_ca(
    cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    return make_ca(cn, key, NOW, timedelta(days=30), path_length=None, issuer=issuer), key


def _make_leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    san: list[x509.GeneralName],
    eku: x509.ObjectIdentifier,
    *,
    not_after: datetime | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("leaf"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(hours=1))
        .not_valid_after(not_after or NOW + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(PEM).decode("ascii") for c in certs)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


SERVER_SAN: list[x509.GeneralName] = [
    x509.DNSName("gw.test"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
]


@dataclass(frozen=True)
class Material:
    ca: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey
    leaf: x509.Certificate
    leaf_key: ec.EllipticCurvePrivateKey
    client: x509.Certificate
    client_key: ec.EllipticCurvePrivateKey
    pin: str
    other_pin: str

    @property
    def chain_der(self) -> list[bytes]:
        return [self.leaf.public_bytes(DER), self.ca.public_bytes(DER)]

    @property
    def anchor(self) -> Anchor:
        return anchor_of(_pem(self.ca), self.pin)


@functools.cache
def material() -> Material:
    ca = _make_ca("test serving CA")
    leaf = _make_leaf(ca, SERVER_SAN, ExtendedKeyUsageOID.SERVER_AUTH)
    client = _make_leaf(
        ca,
        [x509.UniformResourceIdentifier("spiffe://bc.test/site/s/node/n")],
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    other = ec.generate_private_key(ec.SECP256R1())
    return Material(
        ca=ca[0],
        ca_key=ca[1],
        leaf=leaf[0],
        leaf_key=leaf[1],
        client=client[0],
        client_key=client[1],
        pin=pki.spki_pin(ca[1].public_key()),
        other_pin=pki.spki_pin(other.public_key()),
    )


def server_context(tmp_path: Path) -> ssl.SSLContext:
    m = material()
    chain, key = tmp_path / "chain.pem", tmp_path / "key.pem"
    chain.write_text(_pem(m.leaf, m.ca))
    key.write_bytes(_key_pem(m.leaf_key))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(chain, key)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.load_verify_locations(cadata=_pem(m.ca))
    ctx.num_tickets = 0
    return ctx


# --- a server under test ----------------------------------------------------------


@dataclass
class Server:
    port: int = 0
    requests: list[http.Request] = field(default_factory=list)
    stream_closed: trio.Event = field(default_factory=trio.Event)

    async def handler(self, request: http.Request) -> http.Response:
        self.requests.append(request)
        if request.path == "/boom":
            raise RuntimeError("secret-detail-xyz")
        if request.path == "/stream":
            return http.Response(
                200, headers=[("content-type", "application/x-ndjson")], stream=self._lines()
            )
        if request.path == "/forever":
            return http.Response(200, stream=self._forever())
        if request.path == "/bigline":
            return http.Response(200, stream=self._bigline())
        if request.path == "/gzip":
            return http.Response(200, headers=[("content-encoding", "gzip")], body=b"\x1f\x8b")
        if request.path == "/moved":
            return http.Response(302, headers=[("location", "/elsewhere")], body=b"")
        return http.json_response(
            200, {"path": request.path, "query": request.query, "size": len(request.body)}
        )

    async def _lines(self) -> AsyncIterator[bytes]:
        yield b'{"type":"welcome","session_id":"s1"}\n'
        yield b'{"type":'
        yield b'"ping"}\r\n\n{"type":"ping"}'
        yield b'\n{"type":"revocation"}'

    async def _forever(self) -> AsyncIterator[bytes]:
        try:
            yield b'{"type":"ping"}\n'
            await trio.sleep_forever()  # only noticing the client's EOF ends this
            yield b""
        finally:
            self.stream_closed.set()

    async def _bigline(self) -> AsyncIterator[bytes]:
        yield b"x" * (gatewayclient.MAX_LINE + 10)


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path) -> Server:
    srv = Server()
    srv.port = await nursery.start(
        functools.partial(
            http.serve,
            srv.handler,
            "127.0.0.1",
            0,
            ssl_context=server_context(tmp_path),
            max_body=4096,
        )
    )
    return srv


async def _connect(
    srv: Server, name: str = "gw.test", client_cert: tuple[str, bytes] | None = None
) -> SocketTLSStream:
    return await connect_pinned(
        "127.0.0.1", srv.port, name, material().anchor, client_cert=client_cert, timeout=5
    )


def _client(
    srv: Server,
    name: str = "gw.test",
    client_cert: tuple[str, bytes] | None = None,
    owner: object | None = None,
) -> GatewayClient:
    """The gateway client over the real pinned dial (the file-key transport)."""

    async def dial(host: str, port: int) -> trio.abc.Stream:
        return await connect_pinned(
            host, port, name, material().anchor, client_cert=client_cert, timeout=5, owner=owner
        )

    return GatewayClient(DialTransport(dial), host="127.0.0.1", port=srv.port, server_name=name)


# --- pinned TLS -------------------------------------------------------------------


async def test_pinned_request_reaches_handler(server: Server) -> None:
    async with _client(server) as client:
        resp = await client.request("POST", "/v1/join?a=1&b=", b'{"x":1}')
    assert resp.status == 200
    assert resp.headers["content-type"] == "application/json"
    assert json.loads(resp.body) == {"path": "/v1/join", "query": {"a": "1", "b": ""}, "size": 7}
    (seen,) = server.requests
    assert seen.method == "POST"
    assert seen.body == b'{"x":1}'
    assert seen.peer_cert_der is None
    assert seen.headers["host"] == "gw.test"
    assert seen.headers["accept-encoding"] == "identity"
    assert seen.remote.startswith("127.0.0.1:")


async def test_ip_server_name(server: Server) -> None:
    stream = await _connect(server, name="127.0.0.1")
    assert stream.peer_der() is not None
    await stream.aclose()


async def test_wrong_pin_sends_no_byte(nursery: trio.Nursery, tmp_path: Path) -> None:
    ctx = server_context(tmp_path)
    received: list[bytes] = []
    done = trio.Event()

    async def raw(tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, ctx, server_side=True, https_compatible=True)
        try:
            await tls.do_handshake()
            while data := await tls.receive_some(65536):
                received.append(bytes(data))
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(tls)
            done.set()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, raw, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    another = _make_ca("another CA")
    other = Anchor(pin=pki.spki_pin(another[1].public_key()), pem=_pem(another[0]))
    with pytest.raises(PeerVerificationError, match=r"does not chain to the pinned serving CA"):
        await connect_pinned("127.0.0.1", port, "gw.test", other, timeout=5)
    with trio.fail_after(5):
        await done.wait()
    assert received == []


async def test_wrong_pin_never_reaches_handler(server: Server) -> None:
    impostor = _make_ca("impostor")
    other = Anchor(pin=pki.spki_pin(impostor[1].public_key()), pem=_pem(impostor[0]))
    with pytest.raises(PeerVerificationError, match=r"serving_ca_spki_pin"):
        await connect_pinned("127.0.0.1", server.port, "gw.test", other)
    await trio.sleep(0.1)
    assert server.requests == []


async def test_wrong_server_name(server: Server) -> None:
    with pytest.raises(PeerVerificationError, match=r"not valid for other\.test"):
        await _connect(server, name="other.test")
    assert server.requests == []


async def test_unreachable() -> None:
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransportError, match=r"cannot reach the gateway at 127\.0\.0\.1:"):
        await connect_pinned("127.0.0.1", port, "gw.test", material().anchor, timeout=5)


async def test_client_certificate_seen_by_server(server: Server) -> None:
    m = material()
    async with _client(server, client_cert=(_pem(m.client, m.ca), _key_pem(m.client_key))) as c:
        resp = await c.renew(b"{}")
    assert resp.status == 200
    assert server.requests[0].peer_cert_der == m.client.public_bytes(DER)


class _Identity:
    """What a dial's context is kept for: a loaded identity (weakly referenced)."""


async def test_a_context_is_built_once_per_identity_and_anchor(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dials with the same identity share one context (building one parses the CA, the
    chain and the key); a renewed identity dials with its own certificate, never the
    old one's; a certless dial's context is kept per anchor."""
    m = material()
    built: list[tuple[str, bytes] | None] = []
    real = tls.pinned_context

    def counted(anchor: Anchor, client_cert: tuple[str, bytes] | None = None) -> ssl.SSLContext:
        built.append(client_cert)
        return real(anchor, client_cert)

    monkeypatch.setattr(tls, "pinned_context", counted)
    monkeypatch.setattr(tls, "_CERTLESS", {})
    renewed, renewed_key = _make_leaf(
        (m.ca, m.ca_key),
        [x509.UniformResourceIdentifier("spiffe://bc.test/site/s/node/n")],
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    first = (_pem(m.client, m.ca), _key_pem(m.client_key))
    second = (_pem(renewed, m.ca), _key_pem(renewed_key))
    old, new = _Identity(), _Identity()
    for owner, cert in ((old, first), (old, first), (new, second), (new, second)):
        async with _client(server, client_cert=cert, owner=owner) as c:
            assert (await c.renew(b"{}")).status == 200
    seen = [r.peer_cert_der for r in server.requests]
    assert seen == [m.client.public_bytes(DER)] * 2 + [renewed.public_bytes(DER)] * 2
    assert built == [first, second]
    for _ in range(2):
        async with _client(server) as c:  # certless, as a join dials
            assert (await c.join(b"{}")).status == 200
    assert built == [first, second, None]
    assert server.requests[-1].peer_cert_der is None

    other_ca = _make_ca("another serving CA")
    other = anchor_of(_pem(other_ca[0]), pki.spki_pin(other_ca[1].public_key()))
    kept = tls.cached_context(m.anchor, first, old)
    assert tls.cached_context(other, first, old) is not kept  # a new anchor: built anew
    assert built[-1] == first
    gone = weakref.ref(tls.cached_context(m.anchor, first, old))
    del old, kept
    gc.collect()
    assert gone() is None  # the identity went, and its context (its key) with it
    assert tls.cached_context(m.anchor, second, new) is tls.cached_context(m.anchor, second, new)
    # a caller that hands the same identity another chain never dials with the kept one
    assert tls.cached_context(m.anchor, first, new) is not tls.cached_context(m.anchor, second, new)


async def test_bad_client_key_is_transport_error(server: Server) -> None:
    with pytest.raises(TransportError, match="does not load"):
        await _connect(server, client_cert=(_pem(material().client), b"not a key"))


# --- verify_server_chain ----------------------------------------------------------


def test_verify_server_chain_accepts_good_chain() -> None:
    m = material()
    assert verify_server_chain(m.chain_der, "gw.test", m.pin, NOW) is None
    assert verify_server_chain(m.chain_der, "127.0.0.1", m.pin, NOW) is None


def test_expired_leaf() -> None:
    m = material()
    with pytest.raises(TransportError, match="not valid at"):
        verify_server_chain(m.chain_der, "gw.test", m.pin, NOW + timedelta(days=3))


def test_leaf_without_pinned_ca_in_chain() -> None:
    m = material()
    with pytest.raises(TransportError, match="serving_ca_spki_pin"):
        verify_server_chain(m.chain_der[:1], "gw.test", m.pin, NOW)


def test_chain_not_signed_by_pinned_ca() -> None:
    m = material()
    impostor = _make_ca("impostor")
    leaf, _ = _make_leaf(impostor, SERVER_SAN, ExtendedKeyUsageOID.SERVER_AUTH)
    chain = [leaf.public_bytes(DER), m.ca.public_bytes(DER)]  # presents the real CA too
    with pytest.raises(TransportError, match="serving_ca_spki_pin"):
        verify_server_chain(chain, "gw.test", m.pin, NOW)


def test_client_leaf_is_not_a_server() -> None:
    m = material()
    chain = [m.client.public_bytes(DER), m.ca.public_bytes(DER)]
    with pytest.raises(TransportError):
        verify_server_chain(chain, "gw.test", m.pin, NOW)


def test_pinned_intermediate_is_the_anchor() -> None:
    root = _make_ca("root")
    inter = _make_ca("serving intermediate", issuer=root)
    leaf, _ = _make_leaf(inter, SERVER_SAN, ExtendedKeyUsageOID.SERVER_AUTH)
    chain = [c.public_bytes(DER) for c in (leaf, inter[0], root[0])]
    pin = pki.spki_pin(inter[1].public_key())
    assert verify_server_chain(chain, "gw.test", pin, NOW) is None
    assert verify_server_chain(chain[:2], "gw.test", pin, NOW) is None


def _flip(data: tuple[int, int]) -> bytes:
    der = bytearray(material().leaf.public_bytes(DER))
    der[data[0] % len(der)] ^= data[1] or 1
    return bytes(der)


_CHAIN_PART = st.one_of(
    st.binary(max_size=400),
    st.sampled_from(material().chain_der),
    st.tuples(st.integers(0, 10_000), st.integers(0, 255)).map(_flip),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=st.lists(_CHAIN_PART, max_size=4),
    name=st.sampled_from(["gw.test", "127.0.0.1", "", "::1", "-." * 10, "x" * 300]),
    pin=st.sampled_from([material().pin, material().other_pin, "garbage"]),
)
def test_verify_server_chain_raises_only_transport_error(
    chain: list[bytes], name: str, pin: str
) -> None:
    with contextlib.suppress(TransportError):
        verify_server_chain(chain, name, pin, NOW)


# --- the server -------------------------------------------------------------------


async def test_oversized_body_gets_413(server: Server) -> None:
    async with _client(server) as client:
        resp = await client.join(b"x" * 100_000)
    assert resp.status == 413
    assert json.loads(resp.body) == {
        "code": "INVALID_ARGUMENT",
        "message": "request body too large",
    }
    assert server.requests == []


async def test_handler_exception_is_500_without_its_text(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    async with _client(server) as client:
        with caplog.at_level(logging.ERROR, logger="control.http"):
            resp = await client.request("GET", "/boom")
    assert resp.status == 503
    assert json.loads(resp.body) == {"code": "UNAVAILABLE", "message": "internal error"}
    assert b"secret-detail-xyz" not in resp.body
    assert any(r.name == "control.http" and r.exc_info for r in caplog.records)


async def test_malformed_request_gets_400(server: Server) -> None:
    stream = await _connect(server)
    try:
        await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
    finally:
        await stream.aclose()
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b'"code":"INVALID_ARGUMENT"' in data
    assert server.requests == []


async def test_keep_alive_two_requests_one_connection(server: Server) -> None:
    async with _client(server) as client:
        first = await client.request("GET", "/one")
        second = await client.post("/two", b"{}")
    assert (first.status, second.status) == (200, 200)
    assert [r.path for r in server.requests] == ["/one", "/two"]
    assert server.requests[0].remote == server.requests[1].remote


async def test_streamed_lines(server: Server) -> None:
    async with _client(server) as client:
        async with client.stream_lines("POST", "/stream", b"{}") as lines:
            got = [json.loads(line) async for line in lines]
        # the connection is still good for another request afterwards
        again = await client.request("GET", "/after")
    assert lines.status == 200
    assert lines.headers["transfer-encoding"] == "chunked"
    assert got == [
        {"type": "welcome", "session_id": "s1"},
        {"type": "ping"},
        {"type": "ping"},
        {"type": "revocation"},
    ]
    assert again.status == 200
    assert server.requests[0].remote == server.requests[1].remote


async def test_stream_stops_when_client_leaves(server: Server) -> None:
    async with _client(server) as client, client.stream_lines("POST", "/forever", b"{}") as lines:
        assert lines.status == 200
        assert await aiter(lines).__anext__() == b'{"type":"ping"}'
    with trio.fail_after(5):
        await server.stream_closed.wait()


async def test_line_too_long(server: Server) -> None:
    async with _client(server) as client:
        async with client.stream_lines("GET", "/bigline") as lines:
            with pytest.raises(TransportError, match="over 65536 bytes"):
                async for _ in lines:
                    pass
        # that connection is not reused: the next request has a new one
        assert (await client.request("GET", "/next")).status == 200
    assert server.requests[0].remote != server.requests[1].remote


async def test_idle_connection_is_closed(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "FIRST_REQUEST_TIMEOUT", 0.2)  # a new connection that sends nothing
    stream = await _connect(server)
    try:
        with trio.fail_after(5):
            assert await stream.receive_some(100) == b""
    finally:
        await stream.aclose()


async def test_fetch_url_plain_http(nursery: trio.Nursery) -> None:
    srv = Server()
    port = await nursery.start(http.serve, srv.handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/api/compute/.well-known/better-compute?v=1"
    resp = await gatewayclient.fetch_url(url, timeout=5)
    assert resp.status == 200
    assert json.loads(resp.body)["path"] == "/api/compute/.well-known/better-compute"
    assert srv.requests[0].query == {"v": "1"}
    assert srv.requests[0].peer_cert_der is None


async def test_fetch_url_refuses_other_schemes() -> None:
    with pytest.raises(TransportError, match="not an http"):
        await gatewayclient.fetch_url("ftp://example.test/x")


def test_error_response_uses_wire_status() -> None:
    resp = http.error_response("NOT_FOUND", "no such node", [("x-a", "b")])
    assert resp.status == 404
    assert json.loads(resp.body) == {"code": "NOT_FOUND", "message": "no such node"}
    assert ("x-a", "b") in resp.headers
    assert http.error_response("RESOURCE_EXHAUSTED", "slow down").status == 429


async def test_tls_handshake_failure(nursery: trio.Nursery) -> None:
    srv = Server()
    port = await nursery.start(http.serve, srv.handler, "127.0.0.1", 0)  # plain HTTP
    with pytest.raises(TransportError, match=r"TLS handshake with the gateway at .* failed"):
        await connect_pinned("127.0.0.1", port, "gw.test", material().anchor, timeout=5)


async def test_tls_handshake_timeout(nursery: trio.Nursery) -> None:
    async def silent(tcp: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(TransportError, match="timed out"):
        await connect_pinned("127.0.0.1", port, "gw.test", material().anchor, timeout=0.3)


async def test_fetch_url_https_is_verified_by_the_system_store(
    server: Server, nursery: trio.Nursery
) -> None:
    url = f"https://127.0.0.1:{server.port}/api/compute/.well-known/better-compute"
    with pytest.raises(
        TransportError, match=r"^TLS handshake with 127\.0\.0\.1:\d+ failed: CERTIFICATE_VERIFY"
    ):
        await gatewayclient.fetch_url(url, timeout=5)
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransportError, match=r"^cannot reach 127\.0\.0\.1:\d+: Connection refused"):
        await gatewayclient.fetch_url(f"http://127.0.0.1:{port}/x", timeout=5)
    assert server.requests == []


async def test_no_decompression_and_no_redirect(server: Server) -> None:
    async with _client(server) as client:
        with pytest.raises(
            TransportError,
            match=r"^gw\.test sent a response with Content-Encoding gzip; bcd accepts identity only$",
        ):
            await client.request("GET", "/gzip")
        moved = await client.request("GET", "/moved")
    assert moved.status == 302  # judged by the caller, never followed
    assert [r.path for r in server.requests] == ["/gzip", "/moved"]


# --- a gateway that goes away mid-answer ------------------------------------------


async def _raw_gateway(nursery: trio.Nursery, answer: bytes) -> GatewayClient:
    """A plain-TCP peer that reads a request head, writes ``answer`` and closes (a
    gateway killed mid-answer), and a GatewayClient to it over a plain dial."""

    async def peer(tcp: trio.SocketStream) -> None:
        got = b""
        while b"\r\n\r\n" not in got:
            got += await tcp.receive_some(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                      if k.strip().lower() == b"content-length")  # fmt: skip
        while len(body) < length:  # the whole request read: the close is a FIN, not a reset
            body += await tcp.receive_some(65536)
        await tcp.send_all(answer)
        await tcp.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, peer, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]

    async def dial(host: str, p: int) -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, p)

    return GatewayClient(DialTransport(dial), host="127.0.0.1", port=port, server_name="gw.test")


async def test_a_stream_cut_mid_answer_is_a_closed_connection(nursery: trio.Nursery) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    ping = b'{"type":"ping"}\n'
    client = await _raw_gateway(nursery, head + b"%x\r\n%s\r\n" % (len(ping), ping))
    seen: list[bytes] = []

    async def read_all() -> None:
        async with client, client.stream_lines("POST", "/v1/session", b"{}") as lines:
            async for line in lines:
                seen.append(line)

    with pytest.raises(TransportError, match="closed before the answer ended") as caught:
        await read_all()
    assert seen == [ping.strip()]
    assert "malformed" not in str(caught.value)


async def test_no_answer_at_all_is_a_closed_connection(nursery: trio.Nursery) -> None:
    client = await _raw_gateway(nursery, b"")
    async with client:
        with pytest.raises(TransportError, match="closed before the answer ended"):
            await client.post("/v1/renew", b"{}")


async def test_a_malformed_answer_is_still_malformed(nursery: trio.Nursery) -> None:
    client = await _raw_gateway(nursery, b"NOT HTTP AT ALL\r\n\r\n")
    async with client:
        with pytest.raises(TransportError, match="sent a malformed HTTP response"):
            await client.post("/v1/renew", b"{}")
