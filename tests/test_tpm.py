"""bcd.tpm against a real swtpm (the session's ``swtpm`` fixture), and its pure parsers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tpm2_pytss import ESAPI, TPM2B_PUBLIC, TPM2B_SENSITIVE_CREATE, TPMT_PUBLIC, TPMT_SYM_DEF
from tpm2_pytss.constants import ESYS_TR, TPM2_ALG, TPM2_CAP, TPM2_HC, TPM2_SE

from bcd.errors import BcdError
from bcd.pki import PkiError, sign_p1363, spki_pin, verify_p1363
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmError, TpmKeyMismatch
from bcd.tpm.ak import ak_public, certify
from bcd.tpm.credential import activate_credential, make_credential
from bcd.tpm.device import Tpm, open_tpm
from bcd.tpm.ek import EK_CERT_INDEX, ek_kind, ek_public, read_ek_certificate
from bcd.tpm.nodekey import (
    NodeKeyRecord,
    create_node_key_record,
    derive_node_key,
    public_key_of,
    sign,
)
from bcd.tpm.record import node_key_public
from bcd.tpm.structures import (
    ALG_ECDSA,
    ALG_SHA256,
    ECC_NIST_P256,
    ST_ATTEST_CERTIFY,
    TPM_GENERATED_VALUE,
    ecc_public,
    name_of,
    parse_certify_attest,
    parse_name,
    parse_public,
    tpm2b,
)
from bcd.tpm.templates import (
    AK_ATTRIBUTES,
    NODE_KEY_ATTRIBUTES,
    ak_template,
    check_ak_public,
    check_ek_public,
    check_node_key_public,
    node_key_public_area,
    node_key_template,
    p256_public_area,
)
from bcd.tpm.verify import check_ek_certificate, verify_certify
from tests.swtpm import SwTpm

CSR_DIGEST = hashlib.sha256(b"a CSR").digest()


@pytest.fixture
def tpm(swtpm: SwTpm) -> Iterator[Tpm]:
    with open_tpm(swtpm.tcti) as t:
        yield t
    # every test leaves the TPM without transient objects or sessions (looked at
    # without open_tpm, which would flush them)
    raw = Tpm(ESAPI(swtpm.tcti), swtpm.tcti)
    try:
        assert _transients(raw) == []
    finally:
        raw.close()


def _transients(t: Tpm) -> list[int]:
    with t.op("listing") as esapi:
        handles: list[int] = []
        for first in (TPM2_HC.TRANSIENT_FIRST, TPM2_HC.LOADED_SESSION_FIRST):
            _, data = esapi.get_capability(TPM2_CAP.HANDLES, first, 64)
            handles += [int(h) for h in data.data.handles]
        return handles


def _leave_object(t: Tpm) -> None:
    """Create a primary and do not flush it, like a crashed helper."""
    public, _ = TPMT_PUBLIC.unmarshal(node_key_template(b"\x01" * 32))
    with t.op("leaving an object") as esapi:
        esapi.create_primary(
            TPM2B_SENSITIVE_CREATE(), TPM2B_PUBLIC(publicArea=public), ESYS_TR.OWNER
        )


def _software_ak(key: ec.EllipticCurvePrivateKey, attributes: int = AK_ATTRIBUTES) -> bytes:
    """A TPMT_PUBLIC with the AK template's properties around a software key."""
    return p256_public_area(key.public_key(), attributes)


def _attest(extra: bytes, name: bytes, *, magic: int = TPM_GENERATED_VALUE) -> bytes:
    return (
        struct.pack(">IH", magic, ST_ATTEST_CERTIFY)
        + tpm2b(b"\x00\x0b" + b"s" * 32)
        + tpm2b(extra)
        + struct.pack(">QIIB", 1, 2, 3, 1)
        + struct.pack(">Q", 4)
        + tpm2b(name)
        + tpm2b(b"\x00\x0b" + b"q" * 32)
    )


def _sign_attest(key: ec.EllipticCurvePrivateKey, attest: bytes) -> bytes:
    return sign_p1363(key, attest)


# --- the device ---------------------------------------------------------------------


