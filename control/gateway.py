"""The gateway: the TLS front door for nodes.

``POST /v1/join`` (server-auth TLS) relays to JoinService; ``POST /v1/renew`` and
``POST /v1/session`` need the node's client certificate. TLS asks for it optionally
and the application decides (STACK-NOTES): a certificate that is not a live
node_certs row — unknown, revoked, expired — is answered UNAUTHENTICATED before
anything else, at renew, at a vouch and at session open, with a ``reason`` beside
code and message (``unknown-certificate`` for one the store has no row for: a
database restored from an older backup). Renewals are limited to 6 per node and
hour (RESOURCE_EXHAUSTED with ``retry-pushback-ms``).
``POST /v1/discovery/vouch`` takes a site agent's vouch for a machine that booted
on its site (:mod:`control.discovery`), with the same client-certificate check.

Two parts, so a gateway-only process (``serve --role gateway``) holds no key that
admits a node: :class:`NodeCalls` judges joins, renewals and vouches (JoinService,
RenewService: an API replica, or the one-process ``serve``); :class:`Gateway` is the
node-facing front door. It answers sessions and health itself and hands the other
three calls to ``upstream``: :meth:`NodeCalls.handle` in one process, or
:meth:`control.relay.RelayClient.forward` to API replicas.

A session is the gateway's stream of JSON lines: a welcome, a ping every 15 s, and
the RevocationNotice when the certificate it was opened with is revoked; the
stream closes after the notice. Revocations are found by polling the store every
second (so a revocation made through any replica reaches every session), and at
once when PostgreSQL notifies ``bc_revoked`` (:mod:`control.revocations`). A drain
(SIGTERM) ends every session with a clean end of stream, so its node redials.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import ipaddress
import itertools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import trio

from bcd import wire
from control import discovery, nodefacts, renewal
from control.errors import ControlError, Refused, StoreUnavailable
from control.http import DirectWrite, Request, Response, error_response, health_response
from control.joinservice import JoinService
from control.metrics import Metrics
from control.sessionreport import SessionReporter
from control.store import Row, Store, Tx

log = logging.getLogger("control.gateway")

PING_INTERVAL_S = 15.0
PING_SLOTS = 15
"""The pinger's steps per ping interval: each step pings the sessions of one slot."""
# A node holds one session; two overlap while it moves to a renewed certificate.
MAX_SESSIONS_PER_NODE = 2
REVOCATION_POLL_S = 1.0
SESSION_OPEN_MAX_S = 30.0
"""A session whose answer starts more than this after its certificate was checked
ends at once, after its welcome, with a clean end of stream (its node redials and is
checked again); the revocations the poller found are kept at least this long, so
one committed between a session's check and its start still ends it."""
T = TypeVar("T")
_DRAIN: dict[str, Any] = {"type": "drain"}  # never sent: ends the stream
_PING: dict[str, Any] = {"type": "ping"}  # sent as _PING_LINE, encoded once
_PING_LINE = b'{"type":"ping"}\n'
_UPSTREAM_PATHS = frozenset({"/v1/join", "/v1/renew", discovery.VOUCH_PATH})
_LIMIT_OF_PATH = {  # what a RESOURCE_EXHAUSTED of each call ran into
    "/v1/join": "join-requests-pending",
    "/v1/renew": "renewals-per-node",
    discovery.VOUCH_PATH: "vouches-per-site-agent",
}


@dataclass(eq=False)
class _Session:
    node_id: str
    serial: str
    send: trio.MemorySendChannel[dict[str, Any]]
    ends_in_s: float
    """The certificate's remaining life: the session closes when it ends, and the
    node opens the next one with its renewed certificate."""
    replaced: bool = False
    daemon_version: str = ""
    """The Hello's, bounded and printable (``""``: none), reported upstream."""
    slot: int = 0
    """Which of the pinger's PING_SLOTS slots pings this session."""
    ping_queued: bool = False
    expired: bool = False
    closed: bool = False
    checked_at: float = 0.0
    """When its certificate was found live (trio's clock)."""
    direct: DirectWrite = field(default_factory=DirectWrite)
    """The pinger's way to send a ping at once while the stream waits (no task wake)."""
    ending: bool = False
    """Told its end (a drain, a revocation notice): no ping goes ahead of it."""
    notice_told: tuple[float, float] | None = None
    """A revocation notice queued: (its latency then, the database's clock; when, trio's
    clock), for ``bc_revocation_written_seconds`` once it is written."""


