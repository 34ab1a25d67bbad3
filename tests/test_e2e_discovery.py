"""End to end, discovery: a real `better-compute serve` with `--discovery-pool`, a site
agent joined with `bcd join --role site` vouching with `bcd vouch`, and machines that
join with `bcd join --attestor discovery` and no token: one waits, is approved with
`better-compute join-requests approve` and joins; one is rejected; an approval is
used twice at the real gateway; a machine nobody vouched for is refused."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from bcd import pki, wire
from tests.world import (
    BIN,
    JOINED,
    ControlPlane,
    E2EWorld,
    Node,
    cli_env,
    post_join,
    post_join_raw,
    root_site_store,
    run,
)

pytestmark = pytest.mark.e2e
EPOCH = 1_764_400_000


def _mac(node: Node) -> str:
    return (node.sysfs / "sys" / "class" / "net" / "eth0" / "address").read_text().strip()


def _start(e2e: E2EWorld, gateway_url: str | None = None) -> tuple[ControlPlane, str, str, str]:
    db_url, site, (agents, pool) = root_site_store(
        e2e.tmp,
        "dc-1",
        ("site-agents", {}),
        ("discovered", {"joinAttestors": ["discovery"]}),
    )
    cp = e2e.control_plane(
        db_url,
        extra_args=[
            "--discovery-pool",
            pool,
            "--attestor-setting",
            "discovery.allowed_kinds=inventory.read,deploy.*",
            "--attestor-setting",
            "discovery.match_ip=true",
        ],
        gateway_url=gateway_url,
    )
    return cp, site, agents, pool


def _request_of(cp: ControlPlane, agent: subprocess.Popen[str], mac: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        assert agent.poll() is None, agent.communicate()
        assert time.monotonic() < deadline, "no join request was recorded"
        row = cp.one("SELECT * FROM join_requests WHERE mac = ?", (mac,))
        if row is not None:
            return row
        time.sleep(0.1)


def test_discovered_machines_wait_are_decided_and_join(tmp_path: Path, e2e: E2EWorld) -> None:
    cp, site, agents, pool = _start(e2e)
    waiting: list[subprocess.Popen[str]] = []
    try:
        tenant = cp.root_tenant
        # the site agent joins with a site token
        site_token = cp.token(agents, role="site")["token"]
        site_agent = Node.make(tmp_path / "site-agent", cp, site, seed=1)
        done = site_agent.join(site_token, "--role", "site")
        assert done.returncode == 0, done.stderr
        assert "role site" in done.stdout

        # a machine nobody vouched for is refused with the uniform answer
        stranger = Node.make(tmp_path / "stranger", cp, site, seed=9, write_jwk=False)
        refused = stranger.join(None, "--attestor", "discovery")
        assert refused.returncode != 0
        assert "Join refused" in refused.stderr
        reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
        assert "discovery:not-vouched" in reasons

        # the site agent vouches for the machine that booted
        machine = Node.make(tmp_path / "m1", cp, site, seed=2, write_jwk=False)
        vouched = site_agent.bcd(
            "vouch", "--mac", _mac(machine), "--boot-lease-epoch", str(EPOCH),
            "--ip", "127.0.0.1", "--workflow-id", "pxe-42",
        )  # fmt: skip
        assert vouched.returncode == 0, vouched.stderr
        assert vouched.stdout.startswith(f"vouched for {_mac(machine)} on site {site}")
        bad = site_agent.bcd("vouch", "--mac", "not-a-mac", "--boot-lease-epoch", "1")
        assert bad.returncode == 2
        assert "is not a permanent, globally administered unicast MAC" in bad.stderr
        older = site_agent.bcd("vouch", "--mac", _mac(machine), "--boot-lease-epoch", "5")
        assert older.returncode != 0
        assert "a newer boot" in older.stderr

        # with discovery.match_ip, a join from another address than the vouched one fails
        elsewhere = Node.make(tmp_path / "m4", cp, site, seed=4, write_jwk=False)
        vouched = site_agent.bcd(
            "vouch", "--mac", _mac(elsewhere), "--boot-lease-epoch", "3", "--ip", "10.9.9.9"
        )
        assert vouched.returncode == 0, vouched.stderr
        done = elsewhere.join(None, "--attestor", "discovery")
        assert done.returncode == 1
        assert "Join refused" in done.stderr
        reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
        assert "discovery:ip-mismatch" in reasons

        # it waits on its join request
        agent = machine.spawn_join("--attestor", "discovery")
        waiting.append(agent)
        row = _request_of(cp, agent, _mac(machine))
        assert (row["state"], row["attestor"], row["pool_id"]) == ("pending", "discovery", pool)
        listed = cp.cli("join-requests", "list", "--tenant", tenant, "--pool", pool, "--json")
        assert listed.returncode == 0, listed.stderr
        (item,) = json.loads(listed.stdout)["items"]
        site_agent_id = json.loads((site_agent.data_dir / "identity.json").read_text())["node_id"]
        assert (item["vouchedBy"], item["bootLeaseEpoch"]) == (site_agent_id, EPOCH)
        assert (item["mac"], item["ip"], item["workflowId"]) == (
            _mac(machine),
            "127.0.0.1",
            "pxe-42",
        )
        assert cp.one("SELECT COUNT(*) AS n FROM nodes WHERE pool_id = ?", (pool,)) == {"n": 0}

        approved = cp.cli(
            "join-requests", "approve", row["id"], "--tenant", tenant, "--pool", pool,
            "--ttl", "600", "--reason", "rack B7 intake", "--csr-sha256", "0" * 64,
        )  # fmt: skip
        assert approved.returncode == 1
        assert "changed since it was listed" in approved.stderr
        approved = cp.cli(
            "join-requests", "approve", row["id"], "--tenant", tenant, "--pool", pool,
            "--ttl", "600", "--reason", "rack B7 intake", "--csr-sha256", item["csrSha256"],
        )  # fmt: skip
        assert approved.returncode == 0, approved.stderr
        out, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err
        assert f"waiting for approval of join request {row['id']}" in out
        m = JOINED.match(out.strip().splitlines()[-1])
        assert m, out
        node_id = m.group(1)
        shown = cp.cli("nodes", "show", node_id, "--tenant", tenant, "--json")
        assert shown.returncode == 0, shown.stderr
        node = json.loads(shown.stdout)
        assert (node["poolId"], node["role"]) == (pool, "node")
        assert node["certificates"][0]["allowedKinds"] == ["inventory.read", "deploy.*"]
        text = cp.cli("nodes", "show", node_id, "--tenant", tenant)
        assert "allowed kinds: inventory.read, deploy.*" in text.stdout
        doctor = machine.bcd("doctor")
        assert doctor.returncode == 0, doctor.stdout

        # a second machine is rejected: its waiting join fails with the uniform refusal
        other = Node.make(tmp_path / "m2", cp, site, seed=3, write_jwk=False)
        assert (
            site_agent.bcd(
                "vouch", "--mac", _mac(other), "--boot-lease-epoch", "7", "--ip", "127.0.0.1"
            ).returncode
            == 0
        )
        agent2 = other.spawn_join("--attestor", "discovery")
        waiting.append(agent2)
        row2 = _request_of(cp, agent2, _mac(other))
        rejected = cp.cli(
            "join-requests", "reject", row2["id"], "--tenant", tenant, "--pool", pool,
            "--reason", "unknown serial",
        )  # fmt: skip
        assert rejected.returncode == 0, rejected.stderr
        _, err2 = agent2.communicate(timeout=60)
        assert agent2.returncode == 1, err2
        assert "Join refused" in err2
        assert not (other.data_dir / "identity.json").exists()
        reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
        assert "discovery:request-rejected" in reasons
        (decision,) = cp.events(type_="security.join-request.rejected")
        assert decision["reason"] == "unknown serial"
    finally:
        for proc in waiting:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_approval_is_used_once_at_the_real_gateway(tmp_path: Path, e2e: E2EWorld) -> None:
    cp, site, agents, pool = _start(e2e)
    site_agent = Node.make(tmp_path / "site-agent", cp, site, seed=1)
    assert site_agent.join(cp.token(agents, role="site")["token"], "--role", "site").returncode == 0
    claims = wire.Claims(
        product_uuid="4c4c4544-0042-3510-8052-b4c04f4d3799",
        product_serial="SN-DISC-1",
        macs=("00:1b:21:aa:bb:99",),
    )
    assert (
        site_agent.bcd(
            "vouch",
            "--mac",
            claims.macs[0],
            "--boot-lease-epoch",
            str(EPOCH),
            "--ip",
            "127.0.0.1",
        ).returncode
        == 0
    )
    key = pki.generate_key()
    body = wire.dumps(
        wire.JoinRequest(
            role="node", attestor="discovery", sealed_token=None,
            csr_der=pki.make_csr(key), claims=claims, evidence={}, node_id=None,
            daemon_version="test",
        ).to_json()
    )  # fmt: skip
    signing_pin = cp.pins()["join_signing_key_pin"]

    pending = wire.verify_response(trio.run(_post_raw, cp, body), signing_pin)
    assert pending["kind"] == "pending"
    row = cp.one("SELECT id FROM join_requests")
    assert row is not None
    assert pending["request_id"] == row["id"]
    approved = cp.cli(
        "join-requests", "approve", row["id"], "--tenant", cp.root_tenant, "--pool", pool
    )
    assert approved.returncode == 0, approved.stderr

    first = trio.run(_post_raw, cp, body)
    joined = wire.verify_response(first, signing_pin)
    assert joined["kind"] == "joined"
    # within minutes the same request is a lost answer: the same identity, nothing new
    again = wire.verify_response(trio.run(_post_raw, cp, body), signing_pin)
    assert (again["node_id"], again["chain"]) == (joined["node_id"], joined["chain"])
    assert cp.one("SELECT COUNT(*) AS n FROM node_certs") == {"n": 2}  # agent + machine
    with cp.store.tx() as tx:
        tx.execute("UPDATE node_certs SET created_at = created_at - 600001")
    status, second = trio.run(post_join, cp, body)
    assert (status, second) == (403, {"code": "ACCESS_DENIED", "message": "Join refused"})
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert "discovery:request-consumed" in reasons
    assert cp.one("SELECT COUNT(*) AS n FROM nodes WHERE pool_id = ?", (pool,)) == {"n": 1}


async def _post_raw(cp: ControlPlane, body: bytes) -> str:
    status, raw = await post_join_raw(cp, body)
    assert status == 200, raw
    return raw.decode("ascii")


def test_a_pxe_machine_without_config_joins_from_the_well_known_document(
    tmp_path: Path, e2e: E2EWorld
) -> None:
    """A PXE-booted machine has only the three pins (from its boot image): ``bcd join
    --server … --attestor discovery`` builds config.toml from the well-known document."""
    cp, site, agents, pool = _start(e2e, "https://127.0.0.1:{port}")
    agent: subprocess.Popen[str] | None = None
    try:
        site_agent = Node.make(tmp_path / "site-agent", cp, site, seed=1)
        assert (
            site_agent.join(cp.token(agents, role="site")["token"], "--role", "site").returncode
            == 0
        )
        machine = Node.make(tmp_path / "pxe", cp, site, seed=5, write_jwk=False)
        assert (
            site_agent.bcd(
                "vouch", "--mac", _mac(machine), "--boot-lease-epoch", "11", "--ip", "127.0.0.1"
            ).returncode
            == 0
        )
        pins = cp.pins()
        config = tmp_path / "pxe-etc" / "config.toml"
        data = tmp_path / "pxe-data"
        agent = subprocess.Popen(
            [
                str(BIN / "bcd"), "join", "--attestor", "discovery", "--config", str(config),
                "--server", cp.api, "--data-dir", str(data), "--sysfs-root", str(machine.sysfs),
                "--serving-ca-pin", pins["serving_ca_spki_pin"],
                "--join-signing-pin", pins["join_signing_key_pin"],
                "--join-encryption-pin", pins["join_encryption_key_pin"],
            ],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=cli_env(machine.root, secret=False),
        )  # fmt: skip
        row = _request_of(cp, agent, _mac(machine))
        approved = cp.cli(
            "join-requests", "approve", row["id"], "--tenant", cp.root_tenant, "--pool", pool
        )
        assert approved.returncode == 0, approved.stderr
        out, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err
        assert JOINED.match(out.strip().splitlines()[-1]), out
        written = config.read_text()
        assert f'site = "{site}"' in written
        assert f'gateway_url = "https://127.0.0.1:{cp.gateway_port}"' in written
        jwk = json.loads((config.parent / "join-encryption.jwk").read_text())
        assert jwk == cp.well_known()["join"]["encryptionJwk"]
        doctor = run([str(BIN / "bcd"), "doctor", "--config", str(config)])
        assert doctor.returncode == 0, doctor.stdout
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
