"""bcd's attestation key (AK) and TPM2_Certify of a node key.

The AK is a primary under the endorsement hierarchy from a fixed template
(:func:`bcd.tpm.templates.ak_template`): a restricted ECC P-256 signing key. It is
derived again for every use and survives ``tpm2_clear`` (the endorsement seed
does not change).
"""

from __future__ import annotations

from tpm2_pytss import TPMT_SIG_SCHEME
from tpm2_pytss.constants import TPM2_ALG

from bcd.tpm import TpmError
from bcd.tpm.device import ENDORSEMENT, OWNER, Loaded, Tpm
from bcd.tpm.nodekey import NodeKeyRecord, check_derived
from bcd.tpm.structures import parse_signature_ecdsa
from bcd.tpm.templates import ak_template, check_ak_public, node_key_template


def check_derived_ak(ak: Loaded) -> None:
    """Check a freshly derived AK: bcd's AK template, and the TPM's name for it."""
    try:
        info = check_ak_public(ak.public)
    except TpmError as exc:
        raise TpmError("the TPM derived an AK without the AK attributes") from exc
    if info.name != ak.name:
        raise TpmError("the TPM's name for the AK does not match its public area")


def ak_public(tpm: Tpm) -> tuple[bytes, bytes]:
    """The AK's marshalled TPMT_PUBLIC and its name (nameAlg || SHA-256 of it)."""
    with tpm.op("deriving the AK"), tpm.primary(ENDORSEMENT, ak_template()) as ak:
        check_derived_ak(ak)
        return ak.public, ak.name


def certify(tpm: Tpm, record: NodeKeyRecord, qualifying_data: bytes) -> tuple[bytes, bytes]:
    """TPM2_Certify of the record's node key by the AK.

    ``qualifying_data`` is the 32-byte SHA-256 of the CSR. Returns the TPMS_ATTEST
    bytes and the AK's 64-byte P1363 signature over their SHA-256.
    """
    if not isinstance(qualifying_data, bytes) or len(qualifying_data) != 32:
        raise TpmError("the qualifying data is a 32-byte SHA-256 digest")
    with (
        tpm.op("certifying the node key") as esapi,
        tpm.primary(ENDORSEMENT, ak_template()) as ak,
        tpm.primary(OWNER, node_key_template(record.unique_bytes)) as key,
    ):
        check_derived_ak(ak)
        check_derived(key, record)
        attest, signature = esapi.certify(
            key.handle, ak.handle, qualifying_data, TPMT_SIG_SCHEME(scheme=TPM2_ALG.NULL)
        )
        return bytes(attest), parse_signature_ecdsa(bytes(signature.marshal()))
