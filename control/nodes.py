"""Nodes as the API shows them."""

from __future__ import annotations

from typing import Any

from control.store import Tx
from control.tokens import iso


def list_nodes(tx: Tx, tenant_id: str, pool_id: str | None = None) -> list[dict[str, Any]]:
    sql = "SELECT * FROM nodes WHERE tenant_id = ?"
    params: list[Any] = [tenant_id]
    if pool_id:
        sql += " AND pool_id = ?"
        params.append(pool_id)
    rows = tx.query(sql + " ORDER BY id", params)
    return [
        {
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
        for r in rows
    ]
