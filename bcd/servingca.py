"""``serving-ca.pem``: the serving CA certificate, the node's only TLS trust anchor.

It sits beside ``config.toml`` (mode 0644, written atomically by ``install-bcd.sh``
and by the ``bcd join --server`` bootstrap) and must be the one certificate whose
SPKI pin is ``serving_ca_spki_pin``; anything else is a :class:`ConfigError` when it
is loaded. A node installed before the file existed fetches it once: a certless
handshake reads the chain the gateway presents, :func:`bcd.tls.verify_server_chain`
checks it against the pin as before, and the certificate carrying the pin is the
anchor (:func:`bcd.tls.probe_anchor`). It is written beside ``config.toml`` when
that directory is writable (``bcd join`` as root) and otherwise kept in memory for
the life of the process (``bcd node`` as the ``bcd`` user: it probes once per start,
as safe as the file since the pin decides).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from bcd import fs
from bcd.config import Config, gateway_host_port
from bcd.errors import ConfigError, JoinError
from bcd.tls import Anchor, anchor_of, probe_anchor

log = logging.getLogger("bcd.servingca")

SERVING_CA_NAME = "serving-ca.pem"
MAX_PEM_BYTES = 64 * 1024

_known: dict[tuple[str, str], Anchor] = {}
"""Anchors checked in this process, by (config file, pin)."""


def serving_ca_path(cfg: Config) -> Path:
    """``serving-ca.pem`` beside the config file."""
    return cfg.path.parent / SERVING_CA_NAME


def _check_writers(path: Path) -> Callable[[os.stat_result], None]:
    """Like config.toml's: the anchor decides which gateway the node trusts, so only
    root or the user running bcd may be able to change it."""

    def judge(st: os.stat_result) -> None:
        problem = fs.writers_problem(path, st, "it is the serving CA bcd trusts", "0644")
        if problem is not None:
            raise ConfigError(problem)

    return judge


def read_anchor(path: Path, pin: str) -> Anchor | None:
    """The anchor in ``path`` checked against ``pin``; None when there is no file.

    Read as config.toml is: never through a symlink, and refused when anyone but root
    or this user owns it or when group or others may write it.
    """
    try:
        data = fs.read_regular_file(path, MAX_PEM_BYTES, follow=False, judge=_check_writers(path))
    except FileNotFoundError:
        return None
    except fs.NotRegularFile as exc:
        raise ConfigError(f"{path}: is {exc.kind}, not a regular file") from exc
    except fs.FileTooLarge as exc:
        raise ConfigError(f"{path}: larger than {MAX_PEM_BYTES} bytes") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from exc
    try:
        # its dates are not judged here: a stale one is replaced on the first dial
        return anchor_of(data.decode("ascii", "replace"), pin, check_dates=False)
    except ValueError as exc:
        raise ConfigError(
            f"{path}: {exc}; it must be the serving CA certificate whose SPKI pin is "
            "serving_ca_spki_pin (run the install script again, or remove the file and bcd "
            "fetches it from the gateway, checked against the pin)"
        ) from exc


def accept_published(cfg: Config, pem: object, server: str) -> Anchor | None:
    """The well-known document's ``gateway.servingCaPem``, checked against the pin.

    Held in memory for this process (the bootstrap's join uses it; :func:`save`
    writes it beside the new config.toml). None when the document has none (a control
    plane from before it was published: the join then probes).
    """
    if pem is None:
        return None
    try:
        if not isinstance(pem, str):
            raise ValueError("it is not a string")
        anchor = anchor_of(pem, cfg.serving_ca_spki_pin)
    except ValueError as exc:
        raise JoinError(
            f"the serving CA certificate published by {server} does not match "
            f"serving_ca_spki_pin ({exc}); the document is not trusted"
        ) from exc
    _known[(str(cfg.path), cfg.serving_ca_spki_pin)] = anchor
    return anchor


def save(cfg: Config) -> None:
    """Write the anchor held for ``cfg`` as ``serving-ca.pem`` (0644, atomic), if any."""
    anchor = _known.get((str(cfg.path), cfg.serving_ca_spki_pin))
    if anchor is not None:
        fs.atomic_write(serving_ca_path(cfg), anchor.pem.encode("ascii"), 0o644)


async def serving_ca(cfg: Config) -> Anchor:
    """The serving CA for ``cfg``: checked once per process, from the file or the gateway."""
    key = (str(cfg.path), cfg.serving_ca_spki_pin)
    anchor = _known.get(key)
    if anchor is not None:
        return anchor
    path = serving_ca_path(cfg)
    anchor = read_anchor(path, cfg.serving_ca_spki_pin)
    if anchor is None:
        host, port = gateway_host_port(cfg)
        anchor = await probe_anchor(host, port, cfg.server_name, cfg.serving_ca_spki_pin)
        _store(cfg, path, anchor)
    _known[key] = anchor
    return anchor


def replace_stale(cfg: Config, anchor: Anchor) -> None:
    """The stored anchor is stale: OpenSSL refused the gateway's chain, which verifies
    against the pin (the CA re-certified with the same key). ``anchor`` is the presented
    certificate carrying the pin (it passed :func:`bcd.tls.anchor_of`): it replaces the
    one held in memory and, when it can be written, ``serving-ca.pem``."""
    path = serving_ca_path(cfg)
    log.warning(
        "%s is stale: the gateway presents a serving CA certificate with the pinned key "
        "(serving_ca_spki_pin) that is valid now; using it instead",
        path,
    )
    _known[(str(cfg.path), cfg.serving_ca_spki_pin)] = anchor
    _store(cfg, path, anchor)


def _store(cfg: Config, path: Path, anchor: Anchor) -> None:
    if not cfg.path.is_file():  # a bootstrap before its config.toml: save() writes it
        return
    try:
        fs.atomic_write(path, anchor.pem.encode("ascii"), 0o644)
    except OSError as exc:
        log.info(
            "the serving CA certificate came from the gateway (checked against "
            "serving_ca_spki_pin); %s cannot be written (%s), so it is held in memory",
            path,
            exc.strerror or type(exc).__name__,
        )
        return
    log.info("wrote %s (the serving CA, checked against serving_ca_spki_pin)", path)


def forget() -> None:
    """Drop the anchors held in memory (tests)."""
    _known.clear()
