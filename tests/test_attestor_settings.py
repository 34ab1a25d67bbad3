"""Each attestor checks its own settings through a hook of its plugin: the server half
the control plane's ``--attestor-setting`` values at serve's start
(``bcd_server_check_settings``), the node half its table ``[attestors.<name>]`` of
config.toml (``bcd_node_check_settings``). The control plane imports no attestor."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bcd.attestor_api import hookimpl
from bcd.config import parse_config, render_config
from bcd.errors import ConfigError
from bcd.plugins import load_plugins
from control.errors import ControlError
from control.server import check_attestor_settings

REPO = Path(__file__).resolve().parents[1]
PATH = Path("/etc/bcd/config.toml")
PIN = "sha256/" + "A" * 43 + "="
BASE = f"""
gateway_url = "https://gw.example.com"
site = "site_{"0" * 26}"
serving_ca_spki_pin = "{PIN}"
join_signing_key_pin = "{PIN}"
join_encryption_key_pin = "{PIN}"
"""
PLUGINS = load_plugins()


# --- the server half: better-compute serve's start ------------------------------------


def test_the_control_plane_imports_no_attestor_module() -> None:
    for path in sorted((REPO / "control").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n == "attestors" or n.startswith("attestors.") for n in names), path


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"tpm.ek_allow": "/nonexistent/ek-allow"}, "--tpm-ek-allow /nonexistent/ek-allow: not readable"),
        ({"tpm.ek_ca": "/nonexistent/ca.pem"}, "--tpm-ek-ca /nonexistent/ca.pem: not a readable PEM certificate bundle"),
        ({"x509pop.ca": "/nonexistent/ca.pem"}, "--x509pop-ca /nonexistent/ca.pem: not a readable PEM certificate bundle"),
        ({"x509pop.max_expired_s": "0"}, "x509pop.max_expired_s must be a whole number of seconds from 1 to"),
        ({"discovery.approval": "always"}, "the discovery attestor needs --discovery-pool POOL"),
        ({"serial-allowlist.pool": "pool_x"}, "serial-allowlist needs both --attestor-setting serial-allowlist.pool=POOL"),
    ],
)  # fmt: skip
def test_each_attestor_checks_its_server_settings_at_start(
    settings: dict[str, str], problem: str
) -> None:
    with pytest.raises(ControlError) as info:
        check_attestor_settings(PLUGINS, settings)
    assert info.value.code == "INVALID_CONFIG"
    assert info.value.message.startswith(problem)


def test_settings_every_attestor_accepts_start(tmp_path: Path) -> None:
    allow = tmp_path / "ek-allow"
    allow.write_text("")
    settings = {
        "tpm.ek_allow": str(allow),
        "tpm.pool": "pool_x",
        "x509pop.max_expired_s": "60",
        "discovery.pool": "pool_y",
        "serial-allowlist.pool": "pool_z",
        "serial-allowlist.serials": "SN-1",
    }
    check_attestor_settings(PLUGINS, settings)
    assert PLUGINS.server_settings_problems(settings) == []
    assert PLUGINS.server_settings_problems({}) == []


class BrokenCheck:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["broken-check"]

    @hookimpl
    def bcd_server_check_settings(self, attestor: str) -> list[str] | None:
        if attestor != "broken-check":
            return None
        raise RuntimeError("boom")

    @hookimpl
    def bcd_node_check_settings(self, attestor: str, table: Mapping[str, Any]) -> list[str] | None:
        if attestor != "broken-check":
            return None
        raise KeyError("boom")


def test_a_server_check_that_raises_stops_serve_naming_the_attestor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Settings nobody checked do not start serve; the message is the exception's
    class only, never its text."""
    plugins = load_plugins(extra=[BrokenCheck()])
    with caplog.at_level(logging.DEBUG, logger="bcd.plugins"), pytest.raises(ControlError) as info:
        check_attestor_settings(plugins, {})
    assert (info.value.code, info.value.message) == (
        "INVALID_CONFIG",
        "the broken-check attestor plugin failed to check its settings (RuntimeError)",
    )
    assert "boom" not in info.value.message
    (record,) = [r for r in caplog.records if "broken-check" in r.getMessage()]
    assert record.exc_info is not None  # the traceback, at debug only
    assert record.levelno == logging.DEBUG


class WrongAnswer:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["wrong-answer"]

    @hookimpl
    def bcd_server_check_settings(self, attestor: str) -> object:
        return "not a list" if attestor == "wrong-answer" else None


def test_a_server_check_answering_other_than_a_list_of_strings_stops_serve() -> None:
    with pytest.raises(ControlError) as info:
        check_attestor_settings(load_plugins(extra=[WrongAnswer()]), {})
    assert info.value.message == (
        "the wrong-answer attestor plugin failed to check its settings (TypeError)"
    )


