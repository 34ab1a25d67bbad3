"""Attacks on the control plane's HTTP layer and its connections, against a real serve.

One certificate opening many sessions, thousands of idle or half-open connections
from one address, slowloris heads, request-smuggling framing and oversized heads:
each is answered or dropped without a traceback, and with the attack running a real
node still joins and opens its session and the API answers within a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
from pathlib import Path

import pytest
import trio

from bcd import wire
from bcd.identity import LoadedState, load_state
from tests.gatewaycalls import node_client
from tests.world import ControlPlane, Node

pytestmark = pytest.mark.e2e


def _joined(cp: ControlPlane, root: Path, seed: int) -> tuple[Node, LoadedState]:
    site, pool = cp.site_and_pool()
    node = Node.make(root, cp, site, seed=seed)
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    state = load_state(node.data_dir)
    assert isinstance(state, LoadedState)
    return node, state


def _hello(state: LoadedState) -> bytes:
    hello = wire.Hello(state.identity.node_id, "jrn_" + "a" * 26, "b" * 32, "test")
    return wire.dumps(hello.to_json())


def _api_port(cp: ControlPlane) -> int:
    return int(cp.api.rsplit(":", 1)[1])


def _raw(port: int, data: bytes, *, source: str = "127.0.0.1") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


async def test_one_certificate_holds_one_session_however_many_it_opens(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    _node, state = _joined(cp, tmp_path / "n", 31)
    pin = cp.pins()["serving_ca_spki_pin"]
    streams = []
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(40):
            client = await stack.enter_async_context(await node_client(cp.gateway_port, pin, state))
            lines = await stack.enter_async_context(client.session(_hello(state), idle_timeout=20))
            assert lines.status == 200
            it = aiter(lines)
            assert json.loads(await anext(it))["type"] == "welcome"
            streams.append(it)
        # every older session was ended cleanly by the newer one: its stream is over
        with trio.fail_after(10):
            for it in streams[:-1]:
                assert [line async for line in it] == []
        with trio.move_on_after(1) as waited:
            await anext(streams[-1])  # the newest stays open (no line within a second)
        assert waited.cancelled_caught
    assert cp.proc.poll() is None
    assert "Traceback" not in (cp.home / "serve.log").read_text()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_idle_connections_does_not_stop_nodes_or_the_api(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    attack: list[socket.socket] = []
    try:
        # 1,500 bare TCP connections to each listener that never send a ClientHello or
        # a request, and 100 slowloris heads, all from one other address (127.0.0.2)
        for port in (cp.gateway_port, _api_port(cp)):
            for _ in range(1_500):
                s = socket.socket()
                s.setblocking(False)
                s.bind(("127.0.0.2", 0))
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                attack.append(s)
        for _ in range(100):
            s = socket.create_connection(
                ("127.0.0.1", _api_port(cp)), source_address=("127.0.0.2", 0)
            )
            s.sendall(b"GET /api/compute/.well-known/better-compute HTTP/1.1\r\nHost: x\r\nX-a: ")
            attack.append(s)
        time.sleep(1)
        # the serve process holds at most its per-source caps of them
        assert _fds(cp.proc.pid) < 1_024 + 128 + 200
        started = time.monotonic()
        doc = cp.well_known()
        assert doc["join"]["signingKeyPin"]
        assert time.monotonic() - started < 1.0
        node, _state = _joined(cp, tmp_path / "n", 32)
        done = node.bcd("doctor")
        assert done.returncode == 0, done.stdout + done.stderr
        time.sleep(11)  # past the handshake and first-request timeouts
        assert _fds(cp.proc.pid) < 200
    finally:
        for s in attack:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    log = (cp.home / "serve.log").read_text()
    assert "Traceback" not in log
    assert "UnboundLocalError" not in log
    assert len(log.splitlines()) < 60


def test_content_length_with_transfer_encoding_is_refused(
    sqlite_control_plane: ControlPlane,
) -> None:
    answer = _raw(
        _api_port(sqlite_control_plane),
        b"POST /api/compute/v1/tenants/x/sites HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"Content-Length and Transfer-Encoding together" in answer


def test_the_head_limit_holds_when_the_head_arrives_in_one_piece(
    sqlite_control_plane: ControlPlane,
) -> None:
    big = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 900) for i in range(40))  # 36 KiB
    answer = _raw(
        _api_port(sqlite_control_plane),
        b"GET /api/compute/.well-known/better-compute HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
        (b"Content-Length: 999999\r\n\r\n", b"413"),
        (b"X-Big: " + b"v" * 17_000 + b"\r\n\r\n", b"431"),
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", b"400"),
    ],
)
def test_a_refused_head_request_gets_its_answer_without_a_body(
    sqlite_control_plane: ControlPlane, head: bytes, status: bytes
) -> None:
    """Found by make fuzz: h11 forbids a body on a HEAD's answer; the refusal used to be
    sent as a GET's, which failed with a traceback and no answer at all."""
    answer = _raw(_api_port(sqlite_control_plane), b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n" + head)
    assert answer.startswith(b"HTTP/1.1 " + status + b" ")
    assert answer.endswith(b"\r\n\r\n")  # no body
    assert "Traceback" not in (sqlite_control_plane.home / "serve.log").read_text()
