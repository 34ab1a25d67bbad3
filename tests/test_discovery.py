"""The discovery attestor in process, on both stores: site agents vouch for machines
that booted on their site; unknown machines wait for a person, known ones reclaim.

Also the vouch parser (a pure function) and the allowed-kinds rules of the contract.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attestors.discovery import check_settings, parse_allowed_kinds
from bcd import pki as bpki
from bcd import wire
from bcd.attestor_api import Admit, hookimpl, kind_allowed, valid_allowed_kind
from bcd.plugins import load_plugins
from bcd.wire import Claims, JoinRequest
from control import discovery, joinrequests, tenancy
from control.clock import ManualClock
from control.errors import ControlError, Refused
from control.joinservice import JoinService
from control.server import join_crypto
from tests.world.joins import PLACEHOLDER_CLAIMS, World, machine

EPOCH = 1_764_000_000


@dataclasses.dataclass
class Disc:
    w: World
    site_agent: str
    pool: str

    def service(self, **settings: str) -> JoinService:
        base = {"discovery.pool": self.pool, "discovery.match_ip": "false"}
        base.update(settings)
        return JoinService(self.w.store, join_crypto(self.w.pki), load_plugins(), base)

    def vouch(
        self, claims: Claims, epoch: int = EPOCH, *, agent: str | None = None, **kw: Any
    ) -> dict[str, Any]:
        body = {"mac": claims.macs[0], "boot_lease_epoch": epoch, **kw}
        with self.w.store.tx() as tx:
            return discovery.record_vouch(tx, agent or self.site_agent, discovery.parse_vouch(body))

    def attempt(self, claims: Claims, role: str = "node") -> tuple[bytes, bytes]:
        key = bpki.generate_key()
        csr = bpki.make_csr(key)
        request = JoinRequest(
            role=role,
            attestor="discovery",
            sealed_token=None,
            csr_der=csr,
            claims=claims,
            evidence={},
            node_id=None,
            daemon_version="0.1.0-test",
        )
        return wire.dumps(request.to_json()), csr

    def send(self, svc: JoinService, body: bytes) -> dict[str, Any]:
        return wire.verify_response(svc.join(body), self.w.signing_pin)

    def send_from(self, svc: JoinService, body: bytes, peer_ip: str) -> dict[str, Any]:
        return wire.verify_response(svc.join(body, peer_ip=peer_ip), self.w.signing_pin)

    def refused(self, svc: JoinService, body: bytes, reason: str) -> None:
        with pytest.raises(Refused) as info:
            svc.join(body)
        assert (info.value.code, info.value.message) == ("ACCESS_DENIED", "Join refused")
        assert info.value.reason == f"discovery:{reason}"

    def approve(self, request_id: str) -> None:
        with self.w.store.tx() as tx:
            joinrequests.approve(
                tx, self.w.root, self.pool, request_id, ttl_s=900, reason="intake",
                decided_by="test",
            )  # fmt: skip


@pytest.fixture
def disc(world: World) -> Disc:
    """The platform's own site with a pool for discovered machines and a site agent."""
    w = world
    with w.store.tx() as tx:
        site = tenancy.create_site(tx, w.root, "dc-1")["id"]
        agents = tenancy.create_pool(tx, w.root, site, "site-agents", "bcd", {})["id"]
        pool = tenancy.create_pool(
            tx, w.root, site, "discovered", "bcd", {"joinAttestors": ["discovery"]}
        )["id"]
    token = w.mint(tenant=w.root, pool=agents, role="site")
    joined = w.join(w.body(token, machine(900), role="site"))
    assert joined["role"] == "site"
    return Disc(dataclasses.replace(w, site=site), joined["node_id"], pool)


# --- vouches ---------------------------------------------------------------------


