"""Key attestation for AK-bound renewals: the wire shape and the control plane's check.

Pure: no TPM. A certificate that names an AK (``urn:bc:tpm-ak:<nameAlg>:<hex>``)
renews only with ``key_attestation``: the AK's public area, the new key's public
area, and the AK's TPM2_Certify of that key over sha256(csr). The control plane
refuses (never downgrades) when it is missing or fails, with one of the reasons
``key-attestation-missing``, ``key-attestation-ak``, ``node-key-malformed``,
``node-key-attributes``, ``node-key-mismatch`` or ``node-key-certify``.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from bcd.tpm import TpmError
from bcd.tpm.structures import HASHES, name_of, parse_name
from bcd.tpm.templates import check_ak_public, check_node_key_public
from bcd.tpm.verify import verify_certify

STATEMENT_PREFIX = "urn:bc:tpm-ak:"
_MAX_FIELD = 4096


def ak_statement(ak_name: bytes) -> str:
    """``urn:bc:tpm-ak:<nameAlg>:<hex digest>`` for an AK name."""
    alg, digest = parse_name(ak_name, "the AK name")
    return f"{STATEMENT_PREFIX}{HASHES[alg]}:{digest.hex()}"


def ak_statements(statements: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for s in statements if s.startswith(STATEMENT_PREFIX))


@dataclass(frozen=True, slots=True)
class KeyAttestation:
    ak_public: bytes
    key_public: bytes
    certify_attest: bytes
    certify_sig: bytes

    def to_json(self) -> dict[str, str]:
        return {
            "ak_public": base64.b64encode(self.ak_public).decode("ascii"),
            "key_public": base64.b64encode(self.key_public).decode("ascii"),
            "certify_attest": base64.b64encode(self.certify_attest).decode("ascii"),
            "certify_sig": base64.b64encode(self.certify_sig).decode("ascii"),
        }


class AttestationRefused(Exception):
    """Raised by :func:`check_key_attestation`; ``reason`` is the renew refusal reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_key_attestation(obj: object) -> KeyAttestation:
    """Parse the wire form; raise AttestationRefused(node-key-malformed) on bad input."""
    if not isinstance(obj, dict):
        raise AttestationRefused("node-key-malformed")
    try:
        return KeyAttestation(
            ak_public=wire.b64_field(obj, "ak_public", _MAX_FIELD),
            key_public=wire.b64_field(obj, "key_public", _MAX_FIELD),
            certify_attest=wire.b64_field(obj, "certify_attest", _MAX_FIELD),
            certify_sig=wire.b64_field(obj, "certify_sig", _MAX_FIELD),
        )
    except wire.WireError:
        raise AttestationRefused("node-key-malformed") from None


def check_key_attestation(
    attestation: object | None,
    statements: tuple[str, ...],
    csr_key: ec.EllipticCurvePublicKey,
    csr_der: bytes,
) -> None:
    """The control plane's check of a renewal of a leaf naming an AK, in order.

    ``statements`` are the stored leaf's; nothing is read from the CSR but its key.
    """
    named = ak_statements(statements)
    if not named:
        return
    if attestation is None:
        raise AttestationRefused("key-attestation-missing")
    att = parse_key_attestation(attestation)
    try:
        check_ak_public(att.ak_public)
        statement = ak_statement(name_of(att.ak_public))
    except TpmError:
        raise AttestationRefused("key-attestation-ak") from None
    if statement not in named:
        raise AttestationRefused("key-attestation-ak")
    try:
        info = check_node_key_public(att.key_public)
    except TpmError:
        raise AttestationRefused("node-key-attributes") from None
    if not pki.same_public_key(info.ec_key(), csr_key):
        raise AttestationRefused("node-key-mismatch")
    try:
        verify_certify(
            att.certify_attest,
            att.certify_sig,
            att.ak_public,
            name_of(att.key_public),
            hashlib.sha256(csr_der).digest(),
        )
    except TpmError:
        raise AttestationRefused("node-key-certify") from None
