"""SignedResponses (compact JWS, ES256) and the typed bodies the node reads from them.

The control plane signs with :func:`sign_response`; the node verifies with
:func:`verify_response` (the signature under the pinned join-signing key) and then
parses the body once, at that boundary, into a frozen value: :class:`Issued` (a
``joined`` or ``renewed`` answer), :class:`Challenge` (a JoinChallenge) or
:class:`Pending` (a JoinPending), :func:`parse_signed_body` choosing by ``kind``. The
signed RevocationNotice is :func:`verify_revocation_notice`'s :class:`RevocationNotice`.

Every parser returns its value or raises :class:`~bcd.wirejson.WireError` (never
anything else; the text never holds the input). What an :class:`Issued` body must
agree with (this CSR, this key, the leaf's SPIFFE ID and role) is the node's check
(:func:`bcd.issued.check_issued`): the body carries each field as it came, ``None``
when it is absent or of the wrong type, so that check refuses it with the seed's text.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki
from bcd.wirejson import WireError, dumps, is_int, printable, public_jwk_of, public_key_of_jwk

MAX_SIGNED_RESPONSE = 256 * 1024
"""The largest SignedResponse the node verifies (a header with a full ``x5c`` fits)."""
MAX_X5C_CERTS = 4
MAX_X5C_CERT_DER = 8 * 1024
RESPONSE_KINDS = ("joined", "challenge", "pending", "renewed")
MAX_REQUEST_ID = 64
MAX_TIME_MS = 253_402_300_799_999
"""The last millisecond of the year 9999: a later ``server_time`` is no time."""


# --- signing and verifying ---------------------------------------------------------


def sign_response(
    body: dict[str, Any],
    key: ec.EllipticCurvePrivateKey,
    *,
    x5c: Sequence[x509.Certificate] = (),
    include_jwk: bool = True,
) -> str:
    """A compact JWS over ``body``; the header carries the public key and its pin.

    The key rides as ``jwk`` and, when ``x5c`` is given (the signing certificate
    first), as that certificate chain too; ``include_jwk=False`` leaves ``jwk`` out.
    """
    public = key.public_key()
    header: dict[str, Any] = {"alg": "ES256", "kid": pki.spki_pin(public)}
    if include_jwk:
        header["jwk"] = public_jwk_of(public)
    if x5c:
        header["x5c"] = [
            base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode("ascii")
            for cert in x5c
        ]
    signing_input = pki.b64url(dumps(header)) + "." + pki.b64url(dumps(body))
    return signing_input + "." + pki.b64url(pki.sign_p1363(key, signing_input.encode("ascii")))


_X5C_B64_MAX = (MAX_X5C_CERT_DER + 2) // 3 * 4


def public_key_of_x5c(value: object) -> ec.EllipticCurvePublicKey:
    """The P-256 key of the first certificate of a JWS ``x5c`` (base64 DER, leaf first).

    At most :data:`MAX_X5C_CERTS` certificates of at most :data:`MAX_X5C_CERT_DER`
    bytes each, every one of which must parse. Only the leaf's key is used: the node
    trusts it by its pin alone, so the rest of the chain is not verified.
    """
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_X5C_CERTS:
        raise WireError(f"x5c must be a list of 1 to {MAX_X5C_CERTS} certificates")
    certs: list[x509.Certificate] = []
    too_big = f"x5c holds a certificate over {MAX_X5C_CERT_DER} bytes"
    for item in value:
        if not isinstance(item, str):
            raise WireError("x5c holds something that is not base64")
        if len(item) > _X5C_B64_MAX:
            raise WireError(too_big)
        try:
            der = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireError("x5c holds something that is not base64") from exc
        if len(der) > MAX_X5C_CERT_DER:
            raise WireError(too_big)
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except ValueError as exc:
            raise WireError("x5c holds something that is not a DER certificate") from exc
    try:
        key = certs[0].public_key()
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # unsupported or malformed
        raise WireError("the x5c certificate's key is not a P-256 key") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise WireError("the x5c certificate's key is not a P-256 key")
    return key


def signing_key_of_header(header: dict[str, Any]) -> ec.EllipticCurvePublicKey:
    """The key a SignedResponse's protected header names: ``jwk``, ``x5c`` or both.

    With both, they must be the same key.
    """
    has_jwk, has_x5c = "jwk" in header, "x5c" in header
    if not has_jwk and not has_x5c:
        raise WireError("the response header carries no signing key (jwk or x5c)")
    from_jwk = public_key_of_jwk(header["jwk"]) if has_jwk else None
    from_x5c = public_key_of_x5c(header["x5c"]) if has_x5c else None
    if from_jwk is None:
        assert from_x5c is not None
        return from_x5c
    if from_x5c is not None and pki.spki_der(from_jwk) != pki.spki_der(from_x5c):
        raise WireError("the response header's jwk and x5c name different keys")
    return from_jwk


def verify_response(
    jws: str, signing_key_pin: str, kinds: Sequence[str] = RESPONSE_KINDS
) -> dict[str, Any]:
    """Verify a SignedResponse under the pinned join-signing key; return its body.

    The key comes from the protected header's ``jwk`` or ``x5c``
    (:func:`signing_key_of_header`) and is trusted only when its SPKI pin is
    ``signing_key_pin``. The body is a JSON object whose ``kind`` is one of ``kinds``;
    :func:`parse_signed_body` makes it a typed value.
    """
    if not isinstance(jws, str) or jws.count(".") != 2 or len(jws) > MAX_SIGNED_RESPONSE:
        raise WireError("the response is not a compact JWS")
    h64, b64, s64 = jws.split(".")
    try:
        header = json.loads(pki.b64url_decode(h64))
        if not isinstance(header, dict) or header.get("alg") != "ES256":
            raise WireError("the response is not ES256")
        key = signing_key_of_header(header)
        if not pki.pins_equal(pki.spki_pin(key), signing_key_pin):
            raise WireError("the response is not signed by the pinned join-signing key")
        pki.verify_p1363(key, pki.b64url_decode(s64), f"{h64}.{b64}".encode("ascii"))
        body = json.loads(pki.b64url_decode(b64))
    except (ValueError, pki.PkiError, RecursionError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError("the response signature does not verify") from exc
    if not isinstance(body, dict) or body.get("kind") not in kinds:
        raise WireError("the response has no known kind")
    return body


# --- the typed bodies ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Issued:
    """A ``joined`` or ``renewed`` body: a certificate the control plane issued.

    Each field is the body's value when it has the right type, else ``None``: what the
    fields must agree with is checked by the node against its request and the leaf.
    """

    kind: str
    csr_sha256: str | None
    chain: str | None
    node_id: str | None
    site_id: str | None
    trust_domain: str | None
    role: str | None
    bundle: str | None
    trust_version: int | None
    identity_generation: int | None
    server_time_ms: int | None
    """Unix milliseconds, only when within 0 and the end of the year 9999."""


@dataclass(frozen=True, slots=True)
class Challenge:
    """A JoinChallenge: the attestor's next ``round``, answered before ``not_after_ms``."""

    kind: ClassVar[str] = "challenge"
    attestor: str
    round: int
    not_after_ms: int
    challenge: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Pending:
    """A JoinPending: ask again after ``retry_after_s`` (1 when the body names none).

    ``request_id`` is printable ASCII of at most :data:`MAX_REQUEST_ID` characters
    (``?`` when the body names none), so it can be shown as it is.
    """

    kind: ClassVar[str] = "pending"
    request_id: str
    retry_after_s: int


