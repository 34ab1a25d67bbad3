"""The relay's own TLS client (control.relay's backend over bcd.tlsstream), against a
real listener of control.http on loopback: the call is relayed over a kept-alive
connection, and an upstream whose certificate does not verify never receives it."""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from control import http, relay
from control.errors import ControlError
from control.metrics import Metrics
from control.relay import RelayClient
from tests.adversarial.test_review_fixes import _replica
from tests.test_http import _pem, material, server_context


async def _upstream(
    nursery: trio.Nursery, tmp_path: Path, seen: list[bytes], outcomes: list[str]
) -> str:
    async def handler(req: http.Request) -> http.Response:
        seen.append(req.body)
        return http.Response(200, b"signed:" + req.body)

    port: int = await nursery.start(
        functools.partial(
            http.serve,
            handler,
            "127.0.0.1",
            0,
            ssl_context=server_context(tmp_path),
            on_handshake=outcomes.append,
        )
    )
    return f"https://127.0.0.1:{port}"


def _request(body: bytes) -> http.Request:
    return http.Request("POST", "/v1/renew", {}, {}, body, None, "192.0.2.1:1")


async def test_relayed_calls_go_over_one_kept_alive_tls_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    seen: list[bytes] = []
    outcomes: list[str] = []
    url = await _upstream(nursery, tmp_path, seen, outcomes)
    client = RelayClient([url], ssl.create_default_context(cadata=_pem(material().ca)))
    answers = [await client.forward(_request(b"x" * size)) for size in (10, 60_000, 3)]
    assert [(a.status, a.body) for a in answers] == [
        (200, b"signed:" + b"x" * size) for size in (10, 60_000, 3)
    ]
    assert seen == [b"x" * 10, b"x" * 60_000, b"x" * 3]
    assert outcomes == ["completed"]  # one handshake for the three calls
    await client.aclose()


async def test_an_upstream_whose_certificate_does_not_verify_is_never_sent_the_call(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The relay's context trusts another CA: the handshake fails before a byte of the
    call is sent, so the call moves to the next upstream (a call never sent)."""
    seen: list[bytes] = []
    outcomes: list[str] = []
    unverified = await _upstream(nursery, tmp_path, seen, outcomes)
    calls: list[str] = []
    good = await _replica(nursery, "good", calls, answer=True)
    metrics = Metrics()
    client = RelayClient([unverified, good], ssl.create_default_context(), metrics=metrics)
    answer = await client.forward(_request(b"{}"))
    assert (answer.status, answer.body, calls, seen) == (200, b"signed", ["good"], [])
    assert metrics.registry.get_sample_value("bc_relay_not_sent_total") == 1
    await client.aclose()


async def test_a_connection_above_select_s_descriptor_range_is_still_kept_alive(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A gateway holds thousands of sessions, so its relay connections' descriptors
    are above 1,024, where select() cannot look: the idle check must still see a
    live connection as live and reuse it (one handshake for the calls)."""
    seen: list[bytes] = []
    outcomes: list[str] = []
    url = await _upstream(nursery, tmp_path, seen, outcomes)
    filler = [os.dup(0) for _ in range(1100)]
    try:
        client = RelayClient([url], ssl.create_default_context(cadata=_pem(material().ca)))
        for body in (b"one", b"two", b"three"):
            assert (await client.forward(_request(body))).body == b"signed:" + body
        assert outcomes == ["completed"]
        await client.aclose()
    finally:
        for fd in filler:
            os.close(fd)


def _raw_upstream(
    nursery: trio.Nursery,
    answer: Callable[[int], Awaitable[bytes]],
    connections: list[int],
    hang_up: bool = False,
    closed: list[int] | None = None,
) -> Awaitable[str]:
    """A plain-HTTP upstream: each request read whole (head and ``content-length``
    body) is answered with ``answer(n)`` (the n-th request, counted from 1), as raw
    bytes, on a connection kept open until the relay closes it (with ``hang_up``:
    closed after each answer, without saying so); ``connections`` gets one entry per
    connection accepted, ``closed`` one per connection the relay closed."""
    served = [0]

    async def peer(tcp: trio.SocketStream) -> None:
        connections.append(len(connections) + 1)
        got = b""
        while True:
            while b"\r\n\r\n" not in got:
                data = await tcp.receive_some(65536)
                if not data:
                    if closed is not None:
                        closed.append(len(closed) + 1)
                    return
                got += data
            head, _, got = got.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(got) < length:
                got += await tcp.receive_some(65536)
            got = got[length:]
            served[0] += 1
            await tcp.send_all(await answer(served[0]))
            if hang_up:
                return await tcp.aclose()

    async def start() -> str:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, peer, 0, host="127.0.0.1")
        )
        return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    return start()


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def test_an_idle_connection_the_upstream_closed_is_not_reused(
    nursery: trio.Nursery,
) -> None:
    """The upstream answers and hangs up (its idle timeout, a restart): the relay sees
    the idle connection readable when it takes it, closes it and dials anew, so the
    next call is answered, not lost on a dead connection."""
    connections: list[int] = []

    async def answer(n: int) -> bytes:
        return _ok(b"signed%d" % n)

    url = await _raw_upstream(nursery, answer, connections, hang_up=True)
    client = RelayClient([url], ssl.create_default_context())
    assert (await client.forward(_request(b"1"))).body == b"signed1"
    await trio.sleep(0.05)  # the upstream's close has reached the relay's socket
    second = await client.forward(_request(b"2"))
    assert (second.status, second.body, connections) == (200, b"signed2", [1, 2])
    await client.aclose()


