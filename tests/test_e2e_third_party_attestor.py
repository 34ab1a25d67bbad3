"""The example third-party attestor (tests/plugins/example_attestor, ``serial-allowlist``)
joins a node through real processes, with no change to bcd: it is a separate
distribution installed into the environment (``make`` does it) and found only
through the ``bcd.attestors`` entry-point group."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from tests.world import JOINED, REFUSED_LINE, ControlPlane, E2EWorld, Node, root_site_store

pytestmark = pytest.mark.e2e

NAME = "serial-allowlist"
ALLOWED = ("SN-ALLOW-0001", "SN-ALLOW-0002")


def test_the_example_attestor_is_installed_as_a_separate_distribution() -> None:
    (ep,) = [e for e in importlib.metadata.entry_points(group="bcd.attestors") if e.name == NAME]
    assert ep.value == "bcd_example_attestor"
    assert ep.dist is not None
    assert ep.dist.name == "bcd-example-attestor"


@pytest.fixture
def serial_control_plane(e2e: E2EWorld) -> tuple[ControlPlane, str, str]:
    db_url, site, (pool,) = root_site_store(e2e.tmp, "rack-s1", ("serials", {}))
    cp = e2e.control_plane(
        db_url,
        extra_args=[
            "--attestor-setting",
            f"{NAME}.pool={pool}",
            "--attestor-setting",
            f"{NAME}.serials={','.join(ALLOWED)}",
        ],
    )
    return cp, site, pool


def _node(
    tmp_path: Path, cp: ControlPlane, site: str, serial: str, monkeypatch: pytest.MonkeyPatch
) -> Node:
    node = Node.make(tmp_path / "node", cp, site, seed=7)
    (node.sysfs / "sys/class/dmi/id/product_serial").write_text(serial + "\n")
    # the example's node half reads the serial under this root (bcd join's own
    # --sysfs-root is not lent to plugins); the harness keeps it in the child's env
    monkeypatch.setenv("SERIAL_ALLOWLIST_SYSFS_ROOT", str(node.sysfs))
    return node


def test_an_allow_listed_serial_joins_with_no_token(
    serial_control_plane: tuple[ControlPlane, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, site, pool = serial_control_plane
    node = _node(tmp_path, cp, site, ALLOWED[1], monkeypatch)

    done = node.join(None, "--attestor", NAME)

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, done.stdout
    node_id = m.group(1)
    assert m.group(2) == site
    row = cp.one("SELECT pool_id FROM nodes WHERE id = ?", (node_id,))
    assert row == {"pool_id": pool}
    joined = cp.events(type_="node.joined")
    assert [e["nodeId"] for e in joined] == [node_id]
    assert joined[0]["nodeKey"] == "unattested"
    assert cp.events(type_="security.join.refused") == []


def test_a_serial_not_on_the_list_is_refused(
    serial_control_plane: tuple[ControlPlane, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, site, _pool = serial_control_plane
    node = _node(tmp_path, cp, site, "SN-NOT-LISTED", monkeypatch)

    done = node.join(None, "--attestor", NAME)

    assert done.returncode == 1
    assert done.stderr == REFUSED_LINE
    assert "serial-unknown" not in done.stderr + done.stdout
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == [f"{NAME}:serial-unknown"]
    assert cp.events(type_="node.joined") == []
    assert not (node.data_dir / "identity.json").exists()


# --- the node half's own table in config.toml ([attestors.serial-allowlist]) ---------

BAD_FIELD = (
    '[attestors.serial-allowlist]: "serial_field" must be one of product_serial, '
    "board_serial, chassis_serial"
)


def test_the_node_half_takes_its_setting_from_its_table(
    serial_control_plane: tuple[ControlPlane, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, site, pool = serial_control_plane
    node = _node(tmp_path, cp, site, "SN-NOT-LISTED", monkeypatch)
    (node.sysfs / "sys/class/dmi/id/board_serial").write_text(ALLOWED[0] + "\n")
    with node.config.open("a") as f:
        f.write('\n[attestors.serial-allowlist]\nserial_field = "board_serial"\n')

    done = node.join(None, "--attestor", NAME)

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, done.stdout
    assert cp.one("SELECT pool_id FROM nodes WHERE id = ?", (m.group(1),)) == {"pool_id": pool}
    assert cp.events(type_="security.join.refused") == []


def test_a_bad_value_in_its_table_is_refused_with_the_plugins_message(
    serial_control_plane: tuple[ControlPlane, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, site, _pool = serial_control_plane
    node = _node(tmp_path, cp, site, ALLOWED[0], monkeypatch)
    with node.config.open("a") as f:
        f.write('\n[attestors.serial-allowlist]\nserial_field = "mac"\n')

    done = node.join(None, "--attestor", NAME)

    assert done.returncode == 1
    assert done.stderr == f"bcd: {node.config}: {BAD_FIELD}\n"
    assert cp.events(type_="security.join.refused") == []
    assert cp.events(type_="node.joined") == []


def test_a_table_for_an_attestor_no_plugin_names_is_refused(
    serial_control_plane: tuple[ControlPlane, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, site, _pool = serial_control_plane
    node = _node(tmp_path, cp, site, ALLOWED[0], monkeypatch)
    with node.config.open("a") as f:
        f.write('\n[attestors.serial-allowlistt]\nserial_field = "board_serial"\n')

    done = node.join(None, "--attestor", NAME)

    assert done.returncode == 1
    assert done.stderr == (
        f'bcd: {node.config}: unknown attestor "attestors.serial-allowlistt": no attestor '
        "plugin has that name\n"
    )
