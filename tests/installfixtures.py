"""What the install tests share: the built artifacts, a control plane serving them, and
rendered install scripts."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.e2e import BIN, ControlPlane, cli_env, run

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "packaging" / "build_artifact.py"
HOST_PYTHON = Path("/usr/bin/python3")


@dataclass(frozen=True)
class Built:
    version: str
    sha256: str
    path: Path

    @property
    def arch(self) -> str:
        return self.path.name.removeprefix("linux-")


def build_artifact(out: Path, version: str, *with_dists: Path) -> Built:
    """packaging/build_artifact.py --out OUT --version VERSION [--with DIST ...], as a
    real process."""
    extra = [arg for dist in with_dists for arg in ("--with", str(dist))]
    done = subprocess.run(
        [sys.executable, str(BUILDER), "--out", str(out), "--version", version, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    sha = lines[1].split()[1]
    return Built(version, sha, Path(lines[0]))


def start_control_plane(
    home: Path, pki_template: Path, db_url: str, downloads: Path
) -> ControlPlane:
    home.mkdir(parents=True, exist_ok=True)
    return ControlPlane.start(
        home,
        pki_template,
        db_url,
        gateway_url="https://127.0.0.1:{port}",
        extra_args=["--downloads", str(downloads)],
    )


def render(
    cp: ControlPlane,
    out: Path,
    *,
    site: str,
    pool: str,
    built: Built,
    version: str | None = None,
    sha256: str | None = None,
    base_url: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return run(
        [
            str(BIN / "better-compute"),
            "daemon",
            "install-script",
            "--pool",
            pool,
            "--site",
            site,
            "--gateway-url",
            f"https://127.0.0.1:{cp.gateway_port}",
            "--base-url",
            base_url or cp.api,
            "--bcd-version",
            version or built.version,
            "--sha256",
            f"{built.arch}={sha256 or built.sha256}",
            "--out",
            str(out),
        ],
        env=cli_env(cp.home),
    )
