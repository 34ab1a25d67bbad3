"""``serve --downloads DIR`` serves regular files inside DIR only, never through a link."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.world import ControlPlane, E2EWorld

pytestmark = pytest.mark.e2e


def _status(cp: ControlPlane, version: str) -> tuple[int, bytes]:
    url = f"{cp.api}/api/compute/downloads/bcd/{version}/linux-amd64"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - http on loopback
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_links_planted_in_the_downloads_directory_are_not_followed(
    tmp_path: Path, e2e: E2EWorld
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "linux-amd64").write_bytes(b"a secret outside the downloads directory")
    downloads = tmp_path / "dl"
    (downloads / "bcd" / "1.0.0").mkdir(parents=True)
    (downloads / "bcd" / "1.0.0" / "linux-amd64").write_bytes(b"the artifact")
    (downloads / "bcd" / "2.0.0").mkdir()
    (downloads / "bcd" / "2.0.0" / "linux-amd64").symlink_to(outside / "linux-amd64")
    (downloads / "bcd" / "3.0.0").symlink_to(outside, target_is_directory=True)
    cp = e2e.control_plane(
        f"sqlite:///{tmp_path / 's.db'}", extra_args=["--downloads", str(downloads)]
    )
    assert _status(cp, "1.0.0") == (200, b"the artifact")
    for version in ("2.0.0", "3.0.0"):
        status, body = _status(cp, version)
        assert status == 404
        assert b"secret" not in body
