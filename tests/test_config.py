"""config.toml: loading, every error naming its key, rendering that round-trips."""

from __future__ import annotations

import contextlib
import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcd import pki
from bcd.config import (
    DEFAULT_DATA_DIR,
    Config,
    HelperConfig,
    TpmConfig,
    config_from_table,
    config_table,
    gateway_host_port,
    join_encryption_jwk_path,
    load_config,
    parse_config,
    render_config,
)
from bcd.errors import ConfigError
from tests.certs import new_id

SITE = new_id("site")
PIN_A = pki.spki_pin(pki.generate_key().public_key())
PIN_B = pki.spki_pin(pki.generate_key().public_key())
PIN_C = pki.spki_pin(pki.generate_key().public_key())
CFG_PATH = Path("/etc/bcd/config.toml")


def minimal(**overrides: str) -> str:
    values = {
        "gateway_url": '"https://gw.eu.example.com"',
        "site": f'"{SITE}"',
        "serving_ca_spki_pin": f'"{PIN_A}"',
        "join_signing_key_pin": f'"{PIN_B}"',
        "join_encryption_key_pin": f'"{PIN_C}"',
    }
    values.update(overrides)
    return "".join(f"{k} = {v}\n" for k, v in values.items() if v != "DROP")


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, CFG_PATH)
    return str(info.value)


# --- loading ----------------------------------------------------------------------


def test_minimal_config_has_defaults() -> None:
    cfg = parse_config(minimal(), CFG_PATH)
    assert cfg == Config(
        path=CFG_PATH,
        gateway_url="https://gw.eu.example.com",
        site=SITE,
        serving_ca_spki_pin=PIN_A,
        join_signing_key_pin=PIN_B,
        join_encryption_key_pin=PIN_C,
        server_name="gw.eu.example.com",
        data_dir=DEFAULT_DATA_DIR,
        helper=None,
        tpm=TpmConfig(mode="auto", tcti="device:/dev/tpmrm0"),
    )
    assert gateway_host_port(cfg) == ("gw.eu.example.com", 443)
    assert join_encryption_jwk_path(cfg) == Path("/etc/bcd/join-encryption.jwk")


def test_full_config() -> None:
    text = minimal(gateway_url='"https://gw.example.com:8443/"') + (
        'server_name = "gateway.internal"\n'
        'data_dir = "/srv/bcd"\n'
        "[helper]\n"
        'user = "bcd-node"\n'
        'socket = "/run/bcd/h.sock"\n'
        "[tpm]\n"
        'mode = "required"\n'
        'tcti = "device:/dev/tpm0"\n'
    )
    cfg = parse_config(text, CFG_PATH)
    assert cfg.gateway_url == "https://gw.example.com:8443"
    assert gateway_host_port(cfg) == ("gw.example.com", 8443)
    assert cfg.server_name == "gateway.internal"
    assert cfg.data_dir == Path("/srv/bcd")
    assert cfg.helper == HelperConfig(
        user="bcd-node",
        socket=Path("/run/bcd/h.sock"),
        hostconfig_dir=HelperConfig().hostconfig_dir,
    )
    assert cfg.tpm == TpmConfig(mode="required", tcti="device:/dev/tpm0")


def test_empty_helper_table_turns_the_helper_on() -> None:
    cfg = parse_config(minimal() + "[helper]\n", CFG_PATH)
    assert cfg.helper == HelperConfig()


def test_ipv6_gateway() -> None:
    cfg = parse_config(minimal(gateway_url='"https://[2001:db8::1]:9443"'), CFG_PATH)
    assert gateway_host_port(cfg) == ("2001:db8::1", 9443)
    assert cfg.server_name == "2001:db8::1"


