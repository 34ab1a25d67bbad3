"""Discovery vouches: a site agent's word that a machine booted on its site (issue 5).

A site agent (a node of role ``site``, joined with ``bcd join --role site`` and a
site token) tells the gateway, over mutual TLS with its own certificate, that a
machine with this MAC booted on its site: ``POST /v1/discovery/vouch`` with
``{"mac", "boot_lease_epoch", "ip"?, "workflow_id"?}`` (``bcd vouch`` sends it).
The vouch is stored per site and MAC: a newer boot (a larger ``boot_lease_epoch``)
replaces the vouch and makes it usable again, the same boot refreshes its expiry, an
older boot is refused. A vouch counts for :data:`VOUCH_TTL_MS` after it was made
and admits one join (the discovery attestor consumes it in the join transaction).
A site agent may vouch :data:`VOUCHES_PER_MINUTE` times a minute.

Everything the body says is untrusted: :func:`parse_vouch` is a pure function.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import hardware, pki, wire
from bcd.attestor_api import VouchRecord
from control import events
from control.admission import clock_skewed
from control.errors import ControlError, invalid
from control.ids import iso, new_id
from control.proofs import proof_sha256, spend_proof
from control.store import Row, Tx

VOUCH_PATH = "/v1/discovery/vouch"
VOUCH_TTL_MS = 30 * 60 * 1000
VOUCHES_PER_MINUTE = 600
"""Per site agent: a DHCP server hands out leases far slower; more is a broken or
hostile agent filling the table, answered RESOURCE_EXHAUSTED with a pushback."""
SITE_ROLE = "site"
_WORKFLOW = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")
_EPOCH_MAX = 2**53 - 1
_FIELDS = frozenset({"mac", "ip", "boot_lease_epoch", "workflow_id"})


@dataclass(frozen=True, slots=True)
class Vouch:
    mac: str
    boot_lease_epoch: int
    ip: str | None = None
    workflow_id: str | None = None


def parse_vouch(obj: object) -> Vouch:
    """The body of a vouch; raises ControlError INVALID_ARGUMENT naming what is wrong."""
    if not isinstance(obj, dict):
        raise invalid("a vouch must be a JSON object")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise invalid(f"unknown vouch field {sorted(unknown)[0]!r}")
    mac = hardware.normalize_mac(obj.get("mac"))
    if mac is None:
        raise invalid(
            "mac must be a permanent, globally administered unicast MAC such as 0c:c4:7a:12:34:56"
        )
    epoch = obj.get("boot_lease_epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 < epoch <= _EPOCH_MAX:
        raise invalid("boot_lease_epoch must be a positive integer (the boot's DHCP lease time)")
    ip = obj.get("ip")
    if ip is not None:
        try:
            ip = str(ipaddress.ip_address(ip)) if isinstance(ip, str) else None
        except ValueError:
            ip = None
        if ip is None:
            raise invalid("ip must be an IPv4 or IPv6 address")
    workflow = obj.get("workflow_id")
    if workflow is not None and (not isinstance(workflow, str) or not _WORKFLOW.match(workflow)):
        raise invalid("workflow_id must be 1 to 128 of A-Z a-z 0-9 . _ : / -")
    return Vouch(mac=mac, boot_lease_epoch=epoch, ip=ip, workflow_id=workflow)


def as_record(row: Row) -> VouchRecord:
    return VouchRecord(
        vouch_id=str(row["id"]),
        site_id=str(row["site_id"]),
        mac=str(row["mac"]),
        ip=row["ip"],
        workflow_id=row["workflow_id"],
        vouched_by=str(row["vouched_by"]),
        boot_lease_epoch=int(row["boot_lease_epoch"]),
        expires_at_ms=int(row["expires_at"]),
        used=row["used_at"] is not None,
    )


def lock_vouch(tx: Tx, site_id: str, mac: str) -> VouchRecord | None:
    row = tx.one(
        "SELECT * FROM discovery_vouches WHERE site_id = ? AND mac = ?" + tx.for_update,
        (site_id, mac),
    )
    return None if row is None else as_record(row)


def consume_vouch(tx: Tx, vouch_id: str) -> None:
    changed = tx.execute(
        "UPDATE discovery_vouches SET used_at = ? WHERE id = ? AND used_at IS NULL",
        (tx.now_ms(), vouch_id),
    )
    if changed != 1:
        raise ControlError("CONFLICT", "this vouch was used concurrently; retry")


@dataclass(frozen=True)
class VouchProof:
    """A vouch's proof of possession, checked against the site agent's certificate."""

    fields: dict[str, Any]
    client_time_ms: int
    proof_sha256: str
    valid: bool


def parse_vouch_proof(obj: dict[str, Any], node_id: str, peer_der: bytes | None) -> VouchProof:
    """Split ``client_time`` and ``pop_sig`` off a vouch body and check the signature
    (pure CPU, before any transaction); the clock and replay are judged in it."""
    fields = {k: v for k, v in obj.items() if k not in ("client_time", "pop_sig")}
    client_time = obj.get("client_time")
    pop = obj.get("pop_sig")
    if not isinstance(client_time, int) or isinstance(client_time, bool) or client_time < 0:
        raise invalid("client_time must be unix milliseconds (bcd vouch sends it)")
    if not isinstance(pop, str) or len(pop) > 128:
        raise invalid("pop_sig must be the site agent's signature (bcd vouch sends it)")
    try:
        sig = pki.b64url_decode(pop)
        cert = x509.load_der_x509_certificate(peer_der or b"")
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise pki.PkiError("not an EC key")
        message = pki.vouch_pop_message(wire.dumps(fields), node_id, client_time)
        pki.verify_p1363(key, sig, message)
        valid = True
    except (pki.PkiError, ValueError):
        valid, sig = False, pop.encode()
    return VouchProof(fields, client_time, proof_sha256(sig), valid)


def record_vouch(
    tx: Tx, site_agent_id: str, vouch: Vouch, proof: VouchProof | None = None
) -> dict[str, Any]:
    """Store ``vouch`` from the site agent ``site_agent_id`` (a live certificate's node).

    Only a node of role ``site`` that is not retired may vouch, and only for its own
    site, with a fresh proof of possession of its key (``proof``: within 60 s of
    ``compute_now()``, not accepted in the last 120 s, and valid). Returns the stored
    vouch as the gateway answers it.
    """
    agent = tx.one("SELECT * FROM nodes WHERE id = ?", (site_agent_id,))
    if agent is None or agent["role"] != SITE_ROLE or agent["retired_at"] is not None:
        raise ControlError("ACCESS_DENIED", "only a site agent may vouch for machines")
    site_id = str(agent["site_id"])
    now_ms = tx.now_ms()
    if proof is not None:
        if clock_skewed(proof.client_time_ms, now_ms):
            raise ControlError(
                "ACCESS_DENIED", "the vouch's client_time is more than 60 s off; check the clock"
            )
        if not proof.valid:
            raise ControlError("ACCESS_DENIED", "the vouch's proof of possession does not verify")
        if not spend_proof(tx, proof.proof_sha256, site_agent_id, now_ms):
            raise ControlError("ACCESS_DENIED", "this vouch was already accepted (a replay)")
    expires = now_ms + VOUCH_TTL_MS
    tx.execute(
        "DELETE FROM discovery_vouch_calls WHERE vouched_by = ? AND at <= ?",
        (site_agent_id, now_ms - 60_000),
    )
    recent = tx.query(
        "SELECT at FROM discovery_vouch_calls WHERE vouched_by = ? ORDER BY at LIMIT ?",
        (site_agent_id, VOUCHES_PER_MINUTE),
    )
    if len(recent) >= VOUCHES_PER_MINUTE:
        raise ControlError(
            "RESOURCE_EXHAUSTED",
            f"at most {VOUCHES_PER_MINUTE} vouches per site agent and minute",
            retry_after_ms=max(1, int(recent[0]["at"]) + 60_000 - now_ms),
        )
    tx.execute(
        "INSERT INTO discovery_vouch_calls (vouched_by, at) VALUES (?, ?)",
        (site_agent_id, now_ms),
    )
    row = tx.one(
        "SELECT * FROM discovery_vouches WHERE site_id = ? AND mac = ?" + tx.for_update,
        (site_id, vouch.mac),
    )
    if row is not None and vouch.boot_lease_epoch < int(row["boot_lease_epoch"]):
        raise ControlError(
            "INVALID_STATE",
            f"a newer boot of {vouch.mac} was already vouched for (boot_lease_epoch "
            f"{row['boot_lease_epoch']})",
        )
    values = (vouch.ip, vouch.workflow_id, site_agent_id, vouch.boot_lease_epoch, now_ms, expires)
    if row is None:
        vouch_id = new_id("dv")
        tx.execute(
            "INSERT INTO discovery_vouches (id, site_id, mac, ip, workflow_id, vouched_by, "
            "boot_lease_epoch, created_at, updated_at, expires_at, used_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
            (vouch_id, site_id, vouch.mac, *values[:4], now_ms, now_ms, expires),
        )
    elif vouch.boot_lease_epoch > int(row["boot_lease_epoch"]):
        vouch_id = new_id("dv")  # a new boot: a new vouch, usable again
        tx.execute(
            "UPDATE discovery_vouches SET id = ?, ip = ?, workflow_id = ?, vouched_by = ?, "
            "boot_lease_epoch = ?, created_at = ?, updated_at = ?, expires_at = ?, "
            "used_at = NULL WHERE site_id = ? AND mac = ?",
            (vouch_id, *values[:5], now_ms, expires, site_id, vouch.mac),
        )
    else:
        vouch_id = str(row["id"])  # the same boot again (a DHCP renewal): refresh only
        tx.execute(
            "UPDATE discovery_vouches SET ip = ?, workflow_id = ?, vouched_by = ?, "
            "updated_at = ?, expires_at = ? WHERE id = ?",
            (vouch.ip, vouch.workflow_id, site_agent_id, now_ms, expires, vouch_id),
        )
    events.publish(
        tx,
        str(agent["tenant_id"]),
        "discovery.vouched",
        {
            "vouchId": vouch_id,
            "siteId": site_id,
            "mac": vouch.mac,
            "ip": vouch.ip,
            "vouchedBy": site_agent_id,
            "bootLeaseEpoch": vouch.boot_lease_epoch,
        },
    )
    return {
        "vouch_id": vouch_id,
        "site_id": site_id,
        "mac": vouch.mac,
        "boot_lease_epoch": vouch.boot_lease_epoch,
        "expires_at": iso(expires),
    }
