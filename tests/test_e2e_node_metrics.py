"""`bcd node`'s node_exporter textfile ([metrics] textfile), for real: a `bcd node`
process against a real serve, the file read as node_exporter would."""

from __future__ import annotations

import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.world import BIN, ControlPlane, E2EWorld, Node, cli_env, leaf, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def short_lived(e2e: E2EWorld) -> ControlPlane:
    return e2e.control_plane(extra_args=["--cert-ttl-seconds", "10"])


def _joined_node(cp: ControlPlane, root: Path, textfile: Path) -> Node:
    site, pool = cp.site_and_pool()
    node = Node.make(root, cp, site)
    with node.config.open("a") as f:
        f.write(f'[metrics]\ntextfile = "{textfile}"\n')
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    return node


def _start(node: Node) -> subprocess.Popen[bytes]:
    """`bcd node` under a umask of 077: the textfile is 0644 all the same."""
    return subprocess.Popen(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env=cli_env(node.root, secret=False),
        stdout=subprocess.DEVNULL,
        stderr=(node.root / "node.log").open("ab"),
        umask=0o077,
    )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def _samples(textfile: Path) -> dict[str, float]:
    """Every sample of the textfile, by name, parsed by prometheus_client's parser."""
    if not textfile.exists():
        return {}
    families = text_string_to_metric_families(textfile.read_text())
    return {s.name: s.value for family in families for s in family.samples}


def _session_up(textfile: Path) -> bool:
    return _samples(textfile).get("bcd_session_up") == 1.0


def _check_file(textfile: Path) -> None:
    st = textfile.stat()
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert sorted(p.name for p in textfile.parent.iterdir()) == [textfile.name]  # no temp files


def test_node_writes_its_textfile_and_keeps_it_current(
    short_lived: ControlPlane, tmp_path: Path
) -> None:
    cp = short_lived
    textfile = tmp_path / "node-exporter" / "bcd.prom"
    textfile.parent.mkdir()
    node = _joined_node(cp, tmp_path / "n", textfile)
    first = leaf(node)
    proc = _start(node)
    try:
        wait_for(lambda: _session_up(textfile), 15, "bcd_session_up 1")
        before = _samples(textfile)
        assert before["bcd_certificate_expiry_timestamp_seconds"] == first.not_after.timestamp()
        assert before["bcd_identity_generation"] == 1.0
        assert before["bcd_renewal_failures_total"] == 0.0
        assert "bcd_last_renewal_timestamp_seconds" not in before  # never renewed yet
        _check_file(textfile)

        started = time.time()
        wait_for(
            lambda: "bcd_last_renewal_timestamp_seconds" in _samples(textfile), 20, "a renewal"
        )
        after = _samples(textfile)
        renewed = leaf(node)
        assert renewed.serial_hex != first.serial_hex
        assert started - 1 <= after["bcd_last_renewal_timestamp_seconds"] <= time.time()
        assert after["bcd_certificate_expiry_timestamp_seconds"] == renewed.not_after.timestamp()
        assert after["bcd_certificate_expiry_timestamp_seconds"] > first.not_after.timestamp()
        assert after["bcd_session_up"] == 1.0
        _check_file(textfile)

        wait_for(
            lambda: (
                _samples(textfile).get("bcd_last_renewal_timestamp_seconds", 0)
                > after["bcd_last_renewal_timestamp_seconds"]
            ),
            20,
            "a second renewal moving the last-renewal time",
        )
    finally:
        code = _stop(proc)
    assert code == 0, (node.root / "node.log").read_text()
    stopped = _samples(textfile)
    assert stopped["bcd_session_up"] == 0.0  # a stopped node has no session
    _check_file(textfile)

    # the next start takes the last renewal from the journal
    again = _start(node)
    try:
        wait_for(lambda: _session_up(textfile), 15, "bcd_session_up 1 after a restart")
        restarted = _samples(textfile)
        assert restarted["bcd_last_renewal_timestamp_seconds"] == pytest.approx(
            stopped["bcd_last_renewal_timestamp_seconds"], abs=1.0
        )
        assert restarted["bcd_renewal_failures_total"] == 0.0
    finally:
        assert _stop(again) == 0


def test_failed_renewals_and_a_lost_session_are_counted(
    short_lived: ControlPlane, tmp_path: Path
) -> None:
    cp = short_lived
    textfile = tmp_path / "node-exporter" / "bcd.prom"
    textfile.parent.mkdir()
    node = _joined_node(cp, tmp_path / "n", textfile)
    proc = _start(node)
    try:
        wait_for(lambda: _session_up(textfile), 15, "bcd_session_up 1")
        cp.stop()  # the gateway goes: the session is lost, the renewal at 6 s fails
        wait_for(lambda: _samples(textfile).get("bcd_session_up") == 0.0, 15, "session down")
        wait_for(
            lambda: _samples(textfile).get("bcd_renewal_failures_total", 0) >= 1,
            20,
            "a failed renewal counted",
        )
        assert "bcd_last_renewal_timestamp_seconds" not in _samples(textfile)
        assert proc.poll() is None
        _check_file(textfile)
    finally:
        assert _stop(proc) == 0
    assert "renewal failed" in (node.root / "node.log").read_text()


def test_an_unwritable_textfile_is_logged_once_and_the_node_runs_on(
    short_lived: ControlPlane, tmp_path: Path
) -> None:
    cp = short_lived
    textfile = tmp_path / "missing-dir" / "bcd.prom"
    node = _joined_node(cp, tmp_path / "n", textfile)
    proc = _start(node)
    log = node.root / "node.log"
    try:
        wait_for(lambda: "session open (" in log.read_text(), 15, "the session")
        wait_for(lambda: "renewed: certificate" in log.read_text(), 20, "a renewal")
        assert proc.poll() is None
    finally:
        assert _stop(proc) == 0
    text = log.read_text()
    assert text.count("cannot write the metrics textfile") == 1, text
    assert f"cannot write the metrics textfile {textfile}" in text
    assert not textfile.parent.exists()
