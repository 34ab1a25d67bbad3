"""Repositories: the SQL of admission, read into and written from frozen records.

JoinService, RenewService and the attestors' join context read what the admission
core (:mod:`control.admission`) judges through these functions and write what it
decided through them; no SQL of theirs lives elsewhere.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from cryptography import x509

from bcd import pki
from control import joinrequests, tenancy
from control.admission import CertFacts, NodeFacts, PoolFacts, RequestFacts
from control.errors import ControlError
from control.ids import new_id
from control.store import Row, Tx

CONCURRENT = "This machine joined concurrently; retry"


# --- pools --------------------------------------------------------------------------------


def pool_row(tx: Tx, pool_id: str) -> Row | None:
    return tx.one("SELECT * FROM pools WHERE id = ?", (pool_id,))


def platform_operated(tx: Tx, pool: Row) -> bool:
    """policy.kubernetes.platformOperated, and the platform owns the pool (seed)."""
    policy = json.loads(pool["policy"])
    kube = policy.get("kubernetes")
    if not isinstance(kube, dict) or kube.get("platformOperated") is not True:
        return False
    site = tx.one("SELECT tenant_id, custom FROM sites WHERE id = ?", (pool["site_id"],))
    if site is None or site["custom"] or site["tenant_id"] != pool["tenant_id"]:
        return False
    root = tenancy.root_tenant(tx)
    return root is None or root == pool["tenant_id"]


def pool_facts(tx: Tx, pool_id: str) -> PoolFacts | None:
    row = pool_row(tx, pool_id)
    if row is None:
        return None
    allowed = json.loads(row["policy"]).get("joinAttestors")
    return PoolFacts(
        pool_id=str(row["id"]),
        tenant_id=str(row["tenant_id"]),
        site_id=str(row["site_id"]),
        agent=str(row["agent"]),
        join_attestors=tuple(str(a) for a in allowed) if isinstance(allowed, list) else None,
        platform_operated=platform_operated(tx, row),
    )


# --- nodes --------------------------------------------------------------------------------


def latest_statements(tx: Tx, node_id: str) -> tuple[str, ...] | None:
    """The statements of the node's latest certificate (None: it has none). Two
    recorded in the same millisecond: the one with more statements (a TPM-bound node is
    never read as bare because of a tie)."""
    row = tx.one(
        "SELECT statements FROM node_certs WHERE node_id = ? "
        "ORDER BY identity_generation DESC, created_at DESC, length(statements) DESC LIMIT 1",
        (node_id,),
    )
    return None if row is None else tuple(json.loads(row["statements"]))


def _node_facts(tx: Tx, row: Row | None, statements: bool = True) -> NodeFacts | None:
    if row is None:
        return None
    cap = row.get("max_lifetime_s")
    return NodeFacts(
        node_id=str(row["id"]),
        tenant_id=str(row["tenant_id"]),
        site_id=str(row["site_id"]),
        pool_id=str(row["pool_id"]),
        role=str(row["role"]),
        identity_generation=int(row["identity_generation"]),
        retired=row["retired_at"] is not None,
        latest_statements=latest_statements(tx, str(row["id"])) if statements else None,
        max_lifetime_s=None if cap is None else int(cap),
    )


def lock_node(tx: Tx, node_id: str, *, statements: bool = True) -> NodeFacts | None:
    """The node, its row locked (revocations, reclaims and deletions lock it first).

    ``statements=False`` leaves ``latest_statements`` unread (None), one statement
    fewer: for a renewal, which takes the statements from the presented leaf and its
    row, never from the node."""
    row = tx.one("SELECT * FROM nodes WHERE id = ?" + tx.for_update, (node_id,))
    return _node_facts(tx, row, statements)


def read_node(tx: Tx, node_id: str, *, statements: bool = True) -> NodeFacts | None:
    """The node, its row not locked: for a judgement that writes nothing of it."""
    return _node_facts(tx, tx.one("SELECT * FROM nodes WHERE id = ?", (node_id,)), statements)


def lock_node_by_hardware(tx: Tx, hardware_key: str, tenant_id: str) -> NodeFacts | None:
    """The tenant's node with this trusted hardware key, its row locked."""
    row = tx.one(
        "SELECT * FROM nodes WHERE hardware_key = ? AND hardware_key_trusted = 1 "
        "AND tenant_id = ?" + tx.for_update,
        (hardware_key, tenant_id),
    )
    return _node_facts(tx, row)


