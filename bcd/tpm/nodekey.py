"""Node keys in the TPM: derived, never stored.

The node key is a primary under the owner hierarchy, created from the node-key
template (:mod:`bcd.tpm.templates`) and a random 32-byte ``unique`` value. node.key
holds only a :class:`~bcd.tpm.record.NodeKeyRecord`: the same record derives the
same key after a restart, and another key once the owner seed changes
(``tpm2_clear``), which :func:`derive_node_key` reports with
:class:`~bcd.tpm.TpmKeyMismatch`.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric import ec
from tpm2_pytss import TPMT_SIG_SCHEME
from tpm2_pytss.constants import TPM2_ALG

from bcd.tpm import TpmError, TpmKeyMismatch
from bcd.tpm.device import OWNER, Loaded, Tpm
from bcd.tpm.record import (
    NodeKeyPublic,
    NodeKeyRecord,
    create_node_key_record,
    node_key_public,
)
from bcd.tpm.structures import parse_signature_ecdsa
from bcd.tpm.templates import node_key_template

__all__ = [
    "NodeKeyPublic",
    "NodeKeyRecord",
    "check_derived",
    "create_node_key_record",
    "derive_node_key",
    "public_key_of",
    "sign",
]


def check_derived(key: Loaded, record: NodeKeyRecord) -> NodeKeyPublic:
    """Check a freshly derived node key: node-key attributes, the record's pin, its name."""
    try:
        public = node_key_public(key.public, record)
    except TpmKeyMismatch:
        raise
    except TpmError as exc:
        raise TpmError("the TPM derived a key without the node-key attributes") from exc
    if public.name != key.name:
        raise TpmError("the TPM's name for the node key does not match its public area")
    return public


def public_key_of(tpm: Tpm, record: NodeKeyRecord) -> NodeKeyPublic:
    """Derive the record's key and return its public half, public area and name.

    Raises TpmError if the key lacks the node-key attributes, TpmKeyMismatch if the
    record is pinned to another key.
    """
    with (
        tpm.op("deriving the node key"),
        tpm.primary(OWNER, node_key_template(record.unique_bytes)) as key,
    ):
        return check_derived(key, record)


def derive_node_key(tpm: Tpm, record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:
    """The public key the TPM derives from ``record`` (checked as :func:`public_key_of`)."""
    return public_key_of(tpm, record).public_key


def sign(tpm: Tpm, record: NodeKeyRecord, digest: bytes) -> bytes:
    """Sign a SHA-256 digest with the record's key: a 64-byte P1363 signature (r || s)."""
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise TpmError("the TPM signs a 32-byte SHA-256 digest")
    with (
        tpm.op("signing with the node key") as esapi,
        tpm.primary(OWNER, node_key_template(record.unique_bytes)) as key,
    ):
        check_derived(key, record)
        signature = esapi.sign(key.handle, digest, TPMT_SIG_SCHEME(scheme=TPM2_ALG.NULL))
        return parse_signature_ecdsa(bytes(signature.marshal()))