def test_a_vouch_is_recorded_for_the_site_agents_site_with_an_event(disc: Disc) -> None:
    claims = machine(1)
    answer = disc.vouch(claims, ip="10.0.7.21", workflow_id="wf-42")
    assert answer["site_id"] == disc.w.site
    assert answer["mac"] == claims.macs[0]
    assert answer["vouch_id"].startswith("dv_")
    (row,) = disc.w.rows("SELECT * FROM discovery_vouches")
    assert (row["site_id"], row["mac"], row["ip"], row["workflow_id"]) == (
        disc.w.site,
        claims.macs[0],
        "10.0.7.21",
        "wf-42",
    )
    assert (row["vouched_by"], row["boot_lease_epoch"], row["used_at"]) == (
        disc.site_agent,
        EPOCH,
        None,
    )
    (event,) = disc.w.events(disc.w.root, "discovery.vouched")
    assert event["payload"]["vouchedBy"] == disc.site_agent


def test_only_a_site_agent_may_vouch(disc: Disc) -> None:
    node = disc.w.join(disc.w.body(disc.w.mint(), machine(2)))["node_id"]
    with pytest.raises(ControlError) as info:
        disc.vouch(machine(1), agent=node)
    assert info.value.code == "ACCESS_DENIED"
    assert disc.w.rows("SELECT id FROM discovery_vouches") == []


def test_an_older_boot_is_refused_and_a_newer_boot_makes_a_new_vouch(disc: Disc) -> None:
    claims = machine(1)
    first = disc.vouch(claims, EPOCH)
    again = disc.vouch(claims, EPOCH)  # the same boot again: refreshed, same vouch
    assert again["vouch_id"] == first["vouch_id"]
    with pytest.raises(ControlError) as info:
        disc.vouch(claims, EPOCH - 1)
    assert info.value.code == "INVALID_STATE"
    assert "newer boot" in info.value.message
    newer = disc.vouch(claims, EPOCH + 60)
    assert newer["vouch_id"] != first["vouch_id"]
    (row,) = disc.w.rows("SELECT id, boot_lease_epoch FROM discovery_vouches")
    assert (row["id"], row["boot_lease_epoch"]) == (newer["vouch_id"], EPOCH + 60)


def test_a_flood_of_vouches_is_pushed_back(disc: Disc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "VOUCHES_PER_MINUTE", 3)
    for n in range(3):
        disc.vouch(machine(10 + n))
    with pytest.raises(ControlError) as info:
        disc.vouch(machine(20))
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert info.value.retry_after_ms is not None
    assert 0 < info.value.retry_after_ms <= 60_000
    assert len(disc.w.rows("SELECT id FROM discovery_vouches")) == 3
    disc.w.sql("UPDATE discovery_vouch_calls SET at = at - 61000")
    disc.vouch(machine(20))  # a minute later it goes on
    # the limit counts calls: vouching one machine again and again is held back too
    disc.vouch(machine(20))
    disc.vouch(machine(20))
    with pytest.raises(ControlError) as again:
        disc.vouch(machine(20))
    assert again.value.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "a vouch must be a JSON object"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": 1, "x": 1}, "unknown vouch field 'x'"),
        ({"boot_lease_epoch": 1}, "mac must be"),
        ({"mac": "ff:ff:ff:ff:ff:ff", "boot_lease_epoch": 1}, "mac must be"),
        ({"mac": "52:54:00:12:34:56", "boot_lease_epoch": 1}, "mac must be"),  # local
        ({"mac": "0c:c4:7a:12:34:56"}, "boot_lease_epoch must be"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": True}, "boot_lease_epoch must be"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": 0}, "boot_lease_epoch must be"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": "1"}, "boot_lease_epoch must be"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": 1, "ip": "10.0.0.300"}, "ip must be"),
        ({"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": 1, "ip": 7}, "ip must be"),
        (
            {"mac": "0c:c4:7a:12:34:56", "boot_lease_epoch": 1, "workflow_id": "a b"},
            "workflow_id must be",
        ),
    ],
)
def test_a_malformed_vouch_is_named(body: Any, message: str) -> None:
    with pytest.raises(ControlError) as info:
        discovery.parse_vouch(body)
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith(message)


