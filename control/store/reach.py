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
from urllib.parse import unquote, urlsplit, urlunsplit

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
        port = parts.port  # ValueError when not a number from 0 to 65535
    except ValueError:
        return url.split("://", 1)[0] + "://…"
    if parts.password is None and not parts.query:
        return url
    netloc = host if ":" not in host else f"[{host}]"
    if port is not None:
        netloc += f":{port}"
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def _secrets(url: str) -> list[str]:
    """What libpq may repeat of ``url`` that must not be shown: the password and every
    query value, each as written and percent-decoded, longest first."""
    found: set[str] = set()
    password = _password(url)
    if password:
        found.add(password)
    query = url.split("?", 1)[1] if "?" in url else ""
    query = query.split("#", 1)[0]
    for pair in query.split("&"):
        found.add(pair.partition("=")[2])
    if "@" in url.split("?", 1)[0]:  # the userinfo's password as written, if urlsplit fails
        userinfo = url.split("://", 1)[-1].rsplit("@", 1)[0]
        if ":" in userinfo:
            found.add(userinfo.split(":", 1)[1])
    found |= {unquote(s) for s in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def _scrub(reason: str, url: str) -> str:
    """``reason`` with every secret of ``url`` as ``***`` wherever it is not part of a
    longer word, number or address (``connect_timeout=1`` leaves ``port 5432`` and
    ``127.0.0.1`` whole)."""
    for secret in _secrets(url):
        reason = re.sub(rf"(?<!\w)(?<!\w\.){re.escape(secret)}(?!\w)(?!\.\w)", "***", reason)
    return reason


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


def _malformed(exc: Exception, reason: str) -> bool:
    """Whether the URL could not be parsed (nothing was tried): a conninfo parse error
    (a bad percent escape, query parameter, port, sslmode…) or a host IDNA rejects."""
    import psycopg

    if isinstance(exc, (psycopg.ProgrammingError, ValueError)):  # UnicodeError too
        return True
    return reason.removeprefix("connection is bad: ").startswith(("invalid ", "missing "))


def _probe_postgres(url: str) -> None:
    import psycopg

    shown = redact(url)
    try:
        psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True).close()
    except (psycopg.Error, ValueError, UnicodeError, OSError) as exc:
        reason = " ".join(str(exc).split("\n", 1)[0].split())
        reason = reason.removeprefix("connection failed: ")
        if _malformed(exc, reason):
            # libpq's text repeats the value it could not parse, which may be a secret
            raise DatabaseUnreachable(
                f"the database URL is malformed: {shown}; correct it in --db"
            ) from None
        reason = _scrub(reason, url)
        if re.search(r'database ".*" does not exist', reason):
            back = "create it (createdb), or correct the database name in --db"
        elif re.search(r'role ".*" does not exist|authentication failed|pg_hba.conf', reason):
            back = "check the login and its password (~/.pgpass) in --db"
        else:
            back = "start PostgreSQL, or correct the host and port in --db"
        raise DatabaseUnreachable(f"cannot reach the database {shown}: {reason}; {back}") from None
