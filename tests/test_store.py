"""The store on both backends: migrations, compute_now, row locks, conflicts."""

from __future__ import annotations

import sqlite3
import threading
import time

import psycopg
import pytest

from control.errors import StoreConflict
from control.store import Store, open_store
from control.store.base import migrations


def test_migrations_apply_once_and_are_numbered(store: Store) -> None:
    assert store.migrate() == []
    with store.tx() as tx:
        versions = [r["version"] for r in tx.query("SELECT version FROM schema_migrations")]
    assert versions == [v for v, _, _ in migrations()]


def test_compute_now_is_the_database_clock(store: Store) -> None:
    with store.tx() as tx:
        now = tx.now_ms()
    assert abs(now - time.time() * 1000) < 5_000


def _insert_then_fail(store: Store) -> None:
    with store.tx() as tx:
        tx.execute(
            "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?, ?, 0, ?)",
            ("ten_x", "x", tx.now_ms()),
        )
        raise RuntimeError("boom")


def test_rollback_on_exception_keeps_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError):
        _insert_then_fail(store)
    with store.tx() as tx:
        assert tx.one("SELECT id FROM tenants WHERE id = ?", ("ten_x",)) is None


def test_unique_violation_is_a_store_conflict(store: Store) -> None:
    with store.tx() as tx:
        tx.execute("INSERT INTO tenants (id, name, is_root, created_at) VALUES ('a', 'a', 1, 0)")
    with pytest.raises(StoreConflict), store.tx() as tx:
        tx.execute("INSERT INTO tenants (id, name, is_root, created_at) VALUES ('b', 'b', 1, 0)")


def test_primary_key_violation_is_a_store_conflict(store: Store) -> None:
    with store.tx() as tx:
        tx.execute("INSERT INTO tenants (id, name, is_root, created_at) VALUES ('a', 'a', 0, 0)")
    with pytest.raises(StoreConflict), store.tx() as tx:
        tx.execute("INSERT INTO tenants (id, name, is_root, created_at) VALUES ('a', 'b', 0, 0)")


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES ('c', NULL, 0, 0)",
        "INSERT INTO sites (id, tenant_id, name, created_at) VALUES ('s', 'no-such-tenant', 's', 0)",
    ],
    ids=["not-null", "foreign-key"],
)
def test_other_integrity_errors_are_bugs_not_conflicts(store: Store, sql: str) -> None:
    """Only a unique violation is a conflict to retry (as on PostgreSQL): a NOT NULL or
    foreign key failure is the driver's own error, and nothing is kept."""
    driver_error = (sqlite3.IntegrityError, psycopg.errors.IntegrityError)
    with pytest.raises(driver_error) as info, store.tx() as tx:
        tx.execute(sql)
    assert not isinstance(info.value, StoreConflict)
    with store.tx() as tx:
        assert tx.query("SELECT id FROM tenants WHERE id = 'c'") == []
        assert tx.query("SELECT id FROM sites WHERE id = 's'") == []


_TENANT = "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?, ?, 0, 0)"


def test_deferred_statements_run_in_order_before_the_next_one(store: Store) -> None:
    """A deferred statement has run by the time the next statement of its transaction
    runs (a query sees it) and by the commit; more than a pipeline's worth too."""
    with store.tx() as tx:
        tx.defer(_TENANT, ("t1", "one"))
        tx.defer("UPDATE tenants SET name = ? WHERE id = ?", ("uno", "t1"))
        assert tx.one("SELECT name FROM tenants WHERE id = ?", ("t1",)) == {"name": "uno"}
        for i in range(150):
            tx.defer(_TENANT, (f"n{i}", f"n{i}"))
    with store.tx() as tx:
        assert tx.one("SELECT COUNT(*) AS n FROM tenants WHERE id LIKE 'n%'") == {"n": 150}


