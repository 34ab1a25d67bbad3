"""What the review of the hardening found, each pinned by a test (pure or in process)."""

from __future__ import annotations

import functools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio

from bcd.attestor_api import hookimpl
from bcd.config import load_config
from bcd.errors import ConfigError
from bcd.plugins import load_plugins
from control import relay
from control.errors import ControlError
from control.http import Request, source_key, source_of
from control.metrics import Metrics
from control.proofs import spend_proof
from control.relay import RelayClient
from control.store import Store


@pytest.mark.parametrize(
    ("remote", "source", "key"),
    [
        ("192.0.2.7:5000", "192.0.2.7", "192.0.2.7"),
        ("[::ffff:192.0.2.7]:5000", "192.0.2.7", "192.0.2.7"),
        ("[2001:db8:1:2:aaaa::1]:443", "2001:db8:1:2::/64", "2001:db8:1::/48"),
        ("[2001:db8:1:2:bbbb::9]:443", "2001:db8:1:2::/64", "2001:db8:1::/48"),
    ],
)
def test_an_ipv6_subnet_is_one_source_and_its_site_one_of_a_listener(
    remote: str, source: str, key: str
) -> None:
    """One subnet (a /64: a LAN's machines, or a cloud subnet's many VMs) is one source
    of pending join requests, and a listener's connection bounds count its whole site
    (its /48) as one by default."""
    assert source_of(remote.rpartition(":")[0].strip("[]")) == source
    assert source_key(remote) == key


def test_a_listener_counts_an_ipv6_site_as_one_source_and_no_ipv4_block() -> None:
    """The /64s of a /48 (a customer's /56 among them) are one source of a listener's
    bounds; another /48 is another source, and so is each IPv4 address of a /24
    (carrier-grade NAT: its customers share one address already, others a block)."""
    site = {source_key(f"[2001:db8:1:{subnet}::1]:443") for subnet in ("0", "2", "ff", "ffff")}
    assert site == {"2001:db8:1::/48"}
    assert source_key("[2001:db8:2::1]:443") == "2001:db8:2::/48"
    ipv4 = {source_key(f"{host}:443") for host in ("192.0.2.1", "192.0.2.2", "::ffff:192.0.2.3")}
    assert ipv4 == {"192.0.2.1", "192.0.2.2", "192.0.2.3"}


def test_a_proof_is_refused_again_at_exactly_120_s(store: Store) -> None:
    with store.tx() as tx:
        assert spend_proof(tx, "p" * 64, "node_x", 1_000_000)
    with store.tx() as tx:
        assert not spend_proof(tx, "p" * 64, "node_x", 1_120_000)  # still spent
    with store.tx() as tx:
        assert spend_proof(tx, "p" * 64, "node_x", 1_120_001)


def test_a_config_others_can_change_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('gateway_url = "https://gw.example"\n')
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="can be changed by other users"):
        load_config(path)


class EmptyName:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return [""]  # "" is join-token on the wire


def test_a_plugin_claiming_the_empty_name_collides_with_join_token() -> None:
    plugins = load_plugins(extra=[EmptyName()])
    assert "join-token" not in plugins.names()
    assert "" not in plugins.names()
    assert any("join-token" in f.error for f in plugins.failures)


def _request() -> Request:
    return Request("POST", "/v1/join", {}, {}, b"{}", None, "192.0.2.1:1")


