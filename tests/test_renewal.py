"""JoinService.Renew in process: the real store (SQLite and PostgreSQL), real crypto.

A node is made by a real join (JoinService with a token), then renews the way bcd
does: a new key and CSR, its current chain, the client time and the proof of
possession by its current key. Every refusal must look the same to the caller
(ACCESS_DENIED / "Renew refused"), change nothing, and leave its reason only in a
``security.renew.refused`` event: to the node's tenant once the caller proved the
current key, else to the root tenant.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki as bpki
from bcd import wire
from control import nodes
from control.clock import ManualClock
from control.errors import ControlError
from control.joinservice import (
    JoinService,
)
from control.pki import Pki
from control.renewal import (
    RENEWALS_PER_HOUR,
    RenewRefused,
    RenewService,
    check_renew_rate,
    proof_sha256,
    revoke_notices,
    revoked_since,
)
from control.store import Store
from tests.world.joins import PLUGINS
from tests.world.renewals import OWNER, ROOT, Env, NodeId, RenewAttempt, make_env, peer_status

AK = "urn:bc:tpm-ak:sha256:" + "ab" * 32
_P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def csr_with_names(key: ec.EllipticCurvePrivateKey, *uris: str) -> bytes:
    """A CSR that asks for names and statements of its own (which must be ignored)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [x509.NameAttribute(x509.oid.NameOID.ORGANIZATIONAL_UNIT_NAME, "bc-role:site")]
            )
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.DER)


# --- a successful renewal ------------------------------------------------------------


def test_renewal_issues_a_new_certificate_for_the_new_key(env: Env) -> None:
    node = env.join(1)
    attempt = env.body(node)
    body = env.renew_raw(attempt, node.der)

    assert body["kind"] == "renewed"
    assert (body["node_id"], body["site_id"], body["role"]) == (node.node_id, env.site, "node")
    assert body["trust_domain"] == env.pki.trust_domain
    assert body["csr_sha256"] == bpki.sha256_hex(attempt.csr_der)
    assert body["bundle"] == env.pki.bundle_pem()
    assert body["trust_version"] == env.pki.trust_version
    assert body["identity_generation"] == 1
    assert abs(body["server_time"] - time.time() * 1000) < 60_000
    chain = bpki.load_pem_chain(body["chain"])
    assert body["chain"].endswith(env.pki.chain_tail_pem())
    leaf = chain[0]
    assert bpki.same_public_key(attempt.key.public_key(), leaf.public_key())  # type: ignore[arg-type]
    info = bpki.leaf_info(leaf)
    assert str(info.spiffe) == f"spiffe://td.example/site/{env.site}/node/{node.node_id}"
    assert (info.role, info.statements) == ("node", ())
    assert info.serial_hex != node.serial

    rows = env.rows("SELECT * FROM node_certs ORDER BY created_at, serial")
    assert len(rows) == 2
    (new,) = [r for r in rows if r["serial"] == info.serial_hex]
    assert base64.b64decode(new["der"]) == leaf.public_bytes(serialization.Encoding.DER)
    assert (new["node_id"], new["identity_generation"], new["role"]) == (node.node_id, 1, "node")
    assert new["revoked_at"] is None
    assert new["spki_sha256"] == bpki.sha256_hex(bpki.spki_der(attempt.key.public_key()))
    # the old certificate stays valid until it expires (the node unloads its key later)
    (old,) = [r for r in rows if r["serial"] == node.serial]
    assert old["revoked_at"] is None
    (renewal,) = env.rows("SELECT * FROM renewals")
    assert (renewal["serial"], renewal["node_id"]) == (info.serial_hex, node.node_id)
    (audit,) = env.rows("SELECT * FROM audit WHERE action = 'node.renewed'")
    assert (audit["tenant_id"], audit["subject"]) == (env.tenant, node.node_id)
    assert json.loads(audit["payload"]) == {
        "nodeId": node.node_id,
        "previousSerial": node.serial,
        "certSerial": info.serial_hex,
    }
    (state,) = env.rows("SELECT state, identity_generation FROM nodes")
    assert (state["state"], state["identity_generation"]) == ("adopting", 1)
    assert env.events(env.tenant, "security.renew.refused") == []
    assert env.events(env.root, "security.renew.refused") == []


