"""The gateway's report of the sessions it holds, to the API (:mod:`control.nodefacts`).

The gateway may write nothing to the database, so what it sees of a node (its
session's certificate serial and daemon version) goes upstream: in one process to
:class:`control.gateway.NodeCalls`, split through the relay. Batched, so a fleet of
100,000 nodes costs the API one transaction per 1,000 sightings, not one per node:

- a session open is put in a bounded queue (:data:`MAX_PENDING` distinct serials;
  one more is dropped and counted, ``bc_session_reports_dropped_total{reason=
  "queue-full"}``), which is sent every :data:`FLUSH_S` seconds, at most
  :data:`~control.nodefacts.MAX_REPORT_SERIALS` serials a call;
- every :data:`REFRESH_S` seconds every live session is reported again, so a node's
  last seen stays fresh on a session that lasts its certificate's whole life.

Reporting never blocks nor fails a session: :meth:`SessionReporter.seen` only puts
in the queue, and a call the API does not answer with 200 drops its sightings
(counted, ``reason="upstream"``); the next refresh reports them again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

import trio

from control.http import Request, Response
from control.metrics import Metrics
from control.nodefacts import MAX_REPORT_SERIALS, SESSIONS_PATH, encode_report

log = logging.getLogger("control.gateway")

FLUSH_S = 2.0
REFRESH_S = 300.0
MAX_PENDING = 10_000
SEND_TIMEOUT_S = 15.0
MAX_REPORT_BYTES = 48 * 1024
"""A report's body stays below this (the relay listener takes 64 KiB)."""

Handler = Callable[[Request], Awaitable[Response]]


def chunks(seen: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``seen`` in reports of at most MAX_REPORT_SERIALS serials and about
    MAX_REPORT_BYTES of body each."""
    chunk: dict[str, str] = {}
    versions: set[str] = set()
    size = 16
    for serial, version in seen.items():
        cost = len(serial) + 3 + (0 if version in versions else len(version) + 40)
        if chunk and (len(chunk) >= MAX_REPORT_SERIALS or size + cost > MAX_REPORT_BYTES):
            yield chunk
            chunk, versions, size = {}, set(), 16
            cost = len(serial) + 3 + len(version) + 40
        chunk[serial] = version
        versions.add(version)
        size += cost
    if chunk:
        yield chunk


class SessionReporter:
    """Queues the sessions a gateway opens and reports them upstream (see the module)."""

    def __init__(
        self,
        send: Handler,
        live: Callable[[], Iterable[tuple[str, str]]],
        metrics: Metrics,
        *,
        flush_s: float = FLUSH_S,
        refresh_s: float = REFRESH_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.send = send
        self.live = live
        self.metrics = metrics
        self.flush_s = flush_s
        self.refresh_s = refresh_s
        self.max_pending = max_pending
        self.pending: dict[str, str] = {}
        self._failing = False

    def seen(self, serial: str, daemon_version: str) -> None:
        """A session opened with this certificate: queue it (never blocks)."""
        if serial in self.pending or len(self.pending) < self.max_pending:
            self.pending[serial] = daemon_version
        else:
            self.metrics.reports_dropped("queue-full", 1)

    async def run(self) -> None:
        """Flush every ``flush_s``; report every live session every ``refresh_s``."""
        next_refresh = trio.current_time() + self.refresh_s
        while True:
            await trio.sleep(self.flush_s)
            await self.flush()
            if trio.current_time() >= next_refresh:
                next_refresh = trio.current_time() + self.refresh_s
                for chunk in chunks(dict(self.live())):
                    await self._report(chunk)

    async def flush(self) -> None:
        """Send everything queued, a report at a time."""
        while self.pending:
            batch, self.pending = self.pending, {}
            for chunk in chunks(batch):
                await self._report(chunk)

    async def _report(self, chunk: dict[str, str]) -> None:
        req = Request(
            method="POST",
            path=SESSIONS_PATH,
            query={},
            headers={"content-type": "application/json"},
            body=encode_report(chunk),
            peer_cert_der=None,
            remote="gateway",
        )
        status = 0
        try:
            with trio.move_on_after(SEND_TIMEOUT_S):
                status = (await self.send(req)).status
        except Exception as exc:  # the upstream is down: count, never fail a session
            if not self._failing:
                log.warning("session report: the API did not take it (%s)", type(exc).__name__)
            self._failing = True
            self.metrics.reports_dropped("upstream", len(chunk))
            return
        if status != 200:
            if not self._failing:
                log.warning("session report: the API answered %s; dropped", status or "nothing")
            self._failing = True
            self.metrics.reports_dropped("upstream", len(chunk))
            return
        if self._failing:
            log.info("session report: the API takes reports again")
        self._failing = False
