"""The typed bodies the node reads (bcd.signed, bcd.wire): parsed once, hostile input refused.

A SignedResponse body becomes an Issued, a Challenge or a Pending; a session line a
Welcome, a Ping, a RevocationLine or an OtherLine. Every parser either returns its
frozen value or raises WireError (never anything else), whatever it is fed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcd import pki, signed, wire
from bcd.wire import Challenge, Issued, Pending, WireError

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIGN_KEY = pki.generate_key()
SIGN_PIN = pki.spki_pin(SIGN_KEY.public_key())

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
BODY_KEYS = (
    "kind",
    "csr_sha256",
    "chain",
    "node_id",
    "site_id",
    "trust_domain",
    "role",
    "bundle",
    "trust_version",
    "identity_generation",
    "server_time",
    "attestor",
    "round",
    "not_after",
    "challenge",
    "request_id",
    "retry_after_s",
)
kinds = st.sampled_from([*wire.RESPONSE_KINDS, "revocation", ""]) | json_values
# bodies shaped like the four kinds: every known field may hold a plausible or odd value
body_like = st.fixed_dictionaries(
    {"kind": kinds},
    optional={k: json_values for k in BODY_KEYS if k != "kind"} | {"x": json_values},
)


@SETTINGS
@given(body_like)
def test_parse_signed_body_raises_only_wire_error(body: dict[str, Any]) -> None:
    try:
        value = wire.parse_signed_body(body)
    except WireError:
        return
    assert isinstance(value, Issued | Challenge | Pending)
    assert dataclasses.is_dataclass(value)


@SETTINGS
@given(body_like)
def test_every_typed_field_has_its_type_or_is_none(body: dict[str, Any]) -> None:
    body["kind"] = "renewed"
    issued = wire.parse_issued(body)
    for name in ("csr_sha256", "chain", "node_id", "site_id", "trust_domain", "role", "bundle"):
        assert getattr(issued, name) is None or isinstance(getattr(issued, name), str)
    for name in ("trust_version", "identity_generation", "server_time_ms"):
        value = getattr(issued, name)
        assert value is None or (type(value) is int)
    assert issued.server_time_ms is None or 0 <= issued.server_time_ms <= signed.MAX_TIME_MS


@SETTINGS
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_parse_session_line_raises_only_wire_error(line: bytes) -> None:
    try:
        msg = wire.parse_session_line(line)
    except WireError:
        return
    assert isinstance(msg, wire.Welcome | wire.Ping | wire.RevocationLine | wire.OtherLine)
    if isinstance(msg, wire.Welcome):
        assert msg.session_id.isascii()
        assert msg.session_id.isprintable()


def test_a_signed_joined_answer_parses_to_its_fields() -> None:
    body = {
        "kind": "joined",
        "node_id": "node_x",
        "site_id": "site_y",
        "role": "node",
        "trust_domain": "td.example",
        "chain": "PEM",
        "bundle": "ROOTS",
        "trust_version": 3,
        "csr_sha256": "ab" * 32,
        "server_time": 1_700_000_000_000,
        "identity_generation": 2,
    }
    verified = wire.verify_response(wire.sign_response(body, SIGN_KEY), SIGN_PIN)
    assert wire.parse_signed_body(verified) == Issued(
        kind="joined",
        csr_sha256="ab" * 32,
        chain="PEM",
        node_id="node_x",
        site_id="site_y",
        trust_domain="td.example",
        role="node",
        bundle="ROOTS",
        trust_version=3,
        identity_generation=2,
        server_time_ms=1_700_000_000_000,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chain", 5),
        ("node_id", ["node_x"]),
        ("trust_version", True),
        ("trust_version", "3"),
        ("server_time", -1),
        ("server_time", 10**20),
        ("server_time", 1.5),
    ],
)
def test_a_field_of_the_wrong_type_is_none(field: str, value: object) -> None:
    issued = wire.parse_issued({"kind": "renewed", field: value})
    name = "server_time_ms" if field == "server_time" else field
    assert getattr(issued, name) is None


def test_an_issued_body_must_be_joined_or_renewed() -> None:
    with pytest.raises(WireError):
        wire.parse_issued({"kind": "pending"})


@pytest.mark.parametrize(
    "change",
    [
        {"attestor": None},
        {"attestor": 5},
        {"round": "1"},
        {"round": True},
        {"not_after": None},
        {"not_after": 1.0},
        {"challenge": []},
        {"challenge": None},
    ],
)
def test_a_malformed_challenge_is_refused_with_one_text(change: dict[str, Any]) -> None:
    body = {"kind": "challenge", "attestor": "tpm", "round": 1, "not_after": 5, "challenge": {}}
    with pytest.raises(
        wire.MalformedChallenge, match=r"^the control plane sent a malformed challenge$"
    ):
        wire.parse_signed_body({**body, **change})


def test_a_challenge_parses_to_its_fields() -> None:
    body = {
        "kind": "challenge",
        "attestor": "tpm",
        "round": 2,
        "not_after": 9,
        "challenge": {"n": 1},
    }
    assert wire.parse_signed_body(body) == Challenge(
        attestor="tpm", round=2, not_after_ms=9, challenge={"n": 1}
    )
    assert Challenge.kind == "challenge"


@pytest.mark.parametrize(
    ("body", "request_id", "wait"),
    [
        ({"request_id": "jreq_1", "retry_after_s": 5}, "jreq_1", 5),
        ({}, "?", 1),
        ({"request_id": "a\nb\x1b[31m", "retry_after_s": True}, "a?b?[31m", 1),
        ({"request_id": "x" * 500, "retry_after_s": -3}, "x" * 64, -3),
        ({"request_id": 7, "retry_after_s": "5"}, "?", 1),
    ],
)
def test_a_pending_answer_is_shown_safely(body: dict[str, Any], request_id: str, wait: int) -> None:
    pending = wire.parse_signed_body({"kind": "pending", **body})
    assert pending == Pending(request_id=request_id, retry_after_s=wait)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"type":"welcome","session_id":"sess_1"}', wire.Welcome("sess_1")),
        (b'{"type":"welcome"}', wire.Welcome("")),
        (b'{"type":"welcome","session_id":"a\\nb"}', wire.Welcome("a\\nb")),
        (b'{"type":"ping"}', wire.Ping()),
        (b'{"type":"revocation","reason":"r","notice":"a.b.c"}', wire.RevocationLine("a.b.c", "r")),
        (b'{"type":"revocation","notice":5}', wire.RevocationLine(None, "")),
        (b'{"type":"later"}', wire.OtherLine()),
        (b"{}", wire.OtherLine()),
    ],
)
def test_session_lines_parse_to_their_messages(line: bytes, expected: object) -> None:
    assert wire.parse_session_line(line) == expected


@pytest.mark.parametrize(
    "line", [b"", b"[]", b"5", b"\xff", b'{"type": "ping"', b'{"a":"\\ud800"}', b"{" * 100_000]
)
def test_a_session_line_that_is_no_object_is_refused(line: bytes) -> None:
    with pytest.raises(WireError):
        wire.parse_session_line(line)


def test_the_control_plane_keeps_its_imports_from_bcd_wire() -> None:
    """bcd.wire stays the face: what control/ and attestors/ import from it is there."""
    for name in (
        "sign_response",
        "verify_response",
        "revocation_notice_body",
        "verify_revocation_notice",
        "public_jwk_of",
        "public_key_of_jwk",
        "loads_object",
        "dumps",
        "b64_field",
        "STATUS",
        "WireError",
        "MAX_BODY",
    ):
        assert hasattr(wire, name), name
    assert wire.WireError is signed.MalformedChallenge.__mro__[1]
