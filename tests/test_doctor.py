"""bcd doctor: the config and identity checks, their text and JSON, and exit codes."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio

from bcd import pki
from bcd.cli import main
from bcd.config import Config, load_config
from bcd.doctor import (
    Check,
    all_checks,
    exit_code,
    in_group,
    render_json,
    render_text,
    run_checks,
    tpm_check,
)
from bcd.helper.server import HelperSettings
from bcd.identity import Identity, load_state, persist_join
from bcd.keys.file import generate_file_key, key_to_pem
from control.pki import Pki, build_pki
from tests.adversarial import hostile
from tests.certs import CertAuthority, make_ca, node_identity
from tests.swtpm import SwTpm
from tests.sysusers import temporary_user
from tests.world import closed_tcti, offline_node_config

WAY_BACK = "bcd join --reset --yes, then bcd join"


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca()


def _now() -> datetime:
    return datetime.now(UTC)


def join(data_dir: Path, ca: CertAuthority) -> Identity:
    key, identity = node_identity(ca)
    persist_join(data_dir, identity, key_to_pem(key), _now())
    return identity


def test_not_joined_is_a_warning(tmp_path: Path) -> None:
    cfg = offline_node_config(tmp_path, tmp_path / "data")
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
    checks = run_checks(offline_node_config(tmp_path, data_dir), _now())
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
            {"name": "revoked", "status": "ok", "message": checks[2].message},
        ],
        "ok": True,
    }


def test_expired_fails_with_the_way_back(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    identity = join(data_dir, ca)
    later = identity.not_after_time() + timedelta(minutes=1)
    checks = run_checks(offline_node_config(tmp_path, data_dir), later)
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
    checks = run_checks(offline_node_config(tmp_path, data_dir), _now())
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
    check = run_checks(offline_node_config(tmp_path, data_dir), _now())[1]
    assert check.status == "fail"
    assert check.message.startswith("identity.json is damaged: ")
    assert check.message.endswith(WAY_BACK)


def test_doctor_settles_an_interrupted_renewal(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "data"
    join(data_dir, ca)
    (data_dir / "node.key.next").write_bytes(key_to_pem(generate_file_key()))
    assert run_checks(offline_node_config(tmp_path, data_dir), _now())[1].status == "ok"
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
    path = offline_node_config(tmp_path, tmp_path / "data", extra='gatway_url = "x"\n')
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
    return load_config(offline_node_config(tmp_path, tmp_path / "data", helper + tpm))


def test_tpm_off_is_ok_and_opens_nothing(tmp_path: Path) -> None:
    cfg = _tpm_config(tmp_path, f'[tpm]\nmode = "off"\ntcti = "{closed_tcti()}"\n')
    assert tpm_check(cfg) == Check("tpm", "ok", "TPM not used (mode off)")


def test_tpm_present_with_its_ek_certificate(tmp_path: Path, swtpm: SwTpm) -> None:
    check = tpm_check(_tpm_config(tmp_path, f'[tpm]\ntcti = "{swtpm.tcti}"\n'))
    assert check == Check(
        "tpm", "ok", f"TPM present at {swtpm.tcti}; EK certificate (EK-RSA2048) readable"
    )


def test_no_tpm_is_ok_in_auto_and_fails_when_required(tmp_path: Path) -> None:
    tcti = closed_tcti()
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
    from tests.world.agent import running

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
    from tests.world.agent import running

    sock = tmp_path / "run" / "helper.sock"
    tcti = closed_tcti()
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
    config = offline_node_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    assert main(["doctor", "--config", str(config), "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["tpm"] == {"name": "tpm", "status": "ok", "message": "TPM not used (mode off)"}
    assert main(["doctor", "--config", str(tmp_path / "missing.toml"), "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["tpm"]["message"] == "cannot check the TPM without a configuration"


# --- the servingca check ----------------------------------------------------------------

SERVING_CA_WAY_BACK = (
    "run install-bcd.sh again, or remove the file and bcd fetches it from the gateway, "
    "checked against the pin"
)


def _pinned_config(tmp_path: Path, memory_pki: Pki) -> Path:
    """config.toml pinned to ``memory_pki``'s serving CA, no serving-ca.pem, TPM off."""
    config = hostile.write_config(tmp_path, memory_pki, 1, serving_ca=False)
    config.write_text(config.read_text() + '[tpm]\nmode = "off"\n')
    return config


