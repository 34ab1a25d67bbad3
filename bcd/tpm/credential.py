"""Credential activation: the server encrypts a secret to the EK for the AK's name
(:func:`make_credential`, no TPM), and only the TPM holding both keys recovers it
(:func:`activate_credential`).

Blobs travel as the contents of their TPM2B structures: the credential blob is a
TPMS_ID_OBJECT (integrity HMAC and encrypted credential), the encrypted secret the
EK-encrypted seed.
"""

from __future__ import annotations

import contextlib

from tpm2_pytss import (
    TPM2B_ENCRYPTED_SECRET,
    TPM2B_ID_OBJECT,
    TPMT_PUBLIC,
    TPMT_SYM_DEF,
)
from tpm2_pytss.constants import ESYS_TR, TPM2_ALG, TPM2_SE
from tpm2_pytss.TSS2_Exception import TSS2_Exception
from tpm2_pytss.utils import make_credential as _make_credential

from bcd.tpm import TpmError
from bcd.tpm.ak import check_derived_ak
from bcd.tpm.device import ENDORSEMENT, Tpm
from bcd.tpm.ek import ek_template
from bcd.tpm.structures import HASH_SIZES, USER_WITH_AUTH, parse_name
from bcd.tpm.templates import ak_template, check_ek_public

MAX_CREDENTIAL_BLOB = 132  # sizeof(TPMS_ID_OBJECT): two TPM2B of at most 64 bytes
MAX_ENCRYPTED_SECRET = 512  # an RSA-4096 encrypted seed


def make_credential(ek_public: bytes, ak_name: bytes, secret: bytes) -> tuple[bytes, bytes]:
    """Encrypt ``secret`` to the EK for the object named ``ak_name`` (TPM2_MakeCredential).

    Pure: the server's half. ``secret`` is 1 to digest-size-of-the-EK's-nameAlg
    bytes. Returns (credential blob, encrypted secret).
    """
    info = check_ek_public(ek_public)
    parse_name(ak_name, "the AK name")
    if not isinstance(secret, bytes) or not 1 <= len(secret) <= HASH_SIZES[info.name_alg]:
        raise TpmError(
            f"the credential is 1 to {HASH_SIZES[info.name_alg]} bytes for this EK's name algorithm"
        )
    try:
        public, _ = TPMT_PUBLIC.unmarshal(ek_public)
        blob, encrypted = _make_credential(public, secret, ak_name)
    except (TSS2_Exception, ValueError, TypeError) as exc:
        raise TpmError("cannot make a credential for this EK") from exc
    return bytes(blob), bytes(encrypted)


def activate_credential(
    tpm: Tpm, credential_blob: bytes, secret: bytes, kind: str | None = None
) -> bytes:
    """TPM2_ActivateCredential with bcd's AK and the EK of ``kind``: the credential.

    The EK of the low-range templates has no userWithAuth: its use is authorised by
    a policy session with PolicySecret on the endorsement hierarchy.
    """
    if (
        not isinstance(credential_blob, bytes)
        or not 0 < len(credential_blob) <= MAX_CREDENTIAL_BLOB
    ):
        raise TpmError("the credential blob is malformed")
    if not isinstance(secret, bytes) or not 0 < len(secret) <= MAX_ENCRYPTED_SECRET:
        raise TpmError("the encrypted secret is malformed")
    with tpm.op("activating the credential") as esapi:
        template = ek_template(tpm, kind)
        with (
            tpm.primary(ENDORSEMENT, ak_template()) as ak,
            tpm.primary(ENDORSEMENT, template) as ek,
        ):
            check_derived_ak(ak)
            ek_info = check_ek_public(ek.public)
            blob = TPM2B_ID_OBJECT(credential=credential_blob)
            encrypted = TPM2B_ENCRYPTED_SECRET(secret=secret)
            if ek_info.has(USER_WITH_AUTH):
                cert_info = esapi.activate_credential(ak.handle, ek.handle, blob, encrypted)
                return bytes(cert_info)
            session = esapi.start_auth_session(
                ESYS_TR.NONE,
                ESYS_TR.NONE,
                TPM2_SE.POLICY,
                TPMT_SYM_DEF(algorithm=TPM2_ALG.NULL),
                ek_info.name_alg,
            )
            try:
                esapi.policy_secret(ESYS_TR.ENDORSEMENT, session)
                cert_info = esapi.activate_credential(
                    ak.handle, ek.handle, blob, encrypted, session2=session
                )
            except TSS2_Exception:
                with contextlib.suppress(TSS2_Exception):  # report the first failure
                    esapi.flush_context(session)
                raise
            esapi.flush_context(session)
            return bytes(cert_info)
