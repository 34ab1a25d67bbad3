"""One client for the gateway, on httpx over a transport seam.

:class:`GatewayClient` sends the node's calls (``/v1/join``, ``/v1/renew``, the
vouch, the ``/v1/session`` stream) through any ``httpx.AsyncBaseTransport``: the
real one (:func:`bcd.transport.gateway_transport`, TLS pinned to the serving CA
inside the handshake), an in-process one, or a hostile one. Every failure comes out
of one error map (:func:`_translate`) as a :class:`~bcd.errors.TransportError`
whose message never holds bytes of a body; the answer itself (status, headers,
body) is judged by the caller.

Bounds, whatever the gateway sends: a whole body of at most ``max_body`` (1 MiB),
read raw with a running count; a response head of at most 100 KiB (httpcore's h11
bound, also checked on a head that arrived whole); ``Accept-Encoding: identity``
is sent and a response with another ``Content-Encoding`` is refused (no
decompression); 30 s for an exchange once its request starts (one trio deadline
over head and body, the connect and handshake having 15 s each before it); a
streamed line of at most 64 KiB and at most ``idle_timeout`` without a byte. No
redirect is followed, no proxy or ``.netrc`` from the environment is used.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import h11
import httpcore
import httpx
import trio

from bcd import __version__
from bcd.errors import BcdError, TransportError
from bcd.gatewayanswer import Response
from bcd.tls import os_reason

MAX_BODY = 1 << 20
MAX_LINE = 64 * 1024
MAX_HEAD = 100 * 1024  # httpcore's h11 max_incomplete_event_size
CONNECT_TIMEOUT_S = 15.0
EXCHANGE_TIMEOUT_S = 30.0

JOIN_PATH = "/v1/join"
RENEW_PATH = "/v1/renew"
VOUCH_PATH = "/v1/discovery/vouch"
SESSION_PATH = "/v1/session"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it (``__cause__``, else ``__context__``), at most 16 deep."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def _head_over(exc: BaseException) -> bool:
    for inner in _chain(exc):
        if isinstance(inner, h11.RemoteProtocolError) and inner.error_status_hint == 431:
            return True
        if "Receive buffer too long" in str(inner):
            return True
    return False


_CLOSED_EARLY = ("peer closed connection", "Server disconnected")
"""How h11 and httpcore word a connection the peer closed before its answer ended."""


def _closed_early(exc: BaseException) -> bool:
    return any(str(inner).startswith(_CLOSED_EARLY) for inner in _chain(exc))


def _connect_reason(exc: BaseException) -> tuple[bool, str]:
    """(whether TLS failed, a short reason) for a failed connect of httpx's own transport."""
    for inner in _chain(exc):
        if isinstance(inner, ssl.SSLError):
            return True, str(inner.reason or type(inner).__name__)
    for inner in _chain(exc):
        if isinstance(inner, OSError):
            return False, os_reason(inner)
    return False, str(exc) or type(exc).__name__


@contextlib.contextmanager
def _translate(
    name: str, where: str, timeout: float, peer: str = "the gateway at "
) -> Iterator[None]:
    """The one error map: httpx, httpcore, h11 and trio failures into TransportError.

    ``name`` is the gateway's name in messages about the exchange, ``where`` its
    host:port in messages about the connection, ``timeout`` the deadline that ran out.
    """
    try:
        yield
    except BcdError:
        raise  # the dial's own TransportError (cannot reach, handshake, pin) as it is
    except trio.TooSlowError as exc:
        raise TransportError(f"{name} did not answer within {timeout:g} s") from exc
    except (httpx.ConnectTimeout, httpcore.ConnectTimeout) as exc:
        raise TransportError(f"cannot reach {peer}{where}: timed out") from exc
    except (httpx.TimeoutException, httpcore.TimeoutException) as exc:
        raise TransportError(f"{name} did not answer within {timeout:g} s") from exc
    except (httpx.ConnectError, httpcore.ConnectError) as exc:
        tls_failed, reason = _connect_reason(exc)
        if tls_failed:
            raise TransportError(f"TLS handshake with {peer}{where} failed: {reason}") from exc
        raise TransportError(f"cannot reach {peer}{where}: {reason}") from exc
    except (
        httpx.RemoteProtocolError,
        httpcore.RemoteProtocolError,
        h11.RemoteProtocolError,
    ) as exc:
        if _head_over(exc):
            raise TransportError(
                f"{name} sent an HTTP head or chunk header over {MAX_HEAD} bytes"
            ) from exc
        if _closed_early(exc):  # a gateway killed mid-stream: not a malformed answer
            raise TransportError(
                f"the connection to {name} closed before the answer ended"
            ) from exc
        raise TransportError(f"{name} sent a malformed HTTP response") from exc
    except (httpx.LocalProtocolError, httpcore.LocalProtocolError) as exc:
        raise TransportError(f"the HTTP request to {name} could not be sent") from exc
    except (
        httpx.TransportError,
        httpcore.NetworkError,
        trio.BrokenResourceError,
        trio.ClosedResourceError,
        OSError,
    ) as exc:
        raise TransportError(f"the connection to {name} broke") from exc
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise TransportError(f"the exchange with {name} failed ({type(exc).__name__})") from exc


