"""Join requests: what a deferring attestor saw, and the decisions on it (issue 5).

An attestor that answers :class:`~bcd.attestor_api.Defer` has JoinService record a
request here (or refresh the machine's pending one with its new CSR) and answer a
signed ``pending`` body. A tenant decides on the pool, like join tokens:
``approve`` (with a TTL of 60 to 86,400 s) lets exactly one retry with the recorded
CSR join, consumed inside that join's transaction; ``reject`` makes a retry with that
CSR fail. Decisions publish ``security.join-request.approved`` / ``.rejected``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from bcd.attestor_api import Defer, JoinRequestRecord
from control import events, tenancy
from control.errors import ControlError, invalid, not_found
from control.http import source_of
from control.ids import iso, new_id
from control.store import Row, Tx

TTL_MIN_S = 60
TTL_MAX_S = 86_400
TTL_DEFAULT_S = 900
STATES = ("pending", "approved", "rejected")
REASON_MAX = 500
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _iso(ms: Any) -> str | None:
    return None if ms is None else iso(int(ms))


def record(row: Row, now_ms: int | None = None) -> dict[str, Any]:
    """A request as the API shows it: what the attestor saw, and the decision."""
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "poolId": row["pool_id"],
        "siteId": row["site_id"],
        "attestor": row["attestor"],
        "state": row["state"],
        "claims": json.loads(row["claims"]),
        "hardwareKey": row["hardware_key"],
        "mac": row["mac"],
        "ip": row["ip"],
        "workflowId": row["workflow_id"],
        "vouchedBy": row["vouched_by"],
        "bootLeaseEpoch": row["boot_lease_epoch"],
        "csrSha256": row["csr_sha256"],
        "createdAt": iso(int(row["created_at"])),
        "updatedAt": iso(int(row["updated_at"])),
        "decidedAt": _iso(row["decided_at"]),
        "decidedBy": row["decided_by"],
        "reason": row["reason"],
        "expiresAt": _iso(row["expires_at"]),
        "consumedAt": _iso(row["consumed_at"]),
    }


def usable(row: Row, now_ms: int) -> bool:
    """Approved, not consumed, and its approval not expired at ``now_ms``."""
    return (
        row["state"] == "approved"
        and row["consumed_at"] is None
        and row["expires_at"] is not None
        and int(row["expires_at"]) > now_ms
    )


def lock_for_csr(tx: Tx, attestor: str, machine_key: str, csr_sha256: str) -> Row | None:
    """The machine's newest request for ``attestor`` naming this CSR, locked."""
    return tx.one(
        "SELECT * FROM join_requests WHERE attestor = ? AND machine_key = ? AND csr_sha256 = ? "
        "ORDER BY created_at DESC, id DESC LIMIT 1" + tx.for_update,
        (attestor, machine_key, csr_sha256),
    )


def as_record(row: Row, now_ms: int) -> JoinRequestRecord:
    return JoinRequestRecord(
        request_id=str(row["id"]), state=str(row["state"]), usable=usable(row, now_ms)
    )


def consume(tx: Tx, request_id: str) -> None:
    changed = tx.execute(
        "UPDATE join_requests SET consumed_at = ?, updated_at = ? "
        "WHERE id = ? AND state = 'approved' AND consumed_at IS NULL",
        (tx.now_ms(), tx.now_ms(), request_id),
    )
    if changed != 1:  # pragma: no cover - the row is locked and was checked
        raise ControlError("CONFLICT", "This machine joined concurrently; retry")


