"""JoinService.Join in process: the real store (SQLite and PostgreSQL), real crypto.

Bodies are built the way ``bcd join`` builds them: a fresh P-256 key and CSR, the
hardware claims, the token sealed to the JoinService encryption key and bound to
the CSR. Every refusal must look the same to the caller (ACCESS_DENIED / "Join
refused"), leave the token and the nodes untouched, and leave its reason only in a
``security.join.refused`` event routed as the seed says.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder
from cryptography.x509.verification import Store as TrustStore

from bcd import pki as bpki
from bcd import wire
from bcd.wire import Claims
from control import tenancy, tokens
from control.clock import ManualClock
from control.errors import ControlError, Refused
from control.ids import new_id, new_secret
from control.joinservice import JoinService
from tests.world.joins import (
    PLACEHOLDER_CLAIMS,
    PLUGINS,
    ROOT_ONLY,
    TENANT,
    Attempt,
    World,
    machine,
)


def token_id(token: str) -> str:
    return wire.parse_token(token).token_id


def leaf_of(body: dict[str, Any]) -> x509.Certificate:
    return bpki.load_pem_chain(body["chain"])[0]


# --- a successful join --------------------------------------------------------------


def test_join_with_a_token_admits_the_node_in_adopting(world: World) -> None:
    token = world.mint(max_uses=2)
    attempt = world.body(token, machine(1))
    body = world.join(attempt)

    assert body["kind"] == "joined"
    node_id = body["node_id"]
    assert node_id.startswith("node_")
    assert body["site_id"] == world.site
    assert body["role"] == "node"
    assert body["trust_domain"] == world.pki.trust_domain
    assert body["csr_sha256"] == bpki.sha256_hex(attempt.csr_der)
    assert body["bundle"] == world.pki.bundle_pem()
    assert body["trust_version"] == world.pki.trust_version
    assert abs(body["server_time"] - time.time() * 1000) < 60_000

    (node,) = world.rows("SELECT * FROM nodes")
    assert node["id"] == node_id
    assert node["state"] == "adopting"
    assert node["identity_generation"] == 1
    assert (node["tenant_id"], node["site_id"], node["pool_id"], node["role"]) == (
        world.tenant,
        world.site,
        world.pool,
        "node",
    )
    assert node["attestor"] == "join-token"
    assert node["hardware_key_trusted"] == 1
    assert node["retired_at"] is None

    (uses,) = world.rows("SELECT uses_left FROM join_tokens")
    assert uses["uses_left"] == 1

    leaf = leaf_of(body)
    (cert,) = world.rows("SELECT * FROM node_certs")
    assert base64.b64decode(cert["der"]) == leaf.public_bytes(serialization.Encoding.DER)
    assert cert["serial"] == format(leaf.serial_number, "x")
    assert cert["node_id"] == node_id
    assert cert["identity_generation"] == 1
    assert cert["role"] == "node"
    assert cert["revoked_at"] is None
    assert cert["spki_sha256"] == bpki.sha256_hex(bpki.spki_der(attempt.key.public_key()))

    (joined,) = world.events(world.tenant, "node.joined")
    assert joined["payload"] == {
        "nodeId": node_id,
        "attestor": "join-token",
        "reclaim": False,
        "hardwareKeyTrusted": True,
        "certSerial": cert["serial"],
        "nodeKey": "unattested",
        "poolId": world.pool,
        "siteId": world.site,
    }
    (audit,) = world.rows("SELECT * FROM audit")
    assert (audit["tenant_id"], audit["action"], audit["subject"]) == (
        world.tenant,
        "node.joined",
        node_id,
    )
    assert json.loads(audit["payload"]) == joined["payload"]
    assert world.events(world.tenant, "security.join.refused") == []
    assert world.events(world.root, "node.joined") == []


def test_node_certificate_is_a_spiffe_client_leaf_of_at_most_24_hours(world: World) -> None:
    attempt = world.body(world.mint(), machine(2))
    body = world.join(attempt)
    chain = bpki.load_pem_chain(body["chain"])
    leaf = chain[0]

    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    assert uris == [f"spiffe://td.example/site/{world.site}/node/{body['node_id']}"]
    assert san.get_values_for_type(x509.DNSName) == []
    assert leaf.subject == x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "bc-role:node")]
    )
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= timedelta(hours=24)
    assert leaf.not_valid_before_utc.timestamp() <= time.time() + 5
    leaf_key = leaf.public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
    assert bpki.same_public_key(bpki.csr_public_key(bpki.parse_csr(attempt.csr_der)), leaf_key)
    constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca is False
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature
    assert not usage.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]

    info = bpki.leaf_info(leaf)
    assert (info.role, info.statements) == ("node", ())
    assert info.spiffe == bpki.SpiffeId("td.example", world.site, body["node_id"])

    assert chain[1:] == [world.pki.node_ca, world.pki.node_root_ca]
    verifier = PolicyBuilder().store(TrustStore([world.pki.node_root_ca])).build_client_verifier()
    assert verifier.verify(leaf, chain[1:]).chain[-1] == world.pki.node_root_ca


def test_expect_match_admits(world: World) -> None:
    token = world.mint(expect={"serial": "sn-0003", "mac": "00-1B-21-00-03-5E"})
    body = world.join(world.body(token, machine(3)))
    assert body["kind"] == "joined"


def test_serial_expect_matches_the_board_or_chassis_serial(world: World) -> None:
    token = world.mint(expect={"serial": "BOARD-77"})
    claims = machine(4, board_serial="board-77")
    assert world.join(world.body(token, claims))["kind"] == "joined"


def test_placeholder_hardware_with_an_expect_binding_joins_with_an_untrusted_key(
    world: World,
) -> None:
    claims = Claims(
        product_uuid="FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
        product_serial="To Be Filled By O.E.M.",
        board_serial="Default string",
        macs=("00:1b:21:aa:bb:cc", "02:00:00:00:00:01"),
    )
    token = world.mint(expect={"mac": "00-1B-21-AA-BB-CC"})
    body = world.join(world.body(token, claims))
    (node,) = world.rows("SELECT * FROM nodes")
    assert node["id"] == body["node_id"]
    assert node["hardware_key_trusted"] == 0
    (joined,) = world.events(world.tenant, "node.joined")
    assert joined["payload"]["hardwareKeyTrusted"] is False


def test_a_machine_with_fewer_than_two_identifiers_never_reclaims(world: World) -> None:
    claims = Claims(product_serial="ONLY-SERIAL-1")
    first = world.join(world.body(world.mint(expect={"serial": "ONLY-SERIAL-1"}), claims))
    second = world.join(world.body(world.mint(expect={"serial": "ONLY-SERIAL-1"}), claims))
    assert first["node_id"] != second["node_id"]
    assert len(world.rows("SELECT id FROM nodes")) == 2


def test_reclaim_with_an_allow_reclaim_token_keeps_the_node_and_revokes_older_certs(
    world: World,
) -> None:
    first = world.join(world.body(world.mint(), machine(5)))
    old_serial = format(leaf_of(first).serial_number, "x")

    reclaim_token = world.mint(allow_reclaim=True)
    again = world.body(reclaim_token, machine(5, boot_id=str(uuid.uuid4())))
    second = world.join(again)

    assert second["node_id"] == first["node_id"]
    assert second["identity_generation"] == 2
    (node,) = world.rows("SELECT * FROM nodes")
    assert node["identity_generation"] == 2
    assert node["state"] == "adopting"
    new_serial = format(leaf_of(second).serial_number, "x")
    certs = {r["serial"]: r for r in world.rows("SELECT * FROM node_certs")}
    assert set(certs) == {old_serial, new_serial}
    assert certs[old_serial]["revoked_at"] is not None
    assert certs[old_serial]["revoke_reason"] == "reclaimed"
    assert certs[new_serial]["revoked_at"] is None
    assert certs[new_serial]["identity_generation"] == 2

    (revoked,) = world.events(world.tenant, "security.certificate-revoked")
    assert revoked["payload"] == {
        "nodeId": first["node_id"],
        "serial": old_serial,
        "reason": "reclaimed",
    }
    joined = {
        e["payload"]["reclaim"]: e["payload"] for e in world.events(world.tenant, "node.joined")
    }
    assert set(joined) == {False, True}
    assert joined[False]["certSerial"] == old_serial
    assert joined[True]["certSerial"] == new_serial
    assert joined[True]["nodeId"] == first["node_id"]
    actions = [r["action"] for r in world.rows("SELECT action FROM audit ORDER BY created_at, id")]
    assert sorted(actions) == ["node.joined", "node.reclaimed"]
    (uses,) = world.rows(
        "SELECT uses_left FROM join_tokens WHERE id = ?", (token_id(reclaim_token),)
    )
    assert uses["uses_left"] == 0


def test_reclaim_may_name_its_own_node_id(world: World) -> None:
    first = world.join(world.body(world.mint(), machine(6)))
    again = world.body(world.mint(allow_reclaim=True), machine(6), node_id=first["node_id"])
    assert world.join(again)["node_id"] == first["node_id"]


def test_reclaim_through_a_hosted_token_lowers_the_node_to_node_tenant(world: World) -> None:
    first = world.join(world.body(world.mint(), machine(12)))
    assert first["role"] == "node"
    token = world.mint(allow_reclaim=True, hosted="kubernetes")
    second = world.join(world.body(token, machine(12)))
    assert (second["node_id"], second["role"]) == (first["node_id"], "node-tenant")
    (node,) = world.rows("SELECT role, identity_generation FROM nodes")
    assert (node["role"], node["identity_generation"]) == ("node-tenant", 2)


def test_join_refused_reclaim_of_a_retired_node(world: World) -> None:
    world.join(world.body(world.mint(), machine(13)))
    world.sql("UPDATE nodes SET retired_at = updated_at")
    token = world.mint(allow_reclaim=True)
    world.refused(world.body(token, machine(13)), "reclaim", routed_to=TENANT)


def test_hosted_token_gives_role_node_tenant(world: World) -> None:
    body = world.join(world.body(world.mint(hosted="kubernetes"), machine(7)))
    assert body["role"] == "node-tenant"
    assert bpki.leaf_info(leaf_of(body)).role == "node-tenant"
    (node,) = world.rows("SELECT role FROM nodes")
    assert node["role"] == "node-tenant"
    (cert,) = world.rows("SELECT role FROM node_certs")
    assert cert["role"] == "node-tenant"


def test_hosted_token_in_a_tenant_pool_stays_node_tenant_even_when_platform_operated(
    world: World,
) -> None:
    pool = world.pool_in(
        world.tenant, world.site, policy={"kubernetes": {"platformOperated": True}}
    )
    body = world.join(world.body(world.mint(pool=pool, hosted="kubernetes"), machine(8)))
    assert body["role"] == "node-tenant"


def test_hosted_token_in_a_platform_operated_platform_pool_gives_role_node(world: World) -> None:
    with world.store.tx() as tx:
        site = tenancy.create_site(tx, world.root, "platform-dc")["id"]
    pool = world.pool_in(world.root, site, policy={"kubernetes": {"platformOperated": True}})
    token = world.mint(tenant=world.root, pool=pool, hosted="kubernetes")
    assert world.join(world.body(token, machine(9)))["role"] == "node"


def test_site_token_admits_a_site_agent(world: World) -> None:
    with world.store.tx() as tx:
        site = tenancy.create_site(tx, world.root, "platform-dc")["id"]
    pool = world.pool_in(world.root, site)
    token = world.mint(tenant=world.root, pool=pool, role="site")
    body = world.join(world.body(token, machine(10), role="site"))
    assert body["role"] == "site"
    assert bpki.leaf_info(leaf_of(body)).role == "site"


def test_ramdisk_certificate_lives_at_most_two_hours(world: World) -> None:
    with world.store.tx() as tx:
        site = tenancy.create_site(tx, world.root, "platform-dc")["id"]
    pool = world.pool_in(world.root, site)
    token = world.mint(tenant=world.root, pool=pool, role="ramdisk")
    leaf = leaf_of(world.join(world.body(token, machine(11), role="ramdisk")))
    assert bpki.leaf_info(leaf).role == "ramdisk"
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= timedelta(hours=2)


# --- every refusal reason -------------------------------------------------------


def test_join_refused_token_malformed_without_a_sealed_token(world: World) -> None:
    world.mint()
    world.refused(
        world.body(None, machine(20), sealed=None), "token-malformed", routed_to=ROOT_ONLY
    )


def test_join_refused_token_unknown(world: World) -> None:
    world.mint()
    token = f"bcjt_{new_id('jt')}.{new_secret()}"
    world.refused(world.body(token, machine(21)), "token-unknown", routed_to=ROOT_ONLY)


def test_join_refused_token_secret(world: World) -> None:
    token = world.mint()
    forged = f"bcjt_{token_id(token)}.{new_secret()}"
    world.refused(world.body(forged, machine(22)), "token-secret", routed_to=ROOT_ONLY)


def test_join_refused_token_revoked(world: World) -> None:
    token = world.mint()
    with world.store.tx() as tx:
        tokens.revoke(tx, world.tenant, world.pool, token_id(token))
    world.refused(world.body(token, machine(23)), "token-revoked", routed_to=TENANT)


def test_join_refused_token_expired(world: World, clock: ManualClock) -> None:
    token = world.mint()  # for an hour
    clock.advance(3_600_001)
    attempt = world.body(token, machine(24), iat=clock.now_ms() // 1000)
    world.refused(attempt, "token-expired", routed_to=TENANT)


def test_join_refused_token_used_up(world: World) -> None:
    token = world.mint(max_uses=1)
    world.join(world.body(token, machine(25)))
    world.refused(world.body(token, machine(26)), "token-used-up", routed_to=TENANT)


def test_join_refused_token_role(world: World) -> None:
    token = world.mint()
    world.refused(world.body(token, machine(27), role="site"), "token-role", routed_to=TENANT)


@pytest.mark.parametrize("how", ["garbage", "wrong-key", "not-a-token-inside"])
def test_join_refused_seal_invalid(world: World, how: str) -> None:
    token = world.mint()
    key = bpki.generate_key()
    csr = bpki.make_csr(key)
    if how == "garbage":
        sealed = "a.b.c.d.e"
    elif how == "wrong-key":
        other = bpki.generate_key().public_key()
        sealed = wire.seal_token(wire.parse_token(token), other, csr, int(time.time()))
    else:
        sealed = wire.seal_token(
            wire.JoinToken("jt_not-a-real-id", "x"), world.enc, csr, int(time.time())
        )
    attempt = world.body(None, machine(28), key=key, csr_der=csr, sealed=sealed)
    # a seal that opens but holds no token is the token's fault, not the seal's
    reason = "token-malformed" if how == "not-a-token-inside" else "seal-invalid"
    world.refused(attempt, reason, routed_to=ROOT_ONLY)


def test_join_refused_seal_csr_for_a_seal_made_for_another_csr(world: World) -> None:
    token = world.mint()
    other_csr = bpki.make_csr(bpki.generate_key())
    attempt = world.body(token, machine(29), seal_csr_der=other_csr)
    world.refused(attempt, "seal-csr", routed_to=ROOT_ONLY)


@pytest.mark.parametrize("offset_s", [-600, 600])
def test_join_refused_seal_stale(world: World, offset_s: int) -> None:
    token = world.mint()
    attempt = world.body(token, machine(30), iat=int(time.time()) + offset_s)
    world.refused(attempt, "seal-stale", routed_to=ROOT_ONLY)


def test_join_refused_expect_mismatch_consumes_nothing(world: World) -> None:
    token = world.mint(expect={"serial": "SN-7701"})
    world.refused(world.body(token, machine(31)), "expect-mismatch", routed_to=TENANT)
    (row,) = world.rows("SELECT uses_left FROM join_tokens")
    assert row["uses_left"] == 1
    # the token still admits the machine it names
    world.join(world.body(token, machine(31, product_serial="SN-7701")))


@pytest.mark.parametrize(
    "claims",
    [
        PLACEHOLDER_CLAIMS,
        # one identifier kind survives: an untrusted key
        Claims(product_serial="To Be Filled By O.E.M.", macs=("00:1b:21:aa:bb:01",)),
        # two kinds, but neither a product UUID nor a serial
        Claims(
            product_serial="Not Specified",
            macs=("00:1b:21:aa:bb:02",),
            gpu_uuids=("GPU-8c6a3e5f-6ad0-4a48-8d5b-1a2b3c4d5e6f",),
        ),
    ],
    ids=["placeholders-only", "one-kind", "no-uuid-or-serial"],
)
def test_join_refused_placeholder_hardware_without_expect(world: World, claims: Claims) -> None:
    token = world.mint()
    world.refused(world.body(token, claims), "placeholder-hardware", routed_to=TENANT)


def test_join_refused_reclaim_without_allow_reclaim(world: World) -> None:
    first = world.join(world.body(world.mint(), machine(32)))
    second_token = world.mint(max_uses=3)
    world.refused(world.body(second_token, machine(32)), "reclaim", routed_to=TENANT)
    (node,) = world.rows("SELECT id, identity_generation FROM nodes")
    assert (node["id"], node["identity_generation"]) == (first["node_id"], 1)


def test_join_refused_reclaim_from_another_pool(world: World) -> None:
    world.join(world.body(world.mint(), machine(33)))
    other_pool = world.pool_in(world.tenant, world.site)
    token = world.mint(pool=other_pool, allow_reclaim=True)
    world.refused(world.body(token, machine(33)), "reclaim", routed_to=TENANT)


def test_join_refused_pool_agent(world: World) -> None:
    token = world.mint()
    world.sql("UPDATE pools SET agent = 'none' WHERE id = ?", (world.pool,))
    world.refused(world.body(token, machine(34)), "pool-agent", routed_to=TENANT)


def test_join_refused_pool_tenant(world: World) -> None:
    token = world.mint()
    world.sql("UPDATE pools SET tenant_id = ? WHERE id = ?", (world.root, world.pool))
    world.refused(world.body(token, machine(35)), "pool-tenant", routed_to=TENANT)


def test_join_refused_pool_attestor(world: World) -> None:
    pool = world.pool_in(world.tenant, world.site, policy={"joinAttestors": ["tpm"]})
    token = world.mint(pool=pool)
    world.refused(world.body(token, machine(36)), "pool-attestor", routed_to=TENANT)


def test_pool_attestor_listing_join_token_admits(world: World) -> None:
    pool = world.pool_in(world.tenant, world.site, policy={"joinAttestors": ["tpm", "join-token"]})
    assert world.join(world.body(world.mint(pool=pool), machine(37)))["kind"] == "joined"


def _p384_csr() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = ec.generate_private_key(ec.SECP384R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.DER)


def _tampered_csr() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = bpki.generate_key()
    der = bytearray(bpki.make_csr(key))
    der[-1] ^= 0x01  # the last byte of the signature's s
    return key, bytes(der)


@pytest.mark.parametrize("make", [_p384_csr, _tampered_csr], ids=["p384", "tampered"])
def test_join_refused_csr_invalid(world: World, make: Any) -> None:
    key, csr = make()
    token = world.mint()
    attempt = world.body(token, machine(38), key=key, csr_der=csr)
    world.refused(attempt, "csr-invalid", routed_to=TENANT)


def test_join_refused_node_id_for_a_new_machine(world: World) -> None:
    token = world.mint()
    attempt = world.body(token, machine(39), node_id=new_id("node"))
    world.refused(attempt, "node-id", routed_to=TENANT)


def test_join_refused_node_id_of_another_node_on_reclaim(world: World) -> None:
    world.join(world.body(world.mint(), machine(40)))
    other = world.join(world.body(world.mint(), machine(41)))
    token = world.mint(allow_reclaim=True)
    attempt = world.body(token, machine(40), node_id=other["node_id"])
    world.refused(attempt, "node-id", routed_to=TENANT)


@pytest.mark.parametrize(
    "header",
    [
        # a kid holding a lone surrogate (once: pins_equal's str.encode raised)
        pytest.param(
            bpki.b64url(
                json.dumps(
                    {"typ": "bcjt+jwe", "alg": "ECDH-ES+A256KW", "enc": "A256GCM", "kid": "\ud800"}
                ).encode("ascii")
            ),
            id="kid-lone-surrogate",
        ),
        # a header nested deeper than the recursion limit
        pytest.param(bpki.b64url(b"[" * 6000), id="deeply-nested"),
    ],
)
def test_join_refused_seal_invalid_for_an_odd_protected_header(world: World, header: str) -> None:
    world.mint()
    sealed = header + ".a.b.c.d"
    assert len(sealed) <= 8192
    world.refused(world.body(None, machine(42), sealed=sealed), "seal-invalid", routed_to=ROOT_ONLY)


def test_join_refused_csr_invalid_for_an_unknown_key_algorithm(world: World) -> None:
    key = bpki.generate_key()
    ec_public_key_oid = bytes.fromhex("06072a8648ce3d0201")  # 1.2.840.10045.2.1
    csr = bpki.make_csr(key).replace(ec_public_key_oid, bytes.fromhex("06072a8648ce3d0209"))
    attempt = world.body(world.mint(), machine(43), key=key, csr_der=csr)
    world.refused(attempt, "csr-invalid", routed_to=TENANT)


def test_join_refused_csr_invalid_for_a_csr_of_an_unknown_version(world: World) -> None:
    key = bpki.generate_key()
    csr = bpki.make_csr(key).replace(b"\x02\x01\x00", b"\x02\x01\x01", 1)
    attempt = world.body(world.mint(), machine(45), key=key, csr_der=csr)
    world.refused(attempt, "csr-invalid", routed_to=TENANT)


def test_every_refusal_is_the_same_to_the_caller(world: World) -> None:
    token = world.mint(expect={"serial": "SN-7701"})
    attempts = [
        world.body(None, machine(44), sealed="a.b.c.d.e"),
        world.body(f"bcjt_{new_id('jt')}.{new_secret()}", machine(44)),
        world.body(f"bcjt_{token_id(token)}.{new_secret()}", machine(44)),
        world.body(token, machine(44)),
        world.body(token, machine(44), role="ramdisk"),
    ]
    seen = set()
    for attempt in attempts:
        with pytest.raises(Refused) as info:
            world.svc.join(attempt.body)
        seen.add((type(info.value), info.value.code, info.value.message, info.value.args))
    assert seen == {(Refused, "ACCESS_DENIED", "Join refused", ("Join refused",))}


# --- failures that are not refusals ------------------------------------------------


def test_missing_join_crypto_is_invalid_config(world: World) -> None:
    svc = JoinService(world.store, None, PLUGINS)
    attempt = world.body(world.mint(), machine(50))
    with pytest.raises(ControlError) as info:
        svc.join(attempt.body)
    assert not isinstance(info.value, Refused)
    assert info.value.code == "INVALID_CONFIG"
    assert world.rows("SELECT id FROM nodes") == []


def _valid_request(world: World) -> dict[str, Any]:
    return dict(json.loads(world.body(world.mint(), machine(51)).body))


def _malformed_bodies(req: dict[str, Any]) -> dict[str, bytes]:
    claims = req["claims"]
    return {
        "not-json": b"this is not JSON",
        "not-utf8": b"\xff\xfe{}",
        "empty": b"",
        "array": b"[]",
        "array-of-request": wire.dumps([req]),
        "string": wire.dumps("request"),
        "role-number": wire.dumps({**req, "role": 5}),
        "role-unknown": wire.dumps({**req, "role": "admin"}),
        "csr-number": wire.dumps({**req, "csr": 12}),
        "csr-not-base64": wire.dumps({**req, "csr": "not base64!"}),
        "sealed-list": wire.dumps({**req, "sealed_token": ["x"]}),
        "claims-list": wire.dumps({**req, "claims": ["x"]}),
        "macs-string": wire.dumps({**req, "claims": {**claims, "macs": "00:1b:21:00:00:01"}}),
        "serial-number": wire.dumps({**req, "claims": {**claims, "product_serial": 7701}}),
        "claims-unknown-field": wire.dumps({**req, "claims": {**claims, "extra": "x"}}),
        "evidence-list": wire.dumps({**req, "evidence": [1]}),
        "node-id-number": wire.dumps({**req, "node_id": 5}),
        "protocol-2": wire.dumps({**req, "protocol": 2}),
        "round-7": wire.dumps({**req, "round": 7}),
        "oversized": wire.dumps({**req, "padding": "x" * (64 * 1024)}),
        "missing-csr": wire.dumps({k: v for k, v in req.items() if k != "csr"}),
        "missing-role": wire.dumps({k: v for k, v in req.items() if k != "role"}),
    }


def test_malformed_body_is_invalid_argument_and_writes_nothing(world: World) -> None:
    bodies = _malformed_bodies(_valid_request(world))
    assert len(bodies["oversized"]) > 64 * 1024
    before = world.snapshot()
    before_events = world.rows("SELECT id FROM events ORDER BY id")
    for name, body in bodies.items():
        with pytest.raises(ControlError) as info:
            world.svc.join(body)
        assert not isinstance(info.value, Refused), name
        assert info.value.code == "INVALID_ARGUMENT", name
    assert world.snapshot() == before
    assert world.rows("SELECT id FROM events ORDER BY id") == before_events
    assert world.rows("SELECT * FROM refusal_windows") == []


def test_body_of_exactly_64_kib_is_still_parsed(world: World) -> None:
    request = _valid_request(world)
    request["evidence"] = {"pad": ""}
    size = len(wire.dumps(request))
    request["evidence"] = {"pad": "x" * (64 * 1024 - size)}
    body = wire.dumps(request)
    assert len(body) == 64 * 1024
    assert wire.verify_response(world.svc.join(body), world.signing_pin)["kind"] == "joined"


# --- refusal events: rate limit and routing ------------------------------------


def test_refusal_events_are_rate_limited_to_60_a_minute_with_suppressed_count(
    world: World, clock: ManualClock
) -> None:
    attempt = world.body(None, machine(60), sealed="a.b.c.d.e")
    for _ in range(65):
        with pytest.raises(Refused):
            world.svc.join(attempt.body)
    got = world.events(world.root, "security.join.refused")
    assert len(got) == 60
    assert {e["payload"]["suppressed"] for e in got} == {0}
    assert {e["payload"]["reason"] for e in got} == {"join-token:seal-invalid"}

    # another reason has its own budget
    other = world.body(f"bcjt_{new_id('jt')}.{new_secret()}", machine(60))
    with pytest.raises(Refused):
        world.svc.join(other.body)
    assert len(world.events(world.root, "security.join.refused")) == 61

    clock.advance(61_000)  # the minute's window is over

    def suppressed_counts() -> list[int]:
        got = world.events(world.root, "security.join.refused")
        return sorted(
            e["payload"]["suppressed"]
            for e in got
            if e["payload"]["reason"] == "join-token:seal-invalid"
        )

    with pytest.raises(Refused):
        world.svc.join(attempt.body)
    assert suppressed_counts() == [0] * 60 + [5]
    with pytest.raises(Refused):
        world.svc.join(attempt.body)
    assert suppressed_counts() == [0] * 61 + [5]


def test_refusal_event_carries_hashes_never_the_token(world: World) -> None:
    token = world.mint(expect={"serial": "SN-7701"})
    attempt = world.body(token, machine(61))
    with pytest.raises(Refused):
        world.svc.join(attempt.body)
    (event,) = world.events(world.tenant, "security.join.refused")
    text = json.dumps(event)
    secret = token.split(".", 1)[1]
    assert secret not in text
    assert json.loads(attempt.body)["sealed_token"] not in text
    assert event["payload"]["hardwareKey"] is not None
    assert len(event["payload"]["hardwareKey"]) == 64


# --- concurrency ----------------------------------------------------------------


def test_twenty_concurrent_joins_on_a_five_use_token_admit_exactly_five(world: World) -> None:
    token = world.mint(max_uses=5)
    attempts = [world.body(token, machine(100 + i)) for i in range(20)]
    barrier = threading.Barrier(len(attempts))
    results: list[object] = [None] * len(attempts)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = world.svc.join(attempts[i].body)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(attempts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)

    admitted = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, Refused)]
    assert len(admitted) == 5, results
    assert len(refused) == 15, results
    assert {r.reason for r in refused} == {"join-token:token-used-up"}
    node_ids = {wire.verify_response(r, world.signing_pin)["node_id"] for r in admitted}
    assert len(node_ids) == 5
    assert {r["id"] for r in world.rows("SELECT id FROM nodes")} == node_ids
    (row,) = world.rows("SELECT uses_left FROM join_tokens")
    assert row["uses_left"] == 0
    assert len(world.events(world.tenant, "node.joined")) == 5
    reasons = [e["payload"]["reason"] for e in world.events(world.tenant, "security.join.refused")]
    assert reasons == ["join-token:token-used-up"] * 15


# --- a join whose answer was lost ------------------------------------------------------


def test_a_join_asked_again_with_the_same_csr_gets_the_same_identity_and_spends_nothing(
    world: World,
) -> None:
    token = world.mint(max_uses=1)
    attempt = world.body(token, machine(71))
    first = world.join(attempt)
    before = world.snapshot()

    again = world.join(attempt)  # the answer was lost; bcd sends the same request

    assert again["kind"] == "joined"
    assert (again["node_id"], again["identity_generation"]) == (first["node_id"], 1)
    assert leaf_of(again).serial_number == leaf_of(first).serial_number
    assert again["csr_sha256"] == bpki.sha256_hex(attempt.csr_der)
    assert world.snapshot() == before  # nothing issued, nothing consumed, no event


def test_no_second_answer_once_the_certificate_is_revoked_or_old(
    world: World, clock: ManualClock
) -> None:
    token = world.mint(max_uses=1)
    attempt = world.body(token, machine(72))
    world.join(attempt)
    clock.advance(600_001)  # the same CSR, sealed again now: no longer a lost answer
    later = world.body(
        token, machine(72), key=attempt.key, csr_der=attempt.csr_der, iat=clock.now_ms() // 1000
    )
    world.refused(later, "token-used-up", routed_to=TENANT)
    clock.advance(-600_001)  # back within the window, but the certificate is revoked
    world.sql("UPDATE node_certs SET revoked_at = 1")
    world.refused(attempt, "token-used-up", routed_to=TENANT)


def test_invented_attestor_names_share_one_refusal_budget_and_are_never_written(
    world: World,
) -> None:
    base = json.loads(world.body(None, machine(61), sealed="a.b.c.d.e").body)
    for i in range(80):
        with pytest.raises(Refused) as refused:
            world.svc.join(wire.dumps({**base, "attestor": f"made-up-{i}"}))
        assert refused.value.reason == "unknown:seal-invalid"
    got = world.events(world.root, "security.join.refused")
    assert len(got) == 60
    assert {e["payload"]["attestor"] for e in got} == {"unknown"}
    assert not any("made-up" in json.dumps(e) for e in got)
    rows = world.rows("SELECT rate_key FROM refusal_windows")
    assert [r["rate_key"] for r in rows] == [f"{world.root}|join|unknown:seal-invalid"]


def _sealed_plaintext(world: World, plaintext: str) -> Attempt:
    """A join whose seal (made for this JoinService, bound to its CSR) holds ``plaintext``."""
    key = bpki.generate_key()
    csr = bpki.make_csr(key)
    header = {
        "alg": "ECDH-ES+A256KW", "enc": "A256GCM", "typ": wire.SEAL_TYP,
        "kid": bpki.spki_pin(world.enc), "iat": int(time.time()), "csr": bpki.sha256_hex(csr),
    }  # fmt: skip
    from jwcrypto import jwe, jwk

    token_jwe = jwe.JWE(plaintext.encode(), protected=json.dumps(header))
    token_jwe.add_recipient(jwk.JWK(**wire.public_jwk_of(world.enc)))
    return world.body(None, machine(70), key=key, csr_der=csr,
                      sealed=token_jwe.serialize(compact=True))  # fmt: skip


def test_a_bearer_built_from_a_database_dump_is_refused_token_secret(world: World) -> None:
    token = world.mint()
    stored = world.rows("SELECT secret_sha256 FROM join_tokens")[0]["secret_sha256"]
    attempt = _sealed_plaintext(world, f"bcjt_{token_id(token)}.{stored}")
    world.refused(attempt, "token-secret", routed_to=ROOT_ONLY)


def test_a_seal_holding_no_token_is_refused_token_malformed(world: World) -> None:
    world.refused(_sealed_plaintext(world, "hello, world"), "token-malformed", routed_to=ROOT_ONLY)


def test_mac_and_gpu_only_with_an_expect_binding_joins_with_an_untrusted_key(
    world: World,
) -> None:
    claims = Claims(
        macs=("00:1b:21:aa:bb:dd",),
        gpu_uuids=("GPU-3b1e3c4e-7f9a-4a33-9d2e-5c1b8a7e6f10",),
        hostname="gpu-box",
    )
    token = world.mint(expect={"mac": "00:1b:21:aa:bb:dd"})
    world.join(world.body(token, claims))
    (node,) = world.rows("SELECT hardware_key_trusted FROM nodes")
    assert node["hardware_key_trusted"] == 0
    (joined,) = world.events(world.tenant, "node.joined")
    assert joined["payload"]["hardwareKeyTrusted"] is False


def test_another_tenant_cannot_lock_a_machine_out_with_its_identifiers(world: World) -> None:
    with world.store.tx() as tx:
        squatter, _ = tenancy.create_tenant(tx, "squatter")
        site_b = str(tenancy.create_site(tx, squatter, "b")["id"])
    pool_b = world.pool_in(squatter, site_b)
    victim_claims = machine(80)
    # tenant B joins first with tenant A's machine identifiers
    first = world.join(world.body(world.mint(tenant=squatter, pool=pool_b), victim_claims))
    # A's real machine, with A's plain token, still joins (a new node of A)
    second = world.join(world.body(world.mint(), victim_claims))
    assert first["node_id"] != second["node_id"]
    rows = world.rows("SELECT tenant_id, hardware_key_trusted FROM nodes ORDER BY created_at")
    assert [(r["tenant_id"], r["hardware_key_trusted"]) for r in rows] == [
        (squatter, 1),
        (world.tenant, 1),
    ]
    # B learns nothing of A: its events name only itself; the root tenant is told
    assert not any(world.tenant in json.dumps(e) for e in world.events(squatter, "node.joined"))
    assert world.events(squatter, "security.hardware-key.shared") == []
    assert world.events(world.tenant, "security.hardware-key.shared") == []
    (shared,) = world.events(world.root, "security.hardware-key.shared")
    assert shared["payload"]["nodeId"] == second["node_id"]
    assert shared["payload"]["others"] == [{"nodeId": first["node_id"], "tenantId": squatter}]
