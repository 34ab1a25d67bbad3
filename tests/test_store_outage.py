"""A database outage is ``UNAVAILABLE`` with a pushback, never a bug's answer.

Real failures only: a SQLite file that cannot be opened, a SQLite write lock held
by another process's connection, a PostgreSQL pool pointed at a closed port, and a
PostgreSQL backend terminated (``pg_terminate_backend``) in the middle of a
transaction. Each reaches the caller as ``StoreUnavailable`` (code UNAVAILABLE,
``retry_after_ms``), and through the gateway as a 503 with ``retry-pushback-ms`` —
not the bare ``internal error`` a bug gets. An SQL error of our own stays a bug.
"""

from __future__ import annotations

import json
import secrets
import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest
import trio

from bcd.plugins import load_plugins
from control.errors import STORE_PUSHBACK_MS, ControlError, StoreUnavailable
from control.gateway import answering
from control.http import Response
from control.joinservice import JoinService
from control.pki import Pki
from control.server import join_crypto
from control.store import Store, open_store
from tests.conftest import PG_OK, PG_URL, make_store_url
from tests.world.joins import join_body, machine, make_world

T = TypeVar("T")


def _answer(fn: object) -> Response:
    async def call() -> Response:
        async def run() -> Response:
            fn()  # type: ignore[operator]
            raise AssertionError("the store answered")

        return await answering(run)

    return trio.run(call)


def _assert_pushback(response: Response) -> None:
    assert response.status == 503
    body = json.loads(response.body)
    assert body == {"code": "UNAVAILABLE", "message": "the database is unavailable; retry"}
    assert ("retry-pushback-ms", str(STORE_PUSHBACK_MS)) in response.headers


def _assert_unavailable(exc: BaseException) -> None:
    assert isinstance(exc, StoreUnavailable)
    assert (exc.code, exc.retry_after_ms) == ("UNAVAILABLE", STORE_PUSHBACK_MS)
    assert "sqlite" not in exc.message.lower()
    assert "psycopg" not in exc.message.lower()


def _use(store: Store) -> None:
    with store.tx() as tx:
        tx.query("SELECT 1 AS one")


# --- SQLite --------------------------------------------------------------------------


def test_a_sqlite_file_that_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    setup = open_store(url)
    setup.migrate()
    setup.close()
    path.rename(tmp_path / "moved.db")
    path.mkdir()  # the database's path is now unreadable as a database (root reads any mode)
    store = open_store(url)
    try:
        with pytest.raises(StoreUnavailable) as info:
            _use(store)
        _assert_unavailable(info.value)
        _assert_pushback(_answer(lambda: _use(store)))
    finally:
        store.close()


def test_a_held_sqlite_write_lock_is_unavailable_after_the_timeout(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = open_store(url, timeout=0.2)
    store.migrate()
    holder = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable) as info:
            _use(store)
        _assert_unavailable(info.value)
        _assert_pushback(_answer(lambda: _use(store)))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _use(store)  # the lock released: the store answers again
    store.close()


def test_a_sqlite_join_while_the_database_is_locked_is_unavailable(
    tmp_path: Path, memory_pki: Pki
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", timeout=0.2)
    store.migrate()
    world = make_world(store, memory_pki)
    attempt = world.body(world.mint(), machine(1))
    holder = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(ControlError) as info:
            world.svc.join(attempt.body)
        _assert_unavailable(info.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert world.join(attempt)["kind"] == "joined"  # nothing was consumed meanwhile
    store.close()


def test_an_sql_error_of_our_own_stays_a_bug(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with pytest.raises(sqlite3.OperationalError), store.tx() as tx:
            tx.query("SELECT * FROM no_such_table")
    finally:
        store.close()


# --- PostgreSQL ------------------------------------------------------------------------


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    if not PG_OK:
        pytest.fail(f"PostgreSQL is not reachable at {PG_URL}")
    yield from make_store_url("postgres", tmp_path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_postgres_pool_on_a_closed_port_is_unavailable(memory_pki: Pki) -> None:
    store = open_store(f"postgresql://postgres@127.0.0.1:{_closed_port()}/test", timeout=1.0)
    try:
        with pytest.raises(StoreUnavailable) as info:
            _use(store)
        _assert_unavailable(info.value)
        _assert_pushback(_answer(lambda: _use(store)))
        svc = JoinService(store, join_crypto(memory_pki), load_plugins())
        bogus = f"bcjt_jt_{'0' * 26}.{'A' * 43}"
        body = join_body(bogus, memory_pki.join_encryption_key.public_key(), machine(3)).body
        with pytest.raises(StoreUnavailable) as joined:
            svc.join(body)
        _assert_unavailable(joined.value)
    finally:
        store.close()


def _own_backends(url: str) -> tuple[str, str]:
    """``url`` with an application name of its own, and that name (to find its backends
    without touching anyone else's on the shared server)."""
    name = f"outage_{secrets.token_hex(4)}"
    return f"{url}&application_name={name}", name


def _terminate(name: str) -> int:
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (name,),
        ).fetchall()
    return len(rows)


def test_a_terminated_postgres_backend_is_unavailable_then_recovers(pg_url: str) -> None:
    url, name = _own_backends(pg_url)
    store = open_store(url, timeout=2.0)
    store.migrate()
    try:

        def killed_midway() -> None:
            with store.tx() as tx:
                tx.query("SELECT 1 AS one")
                assert _terminate(name) >= 1
                tx.query("SELECT 1 AS one")

        with pytest.raises(StoreUnavailable) as info:
            killed_midway()
        _assert_unavailable(info.value)
        _eventually(lambda: _use(store))  # the pool replaces its dead connections
    finally:
        store.close()


def _eventually(fn: Callable[[], T], attempts: int = 10) -> T:
    """``fn``'s answer once the pool discarded its dead connections; until then every
    failure is an outage (each dead pooled connection fails one transaction)."""
    for _ in range(attempts - 1):
        try:
            return fn()
        except StoreUnavailable as exc:
            _assert_unavailable(exc)
    return fn()


def test_a_postgres_join_while_the_backend_died_is_unavailable_then_joins(
    pg_url: str, memory_pki: Pki
) -> None:
    url, name = _own_backends(pg_url)
    store = open_store(url, timeout=2.0)
    store.migrate()
    world = make_world(store, memory_pki)
    attempt = world.body(world.mint(), machine(2))
    try:
        assert _terminate(name) >= 1  # the pool's idle connection: the next join meets it
        with pytest.raises(ControlError) as info:
            world.svc.join(attempt.body)
        _assert_unavailable(info.value)
        # nothing was consumed meanwhile: the token's one use admits it now
        assert _eventually(lambda: world.join(attempt))["kind"] == "joined"
    finally:
        store.close()