def test_load_config_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(minimal())
    cfg = load_config(path)
    assert cfg.path == path
    assert join_encryption_jwk_path(cfg) == tmp_path / "join-encryption.jwk"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"^no configuration at .*nope\.toml; "):
        load_config(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        load_config(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'site = "\xff"\n')
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(path)


# --- errors name the file and the key ---------------------------------------------


def test_toml_syntax_error() -> None:
    message = error_of(minimal() + "this is not toml\n")
    assert message.startswith(f"{CFG_PATH}: not valid TOML")


def test_unknown_top_level_key() -> None:
    assert error_of(minimal() + 'gatway_url = "x"\n') == f'{CFG_PATH}: unknown key "gatway_url"'


def test_unknown_key_in_tables() -> None:
    assert error_of(minimal() + '[helper]\nusr = "bcd"\n') == (
        f'{CFG_PATH}: unknown key "helper.usr"'
    )
    assert error_of(minimal() + '[tpm]\nmod = "off"\n') == f'{CFG_PATH}: unknown key "tpm.mod"'
    assert error_of(minimal() + "[extra]\n") == f'{CFG_PATH}: unknown key "extra"'


@pytest.mark.parametrize(
    "key",
    [
        "gateway_url",
        "site",
        "serving_ca_spki_pin",
        "join_signing_key_pin",
        "join_encryption_key_pin",
    ],
)
def test_missing_required_key(key: str) -> None:
    assert error_of(minimal(**{key: "DROP"})) == f'{CFG_PATH}: missing key "{key}"'


@pytest.mark.parametrize(
    "key", ["serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin"]
)
def test_malformed_pin_names_the_pin(key: str) -> None:
    message = error_of(minimal(**{key: '"sha256/short"'}))
    assert message.startswith(f'{CFG_PATH}: "{key}" is malformed')
    message = error_of(minimal(**{key: '"' + PIN_A.replace("sha256/", "sha1/") + '"'}))
    assert f'"{key}"' in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (minimal(gateway_url="443"), "gateway_url"),
        (minimal(site="1"), "site"),
        (minimal(serving_ca_spki_pin="[]"), "serving_ca_spki_pin"),
        (minimal() + "data_dir = 5\n", "data_dir"),
        (minimal() + "server_name = true\n", "server_name"),
        (minimal() + 'helper = "yes"\n', "helper"),
        (minimal() + "tpm = 1\n", "tpm"),
        (minimal() + "[helper]\nuser = 1\n", "helper.user"),
        (minimal() + "[helper]\nsocket = []\n", "helper.socket"),
        (minimal() + "[helper]\nhostconfig_dir = 2024-01-01\n", "helper.hostconfig_dir"),
        (minimal() + "[tpm]\nmode = 0\n", "tpm.mode"),
        (minimal() + "[tpm]\ntcti = {}\n", "tpm.tcti"),
    ],
)
def test_wrong_type_names_the_key(text: str, key: str) -> None:
    message = error_of(text)
    assert message.startswith(f'{CFG_PATH}: "{key}"'), message


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('"http://gw.example.com"', "https://"),
        ('"gw.example.com"', "https://"),
        ('"https://"', "https://host"),
        ('"https://gw.example.com/api"', "no path"),
        ('"https://gw.example.com?x=1"', "no path"),
        ('"https://user@gw.example.com"', "https://host"),
        ('"https://gw.example.com:0"', "port"),
        ('"https://gw.example.com:70000"', "port"),
        ('"https://gw.example.com:x"', "https://host"),
        ('"https://gw example.com"', "https://host"),
        ('"https://[zz::1]"', "https://host"),
        ('"https://-bad-.example"', "https://host"),
    ],
)
def test_bad_gateway_url(value: str, fragment: str) -> None:
    message = error_of(minimal(gateway_url=value))
    assert message.startswith(f'{CFG_PATH}: "gateway_url"'), message
    assert fragment in message


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ('data_dir = "relative/dir"\n', "data_dir"),
        ('server_name = "not a host"\n', "server_name"),
        ('[tpm]\nmode = "sometimes"\n', "tpm.mode"),
        ('[helper]\nuser = "bad user"\n', "helper.user"),
        ('[helper]\nsocket = "helper.sock"\n', "helper.socket"),
        ('[tpm]\ntcti = ""\n', "tpm.tcti"),
    ],
)
def test_bad_values_name_the_key(extra: str, key: str) -> None:
    assert error_of(minimal() + extra).startswith(f'{CFG_PATH}: "{key}"')


def test_bad_site_id() -> None:
    assert error_of(minimal(site='"site_x"')).startswith(f'{CFG_PATH}: "site"')


# --- rendering --------------------------------------------------------------------


def test_render_minimal_round_trip() -> None:
    cfg = parse_config(minimal(), CFG_PATH)
    text = render_config(cfg)
    assert parse_config(text, CFG_PATH) == cfg
    assert "server_name" not in text
    assert "[tpm]" not in text


def test_render_full_round_trip() -> None:
    cfg = Config(
        path=CFG_PATH,
        gateway_url="https://[2001:db8::1]:8443",
        site=SITE,
        serving_ca_spki_pin=PIN_A,
        join_signing_key_pin=PIN_B,
        join_encryption_key_pin=PIN_C,
        server_name="gw.example.com",
        data_dir=Path('/srv/odd "dir"\\ü'),
        helper=HelperConfig(
            user="bcd", socket=Path("/run/x\tsock"), hostconfig_dir=Path("/var/lib/hc")
        ),
        tpm=TpmConfig(mode="off", tcti='swtpm:host=127.0.0.1,port=2321 "\x7f"'),
    )
    assert parse_config(render_config(cfg), CFG_PATH) == cfg


