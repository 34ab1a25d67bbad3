"""The checks on an issued certificate, shared by the join and the renewal (seed 003).

An answer is checked in the seed's order: the signature under the pinned
join-signing key (:func:`verify_signed`, which parses the body once into a
:class:`~bcd.signed.Issued`, :class:`~bcd.signed.Challenge` or
:class:`~bcd.signed.Pending`), then :func:`check_issued`: that ``csr_sha256`` is this
request's, that the leaf certifies this key, the SPIFFE ID, and the role. A renewal's
answer (:func:`verify_renewed`) must also be of kind ``renewed`` and name the current
leaf's node, site, trust domain and role. :func:`issued_identity` is the Identity to
store. All pure; every refusal is a :class:`~bcd.errors.JoinError`.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from bcd.errors import JoinError
from bcd.identity import Identity, KeyKind, format_time, make_identity


def verify_signed(signed: str, *, signing_pin: str, what: str = "join") -> wire.SignedBody:
    """Check a SignedResponse's signature under the pinned join-signing key; its typed body."""
    try:
        return wire.parse_signed_body(wire.verify_response(signed, signing_pin))
    except wire.MalformedChallenge as exc:
        raise JoinError(str(exc)) from exc
    except wire.WireError as exc:
        raise JoinError(f"the {what} answer does not verify: {exc}") from exc


def check_issued(
    body: wire.Issued,
    *,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    roles: Collection[str],
    expected: pki.SpiffeId | None = None,
    what: str = "join",
) -> pki.LeafInfo:
    """The checks on an issued certificate (``joined`` or ``renewed``), in the seed's order.

    ``csr_sha256`` is this request's; the leaf certifies ``key``; the leaf's SPIFFE ID
    is the one the body names and, when ``expected`` is given (a renewal), that one;
    its role is one of ``roles`` and the one the body names. Returns the leaf's
    :class:`~bcd.pki.LeafInfo`; raises :class:`JoinError` otherwise.
    """
    if body.csr_sha256 != pki.sha256_hex(csr_der):
        raise JoinError(f"the {what} answer is for another request (csr_sha256 differs)")
    if body.chain is None:
        raise JoinError(f"the {what} answer has no certificate chain")
    try:
        leaf = pki.load_pem_chain(body.chain)[0]
        leaf_key = leaf.public_key()
        if not isinstance(leaf_key, ec.EllipticCurvePublicKey) or not pki.same_public_key(
            leaf_key, key
        ):
            raise JoinError("the issued certificate does not certify this node's key")
        info = pki.leaf_info(leaf)
    except pki.PkiError as exc:
        raise JoinError(f"the issued certificate is not a node certificate: {exc}") from exc
    spiffe = info.spiffe
    if (
        spiffe.node_id != body.node_id
        or spiffe.site_id != body.site_id
        or spiffe.trust_domain != body.trust_domain
    ):
        raise JoinError(f"the issued certificate's SPIFFE ID does not match the {what} answer")
    if expected is not None and spiffe != expected:
        raise JoinError(
            f"the issued certificate's SPIFFE ID {spiffe} is not this node's {expected}"
        )
    if info.role not in roles or body.role != info.role:
        wanted = " or ".join(sorted(roles))
        raise JoinError(f"the issued certificate's role {info.role} is not the requested {wanted}")
    return info


def verify_renewed(
    signed: str,
    *,
    signing_pin: str,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    current: pki.LeafInfo,
) -> wire.Issued:
    """Check a renewal answer; return its body or raise :class:`~bcd.errors.JoinError`.

    The signature under the pinned join-signing key, kind ``renewed``, ``csr_sha256``
    of this CSR, a leaf certifying ``key``, and the ``current`` leaf's SPIFFE ID
    (node, site, trust domain) and role.
    """
    body = verify_signed(signed, signing_pin=signing_pin, what="renewal")
    if not isinstance(body, wire.Issued) or body.kind != "renewed":
        raise JoinError(f"the renewal answer is of kind {body.kind!r}, not 'renewed'")
    check_issued(
        body,
        csr_der=csr_der,
        key=key,
        roles=(current.role,),
        expected=current.spiffe,
        what="renewal",
    )
    return body


def _count_or(value: int | None, default: int) -> int:
    return value if value is not None and value >= 0 else default


def issued_identity(body: wire.Issued, key: KeyKind, current: Identity | None = None) -> Identity:
    """The Identity of a verified ``joined`` or ``renewed`` body (:func:`check_issued`).

    Trust version, bundle, server time and identity generation come from the body when
    it carries them, else from ``current`` (a renewal keeps the identity's), else
    1, no bundle, no time and 1 (a join).
    """
    assert body.chain is not None  # check_issued refused a body without one
    if body.server_time_ms is not None:
        server_time = format_time(datetime.fromtimestamp(body.server_time_ms / 1000, UTC))
    else:
        server_time = current.server_time if current is not None else ""
    return make_identity(
        chain=body.chain,
        bundle=body.bundle or (current.bundle if current is not None else ""),
        trust_version=_count_or(body.trust_version, current.trust_version if current else 1),
        server_time=server_time,
        key=key,
        identity_generation=_count_or(
            body.identity_generation, current.identity_generation if current else 1
        ),
    )
