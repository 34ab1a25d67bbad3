"""The fuzzer's own HTTP/1.1 client: bytes as generated go out, answers are parsed back.

Nothing here normalises a request: the bytes a case holds are written as they are,
in the pieces it says (so a head or a chunk can be split anywhere), over plain TCP
or TLS, while the answer is read at the same time (a server may answer before the
body is in, e.g. 413, and then stop reading). Answers are parsed leniently enough to
report what the server did: status, headers, body (Content-Length, chunked, or until
close), 1xx answers, or how the exchange ended without one.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import trio

MAX_ANSWER = 8 << 20  # a download is about 600 KiB; anything larger is read and dropped
MAX_ANSWER_HEAD = 64 * 1024
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError)


@dataclass
class Endpoint:
    """A listener: plain TCP when ``contexts`` is None, else TLS with a client
    context per identity name (None: no client certificate)."""

    name: str
    host: str
    port: int
    contexts: dict[str | None, ssl.SSLContext] | None = None

    @property
    def tls(self) -> bool:
        return self.contexts is not None


@dataclass
class Answer:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None
    """How the exchange ended without a whole answer: ``no-answer-close`` (the server
    closed before any byte), ``no-answer-timeout``, ``partial-answer``, ``tls:…``…"""
    closed: bool = False
    streamed: bool = False
    informational: list[int] = field(default_factory=list)
    _json: Any = None

    def json(self) -> Any:
        if self._json is None:
            try:
                self._json = json.loads(self.body[:65536].decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                self._json = False
        return self._json

    @property
    def code(self) -> str | None:
        obj = self.json()
        if isinstance(obj, dict) and isinstance(obj.get("code"), str):
            return str(obj["code"])
        return None

    @property
    def message(self) -> str:
        obj = self.json()
        if isinstance(obj, dict):
            return str(obj.get("message", obj.get("reason", "")))
        return ""


class Conn:
    """One connection: a stream and the bytes read from it but not yet consumed."""

    def __init__(self, stream: trio.abc.Stream, local_port: int) -> None:
        self.stream = stream
        self.local_port = local_port
        self.buf = bytearray()
        self.eof = False
        self.broken = False
        self.exchanges = 0

    async def fill(self) -> bool:
        """Read more; False at end of stream."""
        if self.eof:
            return False
        try:
            data = await self.stream.receive_some(65536)
        except _GONE:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def aclose(self) -> None:
        self.broken = True
        with contextlib.suppress(*_GONE, trio.TooSlowError), trio.move_on_after(1):
            await trio.aclose_forcefully(self.stream)


def client_context() -> ssl.SSLContext:
    """A TLS client that trusts anything (the fuzzer is the attacker, not a node)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def connect(endpoint: Endpoint, identity: str | None, source: str = "127.0.0.1") -> Conn:
    """A new connection; raises OSError or ssl.SSLError (as ``ConnectError``)."""
    try:
        tcp = await trio.open_tcp_stream(endpoint.host, endpoint.port, local_address=source)
    except OSError as exc:
        raise ConnectError(f"connect: {exc.strerror or exc}") from exc
    local_port = tcp.socket.getsockname()[1]
    if endpoint.contexts is None:
        return Conn(tcp, local_port)
    ctx = endpoint.contexts[identity]
    tls = trio.SSLStream(tcp, ctx, server_hostname=endpoint.host, https_compatible=True)
    try:
        with trio.fail_after(10):
            await tls.do_handshake()
    except (*_GONE, trio.TooSlowError) as exc:
        await trio.aclose_forcefully(tcp)
        raise ConnectError(f"tls: {type(exc).__name__}") from exc
    return Conn(tls, local_port)


class ConnectError(Exception):
    pass


class _Incomplete(Exception):
    pass


async def _until(conn: Conn, marker: bytes, limit: int) -> int:
    """Index of ``marker`` in the buffer, reading as needed."""
    start = 0
    while (at := conn.buf.find(marker, start)) < 0:
        if len(conn.buf) > limit:
            raise _Incomplete("answer head too large")
        start = max(0, len(conn.buf) - len(marker) + 1)
        if not await conn.fill():
            raise _Incomplete("eof")
    return at


async def _take(conn: Conn, n: int) -> bytes:
    while len(conn.buf) < n:
        if not await conn.fill():
            raise _Incomplete("eof")
    out = bytes(conn.buf[:n])
    del conn.buf[:n]
    return out


