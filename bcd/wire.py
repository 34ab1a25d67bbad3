"""Wire formats both sides share: join requests, sealed tokens, signed responses, errors.

Every parser here is a pure function that takes outside bytes or JSON values and
returns a frozen value or raises :class:`WireError` (never anything else), so the
control plane can map any failure to one uniform refusal and the property tests can
feed them anything.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwcrypto import jwe, jwk
from jwcrypto.common import JWException

from bcd import pki

PROTOCOL_VERSION = 1
MAX_BODY = 64 * 1024
MAX_SIGNED_RESPONSE = 256 * 1024
"""The largest SignedResponse the node verifies (a header with a full ``x5c`` fits)."""
MAX_X5C_CERTS = 4
MAX_X5C_CERT_DER = 8 * 1024
MAX_PUSHBACK_MS = 300_000
"""The longest ``retry-pushback-ms`` the node waits out (5 minutes); longer is capped."""
SEAL_TYP = "bcjt+jwe"
SEAL_MAX_SKEW_S = 300
TOKEN_RE = re.compile(r"^bcjt_(jt_[0-9a-z]{26})\.([A-Za-z0-9_-]{43})$")
_MAX_CLAIM = 256
_MAX_LIST = 64


class WireError(ValueError):
    """Raised when a message does not parse; the text never contains the input."""


# --- JSON helpers -----------------------------------------------------------------


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8")


def loads_object(data: bytes, limit: int = MAX_BODY) -> dict[str, Any]:
    """Parse a JSON object of at most ``limit`` bytes."""
    if len(data) > limit:
        raise WireError("body too large")
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError("body is not JSON") from exc
    if not isinstance(obj, dict):
        raise WireError("body is not a JSON object")
    return obj


_SURROGATE = re.compile("[\ud800-\udfff]")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names and string values are all Unicode text: JSON's ``\\ud800``
    escapes make lone surrogates, which no store and no UTF-8 writer can take."""
    for name, value in pairs:
        if _SURROGATE.search(name) or _has_surrogate(value):
            raise ValueError("a string holds a lone surrogate")
    return dict(pairs)


def _has_surrogate(value: object) -> bool:
    """Inner objects were checked when they were made; strings and lists are here."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _str(
    obj: dict[str, Any], key: str, *, max_len: int = _MAX_CLAIM, optional: bool = False
) -> str:
    value = obj.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str) or len(value) > max_len:
        raise WireError(f"{key} must be a string")
    return value


def b64_field(obj: dict[str, Any], key: str, limit: int = 8192) -> bytes:
    """The bytes of a standard-base64 string field of at most ``limit`` characters."""
    value = obj.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"{key} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{key} must be a base64 string") from exc


def _str_list(obj: dict[str, Any], key: str) -> tuple[str, ...]:
    value = obj.get(key, [])
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > _MAX_LIST:
        raise WireError(f"{key} must be a list of strings")
    if not all(isinstance(v, str) and len(v) <= _MAX_CLAIM for v in value):
        raise WireError(f"{key} must be a list of strings")
    return tuple(value)


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
            product_uuid=_str(obj, "product_uuid", optional=True),
            product_serial=_str(obj, "product_serial", optional=True),
            board_serial=_str(obj, "board_serial", optional=True),
            chassis_serial=_str(obj, "chassis_serial", optional=True),
            macs=_str_list(obj, "macs"),
            gpu_uuids=_str_list(obj, "gpu_uuids"),
            hostname=_str(obj, "hostname", optional=True),
            boot_id=_str(obj, "boot_id", optional=True),
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
    role = _str(obj, "role", max_len=32)
    if role not in ("node", "site", "ramdisk"):
        raise WireError("role must be node, site or ramdisk")
    attestor = _str(obj, "attestor", max_len=64, optional=True)
    sealed = obj.get("sealed_token")
    if sealed is not None and (not isinstance(sealed, str) or len(sealed) > 8192):
        raise WireError("sealed_token must be a string")
    csr_b64 = _str(obj, "csr", max_len=8192)
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
        daemon_version=_str(obj, "daemon_version", max_len=64, optional=True),
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
    csr_b64 = _str(obj, "csr", max_len=8192)
    try:
        csr_der = base64.b64decode(csr_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError("csr must be base64") from exc
    chain = _str(obj, "chain", max_len=32768)
    client_time = obj.get("client_time")
    if not isinstance(client_time, int) or isinstance(client_time, bool) or client_time < 0:
        raise WireError("client_time must be unix milliseconds")
    try:
        pop_sig = pki.b64url_decode(_str(obj, "pop_sig", max_len=128))
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
        node_id=_str(obj, "node_id", max_len=64),
        journal_id=_str(obj, "journal_id", max_len=64),
        boot_id=_str(obj, "boot_id", max_len=64, optional=True),
        daemon_version=_str(obj, "daemon_version", max_len=64, optional=True),
    )


# --- the sealed token (compact JWE) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenedSeal:
    token: JoinToken
    iat: int
    csr_sha256: str


def public_jwk_of(key: ec.EllipticCurvePublicKey) -> dict[str, str]:
    nums = key.public_numbers()
    return {
        "kty": "EC",
        "crv": "P-256",
        "x": pki.b64url(nums.x.to_bytes(32, "big")),
        "y": pki.b64url(nums.y.to_bytes(32, "big")),
    }


def public_key_of_jwk(obj: object) -> ec.EllipticCurvePublicKey:
    """Parse a public P-256 JWK (no private part accepted)."""
    if not isinstance(obj, dict) or obj.get("kty") != "EC" or obj.get("crv") != "P-256":
        raise WireError("not a P-256 public JWK")
    if "d" in obj:
        raise WireError("the JWK holds a private key")
    try:
        x = int.from_bytes(pki.b64url_decode(obj["x"]), "big")
        y = int.from_bytes(pki.b64url_decode(obj["y"]), "big")
        return ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    except (KeyError, ValueError, TypeError) as exc:
        raise WireError("not a P-256 public JWK") from exc


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


# --- signed responses (compact JWS, ES256) ----------------------------------------

RESPONSE_KINDS = ("joined", "challenge", "pending", "renewed")


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
    ``signing_key_pin``.
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


# --- errors -----------------------------------------------------------------------

STATUS = {
    "INVALID_ARGUMENT": 400,
    "INVALID_STATE": 400,
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
    if not isinstance(at, int) or isinstance(at, bool) or not isinstance(reason, str):
        raise WireError("the revocation notice is malformed")
    return RevocationNotice(node_id, serial, printable(reason)[:MAX_NOTICE_REASON], at)


def printable(text: str) -> str:
    """``text`` with every control or non-ASCII character replaced by ``?``."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)
