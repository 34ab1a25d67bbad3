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
import math
import ssl
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence

import httpcore
import trio

from bcd.netstream import NetworkStream, TcpBackend
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
CALL_TIMEOUT_S = 35.0  # httpcore's, per read or write
KEEPALIVE_S = 5.0  # an idle connection to a replica is closed after this
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


class _PlainStream(NetworkStream):
    """A relay connection before its TLS: ``start_tls`` runs it on the socket itself
    (:class:`bcd.tlsstream.SocketTLSStream`), not over httpcore's trio backend's
    ``trio.SSLStream``. Its failures are httpcore's connect errors, so the call moves
    on as one that was never sent."""

    def __init__(self, tcp: trio.SocketStream) -> None:
        super().__init__(tcp)
        self._tcp = tcp

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        if server_hostname is None:  # httpcore passes the origin's host for https
            await trio.aclose_forcefully(self._tcp)
            raise httpcore.ConnectError("a relay upstream needs a host name")
        try:
            tls = SocketTLSStream(self._tcp, ssl_context, server_hostname=server_hostname)
        except trio.BrokenResourceError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                await tls.do_handshake()
        except trio.TooSlowError as exc:
            tls.close()
            raise httpcore.ConnectTimeout("the relay's TLS handshake timed out") from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            tls.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:  # cancelled (the attempt's bound, the node gone): no leak
            tls.close()
            raise
        return NetworkStream(tls)


async def _connect(
    host: str,
    port: int,
    timeout: float | None,  # noqa: ASYNC109 - httpcore's connect timeout
) -> httpcore.AsyncNetworkStream:
    """TCP by trio; the TLS is :class:`_PlainStream`'s."""
    try:
        with trio.fail_after(math.inf if timeout is None else timeout):
            tcp = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError as exc:
        raise httpcore.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
    except OSError as exc:
        raise httpcore.ConnectError(f"connecting to {host}:{port}: {exc}") from exc
    return _PlainStream(tcp)


class RelayClient:
    """Relays node calls to API replicas; one httpcore connection pool, kept-alive
    connections per upstream.

    httpcore, not httpx over it: a relayed call is one POST of bytes as they came,
    and httpx's request and response models cost about 0.17 ms of the gateway's CPU
    per call (0.60 against 0.43 ms for a relayed 5 KB POST over a kept-alive TLS
    connection). No proxy from the environment, no redirects, no decoding: httpcore
    has none of them."""

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
        self.metrics = metrics or Metrics()
        self._preferred = 0
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ctx,
            max_connections=64,
            max_keepalive_connections=64,  # all of them: no handshake churn under load
            keepalive_expiry=KEEPALIVE_S,
            network_backend=TcpBackend(_connect),
        )
        self._up_checked_at = -1e9
        self._up = False

    async def aclose(self) -> None:
        await self._pool.aclose()

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
        try:
            with trio.fail_at(min(trio.current_time() + ATTEMPT_S, deadline)):
                async with self._pool.stream(
                    "POST",
                    url,
                    content=req.body,
                    headers=headers,
                    extensions={"timeout": _TIMEOUTS},
                ) as answer:
                    body = await _bounded(answer)
        except _NOT_SENT as exc:  # nothing reached that replica: the next one may
            self.metrics.relay_not_sent.inc()
            log.warning("relay to %s failed (%s); trying the next", url, type(exc).__name__)
            return None
        except (*_TRANSPORT, _TooLarge, trio.TooSlowError) as exc:
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
        return Response(answer.status, body, _passed(answer.headers))

    async def any_up(self) -> bool:
        """Whether an upstream is ready (its ``/readyz``; asked at most once a second)."""
        now = trio.current_time()
        if now - self._up_checked_at < 1.0:
            return self._up
        self._up_checked_at = now
        for index in self._order():
            try:
                answer = await self._pool.request(
                    "GET",
                    self.upstreams[index] + "/readyz",
                    extensions={"timeout": _HEALTH_TIMEOUTS},
                )
            except _TRANSPORT:
                continue
            if answer.status == 200:
                self._up = True
                return True
        self._up = False
        return False


class _TooLarge(Exception):
    pass


# Failures before the request reached the replica (refused, no route, TLS, no free
# connection): only these move a call to the next upstream.
_NOT_SENT = (httpcore.ConnectError, httpcore.ConnectTimeout, httpcore.PoolTimeout)
# Every failure of the transport (what httpx calls a TransportError).
_TRANSPORT = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
)
_TIMEOUTS = {
    "connect": CONNECT_TIMEOUT_S,
    "read": CALL_TIMEOUT_S,
    "write": CALL_TIMEOUT_S,
    "pool": POOL_TIMEOUT_S,
}
_HEALTH_TIMEOUTS = dict.fromkeys(("connect", "read", "write", "pool"), HEALTH_TIMEOUT_S)


def _passed(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The answer's headers that go back to the node (a repeated one joined by
    commas, as httpx's ``headers[name]`` gave it)."""
    found: dict[str, list[str]] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name in _PASSED_HEADERS:
            found.setdefault(name, []).append(raw_value.decode("latin-1"))
    return [(name, ", ".join(found[name])) for name in _PASSED_HEADERS if name in found]


async def _bounded(answer: httpcore.Response) -> bytes:
    body = bytearray()
    stream = answer.stream
    assert isinstance(stream, AsyncIterable)  # a pool's answer streams asynchronously
    async for chunk in stream:
        body += chunk
        if len(body) > MAX_ANSWER:
            raise _TooLarge
    return bytes(body)


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
