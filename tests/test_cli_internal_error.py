"""A bug in a command is one line on stderr and exit 70, never a traceback (whose text
could hold a secret); the debug variable brings the traceback back for a developer."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

import bcd.cli
import control.cli


def _boom(args: argparse.Namespace) -> int:
    raise RuntimeError("token bcjt_jt_secretsecret.hunter2 in a message")


def test_bcd_reports_an_internal_error_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("BCD_DEBUG", raising=False)
    monkeypatch.setattr(bcd.cli, "cmd_version", _boom)
    assert bcd.cli.main(["version"]) == 70
    err = capsys.readouterr().err
    assert err == (
        "bcd: internal error (RuntimeError); this is a bug in bcd. Run the same command "
        "with BCD_DEBUG=1 for the traceback\n"
    )
    monkeypatch.setenv("BCD_DEBUG", "1")
    with pytest.raises(RuntimeError):
        bcd.cli.main(["version"])


def test_better_compute_reports_an_internal_error_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    monkeypatch.delenv("BETTER_COMPUTE_DEBUG", raising=False)
    monkeypatch.setattr(control.cli, "cmd_migrate", _boom)
    umask = os.umask(0o022)
    try:
        assert control.cli.main(["migrate", "--db", f"sqlite:///{tmp_path}/x.db"]) == 70
    finally:
        os.umask(umask)  # main() sets 077 for its process: not for the rest of the suite
    err = capsys.readouterr().err
    assert "better-compute: internal error (RuntimeError); this is a bug." in err
    assert "hunter2" not in err
    assert "Traceback" not in err


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, pki_template: Path) -> None:
    import shutil
    import socket

    from tests.world import BIN, cli_env, run

    home = tmp_path / "cp"
    shutil.copytree(pki_template / "pki", home / "pki")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run(
            [
                str(BIN / "better-compute"), "serve", "--db", f"sqlite:///{tmp_path}/s.db",
                "--api-listen", f"127.0.0.1:{port}", "--gateway-listen", "127.0.0.1:0",
            ],
            env=cli_env(home),
            timeout=30,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "better-compute: Address already in use (errno 98)"
    assert "Traceback" not in done.stderr


def test_bcd_reports_a_refusal_of_the_system_as_such(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def denied(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", "/secret/path")

    monkeypatch.setattr(bcd.cli, "cmd_version", denied)
    assert bcd.cli.main(["version"]) == 1
    assert capsys.readouterr().err == "bcd: Permission denied (errno 13)\n"
