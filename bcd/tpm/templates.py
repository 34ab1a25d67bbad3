"""The templates bcd creates its TPM keys from, and the checks of their public areas.

Pure (no TPM): the node derives keys from these templates and the control plane
checks the public areas a node sends against the same constants.

- **node key**: ECC P-256, ECDSA/SHA-256, nameAlg SHA-256,
  fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|sign (not restricted, not
  decrypt), empty auth policy, symmetric NULL. A primary under the owner
  hierarchy; its ``unique`` is the 32 random bytes node.key stores (unique.x, with
  an empty unique.y).
- **AK**: the same with ``restricted`` added, a primary under the endorsement
  hierarchy with a fixed ``unique`` (so it survives ``tpm2_clear``).
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives.asymmetric import ec

from bcd.tpm import TpmError
from bcd.tpm.structures import (
    ALG_ECC,
    ALG_ECDSA,
    ALG_NULL,
    ALG_SHA256,
    DECRYPT,
    ECC_NIST_P256,
    FIXED_PARENT,
    FIXED_TPM,
    RESTRICTED,
    SENSITIVE_DATA_ORIGIN,
    SIGN_ENCRYPT,
    USER_WITH_AUTH,
    PublicInfo,
    ecc_public,
    parse_public,
)

NODE_KEY_TEMPLATE = "bcd-node-ecc-p256-v1"
NODE_KEY_ATTRIBUTES = (
    FIXED_TPM | FIXED_PARENT | SENSITIVE_DATA_ORIGIN | USER_WITH_AUTH | SIGN_ENCRYPT
)
UNIQUE_SIZE = 32

AK_TEMPLATE = "bcd-ak-ecc-p256-v1"
AK_ATTRIBUTES = NODE_KEY_ATTRIBUTES | RESTRICTED
AK_UNIQUE = hashlib.sha256(b"bcd attestation key v1").digest()

EK_REQUIRED_ATTRIBUTES = FIXED_TPM | FIXED_PARENT | SENSITIVE_DATA_ORIGIN | RESTRICTED | DECRYPT


def _p256_signing_template(attributes: int, unique: bytes) -> bytes:
    return ecc_public(
        name_alg=ALG_SHA256,
        attributes=attributes,
        scheme=ALG_ECDSA,
        scheme_hash=ALG_SHA256,
        curve=ECC_NIST_P256,
        x=unique,
        y=b"",
    )


def node_key_template(unique: bytes) -> bytes:
    """The marshalled TPMT_PUBLIC template of the node key with this ``unique``."""
    if not isinstance(unique, bytes) or len(unique) != UNIQUE_SIZE:
        raise TpmError(f"a node key's unique value is {UNIQUE_SIZE} bytes")
    return _p256_signing_template(NODE_KEY_ATTRIBUTES, unique)


def node_key_public_area(public_key: object) -> bytes:
    """The TPMT_PUBLIC a TPM reports for a node key holding ``public_key`` (P-256).

    The TPM replaces the template's ``unique`` with the public point, so the public
    area, and hence the name (:func:`bcd.tpm.structures.name_of`), follow from the
    public key alone: the control plane computes the name of a CSR's key with it.
    """
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP256R1
    ):
        raise TpmError("a node key is a P-256 key")
    return p256_public_area(public_key, NODE_KEY_ATTRIBUTES)


def p256_public_area(public_key: ec.EllipticCurvePublicKey, attributes: int) -> bytes:
    """The TPMT_PUBLIC of a P-256 ECDSA/SHA-256 signing key with ``attributes`` holding
    ``public_key`` (what the TPM reports once it made the key from our template)."""
    numbers = public_key.public_numbers()
    return ecc_public(
        name_alg=ALG_SHA256,
        attributes=attributes,
        scheme=ALG_ECDSA,
        scheme_hash=ALG_SHA256,
        curve=ECC_NIST_P256,
        x=numbers.x.to_bytes(32, "big"),
        y=numbers.y.to_bytes(32, "big"),
    )


def ak_template() -> bytes:
    """The marshalled TPMT_PUBLIC template of bcd's attestation key."""
    return _p256_signing_template(AK_ATTRIBUTES, AK_UNIQUE)


def _is_p256_signing_key(info: PublicInfo, attributes: int) -> bool:
    return (
        info.type == ALG_ECC
        and info.name_alg == ALG_SHA256
        and info.attributes == attributes
        and info.auth_policy == b""
        and info.symmetric[0] == ALG_NULL
        and info.scheme == (ALG_ECDSA, ALG_SHA256)
        and info.curve == ECC_NIST_P256
        and info.kdf[0] == ALG_NULL
    )


def check_node_key_public(public: bytes) -> PublicInfo:
    """Parse a node key's TPMT_PUBLIC; raise TpmError unless it has the node-key template."""
    info = parse_public(public)
    if not _is_p256_signing_key(info, NODE_KEY_ATTRIBUTES):
        raise TpmError("the key does not have the node-key attributes")
    return info


def check_ak_public(public: bytes) -> PublicInfo:
    """Parse an AK's TPMT_PUBLIC; raise TpmError unless it has bcd's AK template."""
    info = parse_public(public)
    if not _is_p256_signing_key(info, AK_ATTRIBUTES):
        raise TpmError("the attestation key does not have the AK attributes")
    return info


def check_ek_public(public: bytes) -> PublicInfo:
    """Parse an EK's TPMT_PUBLIC; raise TpmError unless it is a restricted decryption key."""
    info = parse_public(public)
    if (
        not info.has(EK_REQUIRED_ATTRIBUTES)
        or info.has(SIGN_ENCRYPT)
        or info.symmetric[0] == ALG_NULL
    ):
        raise TpmError("the endorsement key does not have the EK attributes")
    return info
