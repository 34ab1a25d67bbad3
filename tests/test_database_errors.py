"""A database that cannot be used is one line naming it (never its password) and the
way back, exit 1, within the connect timeout; a URL of the wrong kind is a usage error
(exit 2). Real ``better-compute`` processes against the real PostgreSQL (a closed
port for "down", a database that does not exist) and SQLite (a missing directory)."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from control.store.reach import CONNECT_TIMEOUT_S, _scrub, redact
from tests.conftest import PG_OK, PG_URL
from tests.e2e import BIN, cli_env, run

BC = str(BIN / "better-compute")
BOUND_S = CONNECT_TIMEOUT_S + 5  # the connect timeout, and a process's start


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


def _pg(database: str) -> str:
    parts = urlsplit(PG_URL)
    user = f"{parts.username}:not-the-password-0123@" if parts.username else ""
    return f"postgresql://{user}{parts.hostname}:{parts.port or 5432}/{database}"


def _cases() -> list[tuple[str, str, str]]:
    port = _closed_port()
    return [
        ("down", f"postgresql://u:pw-sekrit-9876@127.0.0.1:{port}/test",
         f"cannot reach the database postgresql://u@127.0.0.1:{port}/test: connection to "
         f'server at "127.0.0.1", port {port} failed: Connection refused; start PostgreSQL, '
         "or correct the host and port in --db"),
        ("missing-db", _pg("hc_no_such_database"),
         'database "hc_no_such_database" does not exist; create it (createdb), or correct '
         "the database name in --db"),
        ("wrong-host", "postgresql://u@no-such-host.invalid:5432/test",
         "cannot reach the database postgresql://u@no-such-host.invalid:5432/test: "),
    ]  # fmt: skip


def _run(home: Path, argv: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    done = run([BC, *argv], env=cli_env(home), timeout=60)
    return done.returncode, done.stderr, time.monotonic() - start


@pytest.mark.parametrize("verb", ["migrate", "serve", "tenants"])
@pytest.mark.parametrize("case", ["down", "missing-db", "wrong-host"])
def test_postgres_that_cannot_be_used_is_one_line_exit_1(
    verb: str, case: str, tmp_path: Path, pki_template: Path
) -> None:
    if case == "missing-db" and not PG_OK:
        pytest.fail(f"PostgreSQL is not reachable at {PG_URL}")
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    _name, url, expected = next(c for c in _cases() if c[0] == case)
    argv = {
        "migrate": ["migrate", "--db", url],
        "serve": ["serve", "--db", url, "--api-listen", "127.0.0.1:0",
                  "--gateway-listen", "127.0.0.1:0"],
        "tenants": ["tenants", "create", "--db", url, "--name", "t",
                    "--credential-out", str(tmp_path / "cred")],
    }[verb]  # fmt: skip
    code, stderr, took = _run(home, argv)
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("better-compute: UNAVAILABLE: cannot reach the database ")
    assert expected in lines[0]
    assert "pw-sekrit" not in stderr
    assert "not-the-password" not in stderr
    assert "internal error" not in stderr
    assert took < BOUND_S
    assert not (tmp_path / "cred").exists()


def test_sqlite_in_a_missing_directory(tmp_path: Path) -> None:
    db = tmp_path / "nope" / "store.db"
    code, stderr, took = _run(tmp_path, ["migrate", "--db", f"sqlite:///{db}"])
    assert code == 1
    assert stderr.strip() == (
        f"better-compute: UNAVAILABLE: the database sqlite:///{db} cannot be opened: the "
        f"directory {db.parent} does not exist; create it (mkdir -p {db.parent}) or name "
        "another file with --db"
    )
    assert took < BOUND_S


@pytest.mark.parametrize("verb", [["migrate"], ["serve"], ["tenants", "create", "--name", "t",
                                                           "--credential-out", "c"]])  # fmt: skip
def test_a_url_of_the_wrong_kind_is_a_usage_error(verb: list[str], tmp_path: Path) -> None:
    code, stderr, _took = _run(tmp_path, [*verb, "--db", "mysql://root:pw-sekrit@db/x"])
    assert code == 2
    assert stderr.strip().splitlines()[-1] == (
        "better-compute: usage: --db: a URL of an unknown kind (must start sqlite:/// or "
        "postgresql://)"
    )
    assert "pw-sekrit" not in stderr


@pytest.mark.parametrize(
    "url", ["user:pw-sekrit@host/db", "postgresql:/u:pw-sekrit@h/db", "postgresql:u:pw-sekrit@h"]
)
def test_a_url_without_its_scheme_shows_no_password(url: str, tmp_path: Path) -> None:
    # urlsplit finds no password without '//', so redact() would have shown it whole
    code, stderr, _took = _run(tmp_path, ["migrate", "--db", url])
    assert code == 2
    assert "usage: --db: a URL of an unknown kind" in stderr
    assert "pw-sekrit" not in stderr
    assert "host" not in stderr
    assert "@h" not in stderr


def test_the_environment_url_is_named_as_such(tmp_path: Path) -> None:
    env = {**cli_env(tmp_path), "BETTER_COMPUTE_DB": "mysql://u:pw-sekrit@db/x"}
    done = run([BC, "migrate"], env=env, timeout=30)
    assert done.returncode == 2
    assert "usage: BETTER_COMPUTE_DB: a URL of an unknown kind" in done.stderr
    assert "pw-sekrit" not in done.stderr


def test_a_reachable_database_migrates(tmp_path: Path) -> None:
    code, stderr, _took = _run(tmp_path, ["migrate", "--db", f"sqlite:///{tmp_path / 's.db'}"])
    assert code == 0, stderr


def test_redact_removes_the_password_and_the_query() -> None:
    assert redact("postgresql://u:p@h:5/d?passfile=/x") == "postgresql://u@h:5/d"
    assert redact("postgresql://h/d") == "postgresql://h/d"
    assert redact("postgresql://u:p@[::1]:5432/d") == "postgresql://u@[::1]:5432/d"


@pytest.mark.parametrize("verb", ["migrate", "serve"])
@pytest.mark.parametrize(
    ("query", "secrets"),
    [
        ("?password=se%zzcret", ["se%zzcret", "zzcret"]),
        ("?options=-c%20password%3ds3cret%zz", ["s3cret"]),
        ("?sslmode=s3cretmode", ["s3cretmode"]),
        ("?port=s3cretport", ["s3cretport"]),
    ],
)
def test_a_malformed_url_is_one_line_without_libpq_repeating_its_values(
    verb: str, query: str, secrets: list[str], tmp_path: Path, pki_template: Path
) -> None:
    """libpq's parse error repeats the value it could not parse: only the URL (redacted)
    is said, never libpq's text."""
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    url = f"postgresql://u:pw-sekrit-9876@127.0.0.1:{_closed_port()}/db{query}"
    argv = ["migrate", "--db", url] if verb == "migrate" else [
        "serve", "--db", url, "--api-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"]  # fmt: skip
    code, stderr, took = _run(home, argv)
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("better-compute: UNAVAILABLE: the database URL is malformed: "
                               "postgresql://u@127.0.0.1:"), stderr  # fmt: skip
    for secret in [*secrets, "pw-sekrit"]:
        assert secret not in stderr
    assert "internal error" not in stderr
    assert took < BOUND_S


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgres://u:pw-sekrit@h:99999/db", "postgres://…"),
        ("postgres://u:pw-sekrit@127.0.0.1:99999/db", "postgres://…"),
        (f"postgresql://u:pw-sekrit@{'a' * 64}.example:5432/db",
         f"postgresql://u@{'a' * 64}.example:5432/db"),
    ],
)  # fmt: skip
def test_a_port_out_of_range_or_a_host_label_too_long_is_not_an_internal_error(
    url: str, shown: str, tmp_path: Path
) -> None:
    code, stderr, _took = _run(tmp_path, ["migrate", "--db", url])
    assert code in (1, 2), stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert shown in lines[0]
    assert "internal error" not in stderr
    assert "pw-sekrit" not in stderr


def test_redact_a_port_out_of_range() -> None:
    assert redact("postgres://u:pw@h:99999/db") == "postgres://…"
    assert redact("postgres://u:pw@h:99999/db?x=1") == "postgres://…"


def test_scrub_removes_query_values_and_the_password_raw_and_decoded() -> None:
    url = "postgresql://u:p%41ss@h:5432/d?password=abc%2Fdef&connect_timeout=1&options=-c%20x%3Dy"
    said = (
        'at "127.0.0.1", port 5432: "abc/def" abc%2Fdef pAss p%41ss "-c x=y" -c%20x%3Dy timeout 1'
    )
    assert _scrub(said, url) == (
        'at "127.0.0.1", port 5432: "***" *** *** *** "***" *** timeout ***'
    )
