"""Renewal (seed 003, "Renewal"): renewOnce, its answer checks, the task's timing and backoff.

Time is trio's MockClock (``autojump_clock``) and a wall clock tied to it, so a
14-hour wait or a 10-minute backoff takes no real time. The gateway is a fake that
checks the request like JoinService would and answers with real leaves from
``control.pki`` signed by the real join-signing key.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bcd import pki, wire
from bcd.config import Config
from bcd.errors import (
    BcdError,
    CertificateRevoked,
    GatewayUnauthenticated,
    IdentityExpired,
    JoinError,
    RetryableError,
    TransportError,
)
from bcd.gatewayanswer import Response
from bcd.identity import LoadedState, load_state
from bcd.keys.file import key_to_pem, load_key_pem
from bcd.keys.node import FileKey
from bcd.renew import (
    BACKOFF_MAX_S,
    OLD_KEY_HOLD_S,
    REFUSED,
    OldKeys,
    backoff_s,
    format_duration,
    gateway_renew_sender,
    renew_answer,
    renew_at,
    renew_once,
    renewal_task,
)
from control import http
from control.pki import Pki, make_gateway_cert, server_ssl_context
from tests.world.agent import NODE, SITE, T0, TTL_S, FakeGateway, at, joined_state, pin, wall

OTHER_NODE = "node_" + "c" * 26
OTHER_SITE = "site_" + "d" * 26
LOG = logging.getLogger("bcd.test.renew")


# --- pure parts -------------------------------------------------------------------


def test_renew_at_is_60_percent_of_the_lifetime() -> None:
    start = datetime(2025, 1, 1, tzinfo=UTC)
    assert renew_at(start, start + timedelta(hours=24)) == start + timedelta(hours=14, minutes=24)
    assert renew_at(start, start + timedelta(hours=2)) == start + timedelta(minutes=72)
    assert renew_at(start, start + timedelta(hours=10), 0.5) == start + timedelta(hours=5)
    with pytest.raises(ValueError, match="lifetime"):
        renew_at(start, start)
    with pytest.raises(ValueError, match="fraction"):
        renew_at(start, start + timedelta(hours=1), 1.0)


def test_backoff_is_30_seconds_doubling_to_10_minutes() -> None:
    assert [backoff_s(n) for n in range(1, 9)] == [30, 60, 120, 240, 480, 600, 600, 600]
    assert backoff_s(10_000) == BACKOFF_MAX_S


def test_expires_in_is_written_like_a_duration() -> None:
    assert format_duration(5 * 3600 + 12 * 60 + 59) == "5h12m"
    assert format_duration(12 * 60 + 30) == "12m30s"
    assert format_duration(45.9) == "45s"
    assert format_duration(0) == "0s"
    assert format_duration(-300) == "-5m0s"


def _resp(status: int, body: object, **headers: str) -> Response:
    return Response(status, headers, wire.dumps(body) if not isinstance(body, bytes) else body)


def test_gateway_answers_are_mapped() -> None:
    assert renew_answer(_resp(200, b"a.b.c")) == "a.b.c"
    with pytest.raises(GatewayUnauthenticated, match="revoked or unknown") as unauth:
        renew_answer(_resp(401, {"code": "UNAUTHENTICATED", "message": "no", "notice": "n"}))
    assert unauth.value.notice == "n"  # judged by the renewal task (bcd.revocation)
    with pytest.raises(RetryableError) as info:
        renew_answer(
            _resp(
                429,
                {"code": "RESOURCE_EXHAUSTED", "message": "slow"},
                **{"retry-pushback-ms": "1500"},
            )
        )
    assert info.value.pushback_s == 1.5
    with pytest.raises(RetryableError) as info:
        renew_answer(_resp(503, {"code": "UNAVAILABLE", "message": "later"}))
    assert info.value.pushback_s is None
    with pytest.raises(RetryableError) as info:
        renew_answer(
            _resp(503, {"code": "UNAVAILABLE", "message": "x"}, **{"retry-pushback-ms": "-1"})
        )
    assert info.value.pushback_s is None
    with pytest.raises(JoinError) as refused:
        renew_answer(_resp(403, {"code": "ACCESS_DENIED", "message": "Renew refused"}))
    assert str(refused.value) == REFUSED
    assert not isinstance(refused.value, RetryableError)
    with pytest.raises(RetryableError, match="HTTP 502"):
        renew_answer(_resp(502, b"<html>bad gateway</html>"))


# --- renewOnce --------------------------------------------------------------------


async def test_renew_once_stores_a_new_key_and_certificate(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    state = joined_state(tmp_path, memory_pki, wall())
    gateway = FakeGateway(memory_pki, tmp_path)
    new = await renew_once(state, gateway.factory(state), signing_pin=pin(memory_pki), wall=wall)
    # node.key.next was on disk, holding the key of the CSR, before the request went out
    req = gateway.requests[0]
    csr_key = pki.csr_public_key(pki.parse_csr(req.csr_der))
    assert pki.same_public_key(load_key_pem(gateway.next_key_at_send[0]).public_key(), csr_key)
    assert req.client_time_ms == int(T0 * 1000)
    # the new state: new key, new leaf, same node; trust version, bundle, server time updated
    assert pki.same_public_key(new.key.public_key(), csr_key)
    assert not pki.same_public_key(new.key.public_key(), state.key.public_key())
    assert new.leaf_info.spiffe == state.leaf_info.spiffe
    assert new.leaf_info.serial_hex != state.leaf_info.serial_hex
    assert new.identity.trust_version == 2
    assert new.identity.bundle == memory_pki.bundle_pem()
    assert new.identity.server_time != state.identity.server_time
    assert new.identity.identity_generation == 1
    # on disk: what the next start loads is exactly the new state
    assert not (tmp_path / "node.key.next").exists()
    loaded = load_state(tmp_path)
    assert loaded is not None
    assert loaded.next_key == "none"
    assert loaded.identity == new.identity
    assert (tmp_path / "node.key").read_bytes() == key_to_pem(new.key)


def _other_spiffe(node: str = OTHER_NODE, site: str = SITE, td: str = "td.example") -> Any:
    return pki.SpiffeId(td, site, node)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ({"signer": pki.generate_key()}, "pinned join-signing key"),
        ({"kind": "joined"}, "not 'renewed'"),
        ({"csr_sha256": "0" * 64}, "csr_sha256 differs"),
        ({"leaf_key": pki.generate_key().public_key()}, "does not certify this node's key"),
        ({"spiffe": _other_spiffe()}, "is not this node's"),
        ({"spiffe": _other_spiffe(node=NODE, site=OTHER_SITE)}, "is not this node's"),
        ({"role": "site"}, "role site is not the requested node"),
        ({"role": "node-tenant"}, "role node-tenant is not the requested node"),
    ],
    ids=["signer", "kind", "csr", "key", "node", "site", "role", "role-node-tenant"],
)
async def test_a_wrong_answer_is_refused_and_nothing_changes(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
    tamper: dict[str, Any],
    message: str,
) -> None:
    state = joined_state(tmp_path, memory_pki, wall())
    before = {n: (tmp_path / n).read_bytes() for n in ("identity.json", "node.key")}
    gateway = FakeGateway(memory_pki, tmp_path, tamper=tamper)
    with pytest.raises(JoinError, match=message):
        await renew_once(state, gateway.factory(state), signing_pin=pin(memory_pki), wall=wall)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    loaded = load_state(tmp_path)
    assert loaded is not None
    assert loaded.next_key == "removed"  # the stale next key goes at the next start
    assert loaded.identity == state.identity


async def test_another_trust_domain_is_refused(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    """The leaf and the body both name another trust domain: not this node."""
    from control.pki import build_pki

    other = build_pki("other.example", at(T0))
    state = joined_state(tmp_path, memory_pki, wall())
    gateway = FakeGateway(
        other, tmp_path, tamper={"spiffe": _other_spiffe(NODE, SITE, "other.example")}
    )
    with pytest.raises(JoinError, match="is not this node's"):
        await renew_once(state, gateway.factory(state), signing_pin=pin(other), wall=wall)


async def test_a_failed_store_that_did_land_is_adopted(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rename failed after identity.json was written: the settled disk is the renewal."""
    from bcd import identitystore as identity_mod

    state = joined_state(tmp_path, memory_pki, wall())
    real_rename = identity_mod.os.rename

    def failing_rename(src: Any, dst: Any) -> None:
        if str(dst).endswith("node.key"):
            monkeypatch.setattr(identity_mod.os, "rename", real_rename)
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(identity_mod.os, "rename", failing_rename)
    new = await renew_once(
        state,
        FakeGateway(memory_pki, tmp_path).factory(state),
        signing_pin=pin(memory_pki),
        wall=wall,
    )
    assert new.next_key == "promoted"
    assert new.identity != state.identity
    assert load_state(tmp_path) is not None


