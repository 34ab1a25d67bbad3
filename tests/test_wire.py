"""bcd.wire and the parsers of bcd.pki: properties over arbitrary input, round trips.

Every parser takes outside bytes or JSON values and either returns a value or raises
its one documented error type (WireError, PkiError), never anything else, so the
control plane can turn any failure into one uniform refusal.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import string
import time
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcd import pki, wire
from bcd.wire import Claims, JoinRequest, JoinToken, WireError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ENC_KEY = pki.generate_key()
ENC_PIN = pki.spki_pin(ENC_KEY.public_key())
SIGN_KEY = pki.generate_key()
SIGN_PIN = pki.spki_pin(SIGN_KEY.public_key())
CSR_KEY = pki.generate_key()
CSR_DER = pki.make_csr(CSR_KEY)
TOKEN = JoinToken("jt_01k5w3z8q9m4n7p2r6t8v0x1y3", "A" * 21 + "b-_" + "z" * 19)
B64URL = string.ascii_letters + string.digits + "-_"

# --- strategies -------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=16), json_values, max_size=8)

REQUEST_KEYS = (
    "protocol",
    "role",
    "attestor",
    "sealed_token",
    "csr",
    "claims",
    "evidence",
    "node_id",
    "daemon_version",
    "round",
    "answer",
)
claim_value = {
    k: (
        st.lists(st.text(max_size=300), max_size=70)
        if k in ("macs", "gpu_uuids")
        else st.text(max_size=300)
    )
    | json_values
    for k in wire.CLAIM_KEYS
}
# objects shaped like a JoinRequest: every known key may hold a plausible or odd value
plausible = {
    "protocol": st.sampled_from([1, 1.0, True, 2, "1", None]) | json_values,
    "role": st.sampled_from(["node", "site", "ramdisk", "admin", ""]) | json_values,
    "attestor": st.text(max_size=70) | json_values,
    "sealed_token": st.text(max_size=20) | json_values,
    "csr": st.sampled_from([base64.b64encode(CSR_DER).decode(), "", "!!", "QQ=", "é"])
    | st.text(max_size=30)
    | json_values,
    "claims": st.fixed_dictionaries({}, optional=claim_value) | json_values,
    "evidence": json_values,
    "node_id": st.text(max_size=70) | json_values,
    "daemon_version": st.text(max_size=70) | json_values,
    "round": st.integers(min_value=-2, max_value=5) | json_values,
    "answer": json_values,
}
VALID_REQUEST = JoinRequest(
    role="node",
    attestor="",
    sealed_token=None,
    csr_der=CSR_DER,
    claims=Claims(product_uuid="4c4c4544-0042-3510-8052-b7c04f4d4433", macs=("00:1b:21:0a:0b:0c",)),
    evidence={},
    node_id=None,
    daemon_version="0.1.0",
).to_json()
# a valid request with a few members replaced by plausible or odd values, or dropped
request_like = st.builds(
    lambda changes, dropped: {
        k: v for k, v in {**VALID_REQUEST, **changes}.items() if k not in dropped
    },
    st.dictionaries(st.sampled_from(REQUEST_KEYS), st.none(), max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({k: plausible[k] for k in keys})
    ),
    st.sets(st.sampled_from(REQUEST_KEYS), max_size=2),
)
claims_like = st.fixed_dictionaries({}, optional={**claim_value, "unknown": json_values})
b64url_text = st.text(alphabet=B64URL, max_size=80)
five_parts = st.lists(b64url_text, min_size=5, max_size=5).map(".".join)
three_parts = st.lists(b64url_text, min_size=3, max_size=3).map(".".join)


def b64json(obj: object) -> str:
    return pki.b64url(json.dumps(obj).encode("utf-8"))


def _header(**overrides: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        "alg": "ECDH-ES+A256KW",
        "enc": "A256GCM",
        "typ": wire.SEAL_TYP,
        "kid": ENC_PIN,
    }
    header.update(overrides)
    return header


# seals whose header passes the typ/alg/enc/kid checks, with odd rest
seal_like = st.builds(
    lambda extra, parts: ".".join([b64json({**extra, **_header()}), *parts]),
    st.dictionaries(
        st.sampled_from(["epk", "iat", "csr", "zip", "apu", "apv", "crit", "x"]),
        json_values,
        max_size=4,
    ),
    st.lists(b64url_text, min_size=4, max_size=4),
)
# responses whose header names ES256 and the pinned key, with odd rest
response_like = st.builds(
    lambda extra, body, sig: ".".join(
        [
            b64json({**extra, "alg": "ES256", "jwk": wire.public_jwk_of(SIGN_KEY.public_key())}),
            body,
            sig,
        ]
    ),
    st.dictionaries(st.sampled_from(["kid", "typ", "crit", "x"]), json_values, max_size=3),
    b64url_text | json_values.map(b64json),
    b64url_text | st.binary(min_size=64, max_size=64).map(pki.b64url),
)


# --- parsers raise only their documented error type ---------------------------------


@SETTINGS
@given(st.text(max_size=120) | st.from_regex(wire.TOKEN_RE) | json_values)
def test_parse_token_raises_only_wire_error(text: Any) -> None:
    try:
        token = wire.parse_token(text)
    except WireError:
        return
    assert token.bearer == text.strip()
    assert wire.parse_token(token.bearer) == token


@SETTINGS
@given(json_objects | request_like)
def test_parse_join_request_raises_only_wire_error(obj: dict[str, Any]) -> None:
    try:
        request = wire.parse_join_request(obj)
    except WireError:
        return
    assert request.role in ("node", "site", "ramdisk")
    assert wire.parse_join_request(request.to_json()) == request


@SETTINGS
@given(st.binary(max_size=300) | json_values.map(wire.dumps) | request_like.map(wire.dumps))
def test_loads_object_then_parse_raises_only_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        wire.parse_join_request(wire.loads_object(data))


@SETTINGS
@given(json_values | claims_like)
def test_claims_from_json_raises_only_wire_error(obj: Any) -> None:
    try:
        claims = Claims.from_json(obj)
    except WireError:
        return
    assert Claims.from_json(claims.to_json()) == claims


@SETTINGS
@given(st.text(max_size=200) | five_parts | seal_like | json_values)
def test_open_seal_raises_only_wire_error(sealed: Any) -> None:
    with pytest.raises(WireError):
        wire.open_seal(sealed, ENC_KEY, ENC_PIN)


@SETTINGS
@given(st.text(max_size=200) | three_parts | response_like | json_values)
def test_verify_response_raises_only_wire_error(jws: Any) -> None:
    with pytest.raises(WireError):
        wire.verify_response(jws, SIGN_PIN)


@SETTINGS
@given(
    st.binary(max_size=400)
    | st.integers(min_value=0, max_value=len(CSR_DER) - 1).map(lambda n: CSR_DER[:n])
    | st.binary(max_size=40).map(lambda tail: CSR_DER + tail)
)
def test_parse_csr_raises_only_pki_error(der: bytes) -> None:
    try:
        csr = pki.parse_csr(der)
    except pki.PkiError:
        return
    assert pki.same_public_key(pki.csr_public_key(csr), CSR_KEY.public_key())


@SETTINGS
@given(
    st.text(max_size=60)
    | st.text(max_size=60).map(lambda t: "sha256/" + t)
    | st.binary(min_size=32, max_size=32).map(lambda b: base64.b64encode(b).decode())
    | json_values
    | st.binary(max_size=40)
)
def test_parse_pin_raises_only_pki_error(text: Any) -> None:
    try:
        assert pki.parse_pin(text) == text
    except pki.PkiError:
        return
    assert len(base64.b64decode(text[len("sha256/") :], validate=True)) == 32


@SETTINGS
@given(st.binary(min_size=32, max_size=32))
def test_every_well_formed_pin_parses(digest: bytes) -> None:
    pin = "sha256/" + base64.b64encode(digest).decode("ascii")
    assert pki.parse_pin(pin) == pin


# --- round trips --------------------------------------------------------------------


@SLOW
@given(
    secret=st.text(alphabet=B64URL, min_size=43, max_size=43),
    iat=st.integers(min_value=0, max_value=2**40),
    csr=st.binary(min_size=1, max_size=600),
)
def test_seal_then_open_round_trips(secret: str, iat: int, csr: bytes) -> None:
    token = JoinToken("jt_" + "0123456789abcdefghjkmnpqrs", secret)
    sealed = wire.seal_token(token, ENC_KEY.public_key(), csr, iat)
    assert sealed.count(".") == 4
    assert secret not in sealed
    opened = wire.open_seal(sealed, ENC_KEY, ENC_PIN)
    assert opened == wire.OpenedSeal(token=token, iat=iat, csr_sha256=pki.sha256_hex(csr))
    header = json.loads(pki.b64url_decode(sealed.split(".")[0]))
    assert header == {
        "alg": "ECDH-ES+A256KW",
        "enc": "A256GCM",
        "typ": "bcjt+jwe",
        "kid": ENC_PIN,
        "iat": iat,
        "csr": hashlib.sha256(csr).hexdigest(),
        "epk": header["epk"],
    }


@SETTINGS
@given(
    kind=st.sampled_from(["joined", "challenge", "pending"]),
    extra=st.dictionaries(
        st.text(max_size=12).filter(lambda k: k != "kind"), json_values, max_size=6
    ),
)
def test_sign_then_verify_round_trips(kind: str, extra: dict[str, Any]) -> None:
    body = {**extra, "kind": kind}
    jws = wire.sign_response(body, SIGN_KEY)
    assert wire.verify_response(jws, SIGN_PIN) == json.loads(wire.dumps(body))


@SETTINGS
@given(
    role=st.sampled_from(["node", "site", "ramdisk"]),
    attestor=st.text(max_size=64),
    sealed=st.none() | st.text(max_size=200),
    csr=st.binary(max_size=300),
    claims=st.builds(
        Claims,
        product_uuid=st.text(max_size=256),
        product_serial=st.text(max_size=256),
        board_serial=st.text(max_size=256),
        chassis_serial=st.text(max_size=256),
        macs=st.lists(st.text(max_size=256), max_size=64).map(tuple),
        gpu_uuids=st.lists(st.text(max_size=256), max_size=8).map(tuple),
        hostname=st.text(max_size=256),
        boot_id=st.text(max_size=256),
    ),
    evidence=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    node_id=st.none() | st.text(max_size=64),
    daemon_version=st.text(max_size=64),
    rnd=st.integers(min_value=0, max_value=3),
    answer=st.none() | st.dictionaries(st.text(max_size=10), json_values, max_size=3),
)
def test_join_request_to_json_then_parse_round_trips(
    role: str,
    attestor: str,
    sealed: str | None,
    csr: bytes,
    claims: Claims,
    evidence: dict[str, Any],
    node_id: str | None,
    daemon_version: str,
    rnd: int,
    answer: dict[str, Any] | None,
) -> None:
    request = JoinRequest(
        role=role,
        attestor=attestor,
        sealed_token=sealed,
        csr_der=csr,
        claims=claims,
        evidence=evidence,
        node_id=node_id,
        daemon_version=daemon_version,
        round=rnd,
        answer=answer,
    )
    parsed = wire.parse_join_request(wire.loads_object(wire.dumps(request.to_json())))
    assert parsed == JoinRequest(
        **{
            **{f: getattr(request, f) for f in JoinRequest.__slots__},
            "evidence": json.loads(wire.dumps(evidence)),
            "answer": None if answer is None else json.loads(wire.dumps(answer)),
        }
    )


def test_join_request_the_node_builds_parses_back() -> None:
    sealed = wire.seal_token(TOKEN, ENC_KEY.public_key(), CSR_DER, int(time.time()))
    request = JoinRequest(
        role="node",
        attestor="",
        sealed_token=sealed,
        csr_der=CSR_DER,
        claims=Claims(
            product_uuid="4c4c4544-0042-3510-8052-b7c04f4d4433",
            product_serial="SN-7701",
            macs=("00:1b:21:0a:0b:0c",),
            hostname="n1",
        ),
        evidence={},
        node_id=None,
        daemon_version="0.1.0",
    )
    assert wire.parse_join_request(wire.loads_object(wire.dumps(request.to_json()))) == request
    assert "secret" not in repr(request)
    assert sealed not in repr(request)


# --- seals ------------------------------------------------------------------------


def _seal(iat: int | None = None) -> str:
    return wire.seal_token(
        TOKEN, ENC_KEY.public_key(), CSR_DER, int(time.time()) if iat is None else iat
    )


@pytest.mark.parametrize(
    "change",
    [
        {"iat": 12345},
        {"csr": "0" * 64},
        {"kid": ENC_PIN, "x": 1},
        {"apu": "QQ"},
    ],
    ids=["iat", "csr", "extra-member", "apu"],
)
def test_a_tampered_protected_header_fails_to_open(change: dict[str, Any]) -> None:
    sealed = _seal()
    parts = sealed.split(".")
    header = json.loads(pki.b64url_decode(parts[0]))
    header.update(change)
    tampered = ".".join([b64json(header), *parts[1:]])
    with pytest.raises(WireError):
        wire.open_seal(tampered, ENC_KEY, ENC_PIN)


@pytest.mark.parametrize("index", [1, 2, 3, 4], ids=["key", "iv", "ciphertext", "tag"])
def test_a_tampered_seal_part_fails_to_open(index: int) -> None:
    parts = _seal().split(".")
    raw = bytearray(pki.b64url_decode(parts[index]))
    raw[0] ^= 0x01
    parts[index] = pki.b64url(bytes(raw))
    with pytest.raises(WireError):
        wire.open_seal(".".join(parts), ENC_KEY, ENC_PIN)


@pytest.mark.parametrize(
    "change",
    [
        {"typ": "JWT"},
        {"alg": "ECDH-ES"},
        {"enc": "A128GCM"},
        {"kid": pki.spki_pin(pki.generate_key().public_key())},
    ],
    ids=["typ", "alg", "enc", "kid"],
)
def test_a_seal_with_the_wrong_header_is_refused_before_decrypting(change: dict[str, Any]) -> None:
    parts = _seal().split(".")
    header = {**json.loads(pki.b64url_decode(parts[0])), **change}
    with pytest.raises(WireError):
        wire.open_seal(".".join([b64json(header), *parts[1:]]), ENC_KEY, ENC_PIN)


def test_a_seal_for_another_key_does_not_open() -> None:
    other = pki.generate_key()
    sealed = wire.seal_token(TOKEN, other.public_key(), CSR_DER, 1)
    with pytest.raises(WireError):
        wire.open_seal(sealed, ENC_KEY, ENC_PIN)
    # even under the right kid, the wrong key cannot decrypt it
    with pytest.raises(WireError):
        wire.open_seal(sealed, ENC_KEY, pki.spki_pin(other.public_key()))


def test_a_seal_holding_something_else_than_a_token_does_not_open() -> None:
    sealed = wire.seal_token(JoinToken("jt_short", "x"), ENC_KEY.public_key(), CSR_DER, 1)
    with pytest.raises(WireError):
        wire.open_seal(sealed, ENC_KEY, ENC_PIN)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b64json(_header(kid="\ud800")), id="kid-lone-surrogate"),
        pytest.param(b64json(_header(kid=7)), id="kid-number"),
        pytest.param(pki.b64url(b"[" * 6000), id="deeply-nested"),
        pytest.param(
            pki.b64url(
                json.dumps(_header())[:-1].encode() + b',"x":' + b"[" * 2000 + b"]" * 2000 + b"}"
            ),
            id="nested-member",
        ),
    ],
)
def test_open_seal_odd_header_raises_wire_error(header: str) -> None:
    with pytest.raises(WireError):
        wire.open_seal(header + ".a.b.c.d", ENC_KEY, ENC_PIN)


# --- signed responses ---------------------------------------------------------------


def test_verify_response_refuses_a_response_signed_by_another_key() -> None:
    other = pki.generate_key()
    jws = wire.sign_response({"kind": "joined", "node_id": "n"}, other)
    with pytest.raises(WireError):
        wire.verify_response(jws, SIGN_PIN)
    assert wire.verify_response(jws, pki.spki_pin(other.public_key()))["node_id"] == "n"


def test_verify_response_refuses_another_key_claiming_the_pinned_jwk() -> None:
    other = pki.generate_key()
    header = {"alg": "ES256", "kid": SIGN_PIN, "jwk": wire.public_jwk_of(SIGN_KEY.public_key())}
    signing_input = b64json(header) + "." + b64json({"kind": "joined"})
    sig = pki.b64url(pki.sign_p1363(other, signing_input.encode("ascii")))
    with pytest.raises(WireError):
        wire.verify_response(signing_input + "." + sig, SIGN_PIN)


def test_verify_response_refuses_a_tampered_body_or_header() -> None:
    h, b, s = wire.sign_response({"kind": "joined", "node_id": "n"}, SIGN_KEY).split(".")
    forged_body = b64json({"kind": "joined", "node_id": "m"})
    forged_header = b64json({**json.loads(pki.b64url_decode(h)), "x": 1})
    for jws in (f"{h}.{forged_body}.{s}", f"{forged_header}.{b}.{s}", f"{h}.{b}.{s[:-2]}"):
        with pytest.raises(WireError):
            wire.verify_response(jws, SIGN_PIN)


@pytest.mark.parametrize("alg", ["none", "HS256", "ES384", None])
def test_verify_response_refuses_another_algorithm(alg: str | None) -> None:
    h, b, s = wire.sign_response({"kind": "joined"}, SIGN_KEY).split(".")
    header = {**json.loads(pki.b64url_decode(h)), "alg": alg}
    with pytest.raises(WireError):
        wire.verify_response(f"{b64json(header)}.{b}.{s}", SIGN_PIN)


def test_verify_response_refuses_an_unknown_kind() -> None:
    for body in ({"kind": "other"}, {"node_id": "n"}):
        with pytest.raises(WireError):
            wire.verify_response(wire.sign_response(body, SIGN_KEY), SIGN_PIN)


def test_verify_response_deeply_nested_header_raises_wire_error() -> None:
    with pytest.raises(WireError):
        wire.verify_response(pki.b64url(b"[" * 6000) + ".e30.AA", SIGN_PIN)


# --- CSRs ---------------------------------------------------------------------------


def test_parse_csr_accepts_the_nodes_csr() -> None:
    csr = pki.parse_csr(CSR_DER)
    assert pki.same_public_key(pki.csr_public_key(csr), CSR_KEY.public_key())


def test_parse_csr_refuses_a_p384_csr() -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA384())
    )
    with pytest.raises(pki.PkiError, match="P-256"):
        pki.parse_csr(csr.public_bytes(serialization.Encoding.DER))


def test_parse_csr_refuses_a_csr_with_a_broken_signature() -> None:
    der = bytearray(CSR_DER)
    der[-1] ^= 0x01
    with pytest.raises(pki.PkiError, match="signature"):
        pki.parse_csr(bytes(der))


def test_parse_csr_refuses_a_csr_whose_key_was_swapped() -> None:
    other = pki.spki_der(pki.generate_key().public_key())
    mine = pki.spki_der(CSR_KEY.public_key())
    assert CSR_DER.count(mine) == 1
    with pytest.raises(pki.PkiError, match="signature"):
        pki.parse_csr(CSR_DER.replace(mine, other))


def test_parse_csr_refuses_an_unknown_key_algorithm() -> None:
    ec_public_key_oid = bytes.fromhex("06072a8648ce3d0201")
    der = CSR_DER.replace(ec_public_key_oid, bytes.fromhex("06072a8648ce3d0209"))
    with pytest.raises(pki.PkiError):
        pki.parse_csr(der)


def test_parse_csr_refuses_a_csr_of_an_unknown_version() -> None:
    assert CSR_DER.index(b"\x02\x01\x00") == 5  # SEQUENCE { SEQUENCE { INTEGER 0 (version)
    with pytest.raises(pki.PkiError):
        pki.parse_csr(CSR_DER.replace(b"\x02\x01\x00", b"\x02\x01\x01", 1))


def test_parse_csr_every_single_byte_flip_raises_pki_error_or_parses() -> None:
    for i in range(len(CSR_DER)):
        for bit in (0x01, 0x02, 0x80, 0xFF):
            mutated = CSR_DER[:i] + bytes([CSR_DER[i] ^ bit]) + CSR_DER[i + 1 :]
            with contextlib.suppress(pki.PkiError):
                pki.parse_csr(mutated)


# --- small pieces ---------------------------------------------------------------------


def test_loads_object_limits_the_size() -> None:
    body = wire.dumps({"x": "a" * (wire.MAX_BODY - 8)})
    assert len(body) == wire.MAX_BODY
    assert wire.loads_object(body)["x"]
    with pytest.raises(WireError):
        wire.loads_object(body + b" ")


def test_loads_object_refuses_deep_nesting() -> None:
    with pytest.raises(WireError):
        wire.loads_object(b"[" * 10_000 + b"]" * 10_000)


def test_secret_matches_only_its_own_hash() -> None:
    stored = wire.secret_hash(TOKEN.secret)
    assert stored == hashlib.sha256(TOKEN.secret.encode()).hexdigest()
    assert wire.secret_matches(TOKEN.secret, stored)
    assert not wire.secret_matches(TOKEN.secret[:-1] + "x", stored)


def test_token_repr_hides_the_secret() -> None:
    assert TOKEN.secret not in repr(TOKEN)
    assert wire.parse_token(f"  {TOKEN.bearer}\n") == TOKEN


def test_public_jwk_round_trips() -> None:
    key = pki.generate_key().public_key()
    jwk = wire.public_jwk_of(key)
    assert pki.same_public_key(wire.public_key_of_jwk(jwk), key)
    assert pki.same_public_key(wire.public_key_of_jwk({**jwk, "kid": "k", "use": "enc"}), key)
    for bad in (
        {**jwk, "d": "AA"},
        {**jwk, "crv": "P-384"},
        {**jwk, "x": 5},
        {**jwk, "y": "AA"},
        [],
    ):
        with pytest.raises(WireError):
            wire.public_key_of_jwk(bad)
