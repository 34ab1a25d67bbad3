"""Nodes as the API shows them; revoking a node's identity and deleting a node."""

from __future__ import annotations

import json
import re
from typing import Any

from control import events
from control.errors import invalid, not_found
from control.ids import iso
from control.joinservice import NoticeSigner, revoke_node_certs
from control.store import Row, Tx

_REASON = re.compile(r"[\x20-\x7e]{1,200}")


def show_node(tx: Tx, tenant_id: str, node_id: str) -> dict[str, Any]:
    row = tx.one("SELECT * FROM nodes WHERE id = ? AND tenant_id = ?", (node_id, tenant_id))
    if row is None:
        raise not_found("no such node")
    certs = tx.query(
        "SELECT serial, identity_generation, role, not_before, not_after, revoked_at, "
        "revoke_reason, statements, allowed_kinds FROM node_certs WHERE node_id = ? "
        "ORDER BY created_at",
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
                "statements": json.loads(c["statements"]),
                "allowedKinds": json.loads(c["allowed_kinds"]),
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


def _lock_node(tx: Tx, tenant_id: str, node_id: str) -> Row:
    """The node row, locked; NOT_FOUND for a missing node or another tenant's."""
    row = tx.one("SELECT * FROM nodes WHERE id = ?" + tx.for_update, (node_id,))
    if row is None or row["tenant_id"] != tenant_id:
        raise not_found("no such node")
    return row


def revoke_identity(
    tx: Tx, tenant_id: str, node_id: str, sign_notice: NoticeSigner, reason: str = "revoked"
) -> dict[str, Any]:
    """nodes.revokeIdentity: revoke every live certificate of the node.

    Each gets a ``security.certificate-revoked`` event, and the call an audit row
    ``node.identity-revoked``. Idempotent: when nothing is live any more it changes
    nothing and writes nothing. The node keeps its row; it comes back only by
    joining again with fresh evidence (an ``allowReclaim`` token for a machine with a
    trusted hardware key), which raises the identity generation, so certificates of
    older generations stay dead.
    """
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise invalid("reason must be 1 to 200 printable ASCII characters")
    _lock_node(tx, tenant_id, node_id)
    serials = revoke_node_certs(tx, tenant_id, node_id, reason, sign_notice)
    if serials:
        events.audit(
            tx,
            tenant_id,
            "node.identity-revoked",
            node_id,
            {"nodeId": node_id, "reason": reason, "serials": serials},
        )
    return {"nodeId": node_id, "reason": reason, "revoked": serials}


def delete_node(tx: Tx, tenant_id: str, node_id: str, sign_notice: NoticeSigner) -> dict[str, Any]:
    """Delete a node: retire it (``state`` ``retired``, ``retired_at``) and revoke its
    certificates with reason ``deleted``.

    The row stays (its certificates and audit rows refer to it), but the machine is
    free to join again as a NEW node with a plain token: the node's hardware key is
    kept for the record while ``hardware_key_trusted`` is cleared, which takes it
    out of the unique index of trusted hardware keys and out of JoinService's
    reclaim lookup. A deleted node is never reclaimed. Idempotent: deleting a
    retired node changes nothing.
    """
    node = _lock_node(tx, tenant_id, node_id)
    if node["retired_at"] is not None:
        return {"nodeId": node_id, "state": node["state"], "revoked": []}
    now_ms = tx.now_ms()
    tx.execute(
        "UPDATE nodes SET state = 'retired', retired_at = ?, hardware_key_trusted = 0, "
        "updated_at = ? WHERE id = ?",
        (now_ms, now_ms, node_id),
    )
    serials = revoke_node_certs(tx, tenant_id, node_id, "deleted", sign_notice)
    events.audit(
        tx,
        tenant_id,
        "node.deleted",
        node_id,
        {
            "nodeId": node_id,
            "hardwareKey": node["hardware_key"],
            "hardwareKeyTrusted": bool(node["hardware_key_trusted"]),
            "serials": serials,
        },
    )
    return {"nodeId": node_id, "state": "retired", "revoked": serials}
