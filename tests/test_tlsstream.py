"""bcd.tlsstream: a server's TLS on the socket itself, against trio's own TLS client,
on loopback with real certificates (tests/test_http.py's material)."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.serialization import Encoding
from trio.testing import wait_all_tasks_blocked

from bcd.tlsstream import SocketTLSStream
from control.pkitls import server_ssl_context
from tests.test_http import _key_pem, _pem, material, server_context

_RESET = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close with an RST


def _client_context(tmp_path: Path, with_cert: bool = True) -> ssl.SSLContext:
    m = material()
    ctx = ssl.create_default_context(cadata=_pem(m.ca))
    if with_cert:
        chain, key = tmp_path / "client.pem", tmp_path / "client.key"
        chain.write_text(_pem(m.client))
        key.write_bytes(_key_pem(m.client_key))
        ctx.load_cert_chain(chain, key)
    return ctx


@asynccontextmanager
async def _pair(
    tmp_path: Path, *, handshake: bool = True, with_cert: bool = True
) -> AsyncIterator[tuple[SocketTLSStream, trio.SocketStream, trio.SSLStream[trio.SocketStream]]]:
    """A server's SocketTLSStream and a trio TLS client (and its TCP) over loopback."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    accepted = await listeners[0].accept()
    server = SocketTLSStream(accepted, server_context(tmp_path))
    client = trio.SSLStream(tcp, _client_context(tmp_path, with_cert), server_hostname="gw.test")
    try:
        if handshake:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.do_handshake)
                nursery.start_soon(client.do_handshake)
        yield server, tcp, client
    finally:
        await server.aclose()
        await tcp.aclose()
        await listeners[0].aclose()


