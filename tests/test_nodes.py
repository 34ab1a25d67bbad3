"""nodes.revokeIdentity and node deletion: in the store, over the API, through the CLI.

Nodes come from real joins (JoinService with a token) and renew through RenewService,
on SQLite and PostgreSQL; the CLI runs as a real process against `better-compute
serve`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from bcd import wire
from control import nodes, tenancy
from control.api import App
from control.errors import ControlError, Refused
from control.http import Request
from control.joinservice import JoinService
from control.pki import load_pki
from control.server import join_crypto
from tests.world import SECRET, ControlPlane
from tests.world.joins import PLUGINS, join_body, machine
from tests.world.renewals import ROOT, Env, peer_status


def revoked_events(env: Env, tenant: str | None = None) -> list[dict[str, Any]]:
    return [e["payload"] for e in env.events(tenant or env.tenant, "security.certificate-revoked")]


# --- revokeIdentity -------------------------------------------------------------------


def test_revoke_identity_revokes_every_live_certificate_once(env: Env) -> None:
    node = env.join(1)
    renewed = env.renew(node)
    bystander = env.join(2)
    with env.store.tx() as tx:
        got = nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign, "key compromised")
    assert got == {
        "nodeId": node.node_id,
        "reason": "key compromised",
        "revoked": sorted([node.serial, renewed.serial]),
    }
    rows = env.rows(
        "SELECT serial, revoked_at, revoke_reason FROM node_certs WHERE node_id = ?",
        (node.node_id,),
    )
    assert len(rows) == 2
    assert all(r["revoked_at"] is not None for r in rows)
    assert {r["revoke_reason"] for r in rows} == {"key compromised"}
    assert sorted(revoked_events(env), key=lambda p: p["serial"]) == sorted(
        [
            {"nodeId": node.node_id, "serial": s, "reason": "key compromised"}
            for s in (node.serial, renewed.serial)
        ],
        key=lambda p: p["serial"],
    )
    (audit,) = env.rows("SELECT * FROM audit WHERE action = 'node.identity-revoked'")
    assert (audit["tenant_id"], audit["subject"]) == (env.tenant, node.node_id)
    assert json.loads(audit["payload"])["serials"] == got["revoked"]
    # the node keeps its row; the bystander keeps its certificate
    (row,) = env.rows("SELECT state, retired_at FROM nodes WHERE id = ?", (node.node_id,))
    assert row["retired_at"] is None
    with env.store.tx() as tx:
        assert peer_status(tx, bystander.der) == (bystander.node_id, bystander.serial)
        assert peer_status(tx, renewed.der) is None

    # idempotent: nothing left to revoke, no event, no audit row
    with env.store.tx() as tx:
        again = nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign, "key compromised")
    assert again["revoked"] == []
    assert len(revoked_events(env)) == 2
    assert len(env.rows("SELECT * FROM audit WHERE action = 'node.identity-revoked'")) == 1


def test_revoked_identity_cannot_renew_and_only_a_reclaim_brings_the_machine_back(
    env: Env,
) -> None:
    node = env.join(3)
    with env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
    env.refused(env.body(node), node.der, "leaf-revoked", routed_to=ROOT, node=node)
    # a plain token is refused (reclaim); an allowReclaim token reclaims the node
    with pytest.raises(Refused):
        env.join(3)
    back = env.join(3, allow_reclaim=True)
    assert back.node_id == node.node_id
    (gen,) = env.rows("SELECT identity_generation FROM nodes WHERE id = ?", (node.node_id,))
    assert gen["identity_generation"] == 2
    env.renew(back)
    # the old certificate stays dead, even were its revocation undone
    env.sql("UPDATE node_certs SET revoked_at = NULL WHERE serial = ?", (node.serial,))
    env.refused(env.body(node), node.der, "generation", routed_to=ROOT, node=node)


def test_revoke_identity_of_another_tenants_node_is_not_found(env: Env) -> None:
    node = env.join(4)
    with env.store.tx() as tx:
        other, _ = tenancy.create_tenant(tx, "globex")
    for tenant in (other, env.root):
        with pytest.raises(ControlError) as info, env.store.tx() as tx:
            nodes.revoke_identity(tx, tenant, node.node_id, env.sign)
        assert info.value.code == "NOT_FOUND"
    with pytest.raises(ControlError) as info, env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, "node_" + "0" * 26, env.sign)
    assert info.value.code == "NOT_FOUND"
    assert revoked_events(env) == []


@pytest.mark.parametrize("reason", ["", "x" * 201, "tab\there", "é"])
def test_revoke_identity_reason_is_short_printable_text(env: Env, reason: str) -> None:
    node = env.join(5)
    with pytest.raises(ControlError) as info, env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign, reason)
    assert info.value.code == "INVALID_ARGUMENT"


# --- deletion -------------------------------------------------------------------------


def test_delete_retires_revokes_and_lets_the_machine_join_again_as_a_new_node(
    env: Env,
) -> None:
    node = env.join(6)
    renewed = env.renew(node)
    with env.store.tx() as tx:
        got = nodes.delete_node(tx, env.tenant, node.node_id, env.sign)
    assert got == {
        "nodeId": node.node_id,
        "state": "retired",
        "revoked": sorted([node.serial, renewed.serial]),
    }
    (row,) = env.rows("SELECT * FROM nodes WHERE id = ?", (node.node_id,))
    assert row["state"] == "retired"
    assert row["retired_at"] is not None
    assert row["hardware_key"] is not None  # kept for the record
    assert row["hardware_key_trusted"] == 0  # out of the unique index
    certs = env.rows("SELECT revoke_reason FROM node_certs WHERE node_id = ?", (node.node_id,))
    assert [c["revoke_reason"] for c in certs] == ["deleted", "deleted"]
    assert {(p["serial"], p["reason"]) for p in revoked_events(env)} == {
        (node.serial, "deleted"),
        (renewed.serial, "deleted"),
    }
    (audit,) = env.rows("SELECT * FROM audit WHERE action = 'node.deleted'")
    assert audit["subject"] == node.node_id
    env.refused(env.body(renewed), renewed.der, "leaf-revoked", routed_to=ROOT, node=renewed)
    with env.store.tx() as tx:
        assert peer_status(tx, renewed.der) is None

    # the same machine joins again, with a plain token, as a new node
    fresh = env.join(6)
    assert fresh.node_id != node.node_id
    (new,) = env.rows("SELECT * FROM nodes WHERE id = ?", (fresh.node_id,))
    assert (new["state"], new["identity_generation"], new["hardware_key_trusted"]) == (
        "adopting",
        1,
        1,
    )
    assert new["hardware_key"] == row["hardware_key"]
    (joined,) = [
        e["payload"]
        for e in env.events(env.tenant, "node.joined")
        if e["payload"]["nodeId"] == fresh.node_id
    ]
    assert joined["reclaim"] is False
    env.renew(fresh)

    # deleting again changes nothing
    with env.store.tx() as tx:
        again = nodes.delete_node(tx, env.tenant, node.node_id, env.sign)
    assert again == {"nodeId": node.node_id, "state": "retired", "revoked": []}
    assert len(revoked_events(env)) == 2
    assert len(env.rows("SELECT * FROM audit WHERE action = 'node.deleted'")) == 1


def test_a_deleted_node_is_never_reclaimed(env: Env) -> None:
    node = env.join(7)
    with env.store.tx() as tx:
        nodes.delete_node(tx, env.tenant, node.node_id, env.sign)
    fresh = env.join(7, allow_reclaim=True)
    assert fresh.node_id != node.node_id
    attempt = join_body(
        env.mint(allow_reclaim=True),
        env.pki.join_encryption_key.public_key(),
        machine(7),
        node_id=node.node_id,
    )
    with pytest.raises(ControlError) as info:
        env.joins.join(attempt.body)
    assert info.value.code == "ACCESS_DENIED"


def test_delete_of_another_tenants_node_is_not_found(env: Env) -> None:
    node = env.join(8)
    with env.store.tx() as tx:
        other, _ = tenancy.create_tenant(tx, "globex")
    with pytest.raises(ControlError) as info, env.store.tx() as tx:
        nodes.delete_node(tx, other, node.node_id, env.sign)
    assert info.value.code == "NOT_FOUND"
    (row,) = env.rows("SELECT state, retired_at FROM nodes")
    assert row["retired_at"] is None


# --- the API, in process ----------------------------------------------------------------


async def call(
    app: App, method: str, path: str, credential: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    req = Request(
        method=method,
        path="/api/compute" + path,
        query={},
        headers={"authorization": f"Bearer {credential}"},
        body=json.dumps(body).encode() if body is not None else b"",
        peer_cert_der=None,
        remote="127.0.0.1:1",
    )
    resp = await app.api(req)
    return resp.status, json.loads(resp.body)


async def test_api_revoke_identity_and_delete(env: Env) -> None:
    pokes: list[bool] = []
    app = App(
        store=env.store,
        well_known_join=None,
        gateway=None,
        limiter=trio.CapacityLimiter(4),
        on_revocation=lambda: pokes.append(True),
        sign_notice=env.sign,
    )
    node = await trio.to_thread.run_sync(env.join, 9)
    with env.store.tx() as tx:
        other, other_cred = tenancy.create_tenant(tx, "globex")
    base = f"/v1/tenants/{env.tenant}/nodes/{node.node_id}"

    # another tenant: its own path is NOT_FOUND, the owner's path too
    for path, cred in (
        (f"/v1/tenants/{other}/nodes/{node.node_id}", other_cred),
        (base, other_cred),
        (f"/v1/tenants/{env.root}/nodes/{node.node_id}", env.root_credential),
    ):
        status, got = await call(app, "POST", path + "/revoke-identity", cred, {})
        assert (status, got["code"]) == (404, "NOT_FOUND")
        status, got = await call(app, "DELETE", path, cred)
        assert (status, got["code"]) == (404, "NOT_FOUND")
    assert revoked_events(env) == []

    status, got = await call(
        app, "POST", base + "/revoke-identity", env.tenant_credential, {"reason": "stolen"}
    )
    assert status == 200
    assert got == {"nodeId": node.node_id, "reason": "stolen", "revoked": [node.serial]}
    assert pokes == [True]  # the gateway is told at once
    status, got = await call(app, "POST", base + "/revoke-identity", env.tenant_credential)
    assert (status, got["revoked"], got["reason"]) == (200, [], "revoked")
    status, got = await call(
        app, "POST", base + "/revoke-identity", env.tenant_credential, {"reason": 7}
    )
    assert (status, got["code"]) == (400, "INVALID_ARGUMENT")

    status, got = await call(app, "DELETE", base, env.tenant_credential)
    assert (status, got) == (200, {"nodeId": node.node_id, "state": "retired", "revoked": []})
    status, got = await call(app, "GET", base, env.tenant_credential)
    assert (status, got["state"]) == (200, "retired")
    status, got = await call(
        app, "DELETE", f"/v1/tenants/{env.tenant}/nodes/node_bad", env.tenant_credential
    )
    assert (status, got["code"]) == (404, "NOT_FOUND")


# --- the CLI, as a real process -----------------------------------------------------------


@pytest.mark.e2e
def test_cli_nodes_revoke_identity_and_delete(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    loaded = load_pki(cp.home / "pki", SECRET.encode())
    svc = JoinService(cp.store, join_crypto(loaded), PLUGINS)
    token = cp.token(pool)["token"]
    attempt = join_body(token, loaded.join_encryption_key.public_key(), machine(1))
    joined = wire.verify_response(svc.join(attempt.body), loaded.pins()["join_signing_key_pin"])
    node_id = joined["node_id"]
    other, other_cred = cp.tenant("globex")

    for verb in (("revoke-identity",), ("delete",)):
        for tenant, cred in ((other, other_cred), (cp.root_tenant, other_cred)):
            done = cp.cli("nodes", *verb, node_id, "--tenant", tenant, credential_file=cred)
            assert done.returncode == 1, done.stdout + done.stderr
            assert "NOT_FOUND" in done.stderr
    bad = cp.cli("nodes", "delete", "node_../x", "--tenant", cp.root_tenant)
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT" in bad.stderr

    done = cp.cli(
        "nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant, "--reason", "stolen"
    )
    assert done.returncode == 0, done.stderr
    assert f"revoked 1 certificate(s) of {node_id}" in done.stdout
    done = cp.cli("nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"nodeId": node_id, "reason": "revoked", "revoked": []}
    revoked = cp.events(type_="security.certificate-revoked")
    assert [(e["nodeId"], e["reason"]) for e in revoked] == [(node_id, "stolen")]

    done = cp.cli("nodes", "delete", node_id, "--tenant", cp.root_tenant, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"nodeId": node_id, "state": "retired", "revoked": []}
    shown = cp.cli("nodes", "show", node_id, "--tenant", cp.root_tenant, "--json")
    assert json.loads(shown.stdout)["state"] == "retired"
    done = cp.cli("nodes", "delete", node_id, "--tenant", cp.root_tenant)
    assert done.returncode == 0, done.stderr
    assert f"deleted {node_id} (0 certificate(s) revoked)" in done.stdout
