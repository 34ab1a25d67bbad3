"""A small HTTP/1.1 server on trio + h11, optionally over TLS.

Each connection does its TLS handshake here, so the handler sees the client
certificate (``Request.peer_cert_der``); a listener's :class:`Limits` bound its
connections and its handshakes under way, overall and per source (an IPv4 address,
an IPv6 address's /48 by default: ``Limits.source_prefix``), and a connection that has
sent nothing yet holds no handshake slot.
Keep-alive, a request size limit, chunked streaming responses (the session stream),
and errors in the protocol's ``{"code", "message"}`` form. A handler's exception is
logged and answered with a 503 UNAVAILABLE that never carries its text.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import parse_qsl

import h11
import trio

from bcd.credential import shown
from bcd.tlsstream import SocketTLSStream
from bcd.wire import STATUS, dumps

logger = logging.getLogger("control.http")

HANDSHAKE_TIMEOUT = 5.0  # from the connection's task start to the handshake's end, waits in it
HANDSHAKE_LEFT_SHARE = 0.2  # a handshake slot that comes with less of that left goes unused
FIRST_REQUEST_TIMEOUT = 10.0  # a new connection's first request head must arrive by then
IDLE_TIMEOUT = 60.0  # keep-alive: wait this long for the next request
ANONYMOUS_IDLE_TIMEOUT = 5.0  # keep-alive of a TLS connection without a client certificate
REQUEST_TIMEOUT = 30.0  # from a request's first byte to its last
WRITE_TIMEOUT = 30.0  # a client that stops reading is dropped after this
LINGER_TIMEOUT = 2.0  # after a refusal, drain (and drop) input this long before closing
_LINGER_BYTES = 1 << 20
_RECV = 64 * 1024
_MAX_HEAD = 16 * 1024
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError)


@dataclass
class Request:
    method: str
    path: str  # as sent, not percent-decoded
    query: dict[str, str]
    headers: dict[str, str] = field(repr=False)  # lower-case names
    body: bytes = field(repr=False)
    peer_cert_der: bytes | None = field(repr=False)
    remote: str


class DirectWrite:
    """Another task's way into a streamed body (:attr:`Response.direct`): a chunk sent
    at once, on the event loop, while the body's own loop waits for its next chunk.

    A session's ping is most of what an idle session sends; through the body's
    iterator it costs a wake of the connection's task, a generator step and two
    checkpoints, where this is one ``SSL_write``. :meth:`try_write` writes only while
    the body's loop is parked on its iterator (so never inside one of its sends) and
    only whole records (:meth:`bcd.tlsstream.SocketTLSStream.try_send`): a chunk goes
    out between two of the iterator's, never inside one, and may go out before one the
    iterator was handed but has not yet yielded, so it is for chunks whose order does
    not matter (a ping says nothing but "alive"). When it cannot (a plain
    stream, the loop busy or done, the socket full), the caller sends the chunk
    through the iterator as before, under the write timeout."""

    __slots__ = ("_conn", "_framed", "_stream")

    def __init__(self) -> None:
        self._stream: SocketTLSStream | None = None  # set while the loop is parked
        self._conn: h11.Connection | None = None
        self._framed: tuple[bytes, bytes] = (b"", b"")  # the last chunk and its framing

    def reset(self) -> None:
        self._stream = self._conn = None
        self._framed = (b"", b"")

    def frame(self, conn: h11.Connection, chunk: bytes) -> bytes:
        """``chunk`` framed for the body (chunked, or as is for HTTP/1.0): h11's framing
        of a body chunk depends on the chunk only, so the same ping is framed once."""
        if chunk is not self._framed[0]:
            self._framed = (chunk, _send(conn, h11.Data(data=chunk)))
        return self._framed[1]

    def try_write(self, chunk: bytes) -> bool:
        """Send ``chunk`` now; False when it was not sent whole (send it through the
        iterator). False also when the socket filled mid-record: the record is then
        committed and goes first in the body's next send, so the chunk sent through
        the iterator goes twice. Only for a chunk that may (a ping); never raises."""
        stream, conn = self._stream, self._conn
        if stream is None or conn is None or not chunk:
            return False
        try:
            return stream.try_send(self.frame(conn, chunk)) and not stream.unfinished
        except Exception:  # the caller is a loop over every session: it must go on
            logger.exception("a direct write into a streamed response failed")
            return False


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: AsyncIterator[bytes] | None = None  # sent chunked, chunk by chunk
    direct: DirectWrite | None = None  # another task's writes into ``stream``'s body


Handler = Callable[[Request], Awaitable[Response]]
OnLimit = Callable[[str], None]
"""Told the name of each limit a connection or request ran into (metrics)."""
OnHandshake = Callable[[str], None]
"""Told each TLS connection's handshake outcome: ``completed``; ``failed`` (the
client's TLS was refused, or it went away mid-handshake); ``timed-out`` (not done in
``HANDSHAKE_TIMEOUT``); ``silent`` (it closed, or had sent nothing with a fifth of that
time left, without a byte: a TCP health check, a port scan); ``no-slot`` (it queued
for a handshake slot that did not come in time, as the ``OnLimit`` hit says, in a
drain too); ``late`` (its process reached it with under a fifth of that time left:
the process runs behind, or its client's first bytes came at the last moment; in a
drain too). A connection hung up by a drain before or after its wait for a slot is
not told."""
_LIMIT_OF_STATUS = {413: "request-body", 431: "request-head"}


def _no_limit(_name: str) -> None:
    pass


def _no_handshake(_outcome: str) -> None:
    pass


_JSON = ("content-type", "application/json")


SITE_PREFIX = 48
"""What a listener's per-source bounds count an IPv6 client by unless its operator
says otherwise (``serve --ipv6-source-prefix``, ``Limits.source_prefix``): its /48,
one site's prefix (what a registry or an ISP gives one customer, the /56s and /64s it
hands out inside it included), so that a customer holds one source's share, as behind
one IPv4 address, however many /64s it has (docs/decisions.md, "Connection limits")."""
SUBNET_PREFIX = 64
"""One IPv6 subnet's prefix, what the pending join requests' bound counts an address by
(:func:`source_of`). Not one host's: a home's or an office's machines share their
LAN's /64, and so do a cloud subnet's many VMs (AWS gives an instance /128s or /80
prefixes inside its subnet's /64, GCP a /96 per VM)."""
ADDRESS_PREFIX = 128
"""One IPv6 address: the finest a listener's per-source bounds count by, each address
a source of its own as each IPv4 address is. The relay listener's, always (its clients
are the operator's own gateways: ``control.server.relay_limits``); any other
listener's only when its operator says so (``serve --ipv6-source-prefix 128``), for
addresses the operator controls or trusts, since one holder of a /64 can then fill a
listener from a few of its addresses."""


@dataclass(frozen=True)
class Limits:
    """What one listener admits (docs/decisions.md, "Connection limits").

    ``max_connections``: open connections at once; ``max_per_source``: of those,
    from one source (an IPv4 address, an IPv6 address's ``/source_prefix``, 48 to 128:
    :func:`source_key`). A connection over either is closed at accept, before any TLS
    work, and one warning a minute says how many were.

    ``max_handshakes``: TLS handshakes under way at once, given out first come, first
    served; ``max_handshakes_per_source``: of those, for one source (at most
    ``max_handshakes``), so that stalled handshakes from one source cannot keep
    everyone else's from starting. A connection asks for its slot only once its client
    has sent something (its ClientHello's first bytes), so a silent one costs no slot;
    it waits for the slot within its ``HANDSHAKE_TIMEOUT``, doing no TLS work
    meanwhile, and is closed when neither its first bytes nor then its slot came with
    a fifth of that time still left (``HANDSHAKE_LEFT_SHARE``). A listener without TLS
    has no handshakes.
    """

    max_connections: int = 1_024
    max_per_source: int = 128
    idle_timeout: float = IDLE_TIMEOUT
    max_handshakes: int = 64
    max_handshakes_per_source: int = 8
    source_prefix: int = SITE_PREFIX

    def __post_init__(self) -> None:
        if not 0 < self.max_per_source <= self.max_connections:
            raise ValueError("max_per_source must be from 1 to max_connections")
        if not 0 < self.max_handshakes_per_source <= self.max_handshakes:
            raise ValueError("max_handshakes_per_source must be from 1 to max_handshakes")
        prefix = self.source_prefix
        if type(prefix) is not int or not SITE_PREFIX <= prefix <= ADDRESS_PREFIX:
            raise ValueError(f"source_prefix must be from {SITE_PREFIX} to {ADDRESS_PREFIX}")


@dataclass
class _Tally:
    """Closed connections of one kind, warned of at most once a minute."""

    count: int = 0
    warned_at: float = -1e9

    def add(self) -> int | None:
        """Count one; once a minute, the count to warn of (counting starts again)."""
        self.count += 1
        now = trio.current_time()
        if now - self.warned_at < 60:
            return None
        count, self.count, self.warned_at = self.count, 0, now
        return count


@dataclass
class _Gate:
    limits: Limits
    on_limit: OnLimit = _no_limit
    total: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    refused: _Tally = field(default_factory=_Tally)
    handshakes: trio.CapacityLimiter = field(init=False)
    # per source with a handshake under way or waiting: its slots, and how many use them
    handshakes_of: dict[str, tuple[trio.CapacityLimiter, int]] = field(default_factory=dict)
    no_slot: _Tally = field(default_factory=_Tally)
    late: _Tally = field(default_factory=_Tally)

    def __post_init__(self) -> None:
        self.handshakes = trio.CapacityLimiter(self.limits.max_handshakes)

    def admit(self, source: str) -> bool:
        here = self.by_source.get(source, 0)
        if self.total >= self.limits.max_connections or here >= self.limits.max_per_source:
            full = self.total >= self.limits.max_connections
            self.on_limit("connections" if full else "connections-per-source")
            if (refused := self.refused.add()) is not None:
                logger.warning(
                    "connection limit: refused %d connections (at most %d, %d per source)",
                    refused,
                    self.limits.max_connections,
                    self.limits.max_per_source,
                )
            return False
        self.total += 1
        self.by_source[source] = here + 1
        return True

    def release(self, source: str) -> None:
        self.total -= 1
        left = self.by_source.get(source, 1) - 1
        if left:
            self.by_source[source] = left
        else:
            self.by_source.pop(source, None)

    @contextlib.asynccontextmanager
    async def handshake_slot(self, source: str, deadline: float) -> AsyncIterator[str | None]:
        """Hold one of ``source``'s handshake slots, then one of the listener's (each
        queue first come, first served), while the block runs; it is told None, or why
        the connection gets no handshake when less than ``HANDSHAKE_LEFT_SHARE`` of
        ``HANDSHAKE_TIMEOUT`` is left before ``deadline``: a handshake started later
        would most likely be cut off unfinished, its work wasted.

        ``no-slot``: it queued for a slot, which did not come in time (counted as the
        limit's hit, and warned of at most once a minute). ``late``: this process got to
        the connection, or back to it from the slot's queue, that late, whatever the
        slots: its event loop running behind (its CPU saturated), or a client whose
        first bytes came at the edge of their time (the process cannot tell these
        apart); no limit's doing (warned of at most once a minute too). A free slot is
        taken at once, with no yield, so a process that runs behind never shows a limit
        it did not reach (trio's ``CapacityLimiter.acquire`` fails a task past its
        deadline before it looks for a token, and yields after taking one)."""
        cutoff = deadline - HANDSHAKE_TIMEOUT * HANDSHAKE_LEFT_SHARE
        if trio.current_time() >= cutoff:
            self._behind()
            yield "late"
            return
        mine, users = self.handshakes_of.get(source) or (
            trio.CapacityLimiter(self.limits.max_handshakes_per_source),
            0,
        )
        self.handshakes_of[source] = (mine, users + 1)
        try:
            async with contextlib.AsyncExitStack() as held:
                limit = "handshakes-per-source"
                with trio.move_on_at(cutoff):
                    await _take(held, mine)
                    limit = "handshakes"
                    await _take(held, self.handshakes)
                    limit = ""
                refusal = None
                if limit:
                    self._no_slot(limit)
                    refusal = "no-slot"
                elif trio.current_time() >= cutoff:  # its slot came, but it ran too late
                    self._behind()
                    refusal = "late"
                yield refusal
        finally:
            mine, users = self.handshakes_of[source]
            if users > 1:
                self.handshakes_of[source] = (mine, users - 1)
            else:
                del self.handshakes_of[source]

    def _no_slot(self, limit: str) -> None:
        self.on_limit(limit)
        if (closed := self.no_slot.add()) is not None:
            logger.warning(
                "handshake limit: closed %d connections that found no TLS handshake slot in "
                "time (at most %d handshakes at once, %d per source)",
                closed,
                self.limits.max_handshakes,
                self.limits.max_handshakes_per_source,
            )

    def _behind(self) -> None:
        if (closed := self.late.add()) is not None:
            logger.warning(
                "running behind: closed %d connections reached with less than %.0f s of "
                "their %.0f s for the TLS handshake left (the process is short of CPU, or "
                "their clients sent their first bytes at the last moment)",
                closed,
                HANDSHAKE_TIMEOUT * HANDSHAKE_LEFT_SHARE,
                HANDSHAKE_TIMEOUT,
            )


async def _take(held: contextlib.AsyncExitStack, limiter: trio.CapacityLimiter) -> None:
    """One of ``limiter``'s tokens, held until ``held`` closes: a free one at once (none
    is free while others queue: first come, first served), else in its queue."""
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        await held.enter_async_context(limiter)
    else:
        held.callback(limiter.release)


@dataclass
class Lifecycle:
    """What a drain needs to know of the connections of one or more listeners.

    ``busy`` counts requests inside a handler (a join, a renewal, a session's
    stream); ``waiting`` holds the cancel scopes of connections between requests (and
    of TLS connections that have sent nothing yet). :meth:`begin_drain` stops
    accepting, hangs up every waiting connection, and makes every busy one hang up
    after its answer; a connection in the queue for a handshake slot hangs up when its
    slot comes, with no TLS work.
    """

    draining: trio.Event = field(default_factory=trio.Event)
    busy: int = 0
    waiting: set[trio.CancelScope] = field(default_factory=set)
    accepting: list[trio.CancelScope] = field(default_factory=list)

    def begin_drain(self) -> None:
        self.draining.set()
        for scope in [*self.accepting, *self.waiting]:
            scope.cancel()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in a handler; False when ``timeout_s`` ran out."""
        with trio.move_on_after(timeout_s):
            while self.busy:  # noqa: ASYNC110 - polled once, at shutdown
                await trio.sleep(0.05)
            return True
        return False


def json_response(status: int, obj: object, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, dumps(obj), [_JSON, *headers])


def error_response(
    code: str,
    message: str,
    extra_headers: Sequence[tuple[str, str]] = (),
    *,
    status: int | None = None,
    details: dict[str, str] | None = None,
) -> Response:
    """``{"code", "message"}`` with the code's status from bcd.wire.STATUS."""
    body = {**(details or {}), "code": code, "message": message}
    return json_response(status or STATUS.get(code, 500), body, extra_headers)


def health_response(ok: bool, reason: str) -> Response:
    """``/healthz`` and ``/readyz``: 200 or 503 with a one-line JSON reason; the
    connection closes after it (a prober's connection must not hold a slot)."""
    return json_response(
        200 if ok else 503,
        {"status": "ok" if ok else "unavailable", "reason": reason},
        [("connection", "close")],
    )


def _internal_error() -> Response:
    return error_response("UNAVAILABLE", "internal error")


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    max_body: int = 64 * 1024,
    life: Lifecycle | None = None,
    limits: Limits | None = None,
    on_limit: OnLimit = _no_limit,
    on_handshake: OnHandshake | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on host:port (0: any free port) until cancelled or drained.

    ``task_status.started`` reports the port actually bound; ``on_limit`` is told each
    connection or call a limit turned away, ``on_handshake`` each TLS connection's
    handshake outcome. After ``life.begin_drain()`` no connection is accepted and the
    call returns once every connection has ended.
    """
    life = life or Lifecycle()
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:  # each family got its own free port: keep one
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    actual: int = listeners[0].socket.getsockname()[1]
    limits = limits or Limits()
    gate = _Gate(limits, on_limit)
    connection = partial(
        _connection,
        handler,
        ssl_context,
        max_body,
        life,
        limits.idle_timeout,
        on_limit,
        on_handshake or _no_handshake,
        gate,
    )
    async with trio.open_nursery() as connections:
        with trio.CancelScope() as accepting:
            life.accepting.append(accepting)
            task_status.started(actual)
            async with trio.open_nursery() as acceptors:
                for listener in listeners:
                    acceptors.start_soon(_accept, listener, connection, connections, gate)
        for listener in listeners:
            with contextlib.suppress(OSError):
                await listener.aclose()


_ServeOne = Callable[[trio.SocketStream, str, str], Awaitable[None]]
"""Serves one accepted connection: its socket, its ``host:port`` and its source."""


async def _accept(
    listener: trio.SocketListener,
    connection: _ServeOne,
    nursery: trio.Nursery,
    gate: _Gate,
) -> None:
    while True:
        try:
            tcp = await listener.accept()
        except OSError as exc:  # EMFILE and the like: wait for connections to end
            logger.warning("accept failed (%s); retrying in 100 ms", exc.strerror)
            await trio.sleep(0.1)
            continue
        remote = _remote(tcp)
        source = source_key(remote, gate.limits.source_prefix)
        if not gate.admit(source):
            tcp.socket.close()  # no TLS, no answer: the cheapest refusal there is
            continue
        nursery.start_soon(_gated, connection, tcp, remote, gate, source)


async def _gated(
    connection: _ServeOne,
    tcp: trio.SocketStream,
    remote: str,
    gate: _Gate,
    source: str,
) -> None:
    try:
        await connection(tcp, remote, source)
    finally:
        gate.release(source)


def source_of(ip: str, prefix: int = SUBNET_PREFIX) -> str:
    """What a per-source bound counts by: an IPv4 address (an IPv4-mapped IPv6 one as
    IPv4), or an IPv6 address's ``/prefix``: a /64 by default, one subnet (the pending
    join requests' bound: the machines of one LAN or one cloud subnet share it); a
    listener's bounds count by its ``Limits.source_prefix`` (:func:`source_key`)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))
    return str(addr)


def source_key(remote: str, prefix: int = SITE_PREFIX) -> str:
    """What a listener's per-source bounds (connections, handshakes at once) count
    ``host:port`` / ``[v6]:port`` by: :func:`source_of` its host, an IPv6 one by its
    ``/prefix`` (the listener's ``Limits.source_prefix``: the /48 by default, each
    address at 128, as the relay listener counts its gateways). No IPv4
    prefix is counted as one: many customers share an address block, and a
    carrier-grade NAT's customers one address already."""
    return source_of(remote.rpartition(":")[0].strip("[]"), prefix)


def _remote(tcp: trio.SocketStream) -> str:
    try:
        addr: Any = tcp.socket.getpeername()
    except OSError:
        return "unknown"
    host, port = str(addr[0]), addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _connection(
    handler: Handler,
    ssl_context: ssl.SSLContext | None,
    max_body: int,
    life: Lifecycle,
    idle_timeout: float,
    on_limit: OnLimit,
    on_handshake: OnHandshake,
    gate: _Gate,
    tcp: trio.SocketStream,
    remote: str,
    source: str,
) -> None:
    stream: trio.abc.Stream = tcp
    try:
        peer_der: bytes | None = None
        if ssl_context is not None:
            deadline = trio.current_time() + HANDSHAKE_TIMEOUT
            if not await _talks(tcp, deadline - HANDSHAKE_TIMEOUT * HANDSHAKE_LEFT_SHARE, life):
                if not life.draining.is_set():
                    logger.debug("TLS handshake from %s: nothing sent in time", remote)
                    on_handshake("silent")
                return  # a silent connection never took a handshake slot
            async with gate.handshake_slot(source, deadline) as refusal:
                if refusal:
                    on_handshake(refusal)  # no-slot (as the limit hit counted it), late
                    return  # no TLS work for a connection whose slot came too late
                if life.draining.is_set():
                    return  # nor for one in a drain
                try:
                    tls = SocketTLSStream(tcp, ssl_context)
                    stream = tls
                    with trio.fail_at(deadline):
                        await tls.do_handshake()
                except (*_GONE, OSError) as exc:
                    logger.debug("TLS handshake from %s failed: %r", remote, exc)
                    on_handshake("timed-out" if isinstance(exc, trio.TooSlowError) else "failed")
                    return
            on_handshake("completed")
            peer_der = tls.peer_der()
        if ssl_context is not None and peer_der is None:
            idle_timeout = min(idle_timeout, ANONYMOUS_IDLE_TIMEOUT)
        await _serve_http(stream, handler, max_body, peer_der, remote, life, idle_timeout, on_limit)
    except _GONE:
        pass  # the client went away or was too slow
    except Exception:
        logger.exception("connection from %s failed", remote)
    finally:
        with trio.move_on_after(1), contextlib.suppress(*_GONE, OSError):
            await stream.aclose()


async def _talks(tcp: trio.SocketStream, by: float, life: Lifecycle) -> bool:
    """Wait until the client has sent something (a ClientHello's first bytes) by
    ``by``; False when it has not, when it closed the connection without a byte (a TCP
    health check, a scan: it takes no handshake slot), or when a drain began first (a
    connection that has said nothing is hung up like one between requests)."""
    if life.draining.is_set():
        return False
    with trio.CancelScope(deadline=by) as waiting:
        life.waiting.add(waiting)
        try:
            # readable: a byte, or the end of the connection (or its reset); the peek
            # takes nothing, and waits again, within the same bounds, if it must
            return bool(await tcp.socket.recv(1, socket.MSG_PEEK))
        except OSError:
            return False
        finally:
            life.waiting.discard(waiting)
    return False


async def _write(stream: trio.abc.Stream, data: bytes) -> None:
    with trio.fail_after(WRITE_TIMEOUT):
        await stream.send_all(data)


async def _serve_http(
    stream: trio.abc.Stream,
    handler: Handler,
    max_body: int,
    peer_der: bytes | None,
    remote: str,
    life: Lifecycle,
    idle_timeout: float,
    on_limit: OnLimit = _no_limit,
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
    wait = FIRST_REQUEST_TIMEOUT  # a new connection: its first request comes soon or never
    while not life.draining.is_set():
        got: Request | tuple[Response, str] | None = None
        with trio.CancelScope(deadline=trio.current_time() + wait) as scope:
            life.waiting.add(scope)
            try:
                got = await _read_request(stream, conn, scope, max_body, peer_der, remote)
            finally:
                life.waiting.discard(scope)
        if got is None or scope.cancelled_caught:
            return
        if isinstance(got, tuple):  # refused before the handler: answer and hang up
            refusal, method = got
            if refusal.status in _LIMIT_OF_STATUS:
                on_limit(_LIMIT_OF_STATUS[refusal.status])
            await _respond(stream, conn, method, refusal)
            await _linger(stream)
            return
        life.busy += 1
        # h11 refused control characters; a path a caller put a secret in (a whole token
        # where the revoke path wants its id) is never logged, nor the query
        path = shown(got.path[:256])
        try:
            try:
                response = await handler(got)
            except Exception:
                logger.exception("handler failed on %s %s from %s", got.method, path, remote)
                response = _internal_error()
            if logger.isEnabledFor(logging.DEBUG):  # the access log, at --log-level debug
                logger.debug(
                    "%s %s from %s: %d", got.method, path, remote, response.status,
                    extra={"event": "http.request", "method": got.method, "path": path,
                           "remote": remote, "status": response.status},
                )  # fmt: skip
            if life.draining.is_set():
                response.headers.append(("connection", "close"))
            method = got.method
            got = None  # a session's stream lasts hours: not its request's headers and body
            await _respond(stream, conn, method, response)
        finally:
            life.busy -= 1
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return
        conn.start_next_cycle()
        wait = idle_timeout


async def _read_request(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    scope: trio.CancelScope,
    max_body: int,
    peer_der: bytes | None,
    remote: str,
) -> Request | tuple[Response, str] | None:
    """The next request, a refusal to send (with the method it answers: a HEAD's gets
    no body), or None when the client is done."""
    method = "GET"

    async def next_event() -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = bytes(await stream.receive_some(_RECV))
            if data:  # the request has begun: it gets REQUEST_TIMEOUT from here
                scope.deadline = min(scope.deadline, trio.current_time() + REQUEST_TIMEOUT)
            conn.receive_data(data)

    too_large = error_response(
        "INVALID_ARGUMENT", "request body too large", [("connection", "close")], status=413
    )
    try:
        head = await next_event()
        if not isinstance(head, h11.Request):
            return None  # ConnectionClosed
        method = "HEAD" if head.method == b"HEAD" else "GET"
        headers: dict[str, str] = {}
        head_size = len(head.method) + len(head.target) + 12
        for raw_name, raw_value in head.headers:
            head_size += len(raw_name) + len(raw_value) + 4
            name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if head_size > _MAX_HEAD:  # h11 bounds only a head still arriving, not one whole
            return error_response(
                "INVALID_ARGUMENT", "request head too large", [("connection", "close")], status=431
            ), method
        if "content-length" in headers and "transfer-encoding" in headers:
            return error_response(
                "INVALID_ARGUMENT",
                "Content-Length and Transfer-Encoding together",
                [("connection", "close")],
            ), method
        if int(headers.get("content-length", "0").split(",")[0]) > max_body:
            return too_large, method
        if conn.they_are_waiting_for_100_continue:
            go_on = h11.InformationalResponse(status_code=100, headers=[])
            await _write(stream, _send(conn, go_on))
        body = bytearray()
        while not isinstance(event := await next_event(), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                return None
            body += event.data
            if len(body) > max_body:
                return too_large, method
        path, _, query = head.target.decode("ascii").partition("?")
        method = head.method.decode("ascii")
    except (h11.RemoteProtocolError, ValueError):
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return None
        return error_response(
            "INVALID_ARGUMENT", "malformed HTTP request", [("connection", "close")]
        ), method
    return Request(
        method=method,
        path=path,
        query=dict(parse_qsl(query, keep_blank_values=True)),
        headers=headers,
        body=bytes(body),
        peer_cert_der=peer_der,
        remote=remote,
    )


def _send(conn: h11.Connection, event: h11.Event) -> bytes:
    return conn.send(event) or b""


_FRAMING = frozenset({"content-length", "transfer-encoding"})


async def _respond(
    stream: trio.abc.Stream, conn: h11.Connection, method: str, response: Response
) -> None:
    headers = [(n, v) for n, v in response.headers if n.lower() not in _FRAMING]
    bodiless = method == "HEAD" or response.status in (204, 304)
    if response.stream is None and response.status not in (204, 304):
        headers.append(("content-length", str(len(response.body))))
    data = _send(conn, h11.Response(status_code=response.status, headers=headers))
    if response.stream is None or bodiless:
        if response.stream is not None:
            await _aclose(response.stream)
        if response.body and not bodiless:
            data += _send(conn, h11.Data(data=response.body))
        await _write(stream, data + _send(conn, h11.EndOfMessage()))
        return
    await _write(stream, data)
    await _stream_body(stream, conn, response.stream, response.direct or DirectWrite())


async def _stream_body(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    chunks: AsyncIterator[bytes],
    direct: DirectWrite,
) -> None:
    """Send each chunk as it comes (and let ``direct`` write while waiting for the
    next, over TLS); stop when the client goes away."""

    async def watch_peer(cancel: trio.CancelScope) -> None:
        # The client sends nothing more on a streamed exchange; EOF means it left.
        try:
            while data := await stream.receive_some(_RECV):
                conn.receive_data(bytes(data))
                if len(conn.trailing_data[0]) > _MAX_HEAD:
                    break
        except (*_GONE, OSError, h11.RemoteProtocolError):
            pass
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_peer, nursery.cancel_scope)
        # one scope for every write (WRITE_TIMEOUT each), not one per chunk: an idle
        # session's pings are most of what it sends
        writing = trio.CancelScope()
        parked = stream if isinstance(stream, SocketTLSStream) else None
        direct.reset()  # framed for this connection only
        try:
            with writing:
                while True:
                    direct._stream, direct._conn = parked, conn  # parked: others may write
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    finally:
                        direct._stream = direct._conn = None
                    if chunk:
                        writing.deadline = trio.current_time() + WRITE_TIMEOUT
                        await stream.send_all(direct.frame(conn, chunk))
                        writing.deadline = math.inf
                writing.deadline = trio.current_time() + WRITE_TIMEOUT
                await stream.send_all(_send(conn, h11.EndOfMessage()))
        except (*_GONE, OSError):
            pass  # the client went away or stopped reading
        except Exception:
            logger.exception("streamed response failed")
        finally:
            nursery.cancel_scope.cancel()
            await _aclose(chunks)


async def _aclose(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        try:
            await aclose()
        except Exception:
            logger.exception("closing a streamed response failed")


async def _linger(stream: trio.abc.Stream) -> None:
    """Read and drop what the client still sends, so it sees our answer, not a reset."""
    with trio.move_on_after(LINGER_TIMEOUT), contextlib.suppress(*_GONE, OSError):
        total = 0
        while total < _LINGER_BYTES and (data := await stream.receive_some(_RECV)):
            total += len(data)