def test_a_vouch_normalises_its_mac() -> None:
    vouch = discovery.parse_vouch(
        {"mac": "0C-C4-7A-12-34-56", "boot_lease_epoch": 9, "ip": "fd00::0001"}
    )
    assert (vouch.mac, vouch.ip) == ("0c:c4:7a:12:34:56", "fd00::1")


@given(st.dictionaries(st.text(max_size=20), st.none() | st.integers() | st.text(max_size=40)))
def test_parse_vouch_never_raises_anything_but_a_named_refusal(obj: dict[str, Any]) -> None:
    code = "INVALID_ARGUMENT"
    try:
        discovery.parse_vouch(obj)
    except ControlError as exc:
        code = exc.code
    assert code == "INVALID_ARGUMENT"


# --- the attestor --------------------------------------------------------------------


def test_without_a_pool_the_attestor_is_not_configured(disc: Disc) -> None:
    svc = JoinService(disc.w.store, join_crypto(disc.w.pki), load_plugins(), {})
    body, _ = disc.attempt(machine(1))
    disc.refused(svc, body, "not-configured")


def test_match_ip_is_on_by_default(disc: Disc) -> None:
    svc = JoinService(
        disc.w.store, join_crypto(disc.w.pki), load_plugins(), {"discovery.pool": disc.pool}
    )
    claims = machine(1)
    disc.vouch(claims, ip="10.0.7.21")
    body, _ = disc.attempt(claims)
    with pytest.raises(Refused) as info:
        svc.join(body, peer_ip="10.0.7.22")
    assert info.value.reason == "discovery:ip-mismatch"
    assert disc.send_from(svc, body, "10.0.7.21")["kind"] == "pending"
    (req,) = disc.w.rows("SELECT ip FROM join_requests")
    assert req["ip"] == "10.0.7.21"


def test_a_machine_nobody_vouched_for_is_refused(disc: Disc) -> None:
    svc = disc.service()
    body, _ = disc.attempt(machine(1))
    disc.refused(svc, body, "not-vouched")
    disc.vouch(machine(2))  # another machine's vouch does not help
    disc.refused(svc, body, "not-vouched")
    assert disc.w.rows("SELECT id FROM join_requests") == []


def test_a_site_agent_never_joins_by_discovery(disc: Disc) -> None:
    claims = machine(1)
    disc.vouch(claims)
    body, _ = disc.attempt(claims, role="site")
    disc.refused(disc.service(), body, "role")


