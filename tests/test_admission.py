"""The pure admission core (control.admission): every refusal it can return, and
the verdicts it gives, over frozen records — no database, no I/O.

JoinService and RenewService are the shells around it; their tests (test_joinservice,
test_renewal, ...) show the same reasons reaching the events through a real store.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest

from bcd import hardware, pki, wire
from bcd.attestor_api import JOIN_TOKEN, Admit, Challenge, Defer
from control import admission
from control.admission import (
    AdmitApproved,
    CertFacts,
    Issue,
    JoinSubject,
    NodeFacts,
    PoolFacts,
    RecordPending,
    Refusal,
    RequestFacts,
)

CSR_DER = pki.make_csr(pki.generate_key())
CSR = pki.parse_csr(CSR_DER)
CSR_SHA = pki.sha256_hex(CSR_DER)
NOW = 1_800_000_000_000

GOOD_CLAIMS = wire.Claims(
    product_uuid=str(uuid.UUID(int=(0x4C4C4544 << 96) | 7)),
    product_serial="SN-0007",
    macs=("00:1b:21:00:07:5e",),
)
PLACEHOLDER = wire.Claims(
    product_uuid="00000000-0000-0000-0000-000000000000",
    product_serial="To Be Filled By O.E.M.",
)


def subject(**kw: Any) -> JoinSubject:
    claims = kw.pop("claims", GOOD_CLAIMS)
    fields: dict[str, Any] = {
        "attestor": JOIN_TOKEN,
        "csr_sha256": CSR_SHA,
        "csr": CSR,
        "claims": claims,
        "hw": hardware.hardware_key(claims),
    }
    fields.update(kw)
    return JoinSubject(**fields)


def admit(**kw: Any) -> Admit:
    fields: dict[str, Any] = {"tenant_id": "t1", "pool_id": "p1", "site_id": "s1", "role": "node"}
    fields.update(kw)
    return Admit(**fields)


def pool(**kw: Any) -> PoolFacts:
    fields: dict[str, Any] = {
        "pool_id": "p1",
        "tenant_id": "t1",
        "site_id": "s1",
        "agent": "bcd",
        "join_attestors": None,
        "platform_operated": False,
    }
    fields.update(kw)
    return PoolFacts(**fields)


def node(**kw: Any) -> NodeFacts:
    fields: dict[str, Any] = {
        "node_id": "node_1",
        "tenant_id": "t1",
        "site_id": "s1",
        "pool_id": "p1",
        "role": "node",
        "identity_generation": 1,
        "retired": False,
        "latest_statements": (),
    }
    fields.update(kw)
    return NodeFacts(**fields)


def request(**kw: Any) -> RequestFacts:
    fields: dict[str, Any] = {
        "request_id": "jreq_1",
        "state": "approved",
        "csr_sha256": CSR_SHA,
        "pool_id": "p1",
        "usable": True,
        "consumed": False,
    }
    fields.update(kw)
    return RequestFacts(**fields)


def judge(
    a: Admit,
    *,
    s: JoinSubject | None = None,
    existing: NodeFacts | None = None,
    p: PoolFacts | None = None,
    approved: RequestFacts | None = None,
    no_pool: bool = False,
) -> Refusal | Issue:
    s = s or subject()
    hw = admission.screen(s, a)
    assert isinstance(hw, hardware.HardwareKey), hw
    return admission.judge_admit(s, a, hw, existing, None if no_pool else (p or pool()), approved)


# --- lifetime ---------------------------------------------------------------------------


def test_lifetime_is_the_role_maximum_shortened_never_lengthened_by_the_cap() -> None:
    assert admission.lifetime_s(86_400, "node") == 86_400
    assert admission.lifetime_s(86_400, "ramdisk") == 7_200
    assert admission.lifetime_s(3_600, "ramdisk") == 3_600
    assert admission.lifetime_s(86_400, "node", 900) == 900
    assert admission.lifetime_s(86_400, "ramdisk", 10_000) == 7_200
    assert admission.lifetime_s(600, "node", 86_400) == 600


@pytest.mark.parametrize("cap", [1_799, 60, 0, -5, 1_800.5, "3600", True])
def test_a_lifetime_cap_below_the_minimum_or_not_an_int_is_a_plugin_error(cap: object) -> None:
    assert admission.screen(subject(), admit(max_lifetime_s=cap)) == Refusal("plugin-error", "t1")


def test_the_minimum_cap_leaves_room_in_the_hourly_renewal_limit() -> None:
    from bcd.renew import RENEW_FRACTION
    from control import renewal

    assert admission.NODE_RENEW_FRACTION == RENEW_FRACTION
    assert renewal.RENEWALS_PER_HOUR == admission.RENEWALS_PER_HOUR == 6
    assert admission.MIN_LIFETIME_S == 1_800
    # at the shortest cap, the node's own schedule uses at most 4 of the hour's 6
    # renewals (a sliding window holds at most ceil(3600 / 1080) of them)
    interval_s = RENEW_FRACTION * admission.MIN_LIFETIME_S
    assert -(-3_600 // interval_s) <= admission.RENEWALS_PER_HOUR - 2


def test_a_valid_lifetime_cap_reaches_the_issue() -> None:
    verdict = judge(admit(max_lifetime_s=1_800))
    assert isinstance(verdict, Issue)
    assert verdict.max_lifetime_s == 1_800


@pytest.mark.parametrize(
    ("kept", "asked", "issued"),
    [(3_600, None, 3_600), (3_600, 7_200, 3_600), (7_200, 3_600, 3_600), (None, 3_600, 3_600)],
)
def test_a_rejoin_keeps_the_shorter_of_the_nodes_cap_and_the_admissions(
    kept: int | None, asked: int | None, issued: int
) -> None:
    verdict = judge(
        admit(node_id="node_1", max_lifetime_s=asked), existing=node(max_lifetime_s=kept)
    )
    assert isinstance(verdict, Issue)
    assert verdict.max_lifetime_s == issued


def test_a_rejoin_of_an_uncapped_node_without_a_cap_stays_uncapped() -> None:
    verdict = judge(admit(node_id="node_1"), existing=node())
    assert isinstance(verdict, Issue)
    assert verdict.max_lifetime_s is None


def test_a_hardware_reclaim_takes_the_admissions_cap() -> None:
    """The admitting attestor proved the machine afresh: its verdict sets the cap."""
    for asked in (None, 7_200):
        verdict = judge(
            admit(allow_reclaim=True, max_lifetime_s=asked), existing=node(max_lifetime_s=3_600)
        )
        assert isinstance(verdict, Issue)
        assert verdict.max_lifetime_s == asked


# --- the seal ------------------------------------------------------------------------------


def _seal(csr_sha256: str = CSR_SHA, iat_s: int = NOW // 1000) -> wire.OpenedSeal:
    return wire.OpenedSeal(wire.JoinToken("tok", "secret"), iat_s, csr_sha256)


def test_the_seal_refusals() -> None:
    assert admission.check_seal(None, "token-malformed", CSR_SHA, NOW) == Refusal("token-malformed")
    assert admission.check_seal(None, "seal-invalid", CSR_SHA, NOW) == Refusal("seal-invalid")
    assert admission.check_seal(_seal("0" * 64), None, CSR_SHA, NOW) == Refusal("seal-csr")
    stale = NOW // 1000 - wire.SEAL_MAX_SKEW_S - 1
    assert admission.check_seal(_seal(iat_s=stale), None, CSR_SHA, NOW) == Refusal("seal-stale")
    early = NOW // 1000 + wire.SEAL_MAX_SKEW_S + 1
    assert admission.check_seal(_seal(iat_s=early), None, CSR_SHA, NOW) == Refusal("seal-stale")
    assert admission.check_seal(_seal(), None, CSR_SHA, NOW) is None
    assert admission.check_seal(None, None, CSR_SHA, NOW) is None  # another attestor's join


# --- challenge and defer -----------------------------------------------------------------


def test_the_challenge_refusals() -> None:
    good = Challenge(round=1, challenge={"nonce": "x"}, not_after_ms=NOW)
    assert admission.check_challenge(subject(), good) is None
    assert admission.check_challenge(subject(csr=None), good) == Refusal("csr-invalid")
    for bad in (
        dataclasses.replace(good, round=0),
        dataclasses.replace(good, round=admission.MAX_ROUNDS + 1),
        dataclasses.replace(good, challenge=["x"]),  # type: ignore[arg-type]
        dataclasses.replace(good, not_after_ms="soon"),  # type: ignore[arg-type]
    ):
        assert admission.check_challenge(subject(), bad) == Refusal("plugin-error")
    assert admission.check_challenge(subject(request_round=1), good) == Refusal("plugin-error")


def test_the_defer_verdicts_and_refusals() -> None:
    defer = Defer(machine_key="mk", pool_id="p1", admit=admit())
    s = subject(attestor="discovery")
    assert admission.judge_defer(subject(csr=None), defer, pool(), None) == Refusal("csr-invalid")
    assert admission.judge_defer(s, defer, None, None) == Refusal("pool-unknown")
    narrow = pool(join_attestors=("tpm",))
    assert admission.judge_defer(s, defer, narrow, None) == Refusal("pool-attestor", "t1")
    rejected = request(state="rejected")
    assert admission.judge_defer(s, defer, pool(), rejected) == Refusal("request-rejected", "t1")
    spent = request(usable=False, consumed=True)
    assert admission.judge_defer(s, defer, pool(), spent) == Refusal("request-consumed", "t1")
    approved = admission.judge_defer(s, defer, pool(), request())
    assert approved == AdmitApproved(dataclasses.replace(defer.admit, join_request_id="jreq_1"))  # type: ignore[arg-type]
    # approved but expired, or no admission offered: the request is refreshed
    assert admission.judge_defer(s, defer, pool(), request(usable=False)) == RecordPending(
        "t1", "s1"
    )
    no_admit = dataclasses.replace(defer, admit=None)
    assert admission.judge_defer(s, no_admit, pool(), request()) == RecordPending("t1", "s1")
    assert admission.judge_defer(s, defer, pool(), None) == RecordPending("t1", "s1")


# --- screen: the Admit, the CSR, expect and placeholders ---------------------------------


def test_screen_refusals() -> None:
    bad_kinds = admit(allowed_kinds=["k8s"])  # a list, not a tuple
    assert admission.screen(subject(), bad_kinds) == Refusal("plugin-error", "t1")
    assert admission.screen(subject(), admit(allowed_kinds=("Bad Kind",))) == Refusal(
        "plugin-error", "t1"
    )
    assert admission.screen(subject(csr=None), admit()) == Refusal("csr-invalid", "t1")
    expect = admit(expect={"serial": "OTHER-1"})
    assert admission.screen(subject(), expect) == Refusal("expect-mismatch", "t1")
    placeholder = subject(claims=PLACEHOLDER)
    assert admission.screen(placeholder, admit()) == Refusal("placeholder-hardware", "t1")


def test_screen_hardware_keys() -> None:
    hw = admission.screen(subject(), admit())
    assert isinstance(hw, hardware.HardwareKey)
    assert hw.trusted
    # an attestor's proven key replaces the claims'
    proven = admission.screen(subject(claims=PLACEHOLDER), admit(hardware_key="ab" * 32))
    assert isinstance(proven, hardware.HardwareKey)
    assert proven.hex == "ab" * 32
    assert proven.trusted
    assert proven.kinds == frozenset({JOIN_TOKEN})
    # a weak key admitted by its expect binding is never a reclaim key
    weak = wire.Claims(
        macs=GOOD_CLAIMS.macs, gpu_uuids=("GPU-8f1b2c3d-0000-4000-8000-000000000001",)
    )
    bound = admission.screen(subject(claims=weak), admit(expect={"mac": GOOD_CLAIMS.macs[0]}))
    assert isinstance(bound, hardware.HardwareKey)
    assert hardware.hardware_key(weak).trusted
    assert not bound.trusted
    assert admission.reclaim_lookup(admit(), bound) is None
    # other attestors are not held to the placeholder rule
    other = admission.screen(subject(attestor="tpm", claims=PLACEHOLDER), admit())
    assert isinstance(other, hardware.HardwareKey)


def test_reclaim_lookup() -> None:
    hw = hardware.hardware_key(GOOD_CLAIMS)
    assert admission.reclaim_lookup(admit(node_id="node_9"), hw) == ("id", "node_9")
    assert admission.reclaim_lookup(admit(), hw) == ("hardware", hw.hex)


# --- judge_admit: reclaim, pool, node id, approval ----------------------------------------


def test_a_new_machine_is_issued() -> None:
    verdict = judge(admit())
    assert verdict == Issue(
        tenant_id="t1",
        site_id="s1",
        pool_id="p1",
        role="node",
        hw=hardware.hardware_key(GOOD_CLAIMS),
        existing=None,
        consume_request=None,
        max_lifetime_s=None,
    )


def test_reclaim_refusals() -> None:
    assert judge(admit(node_id="node_1")) == Refusal("reclaim", "t1")  # no such node
    tpm_node = node(latest_statements=("urn:bc:tpm-ak:x",))
    assert judge(admit(node_id="node_1"), existing=tpm_node) == Refusal("reclaim", "t1")
    assert judge(admit(), existing=node()) == Refusal("reclaim", "t1")  # no allow_reclaim
    for elsewhere in (
        node(tenant_id="t2"),
        node(site_id="s2"),
        node(pool_id="p2"),
        node(role="ramdisk"),
        node(retired=True),
    ):
        assert judge(admit(allow_reclaim=True), existing=elsewhere) == Refusal("reclaim", "t1")
    other_ak = admit(allow_reclaim=True, statements=("urn:bc:tpm-ak:y",))
    assert judge(other_ak, existing=tpm_node) == Refusal("reclaim", "t1")
    no_cert = node(latest_statements=None)
    assert judge(admit(node_id="node_1"), existing=no_cert) == Refusal("reclaim", "t1")


def test_reclaims_that_are_admitted() -> None:
    reclaimed = judge(admit(allow_reclaim=True), existing=node())
    assert isinstance(reclaimed, Issue)
    assert reclaimed.existing == node()
    rejoin = judge(admit(node_id="node_1"), existing=node())
    assert isinstance(rejoin, Issue)
    assert rejoin.existing == node()
    tpm_node = node(latest_statements=("urn:bc:tpm-ak:x",))
    same_ak = admit(allow_reclaim=True, statements=("urn:bc:tpm-ak:x",))
    assert isinstance(judge(same_ak, existing=tpm_node), Issue)


def test_pool_refusals() -> None:
    assert judge(admit(), no_pool=True) == Refusal("pool-agent", "t1")
    assert judge(admit(), p=pool(agent="none")) == Refusal("pool-agent", "t1")
    assert judge(admit(), p=pool(tenant_id="t2")) == Refusal("pool-tenant", "t1")
    assert judge(admit(), p=pool(site_id="s2")) == Refusal("pool-tenant", "t1")
    assert judge(admit(), p=pool(join_attestors=("tpm",))) == Refusal("pool-attestor", "t1")
    assert isinstance(judge(admit(), p=pool(join_attestors=(JOIN_TOKEN,))), Issue)


def test_node_id_refusals() -> None:
    asks = subject(node_id="node_1")
    assert judge(admit(), s=asks) == Refusal("node-id", "t1")
    assert judge(admit(allow_reclaim=True), s=asks, existing=node(node_id="node_2")) == Refusal(
        "node-id", "t1"
    )
    assert isinstance(judge(admit(allow_reclaim=True), s=asks, existing=node()), Issue)


def test_request_not_approved_refusals() -> None:
    a = admit(join_request_id="jreq_1")
    for approved in (
        None,
        request(csr_sha256="0" * 64),
        request(pool_id="p2"),
        request(usable=False),
    ):
        assert judge(a, approved=approved) == Refusal("request-not-approved", "t1")
    verdict = judge(a, approved=request())
    assert isinstance(verdict, Issue)
    assert verdict.consume_request == "jreq_1"


def test_hosted_roles() -> None:
    hosted = admit(hosted="tenant-x")
    assert admission.cert_role(hosted, pool()) == "node-tenant"
    assert admission.cert_role(hosted, pool(platform_operated=True)) == "node"
    assert admission.cert_role(hosted, None) == "node"
    assert admission.cert_role(admit(role="ramdisk", hosted="x"), pool()) == "ramdisk"
    assert admission.cert_role(admit(), pool()) == "node"
    # a node of the hosted role reclaims under the role its certificate had
    verdict = judge(admit(hosted="x", allow_reclaim=True), existing=node(role="node-tenant"))
    assert isinstance(verdict, Issue)
    assert verdict.role == "node-tenant"


# --- renew ----------------------------------------------------------------------------------


def cert(**kw: Any) -> CertFacts:
    fields: dict[str, Any] = {
        "serial": "ab",
        "node_id": "node_1",
        "identity_generation": 1,
        "role": "node",
        "allowed_kinds": (),
        "not_after_ms": NOW + 60_000,
        "revoked": False,
    }
    fields.update(kw)
    return CertFacts(**fields)


def test_renew_leaf_refusals() -> None:
    def renew(**kw: Any) -> Refusal | None:
        args: dict[str, Any] = {
            "leaf": cert(),
            "node": node(),
            "peer": cert(),
            "client_time_ms": NOW,
            "now_ms": NOW,
        }
        args.update(kw)
        return admission.judge_renew_leaf(**args)

    assert renew() is None
    assert renew(leaf=cert(revoked=True)) == Refusal("leaf-revoked")
    assert renew(leaf=cert(not_after_ms=NOW - 1)) == Refusal("leaf-expired")
    assert renew(node=None) == Refusal("node-retired")
    assert renew(node=node(retired=True)) == Refusal("node-retired")
    assert renew(node=node(identity_generation=2)) == Refusal("generation")
    assert renew(peer=None) == Refusal("identity-mismatch")
    assert renew(peer=cert(node_id="node_2")) == Refusal("identity-mismatch")
    assert renew(peer=cert(revoked=True)) == Refusal("identity-mismatch")
    skew = admission.CLOCK_SKEW_MS
    assert renew(client_time_ms=NOW - skew - 1) == Refusal("clock-skew")
    assert renew(client_time_ms=NOW + skew + 1) == Refusal("clock-skew")
    assert renew(client_time_ms=NOW + skew) is None
    assert admission.clock_skewed(NOW - skew - 1, NOW)  # a vouch's proof, too
    assert not admission.clock_skewed(NOW - skew, NOW)


def test_renew_proof_refusals() -> None:
    assert admission.judge_renew_proof(True, True, CSR, "t1") is None
    assert admission.judge_renew_proof(False, True, CSR, "t1") == Refusal("pop-replay")
    assert admission.judge_renew_proof(False, False, CSR, "t1") == Refusal("pop-replay")
    assert admission.judge_renew_proof(True, False, CSR, "t1") == Refusal("pop-invalid")
    assert admission.judge_renew_proof(True, True, None, "t1") == Refusal("csr-invalid", "t1")
