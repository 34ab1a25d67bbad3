"""Retention prunes what has expired, on both stores, and keeps what is still in use."""

from __future__ import annotations

import pytest

from control import retention
from control.store import Store

DAY = retention.DAY_MS


def _seed(store: Store) -> int:
    with store.tx() as tx:
        now = tx.now_ms()
        tx.execute("INSERT INTO tenants (id, name, created_at) VALUES ('ten_x', 'x', 0)")
        tx.execute(
            "INSERT INTO sites (id, tenant_id, name, created_at) VALUES ('site_x', 'ten_x', 's', 0)"
        )
        tx.execute(
            "INSERT INTO pools (id, tenant_id, site_id, name, agent, created_at) "
            "VALUES ('pool_x', 'ten_x', 'site_x', 'p', 'bcd', 0)"
        )
        for i, age in enumerate((91 * DAY, 1 * DAY)):
            tx.execute(
                "INSERT INTO events (id, tenant_id, type, payload, created_at) "
                "VALUES (?, 'ten_x', 't', '{}', ?)",
                (f"ev_{i}", now - age),
            )
        for key, start in (("old", now - 2 * 3_600_000), ("new", now)):
            tx.execute(
                "INSERT INTO refusal_windows (rate_key, window_start, emitted, suppressed) "
                "VALUES (?, ?, 1, 0)",
                (key, start),
            )
        for i, (state, updated, decided) in enumerate(
            (("pending", now - 2 * 3_600_000, None), ("pending", now, None),
             ("rejected", now, now - 31 * DAY), ("approved", now, now - DAY))
        ):  # fmt: skip
            tx.execute(
                "INSERT INTO join_requests (id, tenant_id, pool_id, site_id, attestor, "
                "machine_key, claims, csr_sha256, state, created_at, updated_at, decided_at) "
                "VALUES (?, 'ten_x', 'pool_x', 'site_x', 'a', ?, '{}', 'c', ?, ?, ?, ?)",
                (f"jreq_{i}", f"m{i}", state, updated, updated, decided),
            )
        for i, used in enumerate((now - 300_000, now)):
            tx.execute(
                "INSERT INTO renew_proofs (proof_sha256, node_id, used_at) VALUES (?, 'n', ?)",
                (f"p{i}", used),
            )
        tx.execute("INSERT INTO discovery_vouch_calls (vouched_by, at) VALUES ('n', ?)", (0,))
        return now


def test_prune_deletes_what_expired_and_keeps_the_rest(store: Store) -> None:
    _seed(store)
    done = retention.prune_once(store)
    with store.tx() as tx:
        assert [r["id"] for r in tx.query("SELECT id FROM events")] == ["ev_1"]
        assert [r["rate_key"] for r in tx.query("SELECT rate_key FROM refusal_windows")] == ["new"]
        kept = sorted(r["id"] for r in tx.query("SELECT id FROM join_requests"))
        assert kept == ["jreq_1", "jreq_3"]
    with store.tx() as tx:  # a pending request a day old goes, however recently asked
        tx.execute("UPDATE join_requests SET created_at = ? WHERE id = 'jreq_1'",
                   (tx.now_ms() - DAY - 1,))  # fmt: skip
    retention.prune_once(store)
    with store.tx() as tx:
        assert [r["id"] for r in tx.query("SELECT id FROM join_requests")] == ["jreq_3"]
        assert [r["proof_sha256"] for r in tx.query("SELECT proof_sha256 FROM renew_proofs")] == [
            "p1"
        ]
        assert tx.query("SELECT at FROM discovery_vouch_calls") == []
    assert done["events"] == 1
    assert done["join_requests"] == 2


def test_prune_works_in_batches(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retention, "BATCH", 2)
    with store.tx() as tx:
        for i in range(7):
            tx.execute(
                "INSERT INTO events (id, tenant_id, type, payload, created_at) "
                "VALUES (?, 't', 't', '{}', 0)",
                (f"ev_{i}",),
            )
    assert retention.prune_once(store)["events"] == 7
    with store.tx() as tx:
        assert tx.query("SELECT id FROM events") == []
