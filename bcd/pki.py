"""What both sides share about keys and certificates: pins, SPIFFE IDs, CSRs, P1363.

Pure functions over values; no I/O. The control plane imports these, bcd never
imports the control plane.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from cryptography.x509.oid import NameOID

PIN_PREFIX = "sha256/"
ROLES = ("node", "site", "ramdisk", "node-tenant")
ROLE_PREFIX = "bc-role:"
STATEMENT_PREFIX = "urn:bc:"
_ID_PART = re.compile(r"^[a-z]+_[0-9a-z]{26}$")
_TRUST_DOMAIN = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,253}[a-z0-9])?$")


class PkiError(ValueError):
    """Raised when a pin, CSR, certificate or signature does not parse or verify."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    if not isinstance(text, str) or not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise PkiError("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise PkiError("not base64url") from exc


def spki_der(public_key: ec.EllipticCurvePublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def spki_pin(public_key: ec.EllipticCurvePublicKey) -> str:
    """``sha256/`` + standard base64 of SHA-256 over the DER SubjectPublicKeyInfo."""
    digest = hashlib.sha256(spki_der(public_key)).digest()
    return PIN_PREFIX + base64.b64encode(digest).decode("ascii")


def pin_of_der_spki(der: bytes) -> str:
    return PIN_PREFIX + base64.b64encode(hashlib.sha256(der).digest()).decode("ascii")


def parse_pin(text: object) -> str:
    """Return ``text`` if it is a well-formed pin, else raise :class:`PkiError`."""
    if not isinstance(text, str) or not text.startswith(PIN_PREFIX):
        raise PkiError("a pin is sha256/ followed by the base64 of a SHA-256 digest")
    body = text[len(PIN_PREFIX) :]
    if not re.fullmatch(r"[A-Za-z0-9+/]{43}=", body):
        raise PkiError("a pin is sha256/ followed by the base64 of a SHA-256 digest")
    if len(base64.b64decode(body)) != 32:  # pragma: no cover - the regex implies it
        raise PkiError("a pin is sha256/ followed by the base64 of a SHA-256 digest")
    return text


def pins_equal(a: str, b: str) -> bool:
    """Constant-time pin comparison; anything that is not ASCII text is unequal."""
    try:
        return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))
    except (UnicodeEncodeError, AttributeError):
        return False


# --- SPIFFE IDs -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpiffeId:
    trust_domain: str
    site_id: str
    node_id: str

    def __str__(self) -> str:
        return f"spiffe://{self.trust_domain}/site/{self.site_id}/node/{self.node_id}"


def parse_spiffe_id(uri: str) -> SpiffeId:
    m = re.fullmatch(r"spiffe://([^/]+)/site/([^/]+)/node/([^/]+)", uri)
    if not m or not _TRUST_DOMAIN.fullmatch(m.group(1)):
        raise PkiError("not a node SPIFFE ID")
    if not _ID_PART.fullmatch(m.group(2)) or not _ID_PART.fullmatch(m.group(3)):
        raise PkiError("not a node SPIFFE ID")
    return SpiffeId(m.group(1), m.group(2), m.group(3))


def valid_trust_domain(td: str) -> bool:
    return bool(_TRUST_DOMAIN.fullmatch(td))


# --- keys and CSRs ----------------------------------------------------------------


def generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A PKCS#10 request with an empty subject; names come only from JoinService."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.DER)


def _der(tag: int, content: bytes) -> bytes:
    size = len(content)
    if size < 0x80:
        return bytes([tag, size]) + content
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + content


_ECDSA_WITH_SHA256 = bytes.fromhex("300a06082a8648ce3d040302")


def make_csr_with(
    public_key: ec.EllipticCurvePublicKey, sign_digest: Callable[[bytes], bytes]
) -> bytes:
    """The request :func:`make_csr` makes, signed by a key held elsewhere (a TPM).

    ``sign_digest`` signs a SHA-256 digest and returns a 64-byte P1363 signature.
    The DER is built here: version 0, an empty subject, the key's SPKI, no attributes.
    """
    info = _der(
        0x30,
        b"\x02\x01\x00" + _der(0x30, b"") + spki_der(public_key) + _der(0xA0, b""),
    )
    signature = sign_digest(hashlib.sha256(info).digest())
    if len(signature) != 64:
        raise PkiError("a P-256 signature is 64 bytes")
    der_sig = encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    return _der(0x30, info + _ECDSA_WITH_SHA256 + _der(0x03, b"\x00" + der_sig))


