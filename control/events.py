"""Events (per tenant, payloads carry hashes, never secrets) and audit rows.

Refusal events are rate-limited in the store, so every replica shares one budget:
at most 60 per attestor and reason per minute; the next one that passes carries
``suppressed``, the count dropped since the last one.
"""

from __future__ import annotations

import json
from typing import Any

from control.ids import iso, new_id
from control.store import Row, Tx

REFUSALS_PER_MINUTE = 60
WINDOW_MS = 60_000


def publish(tx: Tx, tenant_id: str, type_: str, payload: dict[str, Any]) -> str:
    event_id = new_id("ev")
    tx.execute(
        "INSERT INTO events (id, tenant_id, type, payload, created_at) VALUES (?, ?, ?, ?, ?)",
        (event_id, tenant_id, type_, json.dumps(payload, sort_keys=True), tx.now_ms()),
    )
    return event_id


def audit(tx: Tx, tenant_id: str, action: str, subject: str, payload: dict[str, Any]) -> None:
    tx.execute(
        "INSERT INTO audit (id, tenant_id, action, subject, payload, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (
            new_id("au"),
            tenant_id,
            action,
            subject,
            json.dumps(payload, sort_keys=True),
            tx.now_ms(),
        ),
    )


def publish_rate_limited(
    tx: Tx, tenant_id: str, type_: str, rate_key: str, payload: dict[str, Any]
) -> bool:
    """Publish unless ``rate_key`` already had 60 events this minute; return whether it did."""
    now = tx.now_ms()
    row = tx.one(
        "SELECT window_start, emitted, suppressed FROM refusal_windows WHERE rate_key = ?"
        + tx.for_update,
        (rate_key,),
    )
    if row is None:
        tx.execute(
            "INSERT INTO refusal_windows (rate_key, window_start, emitted, suppressed) "
            "VALUES (?, ?, 0, 0) ON CONFLICT (rate_key) DO NOTHING",
            (rate_key, now),
        )
        row = tx.one(
            "SELECT window_start, emitted, suppressed FROM refusal_windows WHERE rate_key = ?"
            + tx.for_update,
            (rate_key,),
        )
        assert row is not None
    start, emitted, suppressed = (
        int(row["window_start"]),
        int(row["emitted"]),
        int(row["suppressed"]),
    )
    if now - start >= WINDOW_MS:
        start, emitted = now, 0
    if emitted >= REFUSALS_PER_MINUTE:
        tx.execute(
            "UPDATE refusal_windows SET window_start = ?, emitted = ?, suppressed = ? "
            "WHERE rate_key = ?",
            (start, emitted, suppressed + 1, rate_key),
        )
        return False
    publish(tx, tenant_id, type_, {**payload, "suppressed": suppressed})
    tx.execute(
        "UPDATE refusal_windows SET window_start = ?, emitted = ?, suppressed = 0 WHERE rate_key = ?",
        (start, emitted + 1, rate_key),
    )
    return True


def list_events(
    tx: Tx, tenant_id: str, type_: str | None = None, since_ms: int | None = None, limit: int = 100
) -> list[Row]:
    sql = "SELECT id, type, payload, created_at FROM events WHERE tenant_id = ?"
    params: list[Any] = [tenant_id]
    if type_:
        sql += " AND type = ?"
        params.append(type_)
    if since_ms is not None:
        sql += " AND created_at >= ?"
        params.append(since_ms)
    sql += " ORDER BY created_at, id LIMIT ?"
    params.append(limit)
    return [
        {
            "id": r["id"],
            "type": r["type"],
            "payload": json.loads(r["payload"]),
            "createdAt": iso(r["created_at"]),
            "createdAtMs": r["created_at"],
        }
        for r in tx.query(sql, params)
    ]
