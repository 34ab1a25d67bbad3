"""Nodes as the API shows them; adopting, revoking a node's identity and deleting a node.

A node's ``state``: ``adopting`` (joined, or joined again), ``adopted`` (its first
session's Hello in a pool without ``acceptanceChecks``, else ``nodes adopt``),
``revoked`` (nodes.revokeIdentity; a re-join or reclaim makes it ``adopting`` again)
and ``retired`` (deleted; for good). docs/operators.md, "Node states and facts".
"""

from __future__ import annotations

import json
import re
from typing import Any

from control import events, nodefacts, tenancy
from control.errors import ControlError, invalid, not_found
from control.ids import iso
from control.joinservice import NoticeSigner, revoke_node_certs
from control.store import Row, Tx, marks

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
        **_node(row, _live_not_after(tx, [node_id]).get(node_id)),
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


def list_nodes(
    tx: Tx,
    tenant_id: str,
    pool_id: str | None = None,
    *,
    page_size: int = tenancy.PAGE_DEFAULT,
    page_token: str | None = None,
) -> dict[str, Any]:
    """One page of the tenant's nodes in id order (``nextPageToken``: the last id shown,
    when more remain), each with its facts."""
    if isinstance(page_size, bool) or not 1 <= page_size <= tenancy.PAGE_MAX:
        raise invalid(f"pageSize must be from 1 to {tenancy.PAGE_MAX}")
    sql = "SELECT * FROM nodes WHERE tenant_id = ?"
    params: list[Any] = [tenant_id]
    if pool_id:
        sql += " AND pool_id = ?"
        params.append(pool_id)
    if page_token:
        sql += " AND id > ?"
        params.append(page_token)
    rows = tx.query(sql + " ORDER BY id LIMIT ?", [*params, page_size + 1])
    shown = rows[:page_size]
    not_after = _live_not_after(tx, [str(r["id"]) for r in shown])
    page: dict[str, Any] = {"items": [_node(r, not_after.get(str(r["id"]))) for r in shown]}
    if len(rows) > page_size:
        page["nextPageToken"] = rows[page_size - 1]["id"]
    return page


def _live_not_after(tx: Tx, node_ids: list[str]) -> dict[str, int]:
    """The latest ``not_after`` of each node's live (unrevoked, unexpired) certificates."""
    if not node_ids:
        return {}
    rows = tx.query(
        "SELECT node_id, MAX(not_after) AS not_after FROM node_certs "
        f"WHERE node_id IN ({marks(len(node_ids))}) AND revoked_at IS NULL AND not_after > ? "
        "GROUP BY node_id",
        [*node_ids, tx.now_ms()],
    )
    return {str(r["node_id"]): int(r["not_after"]) for r in rows}


def _hostname(claims: str) -> str:
    try:
        value = json.loads(claims).get("hostname", "")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def _node(r: Row, cert_not_after: int | None = None) -> dict[str, Any]:
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
        "hostname": _hostname(r["claims"]),
        "daemonVersion": r["daemon_version"] or None,
        "lastSeenAt": None if r["last_seen_at"] is None else iso(r["last_seen_at"]),
        "certificateNotAfter": None if cert_not_after is None else iso(cert_not_after),
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
    nothing and writes nothing. The node's state becomes ``revoked`` (a retired one stays
    ``retired``). The node keeps its row; it comes back only by
    joining again with fresh evidence (an ``allowReclaim`` token for a machine with a
    trusted hardware key), which raises the identity generation, so certificates of
    older generations stay dead.
    """
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise invalid("reason must be 1 to 200 printable ASCII characters")
    node = _lock_node(tx, tenant_id, node_id)
    serials = revoke_node_certs(tx, tenant_id, node_id, reason, sign_notice)
    marked = node["retired_at"] is None and node["state"] != "revoked"
    if marked:  # a retired node stays retired
        tx.execute(
            "UPDATE nodes SET state = 'revoked', updated_at = ? WHERE id = ?",
            (tx.now_ms(), node_id),
        )
    if serials or marked:
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


def adopt_node(tx: Tx, tenant_id: str, node_id: str) -> dict[str, Any]:
    """``nodes adopt``: the operator marks an ``adopting`` node ``adopted`` (a pool with
    ``acceptanceChecks``: this reference runs no controllers to do it).

    Idempotent (an adopted node answers as it is, writing nothing); a retired or
    revoked node is FAILED_PRECONDITION. Writes the ``node.adopted`` audit row and
    event with ``by: operator``.
    """
    node = _lock_node(tx, tenant_id, node_id)
    if node["retired_at"] is not None or node["state"] == "retired":
        raise ControlError(
            "FAILED_PRECONDITION",
            f"{node_id} is retired (deleted); a retired node is never adopted",
        )
    if node["state"] == "revoked":
        raise ControlError(
            "FAILED_PRECONDITION",
            f"{node_id} is revoked; it must join again (an allowReclaim token) before "
            "it can be adopted",
        )
    if node["state"] == "adopted":
        return {"nodeId": node_id, "state": "adopted", "changed": False}
    tx.execute(
        "UPDATE nodes SET state = 'adopted', updated_at = ? WHERE id = ? AND state = 'adopting'",
        (tx.now_ms(), node_id),
    )
    nodefacts.record_adopted(tx, tenant_id, node_id, "operator")
    return {"nodeId": node_id, "state": "adopted", "changed": True}