def test_an_unknown_machine_waits_is_approved_joins_once(disc: Disc, clock: ManualClock) -> None:
    svc = disc.service(**{"discovery.allowed_kinds": "inventory.read, deploy.*"})
    claims = machine(1)
    disc.vouch(claims, ip="10.0.7.21", workflow_id="wf-42")
    body, csr = disc.attempt(claims)
    pending = disc.send(svc, body)
    assert pending["kind"] == "pending"
    assert pending["attestor"] == "discovery"
    (req,) = disc.w.rows("SELECT * FROM join_requests")
    assert (req["state"], req["attestor"], req["pool_id"], req["tenant_id"]) == (
        "pending",
        "discovery",
        disc.pool,
        disc.w.root,
    )
    assert (req["mac"], req["ip"], req["workflow_id"]) == (claims.macs[0], "10.0.7.21", "wf-42")
    assert (req["vouched_by"], req["boot_lease_epoch"]) == (disc.site_agent, EPOCH)
    assert req["machine_key"] == req["hardware_key"]  # a trusted hardware key
    assert req["csr_sha256"] == bpki.sha256_hex(csr)
    assert disc.w.rows("SELECT id FROM nodes WHERE pool_id = ?", (disc.pool,)) == []
    # waiting again with the same CSR changes nothing
    assert disc.send(svc, body)["request_id"] == pending["request_id"]
    with disc.w.store.tx() as tx:
        (listed,) = joinrequests.list_requests(tx, disc.w.root, disc.pool, "pending")["items"]
    assert (listed["vouchedBy"], listed["bootLeaseEpoch"]) == (disc.site_agent, EPOCH)

    disc.approve(pending["request_id"])
    joined = disc.send(svc, body)
    assert joined["kind"] == "joined"
    (node,) = disc.w.rows("SELECT * FROM nodes WHERE id = ?", (joined["node_id"],))
    assert (node["pool_id"], node["attestor"], node["role"]) == (disc.pool, "discovery", "node")
    (cert,) = disc.w.rows("SELECT allowed_kinds FROM node_certs WHERE node_id = ?", (node["id"],))
    assert json.loads(cert["allowed_kinds"]) == ["inventory.read", "deploy.*"]
    (req,) = disc.w.rows("SELECT consumed_at FROM join_requests")
    assert req["consumed_at"] is not None
    # the same CSR again within minutes: a lost answer, the same identity, nothing spent
    assert disc.send(svc, body)["chain"] == joined["chain"]
    # later, the approval is spent: the same CSR again is refused
    clock.advance(600_001)
    disc.refused(svc, body, "request-consumed")
    assert len(disc.w.rows("SELECT id FROM nodes WHERE pool_id = ?", (disc.pool,))) == 1
    # and so is the boot's vouch: the machine's claims with another CSR cannot follow
    # as a "known machine" on the same boot
    (vouch,) = disc.w.rows("SELECT used_at FROM discovery_vouches")
    assert vouch["used_at"] is not None
    again, _ = disc.attempt(claims)
    disc.refused(svc, again, "vouch-used")
    (cert,) = disc.w.rows(
        "SELECT revoked_at FROM node_certs WHERE node_id = ?", (joined["node_id"],)
    )
    assert cert["revoked_at"] is None


def test_an_approval_names_the_csr_it_approves(disc: Disc) -> None:
    svc = disc.service()
    claims = machine(1)
    disc.vouch(claims)
    first, first_csr = disc.attempt(claims)
    request_id = disc.send(svc, first)["request_id"]
    # a newer attempt of the machine (or of someone claiming it) refreshes the request
    second, _ = disc.attempt(claims)
    assert disc.send(svc, second)["request_id"] == request_id
    with disc.w.store.tx() as tx, pytest.raises(ControlError) as info:
        joinrequests.approve(
            tx, disc.w.root, disc.pool, request_id, ttl_s=900, decided_by="t",
            csr_sha256=bpki.sha256_hex(first_csr),
        )  # fmt: skip
    assert info.value.code == "INVALID_STATE"
    assert "changed since it was listed" in info.value.message
    (row,) = disc.w.rows("SELECT state FROM join_requests")
    assert row["state"] == "pending"


def test_a_rejected_machine_is_refused(disc: Disc) -> None:
    svc = disc.service()
    claims = machine(1)
    disc.vouch(claims)
    body, _ = disc.attempt(claims)
    request_id = disc.send(svc, body)["request_id"]
    with disc.w.store.tx() as tx:
        joinrequests.reject(
            tx, disc.w.root, disc.pool, request_id, reason="unknown serial", decided_by="t"
        )
    disc.refused(svc, body, "request-rejected")
    assert disc.w.rows("SELECT id FROM nodes WHERE pool_id = ?", (disc.pool,)) == []