def test_open_flushes_leftovers(swtpm: SwTpm) -> None:
    with open_tpm(swtpm.tcti) as t:
        _leave_object(t)
        _leave_object(t)
        with t.op("leaving a session") as esapi:
            esapi.start_auth_session(
                ESYS_TR.NONE,
                ESYS_TR.NONE,
                TPM2_SE.POLICY,
                TPMT_SYM_DEF(algorithm=TPM2_ALG.NULL),
                TPM2_ALG.SHA256,
            )
        assert len(_transients(t)) == 3
    with open_tpm(swtpm.tcti) as t:  # the next process finds them and flushes them
        assert _transients(t) == []
        _leave_object(t)
        assert t.flush_leftovers() == 1
        assert _transients(t) == []


def test_full_object_slots_are_a_clear_error(tpm: Tpm) -> None:
    for _ in range(3):
        _leave_object(tpm)
    with pytest.raises(TpmError, match="no free slot") as info:
        derive_node_key(tpm, create_node_key_record())
    assert isinstance(info.value, BcdError)
    tpm.flush_leftovers()
    derive_node_key(tpm, create_node_key_record())


def test_open_unreachable_or_bad_tcti() -> None:
    cases = [
        ("swtpm:host=127.0.0.1,port=1", r"cannot open the TPM at swtpm:host=127\.0\.0\.1,port=1"),
        ("no-such-tcti:whatever", "cannot open the TPM"),
        ("", "not a TCTI"),
    ]
    for tcti, message in cases:
        with pytest.raises(TpmError, match=message), open_tpm(tcti):
            pass  # pragma: no cover


def test_lost_tpm_is_a_clear_error(swtpm: SwTpm) -> None:
    with open_tpm(swtpm.tcti) as t:
        swtpm.stop()
        try:
            with pytest.raises(TpmError, match="cannot reach the TPM at swtpm:"):
                derive_node_key(t, create_node_key_record())
        finally:
            swtpm.start()
    with open_tpm(swtpm.tcti) as t:
        derive_node_key(t, create_node_key_record())


def test_pure_modules_do_not_load_tpm2_pytss() -> None:
    """The control plane and ``bcd node`` parse TPM structures without libtss2."""
    code = (
        "import sys, bcd.tpm.record, bcd.tpm.structures, bcd.tpm.templates, bcd.tpm.verify\n"
        "assert 'tpm2_pytss' not in sys.modules, 'tpm2_pytss was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_closed_tpm_refuses(swtpm: SwTpm) -> None:
    with open_tpm(swtpm.tcti) as t:
        pass
    with pytest.raises(TpmError, match="closed"):
        derive_node_key(t, create_node_key_record())


# --- node keys ----------------------------------------------------------------------


def test_record_json_round_trip() -> None:
    record = create_node_key_record()
    assert len(record.unique_bytes) == 32
    assert create_node_key_record().unique != record.unique
    assert record.pin is None
    pinned = record.pinned(ec.generate_private_key(ec.SECP256R1()).public_key())
    text = pinned.to_json()
    assert json.loads(text) == {
        "version": 1,
        "kind": "tpm",
        "template": "bcd-node-ecc-p256-v1",
        "unique": record.unique,
        "pin": pinned.pin,
    }
    assert NodeKeyRecord.from_json(text) == pinned
    assert NodeKeyRecord.from_json(record.to_json()) == record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "version"),
        ({"version": True}, "version"),
        ({"kind": "file"}, "not a TPM key record"),
        ({"template": "other"}, "template"),
        ({"unique": "AB" * 32}, "unique"),
        ({"unique": "ab" * 31}, "unique"),
        ({"unique": 5}, "unique"),
        ({"pin": "sha256/x"}, "pin"),
        ({"extra": 1}, "not a TPM key record"),
    ],
)
def test_record_rejects(change: dict[str, object], message: str) -> None:
    data = create_node_key_record().to_dict() | change
    with pytest.raises(TpmError, match=message):
        NodeKeyRecord.from_json(json.dumps(data).encode())


def test_record_rejects_missing_fields_and_non_json() -> None:
    data = create_node_key_record().to_dict()
    del data["unique"]
    with pytest.raises(TpmError, match="has no unique"):
        NodeKeyRecord.from_json(json.dumps(data).encode())
    for bad in (b"", b"[]", b"\xff", b"-----BEGIN PRIVATE KEY-----", b"{" * 5000, b"[" * 4000):
        with pytest.raises(TpmError):
            NodeKeyRecord.from_json(bad)


@given(st.binary(max_size=300))
def test_record_parser_raises_only_tpm_error(data: bytes) -> None:
    with contextlib.suppress(TpmError):
        NodeKeyRecord.from_json(data)


