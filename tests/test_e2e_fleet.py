"""The fleet shape with real processes on PostgreSQL: API replicas, gateways that relay.

Nodes join through either gateway and renew through the other; a revocation made
on an API replica reaches a session on either gateway; a gateway killed with
SIGKILL loses its nodes to the other one (the tests' load balancer is a TCP
forwarder switched to the survivor); an API replica killed with SIGKILL moves the
relay to the next upstream; the renewal limit and the proof replay window hold
across gateways and replicas.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import trio

from bcd.identity import LoadedState
from tests.gatewaycalls import node_post
from tests.world import (
    BIN,
    ControlPlane,
    Forwarder,
    Node,
    RunningNode,
    cli_env,
    fleet,
    fleet_node,
    loaded,
    node_id,
    relay_url,
    renew_body,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


def environ_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


async def renew_at(
    cp: ControlPlane, port: int, state: LoadedState, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    resp = await node_post(port, cp.pins()["serving_ca_spki_pin"], state, "/v1/renew", body)
    return resp.status, dict(resp.headers), resp.body


async def test_join_through_one_gateway_renew_through_the_other_revoke_on_either(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=2) as f:
        gw1, gw2 = f.gateways
        # the gateways hold no secret and no PKI
        for gw in f.gateways:
            assert b"BETTER_COMPUTE_SECRET" not in environ_of(gw.proc.pid)
            assert not (gw.home / "pki").exists()
        site, pool = f.api.site_and_pool()
        a = fleet_node(f, tmp_path / "a", 1, site, pool, gw1.port)
        b = fleet_node(f, tmp_path / "b", 2, site, pool, gw2.port)
        for node, other in ((a, gw2), (b, gw1)):
            state = loaded(node)
            status, _h, body = await renew_at(f.api, other.port, state, renew_body(state))
            assert status == 200, body
        runs = [RunningNode(a), RunningNode(b)]
        try:
            for run in runs:
                wait_for(lambda run=run: run.sessions() >= 1, 20, "a session")
            assert node_id(a) in gw1.log()
            assert node_id(b) in gw2.log()
            for node in (a, b):
                done = f.api.cli("nodes", "revoke-identity", node_id(node),
                                 "--tenant", f.api.root_tenant)  # fmt: skip
                assert done.returncode == 0, done.stderr
            for run in runs:
                assert run.proc.wait(10) == 1
                assert "this node's certificate was revoked" in run.log()
        finally:
            for run in runs:
                run.stop()


async def test_a_killed_gateway_s_nodes_hold_a_session_through_the_other(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=2) as f:
        gw1, gw2 = f.gateways
        balancer = Forwarder(gw1.port)
        f.forwarders.append(balancer)
        site, pool = f.api.site_and_pool()
        node = fleet_node(f, tmp_path / "n", 3, site, pool, balancer.port)
        run = RunningNode(node)
        try:
            wait_for(lambda: run.sessions() >= 1, 20, "the first session")
            assert node_id(node) in gw1.log()
            gw1.kill()  # kill -9
            balancer.switch(gw2.port)
            wait_for(lambda: run.sessions() >= 2, 30, "a session through the other gateway")
            assert node_id(node) in gw2.log()
            assert run.proc.poll() is None
        finally:
            run.stop()


async def test_a_killed_api_replica_moves_the_relay_to_the_next(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=2, gateways=1) as f:
        (gw,) = f.gateways
        site, pool = f.api.site_and_pool()
        fleet_node(f, tmp_path / "a", 4, site, pool, gw.port)
        first = f.apis[0]
        first.proc.kill()  # kill -9 the upstream the relay prefers
        first.proc.wait(10)
        token = f.apis[1].token(pool)["token"]
        node = Node.make(tmp_path / "b", f.apis[1], site, seed=5, gateway_port=gw.port)
        done = node.join(token)
        assert done.returncode == 0, done.stderr
        assert f"relay to {relay_url(first)}" in gw.log()
        row = f.apis[1].one("SELECT count(*) AS n FROM nodes")
        assert row is not None
        assert row["n"] == 2


async def test_renewal_limit_and_proof_replay_hold_across_gateways_and_replicas(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=2, gateways=0) as f:
        api1, api2 = f.apis
        gw1 = f.add_gateway("gw1", [relay_url(api1)])
        gw2 = f.add_gateway("gw2", [relay_url(api2)])
        site, pool = api1.site_and_pool()
        node = fleet_node(f, tmp_path / "n", 6, site, pool, gw1.port)
        state = loaded(node)
        body = renew_body(state)
        status, _h, answer = await renew_at(api1, gw1.port, state, body)
        assert status == 200, answer
        # the same proof through the other gateway and the other replica: a replay
        status, _h, answer = await renew_at(api1, gw2.port, state, body)
        assert status == 403
        assert json.loads(answer) == {"code": "ACCESS_DENIED", "message": "Renew refused"}
        reasons = [e["reason"] for e in api1.events(type_="security.renew.refused")]
        assert reasons == ["pop-replay"]
        # five more renewals alternating gateways and replicas: six in the hour
        for i in range(5):
            port = (gw2, gw1)[i % 2].port
            status, _h, answer = await renew_at(api1, port, state, renew_body(state))
            assert status == 200, answer
        status, headers, answer = await renew_at(api1, gw2.port, state, renew_body(state))
        assert status == 429, answer
        assert json.loads(answer)["code"] == "RESOURCE_EXHAUSTED"
        assert int(headers["retry-pushback-ms"]) > 0


async def test_health_endpoints_of_every_role(tmp_path: Path, pki_template: Path) -> None:
    import httpx

    with fleet(tmp_path, pki_template, apis=1, gateways=1) as f:
        (gw,) = f.gateways
        api = f.api
        async with httpx.AsyncClient(verify=False) as client:  # noqa: S501 - reading health only
            for base in (api.api, relay_url(api), gw.url):
                for path in ("/healthz", "/readyz"):
                    answer = await client.get(base + path)
                    assert answer.status_code == 200, (base, path, answer.text)
                    assert answer.json()["status"] == "ok"
            api.proc.kill()  # the gateway's only upstream is gone
            api.proc.wait(10)
            deadline = time.monotonic() + 5  # readiness is asked at most once a second
            while (answer := await client.get(gw.url + "/readyz")).status_code == 200:
                assert time.monotonic() < deadline, "readyz still 200 without an upstream"
                await trio.sleep(0.2)
            assert answer.status_code == 503
            assert answer.json() == {"status": "unavailable", "reason": "no API upstream answers"}
            assert (await client.get(gw.url + "/healthz")).status_code == 200


def test_a_gateway_refuses_the_secret_and_a_login_outside_its_role(
    tmp_path: Path, pki_template: Path
) -> None:
    import secrets as pysecrets

    import psycopg

    from tests.world import PG_URL, SECRET, drop_login, pg_schema_url, run

    with fleet(tmp_path, pki_template, apis=1, gateways=0) as f:
        base = [
            str(BIN / "better-compute"), "serve", "--role", "gateway", "--gateway-listen",
            "127.0.0.1:0", "--gateway-dir", str(f.bundle), "--api-upstream", relay_url(f.api),
        ]  # fmt: skip
        with_secret = {**cli_env(tmp_path, secret=False), "BETTER_COMPUTE_SECRET": SECRET}
        done = run([*base, "--db", f.gateway_db_url], env=with_secret)
        assert done.returncode == 1
        assert "a gateway holds no PKI key: unset BETTER_COMPUTE_SECRET" in done.stderr
        assert SECRET not in done.stderr
        done = run([*base], env=cli_env(tmp_path, secret=False))
        assert done.returncode != 0
        assert "--role gateway needs --db postgresql://" in done.stderr
        done = run([*base, "--db", f.gateway_db_url, "--downloads", "/tmp"],
                   env=cli_env(tmp_path, secret=False))  # fmt: skip
        assert done.returncode == 2
        assert "--downloads is for --role api or all" in done.stderr
        with_path = [*base, "--api-upstream", relay_url(f.api) + "/prefix"]
        done = run([*with_path, "--db", f.gateway_db_url], env=cli_env(tmp_path, secret=False))
        assert done.returncode == 1  # the relay would not send a path: refused, not dropped
        assert "INVALID_CONFIG: not an upstream URL" in done.stderr
        assert "Traceback" not in done.stderr
        done = run([*base, "--db", pg_schema_url(f.schema)], env=cli_env(tmp_path, secret=False))
        assert done.returncode == 1  # the owner's login can write: not a gateway's
        assert "can write admission tables" in done.stderr
        outsider = f"out_{pysecrets.token_hex(4)}"
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {outsider} LOGIN")
        url = pg_schema_url(f.schema, outsider)
        try:
            done = run([*base, "--db", url], env=cli_env(tmp_path, secret=False))
            assert done.returncode == 1
            assert "cannot read schema_migrations" in done.stderr
            assert "Traceback" not in done.stderr
        finally:
            drop_login(url)
