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
:data:`MAX_REPORT_SERIALS` serials, applied in one transaction, and costs what it
changes. Last seen is written only once the stored one is :data:`LAST_SEEN_FRESH_MS`
old, so a node seen less than that ago, of an unchanged daemon version, with nothing
to adopt, is read (one SELECT) and neither locked nor written: a session opened
again within the minute (a reconnect, a renewal's new certificate, a session moved
to another gateway) costs no write; the 5-minute re-report of a live session writes
its last seen. The nodes that change are locked in id order (PostgreSQL; two
gateways' overlapping reports never deadlock), decided again on their locked rows,
and written by one UPDATE for all of them (last seen, daemon version, and the
adoption of the nodes still ``adopting`` in a pool without ``acceptanceChecks``: the
node's first Hello adopts it; docs/operators.md), with one INSERT of their
``node.adopted`` audit rows and one of their events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from control import events
from control.errors import invalid
from control.store import Tx, marks

SESSIONS_PATH = "/v1/internal/sessions-seen"
"""The gateways' report of the sessions they hold (never a node's call)."""
MAX_REPORT_SERIALS = 1000
LAST_SEEN_FRESH_MS = 60_000
"""A node's last seen is written again only once the stored one is this old (or
when the node is written anyway): it lags the latest report by less than a minute."""
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


@dataclass
class _Write:
    """What one report changes of one node (``None``: nothing of that)."""

    last_seen: int | None = None
    version: str | None = None
    adopt_serial: str | None = None


def _write_of(
    row: Mapping[str, Any], versions: list[str], adoptable: bool, now: int, serial: str
) -> _Write | None:
    """What to write of ``row`` (its current values), or None: nothing new.

    Last seen moves only forward, and only when the stored one is at least
    :data:`LAST_SEEN_FRESH_MS` old (or when the row is written anyway); the version only
    when a report names another one; adoption only from ``adopting``."""
    write = _Write()
    version = next((v for v in reversed(versions) if v), "")
    if version and version != row["daemon_version"]:
        write.version = version
    if adoptable and row["state"] == "adopting":
        write.adopt_serial = serial
    seen_at = row["last_seen_at"]
    stale = seen_at is None or int(seen_at) <= now - LAST_SEEN_FRESH_MS
    changes = write.version is not None or write.adopt_serial is not None
    if stale or (changes and int(seen_at) < now):
        write.last_seen = now
    if write.last_seen is None and not changes:
        return None
    return write


def record_sessions(tx: Tx, seen: Mapping[str, str]) -> dict[str, int]:
    """Apply one report: last seen, daemon version and first-Hello adoption.

    Serials that are not a live certificate of a live node are ignored (a revocation
    or an expiry may have come between the session's open and its report). A report
    that changes nothing (every node seen less than :data:`LAST_SEEN_FRESH_MS` ago,
    its version unchanged, nothing to adopt) only reads: the live certificates'
    SELECT (and the pools of nodes still ``adopting``); no row lock, no write.
    ``seen`` counts the live nodes named, written or not.
    """
    if not seen:
        return {"seen": 0, "adopted": 0}
    if len(seen) > MAX_REPORT_SERIALS:
        raise invalid(f"a report names at most {MAX_REPORT_SERIALS} serials")
    now = tx.now_ms()
    serials = sorted(seen)
    rows = tx.query(
        "SELECT c.serial, n.id, n.tenant_id, n.pool_id, n.state, n.identity_generation, "
        "n.daemon_version, n.last_seen_at "
        "FROM node_certs c JOIN nodes n ON n.id = c.node_id "
        f"WHERE c.serial IN ({marks(len(serials))}) AND c.revoked_at IS NULL "
        "AND c.not_after > ? AND n.retired_at IS NULL "
        "AND c.identity_generation = n.identity_generation",
        [*serials, now],
    )
    if not rows:
        return {"seen": 0, "adopted": 0}
    # per node: its row as read, the versions and the (lowest) serial reported
    nodes: dict[str, dict[str, Any]] = {}
    versions: dict[str, list[str]] = {}
    first_serial: dict[str, str] = {}
    for r in sorted(rows, key=lambda r: str(r["serial"])):
        node_id = str(r["id"])
        nodes.setdefault(node_id, r)
        versions.setdefault(node_id, []).append(seen[str(r["serial"])])
        first_serial.setdefault(node_id, str(r["serial"]))
    adoptable = _adoptable_pools(tx, [r for r in nodes.values() if r["state"] == "adopting"])

    def writes_of(current: Mapping[str, Mapping[str, Any]]) -> dict[str, _Write]:
        out: dict[str, _Write] = {}
        for node_id, row in current.items():
            write = _write_of(row, versions[node_id], str(row["pool_id"]) in adoptable, now,
                              first_serial[node_id])  # fmt: skip
            if write is not None:
                out[node_id] = write
        return out

    writes = writes_of(nodes)
    if writes and tx.for_update:
        # PostgreSQL: lock in id order, so two gateways' overlapping reports never
        # deadlock, and decide again on the rows as they are under the lock (a
        # revocation, a reclaim or another report may have come since the SELECT).
        # SQLite's transaction holds the database's write lock from its start.
        ids = sorted(writes)
        locked = tx.query(
            "SELECT id, tenant_id, pool_id, state, identity_generation, daemon_version, "
            f"last_seen_at, retired_at FROM nodes WHERE id IN ({marks(len(ids))}) "
            "ORDER BY id" + tx.for_update,
            ids,
        )
        writes = writes_of({
            str(r["id"]): r for r in locked
            if r["retired_at"] is None and r["state"] != "revoked"
            and r["identity_generation"] == nodes[str(r["id"])]["identity_generation"]
        })  # fmt: skip
    if writes:
        _write(tx, writes, now)
    adopted = sorted((node_id, w.adopt_serial) for node_id, w in writes.items() if w.adopt_serial)
    if adopted:
        _record_adoptions(
            tx, [(str(nodes[node_id]["tenant_id"]), node_id, serial) for node_id, serial in adopted]
        )
    return {"seen": len(nodes), "adopted": len(adopted)}


def _adoptable_pools(tx: Tx, adopting: list[Mapping[str, Any]]) -> set[str]:
    """The pools of ``adopting`` nodes whose policy has no truthy ``acceptanceChecks``."""
    if not adopting:
        return set()
    pool_ids = sorted({str(r["pool_id"]) for r in adopting})
    out: set[str] = set()
    for p in tx.query(
        f"SELECT id, policy FROM pools WHERE id IN ({marks(len(pool_ids))})", pool_ids
    ):
        policy = json.loads(p["policy"])
        if not (isinstance(policy, dict) and policy.get("acceptanceChecks")):
            out.add(str(p["id"]))
    return out


def _write(tx: Tx, writes: Mapping[str, _Write], now: int) -> None:
    """One UPDATE for every node written: last seen, versions and adoptions (the same
    statement on SQLite and PostgreSQL: a column every written node takes is set
    plainly, else a CASE by id)."""
    ids = sorted(writes)
    groups: dict[str, dict[Any, list[str]]] = {}
    for node_id in ids:
        w = writes[node_id]
        if w.last_seen is not None:
            groups.setdefault("last_seen_at", {}).setdefault(w.last_seen, []).append(node_id)
        if w.version is not None:
            groups.setdefault("daemon_version", {}).setdefault(w.version, []).append(node_id)
        if w.adopt_serial is not None:
            groups.setdefault("state", {}).setdefault("adopted", []).append(node_id)
            groups.setdefault("updated_at", {}).setdefault(now, []).append(node_id)
    sets: list[str] = []
    params: list[Any] = []
    for column, by_value in groups.items():
        if len(by_value) == 1 and len(next(iter(by_value.values()))) == len(ids):
            sets.append(f"{column} = ?")
            params += list(by_value)
            continue
        cases = "".join(f" WHEN id IN ({marks(len(of))}) THEN ?" for of in by_value.values())
        sets.append(f"{column} = CASE{cases} ELSE {column} END")
        for value, of in by_value.items():
            params += [*of, value]
    tx.execute(
        f"UPDATE nodes SET {', '.join(sets)} WHERE id IN ({marks(len(ids))})", [*params, *ids]
    )


def _record_adoptions(tx: Tx, adopted: list[tuple[str, str, str]]) -> None:
    """The ``node.adopted`` audit rows and events of first Hellos (tenant, node,
    serial): :func:`record_adopted`'s rows, one INSERT of each for the whole report."""
    payloads = [(tenant_id, _adopted_payload(node_id, "session", serial))
                for tenant_id, node_id, serial in adopted]  # fmt: skip
    events.audit_many(tx, [(t, "node.adopted", p["nodeId"], p) for t, p in payloads])
    events.publish_many(tx, [(t, "node.adopted", p) for t, p in payloads])


def _adopted_payload(node_id: str, by: str, serial: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"nodeId": node_id, "by": by}
    if serial is not None:
        payload["serial"] = serial
    return payload


def record_adopted(
    tx: Tx, tenant_id: str, node_id: str, by: str, *, serial: str | None = None
) -> None:
    """The ``node.adopted`` audit row and event (``by``: ``session``, its first Hello,
    or ``operator``, ``nodes adopt``)."""
    payload = _adopted_payload(node_id, by, serial)
    events.audit(tx, tenant_id, "node.adopted", node_id, payload)
    events.publish(tx, tenant_id, "node.adopted", payload)
