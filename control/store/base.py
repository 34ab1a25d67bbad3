"""The store's interface and the migration runner, shared by both backends."""

from __future__ import annotations

import abc
import contextlib
import importlib.resources
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from control.clock import Clock

Row = dict[str, Any]
Params = Sequence[Any]


def marks(n: int) -> str:
    """``n`` placeholders for an ``IN (...)`` list: ``?, ?, ?``."""
    return ", ".join("?" * n)


class Tx(abc.ABC):
    """One database transaction. ``for_update`` is the row-lock suffix of a SELECT.

    ``revoked`` is set by whoever revokes a certificate in it: after the commit the
    store wakes the gateways' revocation polls (PostgreSQL NOTIFY, best effort).
    :meth:`on_commit` runs a callable after the commit, never after a rollback (the
    events' log lines: a rolled-back transaction logs nothing).
    """

    for_update: str = ""
    revoked: bool = False
    _on_commit: list[Callable[[], None]] | None = None
    clock: Clock | None = None
    """The store's injected clock (tests); None: the database's own time."""
    _now: int | None = None

    @abc.abstractmethod
    def execute(self, sql: str, params: Params = ()) -> int:
        """Run a statement; return the number of rows it changed."""

    @abc.abstractmethod
    def query(self, sql: str, params: Params = ()) -> list[Row]:
        """Run a query; return its rows as dicts."""

    def defer(self, sql: str, params: Params = ()) -> None:
        """Run a statement whose result nobody reads: by the time the next statement
        runs, or the transaction commits, it has run, in order.

        A dialect may send it with what comes next in one round trip (PostgreSQL's
        pipeline); its error, a :class:`~control.errors.StoreConflict` included, is
        then raised by that later statement or by the commit, inside the same
        ``with store.tx()`` block. So only a statement whose failure the caller
        handles for the whole transaction may be deferred, never one whose own
        error is caught around it."""
        self.execute(sql, params)

    def one(self, sql: str, params: Params = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def now_ms(self) -> int:
        """``compute_now()``: the database's time at the start of this transaction (or
        the injected clock's, :mod:`control.clock`), read once per transaction."""
        if self._now is None:
            self._now = self.clock.now_ms() if self.clock is not None else self._database_ms()
        return self._now

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once this transaction committed (:meth:`Store.tx`)."""
        if self._on_commit is None:
            self._on_commit = []
        self._on_commit.append(fn)

    def committed(self) -> None:
        """Run the :meth:`on_commit` callables (the store calls it after the commit)."""
        for fn in self._on_commit or ():
            try:
                fn()
            except Exception:  # it committed: the caller's answer must not change
                logging.getLogger("control.store").exception("an after-commit call failed")

    @abc.abstractmethod
    def _database_ms(self) -> int:
        """The database's own time now, in unix milliseconds."""

    def script(self, sql: str) -> None:
        """Run a dialect's own migration script as it is (PostgreSQL only)."""
        raise NotImplementedError(f"{type(self).__name__} runs no scripts")


class Store(abc.ABC):
    dialect: str
    clock: Clock | None = None
    """Set by ``open_store(..., clock=...)``: every transaction's ``now_ms()`` comes
    from it instead of the database (tests; production keeps the database's time)."""

    on_tx: Callable[[float], None] | None = None
    """Told each transaction's duration in seconds, committed or not (metrics)."""

    @contextlib.contextmanager
    def tx(self) -> Iterator[Tx]:
        """A write transaction: committed on success, rolled back on any exception.

        On SQLite it is ``BEGIN IMMEDIATE`` (one writer at a time); on PostgreSQL a
        READ COMMITTED transaction in which ``SELECT … FOR UPDATE`` locks rows.
        """
        observe = self.on_tx
        if observe is None:
            with self._tx() as tx:
                yield tx
            tx.committed()
            return
        start = time.perf_counter()
        try:
            with self._tx() as tx:
                yield tx
        finally:
            observe(time.perf_counter() - start)
        tx.committed()

    @abc.abstractmethod
    def _tx(self) -> contextlib.AbstractContextManager[Tx]:
        """The dialect's transaction (:meth:`tx`)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def migrate(self) -> list[int]:
        """Apply the numbered migrations not yet applied; return their numbers."""
        applied: list[int] = []
        with self.tx() as tx:
            self._lock_migrations(tx)
            tx.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)"
            )
            done = {r["version"] for r in tx.query("SELECT version FROM schema_migrations")}
            for version, dialect, sql in migrations():
                if version in done:
                    continue
                if dialect is None:
                    for statement in split_sql(sql):
                        tx.execute(statement)
                elif dialect == self.dialect:
                    tx.script(sql)
                # a migration of another dialect only takes its number
                tx.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, tx.now_ms()),
                )
                applied.append(version)
        return applied

    def _lock_migrations(self, tx: Tx) -> None:  # noqa: B027 - a hook, empty by default
        """Serialise concurrent migrators (PostgreSQL takes an advisory lock)."""


def migrations() -> list[tuple[int, str | None, str]]:
    """(number, dialect, SQL): ``NNNN_name.sql`` runs on both stores, statement by
    statement; ``NNNN_name.postgres.sql`` is PostgreSQL's own script, run whole (its
    functions hold semicolons), and only takes its number on SQLite."""
    out: list[tuple[int, str | None, str]] = []
    folder = importlib.resources.files("control.store") / "migrations"
    for entry in folder.iterdir():
        m = re.fullmatch(r"(\d{4})_[a-z0-9_]+(?:\.(postgres))?\.sql", entry.name)
        if m:
            out.append((int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    return sorted(out, key=lambda item: item[0])


def split_sql(script: str) -> list[str]:
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def open_store(
    url: str,
    *,
    read_only: bool = False,
    timeout: float = 30.0,
    max_size: int = 8,
    clock: Clock | None = None,
) -> Store:
    """``sqlite:///path/to/file.db`` or ``postgresql://…``.

    ``read_only`` (PostgreSQL only: the gateway role) makes every transaction read
    only; ``timeout`` bounds the wait for a connection (SQLite: for the write lock)
    before the store is reported unavailable. ``clock`` replaces the database's time
    (tests, :mod:`control.clock`).
    """
    store: Store
    if url.startswith("sqlite:///"):
        if read_only:
            raise ValueError("a read-only store (serve --role gateway) needs postgresql://")
        from control.store.sqlite import SqliteStore

        store = SqliteStore(url[len("sqlite:///") :], timeout=timeout)
    elif url.startswith(("postgresql://", "postgres://")):
        from control.store.postgres import PostgresStore

        store = PostgresStore(url, read_only=read_only, timeout=timeout, max_size=max_size)
    else:
        raise ValueError("the database URL must start with sqlite:/// or postgresql://")
    store.clock = clock
    return store