SignedBody = Issued | Challenge | Pending


class MalformedChallenge(WireError):
    """A signed ``challenge`` body without a string ``attestor``, an integer ``round``
    and ``not_after``, or an object ``challenge``."""


def _str_or_none(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    return value if isinstance(value, str) else None


def _int_or_none(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return value if is_int(value) else None


def parse_issued(obj: dict[str, Any]) -> Issued:
    """A verified ``joined`` or ``renewed`` body as an :class:`Issued` (never fails on
    a JSON object: every field that is absent or of the wrong type is ``None``)."""
    kind = obj.get("kind")
    if kind not in ("joined", "renewed"):
        raise WireError("the response is not an issued certificate")
    server_time = _int_or_none(obj, "server_time")
    if server_time is not None and not 0 <= server_time <= MAX_TIME_MS:
        server_time = None
    return Issued(
        kind=str(kind),
        csr_sha256=_str_or_none(obj, "csr_sha256"),
        chain=_str_or_none(obj, "chain"),
        node_id=_str_or_none(obj, "node_id"),
        site_id=_str_or_none(obj, "site_id"),
        trust_domain=_str_or_none(obj, "trust_domain"),
        role=_str_or_none(obj, "role"),
        bundle=_str_or_none(obj, "bundle"),
        trust_version=_int_or_none(obj, "trust_version"),
        identity_generation=_int_or_none(obj, "identity_generation"),
        server_time_ms=server_time,
    )


def parse_challenge(obj: dict[str, Any]) -> Challenge:
    """A verified ``challenge`` body; :class:`MalformedChallenge` when a field is wrong."""
    attestor, rnd = obj.get("attestor"), obj.get("round")
    not_after, challenge = obj.get("not_after"), obj.get("challenge")
    if (
        obj.get("kind") != "challenge"
        or not isinstance(attestor, str)
        or not is_int(rnd)
        or not is_int(not_after)
        or not isinstance(challenge, dict)
    ):
        raise MalformedChallenge("the control plane sent a malformed challenge")
    return Challenge(attestor=attestor, round=rnd, not_after_ms=not_after, challenge=challenge)


def parse_pending(obj: dict[str, Any]) -> Pending:
    """A verified ``pending`` body (lenient: its fields only pace and label the wait)."""
    if obj.get("kind") != "pending":
        raise WireError("the response is not a pending join")
    request_id = obj.get("request_id")
    shown = printable(request_id)[:MAX_REQUEST_ID] if isinstance(request_id, str) else ""
    wait = obj.get("retry_after_s")
    return Pending(request_id=shown or "?", retry_after_s=wait if is_int(wait) else 1)


def parse_signed_body(obj: dict[str, Any]) -> SignedBody:
    """The typed value of a verified SignedResponse body, by its ``kind``."""
    kind = obj.get("kind")
    if kind in ("joined", "renewed"):
        return parse_issued(obj)
    if kind == "challenge":
        return parse_challenge(obj)
    if kind == "pending":
        return parse_pending(obj)
    raise WireError("the response has no known kind")


# --- the signed RevocationNotice --------------------------------------------------

NOTICE_KIND = "revocation"
MAX_NOTICE_REASON = 200


def revocation_notice_body(
    node_id: str, serial: str, reason: str, revoked_at_ms: int
) -> dict[str, Any]:
    """What JoinService signs when it revokes a certificate (a SignedResponse body)."""
    return {
        "kind": NOTICE_KIND,
        "node_id": node_id,
        "serial": serial,
        "reason": reason[:MAX_NOTICE_REASON],
        "revoked_at": revoked_at_ms,
    }


@dataclass(frozen=True, slots=True)
class RevocationNotice:
    node_id: str
    serial: str
    reason: str
    revoked_at_ms: int


def verify_revocation_notice(
    jws: object, signing_key_pin: str, node_id: str, serials: Sequence[str]
) -> RevocationNotice:
    """A notice that this node's certificate (one of ``serials``) was revoked, signed
    under the pinned join-signing key; WireError otherwise. The reason comes back
    with control characters replaced, so it can reach a log line as it is."""
    if not isinstance(jws, str):
        raise WireError("the revocation notice is missing")
    body = verify_response(jws, signing_key_pin, (NOTICE_KIND,))
    if body.get("kind") != NOTICE_KIND:
        raise WireError("not a revocation notice")
    serial, at, reason = body.get("serial"), body.get("revoked_at"), body.get("reason")
    if body.get("node_id") != node_id:
        raise WireError("the revocation notice names another node")
    if not isinstance(serial, str) or serial.lower() not in {s.lower() for s in serials}:
        raise WireError("the revocation notice names another certificate")
    if not is_int(at) or not isinstance(reason, str):
        raise WireError("the revocation notice is malformed")
    return RevocationNotice(node_id, serial, printable(reason)[:MAX_NOTICE_REASON], at)