def test_a_renewed_certificate_renews_again(env: Env) -> None:
    node = env.join(2)
    second = env.renew(node)
    third = env.renew(second)
    assert len({node.serial, second.serial, third.serial}) == 3
    assert third.node_id == node.node_id


def test_renewal_keeps_role_statements_and_allowed_kinds_from_the_stored_leaf(env: Env) -> None:
    node = env.join(3)
    marked = env.issue_extra(node, ("urn:bc:example:keep-me",), ("exec.*", "reboot"))
    # the CSR asks for another node's identity, another role and an AK statement
    key = bpki.generate_key()
    greedy = csr_with_names(key, f"spiffe://td.example/site/{env.site}/node/node_{'0' * 26}", AK)
    attempt = env.body(marked, csr_der=greedy)
    body = env.renew_raw(attempt, marked.der)
    info = bpki.leaf_info(bpki.load_pem_chain(body["chain"])[0])
    assert info.spiffe.node_id == node.node_id
    assert info.role == "node"
    assert info.statements == ("urn:bc:example:keep-me",)
    (row,) = env.rows("SELECT * FROM node_certs WHERE serial = ?", (info.serial_hex,))
    assert json.loads(row["allowed_kinds"]) == ["exec.*", "reboot"]
    assert json.loads(row["statements"]) == ["urn:bc:example:keep-me"]
    assert row["identity_generation"] == 1


def test_renewal_keeps_the_role_of_a_hosted_node(env: Env) -> None:
    node = env.join(4, hosted="kubernetes")
    renewed = env.renew(node)
    assert bpki.leaf_info(renewed.leaf).role == "node-tenant"


def test_renewal_keeps_the_reclaimed_generation(env: Env) -> None:
    env.join(5)
    again = env.join(5, allow_reclaim=True)
    renewed = env.renew(again)
    (row,) = env.rows("SELECT * FROM node_certs WHERE serial = ?", (renewed.serial,))
    assert row["identity_generation"] == 2


def test_client_time_just_within_a_minute_is_accepted(env: Env) -> None:
    node = env.join(6)
    ahead = env.renew(node, client_time=env.now_ms() + 50_000)
    behind = env.renew(ahead, client_time=env.now_ms() - 50_000)
    assert len({node.serial, ahead.serial, behind.serial}) == 3


# --- every refusal --------------------------------------------------------------------


def test_refused_leaf_unknown_for_a_leaf_the_store_never_recorded(env: Env) -> None:
    node = env.join(10)
    key = bpki.generate_key()
    stray = env.crypto.issue_leaf(
        key.public_key(),
        bpki.SpiffeId(env.pki.trust_domain, env.site, node.node_id),
        "node",
        (),
        datetime.now(UTC),
        3600,
    )
    forged = NodeId(node.node_id, env.site, key, bpki.cert_pem(stray) + env.pki.chain_tail_pem())
    env.refused(env.body(forged), node.der, "leaf-unknown", routed_to=ROOT)


def test_refused_leaf_unknown_for_a_leaf_that_differs_from_its_row(env: Env) -> None:
    node = env.join(11)
    # same serial, other bytes: the row's DER is what counts
    other = env.join(12)
    env.sql(
        "UPDATE node_certs SET der = (SELECT der FROM node_certs WHERE serial = ?) "
        "WHERE serial = ?",
        (other.serial, node.serial),
    )
    env.refused(env.body(node), node.der, "leaf-unknown", routed_to=ROOT)


@pytest.mark.parametrize("chain", ["", "not a certificate", "-----BEGIN CERTIFICATE-----\nAA==\n"])
def test_refused_leaf_unknown_for_a_chain_that_does_not_parse(env: Env, chain: str) -> None:
    node = env.join(13)
    env.refused(env.body(node, chain=chain), node.der, "leaf-unknown", routed_to=ROOT)


def test_refused_leaf_revoked(env: Env) -> None:
    node = env.join(14)
    with env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
    env.refused(env.body(node), node.der, "leaf-revoked", routed_to=ROOT, node=node)


