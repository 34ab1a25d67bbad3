"""The endorsement key (EK) and its certificate, as the TCG EK Credential Profile places them.

A TPM may hold several EK certificates; bcd uses the first present in
:data:`EK_KINDS` (the RSA-2048 certificate at NV 0x01C00002 first, as most TPMs
have one). The EK is created again from the standard template of that kind,
completed from the template and nonce NV indices when the TPM defines them, so
it is the key the certificate names; the persistent EK handles are not used
(``tpm2_clear`` evicts them).
"""

from __future__ import annotations

from typing import Any

from cryptography import x509
from tpm2_pytss.utils import NoSuchIndex, create_ek_template

from bcd.tpm import TpmError
from bcd.tpm.device import ENDORSEMENT, Tpm
from bcd.tpm.templates import check_ek_public

# (kind as tpm2-pytss names it, the NV index of its certificate), in order of preference
EK_KINDS: tuple[tuple[str, int], ...] = (
    ("EK-RSA2048", 0x01C00002),
    ("EK-ECC256", 0x01C0000A),
    ("EK-HIGH-RSA2048", 0x01C00012),
    ("EK-HIGH-ECC256", 0x01C00014),
    ("EK-HIGH-ECC384", 0x01C00016),
    ("EK-HIGH-ECC521", 0x01C00018),
    ("EK-HIGH-RSA3072", 0x01C0001C),
    ("EK-HIGH-RSA4096", 0x01C0001E),
)
EK_CERT_INDEX = dict(EK_KINDS)
MAX_CERT = 4096


def ek_kind(tpm: Tpm) -> str:
    """The kind of the EK bcd uses: the first in EK_KINDS whose certificate the TPM holds."""
    present = tpm.nv_indices()
    for kind, index in EK_KINDS:
        if index in present:
            return kind
    raise TpmError("the TPM holds no EK certificate (none of the TCG EK certificate NV indices)")


def _kind(tpm: Tpm, kind: str | None) -> str:
    if kind is None:
        return ek_kind(tpm)
    if kind not in EK_CERT_INDEX:
        raise TpmError(f"unknown EK kind {kind!r}")
    return kind


def _der_length(data: bytes) -> int:
    """The length of the DER SEQUENCE at the start of ``data`` (header included)."""
    if len(data) < 2 or data[0] != 0x30:
        raise TpmError("the EK certificate in NV is not DER")
    first = data[1]
    if first < 0x80:
        return 2 + first
    count = first & 0x7F
    if count == 0 or count > 2 or len(data) < 2 + count:
        raise TpmError("the EK certificate in NV is not DER")
    return 2 + count + int.from_bytes(data[2 : 2 + count], "big")


def read_ek_certificate(tpm: Tpm, kind: str | None = None) -> bytes:
    """The DER EK certificate of ``kind`` (by default :func:`ek_kind`), padding removed."""
    kind = _kind(tpm, kind)
    index = EK_CERT_INDEX[kind]
    if index not in tpm.nv_indices():
        raise TpmError(f"the TPM holds no {kind} certificate (NV 0x{index:08x})")
    data = tpm.nv_read(index, MAX_CERT)
    size = _der_length(data)
    if size > len(data):
        raise TpmError(f"the EK certificate in NV 0x{index:08x} is truncated")
    der = data[:size]
    try:
        x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise TpmError(f"the EK certificate in NV 0x{index:08x} does not parse") from exc
    return der


def ek_template(tpm: Tpm, kind: str | None = None) -> bytes:
    """The marshalled TPMT_PUBLIC template of the EK of ``kind`` on this TPM."""
    kind = _kind(tpm, kind)
    present = tpm.nv_indices()

    def read(index: Any) -> bytes:
        if int(index) not in present:
            raise NoSuchIndex(int(index))
        return tpm.nv_read(int(index))

    with tpm.op("building the EK template"):
        try:
            _, template = create_ek_template(kind, read)
        except ValueError as exc:
            raise TpmError(f"no {kind} template: {exc}") from exc
        return bytes(template.publicArea.marshal())


def ek_public(tpm: Tpm, kind: str | None = None) -> bytes:
    """The EK's marshalled TPMT_PUBLIC (CreatePrimary from its template, then flushed)."""
    with tpm.op("deriving the EK"):
        template = ek_template(tpm, kind)
        with tpm.primary(ENDORSEMENT, template) as ek:
            check_ek_public(ek.public)
            return ek.public