@settings(max_examples=50, deadline=None)
@given(
    port=st.none() | st.integers(1, 65535),
    host=st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9](\.[a-z]{2,5}){0,2}", fullmatch=True),
    data_dir=st.text(min_size=1).map(lambda s: "/" + s.replace("\0", "")),
    helper=st.booleans(),
    mode=st.sampled_from(["auto", "off", "required"]),
    tcti=st.text(min_size=1),
)
def test_render_round_trip_property(
    port: int | None, host: str, data_dir: str, helper: bool, mode: str, tcti: str
) -> None:
    url = f"https://{host}" + (f":{port}" if port else "")
    cfg = Config(
        path=CFG_PATH,
        gateway_url=url,
        site=SITE,
        serving_ca_spki_pin=PIN_A,
        join_signing_key_pin=PIN_B,
        join_encryption_key_pin=PIN_C,
        server_name=host,
        data_dir=Path(data_dir),
        helper=HelperConfig() if helper else None,
        tpm=TpmConfig(mode=mode, tcti=tcti),  # type: ignore[arg-type]
    )
    try:
        text = render_config(cfg)
    except UnicodeEncodeError:  # pragma: no cover - lone surrogates cannot be UTF-8
        return
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return
    assert parse_config(text, CFG_PATH) == cfg


# Any text a path or a TCTI may hold: quotes, backslashes, control characters, DEL,
# characters beyond the BMP; no lone surrogates (they cannot be UTF-8, and
# config_from_table refuses them) and no NUL (never in a path).
_ANY_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1
)
_HELPER_USERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,30}\$?", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(
    host=st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9](\.[a-z]{2,5}){0,2}", fullmatch=True),
    port=st.none() | st.integers(1, 65535),
    server_name=st.none() | st.sampled_from(["gw.internal", "127.0.0.1", "2001:db8::1"]),
    data_dir=_ANY_TEXT,
    helper=st.none()
    | st.builds(
        HelperConfig,
        user=_HELPER_USERS,
        socket=_ANY_TEXT.map(lambda s: Path("/" + s)),
        hostconfig_dir=_ANY_TEXT.map(lambda s: Path("/" + s)),
    ),
    tpm=st.builds(TpmConfig, mode=st.sampled_from(["auto", "off", "required"]), tcti=_ANY_TEXT),
)
def test_any_config_written_with_tomli_w_reads_back_equal(
    host: str,
    port: int | None,
    server_name: str | None,
    data_dir: str,
    helper: HelperConfig | None,
    tpm: TpmConfig,
) -> None:
    cfg = Config(
        path=CFG_PATH,
        gateway_url=f"https://{host}" + (f":{port}" if port else ""),
        site=SITE,
        serving_ca_spki_pin=PIN_A,
        join_signing_key_pin=PIN_B,
        join_encryption_key_pin=PIN_C,
        server_name=server_name or host,
        data_dir=Path("/" + data_dir),
        helper=helper,
        tpm=tpm,
    )
    text = render_config(cfg)
    assert parse_config(text, CFG_PATH) == cfg
    assert config_from_table(tomllib.loads(text), CFG_PATH) == cfg
    assert config_from_table(config_table(cfg), CFG_PATH) == cfg


def test_a_table_is_read_as_its_toml_is() -> None:
    """The bootstrap builds a table; what was once a json.dumps line is now a value.

    json.dumps writes a character beyond the BMP as a surrogate pair, "\\ud83d\\ude00",
    which no TOML reader accepts: that old way could not write this data_dir.
    """
    data_dir = '/srv/bcd "quoted" \\ back\tslash \x7f ü 😀'
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(f"data_dir = {json.dumps(data_dir)}")
    table = {
        "gateway_url": "https://gw.example.com",
        "site": SITE,
        "serving_ca_spki_pin": PIN_A,
        "join_signing_key_pin": PIN_B,
        "join_encryption_key_pin": PIN_C,
        "data_dir": data_dir,
    }
    cfg = config_from_table(table, CFG_PATH)
    assert cfg.data_dir == Path(data_dir)
    assert config_table(cfg) == table
    assert parse_config(render_config(cfg), CFG_PATH) == cfg


