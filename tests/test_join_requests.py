"""Join requests in process, on both stores: the tpm attestor with enrollment defers
an EK it cannot trust; a tenant approves or rejects on the pool."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from bcd import pki as bpki
from control import joinrequests, tenancy
from control.cli import build_parser
from control.clock import ManualClock
from control.errors import ControlError
from tests.world import other_ca_bundle
from tests.world.joins import TpmWorld, tpm_key


@pytest.fixture
def ew(tw: TpmWorld) -> TpmWorld:
    """The world with ``tpm.enrollment=true`` and no EK trust: every EK is unknown."""
    return dataclasses.replace(tw, svc=tw.with_settings(**{"tpm.enrollment": "true"}))


def _pending(w: TpmWorld, key: Any) -> dict[str, Any]:
    body = w.send(w.request(key))
    assert body["kind"] == "pending"
    return body


def _approve(w: TpmWorld, request_id: str, ttl_s: int = 900, tenant: str | None = None) -> Any:
    with w.store.tx() as tx:
        return joinrequests.approve(
            tx,
            tenant or w.tenant,
            w.pool,
            request_id,
            ttl_s=ttl_s,
            reason="rack B7 intake",
            decided_by="test",
        )


def _join(w: TpmWorld, key: Any) -> dict[str, Any]:
    challenge = w.challenge(key)
    return w.send(w.request(key, 1, w.answer(key, challenge)))


def test_without_enrollment_an_unknown_ek_is_still_refused(tw: TpmWorld) -> None:
    svc = tw.with_settings(
        **{"tpm.ek_ca": str(other_ca_bundle(tw.swtpm.ca_bundle.parent / "o.pem"))}
    )
    w = dataclasses.replace(tw, svc=svc)
    w.refused(w.request(tpm_key(w.swtpm.tcti)), "ek-chain")
    assert w.rows("SELECT id FROM join_requests") == []


def test_an_unknown_ek_records_a_pending_request_and_nothing_else(ew: TpmWorld) -> None:
    key = tpm_key(ew.swtpm.tcti)
    body = _pending(ew, key)
    assert body["attestor"] == "tpm"
    assert body["request_id"].startswith("jreq_")
    assert body["retry_after_s"] >= 1
    (row,) = ew.rows("SELECT * FROM join_requests")
    assert row["id"] == body["request_id"]
    assert (row["state"], row["attestor"], row["tenant_id"], row["pool_id"]) == (
        "pending",
        "tpm",
        ew.tenant,
        ew.pool,
    )
    assert row["csr_sha256"] == bpki.sha256_hex(key.csr_der)
    assert row["machine_key"] == row["hardware_key"]
    assert json.loads(row["claims"])["product_uuid"]
    assert ew.rows("SELECT id FROM nodes") == []
    assert ew.rows("SELECT id FROM join_challenges") == []
    listed = _list(ew)
    assert [r["id"] for r in listed] == [row["id"]]
    assert listed[0]["csrSha256"] == row["csr_sha256"]
    assert listed[0]["hardwareKey"] == row["hardware_key"]
    assert listed[0]["decidedAt"] is None
    assert listed[0]["consumedAt"] is None


def _list(w: TpmWorld, state: str = "pending", tenant: str | None = None) -> list[dict[str, Any]]:
    with w.store.tx() as tx:
        items: list[dict[str, Any]] = joinrequests.list_requests(
            tx, tenant or w.tenant, w.pool, state
        )["items"]
        return items


def test_a_newer_attempt_refreshes_the_pending_request_with_its_csr(ew: TpmWorld) -> None:
    first = _pending(ew, tpm_key(ew.swtpm.tcti))
    key = tpm_key(ew.swtpm.tcti)
    second = _pending(ew, key)
    assert second["request_id"] == first["request_id"]
    (row,) = ew.rows("SELECT * FROM join_requests")
    assert row["csr_sha256"] == bpki.sha256_hex(key.csr_der)


def test_an_approval_admits_exactly_one_join(ew: TpmWorld) -> None:
    key = tpm_key(ew.swtpm.tcti)
    request_id = _pending(ew, key)["request_id"]
    approved = _approve(ew, request_id)
    assert approved["state"] == "approved"
    assert approved["expiresAt"]
    assert approved["reason"] == "rack B7 intake"
    assert _list(ew) == []
    assert [r["id"] for r in _list(ew, "all")] == [request_id]
    # two challenge rounds while approved: only the first answer joins
    first = ew.challenge(key)
    second = ew.challenge(key)
    body = ew.send(ew.request(key, 1, ew.answer(key, first)))
    assert body["kind"] == "joined"
    (row,) = ew.rows("SELECT * FROM join_requests")
    assert row["consumed_at"] is not None
    (joined,) = ew.rows("SELECT payload FROM events WHERE type = 'node.joined'")
    assert json.loads(joined["payload"])["joinRequestId"] == request_id
    # the second round's answer with the same CSR only gets the same identity again
    # (as a join whose answer was lost does): nothing more is issued or consumed
    again = ew.send(ew.request(key, 1, ew.answer(key, second)))
    assert (again["node_id"], again["chain"]) == (body["node_id"], body["chain"])
    with ew.store.tx() as tx:
        tx.execute("UPDATE node_certs SET created_at = created_at - 600001")
    ew.refused(ew.request(key, 1, ew.answer(key, second)), "request-not-approved")
    # the approval used twice: a fresh round with that CSR is refused
    ew.refused(ew.request(key), "request-consumed")
    assert len(ew.rows("SELECT id FROM nodes")) == 1


def test_a_join_with_another_csr_does_not_spend_the_approval(ew: TpmWorld) -> None:
    key = tpm_key(ew.swtpm.tcti)
    request_id = _pending(ew, key)["request_id"]
    _approve(ew, request_id)
    other = tpm_key(ew.swtpm.tcti)
    assert _pending(ew, other)["request_id"] != request_id  # a new request for the new CSR
    assert _join(ew, key)["kind"] == "joined"


def test_a_rejected_request_refuses_a_retry_with_its_csr(ew: TpmWorld) -> None:
    key = tpm_key(ew.swtpm.tcti)
    request_id = _pending(ew, key)["request_id"]
    with ew.store.tx() as tx:
        rejected = joinrequests.reject(
            tx, ew.tenant, ew.pool, request_id, reason="unknown serial", decided_by="test"
        )
    assert (rejected["state"], rejected["reason"]) == ("rejected", "unknown serial")
    ew.refused(ew.request(key), "request-rejected")
    assert ew.rows("SELECT id FROM join_challenges") == []
    with pytest.raises(ControlError) as info:
        _approve(ew, request_id)
    assert info.value.code == "INVALID_STATE"


def test_another_tenant_gets_not_found(ew: TpmWorld) -> None:
    request_id = _pending(ew, tpm_key(ew.swtpm.tcti))["request_id"]
    with ew.store.tx() as tx:
        other, _ = tenancy.create_tenant(tx, "other")
    for call in (
        lambda: _list(ew, tenant=other),
        lambda: _approve(ew, request_id, tenant=other),
    ):
        with pytest.raises(ControlError) as info:
            call()
        assert info.value.code == "NOT_FOUND"
    with pytest.raises(ControlError) as info, ew.store.tx() as tx:
        joinrequests.reject(tx, other, ew.pool, request_id, decided_by="x")
    assert info.value.code == "NOT_FOUND"
    with pytest.raises(ControlError) as info, ew.store.tx() as tx:
        joinrequests.approve(tx, ew.tenant, ew.pool, "jreq_" + "0" * 26, ttl_s=900, decided_by="x")
    assert info.value.code == "NOT_FOUND"
    assert ew.rows("SELECT state FROM join_requests") == [{"state": "pending"}]


def test_the_approval_ttl_is_60_to_86400_seconds(ew: TpmWorld) -> None:
    request_id = _pending(ew, tpm_key(ew.swtpm.tcti))["request_id"]
    for ttl in (59, 86_401, 0):
        with pytest.raises(ControlError) as info:
            _approve(ew, request_id, ttl)
        assert info.value.code == "INVALID_ARGUMENT"
    row = _approve(ew, request_id, 86_400)
    (stored,) = ew.rows("SELECT decided_at, expires_at FROM join_requests")
    assert stored["expires_at"] - stored["decided_at"] == 86_400_000
    assert row["state"] == "approved"
    parser = build_parser()
    base = ["join-requests", "approve", request_id, "--tenant", ew.tenant, "--pool", ew.pool]
    for bad in ("59", "86401", "15m"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--ttl", bad])
    assert parser.parse_args([*base, "--ttl", "60"]).ttl == 60
    assert parser.parse_args(["join-requests", "list", "--tenant", "t", "--pool", "p"]).state == (
        "pending"
    )


def test_an_expired_approval_defers_again(ew: TpmWorld, clock: ManualClock) -> None:
    key = tpm_key(ew.swtpm.tcti)
    request_id = _pending(ew, key)["request_id"]
    _approve(ew, request_id, 60)
    clock.advance(120_000)  # the approval was for 60 s
    body = _pending(ew, key)
    assert body["request_id"] != request_id
    assert ew.rows("SELECT id FROM nodes") == []


def test_decisions_publish_events(ew: TpmWorld) -> None:
    first = _pending(ew, tpm_key(ew.swtpm.tcti))["request_id"]
    _approve(ew, first)
    with ew.store.tx() as tx:
        tx.execute("UPDATE join_requests SET machine_key = 'moved'")
    second = _pending(ew, tpm_key(ew.swtpm.tcti))["request_id"]
    with ew.store.tx() as tx:
        joinrequests.reject(tx, ew.tenant, ew.pool, second, reason="no", decided_by="test")
    rows = ew.rows(
        "SELECT type, tenant_id, payload FROM events WHERE type LIKE 'security.join-request.%' "
        "ORDER BY created_at, id"
    )
    assert [(r["type"], r["tenant_id"]) for r in rows] == [
        ("security.join-request.approved", ew.tenant),
        ("security.join-request.rejected", ew.tenant),
    ]
    assert json.loads(rows[0]["payload"])["requestId"] == first
    assert json.loads(rows[1]["payload"])["requestId"] == second
    assert json.loads(rows[1]["payload"])["reason"] == "no"


@pytest.mark.parametrize("reason", ["rack\x1b[2J", "two\nlines", "nul\0", "sep\u2028"])
def test_a_decision_reason_is_printable_text(reason: str) -> None:
    """An operator's reason is printed by `requests show/list`: no escape sequence or
    line break can be stored in it."""
    from control.errors import ControlError

    with pytest.raises(ControlError) as err:
        joinrequests._reason(reason)
    assert err.value.code == "INVALID_ARGUMENT"
    assert joinrequests._reason("rack B7 intake") == "rack B7 intake"
