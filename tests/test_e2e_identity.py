"""LoadState's cases, bcd doctor's outputs and bcd join --reset, through real processes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bcd.identity import persist_join
from bcd.keys.file import generate_file_key, key_to_pem
from tests.certs import node_identity
from tests.world import ControlPlane, Node

pytestmark = pytest.mark.e2e

MISMATCH = (
    "the node key does not match the node certificate; join again: "
    "bcd join --reset --yes, then bcd join"
)


@pytest.fixture
def joined(sqlite_control_plane: ControlPlane, tmp_path: Path) -> tuple[ControlPlane, Node, str]:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    return cp, node, pool


def test_doctor_warns_when_not_joined(sqlite_control_plane: ControlPlane, tmp_path: Path) -> None:
    site, _pool = sqlite_control_plane.site_and_pool()
    node = Node.make(tmp_path / "n", sqlite_control_plane, site)
    done = node.bcd("doctor", "--json")
    assert done.returncode == 0
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["identity"]["status"] == "warn"
    assert "bcd join" in checks["identity"]["message"]


def test_a_key_that_is_not_the_leafs_fails_load_and_doctor(
    joined: tuple[ControlPlane, Node, str],
) -> None:
    _cp, node, _pool = joined
    (node.data_dir / "node.key").write_bytes(key_to_pem(generate_file_key()))
    doctor = node.bcd("doctor")
    assert doctor.returncode == 1
    assert MISMATCH in doctor.stdout
    join = node.join(None)
    assert join.returncode == 1
    assert MISMATCH in join.stderr


def test_a_certified_next_key_is_promoted_and_another_removed(
    joined: tuple[ControlPlane, Node, str],
) -> None:
    _cp, node, _pool = joined
    key_pem = (node.data_dir / "node.key").read_bytes()
    (node.data_dir / "node.key.next").write_bytes(key_pem)
    (node.data_dir / "node.key.next").chmod(0o600)  # as a renewal writes it
    (node.data_dir / "node.key").write_bytes(key_to_pem(generate_file_key()))
    assert node.bcd("doctor").returncode == 0
    assert (node.data_dir / "node.key").read_bytes() == key_pem
    assert not (node.data_dir / "node.key.next").exists()
    (node.data_dir / "node.key.next").write_bytes(key_to_pem(generate_file_key()))
    assert node.bcd("doctor").returncode == 0
    assert not (node.data_dir / "node.key.next").exists()
    assert (node.data_dir / "node.key").read_bytes() == key_pem


def test_an_identity_that_expired_offline_answers_already_joined_and_resets(
    joined: tuple[ControlPlane, Node, str],
) -> None:
    cp, node, pool = joined
    past = datetime.now(UTC) - timedelta(days=3)
    key, identity = node_identity(not_before=past - timedelta(hours=24), not_after=past)
    persist_join(node.data_dir, identity, key_to_pem(key), datetime.now(UTC))

    doctor = node.bcd("doctor")
    assert doctor.returncode == 1
    assert (
        f"the certificate expired at {identity.not_after}; join again as root: "
        "bcd join --reset --yes, then bcd join"
    ) in doctor.stdout
    already = node.join(None)
    assert already.returncode == 0
    assert already.stdout.startswith(f"already joined as {identity.node_id}")

    dry = node.join(None, "--reset")
    assert dry.returncode == 2
    assert "would move" in dry.stdout
    assert json.loads((node.data_dir / "identity.json").read_text())["node_id"] == identity.node_id

    token = cp.token(pool, allowReclaim=True)["token"]
    done = node.join(token, "--reset", "--yes")
    assert done.returncode == 0, done.stderr
    assert "joined as node_" in done.stdout
    moved = sorted(p.name for p in node.data_dir.iterdir() if ".reset-" in p.name)
    assert any(name.startswith("identity.json.reset-") for name in moved)
    assert any(name.startswith("node.key.reset-") for name in moved)
    assert node.bcd("doctor").returncode == 0


def test_a_malformed_pin_stops_bcd_naming_it(joined: tuple[ControlPlane, Node, str]) -> None:
    _cp, node, _pool = joined
    text = node.config.read_text()
    node.config.write_text(
        text.replace('join_signing_key_pin = "sha256/', 'join_signing_key_pin = "sha1/')
    )
    for args in (("doctor",), ("join", "--sysfs-root", str(node.sysfs))):
        done = node.bcd(*args, input=b"")
        assert done.returncode == 1
        assert "join_signing_key_pin" in done.stdout + done.stderr
    node.config.write_text(text + 'colour = "blue"\n')
    done = node.bcd("doctor")
    assert done.returncode == 1
    assert '"colour"' in done.stdout


def test_a_different_node_id_is_refused_when_joined(joined: tuple[ControlPlane, Node, str]) -> None:
    _cp, node, _pool = joined
    done = node.join(None, "--node-id", "node_" + "0" * 26)
    assert done.returncode == 1
    assert "already joined" in done.stderr
