"""`bcd node` for real: renewal, the session, revocation and SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.world import BIN, ControlPlane, E2EWorld, Node, cli_env, leaf, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def short_lived(e2e: E2EWorld) -> ControlPlane:
    return e2e.control_plane(extra_args=["--cert-ttl-seconds", "10"])


def _start_node(node: Node) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env=cli_env(node.root, secret=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _serial(node: Node) -> str:
    return leaf(node).serial_hex


def test_node_renews_keeps_a_session_and_stops_when_revoked(
    short_lived: ControlPlane, tmp_path: Path
) -> None:
    cp = short_lived
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.split()[2]
    first = _serial(node)
    proc = _start_node(node)
    try:
        wait_for(lambda: _serial(node) != first, 20, "a renewal")
        assert (node.data_dir / "journal.db").exists()
        with cp.store.tx() as tx:
            certs = tx.query("SELECT serial FROM node_certs WHERE node_id = ?", (node_id,))
        assert len(certs) >= 2
        assert proc.poll() is None

        revoked = cp.cli("nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant)
        assert revoked.returncode == 0, revoked.stderr
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    _out, err = proc.communicate()
    assert code == 1, err
    assert "agent: this node's certificate was revoked" in err
    assert "certificate revoked" in err
    assert (node.data_dir / "identity.json").exists()
    assert (node.data_dir / "node.key").exists()


def test_node_exits_cleanly_on_sigterm(short_lived: ControlPlane, tmp_path: Path) -> None:
    cp = short_lived
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    proc = _start_node(node)
    try:
        # SIGTERM once the agent runs (its session is open), not after a fixed sleep: on
        # a loaded machine the interpreter may still be importing, and Python's default
        # SIGTERM action is not the agent's clean stop
        assert _wait_for_line(proc, "session open", 60), "bcd node never opened its session"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> bool:
    """Read ``proc``'s stderr until a line holds ``needle`` (True) or it ends or
    ``timeout_s`` passes (False); the reader thread leaves the rest of stderr unread."""
    found = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if needle in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout_s)


def test_node_without_identity_says_how_to_join(short_lived: ControlPlane, tmp_path: Path) -> None:
    site, _pool = short_lived.site_and_pool()
    node = Node.make(tmp_path / "n", short_lived, site)
    done = node.bcd("node")
    assert done.returncode == 1
    assert "bcd join" in done.stderr


@pytest.mark.parametrize("fail_point", ["next-key-first", "next-key", "identity", "rename"])
def test_sigkill_at_a_renewal_storage_step_leaves_a_loadable_identity(
    short_lived: ControlPlane, tmp_path: Path, fail_point: str
) -> None:
    """A real `bcd node` kills itself (SIGKILL) right after the named step is on disk;
    the next start loads a matching key and certificate and renews again."""
    from bcd.identity import load_state

    cp = short_lived
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    before = _serial(node)
    proc = subprocess.Popen(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env={**cli_env(node.root, secret=False), "BCD_FAIL_POINT": fail_point},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state = load_state(node.data_dir)
    assert state is not None
    assert state.leaf_info.spki_sha256 == _spki_of_key(state)
    settled = _serial(node)
    assert settled in (before, state.leaf_info.serial_hex)
    again = _start_node(node)
    try:
        wait_for(lambda: _serial(node) != settled, 20, "a renewal after the crash")
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=10)
    reloaded = load_state(node.data_dir)
    assert reloaded is not None
    assert reloaded.leaf_info.spki_sha256 == _spki_of_key(reloaded)


def _spki_of_key(state) -> str:  # type: ignore[no-untyped-def]
    from bcd import pki

    return pki.sha256_hex(pki.spki_der(state.key.public_key()))
