"""The x509pop attestor's server half in process, on both stores (SQLite, PostgreSQL).

A node joins with a token; its leaf is then presented by the x509pop node half with a
proof of possession of its key. Leaves are made to lie in the past by issuing them
from a PKI built 30 days ago with a shifted clock, so the 7-day default is shown by
time: a leaf that expired 6 days 23 hours ago re-joins, one 7 days and a minute ago
is refused.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestors import x509pop
from bcd import pki as bpki
from bcd import wire
from bcd.attestor_api import Admit, NodeJoinContext, hookimpl
from bcd.plugins import load_plugins
from bcd.rejoin import sign_digest_p1363
from control import events, tenancy, tokens
from control.clock import ManualClock
from control.errors import Refused
from control.joinservice import JoinService, issue_recorded_leaf
from control.pki import Pki, build_pki, issue_node_leaf
from control.server import join_crypto
from control.store import Store
from tests.world import other_ca_bundle
from tests.world.joins import join_body, machine

PLUGINS = load_plugins()
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


@pytest.fixture(scope="module")
def old_pki() -> Pki:
    """A PKI made 30 days ago, so leaves can be issued (and verify) in the past."""
    return build_pki("td.example", datetime.now(UTC) - 30 * DAY)


@dataclass
class Held:
    """What a joined node holds: its key and its chain."""

    key: ec.EllipticCurvePrivateKey
    chain_pem: str
    node_id: str

    @property
    def chain_der(self) -> tuple[bytes, ...]:
        return tuple(
            c.public_bytes(serialization.Encoding.DER) for c in bpki.load_pem_chain(self.chain_pem)
        )

    @property
    def leaf_der(self) -> bytes:
        return self.chain_der[0]


@dataclass
class Env:
    store: Store
    pki: Pki
    root: str
    tenant: str
    site: str
    pool: str
    ca_path: Path
    settings: dict[str, str]
    shift: list[timedelta] = field(default_factory=lambda: [timedelta(0)])

    def service(self, settings: dict[str, str] | None = None) -> JoinService:
        def issue(pub, spiffe, role, statements, now, ttl):  # type: ignore[no-untyped-def]
            return issue_node_leaf(
                self.pki, pub, spiffe, role, statements, now - self.shift[0], ttl
            )

        crypto = dataclasses.replace(join_crypto(self.pki), issue_leaf=issue, cert_ttl_s=3600)
        chosen = self.settings if settings is None else settings
        return JoinService(self.store, crypto, PLUGINS, chosen)

    @property
    def pin(self) -> str:
        return self.pki.pins()["join_signing_key_pin"]

    def token_join(
        self,
        n: int,
        *,
        expired_ago: timedelta | None = timedelta(minutes=5),
        csr_der: bytes | None = None,
    ) -> Held:
        """Join machine ``n`` with a token; its leaf (1 h) expired ``expired_ago`` ago
        (None: a leaf issued now, still valid).

        ``csr_der`` is the CSR of a key held elsewhere (the TPM); else a file key's."""
        self.shift[0] = timedelta(0) if expired_ago is None else expired_ago + HOUR
        try:
            with self.store.tx() as tx:
                token = tokens.create(tx, self.tenant, self.pool, ttl_s=3600)["token"]
            attempt = join_body(
                token, self.pki.join_encryption_key.public_key(), machine(n), csr_der=csr_der
            )
            body = wire.verify_response(self.service().join(attempt.body), self.pin)
        finally:
            self.shift[0] = timedelta(0)
        assert body["kind"] == "joined"
        return Held(attempt.key, body["chain"], body["node_id"])

    def request(
        self,
        held: Held,
        csr_der: bytes,
        *,
        rnd: int = 0,
        answer: dict[str, Any] | None = None,
        role: str = "node",
        evidence: dict[str, Any] | None = None,
    ) -> bytes:
        req = wire.JoinRequest(
            role=role,
            attestor="x509pop",
            sealed_token=None,
            csr_der=csr_der,
            claims=machine(900),
            evidence=x509pop.encode_evidence(held.chain_der) if evidence is None else evidence,
            node_id=None,
            daemon_version="0.1.0-test",
            round=rnd,
            answer=answer,
        )
        return wire.dumps(req.to_json())

    def send(self, body: bytes, svc: JoinService | None = None) -> dict[str, Any]:
        return wire.verify_response((svc or self.service()).join(body), self.pin)

    def node_ctx(self, held: Held, csr_der: bytes) -> NodeJoinContext:
        return NodeJoinContext(
            credential=None,
            csr_der=csr_der,
            encryption_key=None,
            now_s=0,
            role="node",
            identity_chain_der=held.chain_der,
            identity_signer=lambda digest: sign_digest_p1363(held.key, digest),
        )

    def challenge(self, held: Held, csr_der: bytes) -> dict[str, Any]:
        body = self.send(self.request(held, csr_der))
        assert body["kind"] == "challenge"
        assert body["attestor"] == "x509pop"
        assert body["round"] == 1
        return body

    def answer(self, held: Held, csr_der: bytes, challenge: dict[str, Any]) -> dict[str, Any]:
        answer = PLUGINS.node_answer(
            "x509pop", challenge["challenge"], self.node_ctx(held, csr_der)
        )
        assert answer is not None
        return answer

    def rejoin(self, held: Held) -> tuple[dict[str, Any], ec.EllipticCurvePrivateKey]:
        new_key = bpki.generate_key()
        csr = bpki.make_csr(new_key)
        challenge = self.challenge(held, csr)
        body = self.send(self.request(held, csr, rnd=1, answer=self.answer(held, csr, challenge)))
        return body, new_key

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return tx.query(sql, params)

    def sql(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        with self.store.tx() as tx:
            tx.execute(sql, params)

    def refused(
        self, body: bytes, reason: str, *, svc: JoinService | None = None, to: str | None = None
    ) -> None:
        """The join is refused for ``reason``: nothing changes, the event says why."""
        before = (
            self.rows("SELECT * FROM nodes ORDER BY id"),
            self.rows("SELECT serial, revoked_at FROM node_certs ORDER BY serial"),
        )
        tenant = to or self.root
        with self.store.tx() as tx:
            seen = {e["id"] for e in events.list_events(tx, tenant, "security.join.refused")}
        with pytest.raises(Refused) as info:
            (svc or self.service()).join(body)
        assert (info.value.code, info.value.message) == ("ACCESS_DENIED", "Join refused")
        assert info.value.reason == f"x509pop:{reason}"
        after = (
            self.rows("SELECT * FROM nodes ORDER BY id"),
            self.rows("SELECT serial, revoked_at FROM node_certs ORDER BY serial"),
        )
        assert after == before
        with self.store.tx() as tx:
            new = [
                e
                for e in events.list_events(tx, tenant, "security.join.refused")
                if e["id"] not in seen
            ]
        assert [e["payload"]["reason"] for e in new] == [f"x509pop:{reason}"]
        assert new[0]["payload"]["attestor"] == "x509pop"


@pytest.fixture
def env(store: Store, old_pki: Pki, tmp_path: Path) -> Env:
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        tenant, _ = tenancy.create_tenant(tx, "acme")
        site = tenancy.create_site(tx, tenant, "rack-b7")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "gpu", "bcd", {})["id"]
    ca_path = tmp_path / "node-root-ca.pem"
    ca_path.write_text(bpki.cert_pem(old_pki.node_root_ca))
    return Env(store, old_pki, root, tenant, site, pool, ca_path, {"x509pop.ca": str(ca_path)})


