"""A bug in a command is one line on stderr and exit 70, never a traceback (whose text
could hold a secret); the debug variable brings the traceback back for a developer."""

from __future__ import annotations

import argparse

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
    assert control.cli.main(["migrate", "--db", f"sqlite:///{tmp_path}/x.db"]) == 70
    err = capsys.readouterr().err
    assert "better-compute: internal error (RuntimeError); this is a bug." in err
    assert "hunter2" not in err
    assert "Traceback" not in err
