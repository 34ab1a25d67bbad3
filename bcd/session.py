"""The session task: Hello over mutual TLS, then the gateway's stream.

The session is opened with the current certificate (read from the state holder
at every dial, so a renewed key is used from the next connection on). A broken
session is redialled with backoff (1 s doubling to 60 s, reset once a welcome
arrives). A RevocationNotice is logged as ``certificate revoked`` with its reason
and raised as :class:`~bcd.errors.CertificateRevoked`, which stops the agent: it
never redials with that certificate. An UNAUTHENTICATED answer at session open
means the gateway no longer accepts the certificate, and stops the agent the same
way.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import trio

from bcd import __version__, wire
from bcd.config import Config, gateway_host_port
from bcd.errors import CertificateRevoked, TransportError
from bcd.helper import HelperError
from bcd.helper.nodekeys import HelperKeys
from bcd.httpclient import Response, open_lines, request
from bcd.identity import AnyState, LoadedTpmState
from bcd.keys.file import key_to_pem
from bcd.tls import connect_pinned
from bcd.tls_signer import connect_with_signer

log = logging.getLogger("bcd.session")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
IDLE_TIMEOUT_S = 50.0  # three pings missed and a bit


@dataclass(frozen=True, slots=True)
class SessionInfo:
    journal_id: str
    boot_id: str


async def open_gateway(
    cfg: Config, state: AnyState, tpm: HelperKeys | None = None
) -> trio.abc.Stream:
    """Mutual TLS to the gateway with the state's key, pinned to the serving CA.

    A file key goes through :func:`bcd.tls.connect_pinned`; a TPM-held key signs the
    handshake through ``bcd helper`` (:func:`bcd.tls_signer.connect_with_signer`).
    """
    host, port = gateway_host_port(cfg)
    if isinstance(state, LoadedTpmState):
        if tpm is None:
            raise TransportError("a TPM-held node key needs bcd helper ([helper] in config.toml)")
        return await connect_with_signer(
            host,
            port,
            cfg.server_name,
            cfg.serving_ca_spki_pin,
            state.identity.chain,
            state.public_key,
            tpm.signer(state.record),
        )
    client_cert = (state.identity.chain, key_to_pem(state.key))
    return await connect_pinned(
        host, port, cfg.server_name, cfg.serving_ca_spki_pin, client_cert=client_cert
    )


async def post_as_node(
    cfg: Config, state: AnyState, tpm: HelperKeys | None, path: str, body: bytes
) -> Response:
    """One JSON ``POST`` to the gateway over mutual TLS as ``state``'s identity."""
    stream = await open_gateway(cfg, state, tpm)
    try:
        return await request(
            stream,
            "POST",
            path,
            cfg.server_name,
            body,
            headers=[("content-type", "application/json")],
        )
    finally:
        await trio.aclose_forcefully(stream)


async def _one_session(
    cfg: Config, state: AnyState, info: SessionInfo, tpm: HelperKeys | None = None
) -> bool:
    """Run one session until it breaks; return whether a welcome arrived."""
    stream = await open_gateway(cfg, state, tpm)
    hello = wire.Hello(
        node_id=state.identity.node_id,
        journal_id=info.journal_id,
        boot_id=info.boot_id,
        daemon_version=__version__,
    )
    welcomed = False
    try:
        status, _headers, lines = await open_lines(
            stream,
            "POST",
            "/v1/session",
            cfg.server_name,
            wire.dumps(hello.to_json()),
            headers=[("content-type", "application/json")],
            idle_timeout=IDLE_TIMEOUT_S,
        )
        try:
            if status != 200:
                first = b"".join([line async for line in lines])
                err = wire.parse_error(first)
                if status == 401 or (err is not None and err.code == "UNAUTHENTICATED"):
                    raise CertificateRevoked(
                        "the gateway no longer accepts this node's certificate"
                    )
                raise TransportError(f"the gateway refused the session (HTTP {status})")
            async for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("session: the gateway sent a line that is not JSON")
                    continue
                kind = msg.get("type") if isinstance(msg, dict) else None
                if kind == "welcome":
                    welcomed = True
                    log.info("session open (%s)", msg.get("session_id"))
                elif kind == "revocation":
                    reason = str(msg.get("reason", "revoked"))[:200]
                    log.error(
                        "certificate revoked (reason: %s, serial %s)", reason, msg.get("serial")
                    )
                    raise CertificateRevoked(reason)
        finally:
            await lines.aclose()
    finally:
        await stream.aclose()
    return welcomed


async def session_task(
    cfg: Config,
    get_state: Callable[[], AnyState],
    info: SessionInfo,
    *,
    rng: random.Random | None = None,
    tpm: HelperKeys | None = None,
) -> None:
    """Keep a session open until the certificate is revoked (raises CertificateRevoked)."""
    rng = rng or random.Random()  # noqa: S311 - jitter, not a secret
    delay = BACKOFF_FIRST_S
    while True:
        try:
            if await _one_session(cfg, get_state(), info, tpm):
                delay = BACKOFF_FIRST_S
            reason = "the gateway closed the session"
        except (TransportError, HelperError) as exc:
            reason = str(exc)
        wait = delay * (0.5 + rng.random() / 2)
        log.warning("session lost (%s); reconnecting in %.1f s", reason, wait)
        await trio.sleep(wait)
        delay = min(delay * 2, BACKOFF_MAX_S)