def test_a_built_table_with_a_lone_surrogate_is_refused() -> None:
    """A path from argv may carry surrogate escapes (undecodable bytes): refused with
    the key named, not left to fail when the file is written after the join."""
    table = {
        "gateway_url": "https://gw.example.com",
        "site": SITE,
        "serving_ca_spki_pin": PIN_A,
        "join_signing_key_pin": PIN_B,
        "join_encryption_key_pin": PIN_C,
        "data_dir": "/srv/\udcff",
    }
    with pytest.raises(ConfigError) as info:
        config_from_table(table, CFG_PATH)
    assert str(info.value) == f'{CFG_PATH}: "data_dir" is not valid UTF-8'


# --- parsing never raises anything but ConfigError -------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_config_raises_only_config_error(text: str) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(text, CFG_PATH)


_VALUES = st.sampled_from(
    [
        '"x"',
        "1",
        "true",
        "[]",
        "{}",
        '"https://a.b"',
        f'"{PIN_A}"',
        f'"{SITE}"',
        '"/abs"',
        "1979-05-27T07:32:00Z",
        "inf",
        '"https://[::1]:1"',
    ]
)
_KEYS = st.sampled_from(
    [
        "gateway_url",
        "site",
        "serving_ca_spki_pin",
        "join_signing_key_pin",
        "join_encryption_key_pin",
        "server_name",
        "data_dir",
        "helper",
        "tpm",
        "helper.user",
        "helper.socket",
        "tpm.mode",
        "tpm.tcti",
        "other",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=12))
def test_parse_config_structured_inputs_raise_only_config_error(doc: dict[str, str]) -> None:
    text = "".join(f"{k} = {v}\n" for k, v in doc.items())
    try:
        cfg = parse_config(text, CFG_PATH)
    except ConfigError:
        return
    assert parse_config(render_config(cfg), CFG_PATH) == cfg


# --- [metrics] --------------------------------------------------------------------

TEXTFILE = "/var/lib/prometheus/node-exporter/bcd.prom"


def test_metrics_textfile_is_read_and_round_trips() -> None:
    cfg = parse_config(minimal() + f'[metrics]\ntextfile = "{TEXTFILE}"\n', CFG_PATH)
    assert cfg.metrics.textfile == Path(TEXTFILE)
    text = render_config(cfg)
    assert tomllib.loads(text)["metrics"] == {"textfile": TEXTFILE}
    assert parse_config(text, CFG_PATH) == cfg


def test_no_metrics_table_writes_no_textfile() -> None:
    cfg = parse_config(minimal(), CFG_PATH)
    assert cfg.metrics.textfile is None
    assert "metrics" not in tomllib.loads(render_config(cfg))
    assert parse_config(minimal() + "[metrics]\n", CFG_PATH).metrics.textfile is None


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('"bcd.prom"', '"metrics.textfile" must be an absolute path'),
        ('"relative/dir/bcd.prom"', '"metrics.textfile" must be an absolute path'),
        ('"/var/lib/node-exporter/bcd.txt"', '"metrics.textfile" must end in .prom'),
        ('"/var/lib/node-exporter/.prom"', '"metrics.textfile" must end in .prom'),
        ('"/var/lib/node-exporter/"', "without . or .. parts"),
        ('"/var/lib/../../etc/cron.d/x.prom"', "without . or .. parts"),
        ('"/var/lib/./bcd.prom"', "without . or .. parts"),
        ('"/var/lib/bcd\\nfoo.prom"', "must not hold control characters"),
        ('"/var/lib/bcd\\u0000.prom"', '"metrics.textfile" must be an absolute path'),
        ('"/var/lib/bcd\\u001b[31m.prom"', "must not hold control characters"),
        ('""', '"metrics.textfile" must not be empty'),
        ("17", '"metrics.textfile" must be a string'),
        ('["/a.prom"]', '"metrics.textfile" must be a string'),
        (f'"/{"a" * 256}.prom"', "has a part longer than 255 bytes"),
        (f'"{"/abcdefgh" * 600}.prom"', "longer than 4095 bytes"),
    ],
)
def test_bad_metrics_textfile_is_refused_naming_the_key(value: str, fragment: str) -> None:
    message = error_of(minimal() + f"[metrics]\ntextfile = {value}\n")
    assert message.startswith(f"{CFG_PATH}: ")
    assert fragment in message
    assert "\n" not in message
    assert "\x1b" not in message


def test_metrics_must_be_a_table_with_known_keys() -> None:
    assert '"metrics" must be a table' in error_of(minimal(metrics='"/a.prom"'))
    message = error_of(minimal() + '[metrics]\ntextfile = "/a.prom"\nlisten = ":9100"\n')
    assert 'unknown key "metrics.listen"' in message
