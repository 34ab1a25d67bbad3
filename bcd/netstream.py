"""A trio stream as httpcore's network stream (the node's transport)."""

from __future__ import annotations

import select
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpcore
import trio


def _fileno_of(stream: trio.abc.Stream) -> int | None:
    """The file descriptor under ``stream`` (its own ``fileno()``, an SSLStream's
    socket, tlslite's socket)."""
    own = getattr(stream, "fileno", None)
    if callable(own):
        fd = own()
        return fd if isinstance(fd, int) and fd >= 0 else None
    inner: Any = stream
    while isinstance(inner, trio.SSLStream):
        inner = inner.transport_stream
    sock = inner.socket if isinstance(inner, trio.SocketStream) else getattr(inner, "socket", None)
    fileno = getattr(sock, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
    except OSError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def fd_readable(fd: int) -> bool:
    """Whether an idle connection's socket has something to read: its peer closed it, or
    sent what it should not have; either way it is not reused (the node's kept-alive
    connections, the gateway's relay to the API replicas). ``poll``, not ``select``: a
    gateway's descriptors are far above select's 1,024, where each would read as closed.
    A descriptor that poll cannot check counts as readable, so it is not reused."""
    poller = select.poll()
    try:
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class NetworkStream(httpcore.AsyncNetworkStream):
    """A trio stream as httpcore's network stream, its TLS done by whoever opened it
    (the node's dial)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                return bytes(await self._stream.receive_some(max_bytes))
        except trio.TooSlowError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        try:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                await self._stream.send_all(buffer)
        except trio.TooSlowError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        return self  # the dial handshook and pinned already

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle connection the peer closed is not reused
            fd = _fileno_of(self._stream)
            return True if fd is None else fd_readable(fd)
        if info == "ssl_object":
            return getattr(self._stream, "_ssl_object", None)
        return None


Connect = Callable[[str, int, "float | None"], Awaitable[httpcore.AsyncNetworkStream]]
"""Open a connection to (host, port) within a connect timeout (None: the caller's own)."""


class TcpBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend over ``connect``: TCP only (the node's dial, the
    relay's own TLS)."""

    def __init__(self, connect: Connect) -> None:
        self._connect = connect

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._connect(host, port, timeout)

    async def connect_unix_socket(  # pragma: no cover - TCP only
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)
