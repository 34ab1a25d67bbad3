"""bcd doctor: the config and identity checks, their text and JSON, and exit codes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bcd import pki
from bcd.doctor import Check, exit_code, render_json, render_text, run_checks
from bcd.identity import Identity, load_state, persist_join
from bcd.keys.file import generate_file_key, key_to_pem
from tests.certs import CertAuthority, make_ca, new_id, node_identity

WAY_BACK = "bcd join --reset --yes, then bcd join"


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca()


def write_config(tmp_path: Path, data_dir: Path, extra: str = "") -> Path:
    pins = [pki.spki_pin(pki.generate_key().public_key()) for _ in range(3)]
    path = tmp_path / "config.toml"
    path.write_text(
        'gateway_url = "https://gw.example.com"\n'
        f'site = "{new_id("site")}"\n'
        f'serving_ca_spki_pin = "{pins[0]}"\n'
        f'join_signing_key_pin = "{pins[1]}"\n'
        f'join_encryption_key_pin = "{pins[2]}"\n'
        f'data_dir = "{data_dir}"\n' + extra
    )
    return path


def _now() -> datetime:
    return datetime.now(UTC)


def join(data_dir: Path, ca: CertAuthority) -> Identity:
    key, identity = node_identity(ca)
    persist_join(data_dir, identity, key_to_pem(key), _now())
    return identity


def test_not_joined_is_a_warning(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tmp_path / "data")
    checks = run_checks(cfg, _now())
    assert checks == [
        Check("config", "ok", str(cfg)),
        Check("identity", "warn", "this node has not joined; run: bcd join"),
    ]
    assert exit_code(checks) == 0
    assert render_text(checks) == (
        f"ok    config    {cfg}\nwarn  identity  this node has not joined; run: bcd join\n"
    )


def test_joined_is_ok(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    identity = join(data_dir, ca)
    checks = run_checks(write_config(tmp_path, data_dir), _now())
    assert checks[1] == Check(
        "identity",
        "ok",
        f"node {identity.node_id} (site {identity.site_id}, role node); "
        f"certificate valid until {identity.not_after}",
    )
    assert exit_code(checks) == 0
    body = json.loads(render_json(checks))
    assert body == {
        "checks": [
            {"name": "config", "status": "ok", "message": str(tmp_path / "config.toml")},
            {"name": "identity", "status": "ok", "message": checks[1].message},
        ],
        "ok": True,
    }


def test_expired_fails_with_the_way_back(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    identity = join(data_dir, ca)
    later = identity.not_after_time() + timedelta(minutes=1)
    checks = run_checks(write_config(tmp_path, data_dir), later)
    assert checks[1] == Check(
        "identity",
        "fail",
        f"the certificate expired at {identity.not_after}; "
        "join again as root: bcd join --reset --yes, then bcd join",
    )
    assert exit_code(checks) == 1
    assert json.loads(render_json(checks))["ok"] is False
    assert render_text(checks).splitlines()[1].startswith("fail  identity  the certificate expired")


def test_mismatched_key_fails(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    join(data_dir, ca)
    (data_dir / "node.key").write_bytes(key_to_pem(generate_file_key()))
    checks = run_checks(write_config(tmp_path, data_dir), _now())
    assert checks[1] == Check(
        "identity",
        "fail",
        "the node key does not match the node certificate; "
        "join again: bcd join --reset --yes, then bcd join",
    )
    assert exit_code(checks) == 1


def test_damaged_identity_fails(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    join(data_dir, ca)
    (data_dir / "identity.json").write_text("{}")
    check = run_checks(write_config(tmp_path, data_dir), _now())[1]
    assert check.status == "fail"
    assert check.message.startswith("identity.json is damaged: ")
    assert check.message.endswith(WAY_BACK)


def test_doctor_settles_an_interrupted_renewal(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    join(data_dir, ca)
    (data_dir / "node.key.next").write_bytes(key_to_pem(generate_file_key()))
    assert run_checks(write_config(tmp_path, data_dir), _now())[1].status == "ok"
    assert not (data_dir / "node.key.next").exists()
    assert load_state(data_dir) is not None


def test_missing_config(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    checks = run_checks(path, _now())
    assert [c.status for c in checks] == ["fail", "fail"]
    assert checks[0].message.startswith(f"no configuration at {path}; ")
    assert checks[1] == Check(
        "identity", "fail", "cannot check the identity without a configuration"
    )
    assert exit_code(checks) == 1


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, tmp_path / "data", extra='gatway_url = "x"\n')
    checks = run_checks(path, _now())
    assert checks[0] == Check("config", "fail", f'{path}: unknown key "gatway_url"')
    assert checks[1].status == "fail"
    text = render_text(checks)
    assert text.splitlines()[0] == f'fail  config    {path}: unknown key "gatway_url"'


def test_exit_codes() -> None:
    assert exit_code([]) == 0
    assert exit_code([Check("a", "ok", "")]) == 0
    assert exit_code([Check("a", "ok", ""), Check("b", "warn", "")]) == 0
    assert exit_code([Check("a", "warn", ""), Check("b", "fail", "")]) == 1


def test_render_json_shape() -> None:
    checks = [Check("config", "ok", "x"), Check("identity", "warn", "y")]
    body = json.loads(render_json(checks))
    assert set(body) == {"checks", "ok"}
    assert body["ok"] is True
    assert body["checks"] == [
        {"name": "config", "status": "ok", "message": "x"},
        {"name": "identity", "status": "warn", "message": "y"},
    ]
    assert render_text([]) == ""


def test_plugins_check() -> None:
    from bcd.doctor import plugins_check
    from bcd.plugins import PluginFailure, load_plugins

    plugins = load_plugins()
    check = plugins_check(plugins)
    assert check.name == "plugins"
    if not plugins.failures:
        assert check.status == "ok"
        assert check.message.startswith("attestors: ")
    plugins.failures.append(PluginFailure("broken", "ImportError: nope"))
    check = plugins_check(plugins)
    assert check == Check(
        "plugins", "warn", "attestor plugins: broken did not load (ImportError: nope)"
    )
    assert exit_code([check]) == 0
