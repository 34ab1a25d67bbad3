"""control.http's DirectWrite: another task's chunk sent at once into a streamed body
while the body's loop waits for its next chunk (the gateway's pings), over real TLS on
loopback, read back by h11 as a client reads the session: whole chunks, in order, the
framing intact, even when the client stops reading and the socket fills."""

from __future__ import annotations

import functools
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from bcd import wire
from control import http
from tests.gatewaycalls import node_client
from tests.test_http import material, server_context
from tests.test_metrics import _hello
from tests.world import E2EWorld, Node, loaded, node_id


class Body:
    """A streamed body fed by the test through a channel, with its DirectWrite."""

    def __init__(self) -> None:
        self.direct = http.DirectWrite()
        self.send, self.receive = trio.open_memory_channel[bytes](16)
        self.closed = trio.Event()

    async def handler(self, request: http.Request) -> http.Response:
        return http.Response(200, stream=self._chunks(), direct=self.direct)

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            yield b"first\n"
            async for chunk in self.receive:
                yield chunk
        finally:
            self.closed.set()

    async def parked_write(self, chunk: bytes) -> None:
        """Write ``chunk`` directly once the body's loop waits for its next chunk."""
        with trio.fail_after(5):
            while not self.direct.try_write(chunk):  # noqa: ASYNC110 - a bounded poll
                await trio.sleep(0.01)


@pytest.fixture
async def body(nursery: trio.Nursery, tmp_path: Path) -> tuple[Body, int]:
    srv = Body()
    port = await nursery.start(
        functools.partial(
            http.serve, srv.handler, "127.0.0.1", 0, ssl_context=server_context(tmp_path)
        )
    )
    return srv, port


async def _open(port: int, *, rcvbuf: int | None = None) -> trio.SSLStream[trio.SocketStream]:
    """A TLS client (trio's own) that sent ``GET /s``; a small receive buffer on request."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    if rcvbuf is not None:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    ctx = ssl.create_default_context(cadata=material().anchor.pem)
    tls = trio.SSLStream(tcp, ctx, server_hostname="gw.test", https_compatible=True)
    await tls.send_all(b"GET /s HTTP/1.1\r\nHost: gw.test\r\n\r\n")
    return tls


async def _events(tls: trio.SSLStream[trio.SocketStream], conn: h11.Connection) -> list[object]:
    """h11's events until the next data chunk or the end of the message."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await tls.receive_some(65536))
            continue
        if isinstance(event, (h11.Data, h11.EndOfMessage)):
            return [event]
        if isinstance(event, h11.Response):
            assert event.status_code == 200
            assert (b"transfer-encoding", b"chunked") in event.headers
            continue
        raise AssertionError(f"unexpected {event!r}")


async def _read_body(tls: trio.SSLStream[trio.SocketStream]) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/s", headers=[("host", "gw.test")]))
    got = b""
    while True:
        (event,) = await _events(tls, conn)
        if isinstance(event, h11.EndOfMessage):
            return got
        assert isinstance(event, h11.Data)
        got += event.data


async def test_a_direct_write_goes_out_between_the_iterators_chunks(
    body: tuple[Body, int],
) -> None:
    srv, port = body
    assert not srv.direct.try_write(b"early\n")  # no body yet: nothing is written
    tls = await _open(port)
    await srv.parked_write(b"ping-1\n")
    await srv.send.send(b"second\n")
    await trio.testing.wait_all_tasks_blocked()  # the body loop took it, sent it, waits
    await srv.parked_write(b"ping-2\n")
    await srv.send.aclose()  # the body ends
    assert await _read_body(tls) == b"first\nping-1\nsecond\nping-2\n"
    with trio.fail_after(5):
        await srv.closed.wait()
    assert not srv.direct.try_write(b"late\n")  # after the end: never written
    await tls.aclose()


async def test_a_client_that_stops_reading_still_gets_whole_chunks_in_order(
    body: tuple[Body, int],
) -> None:
    """Direct writes until the socket is full: the last one's record is left unfinished
    (try_write says False), and the body's next chunk sends it first, whole."""
    srv, port = body
    tls = await _open(port, rcvbuf=4096)
    await srv.parked_write(b"ping-0\n")
    chunk = 16 * 1024
    written = 0
    while srv.direct.try_write(f"{written:08d}".encode() + b"." * (chunk - 9) + b"\n"):
        written += 1
        assert written < 4096, "the socket never filled"
    assert written > 0
    assert not srv.direct.try_write(b"refused\n")  # an unfinished record waits: no more
    await srv.send.send(b"after\n")  # through the iterator: after the unfinished record
    await srv.send.aclose()
    got = await _read_body(tls)
    lines = got.split(b"\n")
    assert lines[0] == b"first"
    assert lines[1] == b"ping-0"
    numbered = lines[2:-2]
    # every direct chunk, and the one left unfinished, whole and in order
    assert [int(line[:8]) for line in numbered] == list(range(written + 1))
    assert all(len(line) == chunk - 1 for line in numbered)
    assert lines[-2:] == [b"after", b""]
    await tls.aclose()


async def test_a_client_that_never_reads_is_dropped_after_the_write_timeout(
    body: tuple[Body, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "WRITE_TIMEOUT", 1.0)
    srv, port = body
    tls = await _open(port, rcvbuf=4096)
    await srv.parked_write(b"ping-0\n")
    payload = b"." * (16 * 1024 - 1) + b"\n"
    for _ in range(4096):
        if not srv.direct.try_write(payload):
            break
    else:
        raise AssertionError("the socket never filled")
    started = trio.current_time()
    await srv.send.send(b"after\n")  # blocks behind the full socket, 1 s at most
    await trio.sleep(0.3)
    assert not srv.closed.is_set()
    assert not srv.direct.try_write(b"during\n")  # never inside the blocked send
    with trio.fail_after(10):
        await srv.closed.wait()  # the body was closed: the connection dropped
    assert trio.current_time() - started >= 1.0  # by the write timeout
    assert not srv.direct.try_write(b"late\n")
    await trio.aclose_forcefully(tls)


@pytest.mark.e2e
async def test_a_real_gateway_pings_a_node_session_and_ends_it_with_its_revocation(
    e2e: E2EWorld, tmp_path: Path
) -> None:
    """A real serve pinging every 0.2 s (its pinger's direct writes over its TLS), read
    by bcd's own session client: a welcome, pings, the revocation last."""
    cp = e2e.control_plane(extra_args=["--session-ping-seconds", "0.2"])
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    state = loaded(node)
    pin = cp.pins()["serving_ca_spki_pin"]
    kinds: list[str] = []
    async with (
        await node_client(cp.gateway_port, pin, state) as client,
        client.session(_hello(state), idle_timeout=30) as lines,
    ):
        it = aiter(lines)
        with trio.fail_after(10):
            kinds.append(wire.loads_object(await anext(it))["type"])
            while len(kinds) < 6:
                kinds.append(wire.loads_object(await anext(it))["type"])
        done = cp.cli("nodes", "revoke-identity", node_id(node), "--tenant", cp.root_tenant)
        assert done.returncode == 0, done.stderr
        with trio.fail_after(10):
            async for line in it:
                kinds.append(wire.loads_object(line)["type"])
    assert kinds[:6] == ["welcome"] + ["ping"] * 5
    assert set(kinds[6:-1]) <= {"ping"}
    assert kinds[-1] == "revocation"