# --- admission ------------------------------------------------------------------------


def test_a_leaf_expired_6_days_23_hours_ago_rejoins_the_same_node(env: Env) -> None:
    held = env.token_join(1, expired_ago=6 * DAY + 23 * HOUR)
    env.sql(
        "UPDATE node_certs SET allowed_kinds = ? WHERE node_id = ?",
        (json.dumps(["shell.*", "reboot"]), held.node_id),
    )
    old_serial = bpki.leaf_info(bpki.load_pem_chain(held.chain_pem)[0]).serial_hex

    body, new_key = env.rejoin(held)

    assert body["kind"] == "joined"
    assert body["node_id"] == held.node_id
    assert body["identity_generation"] == 2
    assert body["role"] == "node"
    assert body["site_id"] == env.site
    leaf = bpki.load_pem_chain(body["chain"])[0]
    assert bpki.same_public_key(leaf.public_key(), new_key.public_key())  # type: ignore[arg-type]
    assert leaf.not_valid_after_utc > datetime.now(UTC)
    (node,) = env.rows("SELECT * FROM nodes")
    assert (node["id"], node["identity_generation"], node["pool_id"]) == (
        held.node_id,
        2,
        env.pool,
    )
    certs = env.rows(
        "SELECT serial, identity_generation, role, allowed_kinds, revoked_at, revoke_reason "
        "FROM node_certs ORDER BY created_at"
    )
    old = next(c for c in certs if c["serial"] == old_serial)
    new = next(c for c in certs if c["serial"] != old_serial)
    assert old["revoked_at"] is not None
    assert old["revoke_reason"] == "rejoined"
    assert new["revoked_at"] is None
    assert new["identity_generation"] == 2
    assert new["role"] == "node"
    assert json.loads(new["allowed_kinds"]) == ["shell.*", "reboot"]
    with env.store.tx() as tx:
        revoked = events.list_events(tx, env.tenant, "security.certificate-revoked")
        joined = events.list_events(tx, env.tenant, "node.joined")
        audit = tx.query("SELECT action, payload FROM audit WHERE subject = ?", (held.node_id,))
    assert [e["payload"] for e in revoked] == [
        {"nodeId": held.node_id, "serial": old_serial, "reason": "rejoined"}
    ]
    rejoined = joined[-1]["payload"]
    assert rejoined["attestor"] == "x509pop"
    assert rejoined["reclaim"] is True
    assert rejoined["rejoin"] is True
    assert rejoined["nodeKey"] == "unattested"
    assert sorted(r["action"] for r in audit) == ["node.joined", "node.reclaimed"]
    # the challenge is spent: the same answer cannot re-join again
    assert env.rows("SELECT used_at FROM join_challenges")[0]["used_at"] is not None