def test_refused_leaf_expired(env: Env, clock: ManualClock) -> None:
    node = env.join(15)
    clock.advance(86_400_001)  # a day and a millisecond: the leaf's lifetime is over
    attempt = env.body(node, client_time=clock.now_ms())
    env.refused(attempt, node.der, "leaf-expired", routed_to=ROOT, node=node)


def test_refused_leaf_expired_for_a_certificate_that_really_expired(
    store: Store, memory_pki: Pki
) -> None:
    env = make_env(store, memory_pki)
    short = replace(env.crypto, cert_ttl_s=2)
    env.joins = JoinService(store, short, PLUGINS)
    node = env.join(16)
    time.sleep(max(0.0, node.leaf.not_valid_after_utc.timestamp() - time.time()) + 1.1)
    env.refused(env.body(node), node.der, "leaf-expired", routed_to=ROOT, node=node)


def test_an_older_generation_is_dead_after_a_reclaim(env: Env) -> None:
    old = env.join(17)
    env.join(17, allow_reclaim=True)
    # the reclaim revoked it ...
    env.refused(env.body(old), old.der, "leaf-revoked", routed_to=ROOT, node=old)
    # ... and even were it not revoked, its generation is no longer the node's
    env.sql("UPDATE node_certs SET revoked_at = NULL WHERE serial = ?", (old.serial,))
    env.refused(env.body(old), old.der, "generation", routed_to=ROOT, node=old)


def test_refused_node_retired(env: Env) -> None:
    node = env.join(18)
    env.sql(
        "UPDATE nodes SET retired_at = ?, state = 'retired' WHERE id = ?",
        (env.now_ms(), node.node_id),
    )
    env.refused(env.body(node), node.der, "node-retired", routed_to=ROOT, node=node)


def test_refused_identity_mismatch(env: Env) -> None:
    node = env.join(19)
    other = env.join(20)
    for peer in (None, other.der, b"\x30\x03junk", node.der[:-1]):
        env.refused(env.body(node), peer, "identity-mismatch", routed_to=ROOT, node=node)


def test_refused_identity_mismatch_for_a_revoked_peer_certificate_of_the_node(
    env: Env,
) -> None:
    node = env.join(21)
    renewed = env.renew(node)
    env.sql("UPDATE node_certs SET revoked_at = ? WHERE serial = ?", (env.now_ms(), node.serial))
    env.refused(env.body(renewed), node.der, "identity-mismatch", routed_to=ROOT, node=renewed)


def test_another_certificate_of_the_same_node_may_carry_the_call(env: Env) -> None:
    node = env.join(22)
    renewed = env.renew(node)
    # bcd presents its current leaf in the request; the TLS client may still hold the old one
    attempt = env.body(renewed)
    body = env.renew_raw(attempt, node.der)
    assert body["node_id"] == node.node_id
    assert body["csr_sha256"] == bpki.sha256_hex(attempt.csr_der)


@pytest.mark.parametrize("offset_ms", [61_000, -61_000, 3_600_000])
def test_refused_clock_skew(env: Env, offset_ms: int) -> None:
    node = env.join(23)
    attempt = env.body(node, client_time=int(time.time() * 1000) + offset_ms)
    env.refused(attempt, node.der, "clock-skew", routed_to=ROOT, node=node)


def test_refused_pop_replay_within_120_seconds_and_accepted_after(env: Env) -> None:
    node = env.join(24)
    attempt = env.body(node)
    env.renew_raw(attempt, node.der)
    env.refused(attempt, node.der, "pop-replay", routed_to=ROOT, node=node)
    # the same proof with its signature flipped to (r, n - s) is the same proof
    sig = json.loads(attempt.body)["pop_sig"]
    raw = bpki.b64url_decode(sig)
    flipped = raw[:32] + (_P256_N - int.from_bytes(raw[32:], "big")).to_bytes(32, "big")
    assert proof_sha256(flipped) == proof_sha256(raw)
    env.refused(
        RenewAttempt(
            attempt.body.replace(sig.encode(), bpki.b64url(flipped).encode()),
            attempt.key,
            attempt.csr_der,
        ),
        node.der,
        "pop-replay",
        routed_to=ROOT,
        node=node,
    )
    # 119 s later it is still a replay; 121 s later it is not
    env.sql("UPDATE renew_proofs SET used_at = used_at - 119000")
    env.refused(attempt, node.der, "pop-replay", routed_to=ROOT, node=node)
    env.sql("UPDATE renew_proofs SET used_at = used_at - 2000")
    body = env.renew_raw(attempt, node.der)
    assert body["node_id"] == node.node_id
    (proof,) = env.rows("SELECT * FROM renew_proofs")
    assert proof["used_at"] >= env.now_ms() - 10_000


