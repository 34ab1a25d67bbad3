"""bcd doctor: the config and identity checks, their text and JSON, and exit codes."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio

from bcd import pki
from bcd.cli import main
from bcd.config import Config, load_config
from bcd.doctor import Check, exit_code, in_group, render_json, render_text, run_checks, tpm_check
from bcd.helper.server import HelperSettings
from bcd.identity import Identity, load_state, persist_join
from bcd.keys.file import generate_file_key, key_to_pem
from tests.certs import CertAuthority, make_ca, new_id, node_identity
from tests.swtpm import SwTpm
from tests.sysusers import temporary_user

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
        Check("identity", "warn", "this node has not joined (run bcd join)"),
    ]
    assert exit_code(checks) == 0
    assert render_text(checks) == (
        f"ok    config    {cfg}\nwarn  identity  this node has not joined (run bcd join)\n"
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


# --- the tpm check --------------------------------------------------------------------


def _tpm_config(tmp_path: Path, tpm: str, helper: str = "") -> Config:
    return load_config(write_config(tmp_path, tmp_path / "data", helper + tpm))


def _closed_tcti() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"swtpm:host=127.0.0.1,port={port}"


def test_tpm_off_is_ok_and_opens_nothing(tmp_path: Path) -> None:
    cfg = _tpm_config(tmp_path, f'[tpm]\nmode = "off"\ntcti = "{_closed_tcti()}"\n')
    assert tpm_check(cfg) == Check("tpm", "ok", "TPM not used (mode off)")


def test_tpm_present_with_its_ek_certificate(tmp_path: Path, swtpm: SwTpm) -> None:
    check = tpm_check(_tpm_config(tmp_path, f'[tpm]\ntcti = "{swtpm.tcti}"\n'))
    assert check == Check(
        "tpm", "ok", f"TPM present at {swtpm.tcti}; EK certificate (EK-RSA2048) readable"
    )


def test_no_tpm_is_ok_in_auto_and_fails_when_required(tmp_path: Path) -> None:
    tcti = _closed_tcti()
    auto = tpm_check(_tpm_config(tmp_path, f'[tpm]\nmode = "auto"\ntcti = "{tcti}"\n'))
    assert auto.status == "ok"
    assert auto.message.startswith(f"no TPM; node keys are files (no usable TPM at {tcti}: ")
    required = tpm_check(_tpm_config(tmp_path, f'[tpm]\nmode = "required"\ntcti = "{tcti}"\n'))
    assert required.status == "fail"
    assert required.message.startswith(f"[tpm] mode = required, but no usable TPM at {tcti}")
    assert exit_code([required]) == 1
    device = tpm_check(_tpm_config(tmp_path, '[tpm]\ntcti = "device:/dev/no-tpm"\n'))
    assert device == Check(
        "tpm",
        "ok",
        "no TPM; node keys are files (no usable TPM at device:/dev/no-tpm: "
        "no TPM device /dev/no-tpm)",
    )


def _helper_table(user: str, sock: Path) -> str:
    return f'[helper]\nuser = "{user}"\nsocket = "{sock}"\n'


async def test_tpm_through_the_helper(tmp_path: Path, swtpm: SwTpm) -> None:
    from tests.test_helper import running

    sock = tmp_path / "run" / "helper.sock"
    settings = HelperSettings(
        socket=sock, allowed_uids=frozenset({0}), socket_gid=0, tcti=swtpm.tcti
    )
    cfg = _tpm_config(
        tmp_path,
        f'[tpm]\nmode = "required"\ntcti = "{swtpm.tcti}"\n',
        _helper_table("nobody", sock),
    )
    async with running(settings):
        check = await trio.to_thread.run_sync(tpm_check, cfg)
    assert check.status == "ok", check
    assert check.message.startswith(f"TPM reachable through bcd helper at {sock} (AK sha256:")
    assert check.message.endswith("; EK certificate not checked through the helper")

    # the helper gone: a required TPM fails, an auto one warns
    gone = await trio.to_thread.run_sync(tpm_check, cfg)
    assert gone == Check(
        "tpm",
        "fail",
        f"bcd helper is not running: no socket at {sock} (start bcd-helper.service)",
    )
    auto = replace(cfg, tpm=replace(cfg.tpm, mode="auto"))
    assert (await trio.to_thread.run_sync(tpm_check, auto)).status == "warn"


async def test_a_helper_without_a_tpm(tmp_path: Path) -> None:
    from tests.test_helper import running

    sock = tmp_path / "run" / "helper.sock"
    tcti = _closed_tcti()
    settings = HelperSettings(
        socket=sock, allowed_uids=frozenset({0}), socket_gid=0, tcti=tcti, tpm_mode="auto"
    )
    cfg = _tpm_config(tmp_path, f'[tpm]\ntcti = "{tcti}"\n', _helper_table("nobody", sock))
    async with running(settings, tpm=False):
        auto = await trio.to_thread.run_sync(tpm_check, cfg)
        required = replace(cfg, tpm=replace(cfg.tpm, mode="required"))
        failed = await trio.to_thread.run_sync(tpm_check, required)
    assert auto.status == "ok"
    assert auto.message.startswith("no TPM; node keys are files (bcd helper has no usable TPM: ")
    assert failed.status == "fail"
    assert failed.message.startswith("[tpm] mode = required, but bcd helper has no usable TPM")


def test_the_helper_user_in_the_tss_group_fails(tmp_path: Path) -> None:
    """A real temporary user in the real tss group (skipped without useradd)."""
    with temporary_user(groups=("tss",)) as user:
        cfg = _tpm_config(
            tmp_path, '[tpm]\nmode = "auto"\n', _helper_table(user.pw_name, tmp_path / "h.sock")
        )
        assert in_group(user.pw_name, "tss")
        check = tpm_check(cfg)
    name = user.pw_name
    assert check == Check(
        "tpm",
        "fail",
        f"the [helper] user {name} is a member of the tss group, so bcd node could open the "
        f"TPM itself; remove {name} from the tss group: gpasswd -d {name} tss",
    )
    assert not in_group(name, "tss")


def test_doctor_json_has_the_tpm_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    assert main(["doctor", "--config", str(config), "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["tpm"] == {"name": "tpm", "status": "ok", "message": "TPM not used (mode off)"}
    assert main(["doctor", "--config", str(tmp_path / "missing.toml"), "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["tpm"]["message"] == "cannot check the TPM without a configuration"