async def _close(resp: httpx.Response) -> None:
    """Close a response, even in a cancelled scope (its connection is not reused)."""
    with contextlib.suppress(Exception), trio.CancelScope(shield=True), trio.move_on_after(1):
        await resp.aclose()


def _checked_head(resp: httpx.Response, name: str) -> dict[str, str]:
    """The response's headers (lower-case names, repeated ones joined), once bounded."""
    if sum(len(k) + len(v) + 4 for k, v in resp.headers.raw) > MAX_HEAD:
        raise TransportError(f"{name} sent an HTTP head or chunk header over {MAX_HEAD} bytes")
    encoding = resp.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        shown = encoding[:40].encode("unicode_escape").decode("ascii")
        raise TransportError(
            f"{name} sent a response with Content-Encoding {shown}; bcd accepts identity only"
        )
    return dict(resp.headers.items())


async def read_body(resp: httpx.Response, name: str, max_body: int) -> bytes:
    """The raw body of ``resp``, at most ``max_body`` bytes (a running count)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > max_body:
            raise TransportError(f"the response from {name} is over {max_body} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class Lines:
    """An open streamed answer: its status and headers, and its body line by line.

    Iterating yields each non-empty line without its line ending; it raises
    TransportError when no byte arrives for ``idle_timeout`` seconds, a line is over
    ``max_line`` bytes, or the stream breaks. An error answer (one JSON object) is
    read with :meth:`read_rest` instead.
    """

    def __init__(
        self,
        resp: httpx.Response,
        headers: dict[str, str],
        name: str,
        idle_timeout: float | None,
        max_line: int,
    ) -> None:
        self.status = resp.status_code
        self.headers = headers
        self._raw = resp.aiter_raw()
        self._name = name
        self._idle = idle_timeout
        self._max_line = max_line
        self._gen: AsyncGenerator[bytes, None] | None = None

    async def _chunk(self, timeout: float | None) -> bytes | None:  # noqa: ASYNC109
        limit = float("inf") if timeout is None else timeout
        with _translate(self._name, self._name, limit), trio.fail_after(limit):
            return await anext(self._raw, None)

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        if self._gen is None:  # one iterator: a line split across reads is kept
            self._gen = self._lines()
        return self._gen

    async def aclose(self) -> None:
        closers = [getattr(gen, "aclose", None) for gen in (self._gen, self._raw)]
        for close in closers:
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    async def _lines(self) -> AsyncGenerator[bytes, None]:
        too_long = f"a line from {self._name} is over {self._max_line} bytes"
        buf = bytearray()
        while (chunk := await self._chunk(self._idle)) is not None:
            buf += chunk
            while (end := buf.find(b"\n")) >= 0:
                if end > self._max_line:
                    raise TransportError(too_long)
                line = bytes(buf[:end]).rstrip(b"\r")
                del buf[: end + 1]
                if line.strip():
                    yield line
            if len(buf) > self._max_line:
                raise TransportError(too_long)
        if buf.strip():
            yield bytes(buf).rstrip(b"\r")

    async def read_rest(self, limit: int, timeout: float = EXCHANGE_TIMEOUT_S) -> bytes:  # noqa: ASYNC109
        """The rest of the body, at most ``limit`` bytes within ``timeout`` seconds."""
        parts: list[bytes] = []
        size = 0
        try:
            with trio.fail_after(timeout):
                while (chunk := await self._chunk(None)) is not None:
                    size += len(chunk)
                    if size > limit:
                        raise TransportError(f"the answer from {self._name} is over {limit} bytes")
                    parts.append(chunk)
        except trio.TooSlowError as exc:
            raise TransportError(
                f"{self._name} did not finish its answer within {timeout:g} s"
            ) from exc
        return b"".join(parts)


class GatewayClient:
    """The node's calls to its gateway over ``transport`` (an ``httpx.AsyncBaseTransport``).

    ``host`` and ``port`` are the gateway's (the URL), ``server_name`` the name it
    serves (the ``Host`` header and the TLS name). Use as an async context manager,
    or call :meth:`aclose`.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        *,
        host: str,
        port: int,
        server_name: str,
        timeout: float = EXCHANGE_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.server_name = server_name
        self._where = f"{host}:{port}"
        self._url = httpx.URL(scheme="https", host=host, port=port)
        self._timeout = timeout
        self._connect = connect_timeout
        self._client = httpx.AsyncClient(
            transport=transport,
            trust_env=False,
            follow_redirects=False,
            headers={"user-agent": f"bcd/{__version__}", "accept-encoding": "identity"},
        )

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()

    def _send_timed(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Sequence[tuple[str, str]],
        read_timeout: float | None,
    ) -> tuple[httpx.Request, trio.CancelScope]:
        """The request, and the deadline over its exchange.

        The deadline first allows the connect and the handshake (``connect_timeout``
        each, which the dial enforces) and the exchange; once the request starts (a
        trace event of httpcore) it is ``timeout`` from then. httpx's own timeouts
        are a backstop behind it.
        """
        head = {"host": self.server_name, "accept": "application/json"}
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head["content-type"] = "application/json"
        head.update({k.lower(): v for k, v in headers})
        request = self._client.build_request(
            method,
            self._url.copy_with(raw_path=path.encode("ascii")),
            content=body if body is not None else (b"" if "content-type" in head else None),
            headers=head,
            timeout=httpx.Timeout(
                self._timeout + 5,
                read=None if read_timeout is None else read_timeout + 5,
                connect=self._connect,
                pool=self._connect,
            ),
        )
        scope = trio.CancelScope(deadline=trio.current_time() + 2 * self._connect + self._timeout)

        async def trace(event: str, info: Mapping[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                scope.deadline = trio.current_time() + self._timeout

        request.extensions["trace"] = trace
        return request, scope

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Sequence[tuple[str, str]] = (),
        *,
        max_body: int = MAX_BODY,
    ) -> Response:
        """One request; the whole answer (at most ``max_body``) within the deadline."""
        name = self.server_name
        request, scope = self._send_timed(method, path, body, headers, self._timeout)
        with _translate(name, self._where, self._timeout):
            with scope:
                resp = await self._client.send(request, stream=True)
                try:
                    found = _checked_head(resp, name)
                    data = await read_body(resp, name, max_body)
                finally:
                    await _close(resp)
            if scope.cancelled_caught:
                raise trio.TooSlowError
        return Response(status=resp.status_code, headers=found, body=data)

    async def post(self, path: str, body: bytes) -> Response:
        return await self.request("POST", path, body)

    async def join(self, body: bytes) -> Response:
        return await self.post(JOIN_PATH, body)

    async def renew(self, body: bytes) -> Response:
        return await self.post(RENEW_PATH, body)

    async def vouch(self, body: bytes) -> Response:
        return await self.post(VOUCH_PATH, body)

    @contextlib.asynccontextmanager
    async def stream_lines(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Sequence[tuple[str, str]] = (),
        *,
        idle_timeout: float | None = 60.0,
        max_line: int = MAX_LINE,
    ) -> AsyncIterator[Lines]:
        """Send a request and yield its streamed answer (:class:`Lines`); the head
        within the exchange's deadline, then each read within ``idle_timeout``."""
        name = self.server_name
        read = None if idle_timeout is None else max(idle_timeout, self._timeout)
        request, scope = self._send_timed(method, path, body, headers, read)
        with _translate(name, self._where, self._timeout):
            with scope:
                resp = await self._client.send(request, stream=True)
            if scope.cancelled_caught:
                raise trio.TooSlowError
        lines: Lines | None = None
        try:
            lines = Lines(resp, _checked_head(resp, name), name, idle_timeout, max_line)
            yield lines
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                if lines is not None:
                    await lines.aclose()
            await _close(resp)

    def session(
        self, hello: bytes, *, idle_timeout: float
    ) -> contextlib.AbstractAsyncContextManager[Lines]:
        """``POST /v1/session`` with the Hello; the stream of the gateway's lines."""
        return self.stream_lines(
            "POST",
            SESSION_PATH,
            hello,
            [("accept", "application/x-ndjson")],
            idle_timeout=idle_timeout,
        )


def system_store_context() -> ssl.SSLContext:
    """:func:`fetch_url`'s TLS client: the system trust store, host names checked.

    Not ``create_default_context``, which would write the TLS secrets to
    ``$SSLKEYLOGFILE``. Not ``VERIFY_X509_STRICT`` either, unlike the contexts that
    verify the project's own PKI: this store holds whatever CA the operator's site
    serves the control plane under (an enterprise CA, a TLS-inspecting proxy), which
    the project does not issue and cannot hold to RFC 5280, and the well-known
    document it fetches is believed for the pins it matches, not for its TLS.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked
    ctx.load_default_certs()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def fetch_url(
    url: str,
    *,
    timeout: float = 15,  # noqa: ASYNC109 - bounds connect, handshake and exchange
    max_body: int = MAX_BODY,
) -> Response:
    """GET a plain http:// or https:// URL (https verified by the system trust store)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise TransportError("the URL has an invalid port") from exc
    hostname = parts.hostname
    if parts.scheme not in ("http", "https") or not hostname:
        raise TransportError("the URL is not an http:// or https:// URL")
    where = f"{hostname}:{port or (443 if parts.scheme == 'https' else 80)}"
    transport = httpx.AsyncHTTPTransport(verify=system_store_context(), retries=0, trust_env=False)
    async with httpx.AsyncClient(
        transport=transport,
        trust_env=False,
        follow_redirects=False,
        timeout=timeout,
        headers={"accept-encoding": "identity", "accept": "application/json"},
    ) as client:
        with _translate(hostname, where, timeout, peer=""), trio.fail_after(timeout):
            async with client.stream("GET", url) as resp:
                found = _checked_head(resp, hostname)
                data = await read_body(resp, hostname, max_body)
    return Response(status=resp.status_code, headers=found, body=data)