@pytest.mark.parametrize("then", ["query", "execute", "commit"])
def test_a_deferred_conflict_is_raised_in_its_transaction_and_keeps_nothing(
    store: Store, then: str
) -> None:
    """A deferred statement's unique violation is a StoreConflict of its transaction:
    on SQLite at once, on PostgreSQL by the next statement or the commit. Either way
    nothing of the transaction is kept, and the store serves the next one."""
    with store.tx() as tx:
        tx.execute(_TENANT, ("dup", "first"))

    def conflicting() -> None:
        with store.tx() as tx:
            tx.defer(_TENANT, ("kept-not", "x"))
            tx.defer(_TENANT, ("dup", "second"))
            if then == "query":
                tx.query("SELECT id FROM tenants")
            elif then == "execute":
                tx.execute(_TENANT, ("after", "y"))

    with pytest.raises(StoreConflict):
        conflicting()
    with store.tx() as tx:
        rows = tx.query("SELECT id, name FROM tenants ORDER BY id")
    assert rows == [{"id": "dup", "name": "first"}]


def test_a_deferred_statement_waits_on_postgresql(store: Store) -> None:
    """On PostgreSQL a deferred statement is not sent at the call (it goes with the next
    one, in one round trip): its error comes from the statement after it."""
    if store.dialect != "postgres":
        pytest.skip("SQLite runs a deferred statement at once")
    reached = []

    def failing() -> None:
        with store.tx() as tx:
            tx.defer(
                "INSERT INTO tenants (id, name, is_root, created_at) VALUES ('z', 'z', 0, 1/0)"
            )
            reached.append("after the defer")  # its error is not raised yet
            tx.one("SELECT 1 AS one")

    with pytest.raises(psycopg.errors.DivisionByZero):
        failing()
    assert reached == ["after the defer"]
    with store.tx() as tx:
        assert tx.query("SELECT id FROM tenants") == []


def test_row_lock_serialises_concurrent_decrements(store_url: str) -> None:
    """Ten threads take one use each of a 5-use counter: exactly five succeed."""
    setup = open_store(store_url)
    setup.migrate()
    with setup.tx() as tx:
        tx.execute("INSERT INTO refusal_windows VALUES ('k', 0, 5, 0)")
    setup.close()
    won: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        s = open_store(store_url)
        try:
            with s.tx() as tx:
                row = tx.one(
                    "SELECT emitted FROM refusal_windows WHERE rate_key = 'k'" + tx.for_update
                )
                assert row is not None
                ok = row["emitted"] > 0
                if ok:
                    time.sleep(0.01)
                    tx.execute(
                        "UPDATE refusal_windows SET emitted = emitted - 1 WHERE rate_key = 'k'"
                    )
            with lock:
                won.append(ok)
        finally:
            s.close()

    threads = [threading.Thread(target=worker) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 5
    check = open_store(store_url)
    with check.tx() as tx:
        assert tx.one("SELECT emitted FROM refusal_windows WHERE rate_key = 'k'") == {"emitted": 0}
    check.close()


def test_unknown_database_url_is_refused() -> None:
    with pytest.raises(ValueError, match="sqlite:///"):
        open_store("mysql://x")


class _Recorded:
    """A transaction that notes each query's SQL and parameters before it runs."""

    def __init__(self, tx: object) -> None:
        self.tx = tx
        self.seen: list[tuple[str, tuple[object, ...]]] = []

    def query(self, sql: str, params: tuple[object, ...] = ()) -> list[object]:
        self.seen.append((sql, params))
        return self.tx.query(sql, params)  # type: ignore[attr-defined, no-any-return]


def test_the_shared_key_check_seeks_the_key_index(store: Store) -> None:
    """A join's check for another tenant's node with the same trusted hardware key is a
    seek of ``nodes_hardware_key`` on both stores, not a walk of the (tenant_id,
    hardware_key) index: at 40,000 nodes that walk was 7.9 ms of PostgreSQL per join."""
    from control import repos

    with store.tx() as tx:
        recorded = _Recorded(tx)
        assert repos.shared_key_nodes(recorded, "hk-1", "ten_a") == []  # type: ignore[arg-type]
        (sql, params), = recorded.seen  # fmt: skip
        if store.dialect == "postgres":
            tx.execute("SET LOCAL enable_seqscan = off")  # a small table: judge the index
            plan = " ".join(str(r) for r in tx.query("EXPLAIN " + sql, params))
        else:
            plan = " ".join(str(r) for r in tx.query("EXPLAIN QUERY PLAN " + sql, params))
    assert "nodes_hardware_key" in plan, plan