def record_pending(
    tx: Tx,
    *,
    tenant_id: str,
    site_id: str,
    attestor: str,
    defer: Defer,
    claims: dict[str, Any],
    csr_sha256: str,
    source_ip: str | None = None,
) -> str:
    """Record the machine's pending request, or refresh it with this attempt's CSR.

    A new request must fit the bounds on pending requests (:func:`check_room`);
    refreshing the machine's own one always does.
    """
    now = tx.now_ms()
    fields = (
        json.dumps(claims, sort_keys=True),
        defer.hardware_key,
        defer.mac,
        defer.ip,
        defer.workflow_id,
        csr_sha256,
        defer.vouched_by,
        defer.boot_lease_epoch,
    )
    row = tx.one(
        "SELECT id FROM join_requests WHERE pool_id = ? AND machine_key = ? AND state = 'pending'"
        + tx.for_update,
        (defer.pool_id, defer.machine_key),
    )
    if row is not None:
        tx.execute(
            "UPDATE join_requests SET claims = ?, hardware_key = ?, mac = ?, ip = ?, "
            "workflow_id = ?, csr_sha256 = ?, vouched_by = ?, boot_lease_epoch = ?, "
            "attestor = ?, updated_at = ? WHERE id = ?",
            (*fields, attestor, now, row["id"]),
        )
        return str(row["id"])
    source_ip = source_of(source_ip) if source_ip is not None else None
    check_room(tx, defer.pool_id, site_id, source_ip)
    request_id = new_id("jreq")
    tx.execute(
        "INSERT INTO join_requests (id, tenant_id, pool_id, site_id, attestor, machine_key, "
        "claims, hardware_key, mac, ip, workflow_id, csr_sha256, vouched_by, boot_lease_epoch, "
        "state, created_at, updated_at, source_ip) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?)",
        (
            request_id,
            tenant_id,
            defer.pool_id,
            site_id,
            attestor,
            defer.machine_key,
            *fields,
            now,
            now,
            source_ip,
        ),
    )
    return request_id


MAX_PENDING_PER_POOL = 5_000
MAX_PENDING_PER_SITE = 2_000
MAX_PENDING_PER_SOURCE = 50
PENDING_FULL_PUSHBACK_MS = 60_000


def check_room(tx: Tx, pool_id: str, site_id: str, source_ip: str | None) -> None:
    """Bound pending requests, so made-up machines (an unauthenticated EK or vouch
    flood) cannot bury a real one: per pool, per site and per source address. Over a
    bound the join is answered RESOURCE_EXHAUSTED with a minute's pushback (not a
    refusal: the machine may be real and waits its turn)."""
    bounds = [
        ("pool_id = ?", pool_id, MAX_PENDING_PER_POOL, "this pool"),
        ("site_id = ?", site_id, MAX_PENDING_PER_SITE, "this site"),
    ]
    if source_ip is not None:
        bounds.append(("source_ip = ?", source_ip, MAX_PENDING_PER_SOURCE, "this address"))
    for where, value, limit, what in bounds:
        row = tx.one(
            f"SELECT count(*) AS n FROM (SELECT 1 FROM join_requests WHERE {where} "
            "AND state = 'pending' LIMIT ?) AS capped",
            (value, limit),
        )
        if row is not None and int(row["n"]) >= limit:
            raise ControlError(
                "RESOURCE_EXHAUSTED",
                f"{what} has {limit} join requests waiting for a decision; retry later",
                retry_after_ms=PENDING_FULL_PUSHBACK_MS,
            )


# --- the tenant API -----------------------------------------------------------------


def list_requests(
    tx: Tx,
    tenant_id: str,
    pool_id: str,
    state: str = "pending",
    *,
    page_size: int = 100,
    page_token: str | None = None,
) -> dict[str, Any]:
    """The pool's requests, newest first: ``pending`` (the default), ``approved``,
    ``rejected`` or ``all``; ``nextPageToken`` (the last id shown) when more remain."""
    tenancy.owned_pool(tx, tenant_id, pool_id)
    if state not in (*STATES, "all"):
        raise invalid("state must be pending, approved, rejected or all")
    if isinstance(page_size, bool) or not 1 <= page_size <= 1000:
        raise invalid("pageSize must be from 1 to 1000")
    sql = "SELECT * FROM join_requests WHERE pool_id = ?"
    params: list[Any] = [pool_id]
    if state != "all":
        sql += " AND state = ?"
        params.append(state)
    if page_token:
        after = tx.one(
            "SELECT created_at, id FROM join_requests WHERE id = ? AND pool_id = ?",
            (page_token, pool_id),
        )
        if after is None:
            raise invalid("pageToken is not a request of this pool")
        sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
        params += [after["created_at"], after["created_at"], after["id"]]
    sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
    rows = tx.query(sql, [*params, page_size + 1])
    page: dict[str, Any] = {"items": [record(r) for r in rows[:page_size]]}
    if len(rows) > page_size:
        page["nextPageToken"] = rows[page_size - 1]["id"]
    return page


