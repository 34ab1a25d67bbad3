"""The systemd units pass `systemd-analyze verify` (with ExecStart pointed at this bcd)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parents[1] / "systemd"


@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_unit_verifies(unit: str, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing (Debian package systemd)")
    bcd = Path(sys.executable).parent / "bcd"
    text = (UNITS / unit).read_text().replace("/usr/local/bin/bcd", str(bcd))
    (tmp_path / unit).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    problems = [ln for ln in done.stderr.splitlines() if unit in ln or "error" in ln.lower()]
    assert done.returncode == 0, done.stderr
    assert problems == [], problems
