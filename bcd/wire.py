"""Wire formats both sides share: join requests, sealed tokens, signed responses, errors.

Every parser here is a pure function that takes outside bytes or JSON values and
returns a frozen value or raises :class:`WireError` (never anything else), so the
control plane can map any failure to one uniform refusal and the property tests can
feed them anything.

This module is the face both sides import. It holds the requests (JoinRequest,
RenewRequest, Hello), the sealed token, the session messages and the error answers;
:mod:`bcd.wirejson` holds :class:`WireError` and the JSON readers, and
:mod:`bcd.signed` the SignedResponses and the typed bodies the node reads from them
(:class:`~bcd.signed.Issued`, :class:`~bcd.signed.Challenge`,
:class:`~bcd.signed.Pending`), both re-exported here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec
from jwcrypto import jwe, jwk
from jwcrypto.common import JWException

from bcd import pki
from bcd.signed import MAX_SIGNED_RESPONSE as MAX_SIGNED_RESPONSE
from bcd.signed import MAX_X5C_CERT_DER as MAX_X5C_CERT_DER
from bcd.signed import MAX_X5C_CERTS as MAX_X5C_CERTS
from bcd.signed import NOTICE_KIND as NOTICE_KIND
from bcd.signed import RESPONSE_KINDS as RESPONSE_KINDS
from bcd.signed import Challenge as Challenge
from bcd.signed import Issued as Issued
from bcd.signed import MalformedChallenge as MalformedChallenge
from bcd.signed import Pending as Pending
from bcd.signed import RevocationNotice as RevocationNotice
from bcd.signed import SignedBody as SignedBody
from bcd.signed import parse_challenge as parse_challenge
from bcd.signed import parse_issued as parse_issued
from bcd.signed import parse_pending as parse_pending
from bcd.signed import parse_signed_body as parse_signed_body
from bcd.signed import public_key_of_x5c as public_key_of_x5c
from bcd.signed import revocation_notice_body as revocation_notice_body
from bcd.signed import sign_response as sign_response
from bcd.signed import signing_key_of_header as signing_key_of_header
from bcd.signed import verify_response as verify_response
from bcd.signed import verify_revocation_notice as verify_revocation_notice
from bcd.wirejson import MAX_BODY as MAX_BODY
from bcd.wirejson import WireError as WireError
from bcd.wirejson import b64_field as b64_field
from bcd.wirejson import dumps as dumps
from bcd.wirejson import is_int as is_int
from bcd.wirejson import loads_object as loads_object
from bcd.wirejson import printable as printable
from bcd.wirejson import public_jwk_of as public_jwk_of
from bcd.wirejson import public_key_of_jwk as public_key_of_jwk
from bcd.wirejson import str_field, str_list_field

PROTOCOL_VERSION = 1
MAX_PUSHBACK_MS = 300_000
"""The longest ``retry-pushback-ms`` the node waits out (5 minutes); longer is capped."""
SEAL_TYP = "bcjt+jwe"
SEAL_MAX_SKEW_S = 300
TOKEN_RE = re.compile(r"^bcjt_(jt_[0-9a-z]{26})\.([A-Za-z0-9_-]{43})$")


# --- join tokens ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JoinToken:
    token_id: str
    secret: str = field(repr=False)

    @property
    def bearer(self) -> str:
        return f"bcjt_{self.token_id}.{self.secret}"


def parse_token(text: str) -> JoinToken:
    """Parse ``bcjt_<id>.<secret>``; surrounding whitespace is ignored."""
    m = TOKEN_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if not m:
        raise WireError("not a join token (bcjt_…)")
    return JoinToken(m.group(1), m.group(2))


def secret_hash(secret: str) -> str:
    """What the control plane stores of a token or credential secret: its SHA-256."""
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented secret with its stored SHA-256."""
    return hmac.compare_digest(secret_hash(secret).encode(), stored_hash.encode())


# --- claims and join requests -----------------------------------------------------

CLAIM_KEYS = (
    "product_uuid",
    "product_serial",
    "board_serial",
    "chassis_serial",
    "macs",
    "gpu_uuids",
    "hostname",
    "boot_id",
)


