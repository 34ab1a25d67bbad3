"""The revocation feed under ``trio.testing.MockClock``: a revocation made in the
store (as by another replica: no poke, no notification) reaches the gateway's
session within one poll interval of virtual time, without real waiting.

The store takes its time from the same mock clock (:class:`control.clock.TrioClock`),
so ``revoked_at``, the poller's ``since`` and the session's deadline all move with
the event loop; the gateway's store calls run on the loop (``offload=inline``), so
the autojump never runs while a worker thread holds the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives import serialization

from bcd import pki as bpki
from bcd import wire
from control.clock import TrioClock
from control.gateway import REVOCATION_POLL_S, SESSION_OPEN_MAX_S, Gateway, inline
from control.http import Request, Response, error_response
from control.joinservice import notice_signer, revoke_node_certs
from control.pki import Pki
from control.store import Store, open_store
from tests.world.joins import World, machine, make_world

QUIET_S = 5.3  # several polls with nothing to find, ending between two of them


def _session_request(node_id: str, der: bytes) -> Request:
    hello = wire.Hello(node_id=node_id, journal_id="jrn_1", boot_id="", daemon_version="t")
    return Request(
        method="POST",
        path="/v1/session",
        query={},
        headers={},
        body=wire.dumps(hello.to_json()),
        peer_cert_der=der,
        remote="127.0.0.1:5000",
    )


async def _pump(stream: Any, send: trio.MemorySendChannel[Any]) -> None:
    async for chunk in stream:
        await send.send(chunk)
    await send.send(None)


async def _no_upstream(req: Request) -> Response:
    return error_response("NOT_FOUND", "no upstream in this test")


def _mock_world(store_url: str, memory_pki: Pki) -> tuple[trio.testing.MockClock, Store, World]:
    """A store on a mock clock (its time moves with the event loop's) and a world."""
    mock = trio.testing.MockClock(autojump_threshold=0)
    store = open_store(store_url, clock=TrioClock(mock, int(time.time() * 1000)))
    store.migrate()
    return mock, store, make_world(store, memory_pki)


def _joined(world: World) -> tuple[str, bytes, str]:
    """A node joined in ``world``: its id, its leaf's DER and serial."""
    joined = world.join(world.body(world.mint(), machine(1)))
    leaf = bpki.load_pem_chain(joined["chain"])[0]
    return (joined["node_id"], leaf.public_bytes(serialization.Encoding.DER),
            format(leaf.serial_number, "x"))  # fmt: skip


@contextlib.asynccontextmanager
async def _polling(store: Store) -> AsyncIterator[tuple[Gateway, trio.Nursery]]:
    """A gateway with its revocation poller running, both stopped at the end."""
    gateway = _gateway(store)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gateway.revocation_poller)
        yield gateway, nursery
        nursery.cancel_scope.cancel()


def _revoke(store: Store, world: World, memory_pki: Pki, node_id: str) -> None:
    """Revoke the node's certificates in the store, as another replica would."""
    with store.tx() as tx:
        revoke_node_certs(
            tx, world.tenant, node_id, "operator", notice_signer(memory_pki.join_signing_key)
        )


def _gateway(store: Store) -> Gateway:
    """A gateway whose store calls run on the loop (the mock clock's autojump)."""
    return Gateway(
        store,
        upstream=_no_upstream,
        limiter=trio.CapacityLimiter(4),
        ping_interval_s=3_600.0,
        offload=inline,
    )


def test_a_revocation_reaches_the_session_within_one_poll_interval(
    store_url: str, memory_pki: Pki
) -> None:
    mock, store, world = _mock_world(store_url, memory_pki)
    node_id, der, serial = _joined(world)
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with _polling(store) as (gateway, nursery):
            response = await gateway.handle(_session_request(node_id, der))
            assert response.status == 200
            assert response.stream is not None
            # read as the HTTP layer does, in a task of its own (the stream's cancel
            # scopes span its yields); None marks its end
            send, lines = trio.open_memory_channel[Any](16)
            nursery.start_soon(_pump, response.stream, send)
            assert json.loads(await lines.receive())["type"] == "welcome"
            await trio.sleep(QUIET_S)  # the polls run, and find nothing to send
            _revoke(store, world, memory_pki, node_id)  # another replica: nobody pokes
            revoked_at = trio.current_time()
            with trio.fail_after(10 * REVOCATION_POLL_S):
                line = json.loads(await lines.receive())
            seen["after_s"] = trio.current_time() - revoked_at
            seen["line"] = line
            with trio.fail_after(1):  # the stream ends after the notice
                seen["more"] = await lines.receive()
            # and the gateway's decision on the certificate is now UNAUTHENTICATED
            again = await gateway.handle(_session_request(node_id, der))
            seen["again"] = (again.status, json.loads(again.body))

    started = time.monotonic()
    trio.run(main, clock=mock)
    real_s = time.monotonic() - started
    store.close()

    assert 0 < seen["after_s"] <= REVOCATION_POLL_S
    assert real_s < QUIET_S  # virtual time passed; the test did not wait it out
    line = seen["line"]
    assert (line["type"], line["serial"], line["reason"]) == ("revocation", serial, "operator")
    notice = wire.verify_revocation_notice(line["notice"], world.signing_pin, node_id, [serial])
    assert notice.serial == serial
    assert seen["more"] is None
    status, body = seen["again"]
    assert status == 401
    assert body["code"] == "UNAUTHENTICATED"
    assert body["notice"] == line["notice"]


