"""Whether the database a command names can be reached, said in one line.

``better-compute migrate``, ``tenants create`` and ``serve`` (roles all and api) try
the database once before they start: a PostgreSQL server that is down, a wrong host,
a database that does not exist or a login that is refused, and a SQLite file that
cannot be opened are answered :class:`DatabaseUnreachable` (exit 1) naming the
database, its password removed, and the way back, within :data:`CONNECT_TIMEOUT_S`
per address of the host (libpq's ``connect_timeout``), never a pool's 30 s of retries.
A gateway does not call this: it starts unready and waits for its database.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from control.errors import ControlError

CONNECT_TIMEOUT_S = 5
SCHEMES = ("sqlite:///", "postgresql://", "postgres://")


class DatabaseUnreachable(ControlError):
    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


def redact(url: str) -> str:
    """``url`` without its password (``postgresql://user:…@host/db`` → ``user@host/db``),
    and without its query (which may hold one too)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return url.split("://", 1)[0] + "://…"
    if parts.password is None and not parts.query:
        return url
    netloc = host if ":" not in host else f"[{host}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def scheme_ok(url: str) -> bool:
    return url.startswith(SCHEMES)


def probe(url: str) -> None:
    """Connect once; raise :class:`DatabaseUnreachable` if that fails."""
    if url.startswith("sqlite:///"):
        _probe_sqlite(Path(url[len("sqlite:///") :]))
    elif url.startswith(("postgresql://", "postgres://")):
        _probe_postgres(url)


def _probe_sqlite(path: Path) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise DatabaseUnreachable(
            f"the database sqlite:///{path} cannot be opened: the directory {parent} does "
            f"not exist; create it (mkdir -p {parent}) or name another file with --db"
        )
    try:
        conn = sqlite3.connect(path, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DatabaseUnreachable(
            f"the database sqlite:///{path} cannot be opened ({exc}); check the file and "
            f"its directory's permissions (user {os.geteuid()}), or name another file with --db"
        ) from None


def _probe_postgres(url: str) -> None:
    import psycopg

    shown = redact(url)
    try:
        psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True).close()
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split("\n", 1)[0].split())
        reason = reason.removeprefix("connection failed: ")
        password = _password(url)
        if password:
            reason = reason.replace(password, "…")
        if re.search(r'database ".*" does not exist', reason):
            back = "create it (createdb), or correct the database name in --db"
        elif re.search(r'role ".*" does not exist|authentication failed|pg_hba.conf', reason):
            back = "check the login and its password (~/.pgpass) in --db"
        else:
            back = "start PostgreSQL, or correct the host and port in --db"
        raise DatabaseUnreachable(f"cannot reach the database {shown}: {reason}; {back}") from None
