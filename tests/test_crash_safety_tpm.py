"""Crash safety of a TPM renewal with real processes: SIGKILL at each storage step.

One TPM node (a ``bcd join --attestor tpm`` on the session's swtpm, so its leaf
names the AK) under a real ``bcd helper`` (root, holding the swtpm) and a real
``better-compute serve --cert-ttl-seconds 10``, shared by the cases. Each case runs
``bcd node`` with ``BCD_FAIL_POINT=<point>``: it kills itself (SIGKILL) once that
storage step of its AK-bound renewal is on disk. Then:

- what the next start loads (a copy of the data directory, through the helper):
  node.key's record derives the key of identity.json's leaf, the old certificate
  before identity.json was replaced and the new one after, no node.key.next left;
- ``bcd node`` started again without the fail point renews again (a new serial in
  node_certs), and after it the identity loads through the helper and ``bcd doctor``
  finds it ok; the control plane agrees: the same identity generation, the leaf
  still names the AK, no refused renewal.

The cases share the session's swtpm, one at a time (its helper holds it), but each
has its own control plane: a case takes up to two of the six renewals a node may
make in an hour, and the same TPM joining one control plane again is the same node.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki
from bcd.helper.client import HelperClient
from bcd.helper.nodekeys import HelperKeys
from bcd.identity import LoadedTpmState, load_state
from bcd.renew import FAIL_POINTS
from bcd.tpm.record import NodeKeyRecord
from tests.world import (
    BIN,
    JOINED,
    ControlPlane,
    E2EWorld,
    Node,
    SwTpm,
    cli_env,
    helper_table,
    leaf,
    start_helper,
    stop_process,
    tpm_node,
)

pytestmark = pytest.mark.e2e

# Which certificate the next start loads after a crash at each step, and whether the
# control plane had issued a certificate by then (the request goes out after
# next-key-first, and the answer is checked before next-key).
EXPECTED = {
    "next-key-first": ("old", False),
    "next-key": ("old", True),
    "identity": ("new", True),
    "rename": ("new", True),
}


@dataclass
class TpmNode:
    cp: ControlPlane
    node: Node
    node_id: str
    statement: str
    socket: Path


@pytest.fixture
def tpm_helper_node(tmp_path: Path, e2e: E2EWorld, swtpm: SwTpm) -> Iterator[TpmNode]:
    """A TPM node joined with its AK, its `bcd helper` running, short certificates."""
    cp, site, _pool = e2e.tpm_plane(swtpm.ca_bundle, ["--cert-ttl-seconds", "10"])
    sockdir = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    helper: subprocess.Popen[str] | None = None
    try:
        node = tpm_node(tmp_path / "node", cp, site, swtpm)
        socket = sockdir / "run" / "helper.sock"
        with node.config.open("a") as f:
            f.write(helper_table("root", socket, tmp_path / "hostconfig"))
        # the join opens the swtpm itself (it serves one connection), then the helper
        done = node.join(None, "--attestor", "tpm")
        assert done.returncode == 0, done.stderr
        joined = JOINED.match(done.stdout.strip())
        assert joined is not None, done.stdout
        (statement,) = leaf(node).statements
        assert statement.startswith("urn:bc:tpm-ak:sha256:")
        helper = start_helper(node)
        yield TpmNode(cp, node, joined.group(1), statement, socket)
    finally:
        if helper is not None:
            stop_process(helper)
        shutil.rmtree(sockdir, ignore_errors=True)


def _bcd_node(node: Node, fail_point: str | None = None) -> subprocess.Popen[str]:
    env = cli_env(node.root, secret=False)
    if fail_point is not None:
        env["BCD_FAIL_POINT"] = fail_point
    return subprocess.Popen(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _load_through_helper(data_dir: Path, socket: Path) -> LoadedTpmState:
    """LoadState as `bcd node` does it: node.key's record derived through the helper."""

    async def load() -> LoadedTpmState:
        keys = HelperKeys(HelperClient(socket))
        state = await trio.to_thread.run_sync(load_state, data_dir, keys.derive_sync)
        assert isinstance(state, LoadedTpmState)
        # checked here too: the record is pinned to the leaf's key and the TPM derives it
        derived = await keys.client.nodekey(state.record)
        leaf_key = state.leaf.public_key()
        assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
        assert pki.same_public_key(derived.public_key, leaf_key)
        assert state.record.pin == pki.spki_pin(leaf_key)
        return state

    return trio.run(load)


