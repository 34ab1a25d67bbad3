"""The store: one schema with numbered migrations on SQLite (default) and PostgreSQL.

All state of the control plane lives here, so several stateless replicas can share
one PostgreSQL database. Code above the store writes SQL once, with ``?``
placeholders; the PostgreSQL backend translates them. Calls are synchronous and run
in ``trio.to_thread.run_sync`` from the servers (psycopg's async API needs asyncio).

Time is the database's own: :meth:`Tx.now_ms` is ``compute_now()``, read once at the
start of each transaction, and every expiry is judged against it.
"""

from __future__ import annotations

from control.store.base import Row, Store, Tx, open_store

__all__ = ["Row", "Store", "Tx", "open_store"]
