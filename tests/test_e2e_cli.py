"""The operator CLI and bcd's command line, as real processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.world import BIN, ControlPlane, E2EWorld, Node, cli_env, run

pytestmark = pytest.mark.e2e


def test_quickstart_runs_twice(tmp_path: Path) -> None:
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "control.quickstart"],
            cwd=tmp_path,
            env={**cli_env(tmp_path, secret=False), "PYTHONPATH": str(Path(__file__).parents[1])},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "==> bcd join: the machine becomes a node" in done.stdout
        assert "\njoined as node_" in done.stdout
        assert "ok    identity  node node_" in done.stdout
        assert "bcd node | bcd: bcd.session: session open (sess_" in done.stdout
        assert "bcd node | bcd: bcd.renew: renewed: certificate " in done.stdout
        assert "bcd node | agent: this node's certificate was revoked" in done.stdout
        assert "bcd node exited 1 " in done.stdout
        # the PKI secret: a new random one in a 0600 file, named by --secret-file, never
        # printed (nor in any child's environment: no BETTER_COMPUTE_SECRET is set)
        secret_file = tmp_path / ".quickstart" / "control-plane" / "secret"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32
        assert f"serve --secret-file {secret_file} " in done.stdout
        serve_log = (secret_file.parent / "serve.log").read_text()
        assert secret not in done.stdout + done.stderr + serve_log
    assert (tmp_path / ".quickstart" / "node" / "data" / "identity.json").exists()


def test_out_writes_a_new_0600_file_and_never_overwrites(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    out = tmp_path / "tok"
    args = ["join-tokens", "create", "--tenant", cp.root_tenant, "--pool", pool, "--out", str(out)]
    first = cp.cli(*args)
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    token = out.read_text()
    assert token.startswith("bcjt_jt_")
    assert token.strip() not in first.stdout
    again = cp.cli(*args)
    assert again.returncode == 1
    assert "ALREADY_EXISTS" in again.stderr
    assert out.read_text() == token
    listed = cp.cli("join-tokens", "list", "--tenant", cp.root_tenant, "--pool", pool, "--json")
    assert len(json.loads(listed.stdout)["items"]) == 1  # the refused --out minted nothing


def test_a_replayed_key_with_out_is_invalid_state(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    base = ["join-tokens", "create", "--tenant", cp.root_tenant, "--pool", pool, "--key", "rack-b7"]
    first = cp.cli(*base, "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    replay = cp.cli(*base, "--out", str(tmp_path / "b"))
    assert replay.returncode == 1
    assert "INVALID_STATE" in replay.stderr
    assert "revoke that token" in replay.stderr
    assert not (tmp_path / "b").exists()
    printed = cp.cli(*base)
    assert printed.returncode == 0
    assert "bcjt_" not in printed.stdout
    conflict = cp.cli(*base, "--allow-reclaim")
    assert conflict.returncode == 1
    assert "CONFLICT" in conflict.stderr


def test_list_never_shows_a_secret_and_revoke_refuses_a_token(
    sqlite_control_plane: ControlPlane,
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    made = cp.token(pool)
    secret = made["token"].split(".")[1]
    listed = cp.cli("join-tokens", "list", "--tenant", cp.root_tenant, "--pool", pool, "--json")
    assert secret not in listed.stdout
    assert made["id"] in listed.stdout
    pasted = cp.cli(
        "join-tokens", "revoke", made["token"], "--tenant", cp.root_tenant, "--pool", pool
    )
    assert pasted.returncode == 1
    assert secret not in pasted.stderr + pasted.stdout
    for _ in range(2):
        done = cp.cli(
            "join-tokens", "revoke", made["id"], "--tenant", cp.root_tenant, "--pool", pool
        )
        assert done.returncode == 0, done.stderr
    assert len(cp.events(type_="security.join-token.revoked")) == 1
    live = cp.cli("join-tokens", "list", "--tenant", cp.root_tenant, "--pool", pool, "--json")
    assert json.loads(live.stdout)["items"] == []
    every = cp.cli(
        "join-tokens", "list", "--all", "--tenant", cp.root_tenant, "--pool", pool, "--json"
    )
    assert [t["revoked"] for t in json.loads(every.stdout)["items"]] == [True]


def test_another_tenants_pool_is_not_found(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    tenant, cred = cp.tenant("acme")
    _s, pool = cp.site_and_pool()
    done = cp.cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, credential_file=cred)
    assert done.returncode == 1
    assert "NOT_FOUND" in done.stderr


def test_ttl_outside_one_minute_to_a_day_is_refused(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    _s, pool = cp.site_and_pool()
    for ttl, code in (("59s", 1), ("1m", 0), ("24h", 0), ("25h", 1)):
        done = cp.cli(
            "join-tokens", "create", "--tenant", cp.root_tenant, "--pool", pool, "--ttl", ttl
        )
        assert done.returncode == code, (ttl, done.stderr)


# --- bcd join's command line ------------------------------------------------------------


def test_a_positional_token_is_refused_without_echo(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    token = cp.token(pool)["token"]
    node = Node.make(tmp_path / "n", cp, site)
    done = node.bcd("join", token)
    assert done.returncode == 2
    assert token not in done.stderr + done.stdout
    assert token.split(".")[1] not in done.stderr
    bad_flag = node.bcd("join", "--role", token)
    assert bad_flag.returncode == 2
    assert token.split(".")[1] not in bad_flag.stderr


def test_token_file_rules(sqlite_control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    token = cp.token(pool)["token"]
    loose = tmp_path / "loose"
    loose.write_text(token)
    loose.chmod(0o644)
    done = node.bcd("join", "--sysfs-root", str(node.sysfs), "--token-file", str(loose))
    assert done.returncode == 1
    assert "0600 or 0400" in done.stderr
    assert token not in done.stderr
    big = tmp_path / "big"
    big.write_text("x" * 5000)
    big.chmod(0o600)
    done = node.bcd("join", "--sysfs-root", str(node.sysfs), "--token-file", str(big))
    assert done.returncode == 1
    assert "4 KiB" in done.stderr
    # a Kubernetes Secret: token -> ..data/token, ..data -> ..2026_11_29
    secret_dir = tmp_path / "secret"
    (secret_dir / "..2026_11_29").mkdir(parents=True)
    real = secret_dir / "..2026_11_29" / "token"
    real.write_text(token)
    real.chmod(0o400)
    os.symlink("..2026_11_29", secret_dir / "..data")
    os.symlink("..data/token", secret_dir / "token")
    done = node.bcd(
        "join", "--sysfs-root", str(node.sysfs), "--token-file", str(secret_dir / "token")
    )
    assert done.returncode == 0, done.stderr
    assert not real.exists()
    assert not (secret_dir / "token").is_symlink()


def test_join_with_server_bootstraps_a_machine_without_config(
    sqlite_control_plane: ControlPlane, tmp_path: Path, e2e: E2EWorld
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    cp.stop()
    cp2 = e2e.control_plane(cp.db_url, name="cp2", gateway_url="https://127.0.0.1:{port}")
    pins = cp2.pins()
    machine = Node.make(tmp_path / "m", cp2, site)
    config = tmp_path / "fresh" / "config.toml"
    args = [
        str(BIN / "bcd"),
        "join",
        "--config",
        str(config),
        "--server",
        cp2.api,
        "--data-dir",
        str(tmp_path / "fresh-data"),
        "--sysfs-root",
        str(machine.sysfs),
        "--serving-ca-pin",
        pins["serving_ca_spki_pin"],
        "--join-signing-pin",
        pins["join_signing_key_pin"],
    ]
    token = cp2.token(pool)["token"]
    missing = run(args, input=token.encode(), env=cli_env(tmp_path))
    assert missing.returncode == 2
    assert "--join-encryption-pin" in missing.stderr
    wrong = run(
        [*args, "--join-encryption-pin", pins["serving_ca_spki_pin"]],
        input=token.encode(),
        env=cli_env(tmp_path),
    )
    assert wrong.returncode == 1
    assert "refusing it" in wrong.stderr
    assert not config.exists()
    done = run(
        [*args, "--join-encryption-pin", pins["join_encryption_key_pin"]],
        input=token.encode(),
        env=cli_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("joined as node_")
    text = config.read_text()
    assert f'site = "{site}"' in text
    assert (config.parent / "join-encryption.jwk").exists()
    doctor = run([str(BIN / "bcd"), "doctor", "--config", str(config)], env=cli_env(tmp_path))
    assert doctor.returncode == 0, doctor.stdout


def test_a_rotated_join_key_file_fails_with_the_way_back(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    from bcd import pki, wire

    (node.config.parent / "join-encryption.jwk").write_text(
        json.dumps(wire.public_jwk_of(pki.generate_key().public_key()))
    )
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 1
    assert "does not match join_encryption_key_pin" in done.stderr
    assert "generate the install script again" in done.stderr
    assert not (node.data_dir / "identity.json").exists()


def test_pool_policy_and_node_show(sqlite_control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    done = cp.cli(
        "pools",
        "set-policy",
        "--tenant",
        cp.root_tenant,
        "--pool",
        pool,
        "--attestors",
        "tpm",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"] == {"joinAttestors": ["tpm"]}
    node = Node.make(tmp_path / "n", cp, site)
    assert node.join(cp.token(pool)["token"]).returncode == 1
    assert "join-token:pool-attestor" in [
        e["reason"] for e in cp.events(type_="security.join.refused")
    ]
    cp.cli(
        "pools",
        "set-policy",
        "--tenant",
        cp.root_tenant,
        "--pool",
        pool,
        "--attestors",
        "join-token,tpm",
    )
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.split()[2]
    shown = cp.cli("nodes", "show", node_id, "--tenant", cp.root_tenant, "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["state"] == "adopting"
    assert [c["revoked"] for c in detail["certificates"]] == [False]