def parse_csr(der: bytes) -> x509.CertificateSigningRequest:
    """Parse a DER CSR; it must hold a P-256 key and a valid self-signature."""
    try:
        csr = x509.load_der_x509_csr(der)
        public_key = csr.public_key()
        valid = csr.is_signature_valid
    except (ValueError, TypeError, UnsupportedAlgorithm, x509.InvalidVersion) as exc:
        raise PkiError("the CSR does not parse") from exc
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP256R1
    ):
        raise PkiError("the CSR's key is not P-256")
    if not valid:
        raise PkiError("the CSR's signature does not verify")
    return csr


def csr_public_key(csr: x509.CertificateSigningRequest) -> ec.EllipticCurvePublicKey:
    key = csr.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key


# --- P1363 signatures (r || s) ----------------------------------------------------


def sign_p1363(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def verify_p1363(key: ec.EllipticCurvePublicKey, signature: bytes, data: bytes) -> None:
    if len(signature) != 64:
        raise PkiError("a P-256 signature is 64 bytes")
    der = encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    try:
        key.verify(der, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature as exc:
        raise PkiError("the signature does not verify") from exc


def renew_pop_message(csr_der: bytes, node_id: str, client_time_ms: int) -> bytes:
    return f"bc-renew-pop-v1\n{sha256_hex(csr_der)}\n{node_id}\n{client_time_ms}".encode()


def vouch_pop_message(fields: bytes, node_id: str, client_time_ms: int) -> bytes:
    """What a site agent signs with its node key for a vouch: ``fields`` is the vouch's
    body without ``client_time`` and ``pop_sig``, as ``bcd.wire.dumps`` writes it."""
    return f"bc-vouch-pop-v1\n{sha256_hex(fields)}\n{node_id}\n{client_time_ms}".encode()


# --- certificates -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeafInfo:
    spiffe: SpiffeId
    role: str
    statements: tuple[str, ...]
    not_before: datetime
    not_after: datetime
    serial_hex: str
    spki_sha256: str


def load_pem_chain(pem: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise PkiError("the certificate chain does not parse") from exc
    if not certs:
        raise PkiError("the certificate chain is empty")
    return certs


def cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


_MALFORMED = (
    ValueError,
    TypeError,
    UnsupportedAlgorithm,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)
"""What ``cryptography`` raises reading a malformed certificate's parts lazily."""


def leaf_info(cert: x509.Certificate) -> LeafInfo:
    """Read the identity a node leaf carries; raise :class:`PkiError` if it is not one
    (a leaf the request carries is parsed before its sender is known to be live:
    whatever ``cryptography`` raises of a malformed one is a PkiError here)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    except x509.ExtensionNotFound as exc:
        raise PkiError("the certificate has no SPIFFE ID") from exc
    except _MALFORMED as exc:
        raise PkiError("the certificate's extensions or subject do not parse") from exc
    if not uris:
        raise PkiError("the certificate has no SPIFFE ID")
    spiffe = parse_spiffe_id(uris[0])
    statements = tuple(uris[1:])
    if any(not s.startswith(STATEMENT_PREFIX) for s in statements):
        raise PkiError("the certificate names more than one identity")
    roles = [str(a.value)[len(ROLE_PREFIX) :] for a in ous if str(a.value).startswith(ROLE_PREFIX)]
    if len(roles) != 1 or roles[0] not in ROLES:
        raise PkiError("the certificate has no role")
    try:
        key = cert.public_key()
    except _MALFORMED as exc:  # an unknown curve or kind
        raise PkiError("the certificate's key is not P-256") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PkiError("the certificate's key is not P-256")
    return LeafInfo(
        spiffe=spiffe,
        role=roles[0],
        statements=statements,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        serial_hex=format(cert.serial_number, "x"),
        spki_sha256=sha256_hex(spki_der(key)),
    )


def same_public_key(a: ec.EllipticCurvePublicKey, b: ec.EllipticCurvePublicKey) -> bool:
    return spki_der(a) == spki_der(b)
