"""What the operator sees of a node beside its row: sessions seen, daemon version, adoption.

A gateway holds no write access to the database, so it reports the sessions it opens
UPSTREAM, to the API (:class:`control.sessionreport.SessionReporter`), on
:data:`SESSIONS_PATH`: in one process straight to :class:`control.gateway.NodeCalls`,
split, through the relay (:mod:`control.relay`), which takes the path only from a
verified relay certificate. A node can never call it: the gateway's node-facing
front door answers NOT_FOUND for it.

A report names certificate serials, never node ids: :func:`record_sessions` updates
only the node whose LIVE certificate (not revoked, not expired, of its current
generation, node not retired) each serial is, so a stolen relay credential buys
"this certificate was seen", nothing more. One report is at most
:data:`MAX_REPORT_SERIALS` serials, applied in one transaction: one UPDATE of
``last_seen_at`` for all of them, one UPDATE per distinct changed daemon version,
and the adoption of the (few) nodes still ``adopting`` in a pool without
``acceptanceChecks`` (the node's first Hello adopts it; docs/operators.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from control import events
from control.errors import invalid
from control.store import Tx

SESSIONS_PATH = "/v1/internal/sessions-seen"
"""The gateways' report of the sessions they hold (never a node's call)."""
MAX_REPORT_SERIALS = 1000
VERSION_MAX = 64
_VERSION = re.compile(r"[\x20-\x7e]{1,64}")
_SERIAL = re.compile(r"[0-9a-f]{1,40}")  # a certificate serial: at most 20 octets


def printable_version(value: str) -> str:
    """A daemon version as the store keeps it: printable ASCII of at most
    :data:`VERSION_MAX` characters, else ``""`` (none named)."""
    return value if isinstance(value, str) and _VERSION.fullmatch(value) else ""


def encode_report(seen: Mapping[str, str]) -> bytes:
    """The report body: serials grouped by daemon version (a fleet runs few versions,
    so 1,000 serials fit the relay's 64 KiB body)."""
    groups: dict[str, list[str]] = {}
    for serial, version in seen.items():
        groups.setdefault(version, []).append(serial)
    body = {"sessions": [{"daemonVersion": v, "serials": s} for v, s in groups.items()]}
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def parse_report(obj: dict[str, Any]) -> dict[str, str]:
    """``{serial: daemon version}`` of a report body; INVALID_ARGUMENT for anything else."""
    groups = obj.get("sessions")
    if not isinstance(groups, list) or len(groups) > MAX_REPORT_SERIALS:
        raise invalid(f"sessions must be a list of at most {MAX_REPORT_SERIALS} groups")
    seen: dict[str, str] = {}
    for group in groups:
        if not isinstance(group, dict):
            raise invalid("each sessions group must be an object")
        version = group.get("daemonVersion", "")
        if not isinstance(version, str) or (version and not _VERSION.fullmatch(version)):
            raise invalid(f"daemonVersion must be printable ASCII of at most {VERSION_MAX}")
        serials = group.get("serials")
        if not isinstance(serials, list):
            raise invalid("serials must be a list")
        for serial in serials:
            if not isinstance(serial, str) or not _SERIAL.fullmatch(serial):
                raise invalid("each serial must be a certificate serial in lower-case hex")
            seen[serial] = version
            if len(seen) > MAX_REPORT_SERIALS:
                raise invalid(f"a report names at most {MAX_REPORT_SERIALS} serials")
    return seen


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def record_sessions(tx: Tx, seen: Mapping[str, str]) -> dict[str, int]:
    """Apply one report: last seen, daemon version and first-Hello adoption.

    Serials that are not a live certificate of a live node are ignored (a revocation
    or an expiry may have come between the session's open and its report).
    """
    if not seen:
        return {"seen": 0, "adopted": 0}
    if len(seen) > MAX_REPORT_SERIALS:
        raise invalid(f"a report names at most {MAX_REPORT_SERIALS} serials")
    now = tx.now_ms()
    serials = sorted(seen)
    rows = tx.query(
        "SELECT c.serial, n.id, n.tenant_id, n.pool_id, n.state, n.daemon_version "
        "FROM node_certs c JOIN nodes n ON n.id = c.node_id "
        f"WHERE c.serial IN ({_marks(len(serials))}) AND c.revoked_at IS NULL "
        "AND c.not_after > ? AND n.retired_at IS NULL "
        "AND c.identity_generation = n.identity_generation",
        [*serials, now],
    )
    if not rows:
        return {"seen": 0, "adopted": 0}
    node_ids = sorted({str(r["id"]) for r in rows})
    # lock in id order, so two gateways' overlapping reports never deadlock
    tx.query(f"SELECT id FROM nodes WHERE id IN ({_marks(len(node_ids))}) ORDER BY id"
             + tx.for_update, node_ids)  # fmt: skip
    tx.execute(
        f"UPDATE nodes SET last_seen_at = ? WHERE id IN ({_marks(len(node_ids))}) "
        "AND (last_seen_at IS NULL OR last_seen_at < ?)",
        [now, *node_ids, now],
    )
    changed: dict[str, list[str]] = {}
    for r in rows:
        version = seen[str(r["serial"])]
        if version and version != r["daemon_version"]:
            changed.setdefault(version, []).append(str(r["id"]))
    for version, ids in changed.items():
        unique = sorted(set(ids))
        tx.execute(
            f"UPDATE nodes SET daemon_version = ? WHERE id IN ({_marks(len(unique))})",
            [version, *unique],
        )
    adopted = _adopt_first_hellos(tx, [r for r in rows if r["state"] == "adopting"], now)
    return {"seen": len(node_ids), "adopted": adopted}


def _adopt_first_hellos(tx: Tx, rows: list[dict[str, Any]], now: int) -> int:
    """Adopt the ``adopting`` nodes of pools without acceptance checks."""
    if not rows:
        return 0
    pool_ids = sorted({str(r["pool_id"]) for r in rows})
    policies = {
        str(p["id"]): json.loads(p["policy"])
        for p in tx.query(
            f"SELECT id, policy FROM pools WHERE id IN ({_marks(len(pool_ids))})", pool_ids
        )
    }
    count = 0
    done: set[str] = set()
    for r in sorted(rows, key=lambda r: str(r["id"])):
        node_id = str(r["id"])
        policy = policies.get(str(r["pool_id"]), {})
        if node_id in done or (isinstance(policy, dict) and policy.get("acceptanceChecks")):
            continue
        done.add(node_id)
        if tx.execute(
            "UPDATE nodes SET state = 'adopted', updated_at = ? WHERE id = ? "
            "AND state = 'adopting'",
            (now, node_id),
        ):
            record_adopted(tx, str(r["tenant_id"]), node_id, "session", serial=str(r["serial"]))
            count += 1
    return count


def record_adopted(
    tx: Tx, tenant_id: str, node_id: str, by: str, *, serial: str | None = None
) -> None:
    """The ``node.adopted`` audit row and event (``by``: ``session``, its first Hello,
    or ``operator``, ``nodes adopt``)."""
    payload: dict[str, Any] = {"nodeId": node_id, "by": by}
    if serial is not None:
        payload["serial"] = serial
    events.audit(tx, tenant_id, "node.adopted", node_id, payload)
    events.publish(tx, tenant_id, "node.adopted", payload)
