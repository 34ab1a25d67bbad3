"""A TLS connection run by OpenSSL on the socket itself, under trio.

``trio.SSLStream`` runs TLS over two memory BIOs: every record it sends or reads goes
through Python (the ``SSLObject``, the BIOs, trio's ``SocketStream`` and its
socket wrapper, each a few calls and a checkpoint). On a gateway that is most of the
CPU of an idle session's ping and much of a handshake's. Here the connection is a
non-blocking :class:`ssl.SSLSocket` instead: OpenSSL reads and writes the socket
itself, one C call per operation, and trio is asked only to wait until the socket is
ready (:func:`trio.lowlevel.wait_readable` / :func:`~trio.lowlevel.wait_writable`).
docs/decisions.md ("TLS on the socket") has the measurements.

What it keeps of ``trio.SSLStream(..., https_compatible=True)``, which it replaces in
:mod:`control.http` (every listener), :mod:`control.relay` (the gateway's client) and
:func:`bcd.tls.connect_pinned` (the node's pinned dial, a file key's):
the :class:`trio.abc.Stream` interface (each operation a checkpoint; a send and a
receive may run at once in two tasks, two sends or two receives may not); an end of
the connection without ``close_notify`` is an end like any other (a ragged EOF: HTTP
frames its own ends); :meth:`aclose` sends no ``close_notify``; a TLS or socket
failure is :class:`trio.BrokenResourceError`. Every context it runs under refuses
TLS 1.2 renegotiation (``OP_NO_RENEGOTIATION``: :func:`control.pkitls.server_ssl_context`,
:func:`control.relay.client_context`, :func:`bcd.tls.pinned_context`), so a write
never has to read; should OpenSSL still ask one direction to wait for the readiness
the other one waits for, it polls every :data:`CROSS_WAIT_S`.

One thing it adds: :meth:`SocketTLSStream.try_send`, a small write from another task
with no wait while the sender is idle (:class:`control.http.DirectWrite`: the
gateway's pings, with no wake of the session's task).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

CROSS_WAIT_S = 0.01
_DER = 2  # _ssl.ENCODING_DER, for the private Certificate objects of 3.11
DEFAULT_RECEIVE = 65536
_T = TypeVar("_T")


class SocketTLSStream(trio.abc.Stream):
    """One connection's TLS (see the module's note): an accepted one's, server side, or
    with ``server_hostname`` a client's (the name ``ctx`` checks the server's
    certificate for, when it checks host names)."""

    def __init__(
        self, tcp: trio.SocketStream, ctx: ssl.SSLContext, *, server_hostname: str | None = None
    ) -> None:
        # the descriptor moves from trio's socket object to the TLS socket: one owner
        raw = socket.socket(fileno=tcp.socket.detach())
        try:
            raw.setblocking(False)
            # a client already gone fails here, while ``raw`` still owns the descriptor
            # (a wrap that finds it gone may raise after taking it over)
            raw.getpeername()
            self._sock = ctx.wrap_socket(
                raw,
                server_side=server_hostname is None,
                server_hostname=server_hostname,
                do_handshake_on_connect=False,
                suppress_ragged_eofs=True,
            )
        except (OSError, ValueError) as exc:  # the client already gone, say
            raw.close()
            raise trio.BrokenResourceError(f"TLS connection broken: {exc}") from exc
        self._closed = False
        self._broken = False  # a send failed or was cancelled mid-record
        self._unfinished: bytes | None = None  # a record try_send began, socket full
        self._handshook = False
        self._sending = False
        self._receiving = False

    async def do_handshake(self) -> None:
        """The handshake, once; a send or a receive before it does it first (an
        ``SSLSocket`` that never handshook would read and write in the clear)."""
        if not self._handshook:
            await self._run(self._sock.do_handshake)
            self._handshook = True
        else:
            await trio.lowlevel.checkpoint()

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed): for a readiness check."""
        return self._sock.fileno()

    def peer_der(self) -> bytes | None:
        """The peer's certificate (DER) after the handshake; None without one."""
        return None if self._closed else self._sock.getpeercert(binary_form=True)

    def unverified_chain_der(self) -> list[bytes]:
        """The chain the peer presented, leaf first, unverified: readable after a
        handshake OpenSSL aborted on it too (3.13: public; 3.11: on ``_sslobj``)."""
        sock: Any = self._sock
        getter = getattr(sock, "get_unverified_chain", None)
        if getter is None:
            getter = sock._sslobj.get_unverified_chain
        out: list[bytes] = []
        for cert in getter() or ():  # None without a chain (a certless client)
            if cert is not None:
                out.append(cert if isinstance(cert, bytes) else cert.public_bytes(_DER))
        return out

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this connection")
        self._receiving = True
        try:
            if not self._handshook:
                await self.do_handshake()
            return await self._run(self._sock.recv, max_bytes or DEFAULT_RECEIVE)
        finally:
            self._receiving = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this connection")
        if self._broken:
            raise trio.BrokenResourceError("an earlier send on this connection failed")
        self._sending = True
        try:
            if not self._handshook:
                await self.do_handshake()
            if self._unfinished is not None:  # a record try_send began goes first, whole
                await self._run(self._sock.send, self._unfinished)
                self._unfinished = None
            with memoryview(data) as view:
                if not view:
                    if self._closed:
                        raise trio.ClosedResourceError("the connection was closed")
                    await trio.lowlevel.checkpoint()
                while view:
                    sent = await self._run(self._sock.send, view)
                    view = view[sent:]
        except BaseException:
            # a record OpenSSL began may be half written: another send would splice
            # its bytes into it (the retry may move), so no send follows, as in trio
            self._broken = True
            raise
        finally:
            self._sending = False

    def try_send(self, data: bytes) -> bool:
        """Write ``data`` now, with no wait and no checkpoint (from another task than the
        sender's, which must be idle): for a small record on a connection whose sender
        waits for something to send (an idle session's ping).

        False when nothing was written: a send runs or failed, the handshake is not
        done, the connection is closed, or an earlier try's record is still unfinished;
        the caller sends it with :meth:`send_all` instead. True when ``data`` is
        committed: all of it written, or its record begun with the socket full (OpenSSL
        must be called again with the same bytes). Such an unfinished record goes first
        in the next :meth:`send_all`, as a whole, before that call's own bytes; the
        caller makes sure one follows soon (:attr:`unfinished`), under its write
        timeout. A failure marks the connection broken, as a failed send does."""
        if self._sending or self._broken or self._closed or not self._handshook:
            return False
        if self._unfinished is not None:
            return False
        try:
            sent = self._sock.send(data)
            if sent < len(data):  # (OpenSSL writes all or asks again: never, but safe)
                self._unfinished = data[sent:]
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            self._unfinished = data  # the same bytes again, as OpenSSL asks
        except (ssl.SSLError, OSError):
            self._broken = True  # the next send_all says so; the receiver sees the end
        return not self._broken

    @property
    def unfinished(self) -> bool:
        """A record :meth:`try_send` began waits for the next :meth:`send_all`."""
        return self._unfinished is not None

    async def wait_send_all_might_not_block(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError
        await trio.lowlevel.wait_writable(self._sock)

    def close(self) -> None:
        """Close at once (no checkpoint): for a cleanup that must not wait."""
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._sock)  # a task waiting on it gets Closed...
            self._sock.close()  # no close_notify: as https_compatible=True

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def _run(self, op: Callable[..., _T], *args: object) -> _T:
        """``op`` until it neither wants to read nor to write, as a checkpoint."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the connection was closed")
            try:
                done = op(*args)
            except ssl.SSLWantReadError:
                await self._wait(trio.lowlevel.wait_readable)
                continue
            except ssl.SSLWantWriteError:
                await self._wait(trio.lowlevel.wait_writable)
                continue
            except (ssl.SSLError, OSError) as exc:
                raise trio.BrokenResourceError(f"TLS connection broken: {exc}") from exc
            await trio.lowlevel.cancel_shielded_checkpoint()
            return done

    async def _wait(self, wait: Callable[[ssl.SSLSocket], Awaitable[None]]) -> None:
        try:
            await wait(self._sock)
        except trio.BusyResourceError:  # the other direction waits on the same readiness
            await trio.sleep(CROSS_WAIT_S)
        except trio.ClosedResourceError:
            raise trio.ClosedResourceError("the connection was closed") from None
