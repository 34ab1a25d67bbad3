"""config.toml: the node's configuration (PROTOCOL.md, "config.toml").

::

    gateway_url = "https://gw.eu.example.com"      # https only; host and optional port
    site = "site_…"
    serving_ca_spki_pin = "sha256/…"
    join_signing_key_pin = "sha256/…"
    join_encryption_key_pin = "sha256/…"
    server_name = "gw.eu.example.com"              # optional; default: the gateway's host
    data_dir = "/var/lib/bcd"                      # optional

    [helper]                                       # optional; its presence turns the helper on
    user = "bcd"                                   # each key optional, defaults below
    socket = "/run/bcd-helper/helper.sock"
    hostconfig_dir = "/var/lib/bcd-hostconfig"

    [tpm]                                          # optional
    mode = "auto"                                  # auto | off | required
    tcti = "device:/dev/tpmrm0"

    [metrics]                                      # optional
    textfile = "/var/lib/prometheus/node-exporter/bcd.prom"   # node_exporter's textfile

    [attestors.serial-allowlist]                   # optional; an attestor plugin's own table,
    serial_field = "board_serial"                  # whose keys and values that plugin checks

Every problem is a :class:`~bcd.errors.ConfigError` whose message names the file and
the key: a missing file, bad TOML, an unknown key, a missing key, a wrong type, a
malformed pin (a malformed pin stops bcd from starting), a gateway URL that is not
``https://host[:port]``. One function builds a Config from a table,
:func:`config_from_table` (pure): :func:`parse_config` is ``tomllib`` and it, the
``--server`` bootstrap and the install script's renderer build a table and call it.
Only :func:`load_config` reads the file, and only a regular file of at most 64 KiB,
judged before a byte is read (a FIFO or ``/dev/zero`` is refused, never waited on or
read). The file is written by **tomli-w** (:func:`render_config` of
:func:`config_table`), never by hand or by ``json.dumps`` (whose ``\ud83d\ude00``
for a character beyond the BMP ``tomllib`` refuses).

``gateway_url`` is kept without a trailing ``/``. The join-encryption key the install
script writes lives beside the file (:func:`join_encryption_jwk_path`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pwd
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import tomli_w

from bcd import fs, pki
from bcd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/bcd/config.toml")
DEFAULT_DATA_DIR = Path("/var/lib/bcd")
DEFAULT_GATEWAY_PORT = 443
DEFAULT_TCTI = "device:/dev/tpmrm0"
DEFAULT_HELPER_USER = "bcd"
DEFAULT_HELPER_SOCKET = Path("/run/bcd-helper/helper.sock")
DEFAULT_HOSTCONFIG_DIR = Path("/var/lib/bcd-hostconfig")
JOIN_ENCRYPTION_JWK_NAME = "join-encryption.jwk"
MAX_CONFIG_BYTES = 64 * 1024

TpmMode = Literal["auto", "off", "required"]
TPM_MODES: tuple[TpmMode, ...] = ("auto", "off", "required")
PIN_KEYS = ("serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin")
REQUIRED_KEYS = ("gateway_url", "site", *PIN_KEYS)
TOP_LEVEL_KEYS = (
    *REQUIRED_KEYS,
    "server_name",
    "data_dir",
    "helper",
    "tpm",
    "metrics",
    "attestors",
)
HELPER_KEYS = ("user", "socket", "hostconfig_dir")
TPM_KEYS = ("mode", "tcti")
METRICS_KEYS = ("textfile",)
MAX_PATH_BYTES = 4095  # PATH_MAX less the NUL
MAX_NAME_BYTES = 255  # NAME_MAX

_SITE_ID = re.compile(r"^site_[0-9a-z]{26}$")
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^{_DNS_LABEL}(?:\.{_DNS_LABEL})*$")
_NETLOC = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")


@dataclass(frozen=True, slots=True)
class HelperConfig:
    """The ``[helper]`` table: bcd node runs unprivileged beside a root bcd helper."""

    user: str = DEFAULT_HELPER_USER
    socket: Path = DEFAULT_HELPER_SOCKET
    hostconfig_dir: Path = DEFAULT_HOSTCONFIG_DIR


@dataclass(frozen=True, slots=True)
class TpmConfig:
    """The ``[tpm]`` table."""

    mode: TpmMode = "auto"
    tcti: str = DEFAULT_TCTI


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The ``[metrics]`` table: ``textfile``, a node_exporter textfile bcd node writes
    (:mod:`bcd.nodemetrics`); absent, bcd node writes no metrics."""

    textfile: Path | None = None


