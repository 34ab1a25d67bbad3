"""Shared fixtures: real stores (SQLite file and the PostgreSQL server), a real PKI."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from control.clock import ManualClock
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
def clock() -> ManualClock:
    """The control plane's clock for a test about time: it starts at the real time and
    moves only with ``clock.advance(ms)``. A test that asks for it gets a ``store``
    (and so a world) that reads ``compute_now()`` from it instead of the database."""
    return ManualClock(int(time.time() * 1000))


@pytest.fixture
def store(store_url: str, request: pytest.FixtureRequest) -> Iterator[Store]:
    injected = request.getfixturevalue("clock") if "clock" in request.fixturenames else None
    s = open_store(store_url, clock=injected)
    s.migrate()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def memory_pki():  # type: ignore[no-untyped-def]
    from control.pki import build_pki

    return build_pki("td.example", datetime.now(UTC))


@pytest.fixture
def world(store: Store, memory_pki):  # type: ignore[no-untyped-def]
    """JoinService in process (:class:`tests.world.joins.World`): the root tenant, a
    tenant with a site and a pool, on SQLite and on PostgreSQL."""
    from tests.world.joins import make_world

    return make_world(store, memory_pki)


@pytest.fixture
def env(store: Store, memory_pki):  # type: ignore[no-untyped-def]
    """RenewService in process (:class:`tests.world.renewals.Env`): nodes made by real
    joins, renewing as bcd does, on SQLite and on PostgreSQL."""
    from tests.world.renewals import make_env

    return make_env(store, memory_pki)


@pytest.fixture
def tw(store: Store, memory_pki, swtpm):  # type: ignore[no-untyped-def]
    """The tpm attestor in process (:class:`tests.world.joins.TpmWorld`) on the session's
    swtpm."""
    from tests.world.joins import make_tpm_world

    return make_tpm_world(store, memory_pki, swtpm)


@pytest.fixture(scope="session")
def pki_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e import make_pki

    home = tmp_path_factory.mktemp("pki-template")
    make_pki(home)
    return home


@pytest.fixture
def e2e(tmp_path: Path, pki_template: Path):  # type: ignore[no-untyped-def]
    """The end-to-end world (:class:`tests.world.E2EWorld`): whatever a test starts
    through it (control planes, fleets, its own swtpm) stops at teardown."""
    from tests.world import E2EWorld

    w = E2EWorld(tmp_path, pki_template)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def control_plane(store_url: str, e2e):  # type: ignore[no-untyped-def]
    """One ``better-compute serve`` on SQLite and on PostgreSQL."""
    return e2e.control_plane(store_url)


@pytest.fixture
def sqlite_control_plane(e2e):  # type: ignore[no-untyped-def]
    return e2e.control_plane()


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


@pytest.fixture
def own_swtpm(swtpm, e2e):  # type: ignore[no-untyped-def]
    """A swtpm of this test's own: the test clears it, which the session's must not be
    (a clear evicts the persistent EKs tests/test_tpm.py looks for). Requesting the
    session's fixture first checks the tools and silences TSS2_LOG."""
    return e2e.swtpm()


@pytest.fixture
def tpm_control_plane(e2e, own_swtpm):  # type: ignore[no-untyped-def]
    """A control plane trusting ``own_swtpm``'s EK CA for a tpm pool: (cp, site, pool)."""
    return e2e.tpm_plane(own_swtpm.ca_bundle)


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
