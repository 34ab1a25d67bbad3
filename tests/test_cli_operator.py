"""The operator's command lines as real processes: --version, bcd join's argument
errors, tenants|sites|pools list and show, --json, attestor names, join-token states
and the --tenant default (issue 13)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from control.errors import ControlError
from tests.world import BIN, ControlPlane, cli_env, run

pytestmark = pytest.mark.e2e

SECRET = base64.urlsafe_b64encode(bytes(range(7, 39))).rstrip(b"=").decode()
TOKEN = f"bcjt_jt_01k5w8x9y2z3a4b5c6d7e8f9g0.{SECRET}"


def _bcd(tmp_path: Path, *argv: str) -> Any:
    return run([str(BIN / "bcd"), *argv], env=cli_env(tmp_path, secret=False))


def _json(done: Any) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- --version -------------------------------------------------------------------------


def test_version_on_both_command_lines(tmp_path: Path) -> None:
    verb = _bcd(tmp_path, "version")
    flag = _bcd(tmp_path, "--version")
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == verb.stdout
    assert flag.stdout.startswith("bcd ")
    control = run([str(BIN / "better-compute"), "--version"], env=cli_env(tmp_path))
    assert control.returncode == 0, control.stderr
    assert control.stdout == verb.stdout.replace("bcd ", "better-compute ", 1)


# --- bcd join's argument errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tokenfile", "x"], "unknown option --tokenfile; see bcd join --help"),
        (["--tokenfile", TOKEN], "unknown option --tokenfile"),
        ([f"--tokenfile={TOKEN}"], "unknown option --tokenfile"),
        (["--foo"], "unknown option --foo"),
        (["x", "--foo"], "unknown option --foo"),
        (["--role", "siet"], "argument --role: invalid choice: 'siet'"),
        (["--token-file=bcjt_secret"], "--token-file: the value is invalid"),
        ([f"--token-file={TOKEN}"], "--token-file: the value is invalid"),
        ([TOKEN], "takes no positional argument"),
        (["--role", TOKEN], "argument --role: the value is invalid"),
    ],
)
def test_bcd_join_names_the_flag_and_never_echoes_a_token(
    tmp_path: Path, argv: list[str], named: str
) -> None:
    done = _bcd(tmp_path, "join", *argv)
    assert done.returncode == 2
    assert done.stderr.startswith("bcd: usage: ")
    assert named in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert done.stdout == ""
    for secret in (TOKEN, SECRET, "bcjt_"):
        assert secret not in done.stderr
    if argv[0].startswith("--") and argv[0] != "--token-file=bcjt_secret":
        assert "takes no positional argument" not in done.stderr


# --- tenants, sites, pools: list and show --------------------------------------------------


def test_tenants_sites_and_pools_list_and_show(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    root = cp.root_tenant
    acme, acme_cred = cp.tenant("acme")
    site, pool = cp.site_and_pool()
    acme_site, acme_pool = cp.site_and_pool(acme, acme_cred)

    every = _json(cp.cli("tenants", "list", "--json"))
    assert {t["id"] for t in every["items"]} == {root, acme}
    assert [t["root"] for t in every["items"] if t["id"] == root] == [True]
    text = cp.cli("tenants", "list")
    assert f"{acme}  acme  created " in text.stdout
    assert "(root)" in text.stdout
    own = _json(cp.cli("tenants", "list", "--json", credential_file=acme_cred))
    assert [t["id"] for t in own["items"]] == [acme]  # a tenant sees only itself
    assert _json(cp.cli("tenants", "show", acme, "--json"))["name"] == "acme"  # the root: any
    assert _json(cp.cli("tenants", "show", "--json", credential_file=acme_cred))["id"] == acme
    hidden = cp.cli("tenants", "show", root, credential_file=acme_cred)
    assert hidden.returncode == 1
    assert "NOT_FOUND" in hidden.stderr

    sites = _json(cp.cli("sites", "list", "--tenant", root, "--json"))
    assert [s["id"] for s in sites["items"]] == [site]
    shown = _json(cp.cli("sites", "show", site, "--tenant", root, "--json"))
    assert shown["name"] == "rack-b7"
    assert shown["tenantId"] == root
    other = cp.cli("sites", "show", acme_site, "--tenant", root)
    assert other.returncode == 1
    assert "NOT_FOUND" in other.stderr

    pools = _json(cp.cli("pools", "list", "--tenant", acme, "--json", credential_file=acme_cred))
    assert [p["id"] for p in pools["items"]] == [acme_pool]
    line = cp.cli("pools", "show", pool, "--tenant", root)
    assert line.returncode == 0, line.stderr
    assert line.stdout.startswith(f"{pool}  gpu  site {site}  agent bcd  admits any attestor")
    assert cp.cli("pools", "show", acme_pool, "--tenant", root).returncode == 1
    by_site = _json(cp.cli("pools", "list", "--tenant", root, "--site", acme_site, "--json"))
    assert by_site["items"] == []
    bad = cp.cli("pools", "show", "pool_x{tenant}", "--tenant", root)
    assert bad.returncode == 1
    assert "is not a pool id" in bad.stderr


def test_lists_page_with_a_bounded_page_size(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    api = cp.client()
    made = sorted(
        api.call("POST", f"/v1/tenants/{cp.root_tenant}/sites", {"name": f"s{i}"})["id"]
        for i in range(3)
    )
    first = _json(cp.cli("sites", "list", "--tenant", cp.root_tenant, "--page-size", "2", "--json"))
    assert [s["id"] for s in first["items"]] == made[:2]
    text = cp.cli("sites", "list", "--tenant", cp.root_tenant, "--page-size", "2")
    assert f"more: --page-token {first['nextPageToken']}" in text.stdout
    rest = _json(
        cp.cli(
            "sites",
            "list",
            "--tenant",
            cp.root_tenant,
            "--page-token",
            first["nextPageToken"],
            "--json",
        )
    )
    assert [s["id"] for s in rest["items"]] == made[2:]
    assert "nextPageToken" not in rest
    # a page of sites or pools is at most 100 (a pool's policy may be 64 KiB)
    for noun in ("sites", "pools"):
        assert (
            cp.cli(noun, "list", "--tenant", cp.root_tenant, "--page-size", "100").returncode == 0
        )
        for size in ("0", "101", "1000"):
            done = cp.cli(noun, "list", "--tenant", cp.root_tenant, "--page-size", size)
            assert done.returncode == 1
            assert re.search(
                r"INVALID_ARGUMENT: pageSize must be a whole number from 1 to 100\b", done.stderr
            ), done.stderr
    with pytest.raises(ControlError) as info:
        api.call("GET", f"/v1/tenants/{cp.root_tenant}/pools?pageSize=101")
    assert info.value.code == "INVALID_ARGUMENT"
    assert cp.cli("tenants", "list", "--page-size", "1000").returncode == 0
    with pytest.raises(ControlError) as info:
        api.call("GET", f"/v1/tenants/{cp.root_tenant}/pools?pageToken=site_x")
    assert info.value.code == "INVALID_ARGUMENT"


# --- --json ----------------------------------------------------------------------------


def test_json_is_printed_or_refused(sqlite_control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = sqlite_control_plane
    env = cli_env(cp.home)
    migrated = run([str(BIN / "better-compute"), "migrate", "--json", "--db", cp.db_url], env=env)
    assert _json(migrated) == {"applied": []}
    script = ["daemon", "install-script", "--pool", "p", "--site", "s", "--gateway-url", "https://g",
              "--base-url", "https://b", "--bcd-version", "0.1.0", "--sha256", "amd64=00"]  # fmt: skip
    for argv in (["serve", "--json"], [*script, "--json"]):
        done = run([str(BIN / "better-compute"), *argv], env=env)
        assert done.returncode == 2
        assert "unrecognized arguments: --json" in done.stderr


# --- attestor names ---------------------------------------------------------------------


def test_an_unknown_attestor_name_is_refused_by_the_cli_and_the_api(
    sqlite_control_plane: ControlPlane,
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    base = ["--tenant", cp.root_tenant, "--attestors", "join-tokn,tpm"]
    done = cp.cli("pools", "create", "--site", site, "--name", "p", *base)
    assert done.returncode == 2
    assert "--attestors: unknown attestor 'join-tokn'; the known attestors are " in done.stderr
    assert "join-token" in done.stderr
    policy = cp.cli("pools", "set-policy", "--pool", pool, *base)
    assert policy.returncode == 2
    assert "unknown attestor 'join-tokn'" in policy.stderr
    api = cp.client()
    for path, body in (
        (f"/v1/tenants/{cp.root_tenant}/pools",
         {"siteId": site, "name": "p", "agent": "bcd", "policy": {"joinAttestors": ["join-tokn"]}}),
        (f"/v1/tenants/{cp.root_tenant}/pools/{pool}/policy",
         {"policy": {"joinAttestors": ["tpm", "join-tokn"]}}),
    ):  # fmt: skip
        with pytest.raises(ControlError) as info:
            api.call("POST", path, body)
        assert info.value.code == "INVALID_ARGUMENT"
        assert "policy.joinAttestors: unknown attestor 'join-tokn'" in info.value.message
    good = cp.cli("pools", "create", "--site", site, "--name", "p", "--tenant", cp.root_tenant,
                  "--attestors", "join-token,tpm", "--json")  # fmt: skip
    assert _json(good)["policy"]["joinAttestors"] == ["join-token", "tpm"]


# --- join-tokens list states -------------------------------------------------------------


def test_join_tokens_list_labels_each_state(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    ids = {state: cp.token(pool)["id"] for state in ("active", "expired", "used-up", "revoked")}
    with cp.store.tx() as tx:
        tx.execute("UPDATE join_tokens SET expires_at = ? WHERE id = ?", (1000, ids["expired"]))
        tx.execute("UPDATE join_tokens SET uses_left = 0 WHERE id = ?", (ids["used-up"],))
    revoked = cp.cli("join-tokens", "revoke", ids["revoked"], "--tenant", cp.root_tenant,
                     "--pool", pool)  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr
    base = ["join-tokens", "list", "--all", "--tenant", cp.root_tenant, "--pool", pool]
    listed = _json(cp.cli(*base, "--json"))
    assert {t["id"]: t["state"] for t in listed["items"]} == {v: k for k, v in ids.items()}
    text = cp.cli(*base).stdout
    for state, token_id in ids.items():
        assert f"{token_id}  node  {state}  " in text
    live = _json(cp.cli("join-tokens", "list", "--tenant", cp.root_tenant, "--pool", pool,
                        "--json"))  # fmt: skip
    assert [t["state"] for t in live["items"]] == ["active"]


# --- the --tenant default ------------------------------------------------------------------


def test_tenant_defaults_to_the_credentials_own(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    acme, cred = cp.tenant("acme")
    site = _json(cp.cli("sites", "create", "--name", "r1", "--json", credential_file=cred))
    assert site["tenantId"] == acme
    pool = _json(cp.cli("pools", "create", "--site", site["id"], "--name", "p", "--json",
                        credential_file=cred))  # fmt: skip
    assert pool["tenantId"] == acme
    listed = _json(cp.cli("pools", "list", "--json", credential_file=cred))
    assert [p["id"] for p in listed["items"]] == [pool["id"]]
    token = cp.cli("join-tokens", "create", "--pool", pool["id"], "--json", credential_file=cred)
    assert _json(token)["poolId"] == pool["id"]
    mine = _json(cp.cli("sites", "list", "--json"))  # the root's credential: the root's sites
    assert site["id"] not in {s["id"] for s in mine["items"]}