@given(
    st.dictionaries(
        st.sampled_from(["version", "kind", "template", "unique", "pin", "x"]),
        st.none() | st.booleans() | st.integers() | st.text(max_size=70) | st.lists(st.integers()),
    )
)
def test_record_dict_parser_raises_only_tpm_error(data: dict[str, object]) -> None:
    with contextlib.suppress(TpmError):
        NodeKeyRecord.from_dict(data)


def test_node_key_public_checks_attributes_and_pin() -> None:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    area = node_key_public_area(key)
    record = create_node_key_record()
    public = node_key_public(area, record.pinned(key))
    assert spki_pin(public.public_key) == spki_pin(key)
    assert public.name == name_of(area)
    assert node_key_public(area, record).public_area == area  # unpinned: any node key
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    with pytest.raises(TpmKeyMismatch):
        node_key_public(area, record.pinned(other))
    with pytest.raises(TpmError, match="node-key attributes"):
        node_key_public(_software_ak(ec.generate_private_key(ec.SECP256R1())), record)


def test_node_key_is_derived_again_and_has_the_node_key_attributes(tpm: Tpm) -> None:
    record = create_node_key_record()
    key = derive_node_key(tpm, record)
    assert isinstance(key.curve, ec.SECP256R1)
    assert spki_pin(derive_node_key(tpm, record)) == spki_pin(key)
    assert spki_pin(derive_node_key(tpm, create_node_key_record())) != spki_pin(key)
    public = public_key_of(tpm, record)
    assert spki_pin(public.public_key) == spki_pin(key)
    info = check_node_key_public(public.public_area)
    assert info.attributes == NODE_KEY_ATTRIBUTES == 0x00040072
    assert public.name == name_of(public.public_area) == info.name
    assert parse_name(public.name)[0] == ALG_SHA256


def test_sign_gives_p1363_signatures_of_the_key(tpm: Tpm) -> None:
    record = create_node_key_record()
    record = record.pinned(derive_node_key(tpm, record))
    key = derive_node_key(tpm, record)
    message = b"bc-renew-pop-v1\nsomething"
    signature = sign(tpm, record, hashlib.sha256(message).digest())
    assert len(signature) == 64
    verify_p1363(key, signature, message)  # the signature is over SHA-256(message)
    with pytest.raises(PkiError):
        verify_p1363(key, signature, message + b"!")
    for digest in (b"", b"x" * 31, b"x" * 33, "x" * 32):
        with pytest.raises(TpmError, match="32-byte"):
            sign(tpm, record, digest)  # type: ignore[arg-type]


def test_pinned_record_of_another_key_is_refused(tpm: Tpm) -> None:
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    record = create_node_key_record().pinned(other)
    with pytest.raises(TpmKeyMismatch) as info:
        derive_node_key(tpm, record)
    assert str(info.value) == KEY_MISMATCH_MESSAGE
    with pytest.raises(TpmKeyMismatch):
        sign(tpm, record, CSR_DIGEST)
    with pytest.raises(TpmKeyMismatch):
        certify(tpm, record, CSR_DIGEST)


def test_restart_keeps_and_clear_changes_the_node_key(swtpm: SwTpm) -> None:
    record = create_node_key_record()
    with open_tpm(swtpm.tcti) as t:
        record = record.pinned(derive_node_key(t, record))
        ak_before = ak_public(t)
        ek_before = ek_public(t)
        # the EKs bcd derives are the ones swtpm_setup made persistent
        persistent = {0x81010001: ek_before, 0x81010016: ek_public(t, "EK-HIGH-ECC384")}
        assert _persistent_names(t) == {h: name_of(p) for h, p in persistent.items()}
    swtpm.restart()
    with open_tpm(swtpm.tcti) as t:
        assert spki_pin(derive_node_key(t, record)) == record.pin
        assert ak_public(t) == ak_before
    swtpm.clear()
    with open_tpm(swtpm.tcti) as t:
        with pytest.raises(TpmKeyMismatch, match=r"was the TPM cleared\?"):
            derive_node_key(t, record)
        unpinned = NodeKeyRecord(unique=record.unique)
        assert spki_pin(derive_node_key(t, unpinned)) != record.pin
        # the endorsement seed stays: the AK and the EK are the same keys, although
        # the clear evicted the persistent EKs
        assert ak_public(t) == ak_before
        assert ek_public(t) == ek_before
        assert _persistent_names(t) == {}


