"""Renewal refusals at the real gateway over mutual TLS: one answer, the right event."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bcd import pki, wire
from bcd.identity import LoadedState, load_state
from bcd.renew import build_request
from tests.gatewaycalls import node_post
from tests.world import ControlPlane, Node

pytestmark = pytest.mark.e2e

REFUSED = {"code": "ACCESS_DENIED", "message": "Renew refused"}


async def _renew(
    cp: ControlPlane, as_state: LoadedState, body: bytes
) -> tuple[int, dict[str, Any]]:
    pin = cp.pins()["serving_ca_spki_pin"]
    resp = await node_post(cp.gateway_port, pin, as_state, "/v1/renew", body)
    return resp.status, json.loads(resp.body) if resp.status != 200 else {"signed": resp.body}


def _joined(
    cp: ControlPlane, tmp_path: Path, name: str, seed: int, pool: str, site: str
) -> LoadedState:
    node = Node.make(tmp_path / name, cp, site, seed=seed)
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    state = load_state(node.data_dir)
    assert state is not None
    return state


def _body(state: LoadedState, *, client_time_ms: int | None = None, **change: Any) -> bytes:
    now = int(time.time() * 1000) if client_time_ms is None else client_time_ms
    _csr, req = build_request(state, pki.generate_key(), now)
    obj = req.to_json()
    obj.update(change)
    return json.dumps(obj).encode()


async def test_each_renewal_refusal_gives_one_answer_and_its_event(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    a = _joined(cp, tmp_path, "a", 1, pool, site)
    b = _joined(cp, tmp_path, "b", 2, pool, site)

    status, answer = await _renew(cp, a, _body(a))
    assert status == 200, answer
    a = load_state(a.data_dir) or a  # the file on disk is unchanged: still the first leaf

    replayed = _body(b)
    cases: list[tuple[str, LoadedState, bytes]] = [
        ("identity-mismatch", a, _body(b)),
        ("clock-skew", b, _body(b, client_time_ms=int(time.time() * 1000) - 120_000)),
        ("pop-invalid", b, _body(b, pop_sig=pki.b64url(b"\x01" * 64))),
        ("csr-invalid", b, _bad_csr_body(b)),
        ("leaf-unknown", b, _body(b, chain=_foreign_chain())),
        ("pop-replay", b, replayed),
    ]
    status, _ = await _renew(cp, b, replayed)  # the first use of that proof succeeds
    assert status == 200
    for reason, caller, body in cases:
        status, answer = await _renew(cp, caller, body)
        assert (status, answer) == (403, REFUSED), reason
    reasons = sorted(e["reason"] for e in cp.events(type_="security.renew.refused"))
    assert reasons == sorted(r for r, _c, _b in cases)


async def test_a_revoked_certificate_is_unauthenticated_at_renew(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    a = _joined(cp, tmp_path, "a", 1, pool, site)
    done = cp.cli("nodes", "revoke-identity", a.identity.node_id, "--tenant", cp.root_tenant)
    assert done.returncode == 0, done.stderr
    status, answer = await _renew(cp, a, _body(a))
    assert status == 401
    assert answer["code"] == "UNAUTHENTICATED"
    revoked = [e for e in cp.events(type_="security.certificate-revoked")]
    assert [e["nodeId"] for e in revoked] == [a.identity.node_id]


def _bad_csr_body(state: LoadedState) -> bytes:
    """A proof that verifies, over a CSR that does not parse."""
    csr = b"\x30\x03\x02\x01\x00"
    now = int(time.time() * 1000)
    sig = pki.sign_p1363(state.key, pki.renew_pop_message(csr, state.identity.node_id, now))
    req = wire.RenewRequest(
        csr_der=csr, chain=state.identity.chain, client_time_ms=now, pop_sig=sig
    )
    return json.dumps(req.to_json()).encode()


def _foreign_chain() -> str:
    from tests.certs import node_identity

    _key, identity = node_identity()
    return identity.chain


def test_reset_and_reclaim_need_allow_reclaim(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site, seed=3)
    first = node.join(cp.token(pool)["token"])
    assert first.returncode == 0
    node_id = first.stdout.split()[2]
    refused = node.join(cp.token(pool)["token"], "--reset", "--yes")
    assert refused.returncode == 1
    assert "Join refused" in refused.stderr
    assert json.loads((node.data_dir / "identity.json").read_text())["node_id"] == node_id
    again = node.join(cp.token(pool, allowReclaim=True)["token"], "--reset", "--yes")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1].split()[2] == node_id
    ident = json.loads((node.data_dir / "identity.json").read_text())
    assert ident["identity_generation"] == 2
    with cp.store.tx() as tx:
        audit = [
            r["action"] for r in tx.query("SELECT action FROM audit WHERE subject = ?", (node_id,))
        ]
        certs = tx.query(
            "SELECT revoked_at, revoke_reason FROM node_certs WHERE node_id = ? "
            "ORDER BY created_at",
            (node_id,),
        )
    assert "node.reclaimed" in audit
    assert certs[0]["revoke_reason"] == "reclaimed"
    assert certs[1]["revoked_at"] is None