def _peer(
    name: str, calls: list[str], answer: bool
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A replica's side of one connection (plain HTTP: what is under test is the
    relay's failover): it records each request it received whole, then answers 200
    ``signed`` or, when ``answer`` is False, closes without a word (a replica that died
    mid-call)."""

    async def peer(tcp: trio.SocketStream) -> None:
        got = b""
        while b"\r\n\r\n" not in got:
            got += await tcp.receive_some(65536)
        calls.append(name)
        if answer:
            await tcp.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsigned")
        await tcp.aclose()

    return peer


async def _replica(nursery: trio.Nursery, name: str, calls: list[str], answer: bool) -> str:
    """A replica on loopback (:func:`_peer`)."""
    peer = _peer(name, calls, answer)
    listeners = await nursery.start(functools.partial(trio.serve_tcp, peer, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as sock:  # bound, never listening: a connect is refused
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _not_sent(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("bc_relay_not_sent_total")


class _OnSecondPass(logging.Handler):
    """Runs ``then`` when the relay logs its second pass, before it sleeps."""

    def __init__(self, then: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.then = then
        self.passes = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "once more" in record.getMessage():
            self.passes += 1
            self.then()


@pytest.fixture
def second_pass() -> Iterator[Callable[[Callable[[], None]], _OnSecondPass]]:
    logger = logging.getLogger("control.relay")
    added: list[_OnSecondPass] = []

    def watch(then: Callable[[], None]) -> _OnSecondPass:
        added.append(_OnSecondPass(then))
        logger.addHandler(added[-1])
        return added[-1]

    yield watch
    for handler in added:
        logger.removeHandler(handler)


async def test_a_call_no_replica_took_is_tried_once_more(
    nursery: trio.Nursery, second_pass: Callable[[Callable[[], None]], _OnSecondPass]
) -> None:
    """The only replica refused the connection (its handshakes stalled, it was
    restarting): nothing was sent, so the gateway tries it once more after 0.5 s
    instead of answering the node UNAVAILABLE."""
    calls: list[str] = []
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))  # bound, not listening: refused, until the second pass
    opened = trio.Event()

    def listen() -> None:
        sock.listen(8)
        opened.set()

    async def serve() -> None:
        await opened.wait()
        await trio.serve_listeners(_peer("a", calls, True), [trio.SocketListener(sock)])

    nursery.start_soon(serve)
    seen = second_pass(listen)
    metrics = Metrics()
    client = RelayClient(
        [f"http://127.0.0.1:{sock.getsockname()[1]}"], ssl.create_default_context(), metrics=metrics
    )
    answer = await client.forward(_request())
    assert (answer.status, answer.body, calls, seen.passes) == (200, b"signed", ["a"], 1)
    assert _not_sent(metrics) == 1
    await client.aclose()


async def test_a_second_pass_no_replica_takes_is_unavailable(
    second_pass: Callable[[Callable[[], None]], _OnSecondPass],
) -> None:
    seen = second_pass(lambda: None)
    metrics = Metrics()
    client = RelayClient(
        [_closed_port(), _closed_port()], ssl.create_default_context(), metrics=metrics
    )
    began = trio.current_time()
    with pytest.raises(ControlError, match="no JoinService replica answers") as unavailable:
        await client.forward(_request())
    assert unavailable.value.code == "UNAVAILABLE"
    assert trio.current_time() - began >= relay.SECOND_PASS_AFTER_S
    assert (seen.passes, _not_sent(metrics)) == (1, 4)  # each one twice
    await client.aclose()


async def test_no_second_pass_when_a_whole_attempt_would_not_fit(
    monkeypatch: pytest.MonkeyPatch, second_pass: Callable[[Callable[[], None]], _OnSecondPass]
) -> None:
    """The relay's bound on one call (under the node's 30 s) leaves no room for another
    whole attempt: the node is answered UNAVAILABLE at once, and retries."""
    monkeypatch.setattr(relay, "RELAY_DEADLINE_S", relay.ATTEMPT_S)
    seen = second_pass(lambda: None)
    metrics = Metrics()
    client = RelayClient([_closed_port()], ssl.create_default_context(), metrics=metrics)
    with pytest.raises(ControlError, match="no JoinService replica answers"):
        await client.forward(_request())
    assert (seen.passes, _not_sent(metrics)) == (0, 1)
    await client.aclose()


async def test_a_call_already_sent_is_not_sent_to_another_replica(nursery: trio.Nursery) -> None:
    calls: list[str] = []
    a = await _replica(nursery, "a", calls, answer=False)
    b = await _replica(nursery, "b", calls, answer=True)
    client = RelayClient([a, b], ssl.create_default_context())
    with pytest.raises(ControlError) as unavailable:
        await client.forward(_request())
    assert unavailable.value.code == "UNAVAILABLE"
    assert calls == ["a"]  # b never saw it: a may still be judging it
    answer = await client.forward(_request())  # the retry goes to the next one
    assert (answer.status, answer.body, calls[-1]) == (200, b"signed", "b")
    await client.aclose()


async def test_a_call_that_never_reached_a_replica_moves_to_the_next(
    nursery: trio.Nursery,
) -> None:
    calls: list[str] = []
    b = await _replica(nursery, "b", calls, answer=True)
    client = RelayClient([_closed_port(), b], ssl.create_default_context())
    answer = await client.forward(_request())
    assert (answer.status, answer.body, calls) == (200, b"signed", ["b"])
    await client.aclose()
