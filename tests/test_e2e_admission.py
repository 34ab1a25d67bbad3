"""End to end, admission rules with real `better-compute serve` and `bcd join` processes:
a placeholder machine admitted with an expect binding, the pool attestor policy, and
hosted tokens (a node-tenant certificate, the platform-operated exception, and a
hosted reclaim lowering a platform node)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from bcd import pki
from control.simulate import make_machine
from tests.world import REFUSED_LINE, ControlPlane, Node

pytestmark = pytest.mark.e2e


def _role_of(node: Node) -> tuple[str, str]:
    """(role in identity.json, the leaf's OU)."""
    ident = json.loads((node.data_dir / "identity.json").read_text())
    leaf: x509.Certificate = pki.load_pem_chain(ident["chain"])[0]
    (ou,) = leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return ident["role"], str(ou.value)


def _placeholder(node: Node) -> None:
    make_machine(
        node.sysfs,
        product_uuid="00000000-0000-0000-0000-000000000000",
        product_serial="To Be Filled By O.E.M.",
        macs=["00:1b:21:aa:bb:cc"],
    )


def test_a_placeholder_machine_joins_only_with_an_expect_binding(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "m", cp, site, seed=1)
    _placeholder(node)

    refused = node.join(cp.token(pool)["token"])
    assert (refused.returncode, refused.stderr) == (1, REFUSED_LINE)
    assert not (node.data_dir / "identity.json").exists()

    bound = cp.token(pool, expect={"mac": "00:1b:21:aa:bb:cc"})["token"]
    done = node.join(bound)
    assert done.returncode == 0, done.stderr
    ident = json.loads((node.data_dir / "identity.json").read_text())
    row = cp.one("SELECT hardware_key_trusted FROM nodes WHERE id = ?", (ident["node_id"],))
    assert row == {"hardware_key_trusted": 0}  # joined, with an untrusted key
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == ["join-token:placeholder-hardware"]


def test_the_pool_attestor_policy_admits_listed_attestors_only(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, tokens_ok = cp.site_and_pool(policy={"joinAttestors": ["join-token", "tpm"]})
    _s, tpm_only = cp.site_and_pool(policy={"joinAttestors": ["tpm"]})

    admitted = Node.make(tmp_path / "a", cp, site, seed=1)
    assert admitted.join(cp.token(tokens_ok)["token"]).returncode == 0
    refused = Node.make(tmp_path / "b", cp, site, seed=2)
    done = refused.join(cp.token(tpm_only)["token"])
    assert (done.returncode, done.stderr) == (1, REFUSED_LINE)
    assert cp.one("SELECT uses_left FROM join_tokens WHERE pool_id = ?", (tpm_only,)) == {
        "uses_left": 1
    }  # a refused join spends nothing
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == ["join-token:pool-attestor"]


def test_hosted_tokens_make_node_tenant_certificates_unless_platform_operated(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    kube = {"kubernetes": {"platformOperated": True}}
    # the platform's own pool, marked platform-operated: a hosted token makes a node
    site, platform_pool = cp.site_and_pool(policy=kube)
    platform = Node.make(tmp_path / "platform", cp, site, seed=1)
    done = platform.join(cp.token(platform_pool, hosted="kubernetes")["token"])
    assert done.returncode == 0, done.stderr
    assert _role_of(platform) == ("node", "bc-role:node")

    # a tenant's pool that claims platformOperated: the tenant cannot vouch for its
    # own cluster by editing its pool's policy, so the certificate is node-tenant
    tenant, cred = cp.tenant("acme")
    tsite, tenant_pool = cp.site_and_pool(tenant, cred, policy=kube)
    hosted = Node.make(tmp_path / "tenant", cp, tsite, seed=2)
    token = cp.token(tenant_pool, tenant, cred, hosted="kubernetes")["token"]
    done = hosted.join(token)
    assert done.returncode == 0, done.stderr
    assert "role node-tenant" in done.stdout
    assert _role_of(hosted) == ("node-tenant", "bc-role:node-tenant")

    # the same machine's own (non-hosted) token in the tenant's pool: a plain node
    plain = Node.make(tmp_path / "plain", cp, tsite, seed=3)
    assert plain.join(cp.token(tenant_pool, tenant, cred)["token"]).returncode == 0
    assert _role_of(plain) == ("node", "bc-role:node")


def test_a_hosted_reclaim_lowers_a_platform_node(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "m", cp, site, seed=4)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    assert _role_of(node) == ("node", "bc-role:node")
    node_id = json.loads((node.data_dir / "identity.json").read_text())["node_id"]

    token = cp.token(pool, hosted="kubernetes", allowReclaim=True)["token"]
    done = node.join(token, "--reset", "--yes")
    assert done.returncode == 0, done.stderr
    assert json.loads((node.data_dir / "identity.json").read_text())["node_id"] == node_id
    assert _role_of(node) == ("node-tenant", "bc-role:node-tenant")
    row = cp.one("SELECT role, identity_generation FROM nodes WHERE id = ?", (node_id,))
    assert row == {"role": "node-tenant", "identity_generation": 2}
    revoked = cp.one(
        "SELECT COUNT(*) AS n FROM node_certs WHERE node_id = ? AND revoke_reason = 'reclaimed'",
        (node_id,),
    )
    assert revoked == {"n": 1}
