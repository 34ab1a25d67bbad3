"""The embedded SQLite backend (WAL, one writer at a time with BEGIN IMMEDIATE)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

from control.errors import StoreConflict
from control.store.base import Params, Row, Store, Tx

_NOW = "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) AS now"


class _SqliteTx(Tx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._now: int | None = None

    def execute(self, sql: str, params: Params = ()) -> int:
        try:
            return self._conn.execute(sql, tuple(params)).rowcount
        except sqlite3.IntegrityError as exc:
            raise StoreConflict("unique constraint") from exc

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        cur = self._conn.execute(sql, tuple(params))
        names = [d[0] for d in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def now_ms(self) -> int:
        if self._now is None:
            row = self._conn.execute(_NOW).fetchone()
            self._now = int(row[0])
        return self._now


class SqliteStore(Store):
    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextlib.contextmanager
    def tx(self) -> Iterator[Tx]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield _SqliteTx(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.IntegrityError as exc:  # pragma: no cover - deferred constraints
            conn.execute("ROLLBACK")
            raise StoreConflict("unique constraint") from exc

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._all.clear()
        self._local = threading.local()

    def raw(self) -> Any:  # for tests that inspect the file
        return self._conn()
