"""The relay between gateways and API replicas: mutual TLS, and nothing to mint with.

A gateway (``serve --role gateway``) answers nodes itself only for sessions and
health. ``POST /v1/join``, ``/v1/renew`` and the vouch path it relays, body as it
came, to an API replica's relay listener (``serve --role api --relay-listen``),
adding two headers:

- ``bc-relay-peer-cert``: the node's TLS client certificate, base64 DER (absent
  when it sent none);
- ``bc-relay-remote``: the node's address as the gateway saw it (``host:port``).

The gateway's own report of the sessions it holds (:data:`GATEWAY_PATHS`,
:mod:`control.sessionreport`) goes the same way, with neither header.

The relay listener believes those headers only from a verified relay certificate
(:func:`control.gatewaypki.is_relay_certificate`), then judges the call exactly as
the one-process ``serve`` does (:class:`control.gateway.NodeCalls`). What a stolen
relay credential buys: the calls a node could make anyway. A join still needs a
token sealed to a key the gateway does not hold, bound to the CSR it was sealed
with; a renewal still needs the node key's proof of possession.

Several upstreams are tried in turn (``--api-upstream``, repeatable), starting with
the last one that answered. Only a call that never reached a replica (a connection
or TLS failure, no free connection within :data:`POOL_TIMEOUT_S`) moves to the next
one; when it reached none, every one is tried once more after
:data:`SECOND_PASS_AFTER_S` (a replica whose handshakes stalled for a moment, the
only one of a small fleet restarting), if a whole attempt still fits in
:data:`RELAY_DEADLINE_S`, the relay's bound on one call, under the node's 30 s (no
attempt starts with less than :data:`MIN_ATTEMPT_S` of it left). A call that may
have reached one (a reset or a close after it was sent, no whole answer within
:data:`ATTEMPT_S`) is never sent to another, since the first may still be judging it: it is answered ``UNAVAILABLE`` with ``retry-pushback-ms`` and the
next upstream becomes the preferred one; the node's own retry, with the same CSR,
is answered again by JoinService's lost-answer rule. When none answers:
``UNAVAILABLE`` with ``retry-pushback-ms``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence

import h11
import trio

from bcd.netstream import fd_readable
from bcd.tlsstream import SocketTLSStream
from control import discovery, nodefacts
from control.errors import ControlError
from control.gatewaypki import GatewayBundle, is_relay_certificate
from control.http import Request, Response, error_response
from control.metrics import Metrics
from control.pki import load_chain

log = logging.getLogger("control.relay")

PEER_CERT_HEADER = "bc-relay-peer-cert"
REMOTE_HEADER = "bc-relay-remote"
RELAYED_PATHS = frozenset({"/v1/join", "/v1/renew", discovery.VOUCH_PATH})
GATEWAY_PATHS = frozenset({nodefacts.SESSIONS_PATH})
"""The gateway's own calls (its session report): never a node's, which the gateway's
front door answers NOT_FOUND; here only from a relay certificate, like the rest."""
MAX_ANSWER = 1 << 20  # an API replica's answer is a few KiB; more is not relayed
MAX_PEER_CERT_B64 = 8 * 1024
MAX_REMOTE = 64
NONE_UP_PUSHBACK_MS = 1_000
CONNECT_TIMEOUT_S = 3.0
POOL_TIMEOUT_S = 3.0  # no free connection: nothing was sent, so the next replica may take it
MAX_CONNECTIONS = 64  # open to the upstreams at once, idle or busy
MAX_ANSWER_HEAD = 16 * 1024  # an answer's status line and headers
KEEPALIVE_S = 5.0  # an idle connection to a replica is closed after this
_RECV = 65536
ATTEMPT_S = 12.0  # one upstream's whole answer; then the next one, within the node's 30 s
RELAY_DEADLINE_S = 25.0  # one relayed call, every attempt and pass; the node waits 30 s
SECOND_PASS_AFTER_S = 0.5  # when no upstream took the call; then each once more
MIN_ATTEMPT_S = 5.0  # no attempt starts with less of RELAY_DEADLINE_S left
HEALTH_TIMEOUT_S = 2.0
_PASSED_HEADERS = ("content-type", "retry-pushback-ms")


def client_context(bundle: GatewayBundle) -> ssl.SSLContext:
    """The relay's TLS client: the serving CA is the only trust anchor, the relay
    certificate is presented, host names are checked, the chain is held to RFC 5280
    (``VERIFY_X509_STRICT``, as on Python 3.13)."""
    # not create_default_context: it would write the TLS secrets to $SSLKEYLOGFILE
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # no PARTIAL_CHAIN: the serving CA anchors
    ctx.load_verify_locations(cadata=bundle.serving_ca_pem)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a write never has to read (bcd.tlsstream)
    load_chain(ctx, bundle.relay_chain_pem, bundle.relay_key)
    return ctx


class _NotSent(Exception):
    """Nothing of the call reached the upstream: refused, no route, the TCP connect or
    the TLS handshake failed or timed out, no free connection in time. Only these move
    a call to the next upstream."""


class _TooLarge(Exception):
    pass


class _Broken(Exception):
    """The upstream closed the connection before its whole answer."""


@dataclasses.dataclass(frozen=True)
class _Upstream:
    url: str
    tls: bool
    host: str
    port: int
    authority: bytes  # the Host header

    @classmethod
    def parse(cls, url: str) -> _Upstream:
        """``https://host:port`` (``http://`` in tests): no path, query, fragment or
        user, which a call would not carry anyway."""
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            parts, port = None, 0
        if (
            parts is None
            or parts.scheme not in ("https", "http")
            or not parts.hostname
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or "@" in parts.netloc
            or not parts.netloc.isascii()
        ):
            raise ControlError("INVALID_CONFIG", f"not an upstream URL: {url!r}")
        return cls(url, parts.scheme == "https", parts.hostname, port, parts.netloc.encode())


@dataclasses.dataclass(eq=False)
class _Conn:
    """A kept-alive connection to one upstream: its stream and its HTTP/1.1 state."""

    stream: trio.abc.Stream
    fd: int
    http: h11.Connection
    idle_since: float = 0.0


class RelayClient:
    """Relays node calls to API replicas over kept-alive connections, HTTP/1.1 by h11.

    The pool is the relay's own, not httpcore's (docs/decisions.md, "The relay's
    client"): at most :data:`MAX_CONNECTIONS` connections open, each upstream's idle
    ones reused most recent first, an idle one checked (one ``poll``) only when it is
    taken and closed after :data:`KEEPALIVE_S`. A call is one POST of the node's body
    as it came, with headers built here; the answer is read whole, bounded by
    :data:`MAX_ANSWER`. No proxy, no redirect, no decoding."""

    def __init__(
        self,
        upstreams: Sequence[str],
        ctx: ssl.SSLContext,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        if not upstreams:
            raise ControlError("INVALID_CONFIG", "a gateway needs at least one --api-upstream URL")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self._parsed = [_Upstream.parse(u) for u in self.upstreams]
        self.metrics = metrics or Metrics()
        self._ctx = ctx
        self._preferred = 0
        self._idle: list[list[_Conn]] = [[] for _ in self._parsed]
        self._open_count = 0  # connections open, idle or busy: at most MAX_CONNECTIONS
        self._changed = trio.Event()  # set when a connection goes idle or is closed
        self._up_checked_at = -1e9
        self._up = False

    async def aclose(self) -> None:
        for idle in self._idle:
            while idle:
                self._discard(idle.pop())
        await trio.lowlevel.checkpoint()

    def _order(self) -> list[int]:
        n = len(self.upstreams)
        return [(self._preferred + i) % n for i in range(n)]

    async def forward(self, req: Request) -> Response:
        with self.metrics.timed_relay():
            return await self._forward(req)

    async def _forward(self, req: Request) -> Response:
        headers = [  # built here, never copied from the node's request
            (b"content-type", b"application/json"),
            (REMOTE_HEADER.encode(), req.remote[:MAX_REMOTE].encode("ascii")),
        ]
        if req.peer_cert_der is not None:
            headers.append((PEER_CERT_HEADER.encode(), base64.b64encode(req.peer_cert_der)))
        deadline = trio.current_time() + RELAY_DEADLINE_S
        for second in (False, True):
            if second:
                if trio.current_time() + SECOND_PASS_AFTER_S + ATTEMPT_S > deadline:
                    break
                log.warning(
                    "no JoinService replica took the call; each once more in %g s",
                    SECOND_PASS_AFTER_S,
                )
                await trio.sleep(SECOND_PASS_AFTER_S)
            for index in self._order():
                if deadline - trio.current_time() < MIN_ATTEMPT_S:
                    break  # too little time left to judge a call: the node retries it
                answer = await self._attempt(index, req, headers, deadline)
                if answer is not None:
                    return answer
        raise ControlError(
            "UNAVAILABLE",
            "no JoinService replica answers; retry",
            retry_after_ms=NONE_UP_PUSHBACK_MS,
        )

    async def _attempt(
        self,
        index: int,
        req: Request,
        headers: list[tuple[bytes, bytes]],
        deadline: float,
    ) -> Response | None:
        """The call on one upstream: its answer, or None when it never reached it."""
        url = self.upstreams[index] + req.path
        end = min(trio.current_time() + ATTEMPT_S, deadline)
        try:
            status, answer_headers, body = await self._call(
                index, b"POST", req.path, headers, req.body, end
            )
        except _NotSent as exc:  # nothing reached that replica: the next one may
            self.metrics.relay_not_sent.inc()
            log.warning("relay to %s failed (%s); trying the next", url, exc)
            return None
        except (*_TRANSPORT, trio.TooSlowError) as exc:
            # The call may be running there still: sending it to another replica too
            # could judge it twice (a second node for an untrusted key, a renewal
            # refused as a replay while the first was issued). The node retries it.
            self._preferred = (index + 1) % len(self.upstreams)
            log.warning("relay to %s failed after sending (%s)", url, type(exc).__name__)
            raise ControlError(
                "UNAVAILABLE",
                "the JoinService replica did not answer; retry",
                retry_after_ms=NONE_UP_PUSHBACK_MS,
            ) from exc
        self._preferred = index
        return Response(status, body, _passed(answer_headers))

    async def any_up(self) -> bool:
        """Whether an upstream is ready (its ``/readyz``; asked at most once a second)."""
        now = trio.current_time()
        if now - self._up_checked_at < 1.0:
            return self._up
        self._up_checked_at = now
        for index in self._order():
            end = trio.current_time() + HEALTH_TIMEOUT_S
            try:
                status, _, _ = await self._call(index, b"GET", "/readyz", [], b"", end)
            except (_NotSent, *_TRANSPORT, trio.TooSlowError):
                continue
            if status == 200:
                self._up = True
                return True
        self._up = False
        return False

    async def _call(
        self,
        index: int,
        method: bytes,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        end: float,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request to upstream ``index`` and its whole answer, by ``end``.
        :class:`_NotSent` when no connection was had (nothing was sent); after that a
        :data:`_TRANSPORT` failure or :class:`trio.TooSlowError`, the connection closed
        on any failure (cancellation included: no leak)."""
        conn = await self._take(index, end)
        try:
            with trio.fail_at(end):
                return await self._exchange(index, conn, method, path, headers, body)
        except BaseException:
            self._discard(conn)
            raise

    # --- the pool ---------------------------------------------------------------------

    async def _take(self, index: int, end: float) -> _Conn:
        """A live idle connection to upstream ``index`` (the most recent), or a new one
        opened by ``end``; :class:`_NotSent` when neither. With every connection open
        and busy, the call waits (at most :data:`POOL_TIMEOUT_S`) for one to go idle,
        which it takes (its upstream's) or closes to open its own (another's)."""
        wait_until = min(end, trio.current_time() + POOL_TIMEOUT_S)
        while True:
            self._expire()
            idle = self._idle[index]
            while idle:
                conn = idle.pop()
                if not fd_readable(conn.fd):
                    return conn  # the exchange's send is the checkpoint
                self._discard(conn)
            if self._open_count < MAX_CONNECTIONS or self._evict_one():
                self._open_count += 1
                try:
                    return await self._open(self._parsed[index], end)
                except BaseException:
                    self._open_count -= 1
                    self._notify()
                    raise
            with trio.move_on_at(wait_until):
                await self._changed.wait()
            if trio.current_time() >= wait_until:
                raise _NotSent(f"no free connection within {POOL_TIMEOUT_S:g} s")

    def _notify(self) -> None:
        """Wake the calls waiting for a connection: one went idle or was closed."""
        self._changed.set()
        self._changed = trio.Event()

    def _expire(self) -> None:
        """Close every upstream's connections idle for :data:`KEEPALIVE_S` (the oldest
        are first in each list)."""
        now = trio.current_time()
        for idle in self._idle:
            while idle and now - idle[0].idle_since >= KEEPALIVE_S:
                self._discard(idle.pop(0))

    async def _open(self, up: _Upstream, end: float) -> _Conn:
        """TCP, then TLS (:class:`bcd.tlsstream.SocketTLSStream`), each within
        :data:`CONNECT_TIMEOUT_S` and by ``end``; every failure is :class:`_NotSent`."""
        try:
            with trio.fail_at(min(end, trio.current_time() + CONNECT_TIMEOUT_S)):
                tcp = await trio.open_tcp_stream(up.host, up.port)
        except trio.TooSlowError:
            raise _NotSent(f"connecting to {up.host}:{up.port} timed out") from None
        except OSError as exc:
            raise _NotSent(f"connecting to {up.host}:{up.port}: {exc}") from None
        if not up.tls:
            return _Conn(tcp, tcp.socket.fileno(), _client())
        try:
            tls = SocketTLSStream(tcp, self._ctx, server_hostname=up.host)
        except trio.BrokenResourceError as exc:
            raise _NotSent(str(exc)) from None
        try:
            with trio.fail_at(min(end, trio.current_time() + CONNECT_TIMEOUT_S)):
                await tls.do_handshake()
        except trio.TooSlowError:
            tls.close()
            raise _NotSent("the TLS handshake timed out") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            tls.close()
            raise _NotSent(str(exc)) from None
        except BaseException:  # cancelled: no leak
            tls.close()
            raise
        return _Conn(tls, tls.fileno(), _client())

    def _discard(self, conn: _Conn) -> None:
        """Close ``conn`` at once; the calls waiting for a connection may open one."""
        if isinstance(conn.stream, SocketTLSStream):
            conn.stream.close()
        else:
            assert isinstance(conn.stream, trio.SocketStream)
            conn.stream.socket.close()
        self._open_count -= 1
        self._notify()

    def _evict_one(self) -> bool:
        """Close the idle connection idle longest, of any upstream (whether there was
        one)."""
        oldest = min((idle for idle in self._idle if idle), key=lambda i: i[0].idle_since,
                     default=None)  # fmt: skip
        if oldest is None:
            return False
        self._discard(oldest.pop(0))
        return True

    async def _exchange(
        self,
        index: int,
        conn: _Conn,
        method: bytes,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request and its whole answer on ``conn``, which goes back to the idle ones
        when both ends are done with it (else it is closed)."""
        http = conn.http  # h11's state of this connection
        head = [(b"host", self._parsed[index].authority), *headers]
        if method == b"POST":
            head.append((b"content-length", str(len(body)).encode("ascii")))
        out = http.send(h11.Request(method=method, target=path.encode("ascii"), headers=head))
        assert out is not None
        if body:
            out += http.send(h11.Data(data=body)) or b""
        out += http.send(h11.EndOfMessage()) or b""
        await conn.stream.send_all(out)
        status = 0
        answer_headers: list[tuple[bytes, bytes]] = []
        answer = bytearray()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(bytes(await conn.stream.receive_some(_RECV)))
            elif isinstance(event, h11.Response):
                status, answer_headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                answer += event.data
                if len(answer) > MAX_ANSWER:
                    raise _TooLarge
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise _Broken("the upstream closed the connection before its answer ended")
            elif not isinstance(event, h11.InformationalResponse):  # a 1xx is skipped
                raise _Broken(f"unexpected {type(event).__name__} in an answer")
        # reused only when both ends are done and the upstream sent nothing beyond its
        # answer (else the next call would read that as its own answer)
        done = http.our_state is h11.DONE and http.their_state is h11.DONE
        if done and http.trailing_data == (b"", False):
            http.start_next_cycle()
            conn.idle_since = trio.current_time()
            self._idle[index].append(conn)
            self._notify()
        else:
            self._discard(conn)
        return status, answer_headers, bytes(answer)


def _client() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_ANSWER_HEAD)


# Every failure of a call once it may have reached the replica: the connection broke or
# closed, the answer was not HTTP or too large.
_TRANSPORT = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
    h11.ProtocolError,
    _Broken,
    _TooLarge,
)


def _passed(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The answer's headers that go back to the node (a repeated one joined by
    commas, as httpx's ``headers[name]`` gave it)."""
    found: dict[str, list[str]] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name in _PASSED_HEADERS:
            found.setdefault(name, []).append(raw_value.decode("latin-1"))
    return [(name, ", ".join(found[name])) for name in _PASSED_HEADERS if name in found]


Handler = Callable[[Request], Awaitable[Response]]


@dataclasses.dataclass
class RelayListener:
    """The API replica's side: only relay certificates, only the relayed paths."""

    calls: Handler
    health: Callable[[str], Awaitable[Response]]

    async def handle(self, req: Request) -> Response:
        if req.method == "GET" and req.path in ("/healthz", "/readyz"):
            return await self.health(req.path)
        if is_relay_certificate(req.peer_cert_der) is None:
            return error_response("UNAUTHENTICATED", "a relay client certificate is required")
        if req.method != "POST" or req.path not in RELAYED_PATHS | GATEWAY_PATHS:
            return error_response("NOT_FOUND", "no such path")
        try:
            inner = dataclasses.replace(
                req,
                peer_cert_der=_peer_cert(req.headers.get(PEER_CERT_HEADER)),
                remote=_remote(req.headers.get(REMOTE_HEADER)),
            )
        except ValueError as exc:
            return error_response("INVALID_ARGUMENT", str(exc))
        return await self.calls(inner)


def _peer_cert(value: str | None) -> bytes | None:
    if value is None:
        return None
    if len(value) > MAX_PEER_CERT_B64:
        raise ValueError(f"{PEER_CERT_HEADER} is longer than {MAX_PEER_CERT_B64} characters")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{PEER_CERT_HEADER} is not base64") from None


def _remote(value: str | None) -> str:
    if value is None:
        return "unknown"
    if len(value) > MAX_REMOTE or not value.isascii() or not value.isprintable():
        raise ValueError(f"{REMOTE_HEADER} is not an address")
    return value
