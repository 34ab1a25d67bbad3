"""The PostgreSQL backend (psycopg 3, sync, in worker threads; a connection pool)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from control.clock import Clock
from control.errors import ControlError, StoreConflict, StoreUnavailable
from control.store.base import Params, Row, Store, Tx

log = logging.getLogger("control.store")
_NOW = "SELECT (extract(epoch from now()) * 1000)::bigint AS now"
# A transaction begins with its start time in the same round trip (simple protocol,
# two statements): ``now()`` is the transaction's start, so ``compute_now()`` is what
# a later ``SELECT now()`` in it would read, one round trip fewer per transaction.
_BEGIN_NOW = ("BEGIN; " + _NOW).encode()
_PLACEHOLDER = re.compile(r"\?")
_MIGRATION_LOCK = 7_361_002
# At most this many deferred statements wait for the next round trip (a transaction
# deferring more sends them in pipelines of this many).
_MAX_DEFERRED = 64


@functools.lru_cache(maxsize=1024)
def _sql(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (the statements are the code's own
    texts: converted once each, not per call)."""
    return _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))


class _PgTx(Tx):
    for_update = " FOR UPDATE"

    def __init__(self, conn: psycopg.Connection[Any], clock: Clock | None) -> None:
        self._conn = conn
        self.clock = clock
        self._deferred: list[tuple[str, tuple[Any, ...]]] = []

    def begin(self) -> None:
        """BEGIN, with the database's time read in the same round trip (the connection
        is in autocommit mode, so psycopg sends no BEGIN of its own). The store calls
        it first, before anything can be deferred."""
        assert not self._deferred
        if self.clock is not None:
            self._conn.execute(b"BEGIN")
            return
        cur = self._conn.execute(_BEGIN_NOW)
        cur.nextset()
        row = cur.fetchone()
        assert row is not None
        self._now = int(row["now"])

    def defer(self, sql: str, params: Params = ()) -> None:
        """Queued: sent with the next statement or the COMMIT, in one pipeline."""
        if len(self._deferred) >= _MAX_DEFERRED:
            self._pipeline(None)
        self._deferred.append((_sql(sql), tuple(params)))

    def execute(self, sql: str, params: Params = ()) -> int:
        with self._conn.cursor() as cur:
            self._pipeline((cur, _sql(sql), tuple(params)))
            return cur.rowcount

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        with self._conn.cursor() as cur:
            self._pipeline((cur, _sql(sql), tuple(params)))
            return cur.fetchall()  # dict_row: each row is a dict of its own already

    def commit(self) -> None:
        """The deferred statements and the COMMIT, in one round trip."""
        self._pipeline(None, commit=True)

    def _pipeline(
        self, last: tuple[psycopg.Cursor[Any], str, tuple[Any, ...]] | None, commit: bool = False
    ) -> None:
        """Run the deferred statements, then ``last`` (a statement on its cursor) or the
        COMMIT: with none deferred, as a plain call; else in one pipeline (one round
        trip; the first error is raised, and the statements after it are not run)."""
        deferred, self._deferred = self._deferred, []
        try:
            if not deferred:
                if last is not None:
                    last[0].execute(last[1], last[2])
                if commit:
                    self._conn.commit()
                return
            with self._conn.pipeline():
                for sql, params in deferred:
                    self._conn.execute(sql, params)
                if last is not None:
                    last[0].execute(last[1], last[2])
                if commit:
                    self._conn.commit()
        except psycopg.errors.UniqueViolation as exc:
            raise StoreConflict() from exc

    def _database_ms(self) -> int:
        row = self.one(_NOW)
        assert row is not None
        return int(row["now"])

    def script(self, sql: str) -> None:
        # No parameters: psycopg sends the text as is, several statements and
        # dollar-quoted function bodies included.
        self._pipeline(None)  # what was deferred runs first, in order
        self._conn.execute(sql.encode())


def _configure(read_only: bool) -> Any:
    def configure(conn: psycopg.Connection[Any]) -> None:
        """Cancelling a trio task does not stop a running query: bound every statement."""
        conn.execute("SET statement_timeout = 30000")
        conn.execute("SET lock_timeout = 30000")
        if read_only:  # the gateway role: a second fence behind its grants
            conn.execute("SET default_transaction_read_only = on")
        conn.commit()

    return configure


CONNECT_TIMEOUT_S = 5
REVOKED_CHANNEL = "bc_revoked"


def _notify_revoked(conn: psycopg.Connection[Any]) -> None:
    """Wake every LISTENing gateway, after the revocation committed (never inside it: a
    notification queue that a stolen gateway keeps full must not fail a revocation).
    Best effort: the gateways poll every second anyway."""
    try:
        conn.execute(f"NOTIFY {REVOKED_CHANNEL}")
        conn.commit()
    except psycopg.Error:
        log.warning("could not notify the gateways of a revocation; they poll within 1 s")
        with contextlib.suppress(psycopg.Error):
            conn.rollback()


class PostgresStore(Store):
    """``timeout``: how long a transaction waits for a connection before the store is
    reported unavailable (:class:`StoreUnavailable`, UNAVAILABLE with a pushback)."""

    dialect = "postgres"

    def __init__(
        self, url: str, *, max_size: int = 8, timeout: float = 30.0, read_only: bool = False
    ) -> None:
        self.url = url
        self._pool: ConnectionPool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            kwargs={
                "row_factory": dict_row,
                # transactions are begun explicitly (_PgTx.begin), with the time
                "autocommit": True,
                "connect_timeout": CONNECT_TIMEOUT_S,
            },
            configure=_configure(read_only),
            timeout=timeout,
            open=True,
            # the gateway checks a connection before each use, so the first call after a
            # database restart does not fail on a dead connection
            check=ConnectionPool.check_connection if read_only else None,
        )

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Tx]:
        try:
            with self._pool.connection() as conn:
                tx = _PgTx(conn, self.clock)
                try:
                    tx.begin()
                    yield tx
                except BaseException:
                    with contextlib.suppress(psycopg.Error):
                        conn.rollback()
                    raise
                try:
                    tx.commit()
                except BaseException:
                    with contextlib.suppress(psycopg.Error):
                        conn.rollback()
                    raise
                if tx.revoked:
                    _notify_revoked(conn)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            # no connection within ``timeout``, the server went away, a statement or
            # lock timeout: the database cannot answer now (never a bug's 503)
            raise StoreUnavailable() from exc

    def _lock_migrations(self, tx: Tx) -> None:
        # Once schema_migrations exists, lock it: EXCLUSIVE needs a write privilege, so
        # a gateway login (SELECT only) cannot hold migrations off the way it could hold
        # an advisory lock, which PUBLIC may take. The first migration, before any
        # gateway login exists, serialises on the advisory lock.
        row = tx.one("SELECT to_regclass('schema_migrations') IS NOT NULL AS present")
        if row is not None and row["present"]:
            tx.execute("LOCK TABLE schema_migrations IN EXCLUSIVE MODE")
        else:
            tx.query("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))

    def migrate(self) -> list[int]:
        try:
            return super().migrate()
        except (psycopg.errors.RaiseException, psycopg.errors.InsufficientPrivilege) as exc:
            # our migrations' own words, or PostgreSQL's about a missing privilege
            text = (exc.diag.message_primary or "a privilege is missing").replace("\n", " ")
            raise ControlError("INVALID_CONFIG", f"migrating the database failed: {text}") from exc

    def close(self) -> None:
        self._pool.close()