def test_stale_proofs_are_pruned_at_the_next_renewal(env: Env, clock: ManualClock) -> None:
    node = env.join(25)
    renewed = env.renew(node, client_time=clock.now_ms())
    clock.advance(121_000)  # past the replay window
    env.renew(renewed, client_time=clock.now_ms())
    assert len(env.rows("SELECT * FROM renew_proofs")) == 1


def test_refused_pop_invalid(env: Env) -> None:
    node = env.join(26)
    other = env.join(27)
    now = int(time.time() * 1000)
    for attempt in (
        env.body(node, sign_with=bpki.generate_key()),
        env.body(node, sign_with=other.key),
        env.body(node, pop_node_id=other.node_id),
        env.body(node, pop_sig=b"\x01" * 64),
        env.body(node, pop_sig=b"\x01" * 10),
        env.body(node, pop_sig=b""),
    ):
        env.refused(attempt, node.der, "pop-invalid", routed_to=ROOT, node=node)
    # a proof over another client time than the one sent
    good = env.body(node, client_time=now)
    wrong = json.loads(good.body)
    wrong["client_time"] = now + 1
    env.refused(
        RenewAttempt(wire.dumps(wrong), good.key, good.csr_der),
        node.der,
        "pop-invalid",
        routed_to=ROOT,
        node=node,
    )


def _p384_csr() -> bytes:
    key = ec.generate_private_key(ec.SECP384R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.DER)


@pytest.mark.parametrize("make", [lambda: b"\x30\x03\x02\x01\x00", lambda: b"junk", _p384_csr])
def test_refused_csr_invalid_goes_to_the_owner(env: Env, make: Any) -> None:
    node = env.join(28)
    env.refused(env.body(node, csr_der=make()), node.der, "csr-invalid", routed_to=OWNER, node=node)


def test_refused_key_attestation_missing_for_a_leaf_naming_an_ak(env: Env) -> None:
    node = env.join(29)
    tpm = env.issue_extra(node, (AK,))
    env.refused(env.body(tpm), tpm.der, "key-attestation-missing", routed_to=OWNER, node=tpm)


def test_refused_node_key_malformed_for_an_attestation_that_does_not_parse(env: Env) -> None:
    node = env.join(30)
    tpm = env.issue_extra(node, (AK,))
    attestation = {"ak_public": "AAAA", "key_public": "AAAA", "certify": "AAAA"}
    env.refused(
        env.body(tpm, key_attestation=attestation),
        tpm.der,
        "node-key-malformed",
        routed_to=OWNER,
        node=tpm,
    )


def test_a_key_attestation_for_a_leaf_without_an_ak_is_not_needed_and_ignored(env: Env) -> None:
    node = env.join(31)
    renewed = env.renew(node, key_attestation={"certify": "AAAA"})
    assert bpki.leaf_info(renewed.leaf).statements == ()


def test_every_renew_refusal_is_the_same_to_the_caller(env: Env) -> None:
    node = env.join(32)
    seen = set()
    for attempt, peer in (
        (env.body(node, chain="x"), node.der),
        (env.body(node), None),
        (env.body(node, client_time=0), node.der),
        (env.body(node, pop_sig=b"\x00" * 64), node.der),
        (env.body(node, csr_der=b"junk"), node.der),
    ):
        with pytest.raises(RenewRefused) as info:
            env.renewals.renew(attempt.body, peer)
        seen.add((info.value.code, info.value.message, str(info.value), info.value.args))
    assert len(seen) == 1