Handler = Callable[[Request], Awaitable[Response]]


async def answering(fn: Callable[[], Awaitable[Response]]) -> Response:
    """Run a node call; its refusal or error becomes the protocol's ``{code, message}``."""
    try:
        return await fn()
    except Refused as exc:
        return error_response("ACCESS_DENIED", exc.message)
    except ControlError as exc:
        headers = []
        if exc.retry_after_ms is not None:
            headers.append(("retry-pushback-ms", str(exc.retry_after_ms)))
        return error_response(exc.code, exc.message, headers, details=exc.details)


@dataclass
class NodeCalls:
    """Join, renewal and vouch: what needs JoinService's keys or writes admission state."""

    store: Store
    joinservice: JoinService
    renewservice: renewal.RenewService
    limiter: trio.CapacityLimiter
    metrics: Metrics = field(default_factory=Metrics)

    async def _run(self, fn: Callable[[Tx], T]) -> T:
        return await _in_tx(self.store, self.limiter, fn)

    async def handle(self, req: Request) -> Response:
        response = await answering(lambda: self._dispatch(req))
        if response.status == 429 and req.path in _LIMIT_OF_PATH:
            self.metrics.limit_hit(_LIMIT_OF_PATH[req.path])
        return response

    async def _dispatch(self, req: Request) -> Response:
        if req.method == "POST" and req.path == "/v1/join":
            return await self._join(req)
        if req.method == "POST" and req.path == "/v1/renew":
            return await self._renew(req)
        if req.method == "POST" and req.path == discovery.VOUCH_PATH:
            return await self._vouch(req)
        if req.method == "POST" and req.path == nodefacts.SESSIONS_PATH:
            return await self._sessions_seen(req)
        return error_response("NOT_FOUND", "no such path")

    async def _sessions_seen(self, req: Request) -> Response:
        """A gateway's report of the sessions it holds (:mod:`control.nodefacts`). Only a
        gateway reaches this: in one process the Gateway itself, split the relay
        listener, which takes it from a verified relay certificate only; the
        gateway's node-facing front door never passes it on."""
        try:
            seen = nodefacts.parse_report(wire.loads_object(req.body))
        except wire.WireError as exc:
            raise ControlError("INVALID_ARGUMENT", f"malformed session report: {exc}") from exc
        answer = await self._run(lambda tx: nodefacts.record_sessions(tx, seen))
        return Response(200, wire.dumps(answer), [("content-type", "application/json")])

    async def _join(self, req: Request) -> Response:
        join = functools.partial(self.joinservice.join, req.body, peer_ip=peer_host(req.remote))
        signed = await trio.to_thread.run_sync(join, limiter=self.limiter)
        return Response(200, signed.encode("ascii"), [("content-type", "application/jose")])

    async def _renew(self, req: Request) -> Response:
        der = client_certificate(req)

        def renew() -> str:
            """One worker-thread hop and one transaction: the client certificate's
            liveness, the node's rate, then RenewService's own checks (was two
            transactions, and before that three hops and three)."""
            try:
                return self.renewservice.renew_live(req.body, der)
            except renewal.NotLive as dead:
                raise not_live(dead.details) from None

        signed = await trio.to_thread.run_sync(renew, limiter=self.limiter)
        return Response(200, signed.encode("ascii"), [("content-type", "application/jose")])

    async def _vouch(self, req: Request) -> Response:
        """A site agent vouches for a machine that booted on its site (discovery).

        The vouch carries the site agent's proof of possession (``client_time``,
        ``pop_sig``): a relaying gateway sees the certificate, never the key, so the
        certificate alone does not vouch (docs/decisions.md).
        """
        node_id = (await live_peer(self.store, self.limiter, req)).node_id
        try:
            obj = wire.loads_object(req.body)
            proof = discovery.parse_vouch_proof(obj, node_id, req.peer_cert_der)
            vouch = discovery.parse_vouch(proof.fields)
        except wire.WireError as exc:
            raise ControlError("INVALID_ARGUMENT", f"malformed vouch: {exc}") from exc
        answer = await self._run(lambda tx: discovery.record_vouch(tx, node_id, vouch, proof))
        return Response(200, wire.dumps(answer), [("content-type", "application/json")])


class Offload(Protocol):
    """How a store call leaves the event loop (the store is synchronous)."""

    def __call__(self, fn: Callable[[], T], limiter: trio.CapacityLimiter) -> Awaitable[T]: ...


