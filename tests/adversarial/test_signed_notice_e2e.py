"""A real revocation reaches bcd as a notice signed where it was made: a running node
stops on the stream's notice, and a node started afterwards stops on the notice in the
gateway's UNAUTHENTICATED answer (both verified under join_signing_key_pin)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.world import BIN, ControlPlane, Node, cli_env

pytestmark = pytest.mark.e2e


def _node(node: Node) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env=cli_env(node.root, secret=False),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_node_started_after_its_revocation_stops_on_the_signed_notice(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site, seed=51)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    node_id = json.loads((node.data_dir / "identity.json").read_text())["node_id"]
    done = cp.cli("nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant,
                  "--reason", "decommissioned")  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = cp.one("SELECT revoke_notice FROM node_certs WHERE node_id = ?", (node_id,))
    assert row is not None
    assert str(row["revoke_notice"]).count(".") == 2  # a compact JWS, stored
    started = time.monotonic()
    ran = _node(node)
    assert ran.returncode == 1
    assert ran.stderr.rstrip().endswith("agent: this node's certificate was revoked")
    assert "certificate revoked (reason: decommissioned" in ran.stderr
    assert "signed by the control plane" in ran.stderr
    assert time.monotonic() - started < 20