@dataclass(frozen=True, slots=True)
class Config:
    """A validated config.toml. ``path`` is the file it came from (or will go to)."""

    path: Path
    gateway_url: str
    site: str
    serving_ca_spki_pin: str
    join_signing_key_pin: str
    join_encryption_key_pin: str
    server_name: str
    data_dir: Path = DEFAULT_DATA_DIR
    helper: HelperConfig | None = None
    tpm: TpmConfig = field(default_factory=TpmConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    attestor_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """``[attestors.<name>]``: each attestor plugin's own table, checked by that plugin
    (``bcd_node_check_settings``) and lent to it as ``NodeJoinContext.settings``."""


# --- reading ----------------------------------------------------------------------


def load_config(path: Path, *, check_attestors: bool = False) -> Config:
    """Read and validate the configuration at ``path``.

    ``check_attestors`` has each attestor plugin judge its ``[attestors.<name>]``
    table (``bcd join`` and ``bcd doctor``): that loads every plugin, so the long-running
    agents (``bcd helper``, ``bcd node``) and ``bcd vouch`` check only the table's shape.
    """
    try:
        data = fs.read_regular_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"no configuration at {path}; run the install script, or bcd join --server "
            "with --serving-ca-pin, --join-signing-pin and --join-encryption-pin"
        ) from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{path}: is a directory, not a configuration file") from exc
    except fs.NotRegularFile as exc:
        raise ConfigError(
            f"{path}: is {exc.kind}, not a regular file; bcd reads its configuration only "
            "from a regular file (nothing was read)"
        ) from exc
    except fs.FileTooLarge as exc:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    _check_writers(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8") from exc
    return parse_config(text, path, check_attestors=check_attestors)


def _check_writers(path: Path) -> None:
    """config.toml holds the pins that decide what bcd trusts (the gateway, join answers,
    revocation notices): only root or the user running bcd may be able to change it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    problem = fs.writers_problem(path, st, "it holds the pins bcd trusts")
    if problem is not None:
        raise ConfigError(problem)


def parse_config(text: str, path: Path, *, check_attestors: bool = False) -> Config:
    """Validate config.toml text; ``path`` names the file in messages and in the result."""
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return config_from_table(doc, path, check_attestors=check_attestors)


def config_from_table(doc: dict[str, Any], path: Path, *, check_attestors: bool = False) -> Config:
    """The one way to a :class:`Config`: validate a table (parsed TOML, or one a caller
    built, such as the ``--server`` bootstrap's); ``path`` names the file in messages."""
    _check_keys(doc, TOP_LEVEL_KEYS, path, "")
    for key in REQUIRED_KEYS:
        if key not in doc:
            raise ConfigError(f'{path}: missing key "{key}"')

    gateway_url, host = _gateway_url(_string(doc, "gateway_url", path), path)
    site = _string(doc, "site", path)
    if not _SITE_ID.fullmatch(site):
        raise ConfigError(f'{path}: "site" is not a site id (site_ and 26 characters)')
    pins = {key: _pin(doc, key, path) for key in PIN_KEYS}

    server_name = host
    if "server_name" in doc:
        server_name = _string(doc, "server_name", path)
        if not _valid_host(server_name):
            raise ConfigError(f'{path}: "server_name" is not a host name')

    data_dir = DEFAULT_DATA_DIR
    if "data_dir" in doc:
        data_dir = _abs_path(doc, "data_dir", path, "data_dir")

    helper: HelperConfig | None = None
    if "helper" in doc:
        table = _table(doc, "helper", path)
        _check_keys(table, HELPER_KEYS, path, "helper.")
        user = DEFAULT_HELPER_USER
        if "user" in table:
            user = _string(table, "user", path, "helper.user")
            if not _USER.fullmatch(user):
                raise ConfigError(f'{path}: "helper.user" is not a user name')
        socket = DEFAULT_HELPER_SOCKET
        if "socket" in table:
            socket = _abs_path(table, "socket", path, "helper.socket")
        hostconfig_dir = DEFAULT_HOSTCONFIG_DIR
        if "hostconfig_dir" in table:
            hostconfig_dir = _abs_path(table, "hostconfig_dir", path, "helper.hostconfig_dir")
        helper = HelperConfig(user=user, socket=socket, hostconfig_dir=hostconfig_dir)

    tpm = TpmConfig()
    if "tpm" in doc:
        table = _table(doc, "tpm", path)
        _check_keys(table, TPM_KEYS, path, "tpm.")
        mode: TpmMode = "auto"
        if "mode" in table:
            raw_mode = _string(table, "mode", path, "tpm.mode")
            if raw_mode not in TPM_MODES:
                raise ConfigError(f'{path}: "tpm.mode" must be auto, off or required')
            mode = raw_mode
        tcti = DEFAULT_TCTI
        if "tcti" in table:
            tcti = _string(table, "tcti", path, "tpm.tcti")
        tpm = TpmConfig(mode=mode, tcti=tcti)

    metrics = MetricsConfig()
    if "metrics" in doc:
        table = _table(doc, "metrics", path)
        _check_keys(table, METRICS_KEYS, path, "metrics.")
        if "textfile" in table:
            metrics = MetricsConfig(textfile=_textfile(table, path))

    return Config(
        path=path,
        gateway_url=gateway_url,
        site=site,
        serving_ca_spki_pin=pins["serving_ca_spki_pin"],
        join_signing_key_pin=pins["join_signing_key_pin"],
        join_encryption_key_pin=pins["join_encryption_key_pin"],
        server_name=server_name,
        data_dir=data_dir,
        helper=helper,
        tpm=tpm,
        metrics=metrics,
        attestor_settings=_attestor_settings(doc, path, check_attestors),
    )


def _attestor_settings(doc: dict[str, Any], path: Path, check: bool) -> dict[str, dict[str, Any]]:
    """``[attestors]``: a table per attestor. With ``check`` each is judged by its plugin
    (bcd.plugins, imported only then); otherwise only the shape is checked, importing
    nothing, so a plugin that fails to import cannot stop an agent that does not use it."""
    if "attestors" not in doc:
        return {}
    tables = _table(doc, "attestors", path)
    if check:
        from bcd.plugins import node_settings_problem

        problem = node_settings_problem(tables)
        if problem is not None:
            raise ConfigError(f"{path}: {problem}")
    for name, table in tables.items():
        if not isinstance(table, dict):
            shown = json.dumps(str(name)[:64], ensure_ascii=True)[1:-1]
            raise ConfigError(f'{path}: "attestors.{shown}" must be a table ([attestors.{shown}])')
    return {name: dict(table) for name, table in tables.items()}


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], path: Path, prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{path}: unknown key {_quote(prefix + key)}")


def _quote(key: str) -> str:
    """A key as it appears in a message: quoted, with anything unprintable escaped."""
    escaped = "".join(
        c if c.isprintable() and c not in '"\\' else c.encode("unicode_escape").decode("ascii")
        for c in key[:64]
    )
    return f'"{escaped}"' + ("…" if len(key) > 64 else "")


def _string(table: dict[str, Any], key: str, path: Path, name: str | None = None) -> str:
    value = table[key]
    name = name or key
    if not isinstance(value, str):
        raise ConfigError(f'{path}: "{name}" must be a string')
    if not value:
        raise ConfigError(f'{path}: "{name}" must not be empty')
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):  # a built table: no TOML has these
        raise ConfigError(f'{path}: "{name}" is not valid UTF-8')
    return value


