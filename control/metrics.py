"""Prometheus metrics of one control-plane process (``serve --metrics-listen``).

Every metric lives in a :class:`Metrics`, whose registry is its own (not
prometheus_client's global one), so several servers or tests in one process never
share a counter. The services take a ``Metrics`` (a private one when given none);
``serve`` hands one to every part of a role and serves it on a listener of its own
(:meth:`Metrics.handle`: ``GET /metrics``, anything else 404).

Labels are bounded: an attestor is a loaded plugin's name or ``unknown``, a reason a
protocol refusal reason (``other`` when it does not look like one, or once
:data:`REASONS_PER_ATTESTOR` distinct ones have been counted for the attestor), an
outcome and a limit from the short lists below. A node id, token id, tenant id or address is never
a label. docs/operators.md ("Metrics") lists every metric.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

from control.http import Request, Response, error_response

JOIN_OUTCOMES = ("joined", "challenge", "pending", "refused", "error")
RENEW_OUTCOMES = ("renewed", "refused", "rate-limited", "error")
LIMITS = (
    "connections",
    "connections-per-source",
    "handshakes",
    "handshakes-per-source",
    "request-head",
    "request-body",
    "renewals-per-node",
    "join-requests-pending",
    "vouches-per-site-agent",
)
REPORT_DROP_REASONS = ("queue-full", "upstream")
HANDSHAKE_OUTCOMES = ("completed", "failed", "timed-out", "silent", "no-slot", "late")
TLS_LISTENERS = ("gateway", "relay")
_REASON = re.compile(r"[a-z][a-z0-9-]{0,39}")
REASONS_PER_ATTESTOR = 32
"""Distinct reason labels per attestor (and for renewals); any further reason is ``other``."""
PENDING_REFRESH_S = 5.0
"""``bc_join_requests_pending`` is counted at a scrape, at most once per this long."""

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DELIVERY = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


def reason_label(reason: str) -> str:
    """A refusal reason as a label: the protocol's word, else ``other`` (bounded)."""
    return reason if _REASON.fullmatch(reason) else "other"


