"""The control plane's checks of what a TPM produced; pure, no TPM needed.

Every failure is a :class:`~bcd.tpm.TpmError`.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, encode_dss_signature

from bcd.tpm import TpmError
from bcd.tpm.structures import parse_certify_attest, parse_name
from bcd.tpm.templates import check_ak_public, check_ek_public


def verify_p1363_digest(
    key: ec.EllipticCurvePublicKey, signature: bytes, digest: bytes, what: str
) -> None:
    """Verify a 64-byte P1363 ECDSA signature over a SHA-256 digest."""
    if not isinstance(signature, bytes) or len(signature) != 64:
        raise TpmError(f"{what}: a P-256 signature is 64 bytes")
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:], "big")
    if r == 0 or s == 0:
        raise TpmError(f"{what} does not verify")
    try:
        key.verify(encode_dss_signature(r, s), digest, ec.ECDSA(Prehashed(hashes.SHA256())))
    except InvalidSignature as exc:
        raise TpmError(f"{what} does not verify") from exc


def verify_certify(
    attest: bytes,
    signature: bytes,
    ak_public: bytes,
    expected_key_name: bytes,
    qualifying_data: bytes,
) -> None:
    """Check a TPM2_Certify: the AK signed that the TPM holds the key named ``expected_key_name``.

    ``ak_public`` must be bcd's AK (a restricted signing key, so the TPM signs only
    attestations it generated with it); the signature (P1363) must verify over
    SHA-256 of ``attest``; ``attest`` must be a TPM-generated ATTEST_CERTIFY whose
    extraData is ``qualifying_data`` and whose certified name is the expected one.
    """
    ak = check_ak_public(ak_public)
    parse_name(expected_key_name, "the expected key name")
    if not isinstance(qualifying_data, bytes) or len(qualifying_data) != 32:
        raise TpmError("the qualifying data is a 32-byte SHA-256 digest")
    if not isinstance(attest, bytes):
        raise TpmError("the attestation: not a TPMS_ATTEST")
    verify_p1363_digest(
        ak.ec_key(), signature, hashlib.sha256(attest).digest(), "the AK's signature"
    )
    info = parse_certify_attest(attest)
    if not hmac.compare_digest(info.extra_data, qualifying_data):
        raise TpmError("the attestation certifies for other qualifying data")
    if not hmac.compare_digest(info.name, expected_key_name):
        raise TpmError("the attestation certifies another key")


def check_ek_certificate(ek_public: bytes, certificate_der: bytes) -> x509.Certificate:
    """Parse the EK certificate and check it names the key of ``ek_public``.

    Only the binding; the chain to a manufacturer CA is the attestor's check.
    """
    info = check_ek_public(ek_public)
    try:
        cert = x509.load_der_x509_certificate(certificate_der)
        cert_key = cert.public_key()
    except (ValueError, TypeError) as exc:
        raise TpmError("the EK certificate does not parse") from exc
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    try:
        same = cert_key.public_bytes(der, spki) == info.public_key.public_bytes(der, spki)
    except (ValueError, TypeError) as exc:  # pragma: no cover - keys without an SPKI
        raise TpmError("the EK certificate's key is not an RSA or ECC key") from exc
    if not same:
        raise TpmError("the EK certificate names another key than the EK")
    return cert
