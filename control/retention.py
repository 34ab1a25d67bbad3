"""Retention: what the control plane deletes once it has served its purpose.

Every API replica (``serve --role api`` or ``all``) prunes every
:data:`PRUNE_INTERVAL_S`, one table at a time, at most :data:`BATCH` rows per
statement (a few milliseconds of locks, never one long transaction); replicas doing
it at once delete the same rows, which is harmless. Ages are judged against
``compute_now()``. What is kept, and for how long (docs/operators.md, "Retention"):

=======================  =============================================================
events                   :data:`EVENTS_DAYS` days (the audit table is kept forever)
refusal_windows          one hour after its window started (a window lasts a minute)
discovery_vouch_calls    two minutes (the 600-a-minute limit reads the last one)
discovery_vouches        seven days after it expired (it blocks older boot epochs)
join_challenges          one hour after it ended (60 s challenges)
join_requests            thirty days after the decision; a pending one an hour after
                         its machine last asked (a waiting machine asks every few
                         seconds, so only an abandoned or made-up one goes), and any
                         pending one a day after it was made (its machine asks anew)
renew_proofs             three minutes after use (the replay window is 120 s)
renewals                 seven days (the 6-an-hour limit reads the last hour)
=======================  =============================================================

Nodes, certificates and tokens are never pruned: certificates are what a revocation
and a lost answer look up, and their rows are small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from control.store import Store, Tx

log = logging.getLogger("control.retention")

PRUNE_INTERVAL_S = 600.0
BATCH = 10_000
DAY_MS = 86_400_000
EVENTS_DAYS = 90

# (table, key column, age column, extra condition, keep for ms)
RULES: tuple[tuple[str, str, str, str, int], ...] = (
    ("events", "id", "created_at", "", EVENTS_DAYS * DAY_MS),
    ("refusal_windows", "rate_key", "window_start", "", 3_600_000),
    ("discovery_vouches", "id", "expires_at", "", 7 * DAY_MS),
    ("join_challenges", "id", "not_after", "", 3_600_000),
    ("join_requests", "id", "decided_at", " AND decided_at IS NOT NULL", 30 * DAY_MS),
    ("join_requests", "id", "updated_at", " AND state = 'pending'", 3_600_000),
    ("join_requests", "id", "created_at", " AND state = 'pending'", DAY_MS),
    ("renew_proofs", "proof_sha256", "used_at", "", 180_000),
    ("renewals", "serial", "renewed_at", "", 7 * DAY_MS),
)


def _prune_table(tx: Tx, table: str, key: str, age: str, extra: str, keep_ms: int) -> int:
    cutoff = tx.now_ms() - keep_ms
    # the age condition again outside: a row changed while the delete waited for it
    # (a pending request approved, a vouch renewed) is judged as it is now
    return tx.execute(
        f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} "
        f"WHERE {age} < ?{extra} LIMIT ?) AND {age} < ?{extra}",
        (cutoff, BATCH, cutoff),
    )


def prune_once(store: Store) -> dict[str, int]:
    """One pass over every rule; returns the rows deleted per table."""
    done: dict[str, int] = {}
    for table, key, age, extra, keep_ms in RULES:
        total = 0
        while True:
            with store.tx() as tx:
                deleted = _prune_table(tx, table, key, age, extra, keep_ms)
            total += max(deleted, 0)
            if deleted < BATCH:
                break
        done[table] = done.get(table, 0) + total
    with store.tx() as tx:
        done["discovery_vouch_calls"] = max(
            tx.execute("DELETE FROM discovery_vouch_calls WHERE at < ?", (tx.now_ms() - 120_000,)),
            0,
        )
    return done


async def pruner(
    store: Store,
    limiter: trio.CapacityLimiter,
    *,
    interval_s: float = PRUNE_INTERVAL_S,
    on_pass: Callable[[dict[str, int]], None] | None = None,
) -> None:
    """Prune every ``interval_s`` until cancelled; a failed pass is logged and retried."""
    while True:
        try:
            done = await trio.to_thread.run_sync(prune_once, store, limiter=limiter)
        except Exception as exc:  # the database may be down: the next pass catches up
            log.warning(
                "retention pass failed (%s); next in %.0f s", type(exc).__name__, interval_s
            )
        else:
            pruned = {t: n for t, n in done.items() if n}
            if pruned:
                log.info("retention: deleted %s", ", ".join(f"{n} {t}" for t, n in pruned.items()))
            if on_pass is not None:
                on_pass(done)
        await trio.sleep(interval_s)
