"""Issuing and revoking node certificates: what Join and Renew share.

The PKI JoinService needs (:class:`JoinCrypto`), a leaf issued at ``compute_now()``
and recorded as a node_certs row, the signed ``joined`` / ``renewed`` answer,
revocation with its signed RevocationNotice, and the refusal event written after
the rollback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from control import admission, events, repos, tenancy
from control.admission import CERT_TTL_MAX_S
from control.errors import Refused
from control.pkiseal import SealOpener
from control.store import Store, Tx

log = logging.getLogger("control.joinservice")

IssueLeaf = Callable[
    [ec.EllipticCurvePublicKey, pki.SpiffeId, str, tuple[str, ...], datetime, int],
    x509.Certificate,
]


@dataclass(frozen=True)  # not slots: the cached properties need a __dict__
class JoinCrypto:
    """pkiJoinCrypto: what JoinService needs of the PKI (the seed's ``pki.join``)."""

    trust_domain: str
    signing_key: ec.EllipticCurvePrivateKey
    encryption_key: ec.EllipticCurvePrivateKey
    issue_leaf: IssueLeaf
    chain_tail_pem: str
    bundle_pem: str
    trust_version: int
    cert_ttl_s: int = CERT_TTL_MAX_S

    @functools.cached_property
    def encryption_pin(self) -> str:
        return pki.spki_pin(self.encryption_key.public_key())

    @functools.cached_property
    def decryption_jwk(self) -> Any:
        return wire.decryption_jwk(self.encryption_key)

    @functools.cached_property
    def seal_opener(self) -> SealOpener:
        """Opens sealed tokens on ``cryptography`` alone (:mod:`control.pkiseal`)."""
        return SealOpener(self.encryption_key, self.encryption_pin)


def leaf_ttl_s(crypto: JoinCrypto, role: str, cap_s: int | None = None) -> int:
    return admission.lifetime_s(crypto.cert_ttl_s, role, cap_s)


def issue_recorded_leaf(
    tx: Tx,
    crypto: JoinCrypto,
    public_key: ec.EllipticCurvePublicKey,
    spiffe: pki.SpiffeId,
    role: str,
    statements: Sequence[str],
    allowed_kinds: Sequence[str],
    generation: int,
    max_lifetime_s: int | None = None,
) -> tuple[x509.Certificate, pki.LeafInfo]:
    """Issue a node leaf valid from ``compute_now()`` and record it as a node_certs row."""
    now = datetime.fromtimestamp(tx.now_ms() / 1000, UTC)
    ttl = leaf_ttl_s(crypto, role, max_lifetime_s)
    leaf = crypto.issue_leaf(public_key, spiffe, role, tuple(statements), now, ttl)
    # What the leaf carries is what was just put in it: not parsed back out of it.
    info = pki.LeafInfo(
        spiffe=spiffe,
        role=role,
        statements=tuple(statements),
        not_before=leaf.not_valid_before_utc,
        not_after=leaf.not_valid_after_utc,
        serial_hex=format(leaf.serial_number, "x"),
        spki_sha256=pki.sha256_hex(pki.spki_der(public_key)),
    )
    der = leaf.public_bytes(serialization.Encoding.DER)
    repos.record_leaf(tx, info, der, spiffe.node_id, generation, role, allowed_kinds)
    return leaf, info


def signed_identity(
    crypto: JoinCrypto,
    kind: str,
    spiffe: pki.SpiffeId,
    role: str,
    leaf: x509.Certificate,
    csr_sha256: str,
    server_time_ms: int,
    generation: int,
) -> str:
    """The SignedResponse of a ``joined`` or ``renewed`` answer."""
    body = {
        "kind": kind,
        "node_id": spiffe.node_id,
        "site_id": spiffe.site_id,
        "role": role,
        "trust_domain": crypto.trust_domain,
        "chain": pki.cert_pem(leaf) + crypto.chain_tail_pem,
        "bundle": crypto.bundle_pem,
        "trust_version": crypto.trust_version,
        "csr_sha256": csr_sha256,
        "server_time": server_time_ms,
        "identity_generation": generation,
    }
    return wire.sign_response(body, crypto.signing_key)


NoticeSigner = Callable[[dict[str, Any]], str]
"""Signs a RevocationNotice body (bcd.wire.revocation_notice_body) under the join-signing key."""


def notice_signer(signing_key: ec.EllipticCurvePrivateKey) -> NoticeSigner:
    return lambda body: wire.sign_response(body, signing_key)


def revoke_node_certs(
    tx: Tx, tenant_id: str, node_id: str, reason: str, sign_notice: NoticeSigner
) -> list[str]:
    """Revoke every live certificate of a node, with a security.certificate-revoked event each.

    Each revocation stores its signed RevocationNotice (``revoke_notice``), made here,
    where the join-signing key is: the gateways push it as it is, and bcd believes
    only a notice that verifies under its pin. Returns the serials it revoked (none
    when every certificate already was).
    """
    rows = tx.query(
        "SELECT serial FROM node_certs WHERE node_id = ? AND revoked_at IS NULL ORDER BY serial",
        (node_id,),
    )
    tx.revoked = tx.revoked or bool(rows)
    for row in rows:
        now_ms = tx.now_ms()
        notice = sign_notice(wire.revocation_notice_body(node_id, row["serial"], reason, now_ms))
        tx.execute(
            "UPDATE node_certs SET revoked_at = ?, revoke_reason = ?, revoke_notice = ? "
            "WHERE serial = ?",
            (now_ms, reason, notice, row["serial"]),
        )
        events.publish(
            tx,
            tenant_id,
            "security.certificate-revoked",
            {"nodeId": node_id, "serial": row["serial"], "reason": reason},
        )
    return [str(row["serial"]) for row in rows]


def record_refusal(
    store: Store, refusal: Refused, type_: str, rate_key: str, payload: dict[str, Any]
) -> None:
    """Publish a refusal event after the rollback, rate-limited per tenant and ``rate_key``.

    It goes to ``refusal.tenant_id`` when set (the caller proved a secret or key),
    else to the root tenant. The budget is per receiving tenant, so one tenant's
    refusals neither use up another's nor show in its ``suppressed`` counts. A
    failure here is logged, never raised: the refusal itself must still reach the
    caller.
    """
    try:
        with store.tx() as tx:
            tenant = refusal.tenant_id or tenancy.root_tenant(tx)
            if tenant is None:
                log.warning("%s (%s) and no root tenant to tell", type_, refusal.reason)
                return
            events.publish_rate_limited(tx, tenant, type_, f"{tenant}|{rate_key}", payload)
    except Exception:
        log.exception("could not record a refusal (%s)", type_)
