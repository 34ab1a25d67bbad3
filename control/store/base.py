"""The store's interface and the migration runner, shared by both backends."""

from __future__ import annotations

import abc
import contextlib
import importlib.resources
import re
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]
Params = Sequence[Any]


class Tx(abc.ABC):
    """One database transaction. ``for_update`` is the row-lock suffix of a SELECT."""

    for_update: str = ""

    @abc.abstractmethod
    def execute(self, sql: str, params: Params = ()) -> int:
        """Run a statement; return the number of rows it changed."""

    @abc.abstractmethod
    def query(self, sql: str, params: Params = ()) -> list[Row]:
        """Run a query; return its rows as dicts."""

    def one(self, sql: str, params: Params = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    @abc.abstractmethod
    def now_ms(self) -> int:
        """``compute_now()``: the database's time at the start of this transaction."""


class Store(abc.ABC):
    dialect: str

    @abc.abstractmethod
    def tx(self) -> contextlib.AbstractContextManager[Tx]:
        """A write transaction: committed on success, rolled back on any exception.

        On SQLite it is ``BEGIN IMMEDIATE`` (one writer at a time); on PostgreSQL a
        READ COMMITTED transaction in which ``SELECT … FOR UPDATE`` locks rows.
        """

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
            for version, sql in migrations():
                if version in done:
                    continue
                for statement in split_sql(sql):
                    tx.execute(statement)
                tx.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, tx.now_ms()),
                )
                applied.append(version)
        return applied

    def _lock_migrations(self, tx: Tx) -> None:  # noqa: B027 - a hook, empty by default
        """Serialise concurrent migrators (PostgreSQL takes an advisory lock)."""


def migrations() -> list[tuple[int, str]]:
    out = []
    folder = importlib.resources.files("control.store") / "migrations"
    for entry in folder.iterdir():
        m = re.fullmatch(r"(\d{4})_[a-z0-9_]+\.sql", entry.name)
        if m:
            out.append((int(m.group(1)), entry.read_text(encoding="utf-8")))
    return sorted(out)


def split_sql(script: str) -> list[str]:
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def open_store(url: str) -> Store:
    """``sqlite:///path/to/file.db`` or ``postgresql://…``."""
    if url.startswith("sqlite:///"):
        from control.store.sqlite import SqliteStore

        return SqliteStore(url[len("sqlite:///") :])
    if url.startswith(("postgresql://", "postgres://")):
        from control.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError("the database URL must start with sqlite:/// or postgresql://")
