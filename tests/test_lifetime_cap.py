"""An attestor's admission may shorten the certificate's lifetime (the seed: "an
attestor may shorten either"): ``Admit.max_lifetime_s``, in process against a real
JoinService and RenewService on both stores. The cap is kept with the node, so its
renewals are no longer than its join, and a re-join of the node (``Admit.node_id``)
cannot shed it; it never lengthens a lifetime; a cap below
``admission.MIN_LIFETIME_S`` (30 minutes: a shorter leaf would use up the node's
renewals of the hour) or not an int is the attestor's failure (``plugin-error``),
nothing issued.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bcd import pki as bpki
from bcd import wire
from bcd.attestor_api import Admit, ServerJoinContext, hookimpl
from bcd.plugins import load_plugins
from control import admission
from control.errors import Refused
from control.joinservice import JoinService
from control.pki import Pki
from control.renewal import RenewService
from control.server import join_crypto
from control.store import Store
from tests.world.joins import World, machine, make_world


class Capped:
    """Admits every machine into one pool, with the cap it is set to."""

    def __init__(self) -> None:
        self.pool_id = ""
        self.cap: Any = None
        self.node_id: str | None = None
        self.allow_reclaim = False

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["capped"]

    @hookimpl
    def bcd_server_verify(
        self, attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
    ) -> Any:
        pool = ctx.lookup_pool(self.pool_id)
        assert pool is not None
        return Admit(
            tenant_id=pool.tenant_id,
            site_id=pool.site_id,
            pool_id=pool.pool_id,
            role=request.role,
            node_key="unattested",
            max_lifetime_s=self.cap,
            node_id=self.node_id,
            allow_reclaim=self.allow_reclaim,
        )


class Env:
    def __init__(self, world: World) -> None:
        self.world = world
        self.plugin = Capped()
        self.plugin.pool_id = world.pool
        crypto = join_crypto(world.pki)
        self.joins = JoinService(world.store, crypto, load_plugins(extra=[self.plugin]))
        self.renewals = RenewService(world.store, crypto)

    def cap_of(self, joined: dict[str, Any]) -> int | None:
        rows = self.world.rows(
            "SELECT max_lifetime_s FROM nodes WHERE id = ?", (joined["node_id"],)
        )
        cap = rows[0]["max_lifetime_s"]
        return None if cap is None else int(cap)

    @property
    def pin(self) -> str:
        return self.world.signing_pin

    def join(
        self, n: int, *, role: str = "node", node_id: str | None = None
    ) -> tuple[dict[str, Any], Any]:
        key = bpki.generate_key()
        request = wire.JoinRequest(
            role=role,
            attestor="capped",
            sealed_token=None,
            csr_der=bpki.make_csr(key),
            claims=machine(n),
            evidence={},
            node_id=node_id,
            daemon_version="0.1.0-test",
        )
        body = wire.verify_response(self.joins.join(wire.dumps(request.to_json())), self.pin)
        return body, key

    def renew(self, joined: dict[str, Any], key: Any) -> tuple[dict[str, Any], Any]:
        leaf = bpki.load_pem_chain(joined["chain"])[0]
        new_key = bpki.generate_key()
        csr = bpki.make_csr(new_key)
        now = int(time.time() * 1000)
        sig = bpki.sign_p1363(key, bpki.renew_pop_message(csr, joined["node_id"], now))
        body = wire.dumps(wire.RenewRequest(csr, joined["chain"], now, sig, None).to_json())
        peer = leaf.public_bytes(serialization.Encoding.DER)
        return wire.verify_response(self.renewals.renew(body, peer), self.pin), new_key


def lifetime_s(body: dict[str, Any]) -> int:
    leaf: x509.Certificate = bpki.load_pem_chain(body["chain"])[0]
    return int((leaf.not_valid_after_utc - leaf.not_valid_before_utc).total_seconds())


@pytest.fixture
def env(store: Store, memory_pki: Pki) -> Env:
    return Env(make_world(store, memory_pki))


def test_a_capped_admission_is_issued_for_the_cap_and_renewed_for_it(env: Env) -> None:
    env.plugin.cap = 2_700
    joined, key = env.join(1)
    assert lifetime_s(joined) == 2_700
    env.plugin.cap = None  # the cap is the node's, not the attestor's of the moment
    renewed, key = env.renew(joined, key)
    assert lifetime_s(renewed) == 2_700
    again, _ = env.renew(renewed, key)
    assert lifetime_s(again) == 2_700
    assert env.cap_of(joined) == 2_700


def test_a_rejoin_cannot_shed_the_nodes_cap(env: Env) -> None:
    """A re-join of exactly this node (x509pop's, with no cap of its own) keeps the
    shorter of the node's cap and its own: so do the renewals after it."""
    env.plugin.cap = 3_600
    joined, _ = env.join(9)
    node_id = joined["node_id"]
    env.plugin.cap, env.plugin.node_id = None, node_id
    rejoined, key = env.join(9, node_id=node_id)
    assert rejoined["node_id"] == node_id
    assert lifetime_s(rejoined) == 3_600
    assert env.cap_of(rejoined) == 3_600
    assert lifetime_s(env.renew(rejoined, key)[0]) == 3_600
    env.plugin.cap = 7_200  # a longer cap does not lengthen it either
    assert lifetime_s(env.join(9, node_id=node_id)[0]) == 3_600
    env.plugin.cap = 2_000  # a shorter one shortens it
    again, key = env.join(9, node_id=node_id)
    assert lifetime_s(again) == 2_000
    assert env.cap_of(again) == 2_000
    assert lifetime_s(env.renew(again, key)[0]) == 2_000


def test_a_hardware_reclaim_takes_the_cap_of_its_fresh_admission(env: Env) -> None:
    """The admitting attestor proved the machine afresh: its Admit sets the cap."""
    env.plugin.cap = 3_600
    joined, _ = env.join(10)
    env.plugin.cap, env.plugin.allow_reclaim = None, True
    reclaimed, key = env.join(10)
    assert reclaimed["node_id"] == joined["node_id"]
    assert lifetime_s(reclaimed) == 86_400
    assert env.cap_of(reclaimed) is None
    assert lifetime_s(env.renew(reclaimed, key)[0]) == 86_400


def test_without_a_cap_the_default_lifetimes_hold(env: Env) -> None:
    joined, key = env.join(2)
    assert lifetime_s(joined) == 86_400
    renewed, _ = env.renew(joined, key)
    assert lifetime_s(renewed) == 86_400
    ramdisk, _ = env.join(3, role="ramdisk")
    assert lifetime_s(ramdisk) == 7_200


def test_a_cap_never_lengthens_a_lifetime(env: Env) -> None:
    env.plugin.cap = 200_000
    joined, key = env.join(4)
    assert lifetime_s(joined) == 86_400
    renewed, _ = env.renew(joined, key)
    assert lifetime_s(renewed) == 86_400
    env.plugin.cap = 10_000
    ramdisk, ramdisk_key = env.join(5, role="ramdisk")
    assert lifetime_s(ramdisk) == 7_200
    assert lifetime_s(env.renew(ramdisk, ramdisk_key)[0]) == 7_200
    env.plugin.cap = 3_000
    short, short_key = env.join(6, role="ramdisk")
    assert lifetime_s(short) == 3_000
    assert lifetime_s(env.renew(short, short_key)[0]) == 3_000


@pytest.mark.parametrize("cap", [1_799, 60, 0, -1, 1_800.0, "3600", True])
def test_a_cap_below_the_minimum_or_not_an_int_is_a_plugin_error(env: Env, cap: object) -> None:
    env.plugin.cap = cap
    before = env.world.snapshot()
    with pytest.raises(Refused) as refused:
        env.join(7)
    assert (refused.value.code, refused.value.message) == ("ACCESS_DENIED", "Join refused")
    assert refused.value.reason == "capped:plugin-error"
    assert env.world.snapshot() == before
    (event,) = env.world.events(env.world.tenant, "security.join.refused")
    assert event["payload"]["reason"] == "capped:plugin-error"


def test_a_cap_of_the_minimum_is_kept(env: Env) -> None:
    assert admission.MIN_LIFETIME_S == 1_800
    env.plugin.cap = 1_800
    joined, key = env.join(8)
    assert lifetime_s(joined) == 1_800
    assert lifetime_s(env.renew(joined, key)[0]) == 1_800