def lock_reclaim_target(tx: Tx, lookup: tuple[str, str] | None, tenant_id: str) -> NodeFacts | None:
    """The node :func:`control.admission.reclaim_lookup` names, locked."""
    if lookup is None:
        return None
    kind, key = lookup
    return lock_node(tx, key) if kind == "id" else lock_node_by_hardware(tx, key, tenant_id)


def insert_node(
    tx: Tx,
    *,
    tenant_id: str,
    site_id: str,
    pool_id: str,
    role: str,
    hardware_key: str | None,
    hardware_key_trusted: bool,
    claims: dict[str, Any],
    attestor: str,
    max_lifetime_s: int | None,
    daemon_version: str = "",
) -> str:
    """A new node, ``adopting``, identity generation 1; returns its id. ``daemon_version``:
    the join request's (``""``: none named), until a session's Hello names one."""
    node_id = new_id("node")
    now_ms = tx.now_ms()
    tx.defer(
        "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, "
        "identity_generation, hardware_key, hardware_key_trusted, claims, attestor, "
        "max_lifetime_s, daemon_version, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, 'adopting', 1, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            node_id,
            tenant_id,
            site_id,
            pool_id,
            role,
            hardware_key,
            1 if hardware_key_trusted else 0,
            json.dumps(claims, sort_keys=True),
            attestor,
            max_lifetime_s,
            daemon_version or None,
            now_ms,
            now_ms,
        ),
    )
    return node_id


def rejoin_node(
    tx: Tx,
    node_id: str,
    *,
    generation: int,
    role: str,
    claims: dict[str, Any],
    attestor: str,
    max_lifetime_s: int | None,
    daemon_version: str = "",
) -> None:
    """A reclaimed or re-joined node: its new identity generation, ``adopting`` again
    (a ``revoked`` or ``adopted`` one too; its next session's Hello may adopt it)."""
    tx.execute(
        "UPDATE nodes SET identity_generation = ?, state = 'adopting', role = ?, "
        "claims = ?, attestor = ?, max_lifetime_s = ?, "
        "daemon_version = COALESCE(?, daemon_version), updated_at = ? WHERE id = ?",
        (
            generation,
            role,
            json.dumps(claims, sort_keys=True),
            attestor,
            max_lifetime_s,
            daemon_version or None,
            tx.now_ms(),
            node_id,
        ),
    )


def shared_key_nodes(tx: Tx, hardware_key: str, tenant_id: str) -> list[Row]:
    """Live nodes of other tenants claiming the same trusted hardware key (at most 10):
    one seek of ``nodes_hardware_key`` (migration 13). Before it, the only index on the
    key was (tenant_id, hardware_key), and PostgreSQL walked all of it, one entry per
    node, on every join (7.9 ms at 40,000 nodes)."""
    return tx.query(
        "SELECT id, tenant_id FROM nodes "
        "WHERE hardware_key = ? AND hardware_key_trusted = 1 AND tenant_id <> ? "
        "AND retired_at IS NULL ORDER BY created_at, id LIMIT 10",
        (hardware_key, tenant_id),
    )


# --- join requests ------------------------------------------------------------------------


def request_facts(row: Row | None, now_ms: int) -> RequestFacts | None:
    if row is None:
        return None
    return RequestFacts(
        request_id=str(row["id"]),
        state=str(row["state"]),
        csr_sha256=str(row["csr_sha256"]),
        pool_id=None if row["pool_id"] is None else str(row["pool_id"]),
        usable=joinrequests.usable(row, now_ms),
        consumed=row["consumed_at"] is not None,
    )