def test_an_unexpired_leaf_renews_and_never_rejoins(env: Env) -> None:
    held = env.token_join(2, expired_ago=None)
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "not-expired")


def test_a_leaf_a_renewal_replaced_is_refused_even_after_the_new_one_expired(env: Env) -> None:
    held = env.token_join(25, expired_ago=2 * DAY)
    # the node renewed (a later certificate of the same generation), then went offline
    newer = env.token_join(26, expired_ago=DAY)
    env.sql(
        "UPDATE node_certs SET node_id = ?, created_at = created_at + 1 WHERE node_id = ?",
        (held.node_id, newer.node_id),
    )
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "superseded")


def test_the_challenge_stores_only_hashes_bound_to_the_leaf_and_csr(env: Env) -> None:
    held = env.token_join(3)
    csr = bpki.make_csr(bpki.generate_key())
    body = env.challenge(held, csr)
    challenge_id, nonce = x509pop.parse_challenge(body["challenge"])
    (row,) = env.rows("SELECT * FROM join_challenges")
    assert body["not_after"] == row["not_after"] == row["created_at"] + 60_000
    leaf_der = held.leaf_der
    serial = bpki.leaf_info(bpki.load_pem_chain(held.chain_pem)[0]).serial_hex
    assert row["id"] == challenge_id
    assert row["attestor"] == "x509pop"
    assert row["secret_sha256"] == bpki.sha256_hex(nonce)
    assert row["ek_sha256"] == bpki.sha256_hex(leaf_der)
    assert row["ak_name"] == serial
    assert row["csr_sha256"] == bpki.sha256_hex(csr)
    assert base64.b64encode(nonce).decode() not in json.dumps(row)


# --- refusals -------------------------------------------------------------------------


def test_refused_after_7_days_and_a_minute_by_default(env: Env) -> None:
    held = env.token_join(4, expired_ago=7 * DAY + timedelta(minutes=1))
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "expired-too-long")


def test_max_expired_s_shortens_the_window(env: Env) -> None:
    held = env.token_join(5, expired_ago=2 * HOUR)
    short = env.service({**env.settings, "x509pop.max_expired_s": "3600"})
    env.refused(
        env.request(held, bpki.make_csr(bpki.generate_key())), "expired-too-long", svc=short
    )
    longer = env.service({**env.settings, "x509pop.max_expired_s": "10800"})
    assert env.send(env.request(held, bpki.make_csr(bpki.generate_key())), longer)["kind"] == (
        "challenge"
    )


def test_refused_when_not_configured(env: Env) -> None:
    held = env.token_join(6)
    csr = bpki.make_csr(bpki.generate_key())
    env.refused(env.request(held, csr), "not-configured", svc=env.service({}))
    bad = env.service({**env.settings, "x509pop.max_expired_s": "a week"})
    env.refused(env.request(held, csr), "not-configured", svc=bad)