async def test_both_ways_at_once_with_more_than_the_socket_buffers_hold(tmp_path: Path) -> None:
    """4 MiB each way in two tasks per side: partial writes and waits on both
    directions, every byte in order; the client's certificate is the server's to read."""
    size = 4 << 20
    sent_up, sent_down = (
        bytes(range(256)) * (size // 256),
        bytes(reversed(range(256))) * (size // 256),
    )
    got_up, got_down = bytearray(), bytearray()

    async def read(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        while len(into) < size:
            data = await stream.receive_some(65536)
            assert data
            into += data

    async with _pair(tmp_path) as (server, _tcp, client):
        assert server.peer_der() == material().client.public_bytes(Encoding.DER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.send_all, sent_down)
            nursery.start_soon(read, server, got_up)
            nursery.start_soon(client.send_all, sent_up)
            nursery.start_soon(read, client, got_down)
    assert (bytes(got_up), bytes(got_down)) == (sent_up, sent_down)


async def test_no_client_certificate_is_none(tmp_path: Path) -> None:
    async with _pair(tmp_path, with_cert=False) as (server, _tcp, client):
        assert server.peer_der() is None
        await client.send_all(b"ping")
        assert await server.receive_some() == b"ping"


@pytest.mark.parametrize("close_notify", [True, False])
async def test_the_clients_end_is_an_end_with_or_without_close_notify(
    tmp_path: Path, close_notify: bool
) -> None:
    async with _pair(tmp_path) as (server, tcp, client):
        await client.send_all(b"last words")
        if close_notify:
            await client.aclose()  # trio's default: close_notify first
        else:
            await tcp.aclose()  # a ragged end
        got = b""
        while data := await server.receive_some():
            got += data
        assert got == b"last words"


async def test_aclose_wakes_a_waiting_receiver_and_ends_the_stream(tmp_path: Path) -> None:
    async with _pair(tmp_path) as (server, _tcp, _client):
        outcome: list[type[BaseException]] = []

        async def receive() -> None:
            try:
                await server.receive_some()
            except trio.ClosedResourceError as exc:
                outcome.append(type(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await wait_all_tasks_blocked()
            await server.aclose()
        assert outcome == [trio.ClosedResourceError]
        with pytest.raises(trio.ClosedResourceError):
            await server.send_all(b"after")
        assert server.peer_der() is None


async def test_two_receivers_at_once_are_refused(tmp_path: Path) -> None:
    async with _pair(tmp_path) as (server, _tcp, client), trio.open_nursery() as nursery:
        nursery.start_soon(server.receive_some)
        await wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await server.receive_some()
        await client.send_all(b"x")  # the first one returns


async def test_a_cancelled_receive_loses_nothing(tmp_path: Path) -> None:
    async with _pair(tmp_path) as (server, _tcp, client):
        with trio.move_on_after(0.05) as scope:
            await server.receive_some()
        assert scope.cancelled_caught
        await client.send_all(b"still here")
        assert await server.receive_some() == b"still here"


async def test_a_peer_that_does_not_speak_tls_breaks_the_handshake(tmp_path: Path) -> None:
    async with _pair(tmp_path, handshake=False) as (server, tcp, _client):
        await tcp.send_all(b"GET / HTTP/1.1\r\nhost: gw.test\r\n\r\n")
        with pytest.raises(trio.BrokenResourceError, match="TLS connection broken"):
            await server.do_handshake()


async def test_a_reset_is_an_end_and_a_send_after_it_broken(tmp_path: Path) -> None:
    async with _pair(tmp_path) as (server, tcp, _client):
        tcp.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, _RESET)
        await tcp.aclose()  # linger 0: an RST
        assert await server.receive_some() == b""  # an end, as a ragged one is
        with pytest.raises(trio.BrokenResourceError, match="TLS connection broken"):
            await server.send_all(b"x")


def test_the_server_context_refuses_renegotiation(tmp_path: Path) -> None:
    """A write never has to read (bcd.tlsstream's note): the server's context
    (control.pkitls.server_ssl_context) refuses TLS 1.2 renegotiation."""
    m = material()
    ctx = server_ssl_context(_pem(m.leaf, m.ca), m.leaf_key, _pem(m.ca))
    assert ctx.options & ssl.OP_NO_RENEGOTIATION


async def test_a_receive_before_the_handshake_does_it_first(tmp_path: Path) -> None:
    """Never a read in the clear: the first receive handshakes, then decrypts."""
    async with _pair(tmp_path, handshake=False) as (server, _tcp, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, b"sealed")
            assert await server.receive_some() == b"sealed"
        assert server.peer_der() is not None


async def _wrap_and_handshake(tcp: trio.SocketStream, ctx: ssl.SSLContext) -> None:
    server = SocketTLSStream(tcp, ctx)
    try:
        await server.do_handshake()
    finally:
        await server.aclose()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_client_gone_before_its_tls_leaves_no_descriptor(tmp_path: Path) -> None:
    """A client that reset its connection before the server wrapped it: broken, at
    construction or at the handshake, and its descriptor closed either way."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    ctx = server_context(tmp_path)
    before = _open_fds()
    for _ in range(20):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = await listeners[0].accept()
        tcp.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, _RESET)
        await tcp.aclose()
        await trio.sleep(0.01)
        with pytest.raises(trio.BrokenResourceError, match="TLS connection broken"):
            await _wrap_and_handshake(accepted, ctx)
        await accepted.aclose()
    assert _open_fds() == before
    await listeners[0].aclose()


async def test_no_send_after_one_was_cancelled_mid_record(tmp_path: Path) -> None:
    """A send cancelled while the socket was full may leave a record half written; a
    later send would splice into it, so it is refused; receiving goes on."""
    async with _pair(tmp_path) as (server, _tcp, client):
        with trio.move_on_after(0.2) as scope:
            await server.send_all(b"x" * (16 << 20))  # the client reads none of it
        assert scope.cancelled_caught
        with pytest.raises(trio.BrokenResourceError, match="an earlier send"):
            await server.send_all(b"next")
        await client.send_all(b"still heard")
        assert await server.receive_some() == b"still heard"
