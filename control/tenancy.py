"""Tenants, their API credentials, sites and pools."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from bcd import wire
from bcd.attestor_api import canonical_name
from control.errors import ControlError, invalid, not_found
from control.ids import iso, new_id, new_secret
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
    now = tx.now_ms()
    tx.execute(
        "INSERT INTO sites (id, tenant_id, name, custom, created_at) VALUES (?, ?, ?, ?, ?)",
        (site_id, tenant_id, name, 1 if custom else 0, now),
    )
    return {"id": site_id, "tenantId": tenant_id, "name": name, "custom": custom,
            "createdAt": iso(now)}  # fmt: skip


def create_pool(
    tx: Tx, tenant_id: str, site_id: str, name: str, agent: str, policy: dict[str, Any]
) -> Row:
    if agent not in AGENTS:
        raise invalid(f"agent must be one of {', '.join(AGENTS)}")
    check_policy_shape(policy)
    if not name or len(name) > 100:
        raise invalid("the pool name must be 1 to 100 characters")
    site = tx.one("SELECT tenant_id FROM sites WHERE id = ?", (site_id,))
    if site is None:
        raise not_found("no such site")
    pool_id = new_id("pool")
    now = tx.now_ms()
    tx.execute(
        "INSERT INTO pools (id, tenant_id, site_id, name, agent, policy, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (pool_id, tenant_id, site_id, name, agent, json.dumps(policy), now),
    )
    return {
        "id": pool_id,
        "tenantId": tenant_id,
        "siteId": site_id,
        "name": name,
        "agent": agent,
        "policy": policy,
        "createdAt": iso(now),
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
    check_policy_shape(policy)
    tx.execute("UPDATE pools SET policy = ? WHERE id = ?", (json.dumps(policy), pool_id))
    row = tx.one("SELECT * FROM pools WHERE id = ?", (pool_id,))
    assert row is not None
    return pool_record(row)


def check_policy_shape(policy: dict[str, Any]) -> None:
    """INVALID_ARGUMENT when a key this code reads has the wrong type: ``joinAttestors``
    a list of names, ``acceptanceChecks`` a boolean, ``kubernetes`` an object whose
    ``platformOperated`` is a boolean (other keys are kept as given)."""
    attestors = policy.get("joinAttestors")
    if attestors is not None and (
        not isinstance(attestors, list) or not all(isinstance(a, str) and a for a in attestors)
    ):
        raise invalid("policy.joinAttestors must be a list of attestor names")
    if not isinstance(policy.get("acceptanceChecks", False), bool):
        raise invalid("policy.acceptanceChecks must be true or false")
    kube = policy.get("kubernetes", {})
    if not isinstance(kube, dict) or not isinstance(kube.get("platformOperated", False), bool):
        raise invalid("policy.kubernetes must be an object; its platformOperated true or false")


def unknown_attestors(names: list[str], known: Sequence[str]) -> str | None:
    """The message naming the attestors of ``names`` that are not ``known`` (and the
    known ones), or None when every one is known; the API's and the CLI's check."""
    unknown = [n for n in names if canonical_name(n) not in known]
    if not unknown:
        return None
    return (
        f"unknown attestor {', '.join(repr(n[:64]) for n in unknown[:5])}; the known attestors are "
        f"{', '.join(sorted(known))}"
    )


def check_policy_attestors(policy: dict[str, Any], known: Sequence[str]) -> None:
    """INVALID_ARGUMENT when policy.joinAttestors names an attestor no plugin serves."""
    names = policy.get("joinAttestors")
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(a, str) and a for a in names):
        raise invalid("policy.joinAttestors must be a list of attestor names")
    problem = unknown_attestors(names, known)
    if problem is not None:
        raise invalid(f"policy.joinAttestors: {problem}")


# --- listing and showing ---------------------------------------------------------------

PAGE_DEFAULT = 100
PAGE_MAX = 1000
SITE_POOL_PAGE_MAX = 100
"""The largest page of sites or pools: a pool's policy may be 64 KiB, so a page of
1,000 would be ~64 MB built and serialized on the event loop."""


def tenant_record(row: Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "root": bool(row["is_root"]),
        "createdAt": iso(row["created_at"]),
    }


def site_record(row: Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "name": row["name"],
        "custom": bool(row["custom"]),
        "createdAt": iso(row["created_at"]),
    }


def pool_record(row: Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "siteId": row["site_id"],
        "name": row["name"],
        "agent": row["agent"],
        "policy": json.loads(row["policy"]),
        "createdAt": iso(row["created_at"]),
    }


def _page(
    tx: Tx,
    sql: str,
    params: list[Any],
    shape: Callable[[Row], dict[str, Any]],
    page_size: int,
    page_token: str | None,
    page_max: int = PAGE_MAX,
) -> dict[str, Any]:
    """One page in id order; ``nextPageToken`` (the last id shown) when more remain."""
    if isinstance(page_size, bool) or not 1 <= page_size <= page_max:
        raise invalid(f"pageSize must be from 1 to {page_max}")
    if page_token:
        sql += " AND id > ?"
        params = [*params, page_token]
    rows = tx.query(sql + " ORDER BY id LIMIT ?", [*params, page_size + 1])
    page: dict[str, Any] = {"items": [shape(r) for r in rows[:page_size]]}
    if len(rows) > page_size:
        page["nextPageToken"] = rows[page_size - 1]["id"]
    return page


def list_tenants(
    tx: Tx, caller: str, *, page_size: int = PAGE_DEFAULT, page_token: str | None = None
) -> dict[str, Any]:
    """Every tenant for the root tenant; the caller's own for any other."""
    if is_root(tx, caller):
        return _page(tx, "SELECT * FROM tenants WHERE 1 = 1", [], tenant_record, page_size,
                     page_token)  # fmt: skip
    return _page(tx, "SELECT * FROM tenants WHERE id = ?", [caller], tenant_record, page_size,
                 page_token)  # fmt: skip


