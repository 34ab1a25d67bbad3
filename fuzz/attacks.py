"""Connection exhaustion and the session attack, run against the listeners' caps.

- ``idle_flood``: thousands of bare TCP connections from another loopback address
  that never send a ClientHello or a request; each one the server closes is opened
  again after ``reopen_s`` (a sustained flood, not a single wave).
- ``slowloris``: request heads that never end, a byte a second, over plain TCP to
  the API and over TLS to the gateway (after a real handshake).
- ``session_attack``: one node certificate opening hundreds of sessions; every
  older one must end (cleanly) as a newer one opens.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from dataclasses import dataclass, field

import trio

from bcd import wire
from fuzz.client import Endpoint, connect, read_answer

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError)


@dataclass
class FloodStats:
    opened: int = 0
    connect_failed: int = 0
    closed_by_server: int = 0
    held_s: list[float] = field(default_factory=list)
    open_now: int = 0
    peak_open: int = 0

    def opened_one(self) -> None:
        self.opened += 1
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)

    def closed_one(self, held: float) -> None:
        self.open_now -= 1
        self.closed_by_server += 1
        if len(self.held_s) < 50_000:
            self.held_s.append(held)


async def idle_flood(
    port: int,
    count: int,
    stats: FloodStats,
    *,
    source: str,
    reopen_s: float,
    until: float,
    start_s: float = 0.0,
) -> None:
    async def one(index: int) -> None:
        await trio.sleep(start_s + index * 0.0005)  # a ramp, not one burst of SYNs
        while trio.current_time() < until:
            sock = trio.socket.socket()
            try:
                await sock.bind((source, 0))
                with trio.fail_after(5):
                    await sock.connect(("127.0.0.1", port))
            except (OSError, trio.TooSlowError):
                stats.connect_failed += 1
                sock.close()
                await trio.sleep(reopen_s)
                continue
            stats.opened_one()
            opened = time.monotonic()
            ended = False
            with trio.move_on_at(until):
                try:
                    while await sock.recv(4096):
                        pass
                except OSError:
                    pass
                ended = True
            sock.close()
            if ended:
                stats.closed_one(time.monotonic() - opened)
                await trio.sleep(reopen_s)
            else:
                stats.open_now -= 1

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)


SLOW_HEAD = b"GET /api/compute/.well-known/better-compute HTTP/1.1\r\nHost: x\r\nX-a: "


async def slowloris(
    endpoint: Endpoint, count: int, stats: FloodStats, *, source: str, until: float
) -> None:
    head = (
        SLOW_HEAD
        if not endpoint.tls
        else SLOW_HEAD.replace(b"/api/compute/.well-known/better-compute", b"/healthz")
    )

    async def one(index: int) -> None:
        await trio.sleep(index * 0.005)
        while trio.current_time() < until:
            try:
                conn = await connect(endpoint, None, source=source)
            except Exception:
                stats.connect_failed += 1
                await trio.sleep(1)
                continue
            stats.opened_one()
            opened = time.monotonic()
            closed = False
            try:
                await conn.stream.send_all(head)
                with trio.move_on_at(until):
                    while True:
                        with trio.move_on_after(1):
                            if not await conn.stream.receive_some(4096):
                                closed = True
                                break
                        await conn.stream.send_all(b"a")
            except _GONE:
                closed = True
            finally:
                await conn.aclose()
            if closed:
                stats.closed_one(time.monotonic() - opened)
            else:
                stats.open_now -= 1

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)


@dataclass
class SessionStats:
    opened: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    ended_cleanly: int = 0
    ended_otherwise: int = 0
    still_open: int = 0
    errors: int = 0
    opened_at: list[float] = field(default_factory=list)
    """When each session opened, seconds from the attack's start."""
    open_at_end: list[float] = field(default_factory=list)
    """When each session still open at the end had opened."""
    not_opened: int = 0
    """Not opened: the attack's last SETTLE_S had begun (nothing newer could end them)."""


SETTLE_S = 5.0


async def session_attack(
    endpoint: Endpoint,
    identity: str,
    node_id: str,
    count: int,
    concurrency: int,
    stats: SessionStats,
    *,
    until: float,
) -> None:
    """``count`` sessions with one certificate, ``concurrency`` opening at a time; each
    is held until the server ends it (or ``until``)."""
    hello = wire.dumps(wire.Hello(node_id, "jrn_" + "a" * 26, "b" * 32, "fuzz").to_json())
    request = (
        b"POST /v1/session HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(hello)
    ) + hello
    limiter = trio.Semaphore(concurrency)
    start = trio.current_time()

    async def one() -> None:
        async with limiter:
            if trio.current_time() > until - SETTLE_S:
                stats.not_opened += 1
                return
            try:
                conn = await connect(endpoint, identity)
            except Exception:
                stats.errors += 1
                return
            try:
                await conn.stream.send_all(request)
                with trio.fail_after(20):
                    answer = await read_answer(conn, "POST")
            except (*_GONE, trio.TooSlowError):
                stats.errors += 1
                await conn.aclose()
                return
        if answer.status != 200:
            key = f"{answer.status} {answer.code}"
            stats.refused[key] = stats.refused.get(key, 0) + 1
            await conn.aclose()
            return
        stats.opened += 1
        opened_at = trio.current_time() - start
        stats.opened_at.append(opened_at)
        # the rest of the stream: a clean end (0-length chunk) when a newer one replaces it
        try:
            with trio.move_on_at(until) as waited:
                while b"0\r\n\r\n" not in conn.buf:
                    if not await conn.fill():
                        break
            if waited.cancelled_caught:
                stats.still_open += 1
                stats.open_at_end.append(opened_at)
            elif b"0\r\n\r\n" in conn.buf:
                stats.ended_cleanly += 1
            else:
                stats.ended_otherwise += 1
        finally:
            await conn.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


def fd_count(pid: int) -> int:
    with contextlib.suppress(OSError):
        import os

        return len(os.listdir(f"/proc/{pid}/fd"))
    return -1
