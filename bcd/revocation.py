"""What bcd believes when a gateway says its certificate is no longer accepted.

A gateway that only relays may lie (issue 11): it can send a revocation line or
answer ``UNAUTHENTICATED`` to make a node stop, and ``bcd node`` exits 1 then, which
systemd does not restart. So the node stops as revoked only on a RevocationNotice
signed under ``join_signing_key_pin`` that names this node and the certificate it
holds (:func:`bcd.wire.verify_revocation_notice`), made where the revocation was
made. Without one, an ``UNAUTHENTICATED`` for a certificate that has expired is
:class:`~bcd.errors.IdentityExpired` (exit 1, the doctor's way back); anything else
is a refusal to retry, logged, like a broken session.
"""

from __future__ import annotations

import logging
from datetime import datetime

from bcd import wire
from bcd.errors import BcdError, CertificateRevoked, IdentityExpired, RetryableError
from bcd.identity import AnyState

log = logging.getLogger("bcd.revocation")

EXPIRED_WAY_BACK = "join again as root: bcd join --reset --yes, then bcd join"
NOT_ACCEPTED = (
    "the gateway does not accept this node's certificate and sent no valid signed "
    "revocation notice; retrying (a restored control-plane backup may not know it)"
)


def revoked_by(notice: object, signing_pin: str, state: AnyState) -> CertificateRevoked | None:
    """The revocation a notice proves for ``state``'s certificate, or None (logged)."""
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


def judge_unauthenticated(
    notice: object, signing_pin: str, state: AnyState, now: datetime
) -> BcdError:
    """What an UNAUTHENTICATED answer means for ``state``: revoked (a signed notice),
    expired (the certificate's time is over), else a refusal to retry."""
    return (
        revoked_by(notice, signing_pin, state)
        or expired(state, now)
        or RetryableError(NOT_ACCEPTED)
    )
