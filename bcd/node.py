"""``bcd node``: one trio nursery with a session task and a renewal task.

The identity is loaded with LoadState at start. The tasks share it through a
:class:`StateHolder`: the renewal task replaces it, the session task reads it at
every dial. SIGTERM or SIGINT cancels the nursery and ``bcd node`` exits 0. A
RevocationNotice (or the gateway refusing the certificate) stops everything and
``bcd node`` exits 1 with ``agent: this node's certificate was revoked``; nothing
on disk is deleted. Any other failure of a task cancels the others too (no task
is silently survived) and ``bcd node`` exits non-zero naming it: 1 when a person
must act (revoked, not joined, expired), 75 for a temporary failure, 70 for a bug,
so a service manager restarts only the last two.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from bcd import failpoints, systemd
from bcd.config import Config, trusted_owners
from bcd.errors import CertificateRevoked, IdentityError
from bcd.helper.client import HelperClient
from bcd.helper.nodekeys import HelperKeys
from bcd.identity import NOT_JOINED, AnyState, load_state
from bcd.journal import Journal, open_journal
from bcd.renew import FAIL_POINTS, gateway_renew_sender, renewal_task
from bcd.revocation import UNKNOWN_CERTIFICATE
from bcd.session import SessionInfo, session_task

if TYPE_CHECKING:
    from bcd.nodemetrics import TextfileMetrics

log = logging.getLogger("bcd.node")

REVOKED_MESSAGE = "agent: this node's certificate was revoked"
SESSION_WORDS = ("session-open", UNKNOWN_CERTIFICATE)
"""The journal kinds of what the gateway last said of the certificate (bcd doctor's
``session`` check): each replaces the others, so they never grow the journal."""
EXIT_NEEDS_OPERATOR = 1  # revoked, not joined, expired, identity or config broken
EXIT_TEMPORARY = 75  # EX_TEMPFAIL: e.g. the journal could not be opened; retry later
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug ended a task


@dataclass
class StateHolder:
    state: AnyState

    def get(self) -> AnyState:
        return self.state

    def set(self, state: AnyState) -> None:
        self.state = state


def boot_id(root: Path = Path("/")) -> str:
    try:
        return (root / "proc/sys/kernel/random/boot_id").read_text().strip()[:64]
    except OSError:
        return ""


def helper_keys(cfg: Config) -> HelperKeys | None:
    """Under ``[helper]``, the node's TPM-held keys through ``bcd helper``'s socket."""
    if cfg.helper is None:
        return None
    return HelperKeys(HelperClient(cfg.helper.socket))


def load_identity(cfg: Config, now: datetime, tpm: HelperKeys | None = None) -> AnyState:
    """LoadState for an agent mode: not joined or expired are errors with the way back.

    With ``tpm`` (``[helper]``), a TPM-held key is derived through ``bcd helper``; call
    this in ``trio.to_thread.run_sync`` then (the derive calls back into trio).
    """
    owners = trusted_owners(cfg)
    state: AnyState | None
    if tpm is None:
        state = load_state(cfg.data_dir, owners=owners)
    else:
        state = load_state(cfg.data_dir, tpm.derive_sync, owners=owners)
    if state is None:
        raise IdentityError(NOT_JOINED)
    if state.expired(now):
        raise IdentityError(
            f"the certificate expired at {state.identity.not_after}; join again as root: "
            "bcd join --reset --yes, then bcd join"
        )
    return state


async def run_node(cfg: Config, *, wall: Callable[[], float] = time.time) -> None:
    """Run the agent until a signal (returns) or a revocation (raises CertificateRevoked)."""
    now = datetime.fromtimestamp(wall(), UTC)
    tpm = helper_keys(cfg)
    state = await trio.to_thread.run_sync(load_identity, cfg, now, tpm)
    journal: Journal = await trio.to_thread.run_sync(open_journal, cfg.data_dir, now)
    holder = StateHolder(state)
    info = SessionInfo(journal_id=journal.journal_id, boot_id=boot_id())
    metrics = await _open_metrics(cfg, journal, state)
    log.info(
        "node %s (site %s, role %s); certificate valid until %s; journal %s",
        state.identity.node_id,
        state.identity.site_id,
        state.identity.role,
        state.identity.not_after,
        journal.journal_id,
    )
    node_id = state.identity.node_id
    status = f"STATUS=node {node_id}; certificate valid until {state.identity.not_after}"
    # the holder has the state from here on: once renewed, the first one (its key, its
    # TLS context) goes, as every later one does at the next renewal
    del state

    async def record(kind: str, payload: dict[str, Any]) -> object:
        if kind == "renewed":
            systemd.notify(
                f"STATUS=node {node_id}; renewed, certificate valid until {payload.get('notAfter')}"
            )
            if metrics is not None:
                metrics.renewed_at(datetime.fromtimestamp(wall(), UTC))
                await _publish(metrics, holder)
        # what the session last heard is one row, however often a gateway flips it
        replacing = SESSION_WORDS if kind in SESSION_WORDS else ()
        return await trio.to_thread.run_sync(
            functools.partial(journal.append, kind, payload, replacing=replacing)
        )

    hooks = _Hooks() if metrics is None else _metrics_hooks(metrics, holder)
    try:
        await _supervise(
            cfg, holder, info, wall, record, tpm, ready=("READY=1", status), hooks=hooks
        )
    finally:
        if metrics is not None:  # stopped: no session, whatever the file said
            metrics.session(False)
            with trio.CancelScope(shield=True):
                await _publish(metrics, holder)
        await trio.to_thread.run_sync(journal.close)


@dataclass(frozen=True, slots=True)
class _Hooks:
    """What the tasks tell the metrics textfile (nothing without ``[metrics]``)."""

    on_session: Callable[[bool], Awaitable[None]] | None = None
    on_renewal_failure: Callable[[], Awaitable[None]] | None = None


async def _open_metrics(cfg: Config, journal: Journal, state: AnyState) -> TextfileMetrics | None:
    """``[metrics] textfile``: the figures at start, written once (prometheus_client is
    imported only here, and only when configured)."""
    if cfg.metrics.textfile is None:
        return None
    from bcd.identity import parse_time
    from bcd.journal import JournalError
    from bcd.nodemetrics import TextfileMetrics

    metrics = TextfileMetrics(cfg.metrics.textfile)
    metrics.certificate(state)
    metrics.session(False)
    try:
        last = await trio.to_thread.run_sync(journal.last, "renewed")
        if last is not None:
            metrics.renewed_at(parse_time(last.at))
    except (JournalError, ValueError) as exc:  # the figure stays absent
        log.warning("the last renewal could not be read from the journal: %s", exc)
    await trio.to_thread.run_sync(metrics.write)
    return metrics


async def _publish(metrics: TextfileMetrics, holder: StateHolder) -> None:
    metrics.certificate(holder.get())
    await trio.to_thread.run_sync(metrics.write)


def _metrics_hooks(metrics: TextfileMetrics, holder: StateHolder) -> _Hooks:
    async def on_session(up: bool) -> None:
        if metrics.session(up):
            await _publish(metrics, holder)

    async def on_renewal_failure() -> None:
        metrics.renewal_failed()
        await _publish(metrics, holder)

    return _Hooks(on_session=on_session, on_renewal_failure=on_renewal_failure)


async def _supervise(
    cfg: Config,
    holder: StateHolder,
    info: SessionInfo,
    wall: Callable[[], float],
    record: Callable[[str, dict[str, Any]], Awaitable[object]],
    tpm: HelperKeys | None = None,
    ready: tuple[str, ...] = (),
    hooks: _Hooks | None = None,
) -> None:
    hooks = hooks or _Hooks()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_signals, nursery.cancel_scope)
            # Type=notify: ready once the identity loaded, the journal is open and a
            # SIGTERM stops bcd node cleanly.
            systemd.notify(*ready)
            nursery.start_soon(
                lambda: session_task(
                    cfg, holder.get, info, tpm=tpm, on_session=hooks.on_session, record=record
                )
            )
            nursery.start_soon(
                lambda: renewal_task(
                    holder.get,
                    holder.set,
                    lambda s: gateway_renew_sender(cfg, s, tpm),
                    signing_pin=cfg.join_signing_key_pin,
                    wall=wall,
                    log=logging.getLogger("bcd.renew"),
                    record=record,
                    fail_point=failpoints.from_environment(FAIL_POINTS),
                    tpm=tpm,
                    tpm_mode=cfg.tpm.mode,
                    on_failure=hooks.on_renewal_failure,
                )
            )
    except* CertificateRevoked as group:
        # the serial tells bcd doctor which certificate the revocation was of
        revoked = {"reason": str(group.exceptions[0])[:200]}
        await record("revoked", {**revoked, "serial": holder.get().leaf_info.serial_hex})
        raise


async def _signals(
    scope: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s; stopping", signal.Signals(signum).name)
            systemd.notify("STOPPING=1")
            scope.cancel()
            return