@pytest.fixture
def tpm_failed_to_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A distribution whose attestor ``gone`` raises at import, as the tpm plugin does
    when tpm2-pytss is missing."""
    site = tmp_path / "site-packages"
    dist_info = site / "bcd_gone_attestor-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: bcd-gone-attestor\nVersion: 0.1.0\n"
    )
    (dist_info / "entry_points.txt").write_text("[bcd.attestors]\ngone = bcd_gone_attestor\n")
    (site / "bcd_gone_attestor.py").write_text('raise ImportError("no tpm2-pytss here")\n')
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "bcd_gone_attestor", raising=False)
    return "gone"


def test_settings_for_an_attestor_that_did_not_load_stop_serve(tpm_failed_to_load: str) -> None:
    plugins = load_plugins()
    assert [f.name for f in plugins.failures] == [tpm_failed_to_load]
    with pytest.raises(ControlError) as info:
        check_attestor_settings(plugins, {"gone.ek_ca": "/etc/ca.pem", "tpm.pool": "pool_x"})
    assert (info.value.code, info.value.message) == (
        "INVALID_CONFIG",
        "attestor setting gone.ek_ca: no loaded attestor owns it; the plugin gone did not load",
    )
    check_attestor_settings(plugins, {"tpm.pool": "pool_x"})  # the others still start


@pytest.mark.parametrize("key", ["tmp.pool", "x509.ca", "serial-allowlist", "join.x"])
def test_settings_no_loaded_attestor_owns_stop_serve(key: str) -> None:
    with pytest.raises(ControlError) as info:
        check_attestor_settings(PLUGINS, {key: "x"})
    assert info.value.message == f"attestor setting {key}: no loaded attestor owns it"


# --- the node half: [attestors.<name>] in config.toml ---------------------------------


def test_a_plugins_table_is_parsed_checked_and_written_back() -> None:
    text = BASE + '\n[attestors.serial-allowlist]\nserial_field = "board_serial"\n'
    cfg = parse_config(text, PATH, check_attestors=True)
    assert cfg.attestor_settings == {"serial-allowlist": {"serial_field": "board_serial"}}
    assert parse_config(render_config(cfg), PATH) == cfg
    assert parse_config(BASE, PATH).attestor_settings == {}
    assert parse_config(BASE + "\n[attestors]\n", PATH).attestor_settings == {}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[attestors.serial-allowlist]\nserial_field = "mac"\n',
         '[attestors.serial-allowlist]: "serial_field" must be one of product_serial, board_serial, chassis_serial'),
        ("[attestors.serial-allowlist]\nserial_field = 3\n",
         '[attestors.serial-allowlist]: "serial_field" must be one of product_serial, board_serial, chassis_serial'),
        ('[attestors.serial-allowlist]\nserial = "x"\n',
         "[attestors.serial-allowlist]: unknown key 'serial' (it takes serial_field)"),
        ('[attestors.nope]\nx = 1\n',
         'unknown attestor "attestors.nope": no attestor plugin has that name'),
        ('[attestors]\nserial-allowlist = "board_serial"\n',
         '"attestors.serial-allowlist" must be a table ([attestors.serial-allowlist])'),
        ('attestors = "x"\n', '"attestors" must be a table ([attestors])'),
        ('[attestors.tpm]\ntcti = "x"\n', "[attestors.tpm]: the tpm attestor takes no settings"),
        ('[attestors."bad\\u0007"]\n', 'unknown attestor "attestors.bad\\u0007": no attestor plugin has that name'),
    ],
)  # fmt: skip
def test_a_bad_table_is_a_config_error_naming_the_file(table: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + "\n" + table, PATH, check_attestors=True)
    assert str(info.value) == f"{PATH}: {message}"


def test_unknown_keys_outside_the_plugins_tables_are_still_refused() -> None:
    for extra, key in (("[tpm]\nfoo = 1\n", '"tpm.foo"'), ("foo = 1\n", '"foo"')):
        with pytest.raises(ConfigError) as info:
            parse_config(
                BASE + extra + "\n[attestors.serial-allowlist]\n", PATH, check_attestors=True
            )
        assert str(info.value) == f"{PATH}: unknown key {key}"


def test_a_built_in_attestor_accepts_an_empty_table() -> None:
    cfg = parse_config(BASE + "\n[attestors.tpm]\n", PATH, check_attestors=True)
    assert cfg.attestor_settings == {"tpm": {}}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[attestors]\nserial-allowlist = "board_serial"\n',
         '"attestors.serial-allowlist" must be a table ([attestors.serial-allowlist])'),
        ('attestors = "x"\n', '"attestors" must be a table ([attestors])'),
    ],
)  # fmt: skip
def test_without_the_plugins_the_shape_of_attestors_is_still_checked(
    table: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + "\n" + table, PATH)
    assert str(info.value) == f"{PATH}: {message}"


def test_an_agent_loads_an_unknown_attestors_table_without_importing_a_plugin(
    tmp_path: Path,
) -> None:
    """bcd helper, bcd node and bcd vouch load config.toml without check_attestors: a
    plugin that fails to import cannot stop them; bcd join and bcd doctor judge it."""
    config = tmp_path / "config.toml"
    config.write_text(BASE + "\n[attestors.no-such-attestor]\nx = 1\n")
    config.chmod(0o644)
    script = (
        "import sys; from pathlib import Path; from bcd.config import load_config\n"
        f"cfg = load_config(Path({str(config)!r}))\n"
        "print(cfg.attestor_settings)\n"
        "print(sorted(m for m in sys.modules if m == 'bcd.plugins' or m == 'pluggy'"
        " or m.startswith('attestors')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == ["{'no-such-attestor': {'x': 1}}", "[]"]
    from bcd.config import load_config

    with pytest.raises(ConfigError, match=r'unknown attestor "attestors\.no-such-attestor"'):
        load_config(config, check_attestors=True)


def test_a_node_check_that_raises_names_the_plugin_never_a_traceback() -> None:
    plugins = load_plugins(extra=[BrokenCheck()])
    problem = plugins.node_settings_problem({"broken-check": {"a": 1}})
    assert problem == (
        "[attestors.broken-check]: the broken-check attestor plugin failed to check its "
        "settings (KeyError)"
    )
    assert "boom" not in (problem or "")


def test_the_old_import_path_of_the_contract_still_works() -> None:
    import bcd.attestor_api
    import bcd.plugins

    assert bcd.plugins.Admit is bcd.attestor_api.Admit
    assert bcd.plugins.hookimpl is bcd.attestor_api.hookimpl
    with pytest.raises(AttributeError):
        bcd.plugins.NoSuchName  # noqa: B018
