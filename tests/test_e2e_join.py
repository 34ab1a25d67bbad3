"""End to end: a real `better-compute serve` and real `bcd join` processes over TLS."""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bcd import wire
from tests.fakesys import make_machine
from tests.sysusers import temporary_user
from tests.world import JOINED, REFUSED_LINE, ControlPlane, Node

pytestmark = pytest.mark.e2e


def test_a_machine_joins_with_a_join_token(control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    site, pool = cp.site_and_pool()
    token_file = tmp_path / "join-token"
    made = cp.cli(
        "join-tokens",
        "create",
        "--tenant",
        cp.root_tenant,
        "--pool",
        pool,
        "--ttl",
        "1h",
        "--out",
        str(token_file),
    )
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    node = Node.make(tmp_path / "node", cp, site)

    done = node.join(token_file.read_text().strip())

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, done.stdout
    node_id = m.group(1)
    assert m.group(2) == site
    assert stat.S_IMODE(node.data_dir.stat().st_mode) == 0o700
    for name in ("identity.json", "node.key"):
        assert stat.S_IMODE((node.data_dir / name).stat().st_mode) == 0o600
    ident = json.loads((node.data_dir / "identity.json").read_text())
    assert ident["node_id"] == node_id
    assert ident["spiffe_id"] == f"spiffe://td.example/site/{site}/node/{node_id}"
    assert ident["key"] == "file"
    assert ident["identity_generation"] == 1
    row = cp.one("SELECT state, identity_generation, pool_id FROM nodes WHERE id = ?", (node_id,))
    assert row == {"state": "adopting", "identity_generation": 1, "pool_id": pool}
    joined = cp.events(type_="node.joined")
    assert [e["nodeId"] for e in joined] == [node_id]
    assert joined[0]["nodeKey"] == "unattested"
    assert joined[0]["reclaim"] is False
    listed = cp.cli("events", "list", "--tenant", cp.root_tenant, "--type", "node.joined")
    assert node_id in listed.stdout

    doctor = node.bcd("doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert f"node {node_id}" in doctor.stdout

    again = node.join(None)
    assert again.returncode == 0
    assert again.stdout.strip() == f"already joined as {node_id} (site {site}, role node)"


def _refused_reasons(cp: ControlPlane, tenant: str | None = None) -> list[str]:
    return [e["reason"] for e in cp.events(tenant, "security.join.refused")]


def test_every_refusal_looks_the_same_to_the_machine(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    answers: dict[str, str] = {}

    def attempt(reason: str, token: str, seed: int, node_root: Path | None = None) -> Node:
        node = Node.make(node_root or tmp_path / reason, cp, site, seed=seed)
        done = node.join(token)
        assert done.returncode == 1, (reason, done.stdout, done.stderr)
        answers[reason] = done.stderr
        return node

    good = cp.token(pool)["token"]
    token_id = good.split(".")[0][len("bcjt_") :]
    attempt("token-unknown", "bcjt_jt_" + "0" * 26 + "." + "A" * 43, 1)
    attempt("token-secret", good[:-1] + ("A" if good[-1] != "A" else "B"), 2)
    revoked = cp.token(pool)
    cp.client().call(
        "POST", f"/v1/tenants/{cp.root_tenant}/pools/{pool}/join-tokens/{revoked['id']}/revoke"
    )
    attempt("token-revoked", revoked["token"], 3)
    expired = cp.token(pool)
    with cp.store.tx() as tx:
        tx.execute("UPDATE join_tokens SET expires_at = 0 WHERE id = ?", (expired["id"],))
    attempt("token-expired", expired["token"], 4)
    used = cp.token(pool)
    first = Node.make(tmp_path / "first", cp, site, seed=5)
    assert first.join(used["token"]).returncode == 0
    attempt("token-used-up", used["token"], 6)
    attempt("expect-mismatch", cp.token(pool, expect={"serial": "SN-NOT-THIS"})["token"], 7)
    placeholder = tmp_path / "placeholder"
    node = Node.make(placeholder, cp, site, seed=8)
    make_machine(
        node.sysfs,
        product_uuid="",
        product_serial="To Be Filled By O.E.M.",
        macs=["00:1b:21:aa:bb:cc"],
    )
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 1
    answers["placeholder-hardware"] = done.stderr
    reclaim = Node.make(tmp_path / "reclaim", cp, site, seed=5)
    done = reclaim.join(cp.token(pool)["token"])
    assert done.returncode == 1
    answers["reclaim"] = done.stderr
    _s, strict_pool = cp.site_and_pool(policy={"joinAttestors": ["tpm"]})
    attempt("pool-attestor", cp.token(strict_pool)["token"], 9)

    assert set(answers.values()) == {REFUSED_LINE}
    before_secret = _refused_reasons(cp)
    assert "join-token:token-unknown" in before_secret
    assert "join-token:token-secret" in before_secret
    for reason in (
        "token-revoked",
        "token-expired",
        "token-used-up",
        "expect-mismatch",
        "placeholder-hardware",
        "reclaim",
        "pool-attestor",
    ):
        assert f"join-token:{reason}" in before_secret  # the root tenant owns these pools
    row = cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (token_id,))
    assert row == {"uses_left": 1}
    assert not (tmp_path / "token-used-up" / "data" / "identity.json").exists()


def test_refusal_events_go_to_the_token_tenant_once_the_secret_verified(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    tenant, cred = cp.tenant("acme")
    site, pool = cp.site_and_pool(tenant, cred)
    token = cp.token(pool, tenant, cred, expect={"serial": "SN-OTHER"})["token"]
    node = Node.make(tmp_path / "n", cp, site)
    assert node.join(token).returncode == 1
    assert node.join(token[:-2] + "xx").returncode == 1
    assert [e["reason"] for e in cp.events(tenant, "security.join.refused")] == [
        "join-token:expect-mismatch"
    ]
    assert "join-token:token-secret" in _refused_reasons(cp)
    ev = cp.events(tenant, "security.join.refused")[0]
    assert set(ev) >= {"attestor", "reason", "role", "csrSha256", "hardwareKey", "suppressed"}
    assert token.split(".")[1] not in json.dumps(ev)


def test_fifty_concurrent_joins_on_a_five_use_token_admit_five(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    site, pool = cp.site_and_pool()
    token = cp.token(pool, maxUses=5)
    nodes = [Node.make(tmp_path / f"n{i}", cp, site, seed=100 + i) for i in range(50)]
    # Fifty interpreters start at once on a small machine: each may wait its turn for
    # the CPU, so the bound is generous; the race, not the speed, is under test.
    with ThreadPoolExecutor(max_workers=50) as pool_exec:
        results = list(pool_exec.map(lambda n: n.join(token["token"], timeout=240), nodes))
    codes = [r.returncode for r in results]
    assert codes.count(0) == 5, [r.stderr for r in results if r.returncode not in (0, 1)]
    assert codes.count(1) == 45
    assert all(r.stderr == REFUSED_LINE for r in results if r.returncode == 1)
    row = cp.one("SELECT COUNT(*) AS n FROM nodes WHERE pool_id = ?", (pool,))
    assert row is not None
    assert int(row["n"]) == 5
    assert cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (token["id"],)) == {
        "uses_left": 0
    }


# --- under [helper]: root's record and the hand-over -----------------------------------


def _helper_node(root: Path, cp: ControlPlane, site: str, user: str, hostconfig: Path) -> Node:
    node = Node.make(root, cp, site)
    with node.config.open("a") as f:
        f.write(
            f'[helper]\nuser = "{user}"\nhostconfig_dir = "{hostconfig}"\n[tpm]\nmode = "off"\n'
        )
    return node


def test_under_helper_root_records_the_response_and_hands_the_identity_over(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    """A real temporary user (useradd; skipped without it) becomes the files' owner."""
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    hostconfig = tmp_path / "hostconfig" / "bcd"
    with temporary_user() as user:
        node = _helper_node(tmp_path / "node", cp, site, user.pw_name, hostconfig)
        done = node.join(cp.token(pool)["token"])
        assert done.returncode == 0, done.stderr
        for name in ("identity.json", "node.key"):
            st = (node.data_dir / name).stat()
            assert (st.st_uid, st.st_gid) == (user.pw_uid, user.pw_gid), name
            assert stat.S_IMODE(st.st_mode) == 0o600
    record = hostconfig / "join-response.jws"
    assert stat.S_IMODE(hostconfig.stat().st_mode) == 0o700
    st = record.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0)
    body = wire.verify_response(record.read_text(), cp.pins()["join_signing_key_pin"])
    ident = json.loads((node.data_dir / "identity.json").read_text())
    assert (body["kind"], body["node_id"], body["chain"]) == (
        "joined",
        ident["node_id"],
        ident["chain"],
    )


def test_under_helper_a_failed_record_fails_the_join_and_leaves_no_identity(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    node = _helper_node(tmp_path / "node", cp, site, "root", blocker / "hostconfig")
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"bcd: cannot record the join response in {blocker / 'hostconfig' / 'join-response.jws'}: "
    )
    assert "no identity was stored" in done.stderr
    assert not (node.data_dir / "identity.json").exists()
    assert not (node.data_dir / "node.key").exists()
    again = node.join(None)  # still not joined: it asks for a token, not "already joined"
    assert again.returncode == 1
    assert "no join credential in standard input" in again.stderr


def test_under_helper_a_missing_user_fails_before_sending(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = _helper_node(tmp_path / "node", cp, site, "bcdtest-nobody-here", tmp_path / "hc")
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 1
    assert "no user named 'bcdtest-nobody-here'" in done.stderr
    assert cp.events(type_="node.joined") == []
    assert not (tmp_path / "hc").exists()