@pytest.mark.parametrize(
    "evidence",
    [
        {},
        {"chain": []},
        {"chain": "MIIB"},
        {"chain": ["not base64!"]},
        {"chain": [base64.b64encode(b"\x30\x03\x02\x01\x00").decode()]},
        {"chain": ["QUFB"] * 5},
    ],
)
def test_refused_malformed_evidence(env: Env, evidence: dict[str, Any]) -> None:
    held = env.token_join(7)
    body = env.request(held, bpki.make_csr(bpki.generate_key()), evidence=evidence)
    env.refused(body, "evidence-malformed")


def test_refused_a_round_0_with_an_answer_and_a_round_1_without_one(env: Env) -> None:
    held = env.token_join(8)
    csr = bpki.make_csr(bpki.generate_key())
    fake = x509pop.encode_answer("jc_x", b"\0" * 32, b"\0" * 64)
    env.refused(env.request(held, csr, answer=fake), "evidence-malformed")
    env.refused(env.request(held, csr, rnd=1, answer={"id": "jc_x"}), "evidence-malformed")


def test_refused_for_another_role(env: Env) -> None:
    held = env.token_join(9)
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key()), role="site"), "role")


def test_refused_when_the_chain_is_not_the_configured_cas(env: Env, tmp_path: Path) -> None:
    held = env.token_join(10)
    csr = bpki.make_csr(bpki.generate_key())
    other = other_ca_bundle(tmp_path / "other.pem")
    env.refused(env.request(held, csr), "chain", svc=env.service({"x509pop.ca": str(other)}))
    # a leaf of another PKI, presented with its own CAs, against the configured bundle
    from tests.certs import node_identity

    key, identity = node_identity()
    foreign = Held(key, identity.chain, identity.node_id)
    env.refused(env.request(foreign, csr), "chain")


def test_refused_a_leaf_the_ca_issued_but_joinservice_never_recorded(env: Env) -> None:
    held = env.token_join(11)
    leaf = bpki.load_pem_chain(held.chain_pem)[0]
    info = bpki.leaf_info(leaf)
    key = bpki.generate_key()
    now = datetime.now(UTC) - 2 * HOUR  # expired an hour ago
    twin = issue_node_leaf(env.pki, key.public_key(), info.spiffe, "node", (), now, 3600)
    forged = Held(key, bpki.cert_pem(twin) + env.pki.chain_tail_pem(), held.node_id)
    env.refused(env.request(forged, bpki.make_csr(bpki.generate_key())), "leaf-unknown")


def test_refused_a_revoked_leaf(env: Env) -> None:
    held = env.token_join(12)
    env.sql("UPDATE node_certs SET revoked_at = 1, revoke_reason = 'operator'")
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "leaf-revoked")


def test_refused_a_leaf_of_an_older_generation(env: Env) -> None:
    held = env.token_join(13)
    env.sql("UPDATE nodes SET identity_generation = 2")
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "generation")


def test_refused_a_retired_node(env: Env) -> None:
    held = env.token_join(14)
    env.sql("UPDATE nodes SET retired_at = 1")
    env.refused(env.request(held, bpki.make_csr(bpki.generate_key())), "node-retired")


def test_refused_a_tpm_ak_bound_leaf_never_downgraded(env: Env) -> None:
    held = env.token_join(15, expired_ago=3 * HOUR)
    key = bpki.generate_key()
    statement = "urn:bc:tpm-ak:sha256:" + "ab" * 32

    def issued_2h_ago(pub, spiffe, role, statements, now, ttl):  # type: ignore[no-untyped-def]
        return issue_node_leaf(env.pki, pub, spiffe, role, statements, now - 2 * HOUR, ttl)

    crypto = dataclasses.replace(join_crypto(env.pki), issue_leaf=issued_2h_ago, cert_ttl_s=3600)
    with env.store.tx() as tx:
        leaf, _info = issue_recorded_leaf(
            tx,
            crypto,
            key.public_key(),
            bpki.SpiffeId("td.example", env.site, held.node_id),
            "node",
            (statement,),
            (),
            1,
        )
    bound = Held(key, bpki.cert_pem(leaf) + env.pki.chain_tail_pem(), held.node_id)
    env.refused(env.request(bound, bpki.make_csr(bpki.generate_key())), "statement")


