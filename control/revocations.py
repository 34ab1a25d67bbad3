"""PostgreSQL's push of revocations to a gateway: ``LISTEN bc_revoked``.

The store sends ``NOTIFY bc_revoked`` right after a transaction that revoked a
certificate commits (``Tx.revoked``; never inside it, so a full notification queue
cannot fail a revocation). :func:`listen` holds one connection
of its own (not the pool's: a LISTEN lives on its connection) in a worker thread and
pokes the gateway's revocation poll for each notification, so a session learns of a
revocation a few milliseconds after the commit, on whichever replica it was made.

The notification only wakes the poll; the poll reads what was revoked from the
table, so a missed notification costs nothing but time (the poll still runs every
second), and after a reconnect one poke catches up on everything missed meanwhile.
A dead connection is found by the socket error or, on a silent network, by TCP
keepalives and a ``SELECT 1`` every :data:`LIVENESS_S`; it is redialled with backoff
from 0.5 s to 10 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg
import trio

from control.store.postgres import REVOKED_CHANNEL

log = logging.getLogger("control.revocations")

CHANNEL = REVOKED_CHANNEL
LIVENESS_S = 10.0
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 10.0


def _forever(url: str, poke: Callable[[], None], stop: threading.Event) -> None:
    backoff = _BACKOFF_FIRST_S
    down_logged = False
    while not stop.is_set():
        try:
            with psycopg.connect(
                url,
                autocommit=True,
                connect_timeout=5,
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            ) as conn:
                conn.execute(f"LISTEN {CHANNEL}")
                if down_logged:
                    log.info("listening for revocations again")
                down_logged = False
                backoff = _BACKOFF_FIRST_S
                poke()  # catch up on whatever was revoked while not listening
                checked = time.monotonic()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0):
                        poke()
                        if stop.is_set():
                            break
                    if time.monotonic() - checked > LIVENESS_S:
                        conn.execute("SELECT 1")
                        checked = time.monotonic()
        except psycopg.Error as exc:
            if not down_logged:
                log.warning(
                    "revocation notifications unavailable (%s); polling every second meanwhile",
                    type(exc).__name__,
                )
            down_logged = True
        stop.wait(backoff)
        backoff = min(backoff * 2, _BACKOFF_MAX_S)


async def listen(url: str, poke: Callable[[], None]) -> None:
    """Poke ``poke`` (on the trio thread) for each revocation notification, until cancelled."""
    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()

    def poke_from_thread() -> None:
        try:
            trio.from_thread.run_sync(poke, trio_token=token)
        except trio.RunFinishedError:
            stop.set()

    try:
        await trio.to_thread.run_sync(_forever, url, poke_from_thread, stop, abandon_on_cancel=True)
    finally:
        stop.set()