def lock_join_request(tx: Tx, request_id: str, attestor: str) -> RequestFacts | None:
    row = tx.one(
        "SELECT * FROM join_requests WHERE id = ? AND attestor = ?" + tx.for_update,
        (request_id, attestor),
    )
    return request_facts(row, tx.now_ms())


# --- node certificates --------------------------------------------------------------------


_CERT_ROW = "SELECT * FROM node_certs WHERE serial = ?"
_CERT_ROW_AND_NODE = (
    "SELECT c.*, n.id AS node_found, n.retired_at AS node_retired_at "
    "FROM node_certs c LEFT JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?"
)


def cert_row(
    tx: Tx, der: bytes | None, serial: str | None = None, *, with_node: bool = False
) -> Row | None:
    """The node_certs row whose DER is byte for byte ``der``, else None (``serial``:
    the certificate's, when the caller parsed it already). ``with_node``: in the same
    statement, its node's ``node_found`` (its id, None when there is no such node) and
    ``node_retired_at``."""
    if der is None:
        return None
    if serial is None:
        try:
            serial = format(x509.load_der_x509_certificate(der).serial_number, "x")
        except (ValueError, x509.InvalidVersion):
            return None
    row = tx.one(_CERT_ROW_AND_NODE if with_node else _CERT_ROW, (serial,))
    if row is None or base64.b64decode(row["der"]) != der:
        return None
    return row


def cert_facts(row: Row | None) -> CertFacts | None:
    if row is None:
        return None
    return CertFacts(
        serial=str(row["serial"]),
        node_id=str(row["node_id"]),
        identity_generation=int(row["identity_generation"]),
        role=str(row["role"]),
        allowed_kinds=tuple(json.loads(row["allowed_kinds"])),
        not_after_ms=int(row["not_after"]),
        revoked=row["revoked_at"] is not None,
    )


def cert_by_serial(tx: Tx, serial: str) -> Row | None:
    return tx.one("SELECT * FROM node_certs WHERE serial = ?", (serial,))


def record_leaf(
    tx: Tx,
    info: pki.LeafInfo,
    der: bytes,
    node_id: str,
    generation: int,
    role: str,
    allowed_kinds: Sequence[str],
) -> None:
    """Record an issued leaf as a node_certs row."""
    tx.defer(
        "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, "
        "statements, allowed_kinds, not_before, not_after, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            info.serial_hex,
            node_id,
            generation,
            role,
            info.spki_sha256,
            base64.b64encode(der).decode("ascii"),
            json.dumps(list(info.statements)),
            json.dumps(list(allowed_kinds)),
            int(info.not_before.timestamp() * 1000),
            int(info.not_after.timestamp() * 1000),
            tx.now_ms(),
        ),
    )


def recent_live_cert_for_key(tx: Tx, spki_sha256: str, attestor: str, since_ms: int) -> Row | None:
    """A live certificate for this key, recorded after ``since_ms``, of its node's current
    generation, of a node the attestor admitted (a join whose answer was lost)."""
    return tx.one(
        "SELECT c.der, c.role, c.identity_generation FROM node_certs c "
        "JOIN nodes n ON n.id = c.node_id WHERE c.spki_sha256 = ? "
        "AND c.revoked_at IS NULL AND c.created_at > ? AND c.not_after > ? "
        "AND n.retired_at IS NULL AND n.identity_generation = c.identity_generation "
        "AND n.attestor = ? ORDER BY c.created_at DESC LIMIT 1",
        (spki_sha256, since_ms, tx.now_ms(), attestor),
    )


def consumed_or_conflict(changed: int) -> None:
    """A locked, checked row must change exactly once."""
    if changed != 1:  # pragma: no cover - the row is locked and was checked
        raise ControlError("CONFLICT", CONCURRENT)
