"""The tpm attestor in process: JoinService on the real store, the node half on the
session's swtpm, and crafted answers for each refusal."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

from bcd import pki as bpki
from bcd.tpm.ak import certify
from bcd.tpm.attestation import ak_statement
from bcd.tpm.device import open_tpm
from bcd.tpm.nodekey import public_key_of
from bcd.tpm.structures import name_of
from bcd.tpm.templates import node_key_public_area
from control.clock import ManualClock
from control.joinservice import JoinService
from tests.swtpm import SwTpm
from tests.world import other_ca_bundle
from tests.world.joins import PLUGINS, TpmWorld, tpm_key


def test_the_name_of_a_csr_key_is_the_tpm_name(swtpm: SwTpm) -> None:
    key = tpm_key(swtpm.tcti)
    record = key.key_record
    with open_tpm(swtpm.tcti) as t:
        derived = public_key_of(t, record)
    csr_key = bpki.csr_public_key(bpki.parse_csr(key.csr_der))
    assert node_key_public_area(csr_key) == derived.public_area
    assert name_of(node_key_public_area(csr_key)) == derived.name


def test_a_tpm_join_answers_a_challenge_then_admits(tw: TpmWorld, clock: ManualClock) -> None:
    key = tpm_key(tw.swtpm.tcti)
    challenge = tw.challenge(key)
    assert challenge["attestor"] == "tpm"
    assert challenge["round"] == 1
    now_ms = datetime.now(UTC).timestamp() * 1000
    assert now_ms + 50_000 < challenge["not_after"] <= now_ms + 61_000
    assert set(challenge["challenge"]) == {"id", "credential_blob", "encrypted_secret"}
    (row,) = tw.rows("SELECT * FROM join_challenges")
    assert row["used_at"] is None
    assert row["csr_sha256"] == bpki.sha256_hex(key.csr_der)
    assert tw.rows("SELECT id FROM nodes") == []  # nothing issued

    answer = tw.answer(key, challenge)
    body = tw.send(tw.request(key, 1, answer))

    assert body["kind"] == "joined"
    leaf = bpki.load_pem_chain(body["chain"])[0]
    statements = bpki.leaf_info(leaf).statements
    assert len(statements) == 1
    assert statements[0].startswith("urn:bc:tpm-ak:sha256:")
    (node,) = tw.rows("SELECT * FROM nodes")
    ek_hex = hashlib.sha256(
        base64.b64decode(json.loads(tw.request(key))["evidence"]["ek_public"])
    ).hexdigest()
    assert (node["hardware_key"], node["hardware_key_trusted"]) == (ek_hex, 1)
    assert (node["tenant_id"], node["pool_id"], node["attestor"]) == (tw.tenant, tw.pool, "tpm")
    (joined,) = tw.rows("SELECT payload FROM events WHERE type = 'node.joined'")
    assert json.loads(joined["payload"])["nodeKey"] == "tpm"
    # the same answer again (its answer lost) gets the same identity, spending nothing
    again = tw.send(tw.request(key, 1, answer))
    assert (again["node_id"], again["chain"]) == (body["node_id"], body["chain"])
    # once that is no longer a lost answer, the spent challenge refuses it
    clock.advance(600_001)
    tw.refused(tw.request(key, 1, answer), "challenge-used")


def test_a_wrong_secret_is_refused(tw: TpmWorld) -> None:
    key = tpm_key(tw.swtpm.tcti)
    answer = tw.answer(key, tw.challenge(key))
    wrong = answer | {"secret": base64.b64encode(b"\0" * 32).decode()}
    tw.refused(tw.request(key, 1, wrong), "activation")
    tw.refused(tw.request(key, 1, answer | {"id": "jc_unknown"}), "activation")


def test_an_expired_challenge_is_refused(tw: TpmWorld, clock: ManualClock) -> None:
    key = tpm_key(tw.swtpm.tcti)
    answer = tw.answer(key, tw.challenge(key))
    clock.advance(60_001)  # a challenge lasts a minute
    tw.refused(tw.request(key, 1, answer), "challenge-expired")


def test_a_certify_of_another_key_is_refused(tw: TpmWorld) -> None:
    key = tpm_key(tw.swtpm.tcti)
    challenge = tw.challenge(key)
    answer = tw.answer(key, challenge)
    # the AK certifies another TPM key over the same CSR digest
    other = tpm_key(tw.swtpm.tcti).key_record
    with open_tpm(tw.swtpm.tcti) as t:
        attest, sig = certify(t, other, hashlib.sha256(key.csr_der).digest())
    crafted = answer | {
        "certify_attest": base64.b64encode(attest).decode(),
        "certify_sig": base64.b64encode(sig).decode(),
    }
    tw.refused(tw.request(key, 1, crafted), "certify")
    # and the genuine answer presented with another CSR is not this challenge's
    second = tpm_key(tw.swtpm.tcti)
    tw.refused(tw.request(second, 1, answer), "challenge-csr")


def test_ek_trust_refusals(tw: TpmWorld, tmp_path: Path) -> None:
    key = tpm_key(tw.swtpm.tcti)
    other = str(other_ca_bundle(tmp_path / "other.pem"))
    tw.svc = tw.with_settings(**{"tpm.ek_ca": other})
    tw.refused(tw.request(key), "ek-chain")
    allow = tmp_path / "allow"
    allow.write_text("# nobody\n" + "ab" * 32 + "\n")
    tw.svc = tw.with_settings(**{"tpm.ek_allow": str(allow)})
    tw.refused(tw.request(key), "ek-unknown")
    # an EK on the allow-list needs no chain
    ek = base64.b64decode(json.loads(tw.request(key))["evidence"]["ek_public"])
    allow.write_text(hashlib.sha256(ek).hexdigest().upper() + "  # this machine\n")
    assert tw.send(tw.request(key))["kind"] == "challenge"
    # a certificate that names another key than the EK does not chain it
    tw.svc = tw.with_settings(**{"tpm.ek_ca": str(tw.swtpm.ca_bundle)})
    forged = tw.request(key, ek_public=json.loads(tw.request(key))["evidence"]["ak_public"])
    tw.refused(forged, "evidence-malformed")
    tw.svc = JoinService(tw.store, tw.svc.crypto, PLUGINS, {})
    tw.refused(tw.request(key), "not-configured")


def test_ak_statement_format() -> None:
    name = b"\x00\x0b" + bytes(range(32))
    assert ak_statement(name) == "urn:bc:tpm-ak:sha256:" + bytes(range(32)).hex()


def test_reclaim_needs_the_same_ak(tw: TpmWorld) -> None:
    key = tpm_key(tw.swtpm.tcti)
    body = tw.send(tw.request(key, 1, tw.answer(key, tw.challenge(key))))
    node_id = body["node_id"]
    # the node's certificate names another AK: the same EK does not reclaim it
    with tw.store.tx() as tx:
        tx.execute("UPDATE node_certs SET statements = ?", (json.dumps(["urn:bc:tpm-ak:x"]),))
    again = tpm_key(tw.swtpm.tcti)
    tw.refused(tw.request(again, 1, tw.answer(again, tw.challenge(again))), "reclaim")
    with tw.store.tx() as tx:
        tx.execute(
            "UPDATE node_certs SET statements = ?",
            (json.dumps(list(bpki.leaf_info(bpki.load_pem_chain(body["chain"])[0]).statements)),),
        )
    third = tpm_key(tw.swtpm.tcti)
    reclaimed = tw.send(tw.request(third, 1, tw.answer(third, tw.challenge(third))))
    assert reclaimed["node_id"] == node_id
    assert reclaimed["identity_generation"] == 2