def _expired_recorded_leaf(
    env: Env, node_id: str, role: str, statements: tuple[str, ...] = ()
) -> Held:
    """A certificate of ``node_id`` JoinService recorded, issued 2 h ago for 1 h."""

    def issued_2h_ago(pub, spiffe, role, statements, now, ttl):  # type: ignore[no-untyped-def]
        return issue_node_leaf(env.pki, pub, spiffe, role, statements, now - 2 * HOUR, ttl)

    crypto = dataclasses.replace(join_crypto(env.pki), issue_leaf=issued_2h_ago, cert_ttl_s=3600)
    key = bpki.generate_key()
    with env.store.tx() as tx:
        leaf, _info = issue_recorded_leaf(
            tx, crypto, key.public_key(), bpki.SpiffeId("td.example", env.site, node_id),
            role, statements, (), 1,
        )  # fmt: skip
    return Held(key, bpki.cert_pem(leaf) + env.pki.chain_tail_pem(), node_id)


def test_refused_a_ramdisk_leaf(env: Env) -> None:
    held = env.token_join(27, expired_ago=3 * HOUR)
    ramdisk = _expired_recorded_leaf(env, held.node_id, "ramdisk")
    csr = bpki.make_csr(bpki.generate_key())
    env.refused(env.request(ramdisk, csr, role="ramdisk"), "role")