def test_refusal_events_are_rate_limited(env: Env) -> None:
    node = env.join(33)
    attempt = env.body(node, client_time=0)
    for _ in range(62):
        with pytest.raises(RenewRefused):
            env.renewals.renew(attempt.body, node.der)
    got = env.events(env.root, "security.renew.refused")
    assert len(got) in (60, 61)  # 61 when the run crossed a minute
    assert all(e["payload"]["reason"] == "clock-skew" for e in got)


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b"{}", b'{"csr": "!!", "chain": "", "client_time": 1, "pop_sig": ""}', b"\xff"],
)
def test_malformed_body_is_invalid_argument_and_writes_nothing(env: Env, body: bytes) -> None:
    node = env.join(34)
    before = env.snapshot()
    with pytest.raises(ControlError) as info:
        env.renewals.renew(body, node.der)
    assert info.value.code == "INVALID_ARGUMENT"
    assert not isinstance(info.value, RenewRefused)
    assert env.snapshot() == before
    assert env.events(env.root, "security.renew.refused") == []


def test_missing_join_crypto_is_invalid_config(env: Env) -> None:
    node = env.join(35)
    with pytest.raises(ControlError) as info:
        RenewService(env.store, None).renew(env.body(node).body, node.der)
    assert info.value.code == "INVALID_CONFIG"


# --- the rate limit --------------------------------------------------------------------


def test_the_seventh_renewal_within_an_hour_gets_a_pushback(env: Env, clock: ManualClock) -> None:
    node = env.join(40)
    with env.store.tx() as tx:
        assert check_renew_rate(tx, node.node_id) is None
    current = node
    for _ in range(RENEWALS_PER_HOUR):  # a second apart
        current = env.renew(current, client_time=clock.now_ms())
        clock.advance(1_000)
    with env.store.tx() as tx:
        pushback = check_renew_rate(tx, node.node_id)
    assert pushback is not None
    assert 3_500_000 < pushback <= 3_600_000
    before = env.snapshot()
    with pytest.raises(ControlError) as info:
        env.renewals.renew(env.body(current, client_time=clock.now_ms()).body, current.der)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert not isinstance(info.value, RenewRefused)
    assert info.value.retry_after_ms is not None
    assert 3_500_000 < info.value.retry_after_ms <= 3_600_000
    assert env.snapshot() == before
    # another node is not held back
    other = env.join(41)
    env.renew(other, client_time=clock.now_ms())
    # the window slides: once the oldest renewal is an hour old, one more is allowed
    clock.advance(3_600_000 - RENEWALS_PER_HOUR * 1_000)
    with env.store.tx() as tx:
        assert check_renew_rate(tx, node.node_id) is None
    env.renew(current, client_time=clock.now_ms())
    with env.store.tx() as tx:
        assert check_renew_rate(tx, node.node_id) is not None
    # renewals older than an hour were pruned by that renewal
    assert len(env.rows("SELECT * FROM renewals WHERE node_id = ?", (node.node_id,))) == 6


def test_pushback_counts_until_the_oldest_renewal_in_the_window_leaves_it(env: Env) -> None:
    node = env.join(42)
    now = env.now_ms()
    with env.store.tx() as tx:
        for i in range(7):
            tx.execute(
                "INSERT INTO renewals (serial, node_id, renewed_at) VALUES (?, ?, ?)",
                (f"s{i}", node.node_id, now - 3_000_000 + i * 1000),
            )
    with env.store.tx() as tx:
        pushback = check_renew_rate(tx, node.node_id)
        at = tx.now_ms()
    # seven in the window: two must leave it, the second at now - 3_000_000 + 1000 + 1 h
    assert pushback == now - 3_000_000 + 1000 + 3_600_000 - at


