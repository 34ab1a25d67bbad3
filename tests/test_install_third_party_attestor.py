"""A third party's attestor reaches a real host: the artifact is built ``--with`` the
example attestor (tests/plugins/example_attestor), install-bcd.sh installs it as any
artifact, and ``BCD_JOIN_ATTESTOR=serial-allowlist`` has the script's ``bcd join`` use
it, with no token. Run for real, as root, in the install sandbox
(tests/installsandbox.py) against a real ``better-compute serve``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.installfixtures import REPO, Built, build_artifact, render
from tests.installsandbox import Sandbox, missing
from tests.world import ControlPlane, E2EWorld, root_site_store

WHY_NOT = missing()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
]

NAME = "serial-allowlist"
EXAMPLE_ATTESTOR = REPO / "tests" / "plugins" / "example_attestor"
JOINED = re.compile(r"^joined as (node_[0-9a-z]{26}) \(site (site_[0-9a-z]{26}), role node\)")
STOPPED = "install-bcd.sh: stopped; nothing of this run was left installed"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Built]:
    downloads = tmp_path_factory.mktemp("downloads")
    return downloads, build_artifact(downloads, "0.1.0", EXAMPLE_ATTESTOR)


def _serial(sandbox: Sandbox) -> str:
    return (sandbox.root / "machine/sys/class/dmi/id/product_serial").read_text().strip()


@pytest.fixture
def allowed(tmp_path: Path) -> Sandbox:
    """The sandboxed host whose product serial the control plane allows."""
    return Sandbox.make(tmp_path / "sandbox", seed=11)


@pytest.fixture
def cp(e2e: E2EWorld, built: tuple[Path, Built], allowed: Sandbox) -> tuple[ControlPlane, str, str]:
    db_url, site, (pool,) = root_site_store(e2e.tmp, "rack-s1", ("serials", {}))
    plane = e2e.control_plane(
        db_url,
        extra_args=[
            "--downloads",
            str(built[0]),
            "--attestor-setting",
            f"{NAME}.pool={pool}",
            "--attestor-setting",
            f"{NAME}.serials={_serial(allowed)}",
        ],
        gateway_url="https://127.0.0.1:{port}",
    )
    return plane, site, pool


def _script(plane: ControlPlane, tmp: Path, site: str, pool: str, built: Built) -> Path:
    out = tmp / "install-bcd.sh"
    done = render(plane, out, site=site, pool=pool, built=built)
    assert done.returncode == 0, done.stderr
    return out


def test_install_bcd_sh_installs_the_plugin_and_joins_with_it(
    cp: tuple[ControlPlane, str, str],
    built: tuple[Path, Built],
    allowed: Sandbox,
    tmp_path: Path,
) -> None:
    plane, site, pool = cp
    script = _script(plane, tmp_path, site, pool, built[1])

    done = allowed.run(["sh", str(script)], env={"BCD_JOIN_ATTESTOR": NAME})

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, (done.stdout, done.stderr)
    node_id = m.group(1)
    assert m.group(2) == site
    assert plane.one("SELECT pool_id FROM nodes WHERE id = ?", (node_id,)) == {"pool_id": pool}
    joined = plane.events(type_="node.joined")
    assert [e["nodeId"] for e in joined] == [node_id]
    assert plane.events(type_="security.join.refused") == []
    assert plane.one("SELECT COUNT(*) AS n FROM join_tokens") == {"n": 0}  # no token at all
    # the plugin sits in the unpacked version beside bcd, found through its dist-info
    lib = allowed.upper(f"/usr/local/lib/bcd/0.1.0-{built[1].sha256[:12]}/lib")
    assert (lib / "bcd_example_attestor" / "__init__.py").is_file()
    assert (lib / "bcd_example_attestor-0.1.0.dist-info" / "entry_points.txt").is_file()
    assert (allowed.upper("/var/lib/bcd") / "identity.json").is_file()
    assert "bcd.service" in "\n".join(allowed.systemctl_calls())


def test_a_machine_the_plugin_refuses_leaves_nothing_installed(
    cp: tuple[ControlPlane, str, str], built: tuple[Path, Built], tmp_path: Path
) -> None:
    plane, site, pool = cp
    script = _script(plane, tmp_path, site, pool, built[1])
    other = Sandbox.make(tmp_path / "other", seed=12)  # a serial not on the list

    done = other.run(["sh", str(script)], env={"BCD_JOIN_ATTESTOR": NAME})

    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "bcd: the control plane refused the join (ACCESS_DENIED: Join refused)" in lines
    assert lines[-2:] == ["install-bcd.sh: bcd join failed (above)", STOPPED]
    reasons = [e["reason"] for e in plane.events(type_="security.join.refused")]
    assert reasons == [f"{NAME}:serial-unknown"]
    assert not other.upper("/usr/local/lib/bcd").exists()
    assert not other.upper("/etc/bcd/config.toml").exists()


@pytest.mark.parametrize(
    ("env", "stdin", "message"),
    [
        ({"BCD_JOIN_ATTESTOR": "Serial_Allowlist"}, "",
         "install-bcd.sh: BCD_JOIN_ATTESTOR is not an attestor name (a-z, 0-9 and -)"),
        ({"BCD_JOIN_ATTESTOR": NAME}, "bcjt_x.y\n",
         "install-bcd.sh: both a join token and BCD_JOIN_ATTESTOR; pass only one (the token "
         "joins with join-token)"),
    ],
)  # fmt: skip
def test_a_bad_attestor_request_stops_before_anything_is_written(
    cp: tuple[ControlPlane, str, str],
    built: tuple[Path, Built],
    allowed: Sandbox,
    tmp_path: Path,
    env: dict[str, str],
    stdin: str,
    message: str,
) -> None:
    plane, site, pool = cp
    script = _script(plane, tmp_path, site, pool, built[1])

    done = allowed.run(["sh", str(script)], env=env, input=stdin)

    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == message
    assert allowed.files() == {}