class Metrics:
    """The metrics of one process, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.joins = Counter(
            "bc_joins", "Join calls judged, by attestor and outcome (joined, challenge, "
            "pending, refused, error).", ["attestor", "outcome"], registry=r,
        )  # fmt: skip
        self.join_refusals = Counter(
            "bc_join_refusals", "Joins refused, by attestor and the refusal reason "
            "(PROTOCOL.md, Refusal reasons; server side only).", ["attestor", "reason"],
            registry=r,
        )  # fmt: skip
        self.renewals = Counter(
            "bc_renewals", "Renewal calls judged, by outcome (renewed, refused, rate-limited, "
            "error).", ["outcome"], registry=r,
        )  # fmt: skip
        self.renewal_refusals = Counter(
            "bc_renewal_refusals", "Renewals refused, by the refusal reason.", ["reason"],
            registry=r,
        )  # fmt: skip
        self.sessions_live = Gauge(
            "bc_sessions_live", "Node sessions open on this gateway now.", registry=r
        )
        self.session_opens = Counter(
            "bc_session_opens", "Node sessions opened on this gateway.", registry=r
        )
        self.session_reports_dropped = Counter(
            "bc_session_reports_dropped", "Session sightings (a node's last seen, its daemon "
            "version) this gateway could not report to the API, by reason (queue-full, "
            "upstream).", ["reason"], registry=r,
        )  # fmt: skip
        self.revocations_pushed = Counter(
            "bc_revocations_pushed", "RevocationNotices pushed onto a live session.", registry=r
        )
        self.revocation_delivery = Histogram(
            "bc_revocation_delivery_seconds", "From the revoking transaction (revoked_at, the "
            "database's clock) to the notice's push on a session.", buckets=_DELIVERY,
            registry=r,
        )  # fmt: skip
        self.revocation_written = Histogram(
            "bc_revocation_written_seconds", "From the revoking transaction (revoked_at, the "
            "database's clock) to the notice written on the session's connection, which "
            "then ends.", buckets=_DELIVERY, registry=r,
        )  # fmt: skip
        self.relay_latency = Histogram(
            "bc_relay_duration_seconds", "A gateway's relayed node call to an API replica, "
            "until its whole answer, by outcome (answered, unavailable).", ["outcome"],
            buckets=_FAST, registry=r,
        )  # fmt: skip
        self.db_tx = Histogram(
            "bc_db_transaction_duration_seconds", "One database transaction, from taking a "
            "connection to its commit or rollback.", buckets=_FAST, registry=r,
        )  # fmt: skip
        self.relay_not_sent = Counter(
            "bc_relay_not_sent", "A gateway's relay attempts that never reached an API "
            "replica (a connect or TLS failure, no free connection), each moved to the next "
            "replica or to the second pass.", registry=r,
        )  # fmt: skip
        self.limit_hits = Counter(
            "bc_rate_limit_hits", "Calls or connections turned away by a limit, by its name.",
            ["limit"], registry=r,
        )  # fmt: skip
        self.handshakes = Counter(
            "bc_tls_handshakes", "TLS connections of a listener by how their handshake "
            "ended (completed, failed, timed-out, silent, no-slot, late).", ["listener", "outcome"],
            registry=r,
        )  # fmt: skip
        self.join_requests_pending = Gauge(
            "bc_join_requests_pending", "Join requests waiting for an operator's decision "
            f"(counted at a scrape, at most every {PENDING_REFRESH_S:.0f} s).", registry=r,
        )  # fmt: skip
        for outcome in RENEW_OUTCOMES:  # zeros from the start: rate() sees the first event
            self.renewals.labels(outcome)
        for limit in LIMITS:
            self.limit_hits.labels(limit)
        for reason in REPORT_DROP_REASONS:
            self.session_reports_dropped.labels(reason)
        self.count_pending: Callable[[], Awaitable[int]] | None = None
        self._pending_at = -1e9
        self._reasons: dict[str, set[str]] = {}

    def _reason(self, attestor: str, reason: str) -> str:
        """``reason`` as a label, ``other`` beyond :data:`REASONS_PER_ATTESTOR` distinct
        ones for ``attestor`` (a plugin's reasons are its own choice)."""
        label = reason_label(reason)
        seen = self._reasons.setdefault(attestor, set())
        if label in seen:
            return label
        if len(seen) >= REASONS_PER_ATTESTOR:
            return "other"
        seen.add(label)
        return label

    # --- events ------------------------------------------------------------------

    def join(self, attestor: str, outcome: str, reason: str | None = None) -> None:
        self.joins.labels(attestor, outcome).inc()
        if reason is not None:
            self.join_refusals.labels(attestor, self._reason(attestor, reason)).inc()

    def renewal(self, outcome: str, reason: str | None = None) -> None:
        self.renewals.labels(outcome).inc()
        if reason is not None:
            self.renewal_refusals.labels(self._reason("", reason)).inc()

    def reports_dropped(self, reason: str, count: int) -> None:
        if count > 0:
            label = reason if reason in REPORT_DROP_REASONS else "upstream"
            self.session_reports_dropped.labels(label).inc(count)

    def limit_hit(self, limit: str) -> None:
        self.limit_hits.labels(limit if limit in LIMITS else "other").inc()

    def handshake_counter(self, listener: str) -> Callable[[str], None]:
        """What counts ``listener``'s handshake outcomes (``control.http.OnHandshake``),
        each outcome at zero from the start."""
        name = listener if listener in TLS_LISTENERS else "other"
        for outcome in HANDSHAKE_OUTCOMES:
            self.handshakes.labels(name, outcome)

        def count(outcome: str) -> None:
            self.handshakes.labels(
                name, outcome if outcome in HANDSHAKE_OUTCOMES else "other"
            ).inc()

        return count

    def observe_tx(self, seconds: float) -> None:
        self.db_tx.observe(seconds)

    @contextmanager
    def timed_relay(self) -> Iterator[None]:
        start = time.perf_counter()
        outcome = "unavailable"
        try:
            yield
            outcome = "answered"
        finally:
            self.relay_latency.labels(outcome).observe(time.perf_counter() - start)

    # --- the listener ------------------------------------------------------------

    async def handle(self, req: Request) -> Response:
        """``GET /metrics`` in the text exposition format (OpenMetrics when the scraper's
        Accept asks for it); anything else 404."""
        if req.method != "GET" or req.path != "/metrics":
            return error_response("NOT_FOUND", "no such path")
        await self._refresh_pending()
        try:
            encode, content_type = choose_encoder(req.headers.get("accept", ""))
        except Exception:  # an Accept it cannot parse (version=abc): the text format
            encode, content_type = generate_latest, CONTENT_TYPE_LATEST
        # milliseconds of formatting: off the event loop, which carries the sessions
        body = await trio.to_thread.run_sync(encode, self.registry)
        return Response(200, body, [("content-type", content_type)])

    async def _refresh_pending(self) -> None:
        if self.count_pending is None:
            return
        now = trio.current_time()
        if now - self._pending_at < PENDING_REFRESH_S:
            return
        self._pending_at = now
        try:
            self.join_requests_pending.set(await self.count_pending())
        except Exception:  # the database is down: keep the last figure
            return