def _doctor_line(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``bcd doctor``'s exit code and its servingca line."""
    code = main(["doctor", "--config", str(config)])
    lines = [line for line in capsys.readouterr().out.splitlines() if " servingca " in line]
    assert len(lines) == 1, lines
    return code, lines[0]


def test_serving_ca_pem_carrying_the_pin_is_ok(
    tmp_path: Path, memory_pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pinned_config(tmp_path, memory_pki)
    pem = config.parent / "serving-ca.pem"
    pem.write_text(pki.cert_pem(memory_pki.serving_ca))
    pem.chmod(0o644)
    assert _doctor_line(config, capsys) == (0, f"ok    servingca {pem} carries serving_ca_spki_pin")


def test_a_missing_serving_ca_pem_is_a_warning(
    tmp_path: Path, memory_pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pinned_config(tmp_path, memory_pki)
    pem = config.parent / "serving-ca.pem"
    assert _doctor_line(config, capsys) == (
        0,
        f"warn  servingca no {pem}: bcd fetches it from the gateway on its next run (checked "
        "against serving_ca_spki_pin); install-bcd.sh writes it",
    )
    assert not pem.exists()  # doctor neither probes nor writes


def test_serving_ca_pem_of_another_ca_or_garbage_fails(
    tmp_path: Path, memory_pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pinned_config(tmp_path, memory_pki)
    pem = config.parent / "serving-ca.pem"
    loader_way_back = (
        "it must be the serving CA certificate whose SPKI pin is serving_ca_spki_pin (run the "
        "install script again, or remove the file and bcd fetches it from the gateway, checked "
        "against the pin)"
    )
    other = build_pki("td.example", datetime.now(UTC))
    pem.write_text(pki.cert_pem(other.serving_ca))
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem}: its SPKI pin is not serving_ca_spki_pin; {loader_way_back}",
    )
    pem.write_text("not a certificate\n")
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem}: it is not a PEM certificate; {loader_way_back}",
    )
    pem.write_text(pki.cert_pem(memory_pki.serving_ca) + pki.cert_pem(other.serving_ca))
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem}: it holds 2 certificates, not one; {loader_way_back}",
    )


def test_serving_ca_pem_that_is_not_a_regular_file_fails(
    tmp_path: Path, memory_pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pinned_config(tmp_path, memory_pki)
    pem = config.parent / "serving-ca.pem"
    os.mkfifo(pem)
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem}: is a FIFO, not a regular file; {SERVING_CA_WAY_BACK}",
    )
    pem.unlink()
    pem.mkdir()
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca cannot read {pem}: Is a directory; {SERVING_CA_WAY_BACK}",
    )
    pem.rmdir()
    pem.write_bytes(b"x" * (64 * 1024 + 1))
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem}: larger than 65536 bytes; {SERVING_CA_WAY_BACK}",
    )