def test_a_placeholder_machine_is_keyed_by_site_and_mac_and_admitted_by_a_person(
    disc: Disc,
) -> None:
    svc = disc.service()
    claims = dataclasses.replace(PLACEHOLDER_CLAIMS, macs=("0c:c4:7a:00:00:01",))
    disc.vouch(claims)
    body, _ = disc.attempt(claims)
    pending = disc.send(svc, body)
    (req,) = disc.w.rows("SELECT machine_key, hardware_key FROM join_requests")
    assert req == {"machine_key": f"{disc.w.site}|0c:c4:7a:00:00:01", "hardware_key": None}
    disc.approve(pending["request_id"])
    joined = disc.send(svc, body)
    (node,) = disc.w.rows(
        "SELECT hardware_key_trusted FROM nodes WHERE id = ?", (joined["node_id"],)
    )
    assert node["hardware_key_trusted"] == 0


def _known_machine(disc: Disc, svc: JoinService, claims: Claims) -> str:
    disc.vouch(claims)
    body, _ = disc.attempt(claims)
    disc.approve(disc.send(svc, body)["request_id"])
    node_id: str = disc.send(svc, body)["node_id"]
    return node_id


def test_a_known_machine_booted_again_reclaims_its_node_without_a_person(disc: Disc) -> None:
    svc = disc.service()
    claims = machine(1)
    node_id = _known_machine(disc, svc, claims)
    # the next boot (a reinstall over PXE): a new vouch, a new key
    disc.vouch(claims, EPOCH + 600)
    body, _ = disc.attempt(claims)
    joined = disc.send(svc, body)
    assert (joined["kind"], joined["node_id"], joined["identity_generation"]) == (
        "joined",
        node_id,
        2,
    )
    (vouch,) = disc.w.rows("SELECT used_at FROM discovery_vouches")
    assert vouch["used_at"] is not None
    assert len(disc.w.rows("SELECT id FROM join_requests")) == 1  # no new request
    audit = disc.w.rows("SELECT action FROM audit WHERE subject = ? ORDER BY id", (node_id,))
    assert "node.reclaimed" in [a["action"] for a in audit]
    # the same boot cannot admit a second join
    again, _ = disc.attempt(claims)
    disc.refused(svc, again, "vouch-used")


def test_with_approval_always_a_known_machine_waits_too(disc: Disc) -> None:
    claims = machine(1)
    _known_machine(disc, disc.service(), claims)
    disc.vouch(claims, EPOCH + 600)
    body, _ = disc.attempt(claims)
    answer = disc.send(disc.service(**{"discovery.approval": "always"}), body)
    assert answer["kind"] == "pending"


def test_an_expired_vouch_is_refused(disc: Disc, clock: ManualClock) -> None:
    claims = machine(1)
    disc.vouch(claims)
    clock.advance(31 * 60_000)  # a vouch lasts 30 minutes
    body, _ = disc.attempt(claims)
    disc.refused(disc.service(), body, "vouch-expired")


def test_with_match_ip_the_join_must_come_from_the_vouched_address(disc: Disc) -> None:
    svc = disc.service(**{"discovery.match_ip": "true"})
    claims = machine(1)
    body, _ = disc.attempt(claims)
    disc.vouch(claims)  # a vouch without an address cannot match
    with pytest.raises(Refused) as info:
        svc.join(body, peer_ip="10.0.7.21")
    assert info.value.reason == "discovery:ip-mismatch"
    disc.vouch(claims, ip="10.0.7.21")
    with pytest.raises(Refused) as info:
        svc.join(body, peer_ip="10.0.7.99")
    assert info.value.reason == "discovery:ip-mismatch"
    with pytest.raises(Refused):
        svc.join(body)  # no address seen at all
    answer = wire.verify_response(svc.join(body, peer_ip="10.0.7.21"), disc.w.signing_pin)
    assert answer["kind"] == "pending"


def test_a_pool_that_does_not_list_discovery_refuses_it(disc: Disc) -> None:
    with disc.w.store.tx() as tx:
        tenancy.set_pool_policy(tx, disc.w.root, disc.pool, {"joinAttestors": ["join-token"]})
    svc = disc.service()
    claims = machine(1)
    node_id_before = _count_nodes(disc)
    disc.vouch(claims)
    body, _ = disc.attempt(claims)
    disc.refused(svc, body, "pool-attestor")  # no request a person could not use
    assert disc.w.rows("SELECT id FROM join_requests") == []
    assert _count_nodes(disc) == node_id_before


