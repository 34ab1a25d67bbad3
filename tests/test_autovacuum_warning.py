"""``serve`` warns once at start when PostgreSQL's autovacuum is off.

On the real PostgreSQL of this machine: the warning (event
``database.autovacuum_off``) comes exactly when the server's own setting says off,
read here independently; a SQLite store is never warned about.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
import pytest

from control.server import check_autovacuum
from control.store import open_store
from tests.conftest import PG_OK, PG_URL
from tests.fleet import pg_schema, pg_schema_url


def _checked(url: str, caplog: pytest.LogCaptureFixture) -> bool:
    """What ``check_autovacuum`` says of a freshly migrated store at ``url``."""
    store = open_store(url)
    try:
        store.migrate()
        with caplog.at_level(logging.WARNING, logger="control.server"):
            return check_autovacuum(store)
    finally:
        store.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "database.autovacuum_off"]


@pytest.mark.postgres
def test_the_warning_follows_the_servers_setting(caplog: pytest.LogCaptureFixture) -> None:
    assert PG_OK, f"PostgreSQL is not reachable at {PG_URL}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        row = conn.execute("SHOW autovacuum").fetchone()
    assert row is not None
    off = row[0] == "off"
    with pg_schema() as schema:
        assert _checked(pg_schema_url(schema), caplog) is off
    warned = _warnings(caplog)
    assert len(warned) == (1 if off else 0)
    if off:
        assert "autovacuum = on" in warned[0].getMessage()


def test_sqlite_is_not_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _checked(f"sqlite:///{tmp_path / 'cp.db'}", caplog) is False
    assert _warnings(caplog) == []
