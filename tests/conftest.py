"""Shared fixtures: real stores (SQLite file and the PostgreSQL server), a real PKI."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from control.store import Store, open_store

PG_URL = os.environ.get("BCD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_available() -> bool:
    try:
        with psycopg.connect(PG_URL, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


PG_OK = _pg_available()


def make_store_url(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh database: a SQLite file, or a new PostgreSQL schema dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    if not PG_OK:
        pytest.fail(f"PostgreSQL is not reachable at {PG_URL}; the store suite runs on both")
    schema = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from make_store_url(request.param, tmp_path)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    s.migrate()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def memory_pki():  # type: ignore[no-untyped-def]
    from control.pki import build_pki

    return build_pki("td.example", datetime.now(UTC))


@pytest.fixture(scope="session")
def pki_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e import make_pki

    home = tmp_path_factory.mktemp("pki-template")
    make_pki(home)
    return home


@pytest.fixture
def control_plane(store_url: str, tmp_path: Path, pki_template: Path):  # type: ignore[no-untyped-def]
    from tests.e2e import ControlPlane

    home = tmp_path / "cp"
    home.mkdir()
    cp = ControlPlane.start(home, pki_template, store_url)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def sqlite_control_plane(tmp_path: Path, pki_template: Path):  # type: ignore[no-untyped-def]
    from tests.e2e import ControlPlane

    home = tmp_path / "cp"
    home.mkdir()
    cp = ControlPlane.start(home, pki_template, f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def swtpm(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A swtpm provisioned for this test session (EK certificates from a local CA).

    Yields a running :class:`tests.swtpm.SwTpm` (``.tcti``, ``.ca_bundle``,
    ``restart()``, ``clear()``, ``stop()``). TSS2_LOG is silenced for the session.
    """
    from tests.swtpm import QUIET_TSS2_LOG, SwTpm, missing_tools

    missing = missing_tools()
    if missing:
        pytest.fail(f"the TPM tests need {', '.join(missing)}: run `make test` to install them")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TSS2_LOG", QUIET_TSS2_LOG)
        tpm = SwTpm.provision(tmp_path_factory.mktemp("swtpm"))
        tpm.start()
        try:
            yield tpm
        finally:
            tpm.stop()


@pytest.fixture(scope="session")
def unprivileged_venv():  # type: ignore[no-untyped-def]
    """A venv under /var/tmp that an unprivileged user can run, with bcd installed
    (without tpm2-pytss); see :mod:`tests.unprivileged`. Removed after the session."""
    from tests.unprivileged import make_unprivileged_venv

    if os.geteuid() != 0:
        pytest.skip("running bcd as another user needs root")
    venv = make_unprivileged_venv()
    try:
        yield venv
    finally:
        venv.remove()
