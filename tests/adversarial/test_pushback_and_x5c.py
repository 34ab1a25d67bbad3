"""What bcd believes of a gateway's values: ``retry-pushback-ms`` and a SignedResponse's key.

``retry-pushback-ms`` is 1 to 9 ASCII digits, capped at 5 minutes, or absent;
nothing a gateway puts there raises anything but the error it answered. A
SignedResponse names its key as ``jwk``, ``x5c`` (base64 DER, leaf first, at most 4
certificates of at most 8 KiB), or both when they are the same key; the key counts
only when it matches ``join_signing_key_pin``.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from bcd import pki, wire
from bcd.errors import RetryableError
from bcd.gatewayanswer import Response
from bcd.renew import renew_answer
from bcd.vouch import vouch_answer
from control.pki import Pki

BODY = {"kind": "pending", "request_id": "jreq_x", "retry_after_s": 5}
DER = serialization.Encoding.DER


# --- retry-pushback-ms -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("2500", 2.5),
        ("0", 0.0),
        (" 750\t", 0.75),
        ("000001000", 1.0),
        ("300000", 300.0),
        ("300001", 300.0),
        ("999999999", 300.0),  # 9 digits: believed, and capped
        ("1000000000", None),  # 10 digits: not a value
        ("100000000000000", None),
        ("1" * 4000, None),
        ("1" * 5000, None),  # past int()'s digit limit
        ("\xb2", None),  # SUPERSCRIPT TWO: isdigit() is true, int() refuses it
        ("1\xb9", None),
        ("٣", None),  # ARABIC-INDIC DIGIT THREE: int() would take it
        ("１２", None),  # FULLWIDTH digits
        ("-5", None),
        ("+5", None),
        ("1.5", None),
        ("1e3", None),
        ("0x10", None),
        ("1, 2", None),
        ("5\n", None),
        ("", None),
        (None, None),
    ],
)
def test_a_pushback_is_plain_ascii_digits_capped_at_five_minutes(
    value: str | None, seconds: float | None
) -> None:
    assert wire.parse_pushback(value) == seconds


def _busy(value: str) -> Response:
    body = wire.dumps({"code": "UNAVAILABLE", "message": "later"})
    return Response(503, {"retry-pushback-ms": value}, body)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("\xb2", None), ("1" * 4000, None), ("999999999", 300.0), ("-1", None), ("1500", 1.5)],
)
def test_a_renewal_answers_pushback_never_raises_past_the_retryable_error(
    value: str, seconds: float | None
) -> None:
    with pytest.raises(RetryableError) as info:
        renew_answer(_busy(value))
    assert str(info.value) == "UNAVAILABLE: later"
    assert info.value.pushback_s == seconds


def test_a_vouch_answers_pushback_is_believed_only_when_plain() -> None:
    body = wire.dumps({"code": "RESOURCE_EXHAUSTED", "message": "slow down"})
    with pytest.raises(RetryableError) as info:
        vouch_answer(429, body, "\xb2")
    assert str(info.value) == "RESOURCE_EXHAUSTED: slow down; ask again later"
    assert info.value.pushback_s is None
    with pytest.raises(RetryableError) as info:
        vouch_answer(429, body, "999999999")
    assert str(info.value) == "RESOURCE_EXHAUSTED: slow down; ask again in 300 s"


# --- SignedResponse: jwk, x5c or both ----------------------------------------------


def _jws(header: dict[str, Any], body: dict[str, Any], key: ec.EllipticCurvePrivateKey) -> str:
    signing_input = pki.b64url(wire.dumps(header)) + "." + pki.b64url(wire.dumps(body))
    return signing_input + "." + pki.b64url(pki.sign_p1363(key, signing_input.encode("ascii")))


def _b64(cert: x509.Certificate) -> str:
    return base64.b64encode(cert.public_bytes(DER)).decode("ascii")


def _self_signed(key: Any, *, extra: int = 0) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "other")])
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
    )
    if extra:
        names = [x509.DNSName(f"n{i}.example") for i in range(extra)]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256())


def _header(memory_pki: Pki, **fields: Any) -> dict[str, Any]:
    public = memory_pki.join_signing_key.public_key()
    return {"alg": "ES256", "kid": pki.spki_pin(public), **fields}


def _pin(memory_pki: Pki) -> str:
    return memory_pki.pins()["join_signing_key_pin"]


def test_an_x5c_header_with_the_pinned_certificate_verifies(memory_pki: Pki) -> None:
    chain = [_b64(memory_pki.join_signing_cert), _b64(memory_pki.serving_ca)]
    signed = _jws(_header(memory_pki, x5c=chain), BODY, memory_pki.join_signing_key)
    assert wire.verify_response(signed, _pin(memory_pki)) == BODY


def test_sign_response_can_send_x5c_alone_or_beside_jwk(memory_pki: Pki) -> None:
    key, cert = memory_pki.join_signing_key, memory_pki.join_signing_cert
    alone = wire.sign_response(BODY, key, x5c=[cert], include_jwk=False)
    both = wire.sign_response(BODY, key, x5c=[cert])
    assert wire.verify_response(alone, _pin(memory_pki)) == BODY
    assert wire.verify_response(both, _pin(memory_pki)) == BODY


def test_jwk_and_x5c_must_name_the_same_key(memory_pki: Pki) -> None:
    public = memory_pki.join_signing_key.public_key()
    header = _header(memory_pki, jwk=wire.public_jwk_of(public), x5c=[_b64(memory_pki.serving_ca)])
    signed = _jws(header, BODY, memory_pki.join_signing_key)
    with pytest.raises(wire.WireError, match="jwk and x5c name different keys"):
        wire.verify_response(signed, _pin(memory_pki))


def test_an_x5c_of_another_key_fails_the_pin(memory_pki: Pki) -> None:
    other = pki.generate_key()
    signed = _jws(_header(memory_pki, x5c=[_b64(_self_signed(other))]), BODY, other)
    with pytest.raises(wire.WireError, match="not signed by the pinned join-signing key"):
        wire.verify_response(signed, _pin(memory_pki))


def test_a_header_without_a_key_is_refused(memory_pki: Pki) -> None:
    signed = _jws(_header(memory_pki), BODY, memory_pki.join_signing_key)
    with pytest.raises(wire.WireError, match="carries no signing key"):
        wire.verify_response(signed, _pin(memory_pki))


def _x5c_refusal(memory_pki: Pki, x5c: object) -> str:
    signed = _jws(_header(memory_pki, x5c=x5c), BODY, memory_pki.join_signing_key)
    with pytest.raises(wire.WireError) as info:
        wire.verify_response(signed, _pin(memory_pki))
    return str(info.value)


def test_x5c_is_bounded_and_must_parse(memory_pki: Pki) -> None:
    leaf = _b64(memory_pki.join_signing_cert)
    assert _x5c_refusal(memory_pki, [leaf] * 5) == "x5c must be a list of 1 to 4 certificates"
    assert _x5c_refusal(memory_pki, []) == "x5c must be a list of 1 to 4 certificates"
    assert _x5c_refusal(memory_pki, leaf) == "x5c must be a list of 1 to 4 certificates"
    too_long = base64.b64encode(b"\x30" * 9000).decode()
    assert "over 8192 bytes" in _x5c_refusal(memory_pki, [leaf, too_long])
    just_over = base64.b64encode(b"\x30" * 8193).decode()  # fits the text bound, not the DER one
    assert "over 8192 bytes" in _x5c_refusal(memory_pki, [leaf, just_over])
    big = _self_signed(pki.generate_key(), extra=600)
    assert len(big.public_bytes(DER)) > 8192
    assert "over 8192 bytes" in _x5c_refusal(memory_pki, [_b64(big)])
    assert "not a DER certificate" in _x5c_refusal(memory_pki, [leaf, "AAAA"])
    assert "not base64" in _x5c_refusal(memory_pki, [leaf, "not base64!"])
    assert "not base64" in _x5c_refusal(memory_pki, [leaf, 12])


@pytest.mark.parametrize(
    "key",
    [
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec.generate_private_key(ec.SECP384R1()),
    ],
    ids=["rsa", "p384"],
)
def test_an_x5c_leaf_without_a_p256_key_is_refused(memory_pki: Pki, key: Any) -> None:
    assert _x5c_refusal(memory_pki, [_b64(_self_signed(key))]) == (
        "the x5c certificate's key is not a P-256 key"
    )