def test_a_world_writable_serving_ca_pem_fails(
    tmp_path: Path, memory_pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pinned_config(tmp_path, memory_pki)
    pem = config.parent / "serving-ca.pem"
    pem.write_text(pki.cert_pem(memory_pki.serving_ca))
    pem.chmod(0o666)
    assert _doctor_line(config, capsys) == (
        1,
        f"fail  servingca {pem} can be changed by other users (mode 0666); it is the serving "
        f"CA bcd trusts: chmod 0644 {pem}; {SERVING_CA_WAY_BACK}",
    )


def test_no_config_no_serving_ca_check(tmp_path: Path) -> None:
    checks = {c.name: c for c in all_checks(tmp_path / "missing.toml", _now())}
    assert checks["servingca"] == Check(
        "servingca", "fail", "cannot check serving-ca.pem without a configuration"
    )


# --- the revoked check: what bcd node recorded in the journal ---------------------------

REVOKED_WAY_BACK = (
    "the machine comes back only by joining again with fresh evidence (a new token, or "
    "the TPM): as root, bcd join --reset --yes, then bcd join"
)


def _joined_with_journal(
    tmp_path: Path, ca: CertAuthority, *records: tuple[str, dict[str, object], datetime | None]
) -> tuple[Path, str]:
    """A joined node's config and its certificate's serial, its journal.db holding
    ``records`` (kind, payload, time) written the way bcd node writes them."""
    from bcd.journal import open_journal

    data_dir = tmp_path / "data"
    join(data_dir, ca)
    state = load_state(data_dir)
    assert state is not None
    with open_journal(data_dir, _now()) as journal:
        for kind, payload, at in records:
            journal.append(kind, payload, at)
    config = offline_node_config(tmp_path, data_dir, '[tpm]\nmode = "off"\n')
    return config, state.leaf_info.serial_hex


def _line(out: str, name: str) -> str:
    lines = [line for line in out.splitlines() if line.split()[1:2] == [name]]
    assert len(lines) == 1, out
    return lines[0]


def test_a_recorded_revocation_of_this_certificate_fails_with_the_way_back(
    tmp_path: Path, ca: CertAuthority, capsys: pytest.CaptureFixture[str]
) -> None:
    config, serial = _joined_with_journal(
        tmp_path / "r", ca, ("revoked", {"reason": "key-compromise", "serial": "ab"}, None)
    )
    # a revocation of another certificate (before a re-join kept the journal): ok
    assert main(["doctor", "--config", str(config)]) == 0
    assert _line(capsys.readouterr().out, "revoked").startswith("ok    revoked")
    from bcd.journal import open_journal

    with open_journal(tmp_path / "r" / "data", _now()) as journal:
        journal.append("revoked", {"reason": "key-compromise", "serial": serial})
    assert main(["doctor", "--config", str(config)]) == 1
    line = _line(capsys.readouterr().out, "revoked")
    assert line.startswith("fail  revoked   bcd node stopped at ")
    assert f'(serial {serial}, reason "key-compromise")' in line
    assert line.endswith(REVOKED_WAY_BACK)
    assert main(["doctor", "--config", str(config), "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] is False
    assert {c["name"]: c["status"] for c in body["checks"]}["revoked"] == "fail"


def test_a_revocation_recorded_without_a_serial_applies_when_not_older_than_the_certificate(
    tmp_path: Path, ca: CertAuthority, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _now() - timedelta(days=3)  # before the certificate: a previous identity's
    config, _ = _joined_with_journal(tmp_path / "a", ca, ("revoked", {"reason": "x"}, old))
    assert main(["doctor", "--config", str(config)]) == 0
    capsys.readouterr()
    config, _ = _joined_with_journal(tmp_path / "b", ca, ("revoked", {"reason": "x"}, None))
    assert main(["doctor", "--config", str(config)]) == 1
    assert REVOKED_WAY_BACK in _line(capsys.readouterr().out, "revoked")


def test_an_unreadable_journal_is_a_warning_and_doctor_moves_nothing(
    tmp_path: Path, ca: CertAuthority
) -> None:
    data_dir = tmp_path / "data"
    join(data_dir, ca)
    (data_dir / "journal.db").write_bytes(b"not sqlite at all" * 100)
    checks = run_checks(offline_node_config(tmp_path, data_dir), _now())
    revoked = [c for c in checks if c.name == "revoked"]
    assert revoked[0].status == "warn"
    assert "cannot read the journal" in revoked[0].message
    assert (data_dir / "journal.db").read_bytes() == b"not sqlite at all" * 100


def test_unknown_certificate_last_heard_is_a_session_warning_until_a_session_opens(
    tmp_path: Path, ca: CertAuthority, capsys: pytest.CaptureFixture[str]
) -> None:
    from bcd.journal import open_journal

    config, serial = _joined_with_journal(tmp_path, ca)
    with open_journal(tmp_path / "data", _now()) as journal:
        journal.append("session-open", {"serial": serial})
        journal.append("unknown-certificate", {"serial": serial})
    assert main(["doctor", "--config", str(config)]) == 0  # a warning: the node retries
    line = _line(capsys.readouterr().out, "session")
    assert line.startswith("warn  session   at ")
    assert f"the control plane does not know this node's certificate (serial {serial})" in line
    assert "restored from a backup older than this certificate" in line
    assert line.endswith(WAY_BACK)
    with open_journal(tmp_path / "data", _now()) as journal:
        journal.append("session-open", {"serial": serial})
    assert main(["doctor", "--config", str(config)]) == 0
    assert " session " not in capsys.readouterr().out


# --- the hardware check: what the machine claims at join ---------------------------------


def test_a_machine_with_a_trusted_key_shows_its_claims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.fakesys import make_machine

    root = make_machine(
        tmp_path / "sys",
        product_uuid="4C4C4544-0042-3510-8052-B4C04F4E3232",
        product_serial="SN-1234",
        macs=["0c:c4:7a:12:34:56"],
        random_macs=["02:11:22:33:44:55"],
        hostname="gpu-7",
    )
    config = offline_node_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    assert main(["doctor", "--config", str(config), "--sysfs-root", str(root)]) == 0
    line = _line(capsys.readouterr().out, "hardware")
    assert line.startswith(
        'ok    hardware  join claims: product UUID "4C4C4544-0042-3510-8052-B4C04F4E3232"; '
        'serials "SN-1234"; permanent MACs "0c:c4:7a:12:34:56"; GPU UUIDs none; '
        'hostname "gpu-7"; hardware key sha256:'
    )
    assert line.endswith("is trusted (mac, product_uuid, serial)")
    assert "02:11:22:33:44:55" not in line  # a randomised MAC is not claimed
    assert main(["doctor", "--config", str(config), "--sysfs-root", str(root), "--json"]) == 0
    hw = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["hardware"]
    details = hw["details"]
    assert details["trusted"] is True
    assert details["placeholderReasons"] == []
    assert details["identifiers"]["product_uuid"] == ["4c4c4544-0042-3510-8052-b4c04f4e3232"]
    assert details["claims"]["hostname"] == "gpu-7"
    assert "boot_id" not in details["claims"]
    assert len(details["hardwareKey"]) == 64


def test_a_placeholder_machine_says_which_values_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bcd import hardware
    from tests.fakesys import make_machine

    root = make_machine(
        tmp_path / "sys",
        product_uuid="00000000-0000-0000-0000-000000000000",
        product_serial="To Be Filled By O.E.M.",
        macs=["0c:c4:7a:12:34:56"],
        hostname="localhost",
    )
    config = offline_node_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    assert main(["doctor", "--config", str(config), "--sysfs-root", str(root)]) == 0
    line = _line(capsys.readouterr().out, "hardware")
    assert line.startswith("warn  hardware  join claims: ")
    assert (
        'the hardware key is a placeholder (product UUID "00000000-0000-0000-0000-000000000000" '
        "is a placeholder or malformed (dropped); "
        'product serial "To Be Filled By O.E.M." is a placeholder or malformed (dropped); '
        "kinds that survived: permanent MAC; a trusted key needs two of them; "
        "neither a product UUID nor a serial survived)"
    ) in line
    assert "refused as placeholder hardware unless the token binds this machine with expect" in line
    # the rule doctor shows is the one JoinService applies (one function for both)
    claims = hardware.read_claims(root)
    assert hardware.hardware_key(claims).placeholder


def test_a_value_with_a_control_character_cannot_forge_a_doctor_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.fakesys import make_machine

    root = make_machine(tmp_path / "sys", product_serial="A\nok    revoked   forged")
    config = offline_node_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    main(["doctor", "--config", str(config), "--sysfs-root", str(root)])
    out = capsys.readouterr().out
    assert "\nok    revoked   forged" not in out
