"""The embedded SQLite backend (WAL, one writer at a time with BEGIN IMMEDIATE).

A database that cannot answer now — its file cannot be opened or read, the write
lock is not had within ``timeout``, the disk is full or fails — is
:class:`~control.errors.StoreUnavailable` (``UNAVAILABLE`` with a pushback), never a
bug; an SQL error of our own (no such table, a syntax error) stays one.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from control.clock import Clock
from control.errors import StoreConflict, StoreUnavailable
from control.store.base import Params, Row, Store, Tx

_NOW = "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) AS now"
T = TypeVar("T")

# Primary result codes (https://sqlite.org/rescode.html) that mean "the database
# cannot answer now", not "this statement is wrong".
_UNAVAILABLE_CODES = frozenset(
    {
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_AUTH,
    }
)


# Extended result codes of a row another transaction already wrote (PostgreSQL's
# UniqueViolation): the one IntegrityError that is a conflict to retry. NOT NULL,
# CHECK and foreign key failures are bugs in our SQL and stay sqlite3 errors.
_CONFLICT_CODES = frozenset(
    {sqlite3.SQLITE_CONSTRAINT_UNIQUE, sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY}
)


def conflict(exc: sqlite3.IntegrityError) -> bool:
    """Whether ``exc`` is a unique (or primary key) violation: a :class:`StoreConflict`."""
    return getattr(exc, "sqlite_errorcode", None) in _CONFLICT_CODES


def unavailable(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the database cannot answer now (vs. a bug in the SQL)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _UNAVAILABLE_CODES


def _guarded(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except sqlite3.OperationalError as exc:
        if unavailable(exc):
            raise StoreUnavailable() from exc
        raise


class _SqliteTx(Tx):
    def __init__(self, conn: sqlite3.Connection, clock: Clock | None) -> None:
        self._conn = conn
        self.clock = clock

    def execute(self, sql: str, params: Params = ()) -> int:
        try:
            return _guarded(lambda: self._conn.execute(sql, tuple(params)).rowcount)
        except sqlite3.IntegrityError as exc:
            if conflict(exc):
                raise StoreConflict() from exc
            raise

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        def run() -> list[Row]:
            cur = self._conn.execute(sql, tuple(params))
            names = [d[0] for d in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

        return _guarded(run)

    def _database_ms(self) -> int:
        row = _guarded(lambda: self._conn.execute(_NOW).fetchone())
        return int(row[0])


class SqliteStore(Store):
    """``timeout``: how long a transaction waits for the write lock (busy_timeout)
    before the store is reported unavailable."""

    dialect = "sqlite"

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        self.path = path
        self.timeout_ms = max(1, int(timeout * 1000))
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={self.timeout_ms}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = _guarded(self._open)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Tx]:
        conn = self._conn()
        _guarded(lambda: conn.execute("BEGIN IMMEDIATE"))
        try:
            yield _SqliteTx(conn, self.clock)
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        try:
            _guarded(lambda: conn.execute("COMMIT"))
        except sqlite3.IntegrityError as exc:  # deferred constraints: foreign keys, a bug
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if conflict(exc):  # pragma: no cover - SQLite defers no unique constraint
                raise StoreConflict() from exc
            raise
        except StoreUnavailable:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._all.clear()
        self._local = threading.local()

    def raw(self) -> Any:  # for tests that inspect the file
        return self._conn()
