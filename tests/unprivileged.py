"""An interpreter an unprivileged user can run, with bcd installed (for tests as root).

The project's venv lives under /root (0700), which no other user can reach, so a test
that runs ``bcd node`` as another user needs its own: a venv made from Debian's
``/usr/bin/python3`` in a world-readable directory under /var/tmp, with bcd installed
from a copy of this checkout's source. The copy leaves the checkout untouched (a
build writes build/ and the egg-info next to the sources) and drops tpm2-pytss from
the dependencies: ``bcd node`` never opens the TPM (``bcd helper`` does), so a node
that needed tpm2-pytss to start would fail here.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = Path("/usr/bin/python3")
PACKAGES = ("bcd", "attestors", "control")
NOT_FOR_THE_NODE = "tpm2-pytss"


@dataclass(frozen=True)
class UnprivilegedVenv:
    """A venv every user can run: ``bin`` holds its ``bcd`` and ``python``."""

    root: Path
    bin: Path
    seconds: float

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def reachable_by_others(path: Path) -> bool:
    """Whether a user that is neither the owner nor in the group can reach ``path``."""
    for part in (path, *path.parents):
        mode = os.stat(part).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def _without(pyproject: str, requirement: str) -> str:
    """pyproject.toml with one line of ``dependencies`` removed (it must be there)."""
    line = re.compile(rf'^\s*"{re.escape(requirement)}[^"]*",\n', re.MULTILINE)
    out, n = line.subn("", pyproject, count=1)
    if n != 1:
        raise RuntimeError(f"{requirement} is not among pyproject.toml's dependencies")
    return out


def _run(args: list[str]) -> None:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=300, check=False, umask=0o022
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args[:3]} failed ({done.returncode}): {done.stdout}{done.stderr}")


def make_unprivileged_venv() -> UnprivilegedVenv:
    """Build the venv (a few seconds with pip's cache) in a new 0755 directory."""
    if not SYSTEM_PYTHON.exists():
        raise RuntimeError(f"{SYSTEM_PYTHON} is missing (Debian's python3, with python3-venv)")
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="bcd-unprivileged-", dir="/var/tmp"))
    try:
        root.chmod(0o755)
        src = root / "src"
        src.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for package in PACKAGES:
            shutil.copytree(REPO / package, src / package, ignore=ignore)
        pyproject = (REPO / "pyproject.toml").read_text()
        (src / "pyproject.toml").write_text(_without(pyproject, NOT_FOR_THE_NODE))
        venv = root / "venv"
        _run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)])
        python = str(venv / "bin" / "python")
        _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)])
        shutil.rmtree(src)  # installed: the copy is no longer needed
        # the node must not need what was left out
        probe = subprocess.run(
            [python, "-c", "import tpm2_pytss"], capture_output=True, timeout=60, check=False
        )
        if probe.returncode == 0:
            raise RuntimeError(f"{NOT_FOR_THE_NODE} got installed into {venv} after all")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    bin_dir = venv / "bin"
    assert reachable_by_others(bin_dir / "bcd"), f"{bin_dir} is not reachable by other users"
    return UnprivilegedVenv(root, bin_dir, time.monotonic() - started)
