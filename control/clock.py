"""The control plane's clock: the database's, unless a test injects its own.

Every expiry, window and certificate validity is judged against ``compute_now()``,
:meth:`control.store.Tx.now_ms`, read once at the start of each transaction. In
production that is the database's own time (PostgreSQL ``now()``, SQLite
``julianday('now')``), so several replicas agree on it whatever their hosts' clocks
say. A store opened with a :class:`Clock` (``open_store(url, clock=...)``) takes the
time from it instead: tests move time forward with :meth:`ManualClock.advance` (or
under ``trio.testing.MockClock`` with :class:`TrioClock`) rather than ageing rows
with SQL.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Clock(Protocol):
    """A source of ``compute_now()`` in unix milliseconds; called from worker threads."""

    def now_ms(self) -> int: ...


class ManualClock:
    """A clock that moves only when told to (thread-safe)."""

    def __init__(self, start_ms: int) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms

    def set(self, now_ms: int) -> None:
        with self._lock:
            self._now = now_ms


class TrioClock:
    """``start_ms`` plus a trio clock's time (e.g. ``trio.testing.MockClock``): the
    store's time follows the event loop's, autojumps included."""

    def __init__(self, clock: _CurrentTime, start_ms: int) -> None:
        self._clock = clock
        self._start_ms = start_ms
        self._origin = clock.current_time()

    def now_ms(self) -> int:
        return self._start_ms + int((self._clock.current_time() - self._origin) * 1000)


class _CurrentTime(Protocol):
    def current_time(self) -> float: ...