async def test_a_connection_idle_past_the_keepalive_is_not_reused(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "KEEPALIVE_S", 0.05)
    seen: list[bytes] = []
    outcomes: list[str] = []
    url = await _upstream(nursery, tmp_path, seen, outcomes)
    client = RelayClient([url], ssl.create_default_context(cadata=_pem(material().ca)))
    assert (await client.forward(_request(b"a"))).body == b"signed:a"
    assert (await client.forward(_request(b"b"))).body == b"signed:b"  # at once: reused
    assert outcomes == ["completed"]
    await trio.sleep(0.1)
    assert (await client.forward(_request(b"c"))).body == b"signed:c"
    assert outcomes == ["completed", "completed"]  # a new handshake after the keep-alive
    await client.aclose()


async def test_bytes_after_an_answer_are_never_read_as_the_next_call_s_answer(
    nursery: trio.Nursery,
) -> None:
    """An upstream that sends more than its answer (a second answer nobody asked for):
    the connection is closed, not reused, so the next call gets its own answer."""
    connections: list[int] = []

    async def answer(n: int) -> bytes:
        return _ok(b"signed%d" % n) + _ok(b"forged")

    url = await _raw_upstream(nursery, answer, connections)
    client = RelayClient([url], ssl.create_default_context())
    assert (await client.forward(_request(b"1"))).body == b"signed1"
    assert (await client.forward(_request(b"2"))).body == b"signed2"  # not "forged"
    assert connections == [1, 2]
    await client.aclose()


async def test_an_answer_over_the_bound_is_not_relayed(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "MAX_ANSWER", 100)
    connections: list[int] = []

    async def answer(n: int) -> bytes:
        return _ok(b"x" * 101)

    url = await _raw_upstream(nursery, answer, connections)
    client = RelayClient([url], ssl.create_default_context())
    with pytest.raises(ControlError, match="did not answer") as unavailable:
        await client.forward(_request(b"1"))
    assert unavailable.value.code == "UNAVAILABLE"
    assert client._idle == [[]]  # that connection was closed
    await client.aclose()