def _count_nodes(disc: Disc) -> int:
    return len(disc.w.rows("SELECT id FROM nodes"))


# --- settings and allowed kinds -------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({}, None),
        ({"discovery.pool": "pool_x"}, None),
        ({"discovery.pool": "p", "discovery.approval": "never"}, "discovery.approval must be"),
        ({"discovery.pool": "p", "discovery.allowed_kinds": "Exec"}, "discovery.allowed_kinds"),
        ({"discovery.approval": "always"}, "needs --discovery-pool"),
        ({"discovery.pool": "p", "discovery.match_ip": "yes"}, "discovery.match_ip must be"),
        ({"discovery.pool": "p", "discovery.match_ip": "false"}, None),
    ],
)
def test_discovery_settings_are_checked(settings: dict[str, str], problem: str | None) -> None:
    found = check_settings(settings)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_allowed_kinds_are_exact_kinds_or_prefixes() -> None:
    assert parse_allowed_kinds("exec.run, deploy.*") == ("exec.run", "deploy.*")
    assert parse_allowed_kinds("") == ()
    for bad in ("*", "exec.", "Exec.run", "exec.*.run", "exec run", "a" * 129):
        assert not valid_allowed_kind(bad), bad
    assert kind_allowed((), "anything")
    assert kind_allowed(("deploy.*",), "deploy.image")
    assert kind_allowed(("deploy.*",), "deploy.image.fetch")
    assert not kind_allowed(("deploy.*",), "deploy")
    assert not kind_allowed(("deploy.*",), "deployx.image")
    assert kind_allowed(("exec.run",), "exec.run")
    assert not kind_allowed(("exec.run",), "exec.run.now")


class _BadKinds:
    """A third-party attestor that admits with a malformed allowed kind."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["bad-kinds"]

    @hookimpl
    def bcd_server_verify(self, attestor: str, request: Any, ctx: Any) -> Any:
        if attestor != "bad-kinds":
            return None
        pool = ctx.lookup_pool(ctx.settings["bad-kinds.pool"])
        return Admit(
            tenant_id=pool.tenant_id,
            pool_id=pool.pool_id,
            site_id=pool.site_id,
            role="node",
            allowed_kinds=("exec.*", "rm -rf"),
        )


def test_an_attestor_admitting_with_malformed_allowed_kinds_is_a_plugin_error(
    disc: Disc,
) -> None:
    svc = JoinService(
        disc.w.store,
        join_crypto(disc.w.pki),
        load_plugins([_BadKinds()]),
        {"bad-kinds.pool": disc.pool},
    )
    body, _ = disc.attempt(machine(1))
    body = body.replace(b'"attestor":"discovery"', b'"attestor":"bad-kinds"')
    with pytest.raises(Refused) as info:
        svc.join(body)
    assert info.value.reason == "bad-kinds:plugin-error"
    assert _count_nodes(disc) == 1  # the site agent only


def test_bcd_vouch_says_when_to_ask_again() -> None:
    from bcd.errors import RetryableError
    from bcd.vouch import vouch_answer

    body = wire.dumps({"code": "RESOURCE_EXHAUSTED", "message": "at most 600 vouches"})
    with pytest.raises(RetryableError) as info:
        vouch_answer(429, body, "12500")
    assert str(info.value) == "RESOURCE_EXHAUSTED: at most 600 vouches; ask again in 12 s"
    assert info.value.pushback_s == 12.5
    with pytest.raises(RetryableError, match="ask again later"):
        vouch_answer(503, wire.dumps({"code": "UNAVAILABLE", "message": "busy"}))
