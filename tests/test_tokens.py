"""joinTokens.create / list / revoke on the real store (SQLite and PostgreSQL)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from control import events, tenancy, tokens
from control.clock import ManualClock
from control.errors import ControlError
from control.store import Store

TOKEN_FORM = re.compile(r"^bcjt_(jt_[0-9a-z]{26})\.([A-Za-z0-9_-]{43})$")
RECORD_KEYS = {
    "id",
    "poolId",
    "siteId",
    "role",
    "usesLeft",
    "maxUses",
    "expect",
    "allowReclaim",
    "hosted",
    "createdAt",
    "expiresAt",
    "revoked",
}


@dataclass
class World:
    store: Store
    root: str
    tenant: str
    other: str
    site: str
    pool: str
    pool2: str
    other_pool: str
    root_pool: str

    def create(self, *, tenant: str | None = None, pool: str | None = None, **kw: Any) -> Any:
        kw.setdefault("ttl_s", 3600)
        with self.store.tx() as tx:
            return tokens.create(tx, tenant or self.tenant, pool or self.pool, **kw)

    def list(self, *, tenant: str | None = None, pool: str | None = None, **kw: Any) -> Any:
        with self.store.tx() as tx:
            return tokens.list_tokens(tx, tenant or self.tenant, pool or self.pool, **kw)

    def revoke(self, token_id: str, *, tenant: str | None = None, pool: str | None = None) -> Any:
        with self.store.tx() as tx:
            return tokens.revoke(tx, tenant or self.tenant, pool or self.pool, token_id)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> None:
        with self.store.tx() as tx:
            tx.execute(statement, params)

    def row(self, token_id: str) -> dict[str, Any]:
        with self.store.tx() as tx:
            row = tx.one("SELECT * FROM join_tokens WHERE id = ?", (token_id,))
        assert row is not None
        return row

    def events(self, tenant: str, type_: str) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return events.list_events(tx, tenant, type_, limit=10_000)

    def count(self) -> int:
        with self.store.tx() as tx:
            row = tx.one("SELECT COUNT(*) AS n FROM join_tokens")
        assert row is not None
        return int(row["n"])


@pytest.fixture
def world(store: Store) -> World:
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        tenant, _ = tenancy.create_tenant(tx, "acme")
        other, _ = tenancy.create_tenant(tx, "globex")
        site = tenancy.create_site(tx, tenant, "rack-b7")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "gpu", "bcd", {})["id"]
        pool2 = tenancy.create_pool(tx, tenant, site, "cpu", "bcd", {})["id"]
        other_site = tenancy.create_site(tx, other, "elsewhere")["id"]
        other_pool = tenancy.create_pool(tx, other, other_site, "theirs", "bcd", {})["id"]
        root_site = tenancy.create_site(tx, root, "platform-dc")["id"]
        root_pool = tenancy.create_pool(tx, root, root_site, "sites", "bcd", {})["id"]
    return World(store, root, tenant, other, site, pool, pool2, other_pool, root_pool)


def code_of(call: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(ControlError) as info:
        call(*args, **kw)
    return info.value.code


# --- create -------------------------------------------------------------------


def test_create_returns_the_record_and_the_token_once(world: World) -> None:
    created = world.create(
        ttl_s=3600,
        max_uses=3,
        expect={"serial": "sn-7701"},
        idempotency_key="adopt-rack-b7-u12",
    )
    assert set(created) == RECORD_KEYS | {"token"}
    m = TOKEN_FORM.fullmatch(created["token"])
    assert m is not None
    assert m.group(1) == created["id"]
    assert created["poolId"] == world.pool
    assert created["siteId"] == world.site
    assert created["role"] == "node"
    assert (created["usesLeft"], created["maxUses"]) == (3, 3)
    assert created["expect"] == {"serial": "SN-7701"}
    assert created["allowReclaim"] is False
    assert created["hosted"] is None
    assert created["revoked"] is False
    assert created["createdAt"].endswith("Z")
    assert created["expiresAt"].endswith("Z")
    row = world.row(created["id"])
    assert row["expires_at"] - row["created_at"] == 3600 * 1000
    assert row["tenant_id"] == world.tenant


def test_only_the_sha256_of_the_secret_is_stored(world: World) -> None:
    created = world.create()
    secret = created["token"].split(".", 1)[1]
    row = world.row(created["id"])
    assert row["secret_sha256"] == hashlib.sha256(secret.encode("ascii")).hexdigest()
    for column, value in row.items():
        assert secret not in str(value), column
    with world.store.tx() as tx:
        for table in ("events", "audit"):
            for r in tx.query(f"SELECT * FROM {table}"):
                assert secret not in json.dumps(r, default=str)


def test_every_token_has_its_own_secret(world: World) -> None:
    a, b = world.create(max_uses=1), world.create(max_uses=1)
    assert a["id"] != b["id"]
    assert a["token"].split(".")[1] != b["token"].split(".")[1]


def test_create_for_another_tenants_pool_is_not_found(world: World) -> None:
    assert code_of(world.create, pool=world.other_pool) == "NOT_FOUND"
    assert code_of(world.create, tenant=world.other, pool=world.pool) == "NOT_FOUND"
    assert code_of(world.create, pool="pool_doesnotexist") == "NOT_FOUND"
    assert world.count() == 0


def test_create_for_a_pool_without_the_daemon_is_invalid_state(world: World) -> None:
    with world.store.tx() as tx:
        pool = tenancy.create_pool(tx, world.tenant, world.site, "bare", "none", {})["id"]
    assert code_of(world.create, pool=pool) == "INVALID_STATE"
    assert world.count() == 0


def test_ttl_is_from_one_minute_to_one_day(world: World) -> None:
    for ttl in (59, 86_401, 0, -60, True, 3600.0):
        assert code_of(world.create, ttl_s=ttl) == "INVALID_ARGUMENT", ttl
    assert world.count() == 0
    for ttl in (60, 86_400):
        row = world.row(world.create(ttl_s=ttl)["id"])
        assert row["expires_at"] - row["created_at"] == ttl * 1000


BAD_ARGUMENTS: list[dict[str, Any]] = [
    {"max_uses": 0},
    {"max_uses": 10_001},
    {"max_uses": True},
    {"max_uses": "2"},
    {"role": "admin"},
    {"hosted": "docker"},
    {"expect": {"serial": "To Be Filled By O.E.M."}},
    {"expect": {"mac": "02:00:00:00:00:01"}},
    {"expect": {"hostname": "x"}},
    {"expect": ["serial"]},
    {"idempotency_key": ""},
    {"idempotency_key": "k" * 129},
]


def test_create_refuses_bad_arguments(world: World) -> None:
    for kw in BAD_ARGUMENTS:
        assert code_of(world.create, **kw) == "INVALID_ARGUMENT", kw
    assert world.count() == 0
    assert world.events(world.tenant, "security.join-token.created") == []


def test_expect_is_stored_normalised(world: World) -> None:
    created = world.create(
        expect={
            "productUuid": "4C4C4544-0042-3510-8052-B7C04F4D4433",
            "mac": "001B.2100.035E",
            "gpuUuid": "GPU-ABC",
        }
    )
    assert created["expect"] == {
        "productUuid": "4c4c4544-0042-3510-8052-b7c04f4d4433",
        "mac": "00:1b:21:00:03:5e",
        "gpuUuid": "gpu-abc",
    }


# --- idempotency ----------------------------------------------------------------


def test_idempotency_key_retry_returns_the_record_without_token(world: World) -> None:
    first = world.create(expect={"serial": "SN-1"}, idempotency_key="k1")
    again = world.create(expect={"serial": "sn-1"}, idempotency_key="k1", ttl_s=600, max_uses=9)
    assert "token" not in again
    assert again == {k: v for k, v in first.items() if k != "token"}
    assert world.count() == 1
    assert len(world.events(world.tenant, "security.join-token.created")) == 1


def test_idempotency_key_with_different_arguments_is_conflict(world: World) -> None:
    world.create(expect={"serial": "SN-1"}, idempotency_key="k1")
    changes: list[dict[str, Any]] = [
        {"pool": world.pool2},
        {"expect": {"serial": "SN-2"}},
        {"expect": {}},
        {"allow_reclaim": True},
        {"hosted": "kubernetes"},
    ]
    for change in changes:
        kw: dict[str, Any] = {"expect": {"serial": "SN-1"}, "idempotency_key": "k1", **change}
        assert code_of(world.create, **kw) == "CONFLICT", change
    assert world.count() == 1
    assert len(world.events(world.tenant, "security.join-token.created")) == 1


def test_idempotency_keys_are_per_tenant(world: World) -> None:
    mine = world.create(idempotency_key="shared")
    theirs = world.create(tenant=world.other, pool=world.other_pool, idempotency_key="shared")
    assert "token" in theirs
    assert theirs["id"] != mine["id"]


# --- list -----------------------------------------------------------------------


def test_list_never_shows_a_secret(world: World) -> None:
    created = world.create()
    secret = created["token"].split(".", 1)[1]
    listed = world.list()
    (item,) = listed["items"]
    assert set(item) == RECORD_KEYS
    assert item == {k: v for k, v in created.items() if k != "token"}
    text = json.dumps(listed)
    assert secret not in text
    assert world.row(created["id"])["secret_sha256"] not in text
    assert "nextPageToken" not in listed


def test_list_hides_revoked_expired_and_used_up_unless_include_inactive(
    world: World, clock: ManualClock
) -> None:
    live = world.create()["id"]
    revoked = world.create()["id"]
    expired = world.create(ttl_s=60)["id"]
    used_up = world.create()["id"]
    world.revoke(revoked)
    clock.advance(60_001)  # the minute's token expired; the others last an hour
    world.sql("UPDATE join_tokens SET uses_left = 0 WHERE id = ?", (used_up,))
    world.create(pool=world.pool2)  # another pool's token is never listed here

    assert [t["id"] for t in world.list()["items"]] == [live]
    every = world.list(include_inactive=True)["items"]
    assert {t["id"] for t in every} == {live, revoked, expired, used_up}
    by_id = {t["id"]: t for t in every}
    assert by_id[revoked]["revoked"] is True
    assert by_id[used_up]["usesLeft"] == 0


def test_list_of_another_tenants_pool_is_not_found(world: World) -> None:
    assert code_of(world.list, pool=world.other_pool) == "NOT_FOUND"
    assert code_of(world.list, tenant=world.other) == "NOT_FOUND"


def test_list_page_size_is_1_to_200(world: World) -> None:
    for size in (0, 201, -1, True, "10", 100.0):
        assert code_of(world.list, page_size=size) == "INVALID_ARGUMENT", size
    for size in (1, 200):
        assert world.list(page_size=size) == {"items": []}


def test_list_pages_hold_100_by_default_and_200_at_most_with_next_page_token(
    world: World,
) -> None:
    with world.store.tx() as tx:
        made = {tokens.create(tx, world.tenant, world.pool, ttl_s=3600)["id"] for _ in range(250)}

    def walk(**kw: Any) -> list[list[str]]:
        pages, token = [], None
        while True:
            page = world.list(page_token=token, **kw)
            pages.append([t["id"] for t in page["items"]])
            token = page.get("nextPageToken")
            if token is None:
                return pages

    default = walk()
    assert [len(p) for p in default] == [100, 100, 50]
    assert [i for p in default for i in p] == sorted(made)

    biggest = walk(page_size=200)
    assert [len(p) for p in biggest] == [200, 50]
    assert {i for p in biggest for i in p} == made

    exact = walk(page_size=125)
    assert [len(p) for p in exact] == [125, 125]


# --- revoke ---------------------------------------------------------------------


def test_revoke_is_immediate_and_idempotent_with_one_event(world: World) -> None:
    created = world.create()
    first = world.revoke(created["id"])
    assert first["revoked"] is True
    assert "token" not in first
    revoked_at = world.row(created["id"])["revoked_at"]
    assert revoked_at is not None
    second = world.revoke(created["id"])
    assert second == first
    assert world.row(created["id"])["revoked_at"] == revoked_at
    (event,) = world.events(world.tenant, "security.join-token.revoked")
    assert event["payload"] == {"tokenId": created["id"], "poolId": world.pool}


def test_revoke_refuses_anything_with_a_dot(world: World) -> None:
    created = world.create()
    for text in (created["token"], created["token"].removeprefix("bcjt_"), "jt_x.y", "."):
        assert code_of(world.revoke, text) == "INVALID_ARGUMENT"
    assert world.row(created["id"])["revoked_at"] is None
    assert world.events(world.tenant, "security.join-token.revoked") == []


def test_revoke_unknown_id_is_not_found(world: World) -> None:
    assert code_of(world.revoke, "jt_01k5w3z8q9m4n7p2r6t8v0x1y3") == "NOT_FOUND"


def test_revoke_of_another_tenants_or_pools_token_is_not_found(world: World) -> None:
    created = world.create()
    assert code_of(world.revoke, created["id"], tenant=world.other) == "NOT_FOUND"
    assert code_of(world.revoke, created["id"], pool=world.pool2) == "NOT_FOUND"
    assert (
        code_of(world.revoke, created["id"], tenant=world.other, pool=world.other_pool)
        == "NOT_FOUND"
    )
    assert world.row(created["id"])["revoked_at"] is None


# --- events ---------------------------------------------------------------------


def test_created_event_says_pinned_and_hosted(world: World) -> None:
    plain = world.create()
    pinned = world.create(expect={"serial": "SN-7701"})
    hosted = world.create(hosted="kubernetes")
    got = {
        e["payload"]["tokenId"]: e["payload"]
        for e in world.events(world.tenant, "security.join-token.created")
    }
    assert got == {
        plain["id"]: {"tokenId": plain["id"], "poolId": world.pool, "pinned": False},
        pinned["id"]: {"tokenId": pinned["id"], "poolId": world.pool, "pinned": True},
        hosted["id"]: {
            "tokenId": hosted["id"],
            "poolId": world.pool,
            "pinned": False,
            "hosted": "kubernetes",
        },
    }
    assert world.events(world.root, "security.join-token.created") == []
    assert hosted["hosted"] == "kubernetes"


# --- token roles ----------------------------------------------------------------


def test_site_and_ramdisk_tokens_only_for_the_root_tenant(world: World) -> None:
    for role in ("site", "ramdisk"):
        assert code_of(world.create, role=role) == "ACCESS_DENIED", role
        assert world.count() == 0
    for role in ("site", "ramdisk"):
        created = world.create(tenant=world.root, pool=world.root_pool, role=role)
        assert created["role"] == role
        assert TOKEN_FORM.fullmatch(created["token"])
    node = world.create(tenant=world.root, pool=world.root_pool)
    assert node["role"] == "node"


def test_root_tenant_cannot_mint_for_a_tenants_pool(world: World) -> None:
    assert code_of(world.create, tenant=world.root, pool=world.pool, role="site") == "NOT_FOUND"
