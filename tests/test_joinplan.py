"""bcd join as a plan: the --server bootstrap's table, the CLI's light start, no print
in library code. (The plan's behaviour end to end: tests/test_e2e_join.py,
tests/test_e2e_cli.py, tests/adversarial/test_cli_and_files.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bcd import cli, joinplan, pki, rejoin
from bcd.attestor_api import JOIN_TOKEN
from bcd.bootstrap import SITE_PLACEHOLDER, bootstrap_config, write_bootstrap
from bcd.config import load_config
from bcd.errors import JoinError, UsageError
from tests.certs import new_id

ROOT = Path(__file__).resolve().parent.parent
ENCRYPTION_KEY = pki.generate_key().public_key()
PINS = {
    "serving_ca_spki_pin": pki.spki_pin(pki.generate_key().public_key()),
    "join_signing_key_pin": pki.spki_pin(pki.generate_key().public_key()),
    "join_encryption_key_pin": pki.spki_pin(ENCRYPTION_KEY),
}
SERVER = "https://cp.example.com"


def document(**gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {
            "url": "https://gw.example.com:8443",
            "servingCaPin": PINS["serving_ca_spki_pin"],
            **gateway,
        },
        "join": {
            "signingKeyPin": PINS["join_signing_key_pin"],
            "encryptionKeyPin": PINS["join_encryption_key_pin"],
        },
    }


def test_the_bootstrap_writes_with_tomli_w_what_json_dumps_could_not(tmp_path: Path) -> None:
    """A data directory beyond the BMP, with quotes and a backslash: json.dumps wrote
    it as a surrogate pair no TOML reader takes; the table and tomli-w keep it."""
    config = tmp_path / "etc" / "config.toml"
    data_dir = tmp_path / 'data "q" \\ 😀'
    cfg = bootstrap_config(
        document(serverName="gw.internal"),
        server=SERVER,
        config=config,
        pins=PINS,
        data_dir=data_dir,
    )
    assert (cfg.path, cfg.site, cfg.data_dir) == (config, SITE_PLACEHOLDER, data_dir)
    assert (cfg.gateway_url, cfg.server_name) == ("https://gw.example.com:8443", "gw.internal")
    site = new_id("site")
    write_bootstrap(cfg, site, ENCRYPTION_KEY)
    loaded = load_config(config)
    assert loaded.site == site
    assert loaded.data_dir == data_dir
    assert loaded.join_encryption_key_pin == PINS["join_encryption_key_pin"]
    assert (config.parent / "join-encryption.jwk").is_file()


def test_the_bootstrap_refuses_another_pin_than_the_one_given(tmp_path: Path) -> None:
    doc = document(servingCaPin=pki.spki_pin(pki.generate_key().public_key()))
    with pytest.raises(JoinError) as info:
        bootstrap_config(doc, server=SERVER, config=tmp_path / "c.toml", pins=PINS)
    assert str(info.value) == (
        f"the well-known document of {SERVER} has another serving_ca_spki_pin than the one "
        "given; refusing it"
    )


def test_the_bootstrap_names_the_missing_pin_flags(tmp_path: Path) -> None:
    pins = {**PINS, "serving_ca_spki_pin": None, "join_encryption_key_pin": None}
    with pytest.raises(UsageError) as info:
        bootstrap_config(document(), server=SERVER, config=tmp_path / "c.toml", pins=pins)
    assert str(info.value).endswith("--serving-ca-pin, --join-encryption-pin")


HEAVY = ("trio", "cryptography", "jwcrypto", "httpx", "pluggy", "tpm2_pytss", "tlslite", "h11")


@pytest.mark.parametrize("argv", [["version"], ["--version"], ["--help"]])
def test_version_and_help_import_no_heavy_module(argv: list[str]) -> None:
    """What keeps bcd version, --version and --help fast (bench/cli_start.py has the figures)."""
    script = (
        "import sys\n"
        "from bcd.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_light_modules_name_the_attestors_as_the_heavy_ones_do() -> None:
    assert cli.JOIN_TOKEN == JOIN_TOKEN
    assert joinplan.X509POP == rejoin.X509POP


def test_no_print_in_library_code() -> None:
    """Only the command line prints; library code reports through a callback."""
    printing = []
    for path in sorted((ROOT / "bcd").rglob("*.py")):
        if path == ROOT / "bcd" / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                printing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert printing == []
