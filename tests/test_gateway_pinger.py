"""The gateway's one pinger under ``trio.testing.MockClock``: every idle session gets
a ping once per interval (the first within one interval of its welcome), and a
session ends, with a clean end of stream, within one pinger step of its
certificate's end. The store and the gateway take their time from the mock clock,
as in tests/test_revocation_feed_clock.py, whose helpers this reuses."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import trio
import trio.testing
from cryptography.hazmat.primitives import serialization

from bcd import pki as bpki
from control import gateway as gw_module
from control.clock import TrioClock
from control.gateway import PING_SLOTS, Gateway, inline
from control.pki import Pki
from control.store import open_store
from tests.test_revocation_feed_clock import _no_upstream, _pump, _session_request
from tests.world.joins import machine, make_world

INTERVAL_S = 600.0  # long steps: the run reaches the certificates' end fast


def test_one_pinger_pings_each_session_every_interval_and_ends_it_with_its_certificate(
    store_url: str, memory_pki: Pki
) -> None:
    mock = trio.testing.MockClock(autojump_threshold=0)
    store = open_store(store_url, clock=TrioClock(mock, int(time.time() * 1000)))
    store.migrate()
    world = make_world(store, memory_pki)
    ders = []
    for i in (1, 2):
        joined = world.join(world.body(world.mint(), machine(i)))
        leaf = bpki.load_pem_chain(joined["chain"])[0]
        ders.append((joined["node_id"], leaf.public_bytes(serialization.Encoding.DER), leaf))
    seen: dict[int, list[tuple[float, Any]]] = {0: [], 1: []}
    ended = [trio.Event(), trio.Event()]

    async def read(i: int, lines: trio.MemoryReceiveChannel[Any]) -> None:
        while (chunk := await lines.receive()) is not None:
            seen[i].append((trio.current_time(), json.loads(chunk)["type"]))
        seen[i].append((trio.current_time(), None))
        ended[i].set()

    async def main() -> float:
        gateway = Gateway(
            store,
            upstream=_no_upstream,
            limiter=trio.CapacityLimiter(4),
            ping_interval_s=INTERVAL_S,
            offload=inline,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gateway.pinger)
            opened = trio.current_time()
            for i, (node_id, der, _leaf) in enumerate(ders):
                if i == 1:
                    await trio.sleep(INTERVAL_S * 0.4)  # another slot
                response = await gateway.handle(_session_request(node_id, der))
                assert response.status == 200
                assert response.stream is not None
                send, lines = trio.open_memory_channel[Any](64)
                nursery.start_soon(_pump, response.stream, send)
                nursery.start_soon(read, i, lines)
            await trio.sleep(5 * INTERVAL_S)
            assert sum(len(peers) for peers in gateway.sessions.values()) == 2
            # the certificates' end: each stream ends by itself, within one step of it
            with trio.fail_after(48 * 3600):
                for event in ended:
                    await event.wait()
            nursery.cancel_scope.cancel()
            return opened

    started = time.time()  # the mock clock's zero, on the store's clock
    opened = trio.run(main, clock=mock)
    store.close()
    step = INTERVAL_S / PING_SLOTS
    for i, (_node_id, _der, leaf) in enumerate(ders):
        kinds = [k for _, k in seen[i]]
        assert kinds[0] == "welcome"
        assert kinds[-1] is None  # a clean end of stream
        assert set(kinds[1:-1]) == {"ping"}
        times = [t for t, k in seen[i] if k == "ping"]
        welcome_at = seen[i][0][0]
        assert INTERVAL_S - step - 1e-6 <= times[0] - welcome_at <= INTERVAL_S + 1e-6
        gaps = {round(b - a, 6) for a, b in itertools.pairwise(times)}
        assert gaps == {INTERVAL_S}
        life_s = leaf.not_valid_after_utc.timestamp() - started
        ended_at = seen[i][-1][0] - opened
        assert -2 <= ended_at - life_s <= step + 2  # within a step of its end


def test_a_session_whose_answer_is_never_sent_leaves_nothing_behind(
    store_url: str, memory_pki: Pki
) -> None:
    """A node that resets the connection before the session's answer head is written:
    its body is never started, so nothing is registered (the pinger's slots, the
    expiry heap, the session indexes) and repeating it grows nothing."""
    store = open_store(store_url)
    store.migrate()
    world = make_world(store, memory_pki)
    joined = world.join(world.body(world.mint(), machine(1)))
    leaf = bpki.load_pem_chain(joined["chain"])[0]
    der = leaf.public_bytes(serialization.Encoding.DER)

    async def main() -> None:
        gateway = Gateway(
            store, upstream=_no_upstream, limiter=trio.CapacityLimiter(4), offload=inline
        )
        for _ in range(20):
            response = await gateway.handle(_session_request(joined["node_id"], der))
            assert response.status == 200
            assert response.stream is not None  # the head was "lost": never iterated
        assert gateway.sessions == {}
        assert gateway.by_node == {}
        assert not any(gateway._slots)
        assert gateway._ends == []
        # a session whose body does start is registered, and unregistered at its end
        response = await gateway.handle(_session_request(joined["node_id"], der))
        assert response.stream is not None
        stream = response.stream.__aiter__()
        welcome = json.loads(await stream.__anext__())
        assert welcome["type"] == "welcome"
        assert sum(len(p) for p in gateway.sessions.values()) == 1
        await stream.aclose()  # type: ignore[attr-defined]
        assert gateway.sessions == {}

    trio.run(main)


def test_a_session_whose_queue_is_full_still_ends(store_url: str) -> None:
    """A drain or a revocation notice for a session whose queue (8) is full closes the
    queue: the stream sends what was queued, then ends cleanly, and the node redials
    (to be checked, or told of its revocation). Nothing is dropped silently."""
    store = open_store(store_url)
    store.migrate()

    async def main() -> None:
        gateway = Gateway(
            store, upstream=_no_upstream, limiter=trio.CapacityLimiter(4), offload=inline
        )
        for what, told in ((gw_module._DRAIN, True), (_REVOKED, False)):
            send, receive = trio.open_memory_channel[dict[str, Any]](8)
            session = gw_module._Session(
                "node-1", "01ab", send, ends_in_s=600.0, checked_at=trio.current_time()
            )
            # a stream whose queue _end left open would wait for its next line for good
            with trio.fail_after(5):
                stream = gateway._stream(session, "s-1", receive)
                assert json.loads(await stream.__anext__())["type"] == "welcome"
                for _ in range(8):
                    send.send_nowait(gw_module._PING)
                assert gateway._end(session, what) is told
                lines = [chunk async for chunk in stream]
            assert lines == [gw_module._PING_LINE] * 8  # then a clean end, no exception
            assert session.closed
            assert "01ab" not in gateway.sessions

    trio.run(main)


_REVOKED: dict[str, Any] = {"type": "revocation", "reason": "revoked", "serial": "01ab"}
