"""``better-compute serve --config FILE``: every serve flag has its key (the flag's
name without ``--``), the command line overrides the file, an unknown key or a bad
value is a usage error naming the key and the file, and a file other users could
change is refused. Real ``better-compute`` processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from control import serveconfig
from control.cli import build_parser
from control.serveconfig import _subparser, keys
from tests.e2e import BIN, SECRET, cli_env, run, start_serve

BC = str(BIN / "better-compute")


@pytest.fixture
def home(tmp_path: Path, pki_template: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    return home


def _config(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_every_serve_flag_has_its_key() -> None:
    serve = _subparser(build_parser(), "serve")
    longs = {o[2:] for a in serve._actions for o in a.option_strings if o.startswith("--")}
    assert set(keys(serve)) == longs - {"help", "config"}
    assert {"role", "api-listen", "secret-file", "db", "attestor-setting"} <= set(keys(serve))


def test_serve_runs_from_the_file_and_flags_override_it(home: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    config = _config(
        tmp_path / "serve.toml",
        f'secret-file = "{secret}"\n'
        'api-listen = "127.0.0.1:1"\n'  # overridden below: port 1 would not bind
        'gateway-listen = "127.0.0.1:0"\n'
        'gateway-url = "https://gw.example:8443"\n'
        "drain-seconds = 1\n"
        'attestor-setting = ["join-token.unused=1"]\n',
    )
    proc, info = start_serve(
        home, ["--config", str(config), "--api-listen", "127.0.0.1:0"], cli_env(home, secret=False)
    )
    try:
        assert info["role"] == "all"
        assert info["api_port"] != 1
        from control.client import ApiClient

        well_known = ApiClient(info["api"] + "/api/compute", None).call(
            "GET", "/.well-known/better-compute"
        )
        assert well_known["gateway"]["url"] == "https://gw.example:8443"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('api_listen = "127.0.0.1:0"\n',
         'unknown key "api_listen" (the keys are the flags\' names: "api-listen")'),
        ('bogus = 1\n', 'unknown key "bogus"'),
        ('role = "both"\n', "argument --role: invalid choice: 'both'"),
        ("role = true\n", 'key "role": expected a string or a number'),
        ('api-listen = ["a", "b"]\n', 'key "api-listen" takes one value, not a list'),
        ("cert-ttl-seconds = 5\n", "argument --cert-ttl-seconds: from 10 to 86400 seconds"),
        ("role = \n", "not valid TOML"),
    ],
)  # fmt: skip
def test_a_bad_key_or_value_is_a_usage_error_naming_it(
    tmp_path: Path, text: str, expected: str
) -> None:
    config = _config(tmp_path / "serve.toml", text)
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line
    assert line.startswith(f"better-compute: usage: {config}: ")
    assert expected in line


def test_a_file_others_can_change_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path / "serve.toml", 'role = "all"\n', mode=0o620)
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2
    assert (
        f"{config} can be changed by other users (mode 0620); it says which secret, keys and "
        f"database serve uses: chmod go-w {config}"
    ) in done.stderr


def test_a_readable_file_with_a_database_password_is_refused(tmp_path: Path) -> None:
    config = _config(
        tmp_path / "serve.toml", 'db = "postgresql://u:hunter2hunter2@db/x"\n', mode=0o644
    )
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2
    assert "holds a database password and other users can read it" in done.stderr
    assert "hunter2" not in done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@db/x?password=hunter2hunter2",
        "postgresql://db/x?sslmode=require&sslpassword=hunter2hunter2",
        "postgresql:///x?host=/run/postgresql&password=hunter2hunter2",
    ],
)
def test_a_password_in_the_query_counts_as_a_password(tmp_path: Path, url: str) -> None:
    config = _config(tmp_path / "serve.toml", f'db = "{url}"\n', mode=0o644)
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"better-compute: usage: {config} holds a database password and other users can "
        f"read it (mode 0644): chmod go-r {config}"
    )
    assert "hunter2" not in done.stderr


@pytest.mark.parametrize("mode", [0o644, 0o600], ids=["0644", "0600"])
def test_a_malformed_database_url_is_a_usage_error(tmp_path: Path, mode: int) -> None:
    config = _config(
        tmp_path / "serve.toml", 'db = "postgresql://u:hunter2hunter2@[x/db"\n', mode=mode
    )
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f'better-compute: usage: {config}: key "db": not a valid database URL'
    )
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stderr


def test_the_mode_is_the_opened_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the mode judged is the fstat of the file read, never a second stat of the path
    config = _config(tmp_path / "serve.toml", 'role = "all"\n', mode=0o644)
    real_stat = os.stat
    stats: list[object] = []

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        stats.append(path)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(serveconfig.os, "stat", stat)
        table, mode = serveconfig.read(config)
    assert (table, mode) == ({"role": "all"}, 0o644)
    assert stats == []


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    done = run([BC, "serve", "--config", str(tmp_path / "nope.toml")], env=cli_env(tmp_path))
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"better-compute: usage: --config {tmp_path / 'nope.toml'}: no such file"
    )