async def in_worker_thread(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """The default: a worker thread, at most ``limiter``'s many at once."""
    return await trio.to_thread.run_sync(fn, limiter=limiter)


async def inline(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """On the event loop itself: for tests under ``trio.testing.MockClock``, whose
    autojump must not run while a worker thread holds the store."""
    async with limiter:
        return fn()


async def _in_tx(
    store: Store,
    limiter: trio.CapacityLimiter,
    fn: Callable[[Tx], T],
    offload: Offload = in_worker_thread,
) -> T:
    def work() -> T:
        with store.tx() as tx:
            return fn(tx)

    return await offload(work, limiter)


def client_certificate(req: Request) -> bytes:
    """The request's client certificate (DER), else UNAUTHENTICATED."""
    if req.peer_cert_der is None:
        raise ControlError("UNAUTHENTICATED", "a node client certificate is required")
    return req.peer_cert_der


async def live_peer(
    store: Store,
    limiter: trio.CapacityLimiter,
    req: Request,
    offload: Offload = in_worker_thread,
) -> renewal.LivePeer:
    """The request's client certificate as a live node certificate, else
    UNAUTHENTICATED (:func:`not_live`)."""
    der = client_certificate(req)
    peer, details = await _in_tx(
        store, limiter, lambda tx: renewal.live_peer_or_details(tx, der), offload
    )
    if peer is None:
        raise not_live(details)
    return peer


def not_live(details: dict[str, str]) -> ControlError:
    """The UNAUTHENTICATED answer to a client certificate that is not live
    (:func:`control.renewal.live_peer_or_details`'s details beside code and message)."""
    unknown = details.get("reason") == renewal.UNKNOWN_CERTIFICATE
    return ControlError(
        "UNAUTHENTICATED",
        renewal.UNKNOWN_MESSAGE if unknown else "this certificate is not a live node certificate",
        details=details,
    )


@dataclass
class Gateway:
    store: Store
    upstream: Handler
    limiter: trio.CapacityLimiter
    ready: Callable[[], Awaitable[tuple[bool, str]]] | None = None
    ping_interval_s: float = PING_INTERVAL_S
    offload: Offload = in_worker_thread
    sessions: dict[str, list[_Session]] = field(default_factory=dict)
    by_node: dict[str, list[_Session]] = field(default_factory=dict)
    _poked: trio.Event = field(default_factory=trio.Event)
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    reports: Handler | None = None
    """Where session sightings go (:mod:`control.sessionreport`); None: ``upstream``."""
    reporter: SessionReporter = field(init=False)
    _slots: list[set[_Session]] = field(init=False)
    _slot_next: int = field(default=0, init=False)
    _ends: list[tuple[float, int, _Session]] = field(default_factory=list, init=False)
    """A heap of (certificate end, tie-break, session): the pinger ends each session then."""
    _ends_closed: int = field(default=0, init=False)
    """How many sessions in ``_ends`` are closed (compacted when they are half)."""
    _ends_seq: Any = field(default_factory=itertools.count, init=False)
    _revoked: dict[str, tuple[int, float]] = field(default_factory=dict, init=False)
    """serial → (revoked_at, when the poller found it) of the revocations found lately:
    a session registered after its revocation was found ends at once
    (:meth:`_register`)."""

    def __post_init__(self) -> None:
        self._slots = [set() for _ in range(PING_SLOTS)]
        self.reporter = SessionReporter(
            self.reports or self.upstream, self._live_sightings, self.metrics
        )
        # read at a scrape: always what the gateway holds, however a stream ended
        self.metrics.sessions_live.set_function(
            lambda: sum(len(peers) for peers in self.sessions.values())
        )

    def _live_sightings(self) -> list[tuple[str, str]]:
        """(serial, daemon version) of every session open now (the periodic re-report)."""
        return [(serial, peers[-1].daemon_version)
                for serial, peers in self.sessions.items() if peers]  # fmt: skip

    def poke(self) -> None:
        """Look for revocations now (one was made through this process, or notified)."""
        self._poked.set()

    def _replace_older(self, new: _Session) -> None:
        """A new session replaces the older ones: every one of the same certificate, and
        the oldest of its node's beyond MAX_SESSIONS_PER_NODE - 1 (docs/decisions.md)."""
        older = list(self.sessions.get(new.serial, []))
        of_node = [s for s in self.by_node.get(new.node_id, []) if s not in older]
        older += of_node[: max(0, len(of_node) - (MAX_SESSIONS_PER_NODE - 1))]
        for session in older:
            if session.replaced:
                continue
            session.replaced = True
            log.info(
                "a session of %s is replaced by a newer one",
                session.node_id,
                extra={"event": "session.replaced", "node_id": session.node_id,
                       "serial": session.serial},
            )  # fmt: skip
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError,
                                     trio.ClosedResourceError):  # fmt: skip
                session.send.send_nowait(_DRAIN)

    def drain(self) -> None:
        """End every session with a clean end of stream; refuse new ones."""
        self.draining = True
        for peers in list(self.sessions.values()):
            for session in peers:
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError,
                                         trio.ClosedResourceError):  # fmt: skip
                    session.send.send_nowait(_DRAIN)

    async def _run(self, fn: Callable[[Tx], T]) -> T:
        return await _in_tx(self.store, self.limiter, fn, self.offload)

    async def handle(self, req: Request) -> Response:
        if req.method == "GET" and req.path in ("/healthz", "/readyz"):
            return await self.health(req.path)
        if req.method == "POST" and req.path == "/v1/session":
            return await answering(lambda: self._session(req))
        if req.method == "POST" and req.path in _UPSTREAM_PATHS:
            return await answering(lambda: self.upstream(req))
        return error_response("NOT_FOUND", "no such path")

    async def health(self, path: str) -> Response:
        if path == "/healthz":
            return health_response(True, "alive")
        if self.draining:
            return health_response(False, "draining")
        if self.ready is None:
            return health_response(True, "ready")
        ok, reason = await self.ready()
        return health_response(ok, reason)

    async def _session(self, req: Request) -> Response:
        if self.draining:
            raise ControlError("UNAVAILABLE", "this gateway is shutting down", retry_after_ms=1_000)
        checked_at = trio.current_time()  # before the check reads the store
        peer = await live_peer(self.store, self.limiter, req, self.offload)
        node_id, serial = peer.node_id, peer.serial
        try:
            hello = wire.parse_hello(wire.loads_object(req.body))
        except wire.WireError as exc:
            raise ControlError("INVALID_ARGUMENT", f"malformed Hello: {exc}") from exc
        if hello.node_id != node_id:
            raise ControlError("ACCESS_DENIED", "the Hello names another node")
        send, receive = trio.open_memory_channel[dict[str, Any]](8)
        version = nodefacts.printable_version(hello.daemon_version)
        session = _Session(node_id, serial, send, max(0.0, peer.remaining_ms / 1000),
                           daemon_version=version, checked_at=checked_at)  # fmt: skip
        self.metrics.session_opens.inc()
        self.reporter.seen(serial, version)  # queued: never delays the session
        session_id = "sess_" + secrets.token_hex(8)
        journal_id = wire.printable(hello.journal_id)  # the node's text: no line breaks
        log.info(
            "session %s open for %s (journal %s, daemon %s)",
            session_id,
            node_id,
            journal_id,
            version,
            extra={"event": "session.opened", "session_id": session_id, "node_id": node_id,
                   "serial": serial, "journal_id": journal_id,
                   "daemon_version": version},
        )  # fmt: skip
        return Response(
            200,
            headers=[("content-type", "application/x-ndjson")],
            stream=self._stream(session, session_id, receive),
            direct=session.direct,
        )

    def _register(self, session: _Session) -> None:
        """Put a new session in the indexes the pinger, the revocation poller and the
        replacement rule read; :meth:`_stream`'s finally takes it out of them.

        Its certificate was found live some time ago: if the poller has found its
        revocation since (with no session to tell), the session ends after its welcome
        with a clean end of stream, and its node's next dial is answered
        UNAUTHENTICATED with the signed notice. On the event loop, with no wait between
        the two, so a revocation is either found by the poller after this (the session
        is in ``sessions``) or was found before it: after ``checked_at``, which is
        taken before the check reads the store, so it is still in ``_revoked``, kept
        SESSION_OPEN_MAX_S at least, and a session registered later than that ends
        anyway. Its certificate's end counts from ``checked_at`` too."""
        # the slot pinged last: its next ping is a whole interval away
        session.slot = (self._slot_next - 1) % PING_SLOTS
        self._slots[session.slot].add(session)
        heapq.heappush(
            self._ends, (session.checked_at + session.ends_in_s, next(self._ends_seq), session)
        )
        self._replace_older(session)
        self.sessions.setdefault(session.serial, []).append(session)
        self.by_node.setdefault(session.node_id, []).append(session)
        if session.serial in self._revoked and self._end(session, _DRAIN):
            log.info(
                "a session of %s opened as its certificate %s was revoked: ended, so its "
                "node redials and is told",
                session.node_id,
                session.serial,
                extra={"event": "session.revoked_at_open", "node_id": session.node_id,
                       "serial": session.serial},
            )  # fmt: skip

    async def _stream(
        self,
        session: _Session,
        session_id: str,
        receive: trio.MemoryReceiveChannel[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        # No cancel scope here: the pinger (:meth:`pinger`) sends the pings and ends the
        # session at its certificate's end, so an idle session costs no timer of its own.
        # Registered only once the body starts: a node that resets the connection before
        # the answer's head is written leaves nothing behind (a generator never started
        # never runs its finally).
        self._register(session)
        try:
            yield _line({"type": "welcome", "session_id": session_id})
            if session.ends_in_s <= 0:
                return
            if trio.current_time() - session.checked_at > SESSION_OPEN_MAX_S:
                return  # checked too long ago: the node redials and is checked again
            while not (self.draining or session.replaced or session.expired):
                try:
                    notice = await receive.receive()
                except trio.EndOfChannel:
                    return  # ended by :meth:`_end` with its queue full
                if notice is _PING:
                    session.ping_queued = False
                    if self.draining:
                        return
                    yield _PING_LINE
                    continue
                if notice is _DRAIN:
                    return  # a clean end of stream: the node redials
                yield _line(notice)  # resumed once the body's loop has written it
                if notice.get("type") == "revocation":
                    if session.notice_told is not None:
                        latency, told_at = session.notice_told
                        written = latency + trio.current_time() - told_at
                        self.metrics.revocation_written.observe(written)
                    return
        finally:
            session.closed = True
            receive.close()  # what is told to it from now on is refused, not counted
            self._slots[session.slot].discard(session)
            if not session.expired:  # still in the heap, until its end or a compaction
                self._ends_closed += 1
            if self._ends_closed > len(self._ends) // 2 + 1024:  # keep the heap to the live
                self._ends = [e for e in self._ends if not e[2].closed]
                heapq.heapify(self._ends)
                self._ends_closed = 0
            for index, key in ((self.sessions, session.serial), (self.by_node, session.node_id)):
                peers = index.get(key, [])
                if session in peers:
                    peers.remove(session)
                if not peers:
                    index.pop(key, None)
            log.info(
                "session %s closed",
                session_id,
                extra={"event": "session.closed", "session_id": session_id,
                       "node_id": session.node_id, "serial": session.serial},
            )  # fmt: skip

    async def pinger(self) -> None:
        """Ping every session once per ``ping_interval_s``, one slot of them per step, and
        end each session when its certificate ends: one ticker for all the sessions."""
        step = self.ping_interval_s / PING_SLOTS
        next_at = trio.current_time()
        while True:
            next_at = max(next_at + step, trio.current_time())  # behind: no burst
            await trio.sleep_until(next_at)
            now = trio.current_time()
            while self._ends and self._ends[0][0] <= now:
                session = heapq.heappop(self._ends)[2]
                if session.closed:
                    self._ends_closed -= 1
                else:
                    session.expired = True  # out of the heap
                    self._end(session, _DRAIN)
            for session in self._slots[self._slot_next]:
                if session.ping_queued or self.draining:
                    continue
                # at once while its stream waits (the common case); else queued, and
                # behind an end already told (it is never sent then), as before
                if session.ending or session.replaced or not session.direct.try_write(_PING_LINE):
                    session.ping_queued = self._tell(session, _PING)
            self._slot_next = (self._slot_next + 1) % PING_SLOTS

    @staticmethod
    def _tell(session: _Session, what: dict[str, Any]) -> bool:
        """Queue ``what`` on a session's stream; False when it is full or gone."""
        try:
            session.send.send_nowait(what)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    @staticmethod
    def _end(session: _Session, what: dict[str, Any]) -> bool:
        """Queue ``what``, which ends a session (a drain, a revocation notice); with the
        session's queue full, close the queue instead, so the session still ends once
        what is queued is sent (its node redials and is checked, or told). False when
        the session is gone."""
        session.ending = True
        try:
            session.send.send_nowait(what)
        except trio.WouldBlock:
            session.send.close()
            return what is _DRAIN
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def _start_time(self, interval_s: float) -> int:
        """The database's time now, waiting for a database that is down at start."""
        logged = False
        while True:
            try:
                return await self._run(lambda tx: tx.now_ms())
            except StoreUnavailable:
                if not logged:
                    log.warning("revocation poll: the database is unavailable; waiting for it")
                logged = True
                await trio.sleep(interval_s)

    async def revocation_poller(self, *, interval_s: float = REVOCATION_POLL_S) -> None:
        """Push a RevocationNotice to every live session whose certificate was revoked."""
        since = await self._start_time(interval_s)
        seen = self._revoked
        store_down = False
        while True:
            with trio.move_on_after(interval_s):
                await self._poked.wait()
            self._poked = trio.Event()
            # revoked_at is the revoking transaction's start: look back further than any
            # transaction can last, so one committed late is still found; ``seen``
            # keeps a revocation from being sent twice.
            mark = since - renewal.REVOKED_SINCE_OVERLAP_MS
            held = frozenset(self.sessions)  # the serials whose notices are read too
            try:
                rows, notices, now_ms = await self._run(
                    functools.partial(_revoked_and_now, since_ms=mark, held=held)
                )
            except StoreUnavailable:  # catch up from ``since`` once it answers again
                if not store_down:
                    log.warning("revocation poll: the database is unavailable; retrying")
                store_down = True
                continue
            except Exception:
                log.exception("revocation poll failed")
                continue
            if store_down:
                log.info("revocation poll: the database answers again; caught up")
            store_down = False
            found_at = trio.current_time()
            for row in rows:
                at = int(row["revoked_at"])
                since = max(since, at)
                if row["serial"] in seen:
                    continue
                seen[row["serial"]] = (at, found_at)
                for session in list(self.sessions.get(row["serial"], [])):
                    self._tell_revoked(session, row, notices.get(str(row["serial"])), now_ms)
            for serial, (at, found) in list(seen.items()):
                if at < mark - 1000 and found_at - found > SESSION_OPEN_MAX_S:
                    del seen[serial]

    def _tell_revoked(self, session: _Session, row: Row, signed: str | None, now_ms: int) -> None:
        """Push the revocation's signed notice to a session; without one (the session
        opened while the poll read the store, or none is stored) end the session: its
        node's redial is answered UNAUTHENTICATED with the notice."""
        at = int(row["revoked_at"])
        if signed is None:
            if self._end(session, _DRAIN):
                log.info(
                    "a session of %s ended: its certificate %s was revoked",
                    session.node_id,
                    row["serial"],
                    extra={"event": "revocation.session_ended", "node_id": session.node_id,
                           "serial": row["serial"]},
                )  # fmt: skip
            return
        notice = {
            "type": "revocation",
            "reason": row["revoke_reason"] or "revoked",
            "serial": row["serial"],
            "notice": signed,  # signed where it was revoked
        }
        if not self._end(session, notice):
            log.warning(
                "could not push a revocation to a session of %s (its queue full, or it "
                "closed): it ends, and its node is told when it redials",
                session.node_id,
            )
            return
        latency = max(0, now_ms - at) / 1000
        session.notice_told = (latency, trio.current_time())
        self.metrics.revocations_pushed.inc()
        self.metrics.revocation_delivery.observe(latency)
        log.info(
            "revocation of %s pushed to a session of %s",
            row["serial"],
            session.node_id,
            extra={"event": "revocation.pushed", "node_id": session.node_id,
                   "serial": row["serial"], "reason": notice["reason"],
                   "latency_s": latency},
        )  # fmt: skip


def _revoked_and_now(
    tx: Tx, since_ms: int, held: frozenset[str]
) -> tuple[list[Row], dict[str, str | None], int]:
    """The revocations since ``since_ms``, the signed notices of those among ``held``
    (the serials this gateway holds sessions of), and the database's time (delivery
    latency): one transaction, so a store that goes away cannot come between them."""
    rows = renewal.revoked_since(tx, since_ms=since_ms)
    notices = renewal.revoke_notices(tx, [str(r["serial"]) for r in rows if r["serial"] in held])
    return rows, notices, tx.now_ms()


def peer_host(remote: str) -> str | None:
    """The normalised IP address of ``host:port`` / ``[v6]:port`` (None if it is not one)."""
    host = remote.rpartition(":")[0].strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
