"""What bcd believes when a gateway says its certificate is no longer accepted.

A gateway that only relays may lie (issue 11): it can send a revocation line or
answer ``UNAUTHENTICATED`` to make a node stop, and ``bcd node`` exits 1 then, which
systemd does not restart. So the node stops as revoked only on a RevocationNotice
signed under ``join_signing_key_pin`` that names this node and the certificate it
holds (:func:`bcd.wire.verify_revocation_notice`), made where the revocation was
made. Without one, an ``UNAUTHENTICATED`` for a certificate that has expired is
:class:`~bcd.errors.IdentityExpired` (exit 1, the doctor's way back); one whose
``reason`` is ``unknown-certificate`` is :class:`~bcd.errors.CertificateUnknown`
(the store has no row for this certificate: a control-plane database restored from
a backup older than it), logged with its own message, the serial and the way back,
and retried more slowly; anything else is a refusal to retry, logged, like a broken
session. Neither stops the node: a gateway could send either. The bound is the
certificate's own end: once it expires the agent stops with
:class:`~bcd.errors.IdentityExpired` (exit 1) and the same way back.
"""

from __future__ import annotations

import logging
from datetime import datetime

from bcd import wire
from bcd.errors import (
    BcdError,
    CertificateRevoked,
    CertificateUnknown,
    IdentityExpired,
    RetryableError,
)
from bcd.identity import AnyState

log = logging.getLogger("bcd.revocation")

EXPIRED_WAY_BACK = "join again as root: bcd join --reset --yes, then bcd join"
NOT_ACCEPTED = (
    "the gateway does not accept this node's certificate and sent no valid signed "
    "revocation notice; retrying (a restored control-plane backup may not know it)"
)
UNKNOWN_CERTIFICATE = "unknown-certificate"  # the UNAUTHENTICATED answer's reason
UNKNOWN_TEXT = "the control plane does not know this node's certificate"
UNKNOWN_CAUSE = "its database was probably restored from a backup older than this certificate"


def revoked_by(notice: object, signing_pin: str, state: AnyState) -> CertificateRevoked | None:
    """The revocation a notice proves for ``state``'s certificate, or None (logged,
    unless there was no notice at all: the caller's message says what was heard)."""
    if notice is None:
        return None
    try:
        verified = wire.verify_revocation_notice(
            notice, signing_pin, state.identity.node_id, [state.leaf_info.serial_hex]
        )
    except wire.WireError as exc:
        log.warning("a revocation notice that does not verify was ignored (%s)", exc)
        return None
    log.error(
        "certificate revoked (reason: %s, serial %s); signed by the control plane",
        verified.reason,
        verified.serial,
    )
    return CertificateRevoked(verified.reason)


def expired(state: AnyState, now: datetime) -> IdentityExpired | None:
    if not state.expired(now):
        return None
    return IdentityExpired(
        f"the certificate expired at {state.identity.not_after}; {EXPIRED_WAY_BACK}"
    )


def unknown(state: AnyState) -> CertificateUnknown:
    """The message for a certificate the control plane's store has no row for."""
    ident = state.identity
    return CertificateUnknown(
        f"{UNKNOWN_TEXT} (node {ident.node_id}, serial {state.leaf_info.serial_hex}): "
        f"{UNKNOWN_CAUSE}; bcd keeps retrying until the certificate expires at "
        f"{ident.not_after}; unless the operator restores a newer backup, {EXPIRED_WAY_BACK}"
    )


def judge_unauthenticated(
    notice: object, signing_pin: str, state: AnyState, now: datetime, reason: str | None = None
) -> BcdError:
    """What an UNAUTHENTICATED answer means for ``state``: revoked (a signed notice),
    expired (the certificate's time is over), unknown to the store (``reason``
    ``unknown-certificate``), else a refusal to retry."""
    return (
        revoked_by(notice, signing_pin, state)
        or expired(state, now)
        or (unknown(state) if reason == UNKNOWN_CERTIFICATE else RetryableError(NOT_ACCEPTED))
    )
