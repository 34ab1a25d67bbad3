"""A minimal HTTP/1.1 client on h11 over any trio stream.

The caller owns the stream (see :func:`bcd.tls.connect_pinned`); requests on the
same stream reuse it (keep-alive) as long as the previous exchange completed.
Every failure is a :class:`~bcd.errors.TransportError` whose message never
contains bytes of a body.

Everything read is bounded, whatever the server sends: a response head (status
line and headers, or a chunk header or trailers) of at most 32 KiB, at most 8
informational (1xx) heads before the response, a whole body of at most
``max_body`` (1 MiB by default, chunked or not), each streamed line at most
``max_line`` (64 KiB), and the rest of a streamed body read with :func:`read_rest`
at most its ``limit``.
"""

from __future__ import annotations

import contextlib
import math
import ssl
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11
import trio

from bcd.errors import TransportError
from bcd.tls import os_reason

MAX_LINE = 64 * 1024
MAX_BODY = 1 << 20
MAX_HEAD = 32 * 1024
_RECV = 64 * 1024
_MAX_INFORMATIONAL = 8

_conns: weakref.WeakKeyDictionary[trio.abc.Stream, h11.Connection] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)


def _connection(stream: trio.abc.Stream) -> h11.Connection:
    """The h11 state of ``stream``, ready for a new request, or TransportError."""
    try:
        conn = _conns.get(stream)
    except TypeError:  # a stream that cannot be weakly referenced: one exchange each
        conn = None
    if conn is None:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        with contextlib.suppress(TypeError):
            _conns[stream] = conn
        return conn
    if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
        conn.start_next_cycle()
    if conn.our_state is not h11.IDLE or conn.their_state is not h11.IDLE:
        raise TransportError("the connection cannot be reused; open a new one")
    return conn


@contextlib.contextmanager
def _translate(host: str, timeout: float) -> Iterator[None]:
    try:
        with trio.fail_after(timeout):
            yield
    except trio.TooSlowError as exc:
        raise TransportError(f"{host} did not answer within {timeout:g} s") from exc
    except h11.RemoteProtocolError as exc:
        if exc.error_status_hint == 431:  # h11's receive buffer is over MAX_HEAD
            raise TransportError(
                f"{host} sent an HTTP head or chunk header over {MAX_HEAD} bytes"
            ) from exc
        raise TransportError(f"{host} sent a malformed HTTP response") from exc
    except h11.LocalProtocolError as exc:
        raise TransportError(f"the HTTP request to {host} could not be sent") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise TransportError(f"the connection to {host} broke") from exc


async def _next_event(stream: trio.abc.Stream, conn: h11.Connection) -> object:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(_RECV)))
            continue
        return event


async def _start(
    stream: trio.abc.Stream,
    method: str,
    target: str,
    host: str,
    body: bytes | None,
    headers: Sequence[tuple[str, str]],
) -> tuple[h11.Connection, int, dict[str, str]]:
    """Send a request and read the response head."""
    conn = _connection(stream)
    names = {name.lower() for name, _ in headers}
    head = [("host", host), *headers]
    if body is not None or method in ("POST", "PUT", "PATCH"):
        head.append(("content-length", str(len(body or b""))))
        if body is not None and "content-type" not in names:
            head.append(("content-type", "application/json"))
    if "accept" not in names:
        head.append(("accept", "application/json"))
    data = conn.send(h11.Request(method=method, target=target, headers=head))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
    for _ in range(_MAX_INFORMATIONAL + 1):
        event = await _next_event(stream, conn)
        if isinstance(event, h11.Response):
            break
        if not isinstance(event, h11.InformationalResponse):
            raise h11.RemoteProtocolError("no response")
    else:
        raise TransportError(f"{host} sent more than {_MAX_INFORMATIONAL} informational answers")
    # h11 bounds a head still arriving; one that came whole in a read is checked here
    if sum(len(name) + len(value) + 4 for name, value in event.headers) > MAX_HEAD:
        raise TransportError(f"{host} sent an HTTP head or chunk header over {MAX_HEAD} bytes")
    values: dict[str, list[str]] = {}
    for raw_name, raw_value in event.headers:
        values.setdefault(raw_name.decode("latin-1"), []).append(raw_value.decode("latin-1"))
    found = {name: ", ".join(parts) for name, parts in values.items()}
    return conn, event.status_code, found