async def read_answer(conn: Conn, method: str) -> Answer:
    """One answer (after any 1xx); ``error`` says why there is none."""
    answer = Answer()
    got_any = bool(conn.buf)
    try:
        while True:
            if not conn.buf and not await conn.fill():
                answer.error = "no-answer-close" if not got_any else "partial-answer"
                answer.closed = True
                return answer
            got_any = True
            end = await _until(conn, b"\r\n\r\n", MAX_ANSWER_HEAD)
            head = bytes(conn.buf[:end]).decode("latin-1")
            del conn.buf[: end + 4]
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                answer.error = "bad-status-line"
                answer.closed = True
                return answer
            status = int(parts[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                key = name.strip().lower()
                value = value.strip()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
            if 100 <= status < 200:
                answer.informational.append(status)
                continue
            break
        answer.status, answer.headers = status, headers
        if "close" in headers.get("connection", "").lower():
            answer.closed = True
        if method == "HEAD" or status in (204, 304):
            return answer
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _chunked(conn, answer)
        elif "content-length" in headers:
            length = int(headers["content-length"].split(",")[0])
            answer.body = await _take(conn, min(length, MAX_ANSWER))
        else:  # until close
            while await conn.fill():
                if len(conn.buf) > MAX_ANSWER:
                    break
            answer.body = bytes(conn.buf)
            conn.buf.clear()
            answer.closed = True
    except _Incomplete as exc:
        answer.error = "partial-answer" if answer.status is None else f"partial-body ({exc})"
        answer.closed = True
    except ValueError:
        answer.error = "bad-answer-framing"
        answer.closed = True
    return answer


async def _chunked(conn: Conn, answer: Answer) -> None:
    """A chunked body; for a stream of JSON lines (a session) only up to its first line."""
    lines = "ndjson" in answer.headers.get("content-type", "")
    body = bytearray()
    while True:
        end = await _until(conn, b"\r\n", 4096)
        size = int(bytes(conn.buf[:end]).split(b";")[0].strip(), 16)
        del conn.buf[: end + 2]
        if size == 0:
            await _until(conn, b"\r\n", 4096)  # no trailers from this server
            del conn.buf[:2]
            break
        chunk = await _take(conn, size)
        await _take(conn, 2)
        if len(body) < MAX_ANSWER:
            body += chunk
        if lines and b"\n" in body:
            answer.streamed = True
            answer.closed = True  # a session stream goes on: the fuzzer hangs up
            break
    answer.body = bytes(body)


@dataclass
class Exchange:
    answers: list[Answer]
    send_error: str | None
    elapsed: float


async def exchange(
    conn: Conn,
    pieces: list[bytes],
    methods: list[str],
    *,
    delays: list[float] | None = None,
    wait: float = 10.0,
    cap: float = 45.0,
) -> Exchange:
    """Write ``pieces`` (sleeping ``delays[i]`` after piece i) while reading up to
    ``len(methods)`` answers; give up ``wait`` seconds after the last byte went out
    (or ``cap`` seconds after the start)."""
    answers: list[Answer] = []
    send_error: list[str] = []
    sent = trio.Event()
    done = trio.Event()
    started = time.perf_counter()

    with trio.move_on_after(cap):
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                for method in methods:
                    answer = await read_answer(conn, method)
                    answers.append(answer)
                    if answer.status is None or answer.closed:
                        break
                done.set()
                nursery.cancel_scope.cancel()  # all that will come: stop sending too

            async def sender() -> None:
                try:
                    for i, piece in enumerate(pieces):
                        if piece:
                            await conn.stream.send_all(piece)
                        if delays and i < len(delays) and delays[i] > 0:
                            await trio.sleep(delays[i])
                except (*_GONE, trio.BusyResourceError) as exc:
                    send_error.append(type(exc).__name__)
                    conn.broken = True
                sent.set()

            nursery.start_soon(reader)
            nursery.start_soon(sender)
            await sent.wait()
            with trio.move_on_after(wait):
                await done.wait()
            nursery.cancel_scope.cancel()
    if not done.is_set():
        conn.broken = True
        if not answers or answers[-1].status is not None:
            answers.append(Answer(error="no-answer-timeout", closed=True))
    if not sent.is_set():
        conn.broken = True
    conn.exchanges += 1
    if answers and answers[-1].closed:
        conn.broken = True
    return Exchange(answers, send_error[0] if send_error else None, time.perf_counter() - started)


def request_bytes(
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    host: str = "127.0.0.1",
    length: bool = True,
) -> bytes:
    """A well-formed HTTP/1.1 request (Content-Length set unless ``length`` is False)."""
    out = [f"{method} {path} HTTP/1.1", f"host: {host}"]
    out += [f"{n}: {v}" for n, v in headers]
    if length and (body or method in ("POST", "PUT", "PATCH", "DELETE")):
        out.append(f"content-length: {len(body)}")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1", "replace") + body


def set_nodelay(conn: Conn) -> None:
    sock: Any = getattr(conn.stream, "socket", None) or getattr(
        getattr(conn.stream, "transport_stream", None), "socket", None
    )
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