def show_tenant(tx: Tx, caller: str, tenant_id: str) -> dict[str, Any]:
    """The caller's own tenant, or any tenant for the root tenant; else NOT_FOUND."""
    row = tx.one("SELECT * FROM tenants WHERE id = ?", (tenant_id,))
    if row is None or (tenant_id != caller and not is_root(tx, caller)):
        raise not_found("no such tenant")
    return tenant_record(row)


def list_sites(
    tx: Tx, tenant_id: str, *, page_size: int = PAGE_DEFAULT, page_token: str | None = None
) -> dict[str, Any]:
    return _page(tx, "SELECT * FROM sites WHERE tenant_id = ?", [tenant_id], site_record,
                 page_size, page_token, SITE_POOL_PAGE_MAX)  # fmt: skip


def show_site(tx: Tx, tenant_id: str, site_id: str) -> dict[str, Any]:
    row = tx.one("SELECT * FROM sites WHERE id = ?", (site_id,))
    if row is None or row["tenant_id"] != tenant_id:
        raise not_found("no such site")
    return site_record(row)


def list_pools(
    tx: Tx,
    tenant_id: str,
    *,
    site_id: str | None = None,
    page_size: int = PAGE_DEFAULT,
    page_token: str | None = None,
) -> dict[str, Any]:
    sql, params = "SELECT * FROM pools WHERE tenant_id = ?", [tenant_id]
    if site_id is not None:
        sql, params = sql + " AND site_id = ?", [tenant_id, site_id]
    return _page(tx, sql, params, pool_record, page_size, page_token, SITE_POOL_PAGE_MAX)


def show_pool(tx: Tx, tenant_id: str, pool_id: str) -> dict[str, Any]:
    owned_pool(tx, tenant_id, pool_id)
    row = tx.one("SELECT * FROM pools WHERE id = ?", (pool_id,))
    assert row is not None
    return pool_record(row)