def _persistent_names(t: Tpm) -> dict[int, bytes]:
    names = {}
    with t.op("reading persistent handles") as esapi:
        _, data = esapi.get_capability(TPM2_CAP.HANDLES, TPM2_HC.PERSISTENT_FIRST, 64)
        for handle in data.data.handles:
            tr = esapi.tr_from_tpmpublic(handle)
            names[int(handle)] = bytes(esapi.tr_get_name(tr))
            esapi.tr_close(tr)
    return names


# --- the EK -------------------------------------------------------------------------


def test_ek_certificates_are_read_from_nv(tpm: Tpm, swtpm: SwTpm) -> None:
    assert ek_kind(tpm) == "EK-RSA2048"
    assert EK_CERT_INDEX["EK-RSA2048"] == 0x01C00002
    assert EK_CERT_INDEX["EK-HIGH-ECC384"] == 0x01C00016
    issuer = x509.load_pem_x509_certificate(swtpm.issuer_cert.read_bytes())
    root = x509.load_pem_x509_certificate(swtpm.root_cert.read_bytes())
    issuer.verify_directly_issued_by(root)
    for kind, file in (("EK-RSA2048", "ek-rsa2048.crt"), ("EK-HIGH-ECC384", "ek-secp384r1.crt")):
        der = read_ek_certificate(tpm, kind)
        assert der == (swtpm.cert_dir / file).read_bytes()
        cert = x509.load_der_x509_certificate(der)
        cert.verify_directly_issued_by(issuer)
        public = ek_public(tpm, kind)
        assert check_ek_certificate(public, der) == cert
    assert read_ek_certificate(tpm) == read_ek_certificate(tpm, "EK-RSA2048")
    assert ek_public(tpm) == ek_public(tpm, "EK-RSA2048")
    bundle = x509.load_pem_x509_certificates(swtpm.ca_bundle.read_bytes())
    assert bundle == [issuer, root]


def test_ek_of_a_missing_or_unknown_kind(tpm: Tpm) -> None:
    with pytest.raises(TpmError, match="no EK-ECC256 certificate"):
        read_ek_certificate(tpm, "EK-ECC256")
    with pytest.raises(TpmError, match="unknown EK kind"):
        ek_public(tpm, "EK-DSA")


def test_ek_certificate_of_another_key_is_refused(tpm: Tpm) -> None:
    rsa_cert = read_ek_certificate(tpm, "EK-RSA2048")
    with pytest.raises(TpmError, match="another key"):
        check_ek_certificate(ek_public(tpm, "EK-HIGH-ECC384"), rsa_cert)
    with pytest.raises(TpmError, match="does not parse"):
        check_ek_certificate(ek_public(tpm), b"junk")
    node_public = public_key_of(tpm, create_node_key_record()).public_area
    with pytest.raises(TpmError, match="EK attributes"):
        check_ek_certificate(node_public, rsa_cert)


# --- the AK and TPM2_Certify -------------------------------------------------------


def test_ak_is_a_stable_restricted_signing_key(tpm: Tpm) -> None:
    public, name = ak_public(tpm)
    assert (public, name) == ak_public(tpm)
    info = check_ak_public(public)
    assert info.attributes == AK_ATTRIBUTES == 0x00050072
    assert name == name_of(public)
    with pytest.raises(TpmError, match="AK attributes"):
        check_ak_public(public_key_of(tpm, create_node_key_record()).public_area)
    with pytest.raises(TpmError, match="node-key attributes"):
        check_node_key_public(public)


