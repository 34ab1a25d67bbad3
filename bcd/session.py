"""The session task: Hello over mutual TLS, then the gateway's stream.

The session is opened with the current certificate (read from the state holder
at every dial, so a renewed key is used from the next connection on). A broken
session is redialled with backoff (1 s doubling to 60 s, reset once a welcome
arrives), never sooner than a retryable answer's ``retry-pushback-ms`` (capped
at 5 minutes, :func:`bcd.wire.parse_pushback`). An error answer is read only up
to 64 KiB, and lines that are not JSON objects are skipped (logged once per
session). A RevocationNotice is logged as ``certificate revoked`` with its reason
and raised as :class:`~bcd.errors.CertificateRevoked`, which stops the agent: it
never redials with that certificate. An UNAUTHENTICATED answer at session open
means the gateway no longer accepts the certificate, and stops the agent the same
way.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import trio

from bcd import __version__, wire
from bcd.config import Config, gateway_host_port
from bcd.errors import CertificateRevoked, IdentityExpired, TransportError
from bcd.helper import HelperError
from bcd.helper.nodekeys import HelperKeys
from bcd.httpclient import Response, open_lines, read_rest, request
from bcd.identity import AnyState, LoadedTpmState
from bcd.keys.file import key_to_pem
from bcd.revocation import judge_unauthenticated, revoked_by
from bcd.tls import connect_pinned
from bcd.tls_signer import connect_with_signer

log = logging.getLogger("bcd.session")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
IDLE_TIMEOUT_S = 50.0  # three pings missed and a bit
ERROR_BODY_MAX = 64 * 1024  # an error answer is one small JSON object


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
        status, headers, lines = await open_lines(
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
                await _refused(status, headers, lines, cfg, state)
            warned = False
            async for line in lines:
                msg = _message(line)
                if msg is None:
                    if not warned:  # once per session: a hostile stream cannot flood the log
                        log.warning("session: the gateway sent a line that is not a JSON object")
                        warned = True
                    continue
                kind = msg.get("type")
                if kind == "welcome":
                    welcomed = True
                    log.info("session open (%s)", _text(msg.get("session_id"), "?"))
                elif kind == "revocation":
                    # only a notice signed where the revocation was made stops the node
                    revoked = revoked_by(msg.get("notice"), cfg.join_signing_key_pin, state)
                    if revoked is not None:
                        raise revoked
                    raise SessionRefused(
                        "the gateway sent a revocation without a valid signed notice "
                        f"(reason {_text(msg.get('reason'), '?')}); reconnecting"
                    )
        finally:
            await lines.aclose()
    finally:
        await stream.aclose()
    return welcomed


class SessionRefused(TransportError):
    """The gateway answered the session with an error; ``pushback_s`` its capped wait."""

    def __init__(self, message: str, pushback_s: float | None = None) -> None:
        super().__init__(message)
        self.pushback_s = pushback_s


def _message(line: bytes) -> dict[str, Any] | None:
    """A session line as a JSON object, or ``None`` for anything else."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return msg if isinstance(msg, dict) else None


def _text(value: object, default: str) -> str:
    """A string field of a gateway message for a log line: at most 200 characters,
    escaped to printable ASCII (a newline cannot forge a log line)."""
    if not isinstance(value, str) or not value:
        return default
    return value[:200].encode("unicode_escape").decode("ascii")


async def _refused(
    status: int,
    headers: dict[str, str],
    lines: AsyncIterator[bytes],
    cfg: Config,
    state: AnyState,
) -> NoReturn:
    """Judge a session answer other than 200; its body is read only up to 64 KiB."""
    try:
        body = await read_rest(lines, cfg.server_name, limit=ERROR_BODY_MAX)
    except TransportError:  # too long, too slow or broken: judged by the status alone
        body = b""
    err = wire.parse_error(body)
    if status == 401 or (err is not None and err.code == "UNAUTHENTICATED"):
        verdict = judge_unauthenticated(
            _notice_in(body), cfg.join_signing_key_pin, state, datetime.now(UTC)
        )
        if isinstance(verdict, CertificateRevoked | IdentityExpired):
            raise verdict
        raise SessionRefused(str(verdict))
    if err is not None and err.code in wire.RETRYABLE:
        raise SessionRefused(
            f"the gateway refused the session (HTTP {status}, {err.code})",
            wire.parse_pushback(headers.get("retry-pushback-ms")),
        )
    raise SessionRefused(f"the gateway refused the session (HTTP {status})")


def _notice_in(body: bytes) -> object:
    """The ``notice`` field of an error answer (the signed RevocationNotice), if any."""
    msg = _message(body)
    return msg.get("notice") if msg is not None else None


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
            pushback = exc.pushback_s if isinstance(exc, SessionRefused) else None
        else:
            pushback = None
        wait = delay * (0.5 + rng.random() / 2)
        if pushback is not None:  # never sooner than the gateway asked (capped at 5 min)
            wait = max(wait, pushback)
        log.warning("session lost (%s); reconnecting in %.1f s", reason, wait)
        await trio.sleep(wait)
        delay = min(delay * 2, BACKOFF_MAX_S)
