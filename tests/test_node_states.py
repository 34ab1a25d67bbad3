"""Node states and facts end to end: a real `better-compute serve` (one process, and a
gateway relaying to an API replica on PostgreSQL), a real `bcd node`, and the
operator's `better-compute nodes list|show|adopt|revoke-identity|delete`.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcd import __version__ as BCD_VERSION
from control import gatewaypki, nodefacts, relay
from control.ids import iso
from tests.gatewaycalls import node_post
from tests.world import (
    ControlPlane,
    E2EWorld,
    Node,
    RunningNode,
    fleet_node,
    leaf,
    loaded,
    node_id,
    relay_url,
    wait_for,
)

pytestmark = pytest.mark.e2e


def listed(cp: ControlPlane, nid: str) -> dict[str, Any]:
    done = cp.cli("nodes", "list", "--tenant", cp.root_tenant, "--json")
    assert done.returncode == 0, done.stderr
    (item,) = [n for n in json.loads(done.stdout)["items"] if n["id"] == nid]
    return dict(item)


def state(cp: ControlPlane, nid: str) -> Any:
    row = cp.one("SELECT state, last_seen_at FROM nodes WHERE id = ?", (nid,))
    assert row is not None
    return row


def not_after(node: Node) -> str:
    return iso(int(leaf(node).not_after.timestamp() * 1000))


async def test_a_session_adopts_the_node_and_the_operator_sees_its_facts(
    e2e: E2EWorld, tmp_path: Path
) -> None:
    cp = e2e.control_plane()
    site, pool = cp.site_and_pool()
    node = e2e.node(cp, site, seed=11)
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    nid = node_id(node)
    assert listed(cp, nid)["state"] == "adopting"
    run = RunningNode(node)
    try:
        wait_for(lambda: state(cp, nid)["state"] == "adopted", 20, "the first Hello's adoption")
        item = listed(cp, nid)
        assert item["state"] == "adopted"
        assert item["lastSeenAt"] is not None
        assert item["daemonVersion"] == BCD_VERSION
        assert item["hostname"] == "node-11"
        assert item["certificateNotAfter"] == not_after(node)
        assert item["identityGeneration"] == 1
        events = cp.events(type_="node.adopted")
        assert events == [{"type": "node.adopted", "nodeId": nid, "by": "session",
                           "serial": leaf(node).serial_hex}]  # fmt: skip

        table = cp.cli("nodes", "list", "--tenant", cp.root_tenant)
        assert table.returncode == 0, table.stderr
        header, line = table.stdout.splitlines()
        assert header.split() == ["ID", "STATE", "HOSTNAME", "VERSION", "LAST", "SEEN",
                                  "CERT", "UNTIL", "GEN"]  # fmt: skip
        assert line.split() == [nid, "adopted", "node-11", BCD_VERSION, item["lastSeenAt"],
                                item["certificateNotAfter"], "1"]  # fmt: skip
        shown = cp.cli("nodes", "show", nid, "--tenant", cp.root_tenant)
        assert shown.returncode == 0, shown.stderr
        assert f"{nid}  node  adopted  gen 1" in shown.stdout
        assert "hostname:          node-11" in shown.stdout
        assert f"daemon version:    {BCD_VERSION}" in shown.stdout
        assert f"certificate until: {item['certificateNotAfter']}" in shown.stdout

        # a node cannot report sessions itself: the gateway's front door does not know the path
        answer = await node_post(cp.gateway_port, cp.pins()["serving_ca_spki_pin"],
                                 loaded(node), nodefacts.SESSIONS_PATH,
                                 nodefacts.encode_report({leaf(node).serial_hex: "evil"}))  # fmt: skip
        assert answer.status == 404
        assert json.loads(answer.body)["code"] == "NOT_FOUND"
        assert listed(cp, nid)["daemonVersion"] == BCD_VERSION

        done = cp.cli("nodes", "revoke-identity", nid, "--tenant", cp.root_tenant)
        assert done.returncode == 0, done.stderr
        assert run.proc.wait(15) == 1
    finally:
        run.stop()
    item = listed(cp, nid)
    assert (item["state"], item["certificateNotAfter"]) == ("revoked", None)
    refused = cp.cli("nodes", "adopt", nid, "--tenant", cp.root_tenant)
    assert refused.returncode == 1
    assert "FAILED_PRECONDITION" in refused.stderr
    assert "revoked" in refused.stderr
    done = cp.cli("nodes", "delete", nid, "--tenant", cp.root_tenant)
    assert done.returncode == 0, done.stderr
    assert listed(cp, nid)["state"] == "retired"
    refused = cp.cli("nodes", "adopt", nid, "--tenant", cp.root_tenant)
    assert refused.returncode == 1
    assert "FAILED_PRECONDITION" in refused.stderr


def test_a_pool_with_acceptance_checks_waits_for_nodes_adopt(e2e: E2EWorld, tmp_path: Path) -> None:
    cp = e2e.control_plane()
    site, pool = cp.site_and_pool(policy={"acceptanceChecks": True})
    node = e2e.node(cp, site, seed=12)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    nid = node_id(node)
    run = RunningNode(node)
    try:
        wait_for(lambda: state(cp, nid)["last_seen_at"] is not None, 20, "the session's report")
        item = listed(cp, nid)
        assert item["state"] == "adopting"
        assert item["daemonVersion"] == BCD_VERSION
        assert cp.events(type_="node.adopted") == []

        done = cp.cli("nodes", "adopt", nid, "--tenant", cp.root_tenant)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"adopted {nid}"
        again = cp.cli("nodes", "adopt", nid, "--tenant", cp.root_tenant, "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == {"nodeId": nid, "state": "adopted", "changed": False}
        assert listed(cp, nid)["state"] == "adopted"
        assert cp.events(type_="node.adopted") == [
            {"type": "node.adopted", "nodeId": nid, "by": "operator"}
        ]
        audit = cp.one("SELECT count(*) AS n FROM audit WHERE action = 'node.adopted'")
        assert audit == {"n": 1}
    finally:
        run.stop()
    other, other_cred = cp.tenant("globex")
    refused = cp.cli("nodes", "adopt", nid, "--tenant", other, credential_file=other_cred)
    assert refused.returncode == 1
    assert "NOT_FOUND" in refused.stderr


def test_nodes_list_pages(e2e: E2EWorld, tmp_path: Path) -> None:
    cp = e2e.control_plane()
    site, pool = cp.site_and_pool()
    ids = []
    for seed in (21, 22, 23):
        node = e2e.node(cp, site, name=f"n{seed}", seed=seed)
        assert node.join(cp.token(pool)["token"]).returncode == 0
        ids.append(node_id(node))
    ids.sort()
    first = cp.cli("nodes", "list", "--tenant", cp.root_tenant, "--page-size", "2", "--json")
    page = json.loads(first.stdout)
    assert [n["id"] for n in page["items"]] == ids[:2]
    assert page["nextPageToken"] == ids[1]
    text = cp.cli("nodes", "list", "--tenant", cp.root_tenant, "--page-size", "2")
    assert text.stdout.splitlines()[-1] == f"more: --page-token {ids[1]}"
    rest = cp.cli("nodes", "list", "--tenant", cp.root_tenant, "--page-token", ids[1], "--json")
    assert [n["id"] for n in json.loads(rest.stdout)["items"]] == ids[2:]
    by_pool = cp.cli("nodes", "list", "--tenant", cp.root_tenant, "--pool", pool, "--json")
    assert len(json.loads(by_pool.stdout)["items"]) == 3
    for bad in (["--page-size", "0"], ["--page-size", "1001"], ["--page-token", "x"]):
        done = cp.cli("nodes", "list", "--tenant", cp.root_tenant, *bad)
        assert done.returncode == 1
        assert "INVALID_ARGUMENT" in done.stderr


@pytest.mark.postgres
async def test_a_gateway_reports_sessions_through_the_relay(e2e: E2EWorld, tmp_path: Path) -> None:
    f = e2e.fleet(apis=1, gateways=1)
    (gw,) = f.gateways
    site, pool = f.api.site_and_pool()
    node = fleet_node(f, tmp_path / "a", 31, site, pool, gw.port)
    nid = node_id(node)
    run = RunningNode(node)
    try:
        wait_for(lambda: state(f.api, nid)["state"] == "adopted", 30, "the relayed report")
        item = listed(f.api, nid)
        assert item["lastSeenAt"] is not None
        assert item["daemonVersion"] == BCD_VERSION
        assert item["certificateNotAfter"] == not_after(node)

        # through the gateway a node cannot reach the report path
        answer = await node_post(gw.port, f.api.pins()["serving_ca_spki_pin"], loaded(node),
                                 nodefacts.SESSIONS_PATH, b'{"sessions": []}')  # fmt: skip
        assert answer.status == 404
    finally:
        run.stop()
    # on the relay listener: only a relay certificate, and only a live certificate's serial
    url = relay_url(f.api) + nodefacts.SESSIONS_PATH
    bundle = gatewaypki.load_bundle(f.bundle)
    certless = ssl.create_default_context(cadata=bundle.serving_ca_pem)
    async with httpx.AsyncClient(verify=certless) as client:
        answer = await client.post(url, json={"sessions": []})
        assert (answer.status_code, answer.json()["code"]) == (401, "UNAUTHENTICATED")
    async with httpx.AsyncClient(verify=relay.client_context(bundle)) as client:
        answer = await client.post(
            url, json={"sessions": [{"daemonVersion": "x", "serials": ["ab" * 20]}]}
        )
        assert (answer.status_code, answer.json()) == (200, {"seen": 0, "adopted": 0})
        answer = await client.post(url, json={"sessions": [{"serials": ["NOT HEX"]}]})
        assert (answer.status_code, answer.json()["code"]) == (400, "INVALID_ARGUMENT")
