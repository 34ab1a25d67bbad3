"""The TLS handshake bound of a listener (docs/decisions.md, "Connection limits"): at
most ``max_handshakes`` handshakes at once, ``max_handshakes_per_source`` of them for one
address; a connection asks for a slot only once it has sent something, waits for it
within HANDSHAKE_TIMEOUT and does no TLS work meanwhile. Real sockets and real TLS on
loopback, and the slots' bookkeeping (``_Gate.handshake_slot``) under a mock clock."""

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
from trio.testing import MockClock, wait_all_tasks_blocked

from bcd import gatewayclient
from control import http, server
from control.http import Limits, _Gate, source_key
from tests.test_http import Server, _pem, material, server_context

ONE = Limits(max_handshakes=1, max_handshakes_per_source=1)


async def _serve(
    nursery: trio.Nursery,
    tmp_path: Path,
    limits: Limits,
    hits: list[str] | None = None,
    life: http.Lifecycle | None = None,
    outcomes: list[str] | None = None,
) -> int:
    port: int = await nursery.start(
        functools.partial(
            http.serve,
            Server().handler,
            "127.0.0.1",
            0,
            ssl_context=server_context(tmp_path),
            life=life,
            limits=limits,
            on_limit=(hits if hits is not None else []).append,
            on_handshake=(outcomes if outcomes is not None else []).append,
        )
    )
    return port


async def _raw(port: int, source: str = "127.0.0.1", says: bytes = b"") -> trio.socket.SocketType:
    """A TCP connection from ``source`` that sends ``says`` and then nothing more."""
    sock = trio.socket.socket()
    try:
        await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
        if says:
            await sock.send(says)
    except BaseException:
        sock.close()
        raise
    await wait_all_tasks_blocked(0.01)  # the server took it and waits on it
    return sock


async def _stalled(port: int, source: str = "127.0.0.1") -> trio.socket.SocketType:
    """A stalled handshake: a ClientHello's first bytes (its record header), then
    nothing."""
    return await _raw(port, source, _client_hello()[:5])


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


async def _counted(outcomes: list[str], n: int) -> None:
    """Until the server has told ``n`` handshake outcomes (it tells one as its side of
    the connection ends, which the client may see first), at most 2 s."""
    with trio.fail_after(2):
        while len(outcomes) < n:  # noqa: ASYNC110 - the server's record, polled
            await trio.sleep(0.01)


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
    port = await _serve(nursery, tmp_path, ONE)
    stalled = await _stalled(port)
    with _closing(stalled):
        with trio.move_on_after(0.5) as waited:
            await _tls(port)
        assert waited.cancelled_caught  # no slot: the server did not answer its ClientHello
    # its slot is free at once, well before the stalled handshake's 5 s were up
    with trio.fail_after(2):
        tls = await _tls(port)
    await tls.aclose()


async def test_a_connection_that_sends_nothing_takes_no_slot(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "HANDSHAKE_TIMEOUT", 1.0)
    hits: list[str] = []
    outcomes: list[str] = []
    port = await _serve(nursery, tmp_path, ONE, hits, outcomes=outcomes)
    silent = await _raw(port)
    with _closing(silent):
        with trio.fail_after(2):  # the only slot is free: had the silent one taken it, no
            tls = await _tls(port)  # slot would have come with 0.2 s of this one's left
        await tls.aclose()
        with trio.fail_after(2):  # closed when it has said nothing with 0.2 s left
            await _closed_without_a_byte(silent)
    await _counted(outcomes, 2)
    assert hits == []  # not a connection the handshake bound turned away
    assert sorted(outcomes) == ["completed", "silent"]  # but counted: an operator sees them


