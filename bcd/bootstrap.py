"""``bcd join --server``: the well-known document, the configuration built from it, and
the join encryption key (PROTOCOL.md, "config.toml"; seed 003, "Bootstrap").

Without a config.toml, ``bcd join --server URL`` with the three pins from the install
fetches the control plane's well-known document, checks that it publishes the same
pins, and builds the configuration from its gateway section
(:func:`bootstrap_config`, through :func:`bcd.config.config_from_table` as a file
is). Only once the join succeeded are config.toml (tomli-w), join-encryption.jwk and
serving-ca.pem (the document's ``gateway.servingCaPem``, checked against
``serving_ca_spki_pin``) written (:func:`write_bootstrap`). The join encryption key comes from
join-encryption.jwk beside config.toml (:func:`encryption_key_from_file`) or from the
document (:func:`key_from_document`), both checked against ``join_encryption_key_pin``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from bcd import fs, pki, servingca, wire
from bcd.config import Config, config_from_table, join_encryption_jwk_path, render_config
from bcd.errors import JoinError, UsageError

WELL_KNOWN = "/.well-known/better-compute"
BASE_PATH = "/api/compute"
SITE_PLACEHOLDER = "site_" + "0" * 26  # the bootstrap's, until the join names the site
PIN_FLAGS = {
    "serving_ca_spki_pin": "--serving-ca-pin",
    "join_signing_key_pin": "--join-signing-pin",
    "join_encryption_key_pin": "--join-encryption-pin",
}


def _well_known_url(server: str) -> str:
    parsed = urllib.parse.urlsplit(server)
    if parsed.scheme not in ("https", "http") or not parsed.hostname:
        raise UsageError("--server must be the control plane's https:// (or http://) URL")
    base = server.rstrip("/")
    if not parsed.path.rstrip("/").endswith(BASE_PATH):
        base += BASE_PATH
    return base + WELL_KNOWN


async def fetch_well_known(server: str) -> dict[str, Any]:
    from bcd.gatewayclient import fetch_url  # httpx only when the document is fetched

    resp = await fetch_url(_well_known_url(server))
    if resp.status != 200:
        raise JoinError(f"{server} has no well-known document (HTTP {resp.status})")
    try:
        return wire.loads_object(resp.body)
    except wire.WireError as exc:
        raise JoinError(f"the well-known document of {server} is not JSON") from exc


def bootstrap_config(
    doc: dict[str, Any],
    *,
    server: str,
    config: Path,
    pins: Mapping[str, str | None],
    data_dir: Path | None = None,
) -> Config:
    """A config built from the well-known document's gateway section and the pin flags.

    ``pins`` are the flags' values by config key (:data:`PIN_FLAGS`). The table goes
    through :func:`bcd.config.config_from_table`, as a parsed file does; once joined
    it is written with tomli-w (:func:`write_bootstrap`).
    """
    missing = [
        PIN_FLAGS[name] for name, value in ((key, pins[key]) for key in PIN_FLAGS) if not value
    ]
    if missing:
        raise UsageError(
            f"without {config} a join with --server needs the pins from the install: "
            + ", ".join(missing)
        )
    for name, value in ((key, pins[key]) for key in PIN_FLAGS):
        try:
            pki.parse_pin(value)
        except pki.PkiError as exc:
            raise UsageError(f"{PIN_FLAGS[name]}: {exc}") from exc
    gateway = doc.get("gateway")
    if not isinstance(gateway, dict) or not isinstance(gateway.get("url"), str):
        raise JoinError(
            f"{server} publishes no gateway section: its better-compute serve runs without "
            "--gateway-url; give serve --gateway-url https://NAME[:PORT] (the address nodes "
            f"dial), or write {config} instead"
        )
    published = {
        "serving_ca_spki_pin": gateway.get("servingCaPin"),
        "join_signing_key_pin": (doc.get("join") or {}).get("signingKeyPin"),
        "join_encryption_key_pin": (doc.get("join") or {}).get("encryptionKeyPin"),
    }
    for name, value in ((key, pins[key]) for key in PIN_FLAGS):
        seen = published[name]
        if not isinstance(seen, str) or not pki.pins_equal(seen, value or ""):
            raise JoinError(
                f"the well-known document of {server} has another {name} than the one "
                "given; refusing it"
            )
    table: dict[str, Any] = {
        "gateway_url": gateway["url"],
        "site": SITE_PLACEHOLDER,
        **{key: pins[key] for key in PIN_FLAGS},
    }
    if isinstance(gateway.get("serverName"), str):
        table["server_name"] = gateway["serverName"]
    if data_dir:
        table["data_dir"] = str(data_dir.absolute())
    cfg = config_from_table(table, config)
    # gateway.servingCaPem, checked against the pin: the join's trust anchor, and
    # serving-ca.pem once joined (bcd.servingca)
    servingca.accept_published(cfg, gateway.get("servingCaPem"), server)
    return cfg


def encryption_key_from_file(cfg: Config) -> ec.EllipticCurvePublicKey | None:
    path = join_encryption_jwk_path(cfg)
    rotated = (
        f"{path} does not match join_encryption_key_pin (was the join key rotated?); "
        "generate the install script again and rerun it, which rewrites the file and the pins"
    )
    try:
        raw = fs.read_regular_file(path, 4096)
    except FileNotFoundError:
        return None
    except fs.NotRegularFile as exc:
        raise JoinError(
            f"{path} is {exc.kind}, not a regular file (nothing was read); "
            "generate the install script again and rerun it, which rewrites the file"
        ) from exc
    except fs.FileTooLarge as exc:
        raise JoinError(rotated) from exc
    except OSError as exc:
        raise JoinError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        key = wire.public_key_of_jwk(wire.loads_object(raw, 4096))
    except wire.WireError as exc:
        raise JoinError(rotated) from exc
    if not pki.pins_equal(pki.spki_pin(key), cfg.join_encryption_key_pin):
        raise JoinError(rotated)
    return key


def key_from_document(doc: dict[str, Any], pin: str, server: str) -> ec.EllipticCurvePublicKey:
    join_section = doc.get("join")
    if not isinstance(join_section, dict):
        raise JoinError(f"{server} publishes no join section (is pki.join configured?)")
    try:
        key = wire.public_key_of_jwk(join_section.get("encryptionJwk"))
    except wire.WireError as exc:
        raise JoinError(f"the join encryption key published by {server} does not parse") from exc
    if not pki.pins_equal(pki.spki_pin(key), pin):
        raise JoinError(
            f"the join encryption key published by {server} does not match "
            "join_encryption_key_pin; the document is not trusted"
        )
    return key


def write_bootstrap(cfg: Config, site_id: str, encryption_key: ec.EllipticCurvePublicKey) -> None:
    """Once joined: config.toml (the site the join named) and join-encryption.jwk."""
    written = replace(cfg, site=site_id)
    fs.ensure_dir(written.path.parent, 0o755)
    fs.atomic_write(written.path, render_config(written).encode(), 0o644)
    fs.atomic_write(
        join_encryption_jwk_path(written), wire.dumps(wire.public_jwk_of(encryption_key)), 0o644
    )
    servingca.save(written)
