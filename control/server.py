"""``better-compute serve``: the tenant API and the gateway in one trio process."""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from attestors.discovery import check_settings as check_discovery_settings
from bcd import fs
from bcd.plugins import load_plugins
from bcd.systemd import under_journald
from control import pki
from control.api import App
from control.errors import ControlError
from control.gateway import Gateway
from control.http import serve
from control.joinservice import CERT_TTL_MAX_S, JoinCrypto, JoinService
from control.renewal import RenewService
from control.store import open_store

log = logging.getLogger("control.server")


def join_crypto(loaded: pki.Pki, cert_ttl_s: int = CERT_TTL_MAX_S) -> JoinCrypto:
    return JoinCrypto(
        trust_domain=loaded.trust_domain,
        signing_key=loaded.join_signing_key,
        encryption_key=loaded.join_encryption_key,
        issue_leaf=functools.partial(pki.issue_node_leaf, loaded),
        chain_tail_pem=loaded.chain_tail_pem(),
        bundle_pem=loaded.bundle_pem(),
        trust_version=loaded.trust_version,
        cert_ttl_s=cert_ttl_s,
    )


def check_tpm_settings(settings: Mapping[str, str]) -> None:
    """Fail at start, not at the first join, when the tpm attestor's files are unusable."""
    ca = settings.get("tpm.ek_ca")
    if ca:
        try:
            certs = x509.load_pem_x509_certificates(Path(ca).read_bytes())
        except (OSError, ValueError) as exc:
            raise ControlError(
                "INVALID_CONFIG", f"--tpm-ek-ca {ca}: not a readable PEM certificate bundle"
            ) from exc
        if not certs:  # pragma: no cover - load_pem_x509_certificates refuses an empty file
            raise ControlError("INVALID_CONFIG", f"--tpm-ek-ca {ca}: no certificate")
    allow = settings.get("tpm.ek_allow")
    if allow:
        try:
            Path(allow).read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ControlError("INVALID_CONFIG", f"--tpm-ek-allow {allow}: not readable") from exc
    if (ca or allow) and not settings.get("tpm.pool"):
        raise ControlError("INVALID_CONFIG", "the tpm attestor needs --tpm-pool POOL")


def check_x509pop_settings(settings: Mapping[str, str]) -> None:
    """Fail at start when x509pop's CA bundle or its max_expired_s is unusable."""
    from attestors.x509pop import check_settings

    try:
        check_settings(settings)
    except ValueError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ControlError("INVALID_ARGUMENT", f"listen address {listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(
    *,
    home: Path,
    db_url: str,
    api_listen: str,
    gateway_listen: str,
    gateway_san: str,
    gateway_url: str | None,
    ready_file: Path | None,
    secret: bytes,
    cert_ttl_s: int = CERT_TTL_MAX_S,
    attestor_settings: Mapping[str, str] | None = None,
    downloads: Path | None = None,
) -> int:
    # Under journald the journal stamps each line: no second timestamp (bcd.systemd).
    log_format = "%(levelname)s %(name)s: %(message)s"
    if not under_journald(sys.stderr):
        log_format = "%(asctime)s " + log_format
    logging.basicConfig(level=logging.INFO, format=log_format, stream=sys.stderr)
    if downloads is not None and not downloads.is_dir():
        raise ControlError("INVALID_CONFIG", f"--downloads {downloads}: not a directory")
    pki_dir = home / "pki"
    crypto: JoinCrypto | None = None
    well_known_join: dict[str, Any] | None = None
    try:
        loaded = pki.load_pki(pki_dir, secret)
        chain_pem, gw_key = pki.load_gateway(pki_dir, gateway_san, secret)
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    crypto = join_crypto(loaded, cert_ttl_s)
    well_known_join = dict(loaded.well_known_join())
    node_ca_pem = loaded.chain_tail_pem()
    ssl_ctx = pki.server_ssl_context(chain_pem, gw_key, client_ca_pem=node_ca_pem)
    settings = dict(attestor_settings or {})
    check_tpm_settings(settings)
    check_x509pop_settings(settings)
    discovery_problem = check_discovery_settings(settings)
    if discovery_problem is not None:
        raise ControlError("INVALID_CONFIG", discovery_problem)
    store = open_store(db_url)
    store.migrate()
    plugins = load_plugins()
    for failure in plugins.failures:
        log.warning("attestor plugin %s did not load: %s", failure.name, failure.error)
    gateway_doc = None
    if gateway_url:
        gateway_doc = {
            "url": gateway_url,
            "serverName": gateway_san,
            "servingCaPin": loaded.pins()["serving_ca_spki_pin"],
        }
    limiter = trio.CapacityLimiter(8)
    joinservice = JoinService(store, crypto, plugins, settings)
    gateway = Gateway(store, joinservice, RenewService(store, crypto), limiter)
    app = App(
        store=store,
        well_known_join=well_known_join,
        gateway=gateway_doc,
        limiter=limiter,
        on_revocation=gateway.poke,
        downloads=downloads.absolute() if downloads is not None else None,
    )
    api_host, api_port = _split(api_listen)
    gw_host, gw_port = _split(gateway_listen)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            api_bound = await nursery.start(functools.partial(serve, app.api, api_host, api_port))
            gw_bound = await nursery.start(
                functools.partial(serve, gateway.handle, gw_host, gw_port, ssl_context=ssl_ctx)
            )
            nursery.start_soon(gateway.revocation_poller)
            ready = {
                "api": f"http://{api_host}:{api_bound}",
                "gateway": f"https://{gw_host}:{gw_bound}",
                "gateway_port": gw_bound,
                "api_port": api_bound,
            }
            if ready_file is not None:
                fs.atomic_write(ready_file, json.dumps(ready).encode(), 0o644)
            log.info("serving the API on %s and the gateway on %s", ready["api"], ready["gateway"])
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    log.info("shutting down")
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    finally:
        store.close()
    return 0
