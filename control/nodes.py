"""Nodes as the API shows them."""

from __future__ import annotations

from typing import Any

from control.errors import not_found
from control.store import Row, Tx
from control.tokens import iso


def show_node(tx: Tx, tenant_id: str, node_id: str) -> dict[str, Any]:
    row = tx.one("SELECT * FROM nodes WHERE id = ? AND tenant_id = ?", (node_id, tenant_id))
    if row is None:
        raise not_found("no such node")
    certs = tx.query(
        "SELECT serial, identity_generation, role, not_before, not_after, revoked_at, "
        "revoke_reason FROM node_certs WHERE node_id = ? ORDER BY created_at",
        (node_id,),
    )
    return {
        **_node(row),
        "certificates": [
            {
                "serial": c["serial"],
                "identityGeneration": c["identity_generation"],
                "role": c["role"],
                "notBefore": iso(c["not_before"]),
                "notAfter": iso(c["not_after"]),
                "revoked": c["revoked_at"] is not None,
                "revokeReason": c["revoke_reason"],
            }
            for c in certs
        ],
    }


def list_nodes(tx: Tx, tenant_id: str, pool_id: str | None = None) -> list[dict[str, Any]]:
    sql = "SELECT * FROM nodes WHERE tenant_id = ?"
    params: list[Any] = [tenant_id]
    if pool_id:
        sql += " AND pool_id = ?"
        params.append(pool_id)
    return [_node(r) for r in tx.query(sql + " ORDER BY id", params)]


def _node(r: Row) -> dict[str, Any]:
    return {
        "id": r["id"],
        "siteId": r["site_id"],
        "poolId": r["pool_id"],
        "role": r["role"],
        "state": r["state"],
        "identityGeneration": r["identity_generation"],
        "hardwareKeyTrusted": bool(r["hardware_key_trusted"]),
        "attestor": r["attestor"],
        "createdAt": iso(r["created_at"]),
    }
