"""``better-compute daemon install-script``: render install-bcd.sh for one pool and site.

The template is ``control/install-bcd.sh`` (the repository's ``install-bcd.sh`` links
to it); its line ``# @@RENDERED@@`` is replaced by shell assignments: the bcd version,
the control plane's base URL and base path, the pool and site, the SHA-256 of each
architecture's artifact, the text of ``/etc/bcd/config.toml`` (built with
:func:`bcd.config.config_from_table`, written by tomli-w in
:func:`bcd.config.render_config` and read back with :func:`bcd.config.parse_config`,
so the script never writes a configuration bcd would refuse), the join encryption
key as a public JWK, and the serving CA certificate (``serving-ca.pem``, checked
against ``serving_ca_spki_pin``).

Every input is validated first (:class:`InstallScriptError`, one line naming the
flag); values are then single-quoted for the shell (:func:`sh_quote`), so nothing an
operator passes can run as code in the script even if a check were too lax.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from bcd import pki as bcd_pki
from bcd import wire
from bcd.config import (
    DEFAULT_CONFIG_PATH,
    HelperConfig,
    config_from_table,
    parse_config,
    render_config,
)
from bcd.errors import ConfigError
from bcd.tls import anchor_of

MARKER = "# @@RENDERED@@\n"
TEMPLATE = "install-bcd.sh"
BASE_PATH = "/api/compute"
ARCHES = ("amd64", "arm64")
_ID = {"pool": re.compile(r"^pool_[0-9a-z]{26}$"), "site": re.compile(r"^site_[0-9a-z]{26}$")}
_VERSION = re.compile(
    r"^[0-9]{1,6}\.[0-9]{1,6}\.[0-9]{1,6}(?:[-+][0-9A-Za-z]{1,20}(?:\.[0-9A-Za-z]{1,20}){0,4})?$"
)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")


class InstallScriptError(ValueError):
    """An input the script cannot be rendered with; the message names the flag."""


@dataclass(frozen=True, slots=True)
class ScriptValues:
    """Everything the rendered script carries, validated."""

    pool: str
    site: str
    gateway_url: str
    base_url: str
    bcd_version: str
    sha256: dict[str, str]
    config_toml: str
    join_jwk: str
    serving_ca_pem: str = ""


def sh_quote(value: str) -> str:
    """``value`` as one single-quoted POSIX shell word (a ``'`` becomes ``'\\''``)."""
    if "\0" in value:
        raise InstallScriptError("a value holds a NUL character")
    return "'" + value.replace("'", "'\\''") + "'"


def parse_sha256(text: str) -> dict[str, str]:
    """``amd64=HEX,arm64=HEX`` (one or both) into {arch: lower-case hex}."""
    out: dict[str, str] = {}
    for item in text.split(","):
        arch, sep, digest = item.strip().partition("=")
        if not sep:
            raise InstallScriptError(f"--sha256: expected ARCH=HEX, got {item.strip()!r}")
        if arch not in ARCHES:
            raise InstallScriptError(f"--sha256: unknown architecture {arch!r} (amd64 or arm64)")
        if arch in out:
            raise InstallScriptError(f"--sha256: {arch} is given twice")
        digest = digest.strip().lower()
        if not _SHA256.match(digest):
            raise InstallScriptError(f"--sha256 {arch}: not a SHA-256 (64 hexadecimal characters)")
        out[arch] = digest
    return out


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_base_url(url: str) -> str:
    """``https://host[:port]`` (``http://`` only for a loopback host), without a trailing /."""
    if any(c.isspace() or ord(c) < 0x20 for c in url) or len(url) > 300:
        raise InstallScriptError("--base-url: not a URL")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise InstallScriptError("--base-url: the port is not a number from 1 to 65535") from None
    host = parts.hostname or ""
    if parts.scheme not in ("https", "http") or not host:
        raise InstallScriptError("--base-url: must be https://host[:port]")
    if parts.scheme == "http" and not _loopback(host):
        raise InstallScriptError(
            "--base-url: http:// is allowed only for a loopback address; use https://"
        )
    if parts.username or parts.password or parts.query or parts.fragment:
        raise InstallScriptError("--base-url: no user, query or fragment")
    if parts.path not in ("", "/") or port == 0:
        raise InstallScriptError(
            f"--base-url: scheme, host and port only (the base path {BASE_PATH} is added)"
        )
    netloc = parts.netloc
    if not _HOST.match(netloc.rsplit(":", 1)[0] if port is not None else netloc):
        raise InstallScriptError("--base-url: not a valid host name")
    return f"{parts.scheme}://{netloc}"