# --- the task: timing, backoff, pushback, revocation ------------------------------


@dataclass
class Holder:
    """What ``bcd node`` keeps: the current state, read by every task."""

    state: LoadedState
    history: list[tuple[float, LoadedState]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)

    def get(self) -> LoadedState:
        return self.state

    def set(self, state: LoadedState) -> None:
        self.history.append((trio.current_time(), state))
        self.state = state
        self.changed.set()


async def _run(holder: Holder, gateway: FakeGateway, memory_pki: Pki, **kwargs: Any) -> None:
    await renewal_task(
        holder.get,
        holder.set,
        gateway.factory,
        signing_pin=pin(memory_pki),
        wall=wall,
        log=LOG,
        **kwargs,
    )


def _due(state: LoadedState) -> float:
    return renew_at(state.leaf_info.not_before, state.leaf_info.not_after).timestamp()


async def test_the_task_sleeps_until_60_percent_then_renews_each_new_leaf(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall(), ttl_s=24 * 3600))
    gateway = FakeGateway(memory_pki, tmp_path, ttl_s=24 * 3600)
    real_start = time.monotonic()
    dues: list[float] = []

    def on_call(n: int) -> None:
        dues.append(_due(holder.state))
        if n == 3:
            gateway.failures.append(CertificateRevoked("stop"))

    gateway.on_call = on_call
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    assert len(gateway.calls) == 3
    assert gateway.calls == pytest.approx(dues, abs=1e-3)
    # about 14.4 hours apart (60 % of 24 h leaves, less what a new leaf is backdated)
    gap = gateway.calls[1] - gateway.calls[0]
    assert 0.5 * 24 * 3600 < gap <= 0.6 * 24 * 3600
    assert len(holder.history) == 2
    # each sender was built from the state of its time: the new key signs the next call
    assert [s.leaf_info.serial_hex for s in gateway.senders[1:]] == [
        s.leaf_info.serial_hex for _, s in holder.history
    ]
    assert time.monotonic() - real_start < 10  # no real sleeping


