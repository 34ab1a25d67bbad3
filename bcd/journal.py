"""The node's local journal: ``journal.db`` (SQLite, 0600) in the data directory.

It carries the node's ``journal_id`` (sent in Hello) and a small table of events
(renewals, a revocation). The identity outlives the journal (seed 003, "What the
identity is"): a journal that is not SQLite, is damaged, has another schema or no
journal id is moved aside as ``journal.db.corrupt-<unix time>`` (with its SQLite
companions) and a fresh journal with a **new** journal id starts. Nothing here reads
or writes identity.json, node.key or node.key.next.

Schema (version 1)::

    meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)   journal_id, schema_version, created
    events(id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT, kind TEXT, payload TEXT)

Every call is blocking (SQLite, fsync): run :func:`open_journal` and the methods of
:class:`Journal` in ``trio.to_thread.run_sync``. A :class:`Journal` may be used from
any thread (one lock serialises its connection).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import sqlite3
import stat
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bcd import fs
from bcd.errors import BcdError
from bcd.identity import JOURNAL_FILE, JOURNAL_SIDECARS, format_time

SCHEMA_VERSION = "1"
JOURNAL_ID_RE = re.compile(r"^jrn_[a-z2-7]{26}$")
MAX_KIND = 64
MAX_PAYLOAD = 64 * 1024
BUSY_TIMEOUT_S = 5.0
# SQLite result codes that mean "this file is not a usable journal".
_CORRUPT_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, "
    "kind TEXT NOT NULL, payload TEXT NOT NULL)",
)
_COLUMNS = {"meta": ("key", "value"), "events": ("id", "at", "kind", "payload")}


class JournalError(BcdError):
    """Raised when journal.db cannot be opened or written for a reason other than
    damage (permissions, a full disk, a lock held elsewhere); a damaged journal is
    replaced instead, never reported with this."""


class _Unusable(Exception):
    """The file at journal.db is not a usable journal; it is moved aside."""


@dataclass(frozen=True, slots=True)
class JournalEvent:
    id: int
    at: str
    kind: str
    payload: dict[str, Any]


def new_journal_id() -> str:
    """``jrn_`` and 26 lowercase base32 characters (128 random bits)."""
    raw = base64.b32encode(secrets.token_bytes(16)).decode("ascii").rstrip("=").lower()
    return "jrn_" + raw


class Journal:
    """An open journal.db. Use :func:`open_journal` to get one."""

    def __init__(self, path: Path, conn: sqlite3.Connection, journal_id: str) -> None:
        self.path = path
        self.journal_id = journal_id
        self._conn: sqlite3.Connection | None = conn
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                raise JournalError("the journal is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise JournalError(f"cannot write the journal {self.path}: {exc}") from exc

    def append(
        self,
        kind: str,
        payload: Mapping[str, Any],
        at: datetime | None = None,
        *,
        replacing: tuple[str, ...] = (),
    ) -> int:
        """Record an event (``at`` defaults to now, UTC); return its id.

        ``payload`` must be JSON (no secrets: it is kept on disk for good). The events
        of the kinds in ``replacing`` are deleted in the same transaction, so a kind
        that only says what is true now (the session's last word) keeps one row.
        """
        if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
            raise ValueError(f"an event kind is 1 to {MAX_KIND} characters")
        text = json.dumps(dict(payload), sort_keys=True, separators=(",", ":"))
        if len(text) > MAX_PAYLOAD:
            raise ValueError(f"an event payload is at most {MAX_PAYLOAD} bytes of JSON")
        when = format_time(at or datetime.now(UTC))
        with self._connection() as conn, conn:
            if replacing:
                marks = ", ".join("?" * len(replacing))
                conn.execute(f"DELETE FROM events WHERE kind IN ({marks})", replacing)
            cursor = conn.execute(
                "INSERT INTO events (at, kind, payload) VALUES (?, ?, ?)", (when, kind, text)
            )
            row_id = cursor.lastrowid
        assert row_id is not None
        return row_id

    def events(self, kind: str | None = None) -> list[JournalEvent]:
        """The recorded events, oldest first (all, or those of one ``kind``)."""
        query = "SELECT id, at, kind, payload FROM events"
        args: tuple[str, ...] = ()
        if kind is not None:
            query, args = query + " WHERE kind = ?", (kind,)
        with self._connection() as conn:
            rows = conn.execute(query + " ORDER BY id", args).fetchall()
        return [JournalEvent(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    def last(self, kind: str) -> JournalEvent | None:
        """The newest event of ``kind``, if any (one row read, however long the journal)."""
        with self._connection() as conn:
            row = conn.execute(
                "SELECT id, at, kind, payload FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1",
                (kind,),
            ).fetchone()
        return None if row is None else JournalEvent(row[0], row[1], row[2], json.loads(row[3]))

    def close(self) -> None:
        """Close the connection; further calls raise :class:`JournalError`."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_journal(data_dir: Path, now: datetime) -> Journal:
    """Open ``data_dir/journal.db``, creating it (0600) with a new journal id if missing.

    A file that is not a usable journal (not SQLite, damaged, another schema, no
    valid journal id, not a regular file) is moved aside as
    ``journal.db.corrupt-<unix time of now>`` and a fresh journal with a new id is
    started. Raises :class:`JournalError` for anything else (permissions, disk).
    """
    path = data_dir / JOURNAL_FILE
    try:
        fs.ensure_dir(data_dir, 0o700)
        if not os.path.lexists(path):
            _move_aside(data_dir, now, only_sidecars=True)  # never replay an old WAL
            _create(path)
        try:
            conn, journal_id = _open_existing(path)
        except _Unusable:
            _move_aside(data_dir, now)
            _create(path)
            conn, journal_id = _open_existing(path)
    except _Unusable as exc:  # a journal we just created is unusable: the disk lies
        raise JournalError(f"cannot start a journal at {path}: {exc}") from exc
    except (OSError, sqlite3.Error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise JournalError(f"cannot open the journal {path}: {reason}") from exc
    return Journal(path, conn, journal_id)


RECORDED_MAX = 1000


def recorded(data_dir: Path, kinds: tuple[str, ...]) -> list[JournalEvent]:
    """The newest events of ``kinds`` (at most :data:`RECORDED_MAX`, newest first),
    read without changing anything: no journal is no events, and a damaged one is
    left where it is (``bcd doctor``; the agent moves it aside at its start).

    Raises :class:`JournalError` when the journal cannot be read.
    """
    path = data_dir / JOURNAL_FILE
    if not os.path.lexists(path):
        return []
    marks = ", ".join("?" for _ in kinds)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise JournalError(f"the journal {path} is not a regular file")
        uri = path.resolve().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            rows = conn.execute(
                f"SELECT id, at, kind, payload FROM events WHERE kind IN ({marks}) "
                "ORDER BY id DESC LIMIT ?",
                (*kinds, RECORDED_MAX),
            ).fetchall()
        finally:
            conn.close()
    except (OSError, sqlite3.Error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise JournalError(f"cannot read the journal {path}: {reason}") from exc
    events = []
    for r in rows:
        try:
            payload = json.loads(r[3])
        except (TypeError, ValueError):
            continue
        if isinstance(payload, dict) and isinstance(r[1], str):
            events.append(JournalEvent(r[0], r[1], str(r[2]), payload))
    return events


def _is_corrupt(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _CORRUPT_CODES


def _open_existing(path: Path) -> tuple[sqlite3.Connection, str]:
    """Open and check journal.db; raise :class:`_Unusable` for a damaged one."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _Unusable("not a regular file")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.chmod(path, 0o600)
    uri = path.resolve().as_uri() + "?mode=rw"
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        journal_id = _check(conn)
        conn.execute("PRAGMA journal_mode=WAL").fetchone()
        conn.execute("PRAGMA synchronous=FULL")
    except _Unusable:
        conn.close()
        raise
    except sqlite3.Error as exc:
        conn.close()
        if _is_corrupt(exc):
            raise _Unusable(str(exc)) from exc
        raise
    except BaseException:
        conn.close()
        raise
    return conn, journal_id


def _check(conn: sqlite3.Connection) -> str:
    """The journal id of a whole journal of this schema, else :class:`_Unusable`."""
    rows = conn.execute("PRAGMA quick_check").fetchall()
    if [tuple(r) for r in rows] != [("ok",)]:
        raise _Unusable("the database is damaged")
    for table, columns in _COLUMNS.items():
        found = tuple(r[1] for r in conn.execute(f"PRAGMA table_info({table})").fetchall())
        if found != columns:
            raise _Unusable(f"the {table} table is missing or has another schema")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise _Unusable("the journal has another schema version")
    journal_id = meta.get("journal_id")
    if not isinstance(journal_id, str) or not JOURNAL_ID_RE.fullmatch(journal_id):
        raise _Unusable("the journal has no journal id")
    return journal_id


def _create(path: Path) -> None:
    """Build a new journal under a temporary name, then rename it into place."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=DELETE").fetchone()
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("journal_id", new_journal_id()),
                    ("schema_version", SCHEMA_VERSION),
                    ("created", format_time(datetime.now(UTC))),
                ],
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
        os.rename(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fs.fsync_dir(path.parent)


def _move_aside(data_dir: Path, now: datetime, *, only_sidecars: bool = False) -> None:
    """Rename journal.db and its companions to ``journal.db.corrupt-<unix>[-N]…``."""
    names = [JOURNAL_FILE + s for s in JOURNAL_SIDECARS]
    if not only_sidecars:
        names.insert(0, JOURNAL_FILE)
    present = [n for n in names if os.path.lexists(data_dir / n)]
    if not present:
        return
    when = now if now.tzinfo else now.replace(tzinfo=UTC)
    base = f"{JOURNAL_FILE}.corrupt-{int(when.timestamp())}"
    candidate, n = base, 0
    while any(os.path.lexists(data_dir / (candidate + s)) for s in ("", *JOURNAL_SIDECARS)):
        n += 1
        candidate = f"{base}-{n}"
    for name in present:
        os.rename(data_dir / name, data_dir / (candidate + name[len(JOURNAL_FILE) :]))
    fs.fsync_dir(data_dir)
