"""Made-up machines cannot bury a real join request: pending requests are bounded per
pool, site and source address, and the list shows the newest first, page by page."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from bcd import wire
from bcd.attestor_api import Defer, ServerJoinContext, hookimpl
from bcd.plugins import load_plugins
from control import joinrequests
from control.errors import ControlError
from control.joinservice import JoinService
from control.server import join_crypto
from tests.world.joins import World, machine


class Enroller:
    """Defers every join of an unknown machine, like TPM enrolment of a made-up EK."""

    pool_id = ""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["enrol"]

    @hookimpl
    def bcd_server_verify(
        self, attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
    ) -> Any:
        return Defer(machine_key=secrets.token_hex(32), pool_id=self.pool_id)


def _service(world: World) -> JoinService:
    enroller = Enroller()
    enroller.pool_id = world.pool
    return JoinService(world.store, join_crypto(world.pki), load_plugins(extra=[enroller]))


def _join(world: World, svc: JoinService, n: int, ip: str) -> str:
    base = json.loads(world.body(None, machine(n), sealed=None).body)
    signed = svc.join(wire.dumps({**base, "attestor": "enrol"}), peer_ip=ip)
    return str(wire.verify_response(signed, world.signing_pin)["request_id"])


def test_one_address_cannot_fill_the_pending_requests(world: World) -> None:
    svc = _service(world)
    for i in range(joinrequests.MAX_PENDING_PER_SOURCE):
        _join(world, svc, 100 + i, "198.51.100.7")
    with pytest.raises(ControlError) as full:
        _join(world, svc, 999, "198.51.100.7")
    assert full.value.code == "RESOURCE_EXHAUSTED"
    assert full.value.retry_after_ms == joinrequests.PENDING_FULL_PUSHBACK_MS
    # a real machine elsewhere still gets its request recorded
    real = _join(world, svc, 1000, "192.0.2.10")
    with world.store.tx() as tx:
        page = joinrequests.list_requests(tx, world.tenant, world.pool, page_size=10)
    assert real in [item["id"] for item in page["items"]]  # newest first: on the first page
    assert "nextPageToken" in page


def test_the_pool_bound_holds_whatever_the_addresses(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(joinrequests, "MAX_PENDING_PER_POOL", 5)
    svc = _service(world)
    for i in range(5):
        _join(world, svc, 200 + i, f"203.0.113.{i + 1}")
    with pytest.raises(ControlError) as full:
        _join(world, svc, 299, "203.0.113.99")
    assert full.value.code == "RESOURCE_EXHAUSTED"
    assert len(world.rows("SELECT id FROM join_requests")) == 5


def test_pages_walk_every_request_newest_first(world: World) -> None:
    svc = _service(world)
    made = [_join(world, svc, 300 + i, f"203.0.113.{i + 1}") for i in range(7)]
    seen: list[str] = []
    token = None
    with world.store.tx() as tx:
        while True:
            page = joinrequests.list_requests(
                tx, world.tenant, world.pool, page_size=3, page_token=token
            )
            seen += [item["id"] for item in page["items"]]
            token = page.get("nextPageToken")
            if token is None:
                break
    assert sorted(seen) == sorted(made)  # each once (ties within a millisecond: by id)
    assert len(seen) == len(set(seen)) == 7
