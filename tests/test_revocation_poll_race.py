"""Sessions that open while the revocation poll reads the store.

A poll takes the serials it holds sessions of, reads the revocations (and the signed
notices of the held serials) and then applies what it read to the sessions it holds
*then*. In production the read runs in a worker thread and the event loop opens
sessions meanwhile. A revocation committed before or during that window still ends
such a session: by the poll's own result (no notice was read for a serial it did not
hold: the session ends, ``revocation.session_ended``), by the revocations an earlier
poll found (``Gateway._register``), or by the next poll (with the signed notice); and
no session of a node that is not revoked ends.

The real gateway, the real store (SQLite and PostgreSQL) and the real read: the
gateway's offload runs its store calls on the loop, as in
tests/test_revocation_feed_clock.py (whose helpers this reuses), and holds the
poll's read, before it reads the store or after, until the test lets it go (the two
places where, seen from the event loop, a worker thread's read lets others run).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import pytest
import trio
from cryptography.hazmat.primitives import serialization

from bcd import pki as bpki
from bcd import wire
from control import gateway as gateway_module
from control.gateway import REVOCATION_POLL_S, Gateway
from control.http import Response
from control.pki import Pki
from control.store import Row, Tx
from tests.test_revocation_feed_clock import (
    _mock_world,
    _no_upstream,
    _pump,
    _revoke,
    _session_request,
)
from tests.world.joins import World, machine

T = TypeVar("T")
POLLER = "revocation poller"
STILL_OPEN = "still open"
_real_read = gateway_module._revoked_and_now


@dataclass(frozen=True, slots=True)
class _Node:
    node_id: str
    der: bytes
    serial: str


def _join(world: World, n: int) -> _Node:
    joined = world.join(world.body(world.mint(), machine(n)))
    leaf = bpki.load_pem_chain(joined["chain"])[0]
    return _Node(joined["node_id"], leaf.public_bytes(serialization.Encoding.DER),
                 format(leaf.serial_number, "x"))  # fmt: skip


class _PollGate:
    """The gateway's offload: its store calls run on the event loop (as
    ``control.gateway.inline``), and the next revocation poll's read can be held

    - ``"before"`` it reads the store: the poll has taken the serials it holds;
    - ``"after"``: its rows and notices are read, not yet applied;

    until :meth:`hold` moves it on (to be held at the other place) or :meth:`release`
    lets it go. ``held`` is what each poll read the notices for."""

    def __init__(self) -> None:
        self.held: list[frozenset[str]] = []
        self._at: Literal["before", "after"] | None = None
        self._reached = trio.Event()
        self._release = trio.Event()
        self._paused_read = -1

    def read(
        self, tx: Tx, since_ms: int, held: frozenset[str]
    ) -> tuple[list[Row], dict[str, str | None], int]:
        """The poll's real read (``control.gateway._revoked_and_now``), recorded."""
        self.held.append(held)
        return _real_read(tx, since_ms=since_ms, held=held)

    async def hold(self, at: Literal["before", "after"]) -> None:
        """Hold the poll's read at ``at`` (a poll held now moves on to it); return once
        it is there."""
        release = self._release
        self._at, self._reached, self._release = at, trio.Event(), trio.Event()
        release.set()
        await self._reached.wait()

    def release(self) -> None:
        self._at = None
        self._release.set()

    def held_by_the_held_poll(self) -> frozenset[str]:
        """The serials the poll held last took (once it read)."""
        return self.held[self._paused_read]

    async def __call__(self, fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
        poll = trio.lowlevel.current_task().name == POLLER
        if poll and self._at == "before":
            self._paused_read = len(self.held)
            await self._pause()
        async with limiter:
            result = fn()
        if poll and self._at == "after":
            self._paused_read = len(self.held) - 1
            await self._pause()
        return result

    async def _pause(self) -> None:
        self._at = None
        release = self._release
        self._reached.set()
        await release.wait()


@dataclass
class _Run:
    gateway: Gateway
    gate: _PollGate
    nursery: trio.Nursery

    async def check(self, node: _Node) -> Response:
        """The session's certificate checked live; its answer not started yet."""
        response = await self.gateway.handle(_session_request(node.node_id, node.der))
        assert response.status == 200
        return response

    async def start(self, response: Response) -> trio.MemoryReceiveChannel[Any]:
        """The answer starts (as the HTTP layer reads it, in a task of its own): the
        session is registered; its welcome is read."""
        assert response.stream is not None
        send, receive = trio.open_memory_channel[Any](16)
        self.nursery.start_soon(_pump, response.stream, send)
        assert json.loads(await receive.receive())["type"] == "welcome"
        return receive

    async def open(self, node: _Node) -> trio.MemoryReceiveChannel[Any]:
        return await self.start(await self.check(node))

    async def redial(self, node: _Node) -> tuple[int, dict[str, Any]]:
        again = await self.gateway.handle(_session_request(node.node_id, node.der))
        return again.status, json.loads(again.body)


async def _rest(receive: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    """A session's lines after its welcome up to its end (None); ``STILL_OPEN`` if
    it has not ended five poll intervals on."""
    lines: list[Any] = []
    with trio.move_on_after(5 * REVOCATION_POLL_S):
        while (chunk := await receive.receive()) is not None:
            lines.append(json.loads(chunk))
        return [*lines, None]
    return [*lines, STILL_OPEN]


async def _still_up(run: _Run, node: _Node, receive: trio.MemoryReceiveChannel[Any]) -> bool:
    """The bystander's session, a few polls on: told nothing, still held."""
    await trio.sleep(3 * REVOCATION_POLL_S)
    try:
        receive.receive_nowait()
    except trio.WouldBlock:
        return node.serial in run.gateway.sessions
    return False


def _kind(line: Any) -> Any:
    """A line's type; None (the end) and ``STILL_OPEN`` as they are."""
    return line["type"] if isinstance(line, dict) else line


def _events(caplog: pytest.LogCaptureFixture, serial: str) -> list[str]:
    return [
        str(getattr(r, "event", ""))
        for r in caplog.records
        if getattr(r, "serial", None) == serial
        and getattr(r, "event", "").startswith(("revocation.", "session.revoked_at_open"))
    ]


class _Race:
    """A world of two joined nodes (``revoked`` and ``bystander``) on a mock clock, and
    a gateway whose poller runs behind a :class:`_PollGate`."""

    def __init__(self, store_url: str, memory_pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mock, self.store, self.world = _mock_world(store_url, memory_pki)
        self.pki = memory_pki
        self.revoked = _join(self.world, 1)
        self.bystander = _join(self.world, 2)
        self.gate = _PollGate()
        monkeypatch.setattr(gateway_module, "_revoked_and_now", self.gate.read)

    def revoke(self) -> None:
        """The revoked node's certificates revoked in the store, by another replica."""
        _revoke(self.store, self.world, self.pki, self.revoked.node_id)

    def run(self, body: Callable[[_Run], Awaitable[None]]) -> None:
        async def main() -> None:
            async with self._polling() as run:
                await trio.sleep(2 * REVOCATION_POLL_S)  # a few polls, nothing to find
                await body(run)

        trio.run(main, clock=self.mock)
        self.store.close()

    @contextlib.asynccontextmanager
    async def _polling(self) -> AsyncIterator[_Run]:
        """The gateway with its poller running (named, so the gate knows its calls),
        both stopped at the end."""
        gateway = Gateway(self.store, upstream=_no_upstream, limiter=trio.CapacityLimiter(4),
                          ping_interval_s=3_600.0, offload=self.gate)  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gateway.revocation_poller, name=POLLER)
            yield _Run(gateway, self.gate, nursery)
            nursery.cancel_scope.cancel()

    def verify(self, signed: str) -> None:
        notice = wire.verify_revocation_notice(
            signed, self.world.signing_pin, self.revoked.node_id, [self.revoked.serial]
        )
        assert notice.serial == self.revoked.serial


async def _release_and_watch(
    run: _Run,
    race: _Race,
    revoked: trio.MemoryReceiveChannel[Any],
    bystander: trio.MemoryReceiveChannel[Any],
    out: dict[str, Any],
    *,
    redial: bool = True,
) -> None:
    """Let the held poll go, then note what the revoked node's stream got, which
    sessions the held poll held, the revoked node's redial (``redial``), and whether
    the bystander's session is still up."""
    run.gate.release()
    out["lines"] = await _rest(revoked)
    out["held"] = run.gate.held_by_the_held_poll()
    if redial:
        out["redial"] = await run.redial(race.revoked)
    out["bystander_up"] = await _still_up(run, race.bystander, bystander)


def _assert_ended_then_refused(race: _Race, out: dict[str, Any]) -> None:
    assert out["lines"] == [None]  # a clean end of stream right away: no line to check
    status, body = out["redial"]
    assert (status, body["code"], body["reason"]) == (401, "UNAUTHENTICATED", "revoked")
    race.verify(body["notice"])
    assert out["bystander_up"]


def _run_ended_and_logged(
    race: _Race,
    body: Callable[[_Run], Awaitable[None]],
    out: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
    event: str,
) -> None:
    """Run ``body``; the revoked session ended at once and its redial was refused with
    the signed notice, ``event`` logged for it and nothing for the bystander."""
    with caplog.at_level(logging.INFO, logger="control.gateway"):
        race.run(body)
    _assert_ended_then_refused(race, out)
    assert _events(caplog, race.revoked.serial) == [event]
    assert _events(caplog, race.bystander.serial) == []


def test_a_session_opened_and_revoked_while_a_poll_reads_ends_and_is_logged(
    store_url: str,
    memory_pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both sessions open after the poll took the serials it holds, and the revocation
    commits before it reads: the poll finds the row but read no notice for a serial it
    did not hold. The revoked node's session ends (its redial is answered
    UNAUTHENTICATED with the signed notice), logged as ``revocation.session_ended``;
    the other node's session, opened in the same window, stays up."""
    race = _Race(store_url, memory_pki, monkeypatch)
    out: dict[str, Any] = {}

    async def body(run: _Run) -> None:
        await run.gate.hold("before")
        revoked = await run.open(race.revoked)
        bystander = await run.open(race.bystander)
        race.revoke()
        await _release_and_watch(run, race, revoked, bystander, out)

    _run_ended_and_logged(race, body, out, caplog, "revocation.session_ended")
    assert out["held"] == frozenset()  # the path taken: it held neither session


def test_a_session_opened_after_a_poll_read_its_revocation_ends_and_is_logged(
    store_url: str,
    memory_pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The certificate is checked live, then revoked; the poll reads the revocation
    and, before it applies it, the session's answer starts (nothing found yet to end
    it at its registration). The poll's result ends it, logged as
    ``revocation.session_ended``; the other node's session stays up."""
    race = _Race(store_url, memory_pki, monkeypatch)
    out: dict[str, Any] = {}

    async def body(run: _Run) -> None:
        checked = await run.check(race.revoked)
        race.revoke()
        await run.gate.hold("after")
        assert race.revoked.serial not in run.gateway._revoked
        revoked = await run.start(checked)
        bystander = await run.open(race.bystander)
        await _release_and_watch(run, race, revoked, bystander, out)

    _run_ended_and_logged(race, body, out, caplog, "revocation.session_ended")
    assert out["held"] == frozenset()


def test_a_revocation_committed_after_a_poll_read_reaches_a_session_opened_meanwhile(
    store_url: str,
    memory_pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The session opens while the poll reads (not held by it) and its certificate is
    revoked after the read, before the poll applies what it read: that poll finds
    nothing; the next one, within one interval, pushes the signed notice, and the
    stream ends after it. The other node's session stays up."""
    race = _Race(store_url, memory_pki, monkeypatch)
    out: dict[str, Any] = {}

    async def body(run: _Run) -> None:
        await run.gate.hold("before")
        revoked = await run.open(race.revoked)
        bystander = await run.open(race.bystander)
        await run.gate.hold("after")
        race.revoke()
        await _release_and_watch(run, race, revoked, bystander, out, redial=False)

    with caplog.at_level(logging.INFO, logger="control.gateway"):
        race.run(body)
    assert [_kind(line) for line in out["lines"]] == ["revocation", None]
    line = out["lines"][0]
    assert (line["serial"], line["reason"]) == (race.revoked.serial, "operator")
    race.verify(line["notice"])
    assert out["held"] == frozenset()  # it held neither session: the next poll told it
    assert out["bystander_up"]
    assert _events(caplog, race.revoked.serial) == ["revocation.pushed"]
    assert _events(caplog, race.bystander.serial) == []


def test_a_session_opened_while_the_next_poll_reads_ends_by_the_revocation_found_before(
    store_url: str,
    memory_pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The certificate is checked live, then revoked, and a poll finds the revocation
    with no session to tell; the session's answer starts while the next poll reads,
    which skips the row it already handled. The revocations the poller keeps end the
    session at its registration (``session.revoked_at_open``); the other node's
    session, opened in the same window, stays up."""
    race = _Race(store_url, memory_pki, monkeypatch)
    out: dict[str, Any] = {}

    async def body(run: _Run) -> None:
        checked = await run.check(race.revoked)
        race.revoke()
        await run.gate.hold("after")  # a poll read the revocation: no session to tell
        await run.gate.hold("before")  # it applied it; the next poll reads
        assert race.revoked.serial in run.gateway._revoked
        revoked = await run.start(checked)
        bystander = await run.open(race.bystander)
        run.gate.release()
        out["lines"] = await _rest(revoked)
        out["redial"] = await run.redial(race.revoked)
        out["bystander_up"] = await _still_up(run, race.bystander, bystander)

    _run_ended_and_logged(race, body, out, caplog, "session.revoked_at_open")


def test_the_poll_gate_holds_only_the_pollers_read(
    store_url: str, memory_pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness itself: while a poll is held, the gateway's other store calls (a
    session's check) run, and the poll's read has not happened (``before``) or has
    (``after``)."""
    race = _Race(store_url, memory_pki, monkeypatch)
    reads: list[int] = []

    async def body(run: _Run) -> None:
        await run.gate.hold("before")
        reads.append(len(run.gate.held))
        await run.check(race.bystander)  # not held: another task's store call
        reads.append(len(run.gate.held))
        await run.gate.hold("after")
        reads.append(len(run.gate.held))
        run.gate.release()

    race.run(body)
    assert reads[1:] == [reads[0], reads[0] + 1]