async def test_a_call_with_no_free_connection_moves_on_as_never_sent(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection busy (one here, 64 in a gateway): a call waits at most the pool
    timeout for one, then goes to the next upstream as a call that never reached the
    first; the busy connection, once done, is closed to make that room."""
    monkeypatch.setattr(relay, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(relay, "POOL_TIMEOUT_S", 0.2)
    a_conns: list[int] = []
    b_conns: list[int] = []

    async def slow(n: int) -> bytes:
        await trio.sleep(0.3)
        return _ok(b"a")

    async def fast(n: int) -> bytes:
        return _ok(b"b")

    a = await _raw_upstream(nursery, slow, a_conns)
    b = await _raw_upstream(nursery, fast, b_conns)
    metrics = Metrics()
    client = RelayClient([a, b], ssl.create_default_context(), metrics=metrics)
    answers: dict[str, bytes] = {}

    async def call(name: str) -> None:
        answers[name] = (await client.forward(_request(b"{}"))).body

    async with trio.open_nursery() as calls:
        calls.start_soon(call, "first")
        await trio.sleep(0.05)
        calls.start_soon(call, "second")
    assert answers == {"first": b"a", "second": b"b"}
    assert metrics.registry.get_sample_value("bc_relay_not_sent_total") == 1
    assert (a_conns, b_conns) == ([1], [1])
    await client.aclose()


async def test_a_call_waiting_for_a_connection_takes_the_one_that_goes_idle(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection busy, a call for the same upstream waits and then takes the one
    that goes idle: no new handshake under load."""
    monkeypatch.setattr(relay, "MAX_CONNECTIONS", 1)
    conns: list[int] = []

    async def slow(n: int) -> bytes:
        await trio.sleep(0.2)
        return _ok(b"%d" % n)

    url = await _raw_upstream(nursery, slow, conns)
    metrics = Metrics()
    client = RelayClient([url], ssl.create_default_context(), metrics=metrics)
    answers: list[bytes] = []

    async def call() -> None:
        answers.append((await client.forward(_request(b"{}"))).body)

    async with trio.open_nursery() as calls:
        calls.start_soon(call)
        await trio.sleep(0.05)
        calls.start_soon(call)
    assert (sorted(answers), conns) == ([b"1", b"2"], [1])
    assert metrics.registry.get_sample_value("bc_relay_not_sent_total") == 0  # no wait out
    await client.aclose()


async def test_idle_connections_to_an_upstream_no_longer_called_are_closed(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the calls moved to another upstream, the idle connections to the first are
    closed after the keep-alive all the same, not held open."""
    monkeypatch.setattr(relay, "KEEPALIVE_S", 0.05)
    a_conns: list[int] = []
    a_closed: list[int] = []
    b_conns: list[int] = []

    async def answer(n: int) -> bytes:
        return _ok(b"ok")

    a = await _raw_upstream(nursery, answer, a_conns, closed=a_closed)
    b = await _raw_upstream(nursery, answer, b_conns)
    client = RelayClient([a, b], ssl.create_default_context())
    await client.forward(_request(b"{}"))
    assert (a_conns, a_closed) == ([1], [])
    client._preferred = 1  # the calls go to b from now on (as after a failover)
    await trio.sleep(0.1)
    await client.forward(_request(b"{}"))
    await trio.sleep(0.05)
    assert (a_closed, b_conns) == ([1], [1])
    await client.aclose()


@pytest.mark.parametrize(
    "url",
    ["https://api.internal:9443/prefix", "https://u:p@api.internal:9443", "ftp://api.internal",
     "https://api.internal:9443?x=1", "https://api.internal:99999", "https://:9443"],
)  # fmt: skip
def test_an_upstream_url_with_more_than_a_scheme_host_and_port_is_refused(url: str) -> None:
    with pytest.raises(ControlError, match="not an upstream URL") as refused:
        RelayClient([url], ssl.create_default_context())
    assert refused.value.code == "INVALID_CONFIG"
