"""The systemd units: they pass `systemd-analyze verify` (with ExecStart pointed at this
bcd and better-compute), carry the sandboxing a reviewer expects, and bcd speaks to
systemd (readiness through NOTIFY_SOCKET, log priorities under journald)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parents[1] / "systemd"


@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_unit_verifies(unit: str, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing (Debian package systemd)")
    bin_dir = Path(sys.executable).parent
    text = (
        (UNITS / unit)
        .read_text()
        .replace("/usr/local/bin/better-compute", str(bin_dir / "better-compute"))
        .replace("/usr/local/bin/bcd", str(bin_dir / "bcd"))
    )
    (tmp_path / unit).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    problems = [ln for ln in done.stderr.splitlines() if unit in ln or "error" in ln.lower()]
    assert done.returncode == 0, done.stderr
    assert problems == [], problems


# --- what a security reviewer checks in the units ------------------------------------


def _directives(unit: str) -> dict[str, list[str]]:
    """Each directive's values, in order (a key may repeat, e.g. SystemCallFilter)."""
    found: dict[str, list[str]] = {}
    for line in (UNITS / unit).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("unit", ["bcd.service", "bcd-helper.service", "bcd-join.service"])
def test_every_unit_is_sandboxed(unit: str) -> None:
    d = _directives(unit)
    for key, value in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"),
        ("SystemCallArchitectures", "native"),
        ("UMask", "0077"),
    ):
        assert d.get(key) == [value], (unit, key)
    assert "CapabilityBoundingSet" in d
    assert "@system-service" in d["SystemCallFilter"]
    assert d["ExecStart"][0].startswith("/usr/local/bin/bcd ")


def test_only_the_helper_reaches_the_tpm_and_only_the_node_is_unprivileged() -> None:
    node, helper, join = (
        _directives(u) for u in ("bcd.service", "bcd-helper.service", "bcd-join.service")
    )
    assert helper["DeviceAllow"] == ["/dev/tpmrm0 rw"]
    assert helper["DevicePolicy"] == ["closed"]
    assert "DeviceAllow" not in node
    assert "DeviceAllow" not in join
    assert node["PrivateDevices"] == join["PrivateDevices"] == ["yes"]
    assert (node["User"], node["Group"]) == (["bcd"], ["bcd"])
    assert node["CapabilityBoundingSet"] == [""]
    assert "User" not in helper  # root: the TPM
    assert "User" not in join  # root: the identity, the hand-over
    assert (node["StateDirectory"], node["StateDirectoryMode"]) == (["bcd"], ["0700"])
    assert node["Type"] == helper["Type"] == ["notify"]
    assert helper["RuntimeDirectory"] == ["bcd-helper"]
    assert helper["RuntimeDirectoryMode"] == ["0755"]
    assert join["Type"] == ["oneshot"]
    assert "--token-file /etc/bcd/join-token" in join["ExecStart"][0]
    # only on a boot that has a token file: a joined TPM node could not load its
    # identity here (no TPM device in this unit)
    assert join["ConditionPathExists"] == ["/etc/bcd/config.toml", "/etc/bcd/join-token"]
    assert set(join["ReadWritePaths"][0].split()) == {
        "-/var/lib/bcd",
        "-/var/lib/bcd-hostconfig",
        "-/etc/bcd",
    }
    assert node["RestartPreventExitStatus"] == ["1"]


CONTROL_UNITS = ("better-compute-api.service", "better-compute-gateway.service")


@pytest.mark.parametrize("unit", CONTROL_UNITS)
def test_every_control_plane_unit_is_sandboxed(unit: str) -> None:
    d = _directives(unit)
    for key, value in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
        ("SystemCallArchitectures", "native"),
        ("UMask", "0077"),
        ("User", "better-compute"),
        ("Group", "better-compute"),
    ):
        assert d.get(key) == [value], (unit, key)
    assert d["SystemCallFilter"] == ["@system-service", "~@privileged"]
    assert "DeviceAllow" not in d
    role = unit.removeprefix("better-compute-").removesuffix(".service")
    assert d["ExecStart"][0].startswith(f"/usr/local/bin/better-compute serve --role {role} ")


def _seconds(value: str) -> float:
    """A systemd time span of the forms these units use: 45s, 5min, 90."""
    for suffix, factor in (("min", 60), ("s", 1)):
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * factor
    return float(value)


def test_control_plane_units_notify_drain_and_keep_the_secret_off_the_gateway() -> None:
    api, gateway = (_directives(u) for u in CONTROL_UNITS)
    for d in (api, gateway):
        # serve sends READY=1 once listening and STOPPING=1 at SIGTERM (control/server.py)
        assert d["Type"] == ["notify"]
        assert d["NotifyAccess"] == ["main"]
        # SIGTERM drains for --drain-seconds (30 by default): systemd must wait longer
        args = d["ExecStart"][0].split()
        drain = float(args[args.index("--drain-seconds") + 1]) if "--drain-seconds" in args else 30
        assert _seconds(d["TimeoutStopSec"][0]) > drain
    # the API replica holds the PKI: its secret is a systemd credential from a root-only
    # file (serve reads $CREDENTIALS_DIRECTORY/better-compute-secret), never the environment
    assert api["LoadCredential"] == ["better-compute-secret:/etc/better-compute/secret"]
    assert all("BETTER_COMPUTE_SECRET" not in v for v in api.get("Environment", []))
    assert api["EnvironmentFile"] == ["/etc/better-compute/api.env"]  # the database URL
    assert (api["StateDirectory"], api["StateDirectoryMode"]) == (["better-compute"], ["0700"])
    assert api["CapabilityBoundingSet"] == [""]
    # the gateway holds no PKI key: nothing in its unit may carry the secret
    text = (UNITS / "better-compute-gateway.service").read_text()
    for key in ("EnvironmentFile", "LoadCredential", "LoadCredentialEncrypted", "SetCredential",
                "SetCredentialEncrypted", "PassEnvironment"):  # fmt: skip
        assert key not in gateway, key
    assert all("BETTER_COMPUTE_SECRET" not in v for v in gateway.get("Environment", []))
    assert "BETTER_COMPUTE_SECRET=" not in text
    assert "--gateway-dir /etc/better-compute/gateway" in gateway["ExecStart"][0]
    assert (
        gateway["CapabilityBoundingSet"]
        == gateway["AmbientCapabilities"]
        == ["CAP_NET_BIND_SERVICE"]
    )
    assert "StateDirectory" not in gateway  # it writes nothing
    assert "ReadWritePaths" not in gateway