def _lock_pending(tx: Tx, tenant_id: str, pool_id: str, request_id: str) -> Row:
    tenancy.owned_pool(tx, tenant_id, pool_id)
    row = tx.one(
        "SELECT * FROM join_requests WHERE id = ? AND pool_id = ?" + tx.for_update,
        (request_id, pool_id),
    )
    if row is None:
        raise not_found("no such join request")
    if row["state"] != "pending":
        raise ControlError("INVALID_STATE", f"the join request is already {row['state']}")
    return row


def _reason(reason: str | None) -> str | None:
    if reason is not None and len(reason) > REASON_MAX:
        raise invalid(f"reason must be at most {REASON_MAX} characters")
    if reason is not None and not reason.isprintable():
        raise invalid("reason must be printable text (no control characters or line breaks)")
    return reason


def _decided(tx: Tx, tenant_id: str, row: Row, type_: str) -> dict[str, Any]:
    fresh = tx.one("SELECT * FROM join_requests WHERE id = ?", (row["id"],))
    assert fresh is not None
    payload = {
        "requestId": fresh["id"],
        "poolId": fresh["pool_id"],
        "attestor": fresh["attestor"],
        "csrSha256": fresh["csr_sha256"],
        "hardwareKey": fresh["hardware_key"],
        "reason": fresh["reason"],
    }
    if fresh["expires_at"] is not None:
        payload["expiresAt"] = iso(int(fresh["expires_at"]))
    events.publish(tx, tenant_id, type_, payload)
    events.audit(tx, tenant_id, type_, str(fresh["id"]), payload)
    return record(fresh)


def approve(
    tx: Tx,
    tenant_id: str,
    pool_id: str,
    request_id: str,
    *,
    ttl_s: int = TTL_DEFAULT_S,
    reason: str | None = None,
    decided_by: str,
    csr_sha256: str | None = None,
) -> dict[str, Any]:
    """Approve a pending request: one join with its CSR until ``ttl_s`` from now.

    ``csr_sha256``, when given, must still be the request's: a newer attempt of the
    machine refreshes a pending request with its CSR, so a person who approves what
    they listed names it, and a request that changed since is not approved.
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or not TTL_MIN_S <= ttl_s <= TTL_MAX_S:
        raise invalid(f"ttlSeconds must be from {TTL_MIN_S} to {TTL_MAX_S}")
    if csr_sha256 is not None and not _HEX64.fullmatch(csr_sha256):
        raise invalid("csrSha256 must be 64 lowercase hex digits")
    row = _lock_pending(tx, tenant_id, pool_id, request_id)
    if csr_sha256 is not None and row["csr_sha256"] != csr_sha256:
        raise ControlError(
            "INVALID_STATE",
            f"{request_id} changed since it was listed: a newer attempt of the machine "
            f"presented another CSR (csrSha256 {row['csr_sha256']}); list it again and check",
        )
    now = tx.now_ms()
    tx.execute(
        "UPDATE join_requests SET state = 'approved', decided_at = ?, decided_by = ?, "
        "reason = ?, expires_at = ?, updated_at = ? WHERE id = ?",
        (now, decided_by, _reason(reason), now + ttl_s * 1000, now, request_id),
    )
    return _decided(tx, tenant_id, row, "security.join-request.approved")


def reject(
    tx: Tx,
    tenant_id: str,
    pool_id: str,
    request_id: str,
    *,
    reason: str | None = None,
    decided_by: str,
) -> dict[str, Any]:
    """Reject a pending request: a retry with its CSR is refused."""
    row = _lock_pending(tx, tenant_id, pool_id, request_id)
    now = tx.now_ms()
    tx.execute(
        "UPDATE join_requests SET state = 'rejected', decided_at = ?, decided_by = ?, "
        "reason = ?, updated_at = ? WHERE id = ?",
        (now, decided_by, _reason(reason), now, request_id),
    )
    return _decided(tx, tenant_id, row, "security.join-request.rejected")