def build_values(
    *,
    pool: str,
    site: str,
    gateway_url: str,
    base_url: str,
    bcd_version: str,
    sha256: str,
    pins: dict[str, str],
    join_jwk: dict[str, object],
    server_name: str | None = None,
    serving_ca_pem: str | None = None,
) -> ScriptValues:
    """Validate the inputs and build the config.toml text; raise InstallScriptError."""
    for flag, value in (("pool", pool), ("site", site)):
        if not _ID[flag].match(value):
            raise InstallScriptError(f"--{flag}: not a {flag} id ({flag}_ and 26 characters)")
    if not _VERSION.match(bcd_version):
        raise InstallScriptError("--bcd-version: not a version like 1.2.3 or 1.2.3-rc.1")
    digests = parse_sha256(sha256)
    base = check_base_url(base_url)
    key = wire.public_key_of_jwk(join_jwk)
    if not bcd_pki.pins_equal(bcd_pki.spki_pin(key), pins["join_encryption_key_pin"]):
        raise InstallScriptError("the PKI's join encryption key does not match its own pin")
    anchor = ""
    if serving_ca_pem is not None:
        try:
            anchor = anchor_of(serving_ca_pem, pins["serving_ca_spki_pin"]).pem
        except ValueError as exc:
            raise InstallScriptError(f"the PKI's serving CA certificate: {exc}") from exc
    table: dict[str, object] = {"gateway_url": gateway_url, "site": site, **pins}
    if server_name is not None:
        table["server_name"] = server_name
    try:
        parsed = config_from_table(table, DEFAULT_CONFIG_PATH)
    except ConfigError as exc:
        message = str(exc).replace(f"{DEFAULT_CONFIG_PATH}: ", "")
        flag = "--server-name" if "server_name" in message else "--gateway-url"
        raise InstallScriptError(f"{flag}: {message}") from exc
    # [helper]: bcd node runs as the unprivileged bcd user, bcd helper (root) holds the TPM.
    cfg = replace(parsed, helper=HelperConfig())
    text = render_config(cfg)
    if parse_config(text, DEFAULT_CONFIG_PATH) != cfg:  # pragma: no cover - render's contract
        raise InstallScriptError("the configuration does not read back the same")
    return ScriptValues(
        pool=pool,
        site=site,
        gateway_url=cfg.gateway_url,
        base_url=base,
        bcd_version=bcd_version,
        sha256=digests,
        config_toml=text,
        join_jwk=wire.dumps(wire.public_jwk_of(key)).decode("ascii"),
        serving_ca_pem=anchor.rstrip("\n"),
    )


def template() -> str:
    return (resources.files("control") / TEMPLATE).read_text(encoding="utf-8")


def render(values: ScriptValues, text: str | None = None) -> str:
    """install-bcd.sh with ``values`` in place of the marker line."""
    text = template() if text is None else text
    if text.count(MARKER) != 1:
        raise InstallScriptError(f"the template {TEMPLATE} has no single {MARKER.strip()} line")
    assignments = [
        "# Rendered by better-compute daemon install-script; edit the flags, not this block.",
        f"BCD_VERSION={sh_quote(values.bcd_version)}",
        f"BASE_URL={sh_quote(values.base_url)}",
        f"BASE_PATH={sh_quote(BASE_PATH)}",
        f"POOL={sh_quote(values.pool)}",
        f"SITE={sh_quote(values.site)}",
        f"GATEWAY_URL={sh_quote(values.gateway_url)}",
        *(f"SHA256_{arch.upper()}={sh_quote(values.sha256.get(arch, ''))}" for arch in ARCHES),
        f"CONFIG_TOML={sh_quote(values.config_toml)}",
        f"JOIN_JWK={sh_quote(values.join_jwk)}",
        f"SERVING_CA_PEM={sh_quote(values.serving_ca_pem)}",
    ]
    return text.replace(MARKER, "\n".join(assignments) + "\n")


def write_script(path: Path, script: str) -> None:
    from bcd import fs

    fs.atomic_write(path, script.encode("utf-8"), 0o755)