def test_certify_verifies(tpm: Tpm) -> None:
    record = create_node_key_record()
    record = record.pinned(derive_node_key(tpm, record))
    key_name = public_key_of(tpm, record).name
    ak, _ = ak_public(tpm)
    attest, signature = certify(tpm, record, CSR_DIGEST)
    assert len(signature) == 64
    verify_certify(attest, signature, ak, key_name, CSR_DIGEST)
    info = parse_certify_attest(attest)
    assert info.extra_data == CSR_DIGEST
    assert info.name == key_name

    with pytest.raises(TpmError, match="other qualifying data"):
        verify_certify(attest, signature, ak, key_name, hashlib.sha256(b"another CSR").digest())
    other_name = public_key_of(tpm, create_node_key_record()).name
    with pytest.raises(TpmError, match="another key"):
        verify_certify(attest, signature, ak, other_name, CSR_DIGEST)
    another_ak = _software_ak(ec.generate_private_key(ec.SECP256R1()))
    with pytest.raises(TpmError, match="the AK's signature does not verify"):
        verify_certify(attest, signature, another_ak, key_name, CSR_DIGEST)
    tampered = attest[:-1] + bytes([attest[-1] ^ 1])
    with pytest.raises(TpmError, match="does not verify"):
        verify_certify(tampered, signature, ak, key_name, CSR_DIGEST)
    with pytest.raises(TpmError, match="does not verify"):
        verify_certify(attest, signature[:32] + bytes(32), ak, key_name, CSR_DIGEST)
    with pytest.raises(TpmError, match="64 bytes"):
        verify_certify(attest, signature[:63], ak, key_name, CSR_DIGEST)
    # a node key (not restricted) is no AK, even when its signature verifies
    with pytest.raises(TpmError, match="AK attributes"):
        verify_certify(
            attest, signature, public_key_of(tpm, record).public_area, key_name, CSR_DIGEST
        )
    with pytest.raises(TpmError, match="32-byte"):
        certify(tpm, record, b"short")


def test_certify_by_another_ak_does_not_verify(tpm: Tpm) -> None:
    """An AK made from another template in the same TPM is not the announced AK."""
    record = create_node_key_record()
    key_name = public_key_of(tpm, record).name
    attest, signature = certify(tpm, record, CSR_DIGEST)
    other_template = ecc_public(
        name_alg=ALG_SHA256,
        attributes=AK_ATTRIBUTES,
        scheme=ALG_ECDSA,
        scheme_hash=ALG_SHA256,
        curve=ECC_NIST_P256,
        x=b"another AK".ljust(32, b"\0"),
        y=b"",
    )
    assert other_template != ak_template()
    with tpm.op("test"), tpm.primary("endorsement", other_template) as other:
        other_public = other.public
    with pytest.raises(TpmError, match="does not verify"):
        verify_certify(attest, signature, other_public, key_name, CSR_DIGEST)


def test_verify_certify_checks_the_attestation_structure() -> None:
    """Attestations signed by an AK-shaped software key: each structural check."""
    key = ec.generate_private_key(ec.SECP256R1())
    ak = _software_ak(key)
    name = b"\x00\x0b" + b"n" * 32
    good = _attest(CSR_DIGEST, name)
    verify_certify(good, _sign_attest(key, good), ak, name, CSR_DIGEST)
    cases = [
        (_attest(CSR_DIGEST, name, magic=0x12345678), "magic"),
        (good[:4] + b"\x80\x18" + good[6:], "not a TPM2_Certify"),
        (good + b"\0", "trailing"),
        (good[:-3], "truncated"),
        (_attest(CSR_DIGEST[:31], name), "other qualifying data"),
        (_attest(CSR_DIGEST, name[:-1] + b"x"), "another key"),
    ]
    for attest, message in cases:
        with pytest.raises(TpmError, match=message):
            verify_certify(attest, _sign_attest(key, attest), ak, name, CSR_DIGEST)
    for bad_name in (b"", b"\x00\x0b" + b"n" * 31, b"\x00\x99" + b"n" * 32):
        with pytest.raises(TpmError, match="expected key name"):
            verify_certify(good, _sign_attest(key, good), ak, bad_name, CSR_DIGEST)


# --- credential activation ---------------------------------------------------------


@pytest.mark.parametrize("kind", [None, "EK-HIGH-ECC384"])
def test_make_and_activate_credential(tpm: Tpm, kind: str | None) -> None:
    ek = ek_public(tpm, kind)
    _, ak_name = ak_public(tpm)
    secret = hashlib.sha256(b"the challenge").digest()
    blob, encrypted = make_credential(ek, ak_name, secret)
    assert activate_credential(tpm, blob, encrypted, kind) == secret
    # a credential made for another name does not activate with this AK
    blob2, encrypted2 = make_credential(ek, b"\x00\x0b" + bytes(32), secret)
    with pytest.raises(TpmError, match="the TPM refused activating the credential"):
        activate_credential(tpm, blob2, encrypted2, kind)
    tampered = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(TpmError, match="refused"):
        activate_credential(tpm, tampered, encrypted, kind)


