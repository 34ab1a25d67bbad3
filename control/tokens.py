"""Join tokens: joinTokens.create / list / revoke with every rule of the seed."""

from __future__ import annotations

import json
from typing import Any

from bcd import hardware, wire
from control import events, tenancy
from control.errors import ControlError, StoreConflict, invalid, not_found
from control.ids import iso, new_id, new_secret
from control.store import Row, Tx

TTL_MIN_S = 60
TTL_MAX_S = 86_400
MAX_USES_LIMIT = 10_000
PAGE_DEFAULT = 100
PAGE_MAX = 200
TOKEN_ROLES = ("node", "site", "ramdisk")
HOSTED_KINDS = ("kubernetes",)


def record(row: Row) -> dict[str, Any]:
    """The token record the API shows: never the secret or its hash."""
    return {
        "id": row["id"],
        "poolId": row["pool_id"],
        "siteId": row["site_id"],
        "role": row["role"],
        "usesLeft": row["uses_left"],
        "maxUses": row["max_uses"],
        "expect": json.loads(row["expect"]),
        "allowReclaim": bool(row["allow_reclaim"]),
        "hosted": row["hosted"],
        "createdAt": iso(row["created_at"]),
        "expiresAt": iso(row["expires_at"]),
        "revoked": row["revoked_at"] is not None,
    }


def create(
    tx: Tx,
    tenant_id: str,
    pool_id: str,
    *,
    ttl_s: int,
    max_uses: int = 1,
    allow_reclaim: bool = False,
    expect: object = None,
    hosted: str | None = None,
    idempotency_key: str | None = None,
    role: str = "node",
) -> dict[str, Any]:
    """Mint a token; the answer carries ``token`` only when this call created it."""
    pool = tenancy.owned_pool(tx, tenant_id, pool_id)
    if pool["agent"] != "bcd":
        raise ControlError("INVALID_STATE", "the pool's machines run no daemon (agent is not bcd)")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or not TTL_MIN_S <= ttl_s <= TTL_MAX_S:
        raise invalid("ttlSeconds must be a whole number of seconds from 60 (1m) to 86400 (24h)")
    if isinstance(max_uses, bool) or not isinstance(max_uses, int):
        raise invalid("maxUses must be a whole number")
    if not 1 <= max_uses <= MAX_USES_LIMIT:
        raise invalid(f"maxUses must be from 1 to {MAX_USES_LIMIT}")
    if role not in TOKEN_ROLES:
        raise invalid("role must be node, site or ramdisk")
    if role != "node" and not tenancy.is_root(tx, tenant_id):
        raise ControlError(
            "ACCESS_DENIED", "only a module (the root tenant) mints site and ramdisk tokens"
        )
    if hosted is not None and hosted not in HOSTED_KINDS:
        raise invalid("hosted must be kubernetes")
    try:
        expect_norm = hardware.normalize_expect(expect or {})
    except ValueError as exc:
        raise invalid(f"expect: {exc}") from exc
    if idempotency_key is not None and (not idempotency_key or len(idempotency_key) > 128):
        raise invalid("idempotencyKey must be 1 to 128 characters")
    if idempotency_key:
        existing = _by_key(tx, tenant_id, idempotency_key)
        if existing is not None:
            return _replay(existing, pool_id, expect_norm, allow_reclaim, hosted)
    token_id = new_id("jt")
    secret = new_secret()
    now = tx.now_ms()
    try:
        tx.execute(
            "INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, secret_sha256, "
            "max_uses, uses_left, expect, allow_reclaim, hosted, idempotency_key, created_at, "
            "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                token_id,
                tenant_id,
                pool_id,
                pool["site_id"],
                role,
                wire.secret_hash(secret),
                max_uses,
                max_uses,
                json.dumps(expect_norm, sort_keys=True),
                1 if allow_reclaim else 0,
                hosted,
                idempotency_key,
                now,
                now + ttl_s * 1000,
            ),
        )
    except StoreConflict as exc:
        raise ControlError(
            "CONFLICT", "a token with this idempotency key is being created"
        ) from exc
    payload: dict[str, Any] = {"tokenId": token_id, "poolId": pool_id, "pinned": bool(expect_norm)}
    if hosted:
        payload["hosted"] = hosted
    events.publish(tx, tenant_id, "security.join-token.created", payload)
    row = tx.one("SELECT * FROM join_tokens WHERE id = ?", (token_id,))
    assert row is not None
    return {**record(row), "token": f"bcjt_{token_id}.{secret}"}


def _by_key(tx: Tx, tenant_id: str, key: str) -> Row | None:
    return tx.one(
        "SELECT * FROM join_tokens WHERE tenant_id = ? AND idempotency_key = ?", (tenant_id, key)
    )


def _replay(
    row: Row, pool_id: str, expect: dict[str, str], allow_reclaim: bool, hosted: str | None
) -> dict[str, Any]:
    same = (
        row["pool_id"] == pool_id
        and json.loads(row["expect"]) == expect
        and bool(row["allow_reclaim"]) == allow_reclaim
        and row["hosted"] == hosted
    )
    if not same:
        raise ControlError(
            "CONFLICT",
            "this idempotency key was used for a token with another pool, expect, "
            "allowReclaim or hosted",
        )
    return record(row)


def list_tokens(
    tx: Tx,
    tenant_id: str,
    pool_id: str,
    *,
    include_inactive: bool = False,
    page_size: int = PAGE_DEFAULT,
    page_token: str | None = None,
) -> dict[str, Any]:
    tenancy.owned_pool(tx, tenant_id, pool_id)
    if (
        isinstance(page_size, bool)
        or not isinstance(page_size, int)
        or not 1 <= page_size <= PAGE_MAX
    ):
        raise invalid(f"pageSize must be from 1 to {PAGE_MAX}")
    sql = "SELECT * FROM join_tokens WHERE pool_id = ?"
    params: list[Any] = [pool_id]
    if not include_inactive:
        sql += " AND revoked_at IS NULL AND expires_at > ? AND uses_left > 0"
        params.append(tx.now_ms())
    if page_token:
        sql += " AND id > ?"
        params.append(page_token)
    sql += " ORDER BY id LIMIT ?"
    params.append(page_size + 1)
    rows = tx.query(sql, params)
    items = [record(r) for r in rows[:page_size]]
    out: dict[str, Any] = {"items": items}
    if len(rows) > page_size:
        out["nextPageToken"] = rows[page_size - 1]["id"]
    return out


def revoke(tx: Tx, tenant_id: str, pool_id: str, token_id: str) -> dict[str, Any]:
    """End a token at once; revoking twice is not an error."""
    if "." in token_id:
        raise invalid("revoke takes the token id (jt_…), never the token itself")
    tenancy.owned_pool(tx, tenant_id, pool_id)
    row = tx.one(
        "SELECT * FROM join_tokens WHERE id = ? AND pool_id = ?" + tx.for_update,
        (token_id, pool_id),
    )
    if row is None:
        raise not_found("no such join token")
    if row["revoked_at"] is None:
        tx.execute("UPDATE join_tokens SET revoked_at = ? WHERE id = ?", (tx.now_ms(), token_id))
        events.publish(
            tx, tenant_id, "security.join-token.revoked", {"tokenId": token_id, "poolId": pool_id}
        )
        row = tx.one("SELECT * FROM join_tokens WHERE id = ?", (token_id,))
        assert row is not None
    return record(row)
