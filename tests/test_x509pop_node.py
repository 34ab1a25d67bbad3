"""The x509pop node half and its pure parsers; the crash-safe store of a re-join."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from attestors import x509pop
from bcd import pki
from bcd.attestor_api import NodeJoinContext
from bcd.config import Config, parse_config
from bcd.errors import BcdError, IdentityError, JoinError, UsageError
from bcd.identity import RENEWAL_STEPS, load_state, make_identity, persist_join, persist_rejoin
from bcd.keys.file import key_to_pem
from bcd.plugins import load_plugins
from bcd.rejoin import TPM_BOUND, prepare, sign_digest_p1363
from bcd.tpm.record import NodeKeyRecord
from tests.certs import chain_pem, make_ca, new_id

PLUGINS = load_plugins()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


# --- the parsers: only Malformed, never anything else --------------------------------


@given(json_values)
def test_parse_evidence_refuses_any_other_shape_with_malformed(value: Any) -> None:
    for candidate in (value, {"chain": value}):
        try:
            chain = x509pop.parse_evidence(candidate)
        except x509pop.Malformed:
            continue
        assert 0 < len(chain) <= 4
        assert all(isinstance(c, bytes) and c for c in chain)


@given(st.lists(st.binary(min_size=1, max_size=8192), min_size=1, max_size=4))
def test_evidence_round_trips(chain: list[bytes]) -> None:
    assert x509pop.parse_evidence(x509pop.encode_evidence(chain)) == tuple(chain)


@given(json_values, json_values, json_values)
def test_parse_answer_refuses_any_other_shape_with_malformed(a: Any, b: Any, c: Any) -> None:
    for candidate in (a, {"id": a, "nonce": b, "signature": c}):
        try:
            challenge_id, nonce, signature = x509pop.parse_answer(candidate)
        except x509pop.Malformed:
            continue
        assert isinstance(challenge_id, str)
        assert len(nonce) == 32
        assert len(signature) == 64


@given(
    st.text(alphabet="abcdefghjk_0123456789", min_size=1, max_size=64),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=64, max_size=64),
)
def test_answer_round_trips(challenge_id: str, nonce: bytes, signature: bytes) -> None:
    answer = x509pop.encode_answer(challenge_id, nonce, signature)
    assert x509pop.parse_answer(answer) == (challenge_id, nonce, signature)
    assert x509pop.parse_challenge(x509pop.encode_challenge(challenge_id, nonce)) == (
        challenge_id,
        nonce,
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        ({"id": "jc_1", "nonce": _b64(b"\0" * 31), "signature": _b64(b"\0" * 64)}, "nonce"),
        ({"id": "jc_1", "nonce": _b64(b"\0" * 33), "signature": _b64(b"\0" * 64)}, "nonce"),
        ({"id": "jc_1", "nonce": _b64(b"\0" * 32), "signature": _b64(b"\0" * 63)}, "signature"),
        ({"id": "", "nonce": _b64(b"\0" * 32), "signature": _b64(b"\0" * 64)}, "id"),
        ({"id": "x" * 65, "nonce": _b64(b"\0" * 32), "signature": _b64(b"\0" * 64)}, "id"),
        ({"id": 7, "nonce": _b64(b"\0" * 32), "signature": _b64(b"\0" * 64)}, "id"),
        ({"id": "jc_1", "nonce": "***", "signature": _b64(b"\0" * 64)}, "nonce"),
        ({"id": "jc_1", "nonce": _b64(b"\0" * 32)}, "signature"),
        ([], "answer"),
    ],
)
def test_parse_answer_names_the_bad_field(answer: Any, field: str) -> None:
    with pytest.raises(x509pop.Malformed) as info:
        x509pop.parse_answer(answer)
    assert str(info.value) == field


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 604_800), ("", 604_800), ("1", 1), ("60", 60), (" 3600 ", 3600), ("604800", 604_800)],
)
def test_max_expired_s_accepts(value: str | None, expected: int) -> None:
    settings = {} if value is None else {"x509pop.max_expired_s": value}
    assert x509pop.max_expired_s(settings) == expected


@pytest.mark.parametrize("value", ["0", "-5", "604801", "1e3", "a week", "1.5"])
def test_max_expired_s_refuses(value: str) -> None:
    with pytest.raises(ValueError, match=r"x509pop\.max_expired_s"):
        x509pop.max_expired_s({"x509pop.max_expired_s": value})


def test_check_settings_names_the_flag(tmp_path: Path) -> None:
    x509pop.check_settings({})  # not configured is fine
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"--x509pop-ca .*bad\.pem"):
        x509pop.check_settings({"x509pop.ca": str(bad)})
    with pytest.raises(ValueError, match="--x509pop-ca"):
        x509pop.check_settings({"x509pop.ca": str(tmp_path / "missing.pem")})
    good = tmp_path / "ca.pem"
    good.write_text(pki.cert_pem(make_ca().cert))
    x509pop.check_settings({"x509pop.ca": str(good), "x509pop.max_expired_s": "60"})


def test_the_proof_is_domain_separated_and_binds_the_csr() -> None:
    nonce = bytes(range(32))
    message = x509pop.pop_message(nonce, b"csr-a")
    assert message == b"bcd-x509pop-v1\0" + nonce + hashlib.sha256(b"csr-a").digest()
    assert message != x509pop.pop_message(nonce, b"csr-b")


# --- the node half ------------------------------------------------------------------


def _ctx(**overrides: Any) -> NodeJoinContext:
    fields: dict[str, Any] = {
        "credential": None,
        "csr_der": b"the-csr",
        "encryption_key": None,
        "now_s": 0,
        "role": "node",
    }
    fields.update(overrides)
    return NodeJoinContext(**fields)


def test_the_node_half_sends_the_chain_and_signs_nonce_and_csr_with_the_old_key() -> None:
    old = pki.generate_key()
    chain = (b"leaf-der", b"ca-der")
    ctx = _ctx(identity_chain_der=chain, identity_signer=lambda d: sign_digest_p1363(old, d))
    evidence = PLUGINS.node_evidence("x509pop", ctx)
    assert evidence is not None
    assert evidence.sealed_token is None
    assert x509pop.parse_evidence(evidence.evidence) == chain
    nonce = b"\x07" * 32
    answer = PLUGINS.node_answer("x509pop", x509pop.encode_challenge("jc_1", nonce), ctx)
    assert answer is not None
    challenge_id, echoed, signature = x509pop.parse_answer(answer)
    assert (challenge_id, echoed) == ("jc_1", nonce)
    pki.verify_p1363(old.public_key(), signature, x509pop.pop_message(nonce, b"the-csr"))
    with pytest.raises(pki.PkiError):
        pki.verify_p1363(old.public_key(), signature, x509pop.pop_message(nonce, b"other"))


def test_the_node_half_refuses_without_an_identity_or_with_a_bad_challenge() -> None:
    with pytest.raises(BcdError, match="existing identity"):
        PLUGINS.node_evidence("x509pop", _ctx())
    ctx = _ctx(identity_chain_der=(b"x",), identity_signer=lambda d: b"\0" * 64)
    for bad in ({}, {"id": "jc_1", "nonce": "AAAA"}, {"id": 1, "nonce": _b64(b"\0" * 32)}):
        with pytest.raises(BcdError, match="x509pop challenge is malformed"):
            PLUGINS.node_answer("x509pop", bad, ctx)


# --- bcd join --attestor x509pop: what it loads, and storing the result --------------


def _config(tmp_path: Path) -> Config:
    pins = {
        "serving_ca_spki_pin": pki.spki_pin(pki.generate_key().public_key()),
        "join_signing_key_pin": pki.spki_pin(pki.generate_key().public_key()),
        "join_encryption_key_pin": pki.spki_pin(pki.generate_key().public_key()),
    }
    text = (
        'gateway_url = "https://127.0.0.1:1"\n'
        f'site = "{new_id("site")}"\n'
        + "".join(f'{k} = "{v}"\n' for k, v in pins.items())
        + f'data_dir = "{tmp_path / "data"}"\n'
    )
    return parse_config(text, tmp_path / "config.toml")


def _stored(data_dir: Path, **leaf: Any) -> tuple[Any, Any]:
    """An identity on disk; returns (key, identity)."""
    ca = leaf.pop("ca", None) or make_ca()
    key = pki.generate_key()
    cert = ca.issue_leaf(key.public_key(), **leaf)
    identity = make_identity(
        chain=chain_pem(cert, ca),
        bundle=pki.cert_pem(ca.cert),
        trust_version=1,
        server_time="2026-01-01T00:00:00Z",
        key="file",
        identity_generation=1,
    )
    persist_join(data_dir, identity, key_to_pem(key), datetime.now(UTC))
    return key, identity


def _never(_record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:  # a TPM never opened
    raise AssertionError("the TPM was opened")


def test_prepare_lends_an_expired_identity_and_its_key(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    past = datetime.now(UTC) - timedelta(days=2)
    key, identity = _stored(cfg.data_dir, not_before=past, not_after=past + timedelta(hours=1))
    rejoin = prepare(cfg, _never, reset=False, node_id=None, now=_now())
    assert rejoin.state.identity.node_id == identity.node_id
    assert rejoin.role == "node"
    assert len(rejoin.chain_der) == 2
    digest = hashlib.sha256(b"m").digest()
    pki.verify_p1363(key.public_key(), rejoin.signer(digest), b"m")


def test_prepare_refuses_clearly(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with pytest.raises(UsageError, match="does not combine with --reset"):
        prepare(cfg, _never, reset=True, node_id=None, now=_now())
    with pytest.raises(JoinError, match="holds none; join with a token"):
        prepare(cfg, _never, reset=False, node_id=None, now=_now())
    _stored(cfg.data_dir, statements=("urn:bc:tpm-ak:sha256:" + "ab" * 32,))
    with pytest.raises(JoinError) as info:
        prepare(cfg, _never, reset=False, node_id=None, now=_now())
    assert str(info.value) == TPM_BOUND
    with pytest.raises(JoinError, match="names another node"):
        prepare(cfg, _never, reset=False, node_id=new_id("node"), now=_now())


def test_prepare_refuses_a_live_certificate(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _stored(cfg.data_dir)
    with pytest.raises(JoinError, match="bcd node renews it; --attestor x509pop re-joins only"):
        prepare(cfg, _never, reset=False, node_id=None, now=_now())
    later = _now() + timedelta(days=2)
    assert prepare(cfg, _never, reset=False, node_id=None, now=later).role == "node"


def _now() -> datetime:
    return datetime.now(UTC)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("step", RENEWAL_STEPS)
def test_a_rejoin_interrupted_at_any_step_leaves_one_loadable_identity(
    tmp_path: Path, step: str
) -> None:
    data_dir = tmp_path / "data"
    ca = make_ca()
    node_id = new_id("node")
    old_key, old = _stored(data_dir, ca=ca, node_id=node_id)
    (data_dir / "journal.db").write_bytes(b"journal")
    new_key = pki.generate_key()
    new = make_identity(
        chain=chain_pem(
            ca.issue_leaf(new_key.public_key(), node_id=node_id, site_id=old.site_id), ca
        ),
        bundle=old.bundle,
        trust_version=1,
        server_time="2026-01-01T00:00:00Z",
        key="file",
        identity_generation=2,
    )

    def crash(name: str) -> None:
        if name == step:
            raise _Crash(name)

    with pytest.raises(_Crash):
        persist_rejoin(data_dir, new, key_to_pem(new_key), crash)
    state = load_state(data_dir)
    assert state is not None
    expected = old if step == "next-key" else new
    assert state.identity == expected
    held = old_key if step == "next-key" else new_key
    assert pki.same_public_key(state.key.public_key(), held.public_key())
    assert not (data_dir / "node.key.next").exists()
    assert (data_dir / "journal.db").read_bytes() == b"journal"  # the same node's journal


def test_a_rejoin_for_another_node_or_key_stores_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    ca = make_ca()
    _old_key, old = _stored(data_dir, ca=ca)
    before = {p.name: p.read_bytes() for p in data_dir.iterdir()}
    key = pki.generate_key()
    other = make_identity(
        chain=chain_pem(ca.issue_leaf(key.public_key()), ca),
        bundle=old.bundle,
        trust_version=1,
        server_time="2026-01-01T00:00:00Z",
        key="file",
        identity_generation=2,
    )
    with pytest.raises(IdentityError, match="nothing was stored"):
        persist_rejoin(data_dir, other, key_to_pem(key))
    same = make_identity(
        chain=chain_pem(
            ca.issue_leaf(key.public_key(), node_id=old.node_id, site_id=old.site_id), ca
        ),
        bundle=old.bundle,
        trust_version=1,
        server_time="2026-01-01T00:00:00Z",
        key="file",
        identity_generation=2,
    )
    with pytest.raises(IdentityError, match="does not certify"):
        persist_rejoin(data_dir, same, key_to_pem(pki.generate_key()))
    assert {p.name: p.read_bytes() for p in data_dir.iterdir()} == before
    assert json.loads((data_dir / "identity.json").read_text())["node_id"] == old.node_id


# --- bcd doctor's hint ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("expired_ago", "statements", "hinted"),
    [
        (timedelta(hours=-1), (), False),
        (timedelta(days=1), (), True),
        (timedelta(days=6, hours=23), (), True),
        (timedelta(days=7, minutes=1), (), False),
        (timedelta(days=1), ("urn:bc:tpm-ak:sha256:" + "ab" * 32,), False),
    ],
)
def test_doctor_adds_the_x509pop_hint_only_within_7_days(
    tmp_path: Path, expired_ago: timedelta, statements: tuple[str, ...], hinted: bool
) -> None:
    from bcd.doctor import run_checks

    cfg = _config(tmp_path)
    cfg.path.write_text(
        "".join(
            line + "\n"
            for line in (
                'gateway_url = "https://127.0.0.1:1"',
                f'site = "{new_id("site")}"',
                f'serving_ca_spki_pin = "{pki.spki_pin(pki.generate_key().public_key())}"',
                f'join_signing_key_pin = "{pki.spki_pin(pki.generate_key().public_key())}"',
                f'join_encryption_key_pin = "{pki.spki_pin(pki.generate_key().public_key())}"',
                f'data_dir = "{cfg.data_dir}"',
            )
        )
    )
    now = datetime.now(UTC)
    end = now - expired_ago
    _stored(cfg.data_dir, not_before=end - timedelta(hours=1), not_after=end, statements=statements)
    checks = run_checks(cfg.path, now)
    assert checks[1].name == "identity"
    assert checks[1].status == ("fail" if expired_ago > timedelta(0) else "ok")
    hints = [c for c in checks if c.name == "x509pop"]
    if not hinted:
        assert hints == []
        return
    (hint,) = hints
    assert hint.status == "warn"
    assert hint.message.endswith("as root: bcd join --attestor x509pop")
    until = (end.replace(microsecond=0) + timedelta(days=7)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f"until {until}" in hint.message