def _certs(t: TpmNode) -> dict[str, tuple[int, str]]:
    """node_certs of the node: serial -> (identity generation, statements)."""
    with t.cp.store.tx() as tx:
        rows = tx.query(
            "SELECT serial, identity_generation, statements FROM node_certs WHERE node_id = ?",
            (t.node_id,),
        )
    return {r["serial"]: (r["identity_generation"], r["statements"]) for r in rows}


def _generation(t: TpmNode) -> int:
    row = t.cp.one("SELECT identity_generation FROM nodes WHERE id = ?", (t.node_id,))
    assert row is not None
    return int(row["identity_generation"])


def _wait(proc: subprocess.Popen[str], done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"bcd node exited: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {stop_process(proc)}")
        time.sleep(0.05)


def test_every_fail_point_is_covered() -> None:
    assert tuple(EXPECTED) == FAIL_POINTS


@pytest.mark.parametrize("point", FAIL_POINTS)
def test_sigkill_at_a_tpm_renewal_storage_step_loads_a_matching_key_and_renews_again(
    tpm_helper_node: TpmNode, tmp_path: Path, point: str
) -> None:
    t, node = tpm_helper_node, tpm_helper_node.node
    before = leaf(node)
    generation = _generation(t)
    issued_before = _certs(t)
    assert before.serial_hex in issued_before

    crashing = _bcd_node(node, point)
    try:
        code = crashing.wait(30)
    finally:
        err = stop_process(crashing)
    assert code == -signal.SIGKILL, err  # the fail point was reached: the renewal got there
    assert "Traceback" not in err, err
    issued_at_crash = set(_certs(t)) - set(issued_before)
    which, sent = EXPECTED[point]
    assert len(issued_at_crash) == (1 if sent else 0)

    # what the next start loads: taken before the restart settles the directory
    copy = tmp_path / "data-at-crash"
    shutil.copytree(node.data_dir, copy)
    again = _bcd_node(node)
    try:
        loaded = _load_through_helper(copy, t.socket)
        assert not (copy / "node.key.next").exists()
        if which == "old":
            assert loaded.leaf_info.serial_hex == before.serial_hex
        else:
            assert {loaded.leaf_info.serial_hex} == issued_at_crash
            assert loaded.leaf_info.spiffe == before.spiffe
        settled = loaded.leaf_info.serial_hex

        # and `bcd node` renews again from there
        def renewed() -> bool:
            return (
                leaf(node).serial_hex != settled and not (node.data_dir / "node.key.next").exists()
            )

        _wait(again, renewed, "no renewal after the crash")
        assert again.poll() is None
        again.send_signal(signal.SIGTERM)
        assert again.wait(15) == 0
    finally:
        err = stop_process(again)
    assert "renewed: certificate" in err, err
    assert "renewal failed" not in err, err
    assert "Traceback" not in err, err

    state = _load_through_helper(node.data_dir, t.socket)
    assert state.identity.key == "tpm"
    assert NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes()) == state.record
    assert state.leaf_info.statements == (t.statement,)  # still AK-bound
    doctor = node.bcd("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["identity"]["status"] == "ok", checks["identity"]
    assert doctor.returncode == 0, doctor.stdout

    # the control plane's view: the leaf is its latest, same generation, still the AK
    certs = _certs(t)
    serial = state.leaf_info.serial_hex
    assert serial not in issued_before
    assert serial not in issued_at_crash
    generation_of_leaf, statements = certs[serial]
    assert (generation_of_leaf, json.loads(statements)) == (generation, [t.statement])
    assert _generation(t) == generation
    assert t.cp.events(type_="security.renew.refused") == []
