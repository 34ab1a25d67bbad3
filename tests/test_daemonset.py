"""bcd as a DaemonSet (packaging/kubernetes/): every manifest is valid against the
Kubernetes schema (kubernetes-validate, offline, strict), the manifests agree with
each other and with what bcd needs, and the container's start command, taken from
the manifest, joins a real serve and opens a session when run as a process."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.fakesys import random_machine
from tests.world import BIN, ControlPlane, E2EWorld, cli_env, wait_for

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "packaging" / "kubernetes"
MANIFESTS = ("namespace.yaml", "configmap.yaml", "secret.yaml", "daemonset.yaml")
# a recent release the library bundles, and the newest it has
VERSIONS = ("1.33.0", kubernetes_validate.latest_version())


def _doc(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((KUBE / name).read_text()))
    assert isinstance(doc, dict)
    return doc


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _doc("daemonset.yaml")["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    (container,) = _pod_spec()["containers"]
    assert isinstance(container, dict)
    return container


def _env() -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in _container()["env"]}


# --- the manifests ----------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_is_valid_kubernetes(name: str, version: str) -> None:
    assert kubernetes_validate.validate(_doc(name), version, strict=True)


def test_the_validator_is_strict() -> None:
    """A misspelt field fails: strict schemas refuse what they do not know."""
    doc = _doc("daemonset.yaml")
    doc["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_but_the_secret() -> None:
    kustomization = _doc("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(set(MANIFESTS) - {"secret.yaml"})


def test_everything_is_in_one_namespace_the_pods_may_use() -> None:
    namespace = _doc("namespace.yaml")
    name = namespace["metadata"]["name"]
    for manifest in MANIFESTS[1:]:
        assert _doc(manifest)["metadata"]["namespace"] == name
    # hostNetwork and hostPath are allowed only at the privileged level
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_secret_is_mounted_0400_and_read_by_file() -> None:
    pod = _pod_spec()
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    secret = volume["secret"]
    assert secret["secretName"] == _doc("secret.yaml")["metadata"]["name"]
    assert secret["defaultMode"] == 0o400
    (item,) = secret["items"]
    assert item["key"] in _doc("secret.yaml")["stringData"]
    (mount,) = [m for m in _container()["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert _env()["TOKEN_FILE"]["value"] == f"{mount['mountPath']}/{item['path']}"
    script = "\n".join(_container()["command"])
    assert '--token-file "$TOKEN_FILE"' in script
    assert "bcjt_" not in (KUBE / "daemonset.yaml").read_text()  # no token in the manifest


def test_bcds_paths_are_the_hosts() -> None:
    from bcd.config import DEFAULT_CONFIG_PATH, DEFAULT_DATA_DIR

    pod, env = _pod_spec(), _env()
    assert env["CONFIG_FILE"]["value"] == str(DEFAULT_CONFIG_PATH)
    assert env["DATA_DIR"]["value"] == str(DEFAULT_DATA_DIR)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    for path in (DEFAULT_CONFIG_PATH.parent, DEFAULT_DATA_DIR):
        assert host[mounts[str(path)]] == str(path)  # the same path on the host


def test_the_privileges_are_the_ones_documented() -> None:
    pod, container = _pod_spec(), _container()
    assert pod["hostNetwork"] is True
    assert pod["automountServiceAccountToken"] is False
    ctx = container["securityContext"]
    assert ctx["runAsUser"] == 0
    assert ctx["privileged"] is False
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert _env()["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    configmap = _doc("configmap.yaml")["data"]
    for name in ("SERVER_URL", "SERVING_CA_PIN", "JOIN_SIGNING_PIN", "JOIN_ENCRYPTION_PIN"):
        ref = _env()[name]["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == _doc("configmap.yaml")["metadata"]["name"]
        assert ref["key"] in configmap


# --- the start command, run ---------------------------------------------------------


@pytest.fixture
def hosted_plane(e2e: E2EWorld) -> ControlPlane:
    """A serve that publishes its gateway (what bcd join --server reads)."""
    return e2e.control_plane(gateway_url="https://127.0.0.1:{port}")


def _start_command(tmp: Path, cp: ControlPlane, sysfs: Path) -> tuple[list[str], dict[str, str]]:
    """The container's command from the manifest, and its environment: the manifest's
    values, with the host paths redirected under ``tmp`` and the ConfigMap's values
    from ``cp``. ``bcd`` on PATH is the venv's, run with this test's simulated
    machine (``--sysfs-root``, as every test's join is)."""
    container = _container()
    argv = [*container["command"], *container.get("args", [])]
    shim = tmp / "bin" / "bcd"
    shim.parent.mkdir()
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = join ]; then shift; exec {BIN / "bcd"} join --sysfs-root {sysfs} "$@"; fi\n'
        f'exec {BIN / "bcd"} "$@"\n'
    )
    shim.chmod(0o755)
    pins = cp.pins()
    env = {
        **cli_env(tmp, secret=False),
        "PATH": f"{shim.parent}:{os.environ['PATH']}",
        "NODE_NAME": "worker-3",
        "CONFIG_FILE": str(tmp / "etc-bcd" / "config.toml"),
        "DATA_DIR": str(tmp / "var-lib-bcd"),
        "TOKEN_FILE": str(tmp / "secret" / "join-token"),
        "SERVER_URL": cp.api,
        "SERVING_CA_PIN": pins["serving_ca_spki_pin"],
        "JOIN_SIGNING_PIN": pins["join_signing_key_pin"],
        "JOIN_ENCRYPTION_PIN": pins["join_encryption_key_pin"],
    }
    assert set(env) >= set(_env()), "every variable the manifest sets is set here"
    return argv, env


