"""Tenants, their API credentials, sites and pools."""

from __future__ import annotations

import json
from typing import Any

from bcd import wire
from control.errors import ControlError, invalid, not_found
from control.ids import new_id, new_secret
from control.store import Row, Tx

AGENTS = ("bcd", "none")
CREDENTIAL_PREFIX = "bcak_"


def create_tenant(tx: Tx, name: str, *, root: bool = False) -> tuple[str, str]:
    """Create a tenant and its API credential; return (tenant id, bearer credential)."""
    if not name or len(name) > 100:
        raise invalid("the tenant name must be 1 to 100 characters")
    if root and tx.one("SELECT id FROM tenants WHERE is_root = 1"):
        raise ControlError("ALREADY_EXISTS", "a root tenant already exists")
    tenant_id = new_id("ten")
    tx.execute(
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?, ?, ?, ?)",
        (tenant_id, name, 1 if root else 0, tx.now_ms()),
    )
    return tenant_id, create_credential(tx, tenant_id)


def create_credential(tx: Tx, tenant_id: str) -> str:
    cred_id = new_id("ak")
    secret = new_secret()
    tx.execute(
        "INSERT INTO api_credentials (id, tenant_id, secret_sha256, created_at) VALUES (?, ?, ?, ?)",
        (cred_id, tenant_id, wire.secret_hash(secret), tx.now_ms()),
    )
    return f"{CREDENTIAL_PREFIX}{cred_id}.{secret}"


def authenticate(tx: Tx, bearer: str) -> str | None:
    """Return the tenant id of a valid ``bcak_<id>.<secret>``, else None."""
    if not bearer.startswith(CREDENTIAL_PREFIX) or bearer.count(".") != 1:
        return None
    cred_id, secret = bearer[len(CREDENTIAL_PREFIX) :].split(".")
    if len(cred_id) > 40 or len(secret) > 64:
        return None
    row = tx.one(
        "SELECT tenant_id, secret_sha256 FROM api_credentials WHERE id = ? AND revoked_at IS NULL",
        (cred_id,),
    )
    if row is None or not wire.secret_matches(secret, row["secret_sha256"]):
        return None
    return str(row["tenant_id"])


def root_tenant(tx: Tx) -> str | None:
    row = tx.one("SELECT id FROM tenants WHERE is_root = 1")
    return None if row is None else str(row["id"])


def is_root(tx: Tx, tenant_id: str) -> bool:
    return root_tenant(tx) == tenant_id


def create_site(tx: Tx, tenant_id: str, name: str, *, custom: bool = False) -> Row:
    if not name or len(name) > 100:
        raise invalid("the site name must be 1 to 100 characters")
    site_id = new_id("site")
    tx.execute(
        "INSERT INTO sites (id, tenant_id, name, custom, created_at) VALUES (?, ?, ?, ?, ?)",
        (site_id, tenant_id, name, 1 if custom else 0, tx.now_ms()),
    )
    return {"id": site_id, "tenantId": tenant_id, "name": name, "custom": custom}


def create_pool(
    tx: Tx, tenant_id: str, site_id: str, name: str, agent: str, policy: dict[str, Any]
) -> Row:
    if agent not in AGENTS:
        raise invalid(f"agent must be one of {', '.join(AGENTS)}")
    if not name or len(name) > 100:
        raise invalid("the pool name must be 1 to 100 characters")
    site = tx.one("SELECT tenant_id FROM sites WHERE id = ?", (site_id,))
    if site is None:
        raise not_found("no such site")
    pool_id = new_id("pool")
    tx.execute(
        "INSERT INTO pools (id, tenant_id, site_id, name, agent, policy, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (pool_id, tenant_id, site_id, name, agent, json.dumps(policy), tx.now_ms()),
    )
    return {
        "id": pool_id,
        "tenantId": tenant_id,
        "siteId": site_id,
        "name": name,
        "agent": agent,
        "policy": policy,
    }


def owned_pool(tx: Tx, tenant_id: str, pool_id: str) -> Row:
    """The pool if ``tenant_id`` owns it; NOT_FOUND otherwise (another tenant's too)."""
    row = tx.one("SELECT id, tenant_id, site_id, agent, policy FROM pools WHERE id = ?", (pool_id,))
    if row is None or row["tenant_id"] != tenant_id:
        raise not_found("no such pool")
    return row


def set_pool_policy(tx: Tx, tenant_id: str, pool_id: str, policy: dict[str, Any]) -> Row:
    """Replace a pool's policy (``joinAttestors``, ``acceptanceChecks``, ``kubernetes``)."""
    owned_pool(tx, tenant_id, pool_id)
    attestors = policy.get("joinAttestors")
    if attestors is not None and (
        not isinstance(attestors, list) or not all(isinstance(a, str) and a for a in attestors)
    ):
        raise invalid("policy.joinAttestors must be a list of attestor names")
    tx.execute("UPDATE pools SET policy = ? WHERE id = ?", (json.dumps(policy), pool_id))
    row = tx.one("SELECT * FROM pools WHERE id = ?", (pool_id,))
    assert row is not None
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "siteId": row["site_id"],
        "name": row["name"],
        "agent": row["agent"],
        "policy": json.loads(row["policy"]),
    }