class _NodeIdAdmitter:
    """A third-party attestor that re-joins a node by id without statements."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["rejoin-any"]

    @hookimpl
    def bcd_server_verify(self, attestor: str, request: Any, ctx: Any) -> Any:
        if attestor != "rejoin-any":
            return None
        node = ctx.settings["rejoin-any.node"]
        rows = ctx.lookup_pool(ctx.settings["rejoin-any.pool"])
        return Admit(rows.tenant_id, rows.pool_id, rows.site_id, "node", node_id=node)


@pytest.mark.parametrize("tie", [False, True], ids=["later", "same-millisecond"])
def test_joinservice_never_lets_an_attestor_downgrade_a_tpm_bound_node(env: Env, tie: bool) -> None:
    held = env.token_join(28, expired_ago=3 * HOUR)
    _expired_recorded_leaf(env, held.node_id, "node", ("urn:bc:tpm-ak:sha256:" + "cd" * 32,))
    if tie:  # the bare and the bound certificate recorded in the same millisecond
        with env.store.tx() as tx:
            tx.execute("UPDATE node_certs SET created_at = 1000 WHERE node_id = ?", (held.node_id,))
    svc = JoinService(
        env.store,
        join_crypto(env.pki),
        load_plugins([_NodeIdAdmitter()]),
        {"rejoin-any.node": held.node_id, "rejoin-any.pool": env.pool},
    )
    body = json.loads(env.request(held, bpki.make_csr(bpki.generate_key())))
    body["attestor"] = "rejoin-any"
    with pytest.raises(Refused) as info:
        svc.join(json.dumps(body).encode())
    assert info.value.reason == "rejoin-any:reclaim"
    assert env.rows("SELECT identity_generation FROM nodes WHERE id = ?", (held.node_id,)) == [
        {"identity_generation": 1}
    ]


def test_refused_into_a_pool_whose_policy_does_not_list_x509pop(env: Env) -> None:
    held = env.token_join(16)
    env.sql(
        "UPDATE pools SET policy = ? WHERE id = ?",
        (json.dumps({"joinAttestors": ["join-token"]}), env.pool),
    )
    csr = bpki.make_csr(bpki.generate_key())
    answer = env.answer(held, csr, env.challenge(held, csr))
    env.refused(env.request(held, csr, rnd=1, answer=answer), "pool-attestor", to=env.tenant)
    env.sql(
        "UPDATE pools SET policy = ? WHERE id = ?",
        (json.dumps({"joinAttestors": ["join-token", "x509pop"]}), env.pool),
    )
    body, _ = env.rejoin(held)
    assert body["node_id"] == held.node_id


def test_refused_a_used_challenge(env: Env, clock: ManualClock) -> None:
    held = env.token_join(17)
    csr = bpki.make_csr(bpki.generate_key())
    answer = env.answer(held, csr, env.challenge(held, csr))
    assert env.send(env.request(held, csr, rnd=1, answer=answer))["kind"] == "joined"
    clock.advance(600_001)  # not a lost answer any more
    env.refused(env.request(held, csr, rnd=1, answer=answer), "challenge-used")


def test_refused_an_expired_challenge(env: Env, clock: ManualClock) -> None:
    held = env.token_join(18)
    csr = bpki.make_csr(bpki.generate_key())
    answer = env.answer(held, csr, env.challenge(held, csr))
    clock.advance(60_001)  # a challenge lasts a minute
    env.refused(env.request(held, csr, rnd=1, answer=answer), "challenge-expired")


def test_refused_an_answer_for_another_csr(env: Env) -> None:
    held = env.token_join(19)
    csr = bpki.make_csr(bpki.generate_key())
    other_csr = bpki.make_csr(bpki.generate_key())
    challenge = env.challenge(held, csr)
    answer = env.answer(held, other_csr, challenge)  # signed over the other CSR
    env.refused(env.request(held, other_csr, rnd=1, answer=answer), "challenge-csr")


def test_refused_an_unknown_challenge_or_one_for_another_leaf(env: Env) -> None:
    held = env.token_join(20)
    other = env.token_join(21)
    csr = bpki.make_csr(bpki.generate_key())
    answer = env.answer(held, csr, env.challenge(held, csr))
    bogus = {**answer, "id": "jc_" + "0" * 26}
    env.refused(env.request(held, csr, rnd=1, answer=bogus), "challenge-unknown")
    signed_by_other = env.answer(other, csr, {"challenge": json.loads(json.dumps(answer))})
    env.refused(env.request(other, csr, rnd=1, answer=signed_by_other), "challenge-unknown")


def test_refused_a_proof_by_another_key_or_for_another_nonce(env: Env) -> None:
    held = env.token_join(22)
    csr = bpki.make_csr(bpki.generate_key())
    challenge = env.challenge(held, csr)
    impostor = Held(bpki.generate_key(), held.chain_pem, held.node_id)
    wrong_key = env.answer(impostor, csr, challenge)
    env.refused(env.request(held, csr, rnd=1, answer=wrong_key), "pop-invalid")
    right = env.answer(held, csr, challenge)
    wrong_nonce = {**right, "nonce": base64.b64encode(b"\x01" * 32).decode()}
    env.refused(env.request(held, csr, rnd=1, answer=wrong_nonce), "pop-invalid")
    # the failed proofs did not spend the challenge: the holder of the key still can
    assert env.send(env.request(held, csr, rnd=1, answer=right))["kind"] == "joined"


def test_a_refusal_after_the_proof_goes_to_the_nodes_tenant(env: Env) -> None:
    held = env.token_join(23)
    csr = bpki.make_csr(bpki.generate_key())
    answer = env.answer(held, csr, env.challenge(held, csr))
    env.sql("UPDATE nodes SET retired_at = 1")
    env.refused(env.request(held, csr, rnd=1, answer=answer), "node-retired", to=env.tenant)


def test_an_old_key_held_in_the_tpm_proves_possession_through_the_tpm(
    env: Env, swtpm: Any, tmp_path: Path
) -> None:
    """A node whose (statement-free) key lives in the TPM: bcd.rejoin signs through it."""
    from bcd.config import parse_config
    from bcd.identity import LoadedTpmState, make_identity
    from bcd.rejoin import _signer
    from tests.world.joins import tpm_key

    held_key = tpm_key(swtpm.tcti)
    held = env.token_join(24, expired_ago=DAY, csr_der=held_key.csr_der)
    leaf = bpki.load_pem_chain(held.chain_pem)[0]
    assert bpki.same_public_key(leaf.public_key(), held_key.public_key)  # type: ignore[arg-type]
    identity = make_identity(
        chain=held.chain_pem,
        bundle="",
        trust_version=1,
        server_time="2026-01-01T00:00:00Z",
        key="tpm",
        identity_generation=1,
    )
    state = LoadedTpmState(
        tmp_path,
        identity,
        held_key.key_record,
        held_key.public_key,
        leaf,
        bpki.leaf_info(leaf),
    )
    pins = "".join(
        f'{k} = "{bpki.spki_pin(bpki.generate_key().public_key())}"\n'
        for k in ("serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin")
    )
    cfg = parse_config(
        f'gateway_url = "https://127.0.0.1:1"\nsite = "{env.site}"\n{pins}'
        f'[tpm]\nmode = "auto"\ntcti = "{swtpm.tcti}"\n',
        tmp_path / "config.toml",
    )
    signer = _signer(cfg, state)
    new_key = bpki.generate_key()
    csr = bpki.make_csr(new_key)
    challenge = env.challenge(held, csr)
    ctx = dataclasses.replace(env.node_ctx(held, csr), identity_signer=signer)
    answer = PLUGINS.node_answer("x509pop", challenge["challenge"], ctx)
    assert answer is not None
    body = env.send(env.request(held, csr, rnd=1, answer=answer))
    assert (body["node_id"], body["identity_generation"]) == (held.node_id, 2)
