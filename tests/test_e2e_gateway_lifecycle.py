"""A gateway's life beside its database and its nodes: outages, readiness, a drain.

A gateway that loses PostgreSQL keeps its live sessions, refuses what it cannot check
(UNAVAILABLE with ``retry-pushback-ms``), reconnects by itself and catches up on the
revocations it missed. SIGTERM drains: READY=1 and STOPPING=1 reach the service
manager, a renewal in flight completes, sessions end with a clean end of stream, and
the process exits 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from bcd import wire
from bcd.gatewayclient import GatewayClient
from bcd.identity import LoadedState
from bcd.keys.file import key_to_pem
from bcd.tls import connect_pinned
from bcd.transport import DialTransport
from tests.gatewaycalls import gateway_anchor
from tests.world import (
    ControlPlane,
    Forwarder,
    RunningNode,
    fleet,
    fleet_node,
    loaded,
    node_id,
    renew_body,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


def _hello(state: LoadedState) -> bytes:
    hello = wire.Hello(
        node_id=state.identity.node_id,
        journal_id="jrn_" + "a" * 26,
        boot_id="b" * 32,
        daemon_version="test",
    )
    return wire.dumps(hello.to_json())


async def _connect(cp: ControlPlane, port: int, state: LoadedState) -> GatewayClient:
    """A client whose one connection is made now (TLS as ``state``, pinned)."""
    anchor = await gateway_anchor(port, cp.pins()["serving_ca_spki_pin"])
    stream = await connect_pinned(
        "127.0.0.1",
        port,
        "127.0.0.1",
        anchor,
        client_cert=(state.identity.chain, key_to_pem(state.key)),
    )

    async def dial(host: str, port: int) -> trio.abc.Stream:
        return stream

    return GatewayClient(DialTransport(dial), host="127.0.0.1", port=port, server_name="127.0.0.1")


def _remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}").geturl()


async def test_a_gateway_that_loses_its_database_keeps_sessions_and_catches_up(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=0) as f:
        pg_port = urlsplit(f.gateway_db_url).port or 5432
        network = Forwarder(pg_port)
        f.forwarders.append(network)
        gw = f.add_gateway("gw", db_url=_via(f.gateway_db_url, network.port))
        site, pool = f.api.site_and_pool()
        node = fleet_node(f, tmp_path / "n", 11, site, pool, gw.port)
        other = fleet_node(f, tmp_path / "o", 12, site, pool, gw.port)
        run = RunningNode(node)
        try:
            wait_for(lambda: run.sessions() >= 1, 20, "a session")
            network.sever()
            async with httpx.AsyncClient(verify=False) as client:  # noqa: S501 - health only
                deadline = time.monotonic() + 15
                while (ready := await client.get(gw.url + "/readyz")).status_code == 200:
                    assert time.monotonic() < deadline, "readyz stayed 200 without a database"
                    await trio.sleep(0.2)
                assert ready.json() == {
                    "status": "unavailable",
                    "reason": "the database does not answer",
                }
            # what it cannot check now: a new session
            state = loaded(other)
            async with await _connect(f.api, gw.port, state) as client:
                answer = await client.post("/v1/session", _hello(state))
            assert answer.status == 503
            assert json.loads(answer.body)["code"] == "UNAVAILABLE"
            assert int(dict(answer.headers)["retry-pushback-ms"]) > 0
            # the live session is untouched; revoke its node meanwhile on the API
            assert run.proc.poll() is None
            assert "session lost" not in run.log()
            done = f.api.cli(
                "nodes", "revoke-identity", node_id(node), "--tenant", f.api.root_tenant
            )
            assert done.returncode == 0, done.stderr
            await trio.sleep(1.5)
            assert run.proc.poll() is None  # the gateway cannot know yet
            network.heal()
            assert await trio.to_thread.run_sync(run.proc.wait, 30) == 1
            assert "this node's certificate was revoked" in run.log()
            assert gw.proc.poll() is None
            assert "Traceback" not in gw.log()
        finally:
            run.stop()


async def test_sigterm_drains_a_gateway(tmp_path: Path, pki_template: Path) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="bc-notify-", dir="/tmp"))
    notify_path = sock_dir / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(20)
    try:
        with fleet(tmp_path, pki_template, apis=1, gateways=0) as f:
            slow = Forwarder(int(str(f.api.ready["relay_port"])), delay_s=0.4)
            f.forwarders.append(slow)
            gw = f.add_gateway(
                "gw",
                [f"https://127.0.0.1:{slow.port}"],
                env={"NOTIFY_SOCKET": str(notify_path)},
            )
            assert b"READY=1" in notify.recv(4096)
            site, pool = f.api.site_and_pool()
            node = fleet_node(f, tmp_path / "n", 13, site, pool, gw.port)
            state = loaded(node)
            session = await _connect(f.api, gw.port, state)
            opened = session.session(_hello(state), idle_timeout=30)
            lines = await opened.__aenter__()
            assert lines.status == 200
            it = aiter(lines)
            first = json.loads(await anext(it))
            assert first["type"] == "welcome"
            renewed: list[int] = []
            renewal = await _connect(f.api, gw.port, state)  # connected before the drain
            body = renew_body(state)

            async def renew() -> None:
                answer = await renewal.post("/v1/renew", body)
                renewed.append(answer.status)
                await renewal.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(renew)
                await trio.sleep(0.3)  # the renewal is in the slow relay now
                gw.proc.send_signal(signal.SIGTERM)
                rest = [line async for line in it]  # ends cleanly, no TransportError
                await opened.__aexit__(None, None, None)
                await session.aclose()
            assert rest == []
            assert renewed == [200]
            assert gw.proc.wait(40) == 0
            assert b"STOPPING=1" in notify.recv(4096)
            assert "draining" in gw.log()
    finally:
        notify.close()
        _remove(sock_dir)