def _table(table: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = table[key]
    if not isinstance(value, dict):
        raise ConfigError(f'{path}: "{key}" must be a table ([{key}])')
    return value


def _pin(table: dict[str, Any], key: str, path: Path) -> str:
    value = table[key]
    try:
        return pki.parse_pin(value)
    except pki.PkiError as exc:
        raise ConfigError(f'{path}: "{key}" is malformed: {exc}') from exc


def _abs_path(table: dict[str, Any], key: str, path: Path, name: str) -> Path:
    value = _string(table, key, path, name)
    if "\0" in value or not value.startswith("/"):
        raise ConfigError(f'{path}: "{name}" must be an absolute path')
    return Path(value)


def _textfile(table: dict[str, Any], path: Path) -> Path:
    """``metrics.textfile``: an absolute path of a ``*.prom`` file (the only names
    node_exporter's textfile collector reads), without ``.`` or ``..`` parts, control
    characters or a name longer than the file system allows."""
    name = "metrics.textfile"
    value = _abs_path(table, "textfile", path, name)
    text = str(table["textfile"])
    if any(not c.isprintable() for c in text):
        raise ConfigError(f'{path}: "{name}" must not hold control characters')
    if len(text.encode("utf-8")) > MAX_PATH_BYTES:
        raise ConfigError(f'{path}: "{name}" is longer than {MAX_PATH_BYTES} bytes')
    parts = text.split("/")[1:]
    if any(part in (".", "..") for part in parts) or text.endswith("/"):
        raise ConfigError(f'{path}: "{name}" must name a file, without . or .. parts')
    if not value.name.endswith(".prom") or value.name == ".prom":
        raise ConfigError(
            f'{path}: "{name}" must end in .prom (node_exporter reads only *.prom files)'
        )
    if any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        raise ConfigError(f'{path}: "{name}" has a part longer than {MAX_NAME_BYTES} bytes')
    return Path(text)


def _valid_host(host: str) -> bool:
    if _DNS_NAME.fullmatch(host) and len(host) <= 253:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _gateway_url(url: str, path: Path) -> tuple[str, str]:
    """Check ``https://host[:port][/]``; return the URL without a trailing / and the host."""
    bad = f'{path}: "gateway_url" must be https://host or https://host:port'
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(bad)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(bad) from exc
    if parts.scheme != "https" or not url.lower().startswith("https://"):
        raise ConfigError(f'{path}: "gateway_url" must start with https://')
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in url or "#" in url:
        raise ConfigError(f'{path}: "gateway_url" must name only a host and port, no path')
    m = _NETLOC.fullmatch(parts.netloc)
    if not m:
        raise ConfigError(bad)
    host = m.group(1)
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ConfigError(bad) from exc
    elif not _valid_host(host):
        raise ConfigError(bad)
    if m.group(2) is not None and not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f'{path}: "gateway_url" has a port outside 1-65535')
    return url.rstrip("/"), host