def test_tmpfiles_makes_the_directories_with_their_owners() -> None:
    entries = [
        line.split()
        for line in (UNITS / "bcd.tmpfiles.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert entries == [
        ["d", "/etc/bcd", "0755", "root", "root", "-"],
        ["d", "/var/lib/bcd", "0700", "bcd", "bcd", "-"],
        ["d", "/var/lib/bcd-hostconfig", "0700", "root", "root", "-"],
        ["d", "/run/bcd-helper", "0755", "root", "root", "-"],
    ]
    if shutil.which("systemd-tmpfiles") is not None:
        done = subprocess.run(
            ["systemd-tmpfiles", "--cat-config"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0


# --- readiness and journald ----------------------------------------------------------


class NotifySocket:
    """A NOTIFY_SOCKET, as systemd gives a Type=notify unit: datagrams, one per sd_notify."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(30)

    def next(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def close(self) -> None:
        self.sock.close()


def test_notify_sends_one_datagram_and_is_silent_without_a_socket(tmp_path: Path) -> None:
    from bcd.systemd import notify

    ns = NotifySocket(tmp_path / "notify")
    try:
        assert notify("READY=1", "STATUS=a\nb", environ={"NOTIFY_SOCKET": str(ns.path)})
        assert ns.next() == ["READY=1", "STATUS=a b"]
    finally:
        ns.close()
    assert not notify("READY=1", environ={})
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": "@bcd-test-nobody-listens"})


def test_log_lines_carry_the_priority_only_under_journald(tmp_path: Path) -> None:
    from bcd.systemd import JournaldFormatter, under_journald

    path = tmp_path / "stderr"
    with path.open("w") as stream:
        st = os.fstat(stream.fileno())
        assert under_journald(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not under_journald(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not under_journald(stream, {})
    fmt = JournaldFormatter("bcd: %(name)s: %(message)s")
    for level, prefix in ((logging.INFO, "<6>"), (logging.WARNING, "<4>"), (logging.ERROR, "<3>")):
        record = logging.LogRecord("bcd.node", level, __file__, 1, "two\nlines", None, None)
        assert fmt.format(record) == f"{prefix}bcd: bcd.node: two\n{prefix}lines"


def _wait_exit(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_bcd_helper_is_ready_once_its_socket_listens(tmp_path: Path, memory_pki) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("bcd helper runs as root")
    config = tmp_path / "config.toml"
    config.write_text(
        'gateway_url = "https://127.0.0.1:1"\n'
        f'site = "site_{"0" * 26}"\n'
        + "".join(f'{k} = "{v}"\n' for k, v in memory_pki.pins().items())
        + f'data_dir = "{tmp_path / "data"}"\n'
        + f'[helper]\nuser = "root"\nsocket = "{tmp_path / "run" / "helper.sock"}"\n'
        + f'hostconfig_dir = "{tmp_path / "hostconfig"}"\n[tpm]\nmode = "off"\n'
    )
    ns = NotifySocket(tmp_path / "notify")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BCD_", "NOTIFY_"))}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "bcd"), "helper", "--config", str(config)],
        env={**env, "NOTIFY_SOCKET": str(ns.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = ns.next()
        assert ready == ["READY=1", f"STATUS=serving the TPM at {tmp_path / 'run' / 'helper.sock'}"]
        assert (tmp_path / "run" / "helper.sock").is_socket()
        assert _wait_exit(proc) == 0
        assert ns.next() == ["STOPPING=1"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        ns.close()


def test_bcd_node_is_ready_once_its_identity_loaded(
    sqlite_control_plane,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    from tests.world import BIN, Node, cli_env

    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "node", cp, site)
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    node_id = json.loads((node.data_dir / "identity.json").read_text())["node_id"]
    ns = NotifySocket(tmp_path / "notify")
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("w") as stderr:
        st = os.fstat(stderr.fileno())
        env = {
            **cli_env(node.root, secret=False),
            "NOTIFY_SOCKET": str(ns.path),
            "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
        }
        proc = subprocess.Popen(
            [str(BIN / "bcd"), "node", "--config", str(node.config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
        try:
            ready = ns.next()
            assert ready[0] == "READY=1"
            assert ready[1].startswith(f"STATUS=node {node_id}; certificate valid until ")
            assert _wait_exit(proc) == 0
            assert ns.next() == ["STOPPING=1"]
        finally:
            if proc.poll() is None:
                proc.kill()
            ns.close()
    lines = stderr_path.read_text().splitlines()
    assert any(ln.startswith(f"<6>bcd: bcd.node: node {node_id} (site") for ln in lines), lines
    assert all(ln.startswith("<") for ln in lines), lines  # every log line has its priority
