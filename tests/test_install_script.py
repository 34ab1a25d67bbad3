"""install-bcd.sh run for real, as root, in a mount namespace (tests/installsandbox.py)
against a real `better-compute serve` that serves the bcd artifact.

The host's /etc, /usr/local, /var and /run are overlay mounts there: what the script
writes is read back from the upper directories, and the host is untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bcd.config import HelperConfig, parse_config
from tests.installfixtures import (
    HOST_PYTHON,
    REPO,
    Built,
    build_artifact,
    render,
    start_control_plane,
)
from tests.installsandbox import Sandbox, missing
from tests.world import BIN, ControlPlane, cli_env

WHY_NOT = missing()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
]

JOINED = re.compile(r"^joined as (node_[0-9a-z]{26}) \(site (site_[0-9a-z]{26}), role node\)")
UNITS = "bcd-join.service bcd-helper.service bcd.service"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Built, Built]:
    """The downloads directory with two versions of bcd built from this checkout."""
    downloads = tmp_path_factory.mktemp("downloads")
    first = build_artifact(downloads, "0.1.0")
    second = build_artifact(downloads, "0.1.1")
    return downloads, first, second


@pytest.fixture
def cp(
    tmp_path: Path, pki_template: Path, artifacts: tuple[Path, Built, Built]
) -> Iterator[ControlPlane]:
    plane = start_control_plane(
        tmp_path / "cp", pki_template, f"sqlite:///{tmp_path / 'store.db'}", artifacts[0]
    )
    try:
        yield plane
    finally:
        plane.stop()


def _uid(sandbox: Sandbox, name: str) -> tuple[int, int, str]:
    """uid, gid and shell of ``name`` in the sandbox's /etc/passwd."""
    for line in sandbox.upper("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2]), int(fields[3]), fields[6]
    raise AssertionError(f"no user {name} in the sandbox's /etc/passwd")


def _mode_owner(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def _token(cp: ControlPlane, pool: str) -> str:
    token: str = cp.token(pool)["token"]
    return token


def _script(cp: ControlPlane, tmp: Path, site: str, pool: str, built: Built, **kw: str) -> Path:
    out = tmp / f"install-bcd-{built.version}-{len(list(tmp.glob('install-bcd-*')))}.sh"
    done = render(cp, out, site=site, pool=pool, built=built, **kw)
    assert done.returncode == 0, done.stderr
    return out


def test_a_fresh_install_joins_and_a_run_without_a_token_upgrades(
    cp: ControlPlane, tmp_path: Path, artifacts: tuple[Path, Built, Built]
) -> None:
    _, first, second = artifacts
    site, pool = cp.site_and_pool()
    script = _script(cp, tmp_path, site, pool, first)
    token = _token(cp, pool)
    sandbox = Sandbox.make(tmp_path / "sandbox")

    done = sandbox.run(["sh", str(script)], env={"BCD_JOIN_TOKEN": token})

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, (done.stdout, done.stderr)
    node_id = m.group(1)
    assert m.group(2) == site
    assert cp.one("SELECT pool_id FROM nodes WHERE id = ?", (node_id,)) == {"pool_id": pool}
    assert token not in done.stdout + done.stderr
    # the bcd user: a system user with no login, not in the tss group
    uid, gid, shell = _uid(sandbox, "bcd")
    assert uid < 1000
    assert shell == "/usr/sbin/nologin"
    groups = sandbox.upper("/etc/group").read_text()
    assert not re.search(r"^tss:.*\bbcd\b", groups, re.M)
    # config.toml and the join key: what the script was rendered with
    config = sandbox.upper("/etc/bcd/config.toml")
    assert _mode_owner(config) == (0o644, 0, 0)
    cfg = parse_config(config.read_text(), Path("/etc/bcd/config.toml"))
    assert cfg.site == site
    assert cfg.gateway_url == f"https://127.0.0.1:{cp.gateway_port}"
    for name, pin in cp.pins().items():
        assert getattr(cfg, name) == pin
    assert cfg.helper == HelperConfig()
    jwk = sandbox.upper("/etc/bcd/join-encryption.jwk")
    assert _mode_owner(jwk) == (0o644, 0, 0)
    assert json.loads(jwk.read_text()) == cp.well_known()["join"]["encryptionJwk"]
    # the serving CA certificate, the node's only TLS trust anchor, as the API publishes it
    serving_ca = sandbox.upper("/etc/bcd/serving-ca.pem")
    assert _mode_owner(serving_ca) == (0o644, 0, 0)
    assert serving_ca.read_text() == cp.well_known()["gateway"]["servingCaPem"]
    assert _mode_owner(sandbox.upper("/etc/bcd")) == (0o755, 0, 0)
    # the data directory is the bcd user's; the join handed the identity over to it
    data = sandbox.upper("/var/lib/bcd")
    assert _mode_owner(data) == (0o700, uid, gid)
    ident = json.loads((data / "identity.json").read_text())
    assert ident["node_id"] == node_id
    for name in ("identity.json", "node.key"):
        assert _mode_owner(data / name) == (0o600, uid, gid)
    record = sandbox.upper("/var/lib/bcd-hostconfig/join-response.jws")
    assert _mode_owner(record) == (0o600, 0, 0)
    assert _mode_owner(sandbox.upper("/var/lib/bcd-hostconfig")) == (0o700, 0, 0)
    # bcd: a versioned directory, the host's python3, /usr/local/bin/bcd a symlink into it
    version_dir = f"/usr/local/lib/bcd/0.1.0-{first.sha256[:12]}"
    link = sandbox.upper("/usr/local/bin/bcd")
    assert os.readlink(link) == f"{version_dir}/bin/bcd"
    launcher = sandbox.upper(f"{version_dir}/bin/bcd")
    assert launcher.read_text().splitlines()[0] == f"#!{HOST_PYTHON} -IS"
    assert _mode_owner(launcher) == (0o755, 0, 0)
    for unit in UNITS.split():
        installed = sandbox.upper(f"/usr/local/lib/systemd/system/{unit}")
        assert installed.read_bytes() == (REPO / "systemd" / unit).read_bytes()
        assert _mode_owner(installed) == (0o644, 0, 0)
    tmpfiles = sandbox.upper("/usr/local/lib/tmpfiles.d/bcd.conf")
    assert tmpfiles.read_bytes() == (REPO / "systemd" / "bcd.tmpfiles.conf").read_bytes()
    assert sandbox.systemctl_calls() == [
        "daemon-reload",
        f"enable {UNITS}",
        "start bcd-helper.service bcd.service",
    ]
    # the token is nowhere on disk: not in any file the run wrote, nor in its tmp
    assert sandbox.contains(token.encode()) == []
    assert sandbox.contains(token.split(".")[1].encode()) == []
    # the installed bcd runs with the host's python3, as root and as the bcd user
    as_root = sandbox.run(["/usr/local/bin/bcd", "doctor"])
    assert f"node {node_id}" in as_root.stdout, as_root.stdout + as_root.stderr
    as_bcd = sandbox.run(
        ["setpriv", "--reuid=bcd", "--regid=bcd", "--clear-groups", "/usr/local/bin/bcd", "version"]
    )
    assert as_bcd.stdout.strip() == "bcd 0.1.0", as_bcd.stderr
    before = {name: (data / name).read_bytes() for name in ("identity.json", "node.key")}

    # the same host again, without a token and a script for the next version: an upgrade
    upgrade = _script(cp, tmp_path, site, pool, second)
    again = sandbox.run(["sh", str(upgrade)], input="")

    assert again.returncode == 0, again.stderr
    assert "upgrading bcd to 0.1.1" in again.stderr
    new_dir = f"/usr/local/lib/bcd/0.1.1-{second.sha256[:12]}"
    assert os.readlink(link) == f"{new_dir}/bin/bcd"
    version = sandbox.run(["/usr/local/bin/bcd", "version"])
    assert version.stdout.strip() == "bcd 0.1.1", version.stderr
    assert {name: (data / name).read_bytes() for name in before} == before
    assert sandbox.upper(version_dir).is_dir()  # the replaced version stays, for a way back
    assert sandbox.systemctl_calls()[3:] == [
        "daemon-reload",
        f"enable {UNITS}",
        "restart bcd-helper.service bcd.service",
    ]
    assert cfg == parse_config(config.read_text(), Path("/etc/bcd/config.toml"))


def _host_view(sandbox: Sandbox) -> dict[str, str]:
    """The upper dirs' files, without what useradd and userdel rewrite with the same content."""
    files = sandbox.files()
    for path in list(files):
        if files[path] == "dir":
            del files[path]
    same = {}
    for path in files:
        if re.fullmatch(r"/etc/(passwd|group|shadow|gshadow|subuid|subgid)-?", path):
            host, copy = Path(path), sandbox.upper(path)
            if path.endswith("-") or copy.read_bytes() == host.read_bytes():
                same[path] = True
        if path.endswith(".lock") or path.startswith("/var/log/"):
            same[path] = True
    return {p: k for p, k in files.items() if p not in same}


def test_every_refusal_stops_with_a_clear_message_and_installs_nothing(
    cp: ControlPlane, tmp_path: Path, artifacts: tuple[Path, Built, Built]
) -> None:
    _, first, _ = artifacts
    site, pool = cp.site_and_pool()
    good = _script(cp, tmp_path, site, pool, first)
    token = _token(cp, pool)
    cases: list[tuple[str, list[str], dict[str, str], str, str]] = []

    wrong_sum = _script(cp, tmp_path, site, pool, first, sha256="0" * 64)
    cases.append(
        ("wrong checksum", ["sh", str(wrong_sum)], {"BCD_JOIN_TOKEN": token}, "",
         f"but this script expects {'0' * 64}; nothing was installed")
    )  # fmt: skip
    cases.append(
        ("token in an argument", ["sh", str(good), token], {}, "",
         "an argument looks like a join token; the token is never read from the command line")
    )  # fmt: skip
    cases.append(
        ("not a join token", ["sh", str(good)], {"BCD_JOIN_TOKEN": "bcak_" + "x" * 40}, "",
         "the join token does not look like a join token (bcjt_...); it was not echoed")
    )  # fmt: skip
    cases.append(
        ("not a join token on stdin", ["sh", str(good)], {}, "hunter2-" + "y" * 30 + "\n",
         "the join token does not look like a join token (bcjt_...)")
    )  # fmt: skip
    closed = _closed_port()
    unreachable = _script(cp, tmp_path, site, pool, first, base_url=f"http://127.0.0.1:{closed}")
    cases.append(
        ("unreachable server", ["sh", str(unreachable)], {"BCD_JOIN_TOKEN": token}, "",
         f"cannot download bcd from http://127.0.0.1:{closed}/api/compute/downloads/bcd/0.1.0/")
    )  # fmt: skip
    cases.append(
        ("no token, not installed", ["sh", str(good)], {}, "",
         "no join token, and /etc/bcd/config.toml does not exist (so this is not an upgrade)")
    )  # fmt: skip
    cases.append(
        ("the unrendered template", ["sh", str(REPO / "install-bcd.sh")], {"BCD_JOIN_TOKEN": token},
         "", "this is the unrendered template; generate the script with: better-compute daemon")
    )  # fmt: skip
    # no sha256sum: PATH holds only what the script needs before it looks for it
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    for tool in ("unshare", "mount", "sh", "id", "uname", "rm"):
        found = shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin")
        assert found, tool
        (bare / tool).symlink_to(found)
    cases.append(
        ("no sha256sum", ["sh", str(good)], {"PATH": str(bare), "BCD_JOIN_TOKEN": token}, "",
         "sha256sum is missing (GNU coreutils), so the download cannot be checked; nothing "
         "was installed")
    )  # fmt: skip
    for name, argv, env, stdin, message in cases:
        sandbox = Sandbox.make(tmp_path / f"sandbox-{len(list(tmp_path.glob('sandbox-*')))}")
        done = sandbox.run(argv, env=env, input=stdin)
        assert done.returncode != 0, name
        assert message in done.stderr, (name, done.stderr)
        lines = done.stderr.splitlines()
        assert lines, name
        assert all(ln.startswith("install-bcd.sh: ") for ln in lines), lines
        assert token not in done.stdout + done.stderr, name
        assert "hunter2" not in done.stdout + done.stderr, name
        assert sandbox.files() == {}, (name, sandbox.files())
        assert sandbox.systemctl_calls() == [], name

    # a join the control plane refuses (the token is used up) fails after everything was
    # in place: all of it is taken back, the bcd user included
    used = cp.token(pool, expect={"serial": "SN-NOT-THIS-MACHINE"})["token"]
    sandbox = Sandbox.make(tmp_path / "sandbox-refused", seed=99)
    done = sandbox.run(["sh", str(good)], input=used + "\n")
    assert done.returncode == 1, done.stderr
    assert "bcd: the control plane refused the join" in done.stderr
    assert "install-bcd.sh: bcd join failed (above)" in done.stderr
    assert "nothing of this run was left installed" in done.stderr
    assert _host_view(sandbox) == {}, _host_view(sandbox)
    passwd = sandbox.upper("/etc/passwd")
    assert not passwd.exists() or not passwd.read_text().count("\nbcd:")
    assert sandbox.systemctl_calls() == []
    assert sandbox.contains(used.encode()) == []


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_rotated_join_key_fails_the_join_with_the_way_back_and_a_new_script_fixes_it(
    cp: ControlPlane,
    tmp_path: Path,
    pki_template: Path,
    artifacts: tuple[Path, Built, Built],
) -> None:
    downloads, first, _ = artifacts
    site, pool = cp.site_and_pool()
    sandbox = Sandbox.make(tmp_path / "sandbox")
    installed = sandbox.run(
        ["sh", str(_script(cp, tmp_path, site, pool, first))], input=_token(cp, pool)
    )
    assert installed.returncode == 0, installed.stderr
    old_node = JOINED.match(installed.stdout.strip())
    assert old_node
    old_pins = cp.pins()

    # the operator rotates the join encryption key and restarts the control plane
    cp.stop()
    rotated_home = tmp_path / "rotated"
    shutil.copytree(pki_template / "pki", rotated_home / "pki")
    rotate = subprocess.run(
        [str(BIN / "better-compute"), "pki", "rotate-join-key"],
        env=cli_env(rotated_home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert rotate.returncode == 0, rotate.stderr
    assert "generate every install script again" in rotate.stdout
    cp2 = start_control_plane(tmp_path / "cp2", rotated_home, cp.db_url, downloads)
    try:
        new_pins = cp2.pins()
        assert new_pins["join_encryption_key_pin"] != old_pins["join_encryption_key_pin"]
        assert {k: v for k, v in new_pins.items() if k != "join_encryption_key_pin"} == {
            k: v for k, v in old_pins.items() if k != "join_encryption_key_pin"
        }
        # config management copies the new pins into config.toml; join-encryption.jwk is
        # the old install's. The node was revoked and joins again:
        config = sandbox.upper("/etc/bcd/config.toml")
        config.write_text(
            config.read_text().replace(
                old_pins["join_encryption_key_pin"], new_pins["join_encryption_key_pin"]
            )
        )
        token = cp2.token(pool, allowReclaim=True)["token"]
        rejoin = sandbox.run(["/usr/local/bin/bcd", "join", "--reset", "--yes"], input=token + "\n")
        assert rejoin.returncode == 1
        assert (
            "/etc/bcd/join-encryption.jwk does not match join_encryption_key_pin (was the join "
            "key rotated?); generate the install script again and rerun it, which rewrites the "
            "file and the pins"
        ) in rejoin.stderr
        # the way back: a script generated now, run again (the machine is still joined as
        # before, so the script's own join answers "already joined"); then the join works
        script = _script(cp2, tmp_path, site, pool, first)
        rerun = sandbox.run(["sh", str(script)], env={"BCD_JOIN_TOKEN": token})
        assert rerun.returncode == 0, rerun.stderr
        assert f"already joined as {old_node.group(1)}" in rerun.stdout
        jwk = json.loads(sandbox.upper("/etc/bcd/join-encryption.jwk").read_text())
        assert jwk == cp2.well_known()["join"]["encryptionJwk"]
        again = sandbox.run(["/usr/local/bin/bcd", "join", "--reset", "--yes"], input=token + "\n")
        assert again.returncode == 0, again.stderr
        # the same machine (its hardware key) with a token that allows it: the same node
        assert f"joined as {old_node.group(1)}" in again.stdout, again.stdout
        ident = json.loads(sandbox.upper("/var/lib/bcd/identity.json").read_text())
        assert ident["identity_generation"] == 2
        assert sandbox.contains(token.encode()) == []
    finally:
        cp2.stop()


def test_the_installed_bcd_bootstraps_from_the_well_known_document(
    cp: ControlPlane, tmp_path: Path, artifacts: tuple[Path, Built, Built]
) -> None:
    """Without config.toml, ``bcd join --server`` (the artifact, the host's python3) builds
    it from the well-known document's gateway section, given the three pins."""
    _, first, _ = artifacts
    site, pool = cp.site_and_pool()
    sandbox = Sandbox.make(tmp_path / "sandbox", seed=7)
    unpacked = sandbox.run(
        [str(HOST_PYTHON), "-I", "-S", str(first.path), "unpack", "/usr/local/lib/bcd-boot"]
    )
    assert unpacked.returncode == 0, unpacked.stderr
    bcd = "/usr/local/lib/bcd-boot/bin/bcd"
    pins = cp.pins()
    flags = ["--serving-ca-pin", pins["serving_ca_spki_pin"]]
    flags += ["--join-signing-pin", pins["join_signing_key_pin"]]
    token = cp.token(pool)["token"]

    missing_pin = sandbox.run([bcd, "join", "--server", cp.api, *flags], input=token + "\n")
    assert missing_pin.returncode == 2
    assert missing_pin.stderr == (
        "bcd: without /etc/bcd/config.toml a join with --server needs the pins from the "
        "install: --join-encryption-pin\n"
    )
    other = pins["serving_ca_spki_pin"][:-6] + "AAAAA="
    wrong = sandbox.run(
        [bcd, "join", "--server", cp.api, *flags[2:], "--serving-ca-pin", other,
         "--join-encryption-pin", pins["join_encryption_key_pin"]],
        input=token + "\n",
    )  # fmt: skip
    assert wrong.returncode == 1
    assert "has another serving_ca_spki_pin than the one given; refusing it" in wrong.stderr
    assert not sandbox.upper("/etc/bcd/config.toml").exists()

    done = sandbox.run(
        [bcd, "join", "--server", cp.api, *flags,
         "--join-encryption-pin", pins["join_encryption_key_pin"]],
        input=token + "\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert JOINED.match(done.stdout.strip())
    cfg = parse_config(
        sandbox.upper("/etc/bcd/config.toml").read_text(), Path("/etc/bcd/config.toml")
    )
    assert cfg.gateway_url == f"https://127.0.0.1:{cp.gateway_port}"
    assert cfg.site == site
    assert {k: getattr(cfg, k) for k in pins} == pins
    jwk = json.loads(sandbox.upper("/etc/bcd/join-encryption.jwk").read_text())
    assert jwk == cp.well_known()["join"]["encryptionJwk"]
    assert sandbox.contains(token.encode()) == []