def _race(n: int, work: Any) -> list[Any]:
    """Run ``work(i)`` in ``n`` threads at once; return each result or exception."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = work(i)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_one_proof_sent_eight_times_at_once_renews_exactly_once(env: Env) -> None:
    node = env.join(43)
    attempt = env.body(node)
    out = _race(8, lambda _i: env.renewals.renew(attempt.body, node.der))
    assert sum(isinstance(r, str) for r in out) == 1
    refusals = [r for r in out if not isinstance(r, str)]
    assert all(isinstance(r, RenewRefused) and r.reason == "pop-replay" for r in refusals)
    assert len(env.rows("SELECT * FROM renewals")) == 1


def test_ten_renewals_at_once_stay_within_six_an_hour(env: Env) -> None:
    node = env.join(44)
    attempts = [env.body(node) for _ in range(10)]
    out = _race(10, lambda i: env.renewals.renew(attempts[i].body, node.der))
    assert sum(isinstance(r, str) for r in out) == RENEWALS_PER_HOUR
    rest = [r for r in out if not isinstance(r, str)]
    assert all(isinstance(r, ControlError) and r.code == "RESOURCE_EXHAUSTED" for r in rest)
    assert len(env.rows("SELECT * FROM renewals")) == RENEWALS_PER_HOUR


# --- for the gateway ------------------------------------------------------------------


def test_peer_status_names_a_live_node_certificate_only(env: Env, clock: ManualClock) -> None:
    node = env.join(50)
    other = env.join(51)
    with env.store.tx() as tx:
        assert peer_status(tx, node.der) == (node.node_id, node.serial)
        assert peer_status(tx, b"junk") is None
        assert peer_status(tx, node.der[:-1]) is None
    stray = env.crypto.issue_leaf(
        bpki.generate_key().public_key(),
        bpki.SpiffeId(env.pki.trust_domain, env.site, node.node_id),
        "node",
        (),
        datetime.now(UTC),
        3600,
    )
    with env.store.tx() as tx:
        assert peer_status(tx, stray.public_bytes(serialization.Encoding.DER)) is None
    issued = clock.now_ms()
    clock.advance(86_400_001)  # after its not_after
    with env.store.tx() as tx:
        assert peer_status(tx, node.der) is None
    clock.set(issued - 62_000)  # before its not_before (60 s back, in whole seconds)
    with env.store.tx() as tx:
        assert peer_status(tx, node.der) is None
    clock.set(issued)
    with env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, other.node_id, env.sign)
        assert peer_status(tx, other.der) is None


def test_peer_status_refuses_a_certificate_of_a_retired_node(env: Env) -> None:
    node = env.join(52)
    env.sql("UPDATE nodes SET retired_at = 1 WHERE id = ?", (node.node_id,))
    with env.store.tx() as tx:
        assert peer_status(tx, node.der) is None


def test_revoked_since_lists_revocations_after_a_time(env: Env) -> None:
    a = env.join(53)
    b = env.join(54)
    renewed_a = env.renew(a)
    start = env.now_ms() - 1
    with env.store.tx() as tx:
        assert revoked_since(tx, start) == []
        nodes.revoke_identity(tx, env.tenant, a.node_id, env.sign, "key compromised")
    with env.store.tx() as tx:
        got = revoked_since(tx, start)
    assert {r["serial"] for r in got} == {a.serial, renewed_a.serial}
    with env.store.tx() as tx:
        notices = revoke_notices(tx, [r["serial"] for r in got] + [b.serial, "ff"])
    assert set(notices) == {a.serial, renewed_a.serial}  # b is live, ff no certificate
    for r in got:
        assert set(r) == {"serial", "node_id", "revoke_reason", "revoked_at"}
        assert (r["node_id"], r["revoke_reason"]) == (a.node_id, "key compromised")
        notice = wire.verify_revocation_notice(
            notices[r["serial"]], env.pin, a.node_id, [r["serial"]]
        )  # signed where it was revoked, for the gateways to push as it is
        assert notice.reason == "key compromised"
        assert r["revoked_at"] > start
    with env.store.tx() as tx:
        assert revoked_since(tx, max(r["revoked_at"] for r in got)) == []
        nodes.delete_node(tx, env.tenant, b.node_id, env.sign)
    with env.store.tx() as tx:
        later = revoked_since(tx, start)
    assert [r["serial"] for r in later if r["node_id"] == b.node_id] == [b.serial]
    assert [r["revoke_reason"] for r in later if r["node_id"] == b.node_id] == ["deleted"]