@dataclass(frozen=True, slots=True)
class Claims:
    product_uuid: str = ""
    product_serial: str = ""
    board_serial: str = ""
    chassis_serial: str = ""
    macs: tuple[str, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    hostname: str = ""
    boot_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "product_uuid": self.product_uuid,
            "product_serial": self.product_serial,
            "board_serial": self.board_serial,
            "chassis_serial": self.chassis_serial,
            "macs": list(self.macs),
            "gpu_uuids": list(self.gpu_uuids),
            "hostname": self.hostname,
            "boot_id": self.boot_id,
        }

    @classmethod
    def from_json(cls, obj: object) -> Claims:
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise WireError("claims must be an object")
        unknown = set(obj) - set(CLAIM_KEYS)
        if unknown:
            raise WireError("claims has unknown fields")
        return cls(
            product_uuid=str_field(obj, "product_uuid", optional=True),
            product_serial=str_field(obj, "product_serial", optional=True),
            board_serial=str_field(obj, "board_serial", optional=True),
            chassis_serial=str_field(obj, "chassis_serial", optional=True),
            macs=str_list_field(obj, "macs"),
            gpu_uuids=str_list_field(obj, "gpu_uuids"),
            hostname=str_field(obj, "hostname", optional=True),
            boot_id=str_field(obj, "boot_id", optional=True),
        )


@dataclass(frozen=True, slots=True)
class JoinRequest:
    role: str
    attestor: str
    sealed_token: str | None = field(repr=False)
    csr_der: bytes
    claims: Claims
    evidence: dict[str, Any]
    node_id: str | None
    daemon_version: str
    round: int = 0
    answer: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "role": self.role,
            "attestor": self.attestor,
            "sealed_token": self.sealed_token,
            "csr": base64.b64encode(self.csr_der).decode("ascii"),
            "claims": self.claims.to_json(),
            "evidence": self.evidence,
            "node_id": self.node_id,
            "daemon_version": self.daemon_version,
            "round": self.round,
            "answer": self.answer,
        }


def parse_join_request(obj: dict[str, Any]) -> JoinRequest:
    """Parse a JoinRequest body (already a JSON object)."""
    protocol = obj.get("protocol")
    if type(protocol) is not int or protocol != PROTOCOL_VERSION:
        raise WireError("unsupported protocol")
    role = str_field(obj, "role", max_len=32)
    if role not in ("node", "site", "ramdisk"):
        raise WireError("role must be node, site or ramdisk")
    attestor = str_field(obj, "attestor", max_len=64, optional=True)
    sealed = obj.get("sealed_token")
    if sealed is not None and (not isinstance(sealed, str) or len(sealed) > 8192):
        raise WireError("sealed_token must be a string")
    csr_b64 = str_field(obj, "csr", max_len=8192)
    try:
        csr_der = base64.b64decode(csr_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError("csr must be base64") from exc
    evidence = obj.get("evidence")
    if evidence is None:
        evidence = {}
    if not isinstance(evidence, dict):
        raise WireError("evidence must be an object")
    node_id = obj.get("node_id")
    if node_id is not None and (not isinstance(node_id, str) or len(node_id) > 64):
        raise WireError("node_id must be a string")
    rnd = obj.get("round", 0)
    if rnd is None:
        rnd = 0
    if not isinstance(rnd, int) or isinstance(rnd, bool) or not 0 <= rnd <= 3:
        raise WireError("round must be 0 to 3")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, dict):
        raise WireError("answer must be an object")
    return JoinRequest(
        role=role,
        attestor=attestor,
        sealed_token=sealed,
        csr_der=csr_der,
        claims=Claims.from_json(obj.get("claims")),
        evidence=evidence,
        node_id=node_id,
        daemon_version=str_field(obj, "daemon_version", max_len=64, optional=True),
        round=rnd,
        answer=answer,
    )


# --- renewal and sessions ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RenewRequest:
    """POST /v1/renew: a new CSR, the current chain, the client time and the proof."""

    csr_der: bytes
    chain: str
    client_time_ms: int
    pop_sig: bytes
    key_attestation: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "csr": base64.b64encode(self.csr_der).decode("ascii"),
            "chain": self.chain,
            "client_time": self.client_time_ms,
            "pop_sig": pki.b64url(self.pop_sig),
            "key_attestation": self.key_attestation,
        }