def test_a_revocation_made_while_a_session_opens_still_ends_it(
    store_url: str, memory_pki: Pki
) -> None:
    """The certificate is found live, then revoked (by another replica), and the poller
    finds the revocation before the session's answer starts (no session to tell yet):
    the session still ends, right after its welcome, and its node's next dial is
    answered UNAUTHENTICATED with the signed notice."""
    mock, store, world = _mock_world(store_url, memory_pki)
    node_id, der, serial = _joined(world)
    lines: list[Any] = []

    async def main() -> None:
        async with _polling(store) as (gateway, nursery):
            await trio.sleep(2 * REVOCATION_POLL_S)
            response = await gateway.handle(_session_request(node_id, der))
            assert response.status == 200  # checked live: the answer is not started yet
            assert response.stream is not None
            _revoke(store, world, memory_pki, node_id)
            await trio.sleep(3 * REVOCATION_POLL_S)  # the poller finds it: no session yet
            assert serial in gateway._revoked
            send, receive = trio.open_memory_channel[Any](16)
            nursery.start_soon(_pump, response.stream, send)  # the answer starts now
            with trio.fail_after(5 * REVOCATION_POLL_S):
                while (chunk := await receive.receive()) is not None:
                    lines.append(json.loads(chunk))
            lines.append(None)
            assert gateway.sessions == {}
            again = await gateway.handle(_session_request(node_id, der))  # the redial
            lines.append((again.status, json.loads(again.body)))

    trio.run(main, clock=mock)
    store.close()
    assert [line and line["type"] for line in lines[:2]] == ["welcome", None]
    status, body = lines[2]
    assert (status, body["code"], body["reason"]) == (401, "UNAUTHENTICATED", "revoked")
    notice = wire.verify_revocation_notice(body["notice"], world.signing_pin, node_id, [serial])
    assert notice.serial == serial


def test_a_session_checked_too_long_before_its_answer_starts_ends_at_once(
    store_url: str, memory_pki: Pki
) -> None:
    """A session whose answer starts more than SESSION_OPEN_MAX_S after its certificate
    was checked gets its welcome and a clean end of stream: its node redials and is
    checked again."""
    mock, store, world = _mock_world(store_url, memory_pki)
    node_id, der, _serial = _joined(world)
    kinds: list[Any] = []

    async def main() -> None:
        gateway = _gateway(store)
        for delay in (0.0, SESSION_OPEN_MAX_S + 1):
            response = await gateway.handle(_session_request(node_id, der))
            assert response.stream is not None
            await trio.sleep(delay)
            stream = response.stream.__aiter__()
            kinds.append(json.loads(await stream.__anext__())["type"])
            with trio.move_on_after(10) as waited:
                try:
                    await stream.__anext__()
                    kinds.append("more")
                except StopAsyncIteration:
                    kinds.append("end")
            if waited.cancelled_caught:
                await stream.aclose()  # type: ignore[attr-defined]
                kinds.append("open")
            assert gateway.sessions == {}

    trio.run(main, clock=mock)
    store.close()
    assert kinds == ["welcome", "open", "welcome", "end"]


def test_a_revoked_session_without_a_notice_to_push_ends(
    store_url: str, memory_pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A revoked certificate whose row holds no signed notice: the session is not sent
    a revocation line it could not check, it ends with a clean end of stream (its node
    redials and is refused), logged as ``revocation.session_ended``, not as pushed."""
    mock, store, world = _mock_world(store_url, memory_pki)
    node_id, der, serial = _joined(world)
    lines: list[Any] = []

    async def main() -> None:
        async with _polling(store) as (gateway, nursery):
            response = await gateway.handle(_session_request(node_id, der))
            assert response.stream is not None
            send, receive = trio.open_memory_channel[Any](16)
            nursery.start_soon(_pump, response.stream, send)
            lines.append(json.loads(await receive.receive())["type"])
            _revoke(store, world, memory_pki, node_id)
            with store.tx() as tx:
                tx.execute("UPDATE node_certs SET revoke_notice = NULL WHERE serial = ?", (serial,))
            with trio.fail_after(5 * REVOCATION_POLL_S):
                lines.append(await receive.receive())

    with caplog.at_level(logging.INFO, logger="control.gateway"):
        trio.run(main, clock=mock)
    store.close()
    assert lines == ["welcome", None]
    events = [getattr(r, "event", None) for r in caplog.records]
    assert "revocation.session_ended" in events
    assert "revocation.pushed" not in events
