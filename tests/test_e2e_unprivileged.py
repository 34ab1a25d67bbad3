"""End to end, the split the TPM design is for: `bcd helper` as root, `bcd node` as an
unprivileged user made for the test, renewing its TPM-held key through the helper.

`bcd node` runs from a venv an unprivileged user can reach (tests/unprivileged.py),
without tpm2-pytss; everything it reads lives in a 0755 directory under /var/tmp (the
test's tmp_path is under root's 0700 pytest directory).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bcd.tpm.record import NodeKeyRecord
from tests.sysusers import temporary_user
from tests.unprivileged import UnprivilegedVenv, reachable_by_others
from tests.world import (
    JOINED,
    ControlPlane,
    E2EWorld,
    SwTpm,
    cli_env,
    helper_table,
    leaf,
    start_helper,
    stop_process,
    tpm_node,
)

pytestmark = pytest.mark.e2e

# Connects to the helper's socket and prints what happened: the connect's error, or
# the answer the helper sends before hanging up.
PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect:", type(exc).__name__)
    raise SystemExit(0)
data = b""
while chunk := s.recv(4096):
    data += chunk
print("answer:", data.decode().strip())
"""


def _groups(user: pwd.struct_passwd) -> list[int]:
    """``user``'s supplementary groups: a child run as it gets these, none of root's."""
    return [g for g in os.getgrouplist(user.pw_name, user.pw_gid) if g != user.pw_gid]


def _ids(pid: int) -> dict[str, list[int]]:
    """The Uid, Gid and Groups lines of /proc/<pid>/status."""
    ids: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            ids[key] = [int(v) for v in value.split()]
    return ids


def _probe(venv: UnprivilegedVenv, user: pwd.struct_passwd, home: Path, sock: Path) -> str:
    done = subprocess.run(
        [str(venv.bin / "python"), "-c", PROBE, str(sock)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=_groups(user),
        cwd=home,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_bcd_node_as_an_unprivileged_user_renews_its_tpm_key_through_the_helper(
    tmp_path: Path, e2e: E2EWorld, own_swtpm: SwTpm, unprivileged_venv: UnprivilegedVenv
) -> None:
    swtpm = own_swtpm
    venv = unprivileged_venv
    cp, site, _pool = e2e.tpm_plane(swtpm.ca_bundle, ["--cert-ttl-seconds", "10"])
    base = Path(tempfile.mkdtemp(prefix="bcd-unprivileged-node-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        with temporary_user() as user:
            group = grp.getgrgid(user.pw_gid).gr_name
            # in the helper user's group: the socket's mode lets it connect, the
            # helper's peer check must refuse it
            with temporary_user(groups=(group,)) as member:
                _run(cp, site, swtpm, venv, base, user, member)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(
    cp: ControlPlane,
    site: str,
    swtpm: SwTpm,
    venv: UnprivilegedVenv,
    base: Path,
    user: pwd.struct_passwd,
    member: pwd.struct_passwd,
) -> None:
    helper: subprocess.Popen[str] | None = None
    agent: subprocess.Popen[str] | None = None
    try:
        node = tpm_node(base / "node", cp, site, swtpm)
        sock = base / "run" / "helper.sock"
        with node.config.open("a") as f:
            f.write(helper_table(user.pw_name, sock, base / "hostconfig"))
        assert reachable_by_others(node.config)

        # the join, as root, opens the TPM itself and hands the identity to the user
        done = node.join(None, "--attestor", "tpm")
        assert done.returncode == 0, done.stderr
        assert JOINED.match(done.stdout.strip()), done.stdout
        for name in ("identity.json", "node.key"):
            st = os.lstat(node.data_dir / name)
            assert (st.st_uid, st.st_gid) == (user.pw_uid, user.pw_gid), name
        assert os.stat(node.data_dir).st_uid == 0  # the join leaves the directory root's
        # ...which the service manager hands over (StateDirectory= with User=)
        os.chown(node.data_dir, user.pw_uid, user.pw_gid)
        first = leaf(node)
        (statement,) = first.statements
        assert statement.startswith("urn:bc:tpm-ak:sha256:")
        first_record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())

        helper = start_helper(node)
        st = os.stat(sock)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, user.pw_gid, 0o660)

        env = {**cli_env(node.root, secret=False), "HOME": str(base)}
        agent = subprocess.Popen(
            [str(venv.bin / "bcd"), "node", "--config", str(node.config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=_groups(user),
            cwd=base,
        )
        ids = _ids(agent.pid)
        assert ids["Uid"] == [user.pw_uid] * 4, ids
        assert ids["Gid"] == [user.pw_gid] * 4, ids
        assert ids["Groups"] == [], ids

        deadline = time.monotonic() + 30
        # identity.json is written before node.key.next is renamed over node.key
        while leaf(node).serial_hex == first.serial_hex or (
            (node.data_dir / "node.key.next").exists()
        ):
            if agent.poll() is not None:
                raise AssertionError(f"bcd node exited: {agent.communicate()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no renewal: {stop_process(agent)}")
            time.sleep(0.1)
        renewed = leaf(node)
        assert renewed.statements == (statement,)  # the new leaf still names the AK
        record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())
        assert record.unique != first_record.unique
        for name in ("identity.json", "node.key"):  # rewritten by the node: still its own
            assert os.lstat(node.data_dir / name).st_uid == user.pw_uid, name
        assert cp.events(type_="security.renew.refused") == []

        # other users: nobody (not in the socket's group) cannot even connect; a user in
        # the group connects and the helper refuses it by its peer credentials
        nobody = pwd.getpwnam("nobody")
        assert _probe(venv, nobody, base, sock) == "connect: PermissionError"
        answer = _probe(venv, member, base, sock)
        assert answer.startswith("answer: "), answer
        error = json.loads(answer.removeprefix("answer: "))["error"]
        assert error == {
            "code": "forbidden",
            "message": f"uid {member.pw_uid} may not use bcd helper",
        }

        assert agent.poll() is None
        err = stop_process(agent)
        agent = None
        assert "renewed: certificate" in err, err
        assert "session open" in err, err
        assert "Traceback" not in err, err
        helper_err = stop_process(helper)
        helper = None
        assert f"(uid {member.pw_uid}, gid {member.pw_gid}): not the [helper] user" in helper_err
    finally:
        # before the users go: userdel refuses a user that still runs a process
        if agent is not None:
            stop_process(agent)
        if helper is not None:
            stop_process(helper)