async def request(
    stream: trio.abc.Stream,
    method: str,
    target: str,
    host: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
    max_body: int = MAX_BODY,
    timeout: float = 30,  # noqa: ASYNC109 - one deadline over the whole exchange
) -> Response:
    """Send one request on ``stream`` and read the whole response (at most ``max_body``)."""
    with _translate(host, timeout):
        conn, status, found = await _start(stream, method, target, host, body, headers)
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await _next_event(stream, conn)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > max_body:
                    raise TransportError(f"the response from {host} is over {max_body} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return Response(status=status, headers=found, body=b"".join(chunks))
            else:
                raise h11.RemoteProtocolError("unexpected event")


async def open_lines(
    stream: trio.abc.Stream,
    method: str,
    target: str,
    host: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
    *,
    timeout: float = 30,  # noqa: ASYNC109 - bounds the wait for the response head
    idle_timeout: float | None = 60.0,
    max_line: int = MAX_LINE,
) -> tuple[int, dict[str, str], AsyncGenerator[bytes, None]]:
    """Send a request and return (status, headers, lines of the streamed body).

    The iterator yields each non-empty line without its line ending; it raises
    TransportError when no byte arrives for ``idle_timeout`` seconds, a line is
    over ``max_line`` bytes, or the stream ends before the response does. An error
    answer (one JSON object) comes through the same iterator. Close the iterator
    (``aclose``) when done with it.
    """
    with _translate(host, timeout):
        conn, status, found = await _start(stream, method, target, host, body, headers)
    return status, found, _lines(stream, conn, host, idle_timeout, max_line)


async def _lines(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    host: str,
    idle_timeout: float | None,
    max_line: int,
) -> AsyncGenerator[bytes, None]:
    too_long = f"a line from {host} is over {max_line} bytes"
    buf = bytearray()
    while True:
        with _translate(host, math.inf if idle_timeout is None else idle_timeout):
            event = await _next_event(stream, conn)
        if isinstance(event, h11.Data):
            buf += event.data
            while (end := buf.find(b"\n")) >= 0:
                if end > max_line:
                    raise TransportError(too_long)
                line = bytes(buf[:end]).rstrip(b"\r")
                del buf[: end + 1]
                if line.strip():
                    yield line
            if len(buf) > max_line:
                raise TransportError(too_long)
        elif isinstance(event, h11.EndOfMessage):
            if buf.strip():
                yield bytes(buf).rstrip(b"\r")
            return
        else:
            raise TransportError(f"{host} sent a malformed HTTP response")


async def read_rest(
    lines: AsyncIterator[bytes],
    host: str,
    *,
    limit: int,
    timeout: float = 30,  # noqa: ASYNC109 - one deadline over the rest of the body
) -> bytes:
    """The rest of a streamed body (its lines joined), at most ``limit`` bytes.

    For an answer that is one document, such as an error, arriving through
    :func:`open_lines`: raises TransportError when it is longer than ``limit`` or
    does not end within ``timeout`` seconds, so a server cannot make the caller
    hold more than ``limit`` bytes or wait forever.
    """
    parts: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(timeout):
            async for line in lines:
                size += len(line)
                if size > limit:
                    raise TransportError(f"the answer from {host} is over {limit} bytes")
                parts.append(line)
    except trio.TooSlowError as exc:
        raise TransportError(f"{host} did not finish its answer within {timeout:g} s") from exc
    return b"".join(parts)


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
    port = port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rpartition("@")[2]
    where = f"{hostname}:{port}"
    try:
        with trio.fail_after(timeout):
            tcp = await trio.open_tcp_stream(hostname, port)
    except trio.TooSlowError as exc:
        raise TransportError(f"cannot reach {where}: timed out") from exc
    except OSError as exc:
        raise TransportError(f"cannot reach {where}: {os_reason(exc)}") from exc
    stream: trio.abc.Stream = tcp
    try:
        if parts.scheme == "https":
            ctx = ssl.create_default_context()
            ctx.set_alpn_protocols(["http/1.1"])
            tls = trio.SSLStream(tcp, ctx, server_hostname=hostname, https_compatible=True)
            stream = tls
            try:
                with trio.fail_after(timeout):
                    await tls.do_handshake()
            except trio.TooSlowError as exc:
                raise TransportError(f"TLS handshake with {where} timed out") from exc
            except (trio.BrokenResourceError, OSError) as exc:
                cause = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
                reason = getattr(cause, "reason", None) or type(cause).__name__
                raise TransportError(f"TLS handshake with {where} failed: {reason}") from exc
        return await request(
            stream,
            "GET",
            target,
            host_header,
            headers=[("connection", "close")],
            max_body=max_body,
            timeout=timeout,
        )
    finally:
        await trio.aclose_forcefully(stream)
