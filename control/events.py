"""Events (per tenant, payloads carry hashes, never secrets) and audit rows.

Refusal events are rate-limited in the store, so every replica shares one budget:
at most 60 per attestor and reason per minute; the next one that passes carries
``suppressed``, the count dropped since the last one.

Every published event is also one structured log line (logger ``control.events``),
written once its transaction commits (a rolled-back one logs nothing): ``event`` is
the event's type; ``event_id``, ``tenant_id`` and the payload's keys in snake_case
(``nodeId`` is ``node_id``; ``certSerial`` is ``serial``, as in every line) are its
fields. Refusals and a shared hardware key are warnings, every other event info; a
refusal's line has the event's budget, so a flood of refusals writes at most 60 lines
per tenant, attestor, reason and minute too. :func:`log_event` writes the lines of
what is no event (a renewal).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from bcd.systemd import RECORD_ATTRS
from control.ids import iso, new_id
from control.store import Row, Tx

REFUSALS_PER_MINUTE = 60
WINDOW_MS = 60_000

log = logging.getLogger("control.events")

MESSAGES = {
    "node.joined": "node joined",
    "node.adopted": "node adopted",
    "security.join.refused": "join refused",
    "security.renew.refused": "renewal refused",
    "security.certificate-revoked": "certificate revoked",
    "security.join-request.approved": "join request approved",
    "security.join-request.rejected": "join request rejected",
    "security.join-token.created": "join token created",
    "security.join-token.revoked": "join token revoked",
    "security.hardware-key.shared": "a trusted hardware key is claimed by another tenant's node",
    "discovery.vouched": "site agent vouched for a machine",
}
"""The log line's message of each event type (else the type itself)."""
_WARNINGS = ("security.join.refused", "security.renew.refused", "security.hardware-key.shared")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def snake(key: str) -> str:
    """``certSerial`` → ``cert_serial``: a payload key as a log field's name."""
    return _CAMEL.sub("_", key).lower()


def log_event(
    event: str,
    message: str,
    *,
    level: int = logging.INFO,
    logger: logging.Logger = log,
    **fields: Any,
) -> None:
    """One structured log line: ``event`` and ``fields`` become the JSON line's keys
    (``key=value`` after the text line's message). Never give it a secret."""
    logger.log(level, "%s", message, extra={"event": event, **fields})


def _log_published(event_id: str, tenant_id: str, type_: str, payload: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"event_id": event_id, "tenant_id": tenant_id}
    for key, value in payload.items():
        name = "serial" if key == "certSerial" else snake(key)
        if name in fields or name in RECORD_ATTRS or name == "event":
            name = "payload_" + name  # e.g. the other tenant of a shared hardware key
        fields[name] = value
    level = logging.WARNING if type_ in _WARNINGS else logging.INFO
    log_event(type_, MESSAGES.get(type_, type_), level=level, **fields)


def publish(tx: Tx, tenant_id: str, type_: str, payload: dict[str, Any]) -> str:
    return publish_many(tx, [(tenant_id, type_, payload)])[0]


def publish_many(tx: Tx, items: Sequence[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Events (tenant, type, payload), one INSERT for all; each logged after commit."""
    ids: list[str] = []
    params: list[Any] = []
    now = tx.now_ms()
    for tenant_id, type_, payload in items:
        event_id = new_id("ev")
        ids.append(event_id)
        params += [event_id, tenant_id, type_, json.dumps(payload, sort_keys=True), now]
        tx.on_commit(functools.partial(_log_published, event_id, tenant_id, type_, dict(payload)))
    if ids:
        rows = ", ".join(["(?, ?, ?, ?, ?)"] * len(ids))
        tx.defer(
            f"INSERT INTO events (id, tenant_id, type, payload, created_at) VALUES {rows}", params
        )
    return ids


def audit(tx: Tx, tenant_id: str, action: str, subject: str, payload: dict[str, Any]) -> None:
    audit_many(tx, [(tenant_id, action, subject, payload)])


def audit_many(tx: Tx, items: Sequence[tuple[str, str, str, dict[str, Any]]]) -> None:
    """Audit rows (tenant, action, subject, payload), one INSERT for all."""
    params: list[Any] = []
    now = tx.now_ms()
    for tenant_id, action, subject, payload in items:
        params += [new_id("au"), tenant_id, action, subject, json.dumps(payload, sort_keys=True),
                   now]  # fmt: skip
    if params:
        rows = ", ".join(["(?, ?, ?, ?, ?, ?)"] * len(items))
        tx.defer(
            "INSERT INTO audit (id, tenant_id, action, subject, payload, created_at) "
            f"VALUES {rows}",
            params,
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
