"""The TLS handshake bound of a listener (docs/decisions.md, "Connection limits"): at
most ``max_handshakes`` handshakes at once, ``max_handshakes_per_source`` of them for one
address; a connection waits for its slot within HANDSHAKE_TIMEOUT and does no TLS work
meanwhile. Real sockets and real TLS on loopback."""

from __future__ import annotations

import contextlib
import functools
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from bcd import gatewayclient
from control import http, server
from control.http import Limits
from tests.test_http import Server, _pem, material, server_context


async def _serve(
    nursery: trio.Nursery, tmp_path: Path, limits: Limits, hits: list[str] | None = None
) -> int:
    port: int = await nursery.start(
        functools.partial(
            http.serve,
            Server().handler,
            "127.0.0.1",
            0,
            ssl_context=server_context(tmp_path),
            limits=limits,
            on_limit=(hits if hits is not None else []).append,
        )
    )
    return port


async def _raw(port: int, source: str = "127.0.0.1") -> trio.socket.SocketType:
    """A TCP connection from ``source`` that says nothing: a stalled handshake."""
    sock = trio.socket.socket()
    try:
        await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    await wait_all_tasks_blocked(0.01)  # the server took it and waits on it
    return sock


def _client_context() -> ssl.SSLContext:
    return ssl.create_default_context(cadata=_pem(material().ca))


async def _tls(port: int, source: str = "127.0.0.1") -> trio.SSLStream[trio.SocketStream]:
    """A TLS client from ``source`` whose handshake is done."""
    sock = trio.socket.socket()
    try:
        await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
        tls = trio.SSLStream(trio.SocketStream(sock), _client_context(), server_hostname="gw.test")
        await tls.do_handshake()
    except BaseException:
        sock.close()
        raise
    return tls


def _client_hello() -> bytes:
    bio_in, bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _client_context().wrap_bio(bio_in, bio_out, server_hostname="gw.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return bio_out.read()


async def _closed_without_a_byte(sock: trio.socket.SocketType) -> None:
    try:
        data = await sock.recv(65536)
    except ConnectionResetError:  # closed with our ClientHello unread
        return
    assert data == b""


@contextlib.contextmanager
def _closing(*socks: trio.socket.SocketType) -> Iterator[None]:
    try:
        yield
    finally:
        for sock in socks:
            sock.close()


async def test_a_stalled_handshake_holds_the_only_slot_until_its_client_goes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port = await _serve(nursery, tmp_path, Limits(max_handshakes=1))
    stalled = await _raw(port)
    with _closing(stalled):
        with trio.move_on_after(0.5) as waited:
            await _tls(port)
        assert waited.cancelled_caught  # no slot: the server did not answer its ClientHello
    # its slot is free at once, well before the stalled handshake's 5 s were up
    with trio.fail_after(2):
        tls = await _tls(port)
    await tls.aclose()


async def test_one_source_cannot_take_the_slots_of_the_others(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port = await _serve(nursery, tmp_path, Limits(max_handshakes=2, max_handshakes_per_source=1))
    first, second = await _raw(port), await _raw(port)  # the second waits for its source's slot
    with _closing(first, second):
        with trio.move_on_after(0.5) as waited:
            await _tls(port)
        assert waited.cancelled_caught
        with trio.fail_after(2):
            tls = await _tls(port, source="127.0.0.2")  # the listener's second slot is free
        await tls.aclose()


@pytest.mark.parametrize(
    ("holder", "limits", "limit"),
    [
        ("127.0.0.2", Limits(max_handshakes=1), "handshakes"),
        ("127.0.0.1", Limits(max_handshakes=2, max_handshakes_per_source=1),
         "handshakes-per-source"),
    ],
)  # fmt: skip
async def test_a_connection_without_a_slot_in_time_is_closed_without_tls_work(
    nursery: trio.Nursery,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    holder: str,
    limits: Limits,
    limit: str,
) -> None:
    monkeypatch.setattr(http, "HANDSHAKE_TIMEOUT", 1.0)
    hits: list[str] = []
    port = await _serve(nursery, tmp_path, limits, hits)
    stalled = await _raw(port, holder)  # holds the slot its whole second
    waiting = [await _raw(port), await _raw(port)]
    with _closing(stalled, *waiting), caplog.at_level(logging.WARNING, "control.http"):
        started = time.monotonic()
        with trio.fail_after(http.HANDSHAKE_TIMEOUT):  # never longer than the handshake's time
            for sock in waiting:
                await sock.send(_client_hello())
                await _closed_without_a_byte(sock)  # no ServerHello: no TLS work
        assert time.monotonic() - started >= 0.5  # it did wait for a slot
    assert hits == [limit, limit]
    warnings = [r.getMessage() for r in caplog.records if r.name == "control.http"]
    assert warnings == [
        "handshake limit: closed 1 connections that found no TLS handshake slot in time "
        f"(at most {limits.max_handshakes} handshakes at once, "
        f"{limits.max_handshakes_per_source} per source)"
    ]  # one a minute


async def test_a_listener_without_tls_has_no_handshake_slots(nursery: trio.Nursery) -> None:
    srv = Server()
    port = await nursery.start(
        functools.partial(http.serve, srv.handler, "127.0.0.1", 0, limits=Limits(max_handshakes=1))
    )
    stalled = await _raw(port)
    with _closing(stalled):
        resp = await gatewayclient.fetch_url(f"http://127.0.0.1:{port}/x", timeout=2)
    assert resp.status == 200


@pytest.mark.parametrize("name", ["gateway", "relay"])
def test_stalling_every_handshake_takes_no_fewer_addresses_than_filling_the_listener(
    name: str,
) -> None:
    limits = server.LIMITS[name]
    stall = limits.max_handshakes / limits.max_handshakes_per_source
    assert stall >= limits.max_connections / limits.max_per_source


@pytest.mark.parametrize("per_source", [32, 100, 128, 256, 512, 1_000, 2_048])
def test_the_relay_handshake_share_follows_its_per_source_setting(per_source: int) -> None:
    limits = server.relay_limits(per_source)
    assert limits.max_per_source == per_source
    stall = limits.max_handshakes / limits.max_handshakes_per_source
    assert stall >= limits.max_connections / per_source
    assert limits.max_handshakes_per_source <= 8
