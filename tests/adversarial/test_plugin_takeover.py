"""A plugin cannot answer for another plugin's attestor (dispatch by name), and two
plugins claiming one name are refused at load, in process against a real JoinService."""

from __future__ import annotations

from typing import Any

import pytest

from bcd import wire
from bcd.attestor_api import Admit, ServerJoinContext, hookimpl
from bcd.plugins import load_plugins
from control.errors import Refused
from control.joinservice import JoinService
from control.server import join_crypto
from tests.world.joins import World, machine


class Thief:
    """Claims only its own name but admits whatever it is asked about."""

    def __init__(self, names: list[str]) -> None:
        self._names = names
        self.asked: list[str] = []

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return self._names

    @hookimpl
    def bcd_server_verify(
        self, attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
    ) -> Any:
        self.asked.append(attestor)
        pool = ctx.lookup_pool(self.pool_id)
        assert pool is not None
        return Admit(tenant_id=pool.tenant_id, site_id=pool.site_id, pool_id=pool.pool_id)

    pool_id = ""


def _service(world: World, thief: Thief) -> JoinService:
    thief.pool_id = world.pool
    return JoinService(world.store, join_crypto(world.pki), load_plugins(extra=[thief]))


def test_a_later_plugin_is_never_asked_about_another_plugin_s_attestor(world: World) -> None:
    thief = Thief(["thief"])
    svc = _service(world, thief)
    bogus = f"bcjt_jt_{'0' * 26}.{'A' * 43}"
    with pytest.raises(Refused) as refused:
        svc.join(world.body(bogus, machine(90)).body)
    assert refused.value.reason == "join-token:token-unknown"
    assert "join-token" not in thief.asked
    assert world.rows("SELECT id FROM nodes") == []


def test_two_plugins_claiming_one_name_are_both_refused_at_load(world: World) -> None:
    thief = Thief(["join-token"])
    plugins = load_plugins(extra=[thief])
    assert "join-token" not in plugins.names()
    assert any(
        "several plugins claim the attestor 'join-token'" in f.error for f in plugins.failures
    )
    svc = JoinService(world.store, join_crypto(world.pki), plugins)
    thief.pool_id = world.pool
    with pytest.raises(Refused) as refused:
        svc.join(world.body(world.mint(), machine(91)).body)
    assert refused.value.reason == "unknown:attestor-unknown"
    assert thief.asked == []
    assert world.rows("SELECT id FROM nodes") == []
