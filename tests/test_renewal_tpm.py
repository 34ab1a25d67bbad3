"""AK-bound renewals on the control plane, with attestations a real swtpm makes.

A leaf naming an AK renews only with that AK's TPM2_Certify of the new key over
sha256(csr); a missing or failing attestation is refused, never downgraded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from bcd import pki as bpki
from bcd.tpm.ak import ak_public, certify
from bcd.tpm.attestation import KeyAttestation, ak_statement
from bcd.tpm.device import open_tpm
from bcd.tpm.nodekey import public_key_of, sign
from bcd.tpm.record import create_node_key_record
from bcd.tpm.structures import name_of
from bcd.tpm.templates import node_key_public_area
from tests.swtpm import SwTpm
from tests.world.renewals import OWNER, Env


def _tpm_renewal(
    swtpm: SwTpm, qualifying: bytes | None = None
) -> tuple[bytes, dict[str, Any], str]:
    """A CSR for a new key in the TPM, its attestation by the TPM's AK, the AK statement."""
    record = create_node_key_record()
    with open_tpm(swtpm.tcti) as tpm:
        ak_pub, ak_name = ak_public(tpm)
        key = public_key_of(tpm, record)
        record = record.pinned(key.public_key)
        csr = bpki.make_csr_with(key.public_key, lambda d: sign(tpm, record, d))
        attest, sig = certify(tpm, record, qualifying or hashlib.sha256(csr).digest())
    attestation = KeyAttestation(ak_pub, key.public_area, attest, sig).to_json()
    return csr, attestation, ak_statement(ak_name)


def test_an_ak_bound_renewal_with_the_aks_certify_is_issued(env: Env, swtpm: SwTpm) -> None:
    csr, attestation, statement = _tpm_renewal(swtpm)
    node = env.issue_extra(env.join(40), (statement,))
    attempt = env.body(node, csr_der=csr, key_attestation=attestation)
    body = env.renew_raw(attempt, node.der)
    leaf = bpki.load_pem_chain(body["chain"])[0]
    assert bpki.leaf_info(leaf).statements == (statement,)
    assert body["csr_sha256"] == bpki.sha256_hex(csr)


@pytest.mark.parametrize(
    ("bend", "reason"),
    [
        ("missing", "key-attestation-missing"),
        ("another-ak", "key-attestation-ak"),
        ("malformed", "node-key-malformed"),
        ("not-a-node-key", "node-key-attributes"),
        ("another-key", "node-key-mismatch"),
        ("other-qualifying-data", "node-key-certify"),
    ],
)
def test_an_ak_bound_renewal_is_refused_never_downgraded(
    env: Env, swtpm: SwTpm, bend: str, reason: str
) -> None:
    csr, attestation, statement = _tpm_renewal(
        swtpm, b"\x00" * 32 if bend == "other-qualifying-data" else None
    )
    node = env.issue_extra(env.join(41), (statement,))
    if bend == "missing":
        attestation = None  # type: ignore[assignment]
    elif bend == "another-ak":
        node = env.issue_extra(env.join(42), ("urn:bc:tpm-ak:sha256:" + "cd" * 32,))
    elif bend == "malformed":
        attestation = {**attestation, "certify_sig": "***"}
    elif bend == "not-a-node-key":
        ak_pub = attestation["ak_public"]
        attestation = {**attestation, "key_public": ak_pub}
    elif bend == "another-key":
        csr = bpki.make_csr(bpki.generate_key())
    env.refused(
        env.body(node, csr_der=csr, key_attestation=attestation),
        node.der,
        reason,
        routed_to=OWNER,
        node=node,
    )


def test_the_certified_name_is_computed_from_the_csr_key(swtpm: SwTpm) -> None:
    record = create_node_key_record()
    with open_tpm(swtpm.tcti) as tpm:
        key = public_key_of(tpm, record)
    assert name_of(node_key_public_area(key.public_key)) == key.name