def _run_pod(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends
    try:
        return proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def test_the_start_command_joins_then_runs_bcd_node_and_restarts_as_the_same_node(
    hosted_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = hosted_plane
    site, pool = cp.site_and_pool()
    token = cp.token(pool, hosted="kubernetes")["token"]
    sysfs = random_machine(tmp_path / "sys", 7)
    argv, env = _start_command(tmp_path, cp, sysfs)
    for name in ("etc-bcd", "var-lib-bcd"):  # hostPath DirectoryOrCreate: 0755 root
        (tmp_path / name).mkdir(mode=0o755)
    secret = tmp_path / "secret"  # the Secret's mount: the token file, 0400
    secret.mkdir()
    token_file = secret / "join-token"
    token_file.write_text(token)
    token_file.chmod(0o400)
    log = tmp_path / "pod.log"

    proc = _run_pod(argv, env, log)
    try:
        wait_for(lambda: "session open (" in log.read_text(), 30, "the session")
        assert proc.poll() is None
        bcd_node = _bcd_node_pid(proc.pid)
        cmdline = Path(f"/proc/{bcd_node}/cmdline").read_bytes()
        assert token.encode() not in cmdline  # never on argv
        assert token not in Path(f"/proc/{bcd_node}/environ").read_text(errors="replace")
    finally:
        first_exit = _stop(proc)
    text = log.read_text()
    assert first_exit == 0, text
    assert "bcd: on Kubernetes node worker-3" in text
    assert "joined as node_" in text
    assert token not in text
    config = Path(env["CONFIG_FILE"])
    assert f'site = "{site}"' in config.read_text()
    identity = Path(env["DATA_DIR"]) / "identity.json"
    assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    assert not token_file.exists()  # bcd join deletes the token it used
    node_id = text.split("joined as ", 1)[1].split()[0]
    row = cp.one("SELECT role FROM node_certs WHERE node_id = ?", (node_id,))
    assert row is not None
    assert row["role"] == "node-tenant"  # a hosted token's node

    # the pod restarts (a new container, the host's paths kept, no token any more)
    log.write_text("")
    again = _run_pod(argv, env, log)
    try:
        wait_for(lambda: "session open (" in log.read_text(), 30, "the session after a restart")
    finally:
        assert _stop(again) == 0, log.read_text()
    assert f"already joined as {node_id}" in log.read_text()

    # revoked: the pod stops with exit 1 (and would crash-loop); the way back of
    # docs/kubernetes.md: the identity moved aside, a reclaiming token in the Secret
    revoked = cp.cli("nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant)
    assert revoked.returncode == 0, revoked.stderr
    log.write_text("")
    dead = _run_pod(argv, env, log)
    try:
        assert dead.wait(30) == 1, log.read_text()
    finally:
        _stop(dead)
    assert "agent: this node's certificate was revoked" in log.read_text()
    reset = subprocess.run(
        [str(BIN / "bcd"), "join", "--reset", "--yes", "--config", env["CONFIG_FILE"],
         "--data-dir", env["DATA_DIR"]],
        env=cli_env(tmp_path, secret=False), stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert reset.returncode == 0, reset.stderr
    assert not identity.exists()
    token_file.write_text(cp.token(pool, hosted="kubernetes", allowReclaim=True)["token"])
    token_file.chmod(0o400)
    log.write_text("")
    back = _run_pod(argv, env, log)
    try:
        wait_for(lambda: "session open (" in log.read_text(), 30, "the session after a reclaim")
    finally:
        assert _stop(back) == 0, log.read_text()
    assert f"joined as {node_id}" in log.read_text()  # the same node, reclaimed


def test_the_start_command_stops_without_node_name(tmp_path: Path) -> None:
    container = _container()
    argv = [*container["command"], *container.get("args", [])]
    done = subprocess.run(
        argv,
        env={"PATH": os.environ["PATH"]},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "NODE_NAME" in done.stderr


def _bcd_node_pid(shell_pid: int) -> int:
    """The start command execs bcd node: the shell's pid becomes bcd node's."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cmdline = Path(f"/proc/{shell_pid}/cmdline").read_bytes().split(b"\0")
        if b"node" in cmdline and any(part.endswith(b"bcd") for part in cmdline):
            return shell_pid
        time.sleep(0.05)
    raise AssertionError("the start command did not exec bcd node")