def test_activate_credential_rejects_malformed_input(tpm: Tpm) -> None:
    with pytest.raises(TpmError, match="credential blob"):
        activate_credential(tpm, b"", b"x")
    with pytest.raises(TpmError, match="credential blob"):
        activate_credential(tpm, b"x" * 133, b"x")
    with pytest.raises(TpmError, match="encrypted secret"):
        activate_credential(tpm, b"x", b"x" * 513)
    with pytest.raises(TpmError, match="refused"):
        activate_credential(tpm, b"x" * 10, b"y" * 10)


def test_make_credential_rejects(tpm: Tpm) -> None:
    ek = ek_public(tpm)
    _, ak_name = ak_public(tpm)
    with pytest.raises(TpmError, match="1 to 32 bytes"):
        make_credential(ek, ak_name, b"x" * 33)
    with pytest.raises(TpmError, match="1 to 32 bytes"):
        make_credential(ek, ak_name, b"")
    with pytest.raises(TpmError, match="AK name"):
        make_credential(ek, ak_name[:-1], b"x")
    node = public_key_of(tpm, create_node_key_record()).public_area
    with pytest.raises(TpmError, match="EK attributes"):
        make_credential(node, ak_name, b"x")
    ecc_ek = ek_public(tpm, "EK-HIGH-ECC384")
    assert check_ek_public(ecc_ek).name_alg == 0x000C
    make_credential(ecc_ek, ak_name, b"x" * 48)


# --- pure parsers: arbitrary input raises only TpmError ------------------------------

VALID_AK = _software_ak(ec.generate_private_key(ec.SECP256R1()))


def test_parse_public_reads_a_software_ak() -> None:
    info = parse_public(VALID_AK)
    assert info.attributes == AK_ATTRIBUTES
    assert info.scheme == (ALG_ECDSA, ALG_SHA256)
    assert info.name == name_of(VALID_AK)
    # tpm2-pytss reads the same structure
    public, used = TPMT_PUBLIC.unmarshal(VALID_AK)
    assert used == len(VALID_AK)
    assert int(public.objectAttributes) == AK_ATTRIBUTES


def test_parse_public_rejects() -> None:
    cases = [
        (b"", "truncated"),
        (VALID_AK + b"\0", "trailing"),
        (b"\x00\x08" + VALID_AK[2:], "object type"),
        (VALID_AK[:2] + b"\x00\x99" + VALID_AK[4:], "hash algorithm"),
        (VALID_AK[:-1] + bytes([VALID_AK[-1] ^ 1]), "public key is invalid"),
        (b"x" * 2000, "not a TPMT_PUBLIC"),
    ]
    for data, message in cases:
        with pytest.raises(TpmError, match=message):
            parse_public(data)


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=400),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda p: valid[: p[0]] + bytes([p[1]]) + valid[p[0] + 1 :]
        ),
    )


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(VALID_AK))
def test_parse_public_raises_only_tpm_error(data: bytes) -> None:
    try:
        info = parse_public(data)
    except TpmError:
        return
    assert info.name == name_of(data)


@given(st.binary(max_size=200))
def test_name_parsers_raise_only_tpm_error(data: bytes) -> None:
    for parse in (name_of, parse_name):
        with contextlib.suppress(TpmError):
            parse(data)


GOOD_ATTEST = _attest(CSR_DIGEST, b"\x00\x0b" + b"n" * 32)


@given(_mutations(GOOD_ATTEST))
def test_parse_attest_raises_only_tpm_error(data: bytes) -> None:
    with contextlib.suppress(TpmError):
        parse_certify_attest(data)


@given(
    _mutations(GOOD_ATTEST),
    st.binary(max_size=70),
    _mutations(VALID_AK),
    st.binary(max_size=40),
    st.binary(max_size=40),
)
def test_verify_certify_raises_only_tpm_error(
    attest: bytes, signature: bytes, ak: bytes, name: bytes, qualifying: bytes
) -> None:
    with pytest.raises(TpmError):
        verify_certify(attest, signature, ak, name, qualifying)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=50)
@given(_mutations(VALID_AK), st.binary(max_size=40), st.binary(max_size=40))
def test_make_credential_raises_only_tpm_error(ek: bytes, name: bytes, secret: bytes) -> None:
    with pytest.raises(TpmError):  # an AK-shaped key is never an EK
        make_credential(ek, name, secret)