# --- derived values ---------------------------------------------------------------


def gateway_host_port(cfg: Config) -> tuple[str, int]:
    """The gateway's host (IPv6 without brackets) and port (443 by default)."""
    m = _NETLOC.fullmatch(urlsplit(cfg.gateway_url).netloc)
    assert m is not None, "a Config holds a validated gateway_url"
    host = m.group(1)
    if host.startswith("["):
        host = host[1:-1]
    return host, int(m.group(2)) if m.group(2) else DEFAULT_GATEWAY_PORT


def join_encryption_jwk_path(cfg: Config) -> Path:
    """``join-encryption.jwk`` beside the config file."""
    return cfg.path.parent / JOIN_ENCRYPTION_JWK_NAME


def trusted_owners(cfg: Config) -> frozenset[int]:
    """The uids that may own the data directory and its files (bcd.identity checks them).

    Root, the user running bcd and, under ``[helper]``, the helper user (the join
    hands identity.json and node.key to it, and systemd's ``StateDirectory=`` gives it
    the directory). A helper user that does not exist adds nothing.
    """
    owners = {0, os.geteuid()}
    if cfg.helper is not None:
        with contextlib.suppress(KeyError):
            owners.add(pwd.getpwnam(cfg.helper.user).pw_uid)
    return frozenset(owners)


# --- writing ----------------------------------------------------------------------


def config_table(cfg: Config) -> dict[str, Any]:
    """The table :func:`config_from_table` reads back to ``cfg``.

    Values equal to their defaults are left out, so the file stays short; a present
    ``[helper]`` is written whole.
    """
    host, _ = gateway_host_port(cfg)
    table: dict[str, Any] = {
        "gateway_url": cfg.gateway_url,
        "site": cfg.site,
        **{key: getattr(cfg, key) for key in PIN_KEYS},
    }
    if cfg.server_name != host:
        table["server_name"] = cfg.server_name
    if cfg.data_dir != DEFAULT_DATA_DIR:
        table["data_dir"] = str(cfg.data_dir)
    if cfg.helper is not None:
        table["helper"] = {
            "user": cfg.helper.user,
            "socket": str(cfg.helper.socket),
            "hostconfig_dir": str(cfg.helper.hostconfig_dir),
        }
    if cfg.tpm != TpmConfig():
        table["tpm"] = {"mode": cfg.tpm.mode, "tcti": cfg.tpm.tcti}
    if cfg.metrics.textfile is not None:
        table["metrics"] = {"textfile": str(cfg.metrics.textfile)}
    if cfg.attestor_settings:
        table["attestors"] = {name: dict(t) for name, t in cfg.attestor_settings.items()}
    return table


def render_config(cfg: Config) -> str:
    """TOML text for ``cfg`` (written by tomli-w) that :func:`parse_config` reads back to
    an equal Config."""
    return "# bcd configuration (PROTOCOL.md, config.toml)\n" + tomli_w.dumps(config_table(cfg))
