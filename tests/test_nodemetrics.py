"""bcd.nodemetrics: the textfile's atomic write, its mode and a failing write, on real
files (the end-to-end run is tests/test_e2e_node_metrics.py)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bcd.nodemetrics import TextfileMetrics


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)  # bcd.service's UMask
    try:
        yield
    finally:
        os.umask(old)


def _samples(path: Path) -> dict[str, float]:
    families = text_string_to_metric_families(path.read_text())
    return {s.name: s.value for f in families for s in f.samples}


def test_the_file_is_0644_from_the_rename_on_and_no_temp_file_stays(
    tmp_path: Path, umask_077: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "bcd.prom"
    renamed: list[int] = []
    rename = os.rename

    def spy(src: str, dst: str) -> None:  # the real rename, after noting the mode
        renamed.append(stat.S_IMODE(os.stat(src).st_mode))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", spy)
    metrics = TextfileMetrics(path)
    metrics.session(True)
    metrics.renewal_failed()
    metrics.renewed_at(datetime(2026, 12, 1, tzinfo=UTC))
    assert metrics.write()
    assert renamed == [0o644]  # node_exporter never sees the umask's 0600
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["bcd.prom"]
    samples = _samples(path)
    assert samples["bcd_session_up"] == 1.0
    assert samples["bcd_renewal_failures_total"] == 1.0
    assert (
        samples["bcd_last_renewal_timestamp_seconds"]
        == datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    )
    assert not any(name.endswith("_created") for name in samples)


def test_a_failing_write_is_logged_once_until_one_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "dir" / "bcd.prom"
    metrics = TextfileMetrics(path)
    with caplog.at_level(logging.INFO, logger="bcd.node"):
        assert not metrics.write()
        assert not metrics.write()
        path.parent.mkdir()
        assert metrics.write()
        path.unlink()
        path.parent.rmdir()  # failing again: logged again, once
        assert not metrics.write()
        assert not metrics.write()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot write the metrics textfile" in m for m in messages) == 2
    assert sum("is written again" in m for m in messages) == 1


def test_no_symlink_in_the_textfile_directory_is_followed(tmp_path: Path) -> None:
    """Another writer of the shared directory plants symlinks at the textfile's name
    and at prometheus-client's own predictable temporary name: neither target (a
    stand-in for node.key, 0600) is written or chmodded; the textfile is a file."""
    import threading

    path = tmp_path / "bcd.prom"
    victims = [tmp_path / "victim-a", tmp_path / "victim-b"]
    for victim in victims:
        victim.write_text("keep\n")
        victim.chmod(0o600)
    path.symlink_to(victims[0])
    (tmp_path / f"bcd.prom.{os.getpid()}.{threading.current_thread().ident}").symlink_to(victims[1])
    assert TextfileMetrics(path).write()
    for victim in victims:
        assert victim.read_text() == "keep\n"
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert "bcd_session_up" in path.read_text()
    assert not list(tmp_path.glob("*.tmp"))
