"""Two joins of one machine racing each other: the loser is judged as if it came after.

On SQLite every join is one BEGIN IMMEDIATE transaction, so two joins never
overlap: the second sees the first's node and is a reclaim (refused without
allowReclaim). On PostgreSQL they can overlap; the unique index on trusted
hardware keys fails the loser's transaction, and JoinService judges it once more,
now seeing the winner's node: the same reclaim refusal on both stores, with the
token's use rolled back. A barrier inside the attestor's verdict makes the overlap
certain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcd import pki, wire
from bcd.plugins import load_plugins
from control import tenancy, tokens
from control.errors import ControlError
from control.joinservice import JoinService
from control.pki import Pki
from control.server import join_crypto
from control.store import Store, open_store
from tests.conftest import make_store_url


@pytest.fixture
def pg_store(tmp_path: Path) -> Iterator[Store]:
    for url in make_store_url("postgres", tmp_path):
        store = open_store(url)
        store.migrate()
        try:
            yield store
        finally:
            store.close()


def _body(token: str, memory_pki: Pki) -> bytes:
    key = pki.generate_key()
    csr = pki.make_csr(key)
    sealed = wire.seal_token(
        wire.parse_token(token), memory_pki.join_encryption_key.public_key(), csr, int(time.time())
    )
    claims = wire.Claims(
        product_uuid="4c4c4544-0042-3510-8052-b4c04f4d3732",
        product_serial="SN-RACE",
        macs=("00:1b:21:aa:bb:99",),
    )
    return wire.dumps(
        wire.JoinRequest(
            role="node",
            attestor="",
            sealed_token=sealed,
            csr_der=csr,
            claims=claims,
            evidence={},
            node_id=None,
            daemon_version="test",
        ).to_json()
    )


def test_two_joins_of_one_machine_racing_end_as_if_one_came_after(
    pg_store: Store, memory_pki: Pki
) -> None:
    with pg_store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        site = tenancy.create_site(tx, root, "s")
        pool = tenancy.create_pool(tx, root, site["id"], "p", "bcd", {})
        made = [tokens.create(tx, root, pool["id"], ttl_s=600)["token"] for _ in range(2)]
    plugins = load_plugins()
    barrier = threading.Barrier(2, timeout=10)
    verify = plugins.server_verify
    calls: list[int] = []

    def in_step(*args: Any, **kwargs: Any) -> Any:
        verdict = verify(*args, **kwargs)
        calls.append(1)
        if len(calls) <= 2:  # both have locked their own token before either inserts
            barrier.wait()
        return verdict

    plugins.server_verify = in_step  # type: ignore[method-assign]
    service = JoinService(pg_store, join_crypto(memory_pki), plugins)
    outcomes: list[str] = []

    def attempt(token: str) -> None:
        try:
            service.join(_body(token, memory_pki))
            outcomes.append("joined")
        except ControlError as exc:
            outcomes.append(f"{exc.code}: {exc.message}")

    threads = [threading.Thread(target=attempt, args=(t,)) for t in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == sorted(["joined", "ACCESS_DENIED: Join refused"])
    assert len(calls) == 3  # the loser was judged a second time
    with pg_store.tx() as tx:
        assert tx.one("SELECT COUNT(*) AS n FROM nodes") == {"n": 1}
        uses = [r["uses_left"] for r in tx.query("SELECT uses_left FROM join_tokens ORDER BY id")]
        reasons = [
            r["payload"] for r in tx.query("SELECT payload FROM events WHERE type = ?",
                                           ("security.join.refused",))
        ]  # fmt: skip
    assert sorted(uses) == [0, 1]  # the loser's use was rolled back
    assert len(reasons) == 1
    assert '"reason": "join-token:reclaim"' in reasons[0]