async def test_a_leaf_past_its_renewal_time_is_renewed_at_once(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall() - 0.9 * TTL_S))
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.on_call = lambda n: (
        gateway.failures.append(CertificateRevoked("stop")) if n == 2 else None
    )
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    assert gateway.calls[0] == T0


async def test_failures_back_off_from_30_seconds_to_10_minutes(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = joined_state(tmp_path, memory_pki, wall(), ttl_s=24 * 3600)
    holder = Holder(state)
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.failures = [TransportError("the gateway is down") for _ in range(9)]
    gateway.failures.append(CertificateRevoked("stop"))
    caplog.set_level(logging.WARNING, logger=LOG.name)
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    gaps = [b - a for a, b in zip(gateway.calls, gateway.calls[1:], strict=False)]
    assert gaps == pytest.approx([30, 60, 120, 240, 480, 600, 600, 600, 600], abs=1e-6)
    assert gateway.calls[0] == pytest.approx(_due(state), abs=1e-3)
    # logged as "renewal failed" with the attempt and expiresIn
    failed = [r for r in caplog.records if r.getMessage().startswith("renewal failed")]
    assert len(failed) == 9
    expires = state.leaf_info.not_after.timestamp()
    for n, (record, call) in enumerate(zip(failed, gateway.calls, strict=False), start=1):
        assert record.levelno == logging.WARNING
        assert record.attempt == n  # type: ignore[attr-defined]
        assert record.expiresIn == format_duration(expires - call)  # type: ignore[attr-defined]
        assert record.getMessage() == (
            f"renewal failed (attempt {n}, expiresIn {format_duration(expires - call)}): "
            "the gateway is down"
        )
    assert failed[0].expiresIn == "9h36m"  # type: ignore[attr-defined] # 40 % of 24 h
    assert holder.history == []


async def test_a_busy_gateways_pushback_is_waited_exactly(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.failures = [
        RetryableError("RESOURCE_EXHAUSTED: slow down", 12.345),
        TransportError("down"),  # attempt 2 without pushback: the backoff's 60 s
        RetryableError("UNAVAILABLE: later", 0.25),  # below the floor: waited 1 s
    ]
    gateway.on_call = lambda n: (
        gateway.failures.append(CertificateRevoked("stop")) if n == 5 else None
    )
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    gaps = [b - a for a, b in zip(gateway.calls, gateway.calls[1:], strict=False)]
    assert gaps[:3] == pytest.approx([12.345, 60, 1.0], abs=1e-6)
    assert len(holder.history) == 1  # the fourth call renewed
    assert gateway.calls[4] == pytest.approx(_due(holder.state), abs=1e-3)


async def test_access_denied_is_retried_like_any_failure(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.failures = [JoinError(REFUSED), JoinError(REFUSED), CertificateRevoked("stop")]
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    assert len(gateway.calls) == 3


async def test_a_revoked_certificate_stops_the_task_and_deletes_nothing(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    before = {n: (tmp_path / n).read_bytes() for n in ("identity.json", "node.key")}
    gateway = FakeGateway(memory_pki, tmp_path, failures=[CertificateRevoked("revoked")])
    with pytest.raises(CertificateRevoked, match="revoked"):
        await _run(holder, gateway, memory_pki)
    assert len(gateway.calls) == 1
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert load_state(tmp_path) is not None


async def test_a_store_failure_the_disk_survived_is_adopted_by_the_task(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rename failed and the settling right after it too: the task settles it later."""
    from bcd import identitystore as identity_mod
    from bcd import renew as renew_mod

    first = joined_state(tmp_path, memory_pki, wall())
    holder = Holder(first)
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.on_call = lambda n: (
        gateway.failures.append(CertificateRevoked("stop")) if n == 2 else None
    )
    real_rename, real_reload = identity_mod.os.rename, renew_mod._reload

    def failing_rename(src: Any, dst: Any) -> None:
        if str(dst).endswith("node.key"):
            monkeypatch.setattr(identity_mod.os, "rename", real_rename)
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    def failing_reload(data_dir: Path) -> LoadedState | None:
        monkeypatch.setattr(renew_mod, "_reload", real_reload)
        return None

    monkeypatch.setattr(identity_mod.os, "rename", failing_rename)
    monkeypatch.setattr(renew_mod, "_reload", failing_reload)
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki)
    ((_, adopted),) = holder.history
    assert adopted.next_key == "promoted"
    assert adopted.leaf == gateway.issued[0]
    # adopted as a success: the next renewal waits for 60 % of the adopted leaf
    assert gateway.calls[1] == pytest.approx(_due(adopted), abs=1e-3)


async def test_a_bug_is_not_swallowed(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    gateway = FakeGateway(memory_pki, tmp_path, failures=[ZeroDivisionError()])
    with pytest.raises(ZeroDivisionError):
        await _run(holder, gateway, memory_pki)


async def test_an_expired_certificate_stops_the_renewal_with_the_way_back(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall() - 2 * TTL_S))
    gateway = FakeGateway(memory_pki, tmp_path, failures=[JoinError(REFUSED)])
    with pytest.raises(IdentityExpired, match="bcd join --reset --yes, then bcd join"):
        await _run(holder, gateway, memory_pki)
    assert gateway.calls == []  # no renewal can succeed: nothing was sent


async def test_unauthenticated_stops_the_renewal_only_with_a_signed_notice(
    tmp_path: Path,
    memory_pki: Pki,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = joined_state(tmp_path, memory_pki, wall())
    unsigned = GatewayUnauthenticated("no", notice=None)
    forged = GatewayUnauthenticated(
        "no",
        notice=wire.sign_response(
            wire.revocation_notice_body(state.identity.node_id, state.leaf_info.serial_hex, "x", 0),
            pki.generate_key(),
        ),
    )
    signed = GatewayUnauthenticated(
        "no",
        notice=wire.sign_response(
            wire.revocation_notice_body(
                state.identity.node_id, state.leaf_info.serial_hex, "key compromised", 0
            ),
            memory_pki.join_signing_key,
        ),
    )
    holder = Holder(state)
    gateway = FakeGateway(memory_pki, tmp_path, failures=[unsigned, forged, signed])
    caplog.set_level(logging.INFO, logger=LOG.name)
    with pytest.raises(CertificateRevoked, match="key compromised"):
        await _run(holder, gateway, memory_pki, fraction=0.01)
    failed = [r for r in caplog.records if r.getMessage().startswith("renewal failed")]
    assert len(failed) == 2  # the unsigned and the forged answers were retried


# --- the old key: held 5 minutes, then unloaded ---------------------------------------


async def test_the_old_key_is_unloaded_5_minutes_after_a_renewal(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    first = joined_state(tmp_path, memory_pki, wall())
    holder = Holder(first)
    gateway = FakeGateway(memory_pki, tmp_path)
    unloaded: list[tuple[float, Any]] = []
    old_keys = OldKeys(on_unload=lambda key: unloaded.append((trio.current_time(), key)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(_run, holder, gateway, memory_pki, old_keys=old_keys))
        await holder.changed.wait()
        renewed_at = holder.history[0][0]
        assert old_keys.keys() == (FileKey(first.key),)
        await trio.sleep_until(renewed_at + OLD_KEY_HOLD_S - 0.5)
        assert len(old_keys) == 1
        await trio.sleep_until(renewed_at + OLD_KEY_HOLD_S + 0.5)
        assert len(old_keys) == 0
        nursery.cancel_scope.cancel()
    assert unloaded == [(renewed_at + OLD_KEY_HOLD_S, FileKey(first.key))]
    assert OLD_KEY_HOLD_S == 300


def test_old_keys_holder() -> None:
    a, b = pki.generate_key(), pki.generate_key()
    keys = OldKeys(hold_s=300)
    assert keys.next_due() is None
    keys.retire(a, 10.0)
    keys.retire(b, 100.0)
    assert keys.next_due() == 310.0
    assert len(keys.unload_due(309.9)) == 0
    assert len(keys.unload_due(310.0)) == 1
    assert keys.keys() == (b,)
    assert keys.next_due() == 400.0
    assert len(keys.unload_due(1000.0)) == 1
    assert len(keys) == 0


async def test_a_renewal_is_written_to_the_journal(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    gateway = FakeGateway(memory_pki, tmp_path)
    gateway.on_call = lambda n: (
        gateway.failures.append(CertificateRevoked("stop")) if n == 2 else None
    )
    recorded: list[tuple[str, dict[str, Any]]] = []

    async def record(kind: str, payload: dict[str, Any]) -> None:
        recorded.append((kind, payload))

    first_serial = holder.state.leaf_info.serial_hex
    with pytest.raises(CertificateRevoked):
        await _run(holder, gateway, memory_pki, record=record)
    assert recorded == [
        (
            "renewed",
            {
                "previousSerial": first_serial,
                "serial": holder.state.leaf_info.serial_hex,
                "notAfter": holder.state.identity.not_after,
                "spkiSha256": holder.state.leaf_info.spki_sha256,
            },
        )
    ]


async def test_a_stop_while_a_renewal_is_journalled_still_journals_it(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    """SIGTERM cancels the agent's tasks; a renewal already stored and in use is
    journalled all the same (the textfile's last renewal at the next start is the
    journal's)."""
    holder = Holder(joined_state(tmp_path, memory_pki, wall()))
    gateway = FakeGateway(memory_pki, tmp_path)
    recorded: list[str] = []
    entered = trio.Event()

    async def record(kind: str, payload: dict[str, Any]) -> None:
        entered.set()
        await trio.sleep(1)  # the write in its worker thread, while the stop arrives
        recorded.append(payload["serial"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(_run, holder, gateway, memory_pki, record=record))
        await entered.wait()
        nursery.cancel_scope.cancel()
    assert recorded == [holder.state.leaf_info.serial_hex]


# --- over real mutual TLS -----------------------------------------------------------


@dataclass
class TlsGateway:
    """A gateway on loopback: mutual TLS, POST /v1/renew answered by a FakeGateway."""

    fake: FakeGateway
    peers: list[bytes] = field(default_factory=list)
    answer: str = "ok"

    async def handler(self, request: http.Request) -> http.Response:
        assert request.path == "/v1/renew"
        assert request.peer_cert_der is not None
        self.peers.append(request.peer_cert_der)
        if self.answer == "unauthenticated":
            return http.error_response("UNAUTHENTICATED", "certificate not accepted")
        if self.answer == "busy":
            return http.error_response(
                "RESOURCE_EXHAUSTED", "too many renewals", [("retry-pushback-ms", "2500")]
            )
        if self.answer == "denied":
            return http.error_response("ACCESS_DENIED", "Renew refused")
        peer = x509.load_der_x509_certificate(request.peer_cert_der)
        signed = await self.fake.send(peer, request.body)
        return http.Response(200, signed.encode("ascii"), [("content-type", "application/jose")])


@pytest.fixture
async def tls_gateway(
    nursery: trio.Nursery, tmp_path: Path, memory_pki: Pki
) -> tuple[TlsGateway, Config]:
    gw_key = pki.generate_key()
    gw_cert = make_gateway_cert(memory_pki, gw_key.public_key(), "gw.test", at(time.time()))
    ctx = server_ssl_context(
        pki.cert_pem(gw_cert) + pki.cert_pem(memory_pki.serving_ca),
        gw_key,
        client_ca_pem=memory_pki.chain_tail_pem(),
    )
    gateway = TlsGateway(FakeGateway(memory_pki, tmp_path, clock=time.time))
    port = await nursery.start(
        functools.partial(http.serve, gateway.handler, "127.0.0.1", 0, ssl_context=ctx)
    )
    pins = memory_pki.pins()
    cfg = Config(
        path=tmp_path / "config.toml",
        gateway_url=f"https://127.0.0.1:{port}",
        site=SITE,
        serving_ca_spki_pin=pins["serving_ca_spki_pin"],
        join_signing_key_pin=pins["join_signing_key_pin"],
        join_encryption_key_pin=pins["join_encryption_key_pin"],
        server_name="gw.test",
        data_dir=tmp_path,
    )
    return gateway, cfg


def _der(state: LoadedState) -> bytes:
    return state.leaf.public_bytes(serialization.Encoding.DER)


async def test_renewal_over_mutual_tls_uses_the_new_key_next_time(
    tmp_path: Path, memory_pki: Pki, tls_gateway: tuple[TlsGateway, Config]
) -> None:
    gateway, cfg = tls_gateway
    first = joined_state(tmp_path, memory_pki, time.time())
    pin_ = cfg.join_signing_key_pin
    second = await renew_once(
        first, gateway_renew_sender(cfg, first), signing_pin=pin_, wall=time.time
    )
    third = await renew_once(
        second, gateway_renew_sender(cfg, second), signing_pin=pin_, wall=time.time
    )
    assert gateway.peers == [_der(first), _der(second)]
    loaded = load_state(tmp_path)
    assert loaded is not None
    assert loaded.identity == third.identity


async def test_gateway_refusals_over_mutual_tls(
    tmp_path: Path, memory_pki: Pki, tls_gateway: tuple[TlsGateway, Config]
) -> None:
    gateway, cfg = tls_gateway
    state = joined_state(tmp_path, memory_pki, time.time())
    send = gateway_renew_sender(cfg, state)
    gateway.answer = "unauthenticated"
    with pytest.raises(GatewayUnauthenticated):
        await renew_once(state, send, signing_pin=cfg.join_signing_key_pin, wall=time.time)
    gateway.answer = "busy"
    with pytest.raises(RetryableError) as info:
        await renew_once(state, send, signing_pin=cfg.join_signing_key_pin, wall=time.time)
    assert info.value.pushback_s == 2.5
    gateway.answer = "denied"
    with pytest.raises(JoinError, match="Renew refused"):
        await renew_once(state, send, signing_pin=cfg.join_signing_key_pin, wall=time.time)
    assert gateway.peers == [_der(state)] * 3
    assert isinstance(info.value, BcdError)