def parse_renew_request(obj: dict[str, Any]) -> RenewRequest:
    csr_b64 = str_field(obj, "csr", max_len=8192)
    try:
        csr_der = base64.b64decode(csr_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError("csr must be base64") from exc
    chain = str_field(obj, "chain", max_len=32768)
    client_time = obj.get("client_time")
    if not isinstance(client_time, int) or isinstance(client_time, bool) or client_time < 0:
        raise WireError("client_time must be unix milliseconds")
    try:
        pop_sig = pki.b64url_decode(str_field(obj, "pop_sig", max_len=128))
    except pki.PkiError as exc:
        raise WireError("pop_sig must be base64url") from exc
    attestation = obj.get("key_attestation")
    if attestation is not None and not isinstance(attestation, dict):
        raise WireError("key_attestation must be an object")
    return RenewRequest(csr_der, chain, client_time, pop_sig, attestation)


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of a session (POST /v1/session)."""

    node_id: str
    journal_id: str
    boot_id: str
    daemon_version: str

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "journal_id": self.journal_id,
            "boot_id": self.boot_id,
            "daemon_version": self.daemon_version,
        }


def parse_hello(obj: dict[str, Any]) -> Hello:
    return Hello(
        node_id=str_field(obj, "node_id", max_len=64),
        journal_id=str_field(obj, "journal_id", max_len=64),
        boot_id=str_field(obj, "boot_id", max_len=64, optional=True),
        daemon_version=str_field(obj, "daemon_version", max_len=64, optional=True),
    )


MAX_SESSION_LINE = 128 * 1024
"""The longest session line parsed (the transport cuts lines well before this)."""
MAX_SESSION_TEXT = 200


@dataclass(frozen=True, slots=True)
class Welcome:
    """``{"type": "welcome", "session_id"}``: the session is open."""

    session_id: str
    """Printable ASCII of at most 200 characters, ``""`` when the gateway named none."""


@dataclass(frozen=True, slots=True)
class Ping:
    """``{"type": "ping"}``: the gateway is there (every 15 s)."""


@dataclass(frozen=True, slots=True)
class RevocationLine:
    """``{"type": "revocation", "reason", "notice"}``: the gateway says the certificate is
    revoked. Only ``notice`` (a signed RevocationNotice, checked by
    :func:`bcd.revocation.revoked_by`) can prove it; ``reason`` is the gateway's word,
    for the log only (printable, at most 200 characters, ``""`` when absent)."""

    notice: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class OtherLine:
    """A JSON object of another or no ``type``: skipped (a newer gateway may send more)."""


SessionMessage = Welcome | Ping | RevocationLine | OtherLine


def _session_text(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        return ""
    return value[:MAX_SESSION_TEXT].encode("unicode_escape").decode("ascii")


def parse_session_line(line: bytes) -> SessionMessage:
    """One line of the gateway's session stream; WireError when it is not a JSON object.

    Texts come back escaped to printable ASCII (a newline cannot forge a log line).
    """
    obj = loads_object(line, MAX_SESSION_LINE)
    kind = obj.get("type")
    if kind == "welcome":
        return Welcome(_session_text(obj, "session_id"))
    if kind == "ping":
        return Ping()
    if kind == "revocation":
        notice = obj.get("notice")
        return RevocationLine(
            notice if isinstance(notice, str) else None, _session_text(obj, "reason")
        )
    return OtherLine()


# --- the sealed token (compact JWE) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenedSeal:
    token: JoinToken
    iat: int
    csr_sha256: str


def seal_token(
    token: JoinToken, encryption_key: ec.EllipticCurvePublicKey, csr_der: bytes, iat: int
) -> str:
    """Encrypt the bearer token to the JoinService key, bound to this CSR."""
    header = {
        "alg": "ECDH-ES+A256KW",
        "enc": "A256GCM",
        "typ": SEAL_TYP,
        "kid": pki.spki_pin(encryption_key),
        "iat": iat,
        "csr": pki.sha256_hex(csr_der),
    }
    key = jwk.JWK(**public_jwk_of(encryption_key))
    token_jwe = jwe.JWE(token.bearer.encode("ascii"), protected=json.dumps(header))
    token_jwe.add_recipient(key)
    return str(token_jwe.serialize(compact=True))


def decryption_jwk(key: ec.EllipticCurvePrivateKey) -> jwk.JWK:
    """The JoinService decryption key in jwcrypto's form; convert it once, not per join."""
    return jwk.JWK.from_pyca(key)


def open_seal(
    sealed: str, decryption_key: ec.EllipticCurvePrivateKey | jwk.JWK, expected_kid: str
) -> OpenedSeal:
    """Decrypt a sealed token; check ``typ`` and ``kid``. The caller checks csr and iat."""
    if not isinstance(sealed, str) or sealed.count(".") != 4 or len(sealed) > 8192:
        raise WireError("not a compact JWE")
    try:
        header = json.loads(pki.b64url_decode(sealed.split(".", 1)[0]))
    except (ValueError, pki.PkiError, RecursionError) as exc:
        raise WireError("not a compact JWE") from exc
    if not isinstance(header, dict) or header.get("typ") != SEAL_TYP:
        raise WireError("wrong typ")
    if header.get("alg") != "ECDH-ES+A256KW" or header.get("enc") != "A256GCM":
        raise WireError("wrong algorithm")
    if not isinstance(header.get("kid"), str) or not pki.pins_equal(header["kid"], expected_kid):
        raise WireError("wrong kid")
    key = decryption_key if isinstance(decryption_key, jwk.JWK) else decryption_jwk(decryption_key)
    try:
        obj = jwe.JWE()
        obj.allowed_algs = ["ECDH-ES+A256KW", "A256GCM"]
        obj.deserialize(sealed, key=key)
        plaintext = obj.payload
    except (JWException, ValueError, TypeError, KeyError) as exc:
        raise WireError("the seal does not open") from exc
    iat = header.get("iat")
    csr = header.get("csr")
    if not isinstance(iat, int) or isinstance(iat, bool):
        raise WireError("iat missing")
    if not isinstance(csr, str) or not re.fullmatch(r"[0-9a-f]{64}", csr):
        raise WireError("csr missing")
    return OpenedSeal(token=_sealed_token(plaintext), iat=iat, csr_sha256=csr)


class NotAToken(WireError):
    """The seal opened (it was made for this JoinService) but holds no join token."""


_LOOSE_TOKEN_RE = re.compile(r"^bcjt_(jt_[0-9a-z]{26})\.([\x21-\x7e]{1,256})$")


def _sealed_token(plaintext: bytes) -> JoinToken:
    """The token a seal holds. A well-formed token id with a secret of the wrong shape
    (say the stored hash from a database dump) is still that token's, so its check
    answers ``token-secret``; anything else is :class:`NotAToken` (``token-malformed``)."""
    try:
        text = plaintext.decode("ascii")
    except UnicodeDecodeError as exc:
        raise NotAToken("not a join token") from exc
    try:
        return parse_token(text)
    except WireError:
        pass
    m = _LOOSE_TOKEN_RE.fullmatch(text.strip())
    if m is None:
        raise NotAToken("not a join token")
    return JoinToken(m.group(1), m.group(2))


# --- errors -----------------------------------------------------------------------

STATUS = {
    "INVALID_ARGUMENT": 400,
    "INVALID_STATE": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "ACCESS_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "CONFLICT": 409,
    "RESOURCE_EXHAUSTED": 429,
    "INVALID_CONFIG": 500,
    "UNAVAILABLE": 503,
}
RETRYABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")


@dataclass(frozen=True, slots=True)
class ErrorBody:
    code: str
    message: str


def parse_error(data: bytes) -> ErrorBody | None:
    """An error answer's ``{"code", "message"}`` (at most 4 KiB; the message cut to 512
    characters, non-printable ones blanked), or ``None`` when it is not one."""
    try:
        obj = loads_object(data, 4096)
    except WireError:
        return None
    code, message = obj.get("code"), obj.get("message")
    if isinstance(code, str) and code in STATUS and isinstance(message, str):
        # shown on one line: a control character (a newline) cannot forge another
        text = "".join(ch if ch.isprintable() else " " for ch in message[:512])
        return ErrorBody(code, text)
    return None


_PUSHBACK = re.compile(r"[0-9]{1,9}")


def parse_pushback(value: str | None) -> float | None:
    """``retry-pushback-ms`` as seconds to wait, or ``None`` when absent or unparsable.

    Only 1 to 9 ASCII digits are a value (surrounding blanks aside): a sign, another
    script's digits, a fraction, a list of values or a longer number count as absent.
    A value over :data:`MAX_PUSHBACK_MS` is capped to it.
    """
    if not isinstance(value, str):
        return None
    text = value.strip(" \t")
    if _PUSHBACK.fullmatch(text) is None:
        return None
    return min(int(text), MAX_PUSHBACK_MS) / 1000
