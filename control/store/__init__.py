"""The store: one schema with numbered migrations on SQLite (default) and PostgreSQL.

All state of the control plane lives here, so several stateless replicas can share
one PostgreSQL database. Code above the store writes SQL once, with ``?``
placeholders; the PostgreSQL backend translates them. Calls are synchronous and run
in ``trio.to_thread.run_sync`` from the servers (psycopg's async API needs asyncio).

Time is the database's own: :meth:`Tx.now_ms` is ``compute_now()``, read once per
transaction, and every expiry is judged against it. Tests inject a clock instead
(``open_store(url, clock=...)``, :mod:`control.clock`).

A database that cannot answer now (unreachable, a held lock past the timeout, a file
that cannot be opened) raises :class:`~control.errors.StoreUnavailable`: UNAVAILABLE
with a pushback, never a bug's answer. A unique-constraint race raises
:class:`~control.errors.StoreConflict` (CONFLICT).
"""

from __future__ import annotations

from control.store.base import Row, Store, Tx, marks, open_store

__all__ = ["Row", "Store", "Tx", "marks", "open_store"]