async def test_a_connection_closed_without_a_byte_takes_no_slot_and_is_silent(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A TCP health check or a scan connects and closes: no handshake slot, no TLS
    work, counted ``silent`` (not a failed handshake)."""
    outcomes: list[str] = []
    port = await _serve(nursery, tmp_path, ONE, outcomes=outcomes)
    stalled = await _stalled(port)  # holds the only slot
    with _closing(stalled):
        probe = await _raw(port)
        probe.close()
        await _counted(outcomes, 1)  # at once, not after a slot's wait (4 s, then no-slot)
        assert outcomes == ["silent"]


async def test_in_a_drain_a_connection_whose_slot_comes_does_no_tls_work(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    life = http.Lifecycle()
    outcomes: list[str] = []
    port = await _serve(nursery, tmp_path, ONE, life=life, outcomes=outcomes)
    holder = await _stalled(port)
    waiter = await _raw(port, says=_client_hello())  # queued for the holder's slot
    silent = await _raw(port)
    with _closing(holder, waiter, silent):
        await wait_all_tasks_blocked(0.05)  # the waiter queued, the silent one in _talks
        life.begin_drain()
        with trio.fail_after(2):
            await _closed_without_a_byte(silent)  # hung up at once, like an idle connection
        holder.close()  # its slot frees and goes to the waiter
        with trio.fail_after(2):
            await _closed_without_a_byte(waiter)  # no ServerHello
    # the holder's handshake failed (its client went away); the drain's hang-ups of the
    # silent one and the waiter are not handshakes that went wrong
    assert outcomes == ["failed"]


async def test_one_source_cannot_take_the_slots_of_the_others(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port = await _serve(nursery, tmp_path, Limits(max_handshakes=2, max_handshakes_per_source=1))
    first, second = await _stalled(port), await _stalled(port)  # the second waits its turn
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
        ("127.0.0.2", ONE, "handshakes"),
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
    # 2 s, not 1: the waiters give up 1.6 s after their accept, and the holder's slot
    # frees 2 s after its own, so they may be accepted up to 0.4 s after it (a loaded
    # machine) and still find no slot
    monkeypatch.setattr(http, "HANDSHAKE_TIMEOUT", 2.0)
    hits: list[str] = []
    outcomes: list[str] = []
    port = await _serve(nursery, tmp_path, limits, hits, outcomes=outcomes)
    stalled = await _stalled(port, holder)  # holds the slot its whole 2 s
    started = time.monotonic()
    waiting = [await _raw(port, says=_client_hello()), await _raw(port, says=_client_hello())]
    with _closing(stalled, *waiting), caplog.at_level(logging.WARNING, "control.http"):
        with trio.fail_after(http.HANDSHAKE_TIMEOUT):  # never longer than the handshake's time
            for sock in waiting:
                await _closed_without_a_byte(sock)  # no ServerHello: no TLS work
        assert time.monotonic() - started >= 1.0  # it did wait for a slot
        with trio.fail_after(2):
            await _closed_without_a_byte(stalled)  # its 2 s ran out
    assert hits == [limit, limit]
    assert sorted(outcomes) == ["no-slot", "no-slot", "timed-out"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "control.http"]
    assert warnings == [
        "handshake limit: closed 1 connections that found no TLS handshake slot in time "
        f"(at most {limits.max_handshakes} handshakes at once, "
        f"{limits.max_handshakes_per_source} per source)"
    ]  # one a minute


async def test_a_client_that_does_not_speak_tls_is_counted_as_a_failed_handshake(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    outcomes: list[str] = []
    port = await _serve(nursery, tmp_path, ONE, outcomes=outcomes)
    plain = await _raw(port, says=b"GET / HTTP/1.1\r\nHost: gw.test\r\n\r\n")
    with _closing(plain), trio.fail_after(2), contextlib.suppress(ConnectionResetError):
        while await plain.recv(65536):  # an alert, perhaps, then the end
            pass
    assert outcomes == ["failed"]  # counted before the server closed it
    with trio.fail_after(2):
        tls = await _tls(port)  # its slot was given back
    await _counted(outcomes, 2)  # the server's side of the handshake is done too
    await tls.aclose()
    assert outcomes == ["failed", "completed"]


async def test_a_listener_without_tls_has_no_handshake_slots(nursery: trio.Nursery) -> None:
    srv = Server()
    port = await nursery.start(
        functools.partial(http.serve, srv.handler, "127.0.0.1", 0, limits=ONE)
    )
    stalled = await _stalled(port)
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


def test_the_gateway_gives_a_nat_site_64_handshakes_and_a_stall_costs_1024_every_5s() -> None:
    """A site of up to 1,024 nodes behind one address (the per-source connection bound)
    gets 64 handshakes at once after a gateway restart; stalling all 1,024 takes that
    many talking connections every HANDSHAKE_TIMEOUT (about 205 a second), from 16
    addresses."""
    limits = server.LIMITS["gateway"]
    assert (limits.max_handshakes, limits.max_handshakes_per_source) == (1_024, 64)
    assert limits.max_per_source == 1_024
    assert limits.max_handshakes / http.HANDSHAKE_TIMEOUT > 200
    assert limits.max_handshakes // limits.max_handshakes_per_source == 16


@pytest.mark.parametrize(("total", "per_source"), [(4, 8), (0, 0), (1, 0)])
def test_a_source_cannot_have_more_handshakes_than_the_listener(
    total: int, per_source: int
) -> None:
    with pytest.raises(ValueError, match="max_handshakes_per_source must be from 1 to"):
        Limits(max_handshakes=total, max_handshakes_per_source=per_source)


@pytest.mark.parametrize("per_source", [32, 100, 128, 256, 512, 1_000, 2_048])
def test_the_relay_handshake_share_follows_its_per_source_setting(per_source: int) -> None:
    limits = server.relay_limits(per_source)
    assert limits.max_per_source == per_source
    stall = limits.max_handshakes / limits.max_handshakes_per_source
    assert stall >= limits.max_connections / per_source
    assert limits.max_handshakes_per_source <= 8


# _Gate.handshake_slot, its bookkeeping alone: one slot for the listener and one per
# source; "a" holds both, so another connection from "a" waits for its source's slot
# and one from "b" for the listener's. Whatever becomes of a connection, nothing of it
# stays behind.


def _idle(gate: _Gate) -> bool:
    return gate.handshakes_of == {} and gate.handshakes.borrowed_tokens == 0


async def _hold(
    gate: _Gate,
    release: trio.Event,
    source: str = "a",
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with gate.handshake_slot(source, trio.current_time() + 5) as refusal:
        assert refusal is None
        task_status.started()
        await release.wait()


async def test_a_slot_is_given_back_when_the_handshake_completes(
    autojump_clock: MockClock,
) -> None:
    gate = _Gate(ONE)
    async with gate.handshake_slot("a", trio.current_time() + 5) as refusal:
        assert refusal is None
        assert gate.handshakes.borrowed_tokens == 1
        assert gate.handshakes_of["a"][1] == 1
    assert _idle(gate)


@pytest.mark.parametrize(("source", "limit"), [("a", "handshakes-per-source"), ("b", "handshakes")])
async def test_a_connection_without_a_slot_in_time_gives_up_with_a_fifth_left(
    autojump_clock: MockClock, source: str, limit: str
) -> None:
    hits: list[str] = []
    gate = _Gate(ONE, hits.append)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, gate, release)
        started = trio.current_time()
        async with gate.handshake_slot(source, started + 5) as refusal:
            assert refusal == "no-slot"
            assert trio.current_time() - started == pytest.approx(4.0)
        assert hits == [limit]
        assert gate.no_slot.count == 0  # reset by its warning, the first of the minute
        release.set()
    assert _idle(gate)


@pytest.mark.parametrize("held", [False, True])  # the slots free, or another's
async def test_a_connection_reached_with_under_a_fifth_left_is_late_not_a_limits_hit(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture, held: bool
) -> None:
    # the process got to the connection 4.5 s into its 5 s (its event loop behind):
    # no handshake, told "late", no limit's hit, nothing held, one warning a minute
    hits: list[str] = []
    gate = _Gate(ONE, hits.append)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        if held:
            await nursery.start(_hold, gate, release)
        for _ in range(2):
            started = trio.current_time()
            async with gate.handshake_slot("b", started + 0.5) as refusal:
                assert refusal == "late"
                assert trio.current_time() == started  # at once
        assert hits == []
        assert gate.handshakes.borrowed_tokens == (1 if held else 0)
        release.set()
    assert _idle(gate)
    warned = [r for r in caplog.records if "running behind" in r.getMessage()]
    assert len(warned) == 1
    assert "closed 1 connections" in warned[0].getMessage()


async def test_a_slot_that_comes_as_its_process_runs_too_late_goes_unused(
    autojump_clock: MockClock,
) -> None:
    # "b" queues for the listener's only slot; "a" gives it back at 3.9 s, and the
    # process gets back to "b" only at 4.1 s, past its cutoff: late, not a handshake
    hits: list[str] = []
    gate = _Gate(ONE, hits.append)
    started = trio.current_time()

    async def holder(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with gate.handshake_slot("a", started + 5) as refusal:
            assert refusal is None
            task_status.started()
            await trio.sleep(3.9)
        autojump_clock.jump(0.2)  # given back; the waiter runs only after this

    async with trio.open_nursery() as nursery:
        await nursery.start(holder)
        async with gate.handshake_slot("b", started + 5) as refusal:
            assert refusal == "late"
            assert trio.current_time() - started == pytest.approx(4.1)
    assert hits == []
    assert _idle(gate)


async def test_a_free_slot_is_taken_with_no_yield_between_the_two(
    autojump_clock: MockClock,
) -> None:
    # a process whose event loop ran behind between the source's slot and the
    # listener's saw the listener's limit with every slot free: no yield comes between
    gate = _Gate(ONE)
    with trio.testing.assert_no_checkpoints():
        async with gate.handshake_slot("a", trio.current_time() + 5) as refusal:
            assert refusal is None
            assert gate.handshakes.borrowed_tokens == 1
    assert _idle(gate)


@pytest.mark.parametrize("source", ["a", "b"])  # waiting for its source's slot, the listener's
async def test_a_connection_cancelled_while_it_waits_for_a_slot_leaves_nothing(
    autojump_clock: MockClock, source: str
) -> None:
    hits: list[str] = []
    gate = _Gate(ONE, hits.append)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, gate, release)
        with trio.move_on_after(1) as cancelled:
            async with gate.handshake_slot(source, trio.current_time() + 5):
                pytest.fail("given a slot that another holds")
        assert cancelled.cancelled_caught
        assert {key: users for key, (_, users) in gate.handshakes_of.items()} == {"a": 1}
        assert hits == []  # a cancelled connection is no limit's doing
        release.set()
    assert _idle(gate)


async def test_a_slot_is_given_back_when_the_handshake_raises(
    autojump_clock: MockClock,
) -> None:
    gate = _Gate(ONE)

    async def handshake() -> None:
        async with gate.handshake_slot("a", trio.current_time() + 5) as refusal:
            assert refusal is None
            raise ssl.SSLError("bad ClientHello")

    with pytest.raises(ssl.SSLError):
        await handshake()
    assert _idle(gate)
    async with gate.handshake_slot("b", trio.current_time() + 5) as refusal:
        assert refusal is None  # the listener's only slot is free again


# An IPv6 client is counted by its /48 (source_key): the /64s of one site, a customer's
# /56 among them, share one source's share of the connections and of the handshakes
# (docs/decisions.md, "Connection limits"). A loopback machine cannot connect from
# several /64s, so these are the gate's bookkeeping alone, with the keys of real
# addresses.


def _site(subnet: str, site: str = "1") -> str:
    """The source of a host in ``subnet`` (a /64) of ``2001:db8:<site>::/48``."""
    return source_key(f"[2001:db8:{site}:{subnet}::1]:443")


async def test_the_64s_of_one_ipv6_site_share_one_sources_connections(
    autojump_clock: MockClock,
) -> None:
    hits: list[str] = []
    gate = _Gate(Limits(max_connections=16, max_per_source=2), hits.append)
    first, second, third = _site("1"), _site("2"), _site("ff00")
    assert gate.admit(first)
    assert gate.admit(second)
    assert not gate.admit(third)  # a third /64 of the site: over its share
    assert hits == ["connections-per-source"]
    assert gate.admit(_site("1", site="2"))  # another site has a share of its own
    for host in ("192.0.2.1", "192.0.2.2", "192.0.2.3"):  # each IPv4 address its own
        assert gate.admit(source_key(f"{host}:443"))
    gate.release(first)
    assert gate.admit(third)  # the site's share is given back whole
    for source in (second, third, _site("1", site="2"), "192.0.2.1", "192.0.2.2", "192.0.2.3"):
        gate.release(source)
    assert (gate.total, gate.by_source) == (0, {})
    assert hits == ["connections-per-source"]


async def test_the_64s_of_one_ipv6_site_share_one_sources_handshakes(
    autojump_clock: MockClock,
) -> None:
    hits: list[str] = []
    gate = _Gate(Limits(max_handshakes=2, max_handshakes_per_source=1), hits.append)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, gate, release, _site("1"))
        # the listener has a slot free, but not the site: another /64 of it waits
        # for the site's slot, and gives up with a fifth of its time left
        async with gate.handshake_slot(_site("2"), trio.current_time() + 5) as refusal:
            assert refusal == "no-slot"
        assert hits == ["handshakes-per-source"]
        async with gate.handshake_slot(_site("1", site="2"), trio.current_time() + 5) as refusal:
            assert refusal is None  # another site takes the listener's free slot at once
        release.set()
    assert _idle(gate)
    assert hits == ["handshakes-per-source"]


# The accept path counts an IPv6 client by its listener's own prefix
# (Limits.source_prefix, serve --ipv6-source-prefix): a listener of hosts with public
# addresses in one /48 gives each /64 a share of its own at 64, and each address at 128
# (many cloud VMs share a /64), as the relay listener always does. A listener stand-in
# hands out connections from real IPv6 addresses, which loopback cannot connect from.


class _Peer:
    """An accepted connection's socket: its peer's address, and whether it was closed."""

    def __init__(self, host: str) -> None:
        self.host, self.closed = host, False

    def getpeername(self) -> tuple[str, int, int, int]:
        return (self.host, 443, 0, 0)

    def close(self) -> None:
        self.closed = True


class _Accepted:
    def __init__(self, host: str) -> None:
        self.socket = _Peer(host)


class _Listener:
    """Hands out a connection from each of ``hosts`` in turn, then waits forever."""

    def __init__(self, hosts: list[str]) -> None:
        self.accepted = [_Accepted(host) for host in hosts]
        self.left = list(self.accepted)

    async def accept(self) -> _Accepted:
        if not self.left:
            await trio.sleep_forever()
        return self.left.pop(0)


_HOSTS = [
    "2001:db8:1:1::1",
    "2001:db8:1:1::2",
    "2001:db8:1:1::3",  # a third connection of the /64 2001:db8:1:1::/64
    "2001:db8:1:2::1",  # another /64 of the same /56 and /48
    "2001:db8:1:100::1",  # another /56 of the same /48
    "192.0.2.1",
    "::ffff:192.0.2.1",  # the same IPv4 address, whatever the prefix
]


@pytest.mark.parametrize(
    ("prefix", "admitted"),
    [
        (48, ["2001:db8:1:1::1", "2001:db8:1:1::2"]),
        (56, ["2001:db8:1:1::1", "2001:db8:1:1::2", "2001:db8:1:100::1"]),
        (64, ["2001:db8:1:1::1", "2001:db8:1:1::2", "2001:db8:1:2::1", "2001:db8:1:100::1"]),
        (128, _HOSTS[:5]),  # each address its own source, the third of a /64 too
    ],
)
async def test_the_accept_path_counts_an_ipv6_client_by_its_listeners_prefix(
    prefix: int, admitted: list[str]
) -> None:
    hits: list[str] = []
    gate = _Gate(Limits(max_connections=16, max_per_source=2, source_prefix=prefix), hits.append)
    listener = _Listener(_HOSTS)
    served: list[tuple[str, str]] = []

    async def connection(_tcp: object, remote: str, source: str) -> None:
        served.append((remote, source))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(http._accept, listener, connection, nursery, gate)
        await wait_all_tasks_blocked()
        refused = [a.socket.host for a in listener.accepted if a.socket.closed]
        assert sorted(remote for remote, _ in served) == sorted(
            [*(f"[{host}]:443" for host in admitted), "192.0.2.1:443", "[::ffff:192.0.2.1]:443"]
        )  # the connections start in whatever order trio runs them
        assert {source for _, source in served} == {
            *(source_key(f"[{host}]:443", prefix) for host in admitted),
            "192.0.2.1",
        }
        assert refused == [host for host in _HOSTS[:5] if host not in admitted]
        assert hits == ["connections-per-source"] * len(refused)
        nursery.cancel_scope.cancel()
    assert (gate.total, gate.by_source) == (0, {})  # every admitted connection given back


async def test_the_relay_listener_counts_each_gateway_address_as_its_own_source() -> None:
    """The relay's clients are the operator's gateways, here in one /64 of an internal
    network: each address is a source of its own, as each IPv4 address is, so that the
    gateways do not share one source's share; one address still holds only its own."""
    hits: list[str] = []
    gate = _Gate(server.relay_limits(1), hits.append)  # one connection from a source
    gateways = ["2001:db8:1:1::a", "2001:db8:1:1::b", "2001:db8:1:1::c", "192.0.2.1"]
    listener = _Listener([*gateways, "2001:db8:1:1::a", "::ffff:192.0.2.1"])
    served: list[str] = []

    async def connection(_tcp: object, remote: str, _source: str) -> None:
        served.append(remote)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(http._accept, listener, connection, nursery, gate)
        await wait_all_tasks_blocked()
        assert sorted(served) == sorted(
            f"[{host}]:443" if ":" in host else f"{host}:443" for host in gateways
        )
        refused = [a.socket.host for a in listener.accepted if a.socket.closed]
        assert refused == ["2001:db8:1:1::a", "::ffff:192.0.2.1"]  # a second from one
        assert hits == ["connections-per-source"] * 2
        nursery.cancel_scope.cancel()
    assert (gate.total, gate.by_source) == (0, {})
