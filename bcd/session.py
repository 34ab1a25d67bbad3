"""The session task: Hello over mutual TLS, then the gateway's stream.

The stream is :meth:`bcd.gatewayclient.GatewayClient.session` (lines of at most
64 KiB, at most 50 s without a byte).

The session is opened with the current certificate (read from the state holder
at every dial, so a renewed key is used from the next connection on). A broken
session is redialled with backoff (1 s doubling to 60 s, reset once a welcome
arrives), never sooner than a retryable answer's ``retry-pushback-ms`` (capped
at 5 minutes, :func:`bcd.wire.parse_pushback`). An error answer is read only up
to 64 KiB, and lines that are not JSON objects are skipped (logged once per
session). A RevocationNotice is logged as ``certificate revoked`` with its reason
and raised as :class:`~bcd.errors.CertificateRevoked`, which stops the agent: it
never redials with that certificate. An UNAUTHENTICATED answer at session open is
judged by :func:`bcd.revocation.judge_unauthenticated`: it stops the agent only with
a signed notice (revoked) or once the certificate expired; ``unknown-certificate``
(a control-plane database restored from an older backup) is logged as an error with
its own message and redialled every 5 minutes (:data:`UNKNOWN_RETRY_S`), and the
journal records it (``bcd doctor`` shows it).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

import trio

from bcd import __version__, wire
from bcd.config import Config
from bcd.errors import (
    BcdError,
    CertificateRevoked,
    CertificateUnknown,
    IdentityExpired,
    TransportError,
)
from bcd.gatewayanswer import ERROR_BODY_MAX, notice_in, reason_in
from bcd.helper import HelperError
from bcd.helper.nodekeys import HelperKeys
from bcd.identity import AnyState
from bcd.revocation import UNKNOWN_CERTIFICATE, judge_unauthenticated, revoked_by

if TYPE_CHECKING:
    from bcd.gatewayanswer import Response
    from bcd.gatewayclient import Lines

log = logging.getLogger("bcd.session")

SessionWatcher = Callable[[bool], Awaitable[None]]
"""Told ``True`` when a session opens (a welcome) and ``False`` when it is lost."""

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
IDLE_TIMEOUT_S = 50.0  # three pings missed and a bit
# The redial wait after the gateway said the store does not know this certificate (a
# restored backup): an operator's fix (a newer backup) is found within this, and a
# node that cannot come back does not knock every minute until its certificate ends.
UNKNOWN_RETRY_S = 300.0


@dataclass(frozen=True, slots=True)
class SessionInfo:
    journal_id: str
    boot_id: str


async def post_as_node(
    cfg: Config, state: AnyState, tpm: HelperKeys | None, path: str, body: bytes
) -> Response:
    """One JSON ``POST`` to the gateway over mutual TLS as ``state``'s identity.

    A file key's certificate goes to a gateway whose chain verified up to the serving
    CA (:func:`bcd.tls.pinned_context`); a TPM-held key signs the handshake through
    ``bcd helper`` (:mod:`bcd.tls_signer`). One connection, closed after.
    """
    from bcd.transport import gateway_client  # httpx once the agent is up (fast start)

    async with await gateway_client(cfg, state, tpm) as client:
        return await client.post(path, body)


async def _one_session(
    cfg: Config,
    state: AnyState,
    info: SessionInfo,
    tpm: HelperKeys | None = None,
    on_session: SessionWatcher | None = None,
) -> bool:
    """Run one session until it breaks; return whether a welcome arrived."""
    from bcd.transport import gateway_client

    hello = wire.Hello(
        node_id=state.identity.node_id,
        journal_id=info.journal_id,
        boot_id=info.boot_id,
        daemon_version=__version__,
    )
    welcomed = False
    async with (
        await gateway_client(cfg, state, tpm) as client,
        client.session(wire.dumps(hello.to_json()), idle_timeout=IDLE_TIMEOUT_S) as lines,
    ):
        if lines.status != 200:
            await _refused(lines, cfg, state)
        warned = False
        async for line in lines:
            try:
                msg = wire.parse_session_line(line)
            except wire.WireError:
                if not warned:  # once per session: a hostile stream cannot flood the log
                    log.warning("session: the gateway sent a line that is not a JSON object")
                    warned = True
                continue
            if isinstance(msg, wire.Welcome):
                welcomed = True
                log.info("session open (%s)", msg.session_id or "?")
                if on_session is not None:
                    await on_session(True)
            elif isinstance(msg, wire.RevocationLine):
                # only a notice signed where the revocation was made stops the node
                revoked = revoked_by(msg.notice, cfg.join_signing_key_pin, state)
                if revoked is not None:
                    raise revoked
                raise SessionRefused(
                    "the gateway sent a revocation without a valid signed notice "
                    f"(reason {msg.reason or '?'}); reconnecting"
                )
    return welcomed


class SessionRefused(TransportError):
    """The gateway answered the session with an error; ``pushback_s`` its capped wait;
    ``unknown`` when it said the store has no row for this certificate."""

    def __init__(
        self, message: str, pushback_s: float | None = None, *, unknown: bool = False
    ) -> None:
        super().__init__(message)
        self.pushback_s = pushback_s
        self.unknown = unknown


async def _refused(lines: Lines, cfg: Config, state: AnyState) -> NoReturn:
    """Judge a session answer other than 200; its body is read only up to 64 KiB."""
    status, headers = lines.status, lines.headers
    try:
        body = await lines.read_rest(ERROR_BODY_MAX)
    except TransportError:  # too long, too slow or broken: judged by the status alone
        body = b""
    err = wire.parse_error(body)
    if status == 401 or (err is not None and err.code == "UNAUTHENTICATED"):
        verdict = judge_unauthenticated(
            notice_in(body), cfg.join_signing_key_pin, state, datetime.now(UTC), reason_in(body)
        )
        if isinstance(verdict, CertificateRevoked | IdentityExpired):
            raise verdict
        if isinstance(verdict, CertificateUnknown):
            raise SessionRefused(str(verdict), UNKNOWN_RETRY_S, unknown=True)
        raise SessionRefused(str(verdict))
    if err is not None and err.code in wire.RETRYABLE:
        raise SessionRefused(
            f"the gateway refused the session (HTTP {status}, {err.code})",
            wire.parse_pushback(headers.get("retry-pushback-ms")),
        )
    raise SessionRefused(f"the gateway refused the session (HTTP {status})")


async def session_task(
    cfg: Config,
    get_state: Callable[[], AnyState],
    info: SessionInfo,
    *,
    rng: random.Random | None = None,
    tpm: HelperKeys | None = None,
    on_session: SessionWatcher | None = None,
    record: Recorder | None = None,
) -> None:
    """Keep a session open until the certificate is revoked (raises CertificateRevoked).

    ``on_session`` (the metrics textfile) is awaited with ``True`` at each welcome and
    with ``False`` each time a session is lost or a dial fails. ``record`` (the
    journal) gets ``unknown-certificate`` when the gateway says the store does not
    know the certificate and ``session-open`` at a welcome, each once per
    certificate until the other happens, so ``bcd doctor`` can tell which was last."""
    rng = rng or random.Random()  # noqa: S311 - jitter, not a secret
    delay = BACKOFF_FIRST_S
    journal = _Noted(record)
    while True:
        state = get_state()

        async def watch(up: bool, state: AnyState = state) -> None:
            if on_session is not None:
                await on_session(up)
            if up:
                await journal.note("session-open", state)

        level = logging.WARNING
        try:
            if await _one_session(cfg, state, info, tpm, watch):
                delay = BACKOFF_FIRST_S
            reason = "the gateway closed the session"
        except (TransportError, HelperError) as exc:
            reason = str(exc)
            pushback = exc.pushback_s if isinstance(exc, SessionRefused) else None
            if isinstance(exc, SessionRefused) and exc.unknown:
                level = logging.ERROR
                await journal.note(UNKNOWN_CERTIFICATE, state)
        else:
            pushback = None
        if on_session is not None:
            await on_session(False)
        wait = delay * (0.5 + rng.random() / 2)
        if pushback is not None:  # never sooner than the gateway asked (capped at 5 min)
            wait = max(wait, pushback)
        log.log(level, "session lost (%s); reconnecting in %.1f s", reason, wait)
        await trio.sleep(wait)
        delay = min(delay * 2, BACKOFF_MAX_S)


Recorder = Callable[[str, dict[str, Any]], Awaitable[object]]


class _Noted:
    """Journal ``session-open`` / ``unknown-certificate`` once per certificate until
    the other one happens (a redial every 5 minutes does not grow the journal)."""

    def __init__(self, record: Recorder | None) -> None:
        self.record = record
        self.last: dict[str, str] = {}  # serial -> the kind last recorded

    async def note(self, kind: str, state: AnyState) -> None:
        serial = state.leaf_info.serial_hex
        if self.record is None or self.last.get(serial) == kind:
            return
        self.last[serial] = kind
        try:
            await self.record(kind, {"serial": serial})
        except BcdError as exc:  # the journal is a record, not a reason to stop
            log.warning("cannot record %s in the journal: %s", kind, exc)
