"""The fleet simulator: N nodes, each a real bcd identity held in memory, against a real
control plane (an API replica and gateways as processes, on PostgreSQL).

Run from the repository root::

    .venv/bin/python bench/fleet.py --nodes N [--procs P] [--gateways G]
        [--concurrency C] [--ping-seconds S] [--steady-pings K] [--cert-ttl S]
        [--revocations R] [--probe-nodes K] [--skip-renewal] [--no-vacuum] [--out DIR]
        [--profile] [--instructions]

It prints figures and judges nothing (every phase prints its error count, which should
be 0); ``tests/test_fleet_sim.py`` runs it small and checks only that outcome.

**The control plane.** ``bench.replicas.bench_fleet``: one API replica (``serve --role
api --relay-listen``) and G gateways (``serve --role gateway``), each with its own
PostgreSQL ``application_name`` so the CPU of its backends reads apart, on a fresh
schema dropped afterwards. Certificates are short (``--cert-ttl-seconds``, default
1800 s, or 72 ms a node where that is longer: 7,200 s at N = 100,000) and the gateways ping every ``--session-ping-seconds`` (``--ping-seconds``,
default 2 s up to N = 1,400, N/700 s above, at most 30 s; production pings every 15 s)
so a run sees several pings and the simulators keep up with them.

**The nodes.** P simulator processes (this file with ``--worker``), each holding N/P
nodes. A node is a real bcd identity: its own P-256 key and certificate from a real
join, in a :class:`bcd.identitystore.MemoryStore`, loaded with
:func:`bcd.identity.load_from`. It talks through bcd's own code only: the join is
:func:`bcd.join.send_with_retries` over :func:`bcd.join.gateway_sender` (bcd's own
backoff and the server's pushback, the token sealed anew for each attempt; a retried
attempt counts as "retried join", not as an error) and :func:`bcd.join.verify_joined`;
the session is :func:`bcd.session.session_task` (its own reconnect backoff, 1 s
doubling to 60 s with jitter, and its check of the signed revocation notice); the
renewal is
:func:`bcd.renew.renew_once` over :func:`bcd.renew.gateway_renew_sender` (the store
written as bcd writes it). All over :mod:`bcd.transport` and real TLS.

Two seams of trio stand in for the network: the k-th node of a simulator process has
``gateway_url`` ``https://gw<k mod G>.fleet`` and a hostname resolver maps that name to its gateway
while it lives, and to the other gateways (round robin) once it is dead: a load
balancer's health check. A socket factory binds each node's connections to its own
loopback address (127.100.0.1 on), as each machine of a fleet has its own address: the
gateway admits at most 1,024 connections per source address.

**The phases**, each timed, each with its error count:

1. *join storm*: N joins, C at a time per simulator process, on P*C join tokens (a
   token's row is locked for the whole of its join) with ``maxUses``, over the pools
   of ``--sites`` sites;
2. *sessions*: every node opens its session (4*C opening at a time per process), then all
   are held ``--steady-pings`` ping intervals: the gateways' RSS growth over the
   sessions and their CPU per session-second;
3. *renewal wave*: every node renews once (C at a time per process), its session staying
   up on the old certificate;
4. *revocations*: R random nodes (default min(200, N/10)) revoked through the API replica
   (4 calls at a time), drawn from N from 10,000 on from the probe's nodes, a light
   simulator process of their own (``--probe-nodes``, :func:`probe_default`); latency from the call to the moment the node's session task
   raised ``CertificateRevoked`` (the signed revocation line); no other session may drop.
   Beside it, apart: the gateways' own share, from the revoking transaction's
   ``revoked_at`` to the notice queued on the session (their
   ``bc_revocation_delivery_seconds`` over the phase, quantiles interpolated within its
   buckets, and the notices pushed), and the call's start to the moment each node's bcd
   had verified the signed notice (its "certificate revoked" log record, timed in the
   simulator): what is left is the simulator receiving the line, checking it and ending
   the session, on a process that holds N/P nodes (the probe's 1,000, with a probe);
5. *gateway restart*: ``kill -9`` of gw1; its nodes redial with bcd's backoff, through
   the others; the time until each of the sessions gw1 held (counted by the simulators
   before the kill) was lost and every live node holds a session again, and the
   reconnect rate over time.

A simulator process is N/P machines on part of two shared cores: a node's session dial
(the first and every redial) waits for one of 4*C slots of its process, held until the
welcome or the failure, so that the 1/G of the fleet redialling after a kill does not
make every handshake of the process slower than the gateway's 5 s handshake timeout
(each would fail: the simulator would measure its own CPU). A redial waiting longer than
bcd's 15 s connect timeout fails as "timed out" and backs off, having done no work. A
simulator's event loop running over a second late, or a garbage collection over 0.5 s,
is logged (``BCD_FLEET_LOG=WARNING``): a simulator starved that long makes its
handshakes outlast the gateway's timeout, and under TLS 1.3 a client's handshake is
over before the gateway has read its certificate, so the node sees "the connection to
… broke" at its first read (what the renewal wave retries).

``--instructions`` starts every ``serve`` under valgrind's callgrind and reads each
process's instructions over each phase (``callgrind_control --dump`` at its start and
end): instructions per join, session opened, idle session-second and renewal, and per
join and renewal over the raw floor's instructions (``bench/join.py`` and
``bench/renew.py``'s floor loops under callgrind). User-space instructions only (the
kernel's TLS socket work and PostgreSQL's backends are not counted); about 50 times
slower, so a small N (e.g. ``--nodes 200 --procs 1 --concurrency 4 --ping-seconds
10``), whose CPU and latency figures are valgrind's.

CPU: utime + stime from ``/proc`` of the API replica, each gateway and their PostgreSQL
backends, over each phase; PostgreSQL transactions are ``pg_stat_database``'s
``xact_commit`` delta of the database (other users of the database count too), and each
phase names the run schema's tables its sequential scans read most, with the rows read
and the index scans (``pg_stat_user_tables``, which each backend publishes up to about
a second late, so a short phase may count a neighbour's; in the JSON under
``phases``). On a server whose autovacuum is off (this machine's), the run does what
it would: ``VACUUM (ANALYZE)`` of its schema every 30 s, that backend's CPU apart
(``pg_vacuum_cpu_s``; None when autovacuum is on and does it). The
figures go to ``DIR/fleet-N.json`` and the plot to ``DIR/fleet-N.png`` (``--out``,
default ``bench/out``).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import gc
import itertools
import json
import logging
import math
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402
import trio  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from psycopg import sql  # noqa: E402

from bcd import pki, wire  # noqa: E402
from bcd.config import Config  # noqa: E402
from bcd.errors import BcdError, CertificateRevoked, TransportError  # noqa: E402
from bcd.identity import AnyState, MemoryStore, load_from  # noqa: E402
from bcd.identitydoc import IDENTITY_FILE, NODE_KEY_FILE  # noqa: E402
from bcd.issued import issued_identity  # noqa: E402
from bcd.join import gateway_sender, send_with_retries, verify_joined  # noqa: E402
from bcd.keys.file import key_to_pem  # noqa: E402
from bcd.renew import gateway_renew_sender, renew_once  # noqa: E402
from bcd.servingca import serving_ca  # noqa: E402
from bcd.session import SessionInfo, session_task  # noqa: E402
from bench.common import (  # noqa: E402
    PG_URL,
    SERVER_NAME,
    join_body,
    machine_claims,
    pg_backends_cpu_s,
    print_environment,
    proc_cpu_s,
)
from bench.replicas import Meter, Roles, Spent, bench_fleet, pct  # noqa: E402
from control.metrics import HANDSHAKE_OUTCOMES  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out"
TICK_S = 0.25
DIAL_SLOTS = 4  # session dials at a time per simulator process, times --concurrency
RENEW_TRIES = 3
FULL_COLLECTIONS_AFTER = 1_000_000
"""A simulator process's third ``gc`` threshold (young collections before a full one):
no full collection runs by itself, only :func:`settle`'s between phases. A full
collection walks every object of the oldest generation not yet frozen, and at N =
100,000 (12,500 nodes a process, 8 processes on 2 cores) they grew with the join storm
from 0.7 to 6.9 s each (324 of them, 653 s in all in the first 31 minutes), stopping the
process past the gateway's 5 s handshake bound. What a phase leaves unreachable in
cycles waits for the phase's end. (Without them the sessions phase at 100,000 still
stalls near 36,000 sessions on this 2-core machine: the simulators' pings and dials
take the cores; docs/decisions.md, the fourth session.) A real node is its own process
with one identity, where none of this arises."""
FREEZE_EVERY = 1_000
"""Within the renewal wave and the sessions phase, the objects alive are frozen
(``gc.freeze``, no collection) after every this many renewals (or sessions welcomed) of
a process, so no full collection inside the phase walks all its nodes' new states (at
10,000 nodes a process they stopped it 4-8 s in the renewal wave; at N = 100,000, 8
processes of 12,500 nodes, 7 s stalls in the sessions phase failed the handshakes of
the dials under way, whose redials made more garbage, until no session opened)."""
SAMPLE_S = 0.5
FILE_LIMIT = 20_000
GATEWAY_SESSIONS_MAX = 16_000  # control.server.LIMITS["gateway"].max_connections
VACUUM_S = 30.0
"""How often :class:`Vacuumer` vacuums and analyzes the run's schema (autovacuum off)."""
TABLES_SHOWN = 4
"""The tables each phase's line names, by the rows sequential scans read."""
PHASES = ("join", "sessions", "steady", "renewal", "revocation", "restart")


# --- the simulator process ------------------------------------------------------------

log = logging.getLogger("fleet")
SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("source", default=None)
SESSION: contextvars.ContextVar[SimNode | None] = contextvars.ContextVar("session", default=None)
"""The node whose session task is dialling (unset in joins and renewals)."""


def source_address(i: int) -> str:
    """Node ``i``'s own loopback address: 127.100.0.1, 127.100.0.2, …"""
    n = i + 1
    return f"127.{100 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"


class SourceSockets(trio.abc.SocketFactory):
    """Sockets bound to the calling node's address (the ``SOURCE`` context variable)."""

    def socket(
        self,
        family: socket.AddressFamily | int = socket.AF_INET,
        type: socket.SocketKind | int = socket.SOCK_STREAM,
        proto: int = 0,
    ) -> trio.socket.SocketType:
        sock = socket.socket(family, type, proto)
        src = SOURCE.get()
        if src is not None and family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, 24, 1)  # IP_BIND_ADDRESS_NO_PORT
            sock.bind((src, 0))
        return trio.socket.from_stdlib_socket(sock)


class Balancer(trio.abc.HostnameResolver):
    """``gw<k>.fleet`` is gateway k while it lives, else the live ones in turn."""

    def __init__(self, ports: list[int], gate: Callable[[], Awaitable[None]] | None = None) -> None:
        self.ports = ports
        self.dead: set[int] = set()
        self._turn = 0
        self.gate = gate

    async def getaddrinfo(
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[tuple[Any, ...]]:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not (name.startswith("gw") and name.endswith(".fleet")):
            raise socket.gaierror(socket.EAI_NONAME, f"unknown host {name}")
        if self.gate is not None:
            await self.gate()
        k = int(name[2:].split(".", 1)[0])
        if k in self.dead:
            live = [g for g in range(len(self.ports)) if g not in self.dead]
            self._turn += 1
            k = live[self._turn % len(live)]
        addr = ("127.0.0.1", self.ports[k])
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]

    async def getnameinfo(self, sockaddr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        raise NotImplementedError


@dataclass(slots=True)
class SimNode:
    i: int  # in the fleet
    k: int  # in this simulator process
    cfg: Config
    source: str
    state: AnyState | None = None
    node_id: str = ""
    up: bool = False
    revoked: bool = False
    verified_at: float | None = None  # when bcd verified its signed revocation notice
    dialing: bool = False  # holds one of the simulator's session-dial slots


@dataclass
class Counters:
    joined: int = 0
    renewed: int = 0
    up: int = 0
    welcomes: int = 0
    losses: int = 0
    revoked: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, phase: str, what: str) -> None:
        key = f"{phase}: {what[:160]}"
        self.errors[key] = self.errors.get(key, 0) + 1


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class Simulator:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.balancer = Balancer(spec["ports"], self._dial_slot)
        self.c = Counters()
        home = Path(spec["home"])
        gateways = len(spec["ports"])
        self.cfgs = []
        for k in range(gateways):
            (home / f"gw{k}").mkdir(parents=True, exist_ok=True)
            self.cfgs.append(
                Config(
                    path=home / f"gw{k}" / "config.toml",
                    gateway_url=f"https://gw{k}.fleet",
                    site=spec["site"],
                    serving_ca_spki_pin=spec["pins"]["serving_ca_spki_pin"],
                    join_signing_key_pin=spec["pins"]["join_signing_key_pin"],
                    join_encryption_key_pin=spec["pins"]["join_encryption_key_pin"],
                    server_name=SERVER_NAME,
                    data_dir=home,
                )
            )
        self.nodes = [
            SimNode(i, k, self.cfgs[k % gateways], source_address(i))
            for k, i in enumerate(spec["indexes"])
        ]
        self.signing_pin = spec["pins"]["join_signing_key_pin"]
        self.concurrency = int(spec["concurrency"])
        self.dials = trio.Semaphore(DIAL_SLOTS * self.concurrency)

    async def _dial_slot(self) -> None:
        """A session's dial waits for one of DIAL_SLOTS * ``concurrency`` slots, held until
        its welcome or its failure (``hold``'s watcher). A real node dials on its own
        machine; here N/P nodes share one process, and thousands of handshakes at once (a
        gateway's nodes after its kill) would each take longer than the gateway's 5 s
        handshake timeout: every one would fail, the simulator measuring its own CPU. 64
        handshakes at a time (about 5 ms of simulator CPU each) stay far within it."""
        node = SESSION.get()
        if node is None or node.dialing:
            return
        await self.dials.acquire()
        node.dialing = True

    def _dial_done(self, node: SimNode) -> None:
        if node.dialing:
            node.dialing = False
            self.dials.release()

    def counts(self) -> dict[str, Any]:
        c = self.c
        return {
            "joined": c.joined, "renewed": c.renewed, "up": c.up, "welcomes": c.welcomes,
            "losses": c.losses, "revoked": c.revoked,
        }  # fmt: skip

    async def ticker(self) -> None:
        """The counters every TICK_S; a warning when this process's event loop ran more
        than a second late (it is starved: what it measures is its own CPU)."""
        while True:
            emit({"ev": "tick", "t": time.monotonic(), **self.counts()})
            due = time.monotonic() + TICK_S
            await trio.sleep(TICK_S)
            late = time.monotonic() - due
            if late > 1.0:
                log.warning("the simulator's event loop ran %.1f s late", late)

    async def each(self, work: Callable[[SimNode], Any]) -> None:
        """``work`` on every node, ``concurrency`` at a time, each in its node's address."""
        nodes = iter(self.nodes)

        async def worker() -> None:
            for node in nodes:
                SOURCE.set(node.source)
                await work(node)

        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(worker)

    async def join(self, tokens: list[str], encryption_jwk: dict[str, Any]) -> None:
        key = wire.public_key_of_jwk(encryption_jwk)

        async def one(node: SimNode) -> None:
            seed = 1_000_000 + node.i
            node_key = pki.generate_key()
            csr_der = pki.make_csr(node_key)
            claims = machine_claims(random.Random(seed), seed, 0)
            send = gateway_sender(node.cfg)
            failed: list[str] = []  # each attempt's failure; all but a last one were retried

            async def attempt(body: bytes) -> str:
                try:
                    return await send(body)
                except BcdError as exc:
                    failed.append(f"{type(exc).__name__}: {exc}")
                    raise

            try:
                parsed = wire.parse_token(tokens[node.k % len(tokens)])
                # bcd's own retries (bcd.join.send_with_retries: its backoff, the
                # server's pushback, the token sealed anew on each attempt)
                try:
                    signed = await send_with_retries(
                        attempt, lambda: join_body(parsed, key, csr_der, claims)
                    )
                except BcdError:
                    failed[-1:] = []  # the attempt bcd gave up on is the join's error
                    raise
                finally:
                    for text in failed:
                        self.c.error("retried join", text)
                body = verify_joined(
                    signed,
                    signing_pin=self.signing_pin,
                    csr_der=csr_der,
                    key=node_key.public_key(),
                    role="node",
                )
                if not isinstance(body, wire.Issued) or body.kind != "joined":
                    self.c.error("join", f"the answer is {type(body).__name__}, not joined")
                    return
                identity = issued_identity(body, "file")
                store = MemoryStore(
                    f"node{node.i}",
                    {IDENTITY_FILE: identity.to_json(), NODE_KEY_FILE: key_to_pem(node_key)},
                )
                node.state = load_from(store)
                node.node_id = identity.node_id
                self.c.joined += 1
            except BcdError as exc:
                self.c.error("join", f"{type(exc).__name__}: {exc}")

        await self.each(one)

    async def hold(self, node: SimNode) -> None:
        """Node's session, as bcd node keeps it; note welcomes, losses, the revocation.
        Each dial takes a slot of ``_dial_slot``: the first one here, so no timeout of
        bcd runs while it waits; a redial inside bcd's connect timeout (15 s), so a
        redial that waits longer fails as "timed out" and backs off (it did no work)."""
        SOURCE.set(node.source)
        SESSION.set(node)
        await self.dials.acquire()
        node.dialing = True

        async def watch(up: bool) -> None:
            self._dial_done(node)
            if up and not node.up:
                node.up = True
                self.c.up += 1
                self.c.welcomes += 1
                if self.c.welcomes % FREEZE_EVERY == 0:
                    gc.freeze()  # as in the renewal wave: no full walk of the held sessions
            elif not up and node.up:
                node.up = False
                self.c.up -= 1
                self.c.losses += 1

        def current() -> AnyState:
            assert node.state is not None
            return node.state

        info = SessionInfo(str(uuid.uuid4()), str(uuid.uuid4()))
        try:
            await session_task(node.cfg, current, info, on_session=watch)
        except CertificateRevoked:
            emit({"ev": "revoked", "node": node.node_id, "t": time.monotonic(),
                  "v": node.verified_at})  # fmt: skip
            node.revoked = True
            self.c.revoked += 1
        except BcdError as exc:
            self.c.error("session", f"{type(exc).__name__}: {exc}")
        finally:
            if node.up:
                node.up = False
                self.c.up -= 1
            self._dial_done(node)

    async def renew(self) -> None:
        async def one(node: SimNode) -> None:
            state = node.state
            if state is None or node.revoked:
                return
            # renewal_task retries a failed renewal (after 30 s, doubling); the wave
            # retries a broken connection up to RENEW_TRIES times after 2 s, 4 s, and
            # reports how many it retried apart from the errors
            for attempt in range(1, RENEW_TRIES + 1):
                began = time.monotonic()
                try:
                    node.state = await renew_once(
                        state,
                        gateway_renew_sender(node.cfg, state),
                        signing_pin=self.signing_pin,
                        wall=time.time,
                    )
                    self.c.renewed += 1
                    if self.c.renewed % FREEZE_EVERY == 0:
                        gc.freeze()  # no collection (no pause): the next ones skip these
                    return
                except TransportError as exc:
                    if attempt == RENEW_TRIES:
                        self.c.error("renewal", f"{type(exc).__name__}: {exc}")
                        return
                    self.c.error("retried renewal", f"{type(exc).__name__}: {exc}")
                    log.warning("renewal of %s from %s failed after %.2f s (%s); retrying",
                                node.node_id, node.source, time.monotonic() - began, exc)  # fmt: skip
                    await trio.sleep(2.0 * attempt)
                except BcdError as exc:
                    self.c.error("renewal", f"{type(exc).__name__}: {exc}")
                    return

        await self.each(one)

    async def run(self) -> None:
        trio.socket.set_custom_hostname_resolver(self.balancer)
        trio.socket.set_custom_socket_factory(SourceSockets())
        for cfg in self.cfgs:  # the serving CA, probed once and kept beside the config
            await serving_ca(cfg)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.ticker)
            emit({"ev": "ready"})
            while True:
                while b"\n" not in buf:
                    chunk = await stdin.receive_some(65536)
                    if not chunk:
                        nursery.cancel_scope.cancel()
                        return
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                what = cmd["cmd"]
                if what == "join":
                    await self.join(cmd["tokens"], cmd["encryption_jwk"])
                    settle()
                    nodes = [[n.i, n.node_id] for n in self.nodes if n.node_id]
                    emit({"ev": "done", "cmd": what, "nodes": nodes, "errors": self.c.errors})
                elif what == "sessions":
                    for node in self.nodes:
                        if node.state is not None:
                            nursery.start_soon(self.hold, node)
                    emit({"ev": "done", "cmd": what})
                elif what == "renew":
                    settle()  # the sessions opened since the join
                    await self.renew()
                    settle()
                    emit({"ev": "done", "cmd": what, "errors": self.c.errors})
                elif what == "dead":  # before the kill: the nodes whose session it holds
                    dead = int(cmd["gateway"])
                    self.balancer.dead.add(dead)
                    held = sum(1 for n in self.nodes if n.up and n.cfg is self.cfgs[dead])
                    emit({"ev": "done", "cmd": what, "held": held, **self.counts()})
                elif what == "stop":
                    emit({"ev": "done", "cmd": what, "errors": self.c.errors})
                    nursery.cancel_scope.cancel()
                    return


def raise_file_limit() -> int:
    """This process's open-file limit raised to its hard limit (a simulator process
    holds a socket per node); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def settle() -> None:
    """Collect, then freeze what is left (``gc.freeze``): between phases, never inside
    one. The nodes' states and sessions live the whole run; left in the oldest
    generation, every full collection walks them all, and at N = 20,000 (6,700 nodes a
    process, a loaded machine) each stopped the simulator 4 to 8 s during the renewal
    wave: longer than the gateway's 5 s handshake timeout, so every renewal handshake in
    flight failed."""
    gc.collect()
    gc.freeze()


def _log_slow_collections() -> None:
    """A warning for each garbage collection that stopped this process over 0.5 s."""
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        elif (took := time.monotonic() - began[0]) > 0.5:
            log.warning("a generation-%d collection took %.1f s", info["generation"], took)

    gc.callbacks.append(timed)


class _VerifiedAt(logging.Filter):
    def __init__(self, keep_from: int) -> None:
        super().__init__()
        self._keep_from = keep_from

    def filter(self, record: logging.LogRecord) -> bool:
        node = SESSION.get()
        if node is not None and str(record.msg).startswith("certificate revoked"):
            node.verified_at = time.monotonic()
        return record.levelno >= self._keep_from


def worker_main() -> int:
    raise_file_limit()

    # bcd's own warnings, 10,000 times over: only with BCD_FLEET_LOG=INFO (or WARNING)
    level = os.environ.get("BCD_FLEET_LOG", "CRITICAL")
    logging.basicConfig(level=level, format="%(relativeCreated)d %(name)s %(message)s")
    # bcd logs "certificate revoked" once the signed notice verified: note the time on
    # the node (its session's context), whatever the level the log is kept at
    noted = logging.getLogger("bcd.revocation")
    noted.setLevel(min(logging.ERROR, logging.getLogger().getEffectiveLevel()))
    noted.addFilter(_VerifiedAt(logging.getLogger().getEffectiveLevel()))
    _log_slow_collections()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTIONS_AFTER)
    spec = json.loads(sys.stdin.readline())
    trio.run(Simulator(spec).run)
    return 0


# --- the driver: workers, sampling, phases ---------------------------------------------


class Worker:
    """One simulator process: commands on its stdin, events read by a thread."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
        )
        self.tick: dict[str, Any] = {}
        self.revoked: dict[str, float] = {}
        self.verified: dict[str, float] = {}
        self._done: dict[str, dict[str, Any]] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._send(spec)
        self.wait("ready", 120)

    def _send(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(doc) + "\n").encode())
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            ev = json.loads(raw)
            with self._cv:
                if ev["ev"] == "tick":
                    self.tick = ev
                elif ev["ev"] == "revoked":
                    self.revoked[ev["node"]] = ev["t"]
                    if ev.get("v") is not None:
                        self.verified[ev["node"]] = ev["v"]
                elif ev["ev"] in ("done", "ready"):
                    self._done[ev.get("cmd", "ready")] = ev
                self._cv.notify_all()
        with self._cv:
            self._done["exit"] = {}
            self._cv.notify_all()

    def command(self, cmd: str, **fields: Any) -> None:
        with self._cv:
            self._done.pop(cmd, None)
        self._send({"cmd": cmd, **fields})

    def wait(self, cmd: str, timeout: float) -> dict[str, Any]:
        with self._cv:
            if not self._cv.wait_for(
                lambda: cmd in self._done or "exit" in self._done, timeout=timeout
            ):
                raise RuntimeError(f"simulator pid {self.proc.pid}: no answer to {cmd}")
            if cmd not in self._done:
                raise RuntimeError(f"simulator pid {self.proc.pid} exited (see its log)")
            return self._done.pop(cmd)

    def count(self, key: str) -> int:
        return int(self.tick.get(key, 0))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.command("stop")
            self.wait("stop", 30)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


def proc_cpu_or_none(pid: int) -> float | None:
    try:
        return proc_cpu_s(pid)
    except (FileNotFoundError, ProcessLookupError):
        return None


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Vacuumer:
    """What autovacuum does, on a server whose autovacuum is off (this machine's is):
    ``VACUUM (ANALYZE)`` of the run schema's tables every VACUUM_S, from one connection
    of its own, whose backend's CPU is counted apart from the roles'
    (``pg_vacuum_cpu_s``). Without it every token and node row a join updates leaves a
    dead version behind and the planner keeps an empty table's plans, so PostgreSQL's
    CPU per join grows with N (docs/fleet.md)."""

    def __init__(self, schema: str, *, wanted: bool = True) -> None:
        self.schema = schema
        self.runs = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SHOW autovacuum").fetchone()
        self.enabled = wanted and row is not None and row[0] == "off"
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.enabled:
            print(f"PostgreSQL's autovacuum is off: VACUUM (ANALYZE) every {VACUUM_S:g} s",
                  flush=True)  # fmt: skip
            self._thread.start()

    def _run(self) -> None:
        with psycopg.connect(
            PG_URL, autocommit=True, connect_timeout=5, application_name="fleet-vacuum"
        ) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            pid = int(row[0]) if row else 0
            start = proc_cpu_or_none(pid) or 0.0
            while not self._stop.wait(VACUUM_S):
                tables = conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s", (self.schema,)
                ).fetchall()
                if not tables:
                    continue
                names = sql.SQL(", ").join(sql.Identifier(self.schema, t[0]) for t in tables)
                try:
                    conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(names))
                except psycopg.Error as exc:  # a figure's help lost, not the run
                    print(f"  (VACUUM failed: {exc})", flush=True)
                    continue
                self.runs += 1
                self.cpu_s = (proc_cpu_or_none(pid) or start) - start

    def stop(self) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(60)


def table_reads(schema: str) -> dict[str, tuple[int, int, int, int]]:
    """Per table of the run's schema: (sequential scans, rows they read, index scans,
    rows those fetched) from ``pg_stat_user_tables`` (PostgreSQL's counters, flushed by
    each backend about once a second)."""
    with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT relname, seq_scan, seq_tup_read, COALESCE(idx_scan, 0), "
            "COALESCE(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE schemaname = %s",
            (schema,),
        ).fetchall()
    return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def xact_commit() -> int:
    with psycopg.connect(PG_URL, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


class Sampler:
    """Every SAMPLE_S: CPU of each role (process + its backends), the workers' counters."""

    def __init__(self, roles: Roles, workers: list[Worker]) -> None:
        self.roles = roles
        self.workers = workers
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(Exception):
                self.samples.append(self.sample())

    def sample(self) -> dict[str, Any]:
        """The processes' CPU, stamped ``t_procs`` as soon as it is read, then
        PostgreSQL's backends, stamped ``t``: on a saturated machine the backends' query
        can take seconds, and a rate of the processes' CPU over the stamps taken after
        it made a peak of 7.5 cores of a 2-core machine (the seventh session's 60,000)."""
        cpu: dict[str, float] = {}
        for k, pid in list(self.roles.pids.items()):
            got = proc_cpu_or_none(pid)
            if got is not None:
                cpu[k] = got
        sims = sum(proc_cpu_or_none(w.proc.pid) or 0.0 for w in self.workers)
        t_procs = time.monotonic() - self.t0
        pg = 0.0
        for app in list(self.roles.apps.values()):
            pg += sum((pg_backends_cpu_s(app) or {}).values())
        counts = {
            key: sum(w.count(key) for w in self.workers)
            for key in ("joined", "renewed", "up", "welcomes", "losses", "revoked")
        }
        return {
            "t": time.monotonic() - self.t0,
            "t_procs": t_procs,
            "cpu": cpu,
            "pg": pg,
            "simulators": sims,
            **counts,
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Phase:
    name: str
    start: float
    end: float = 0.0
    spent: Spent | None = None
    xacts: int = 0
    errors: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    instructions: dict[str, int] = field(default_factory=dict)
    """Per role, valgrind's Ir over the phase (``--instructions``)."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def control_cpu_s(self) -> float:
        assert self.spent is not None
        return sum(self.spent.procs.values()) + sum(
            v for v in self.spent.pg.values() if v is not None
        )

    def pg_cpu_s(self) -> float:
        assert self.spent is not None
        return sum(v for v in self.spent.pg.values() if v is not None)

    def role_cpu(self) -> dict[str, float]:
        assert self.spent is not None
        out = dict(self.spent.procs)
        for k, v in self.spent.pg.items():
            out[f"{k}_pg"] = v or 0.0
        return out


PROFILED_PHASES = ("join", "steady", "renewal", "restart")
PY_SPY = Path(sys.executable).parent / "py-spy"


class Profiler:
    """``py-spy record --nonblocking`` of the API replica, one gateway and one simulator
    over a phase, in raw (collapsed-stack) form; :meth:`top` sums it by function."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled and PY_SPY.exists()
        self._running: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.files: dict[str, Path] = {}

    def start(self, phase: str, pids: dict[str, int]) -> None:
        if not self.enabled or phase not in PROFILED_PHASES:
            return
        for role, pid in pids.items():
            path = self.out / f"profile-{phase}-{role}.txt"
            cmd = [str(PY_SPY), "record", "--nonblocking", "--rate", "50", "-f", "raw",
                   "-o", str(path), "--pid", str(pid)]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._running.append((proc, path))
            self.files[f"{phase}/{role}"] = path

    def stop(self) -> None:
        for proc, _path in self._running:
            proc.send_signal(signal.SIGINT)
        for proc, _path in self._running:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._running = []

    def top(self, limit: int = 6) -> dict[str, dict[str, list[tuple[str, float]]]]:
        """Per profile, as shares of its samples: ``self``, the functions running (the
        leaf frame); ``ours``, the project's functions (bcd/, control/) including what
        they call, entry points left out."""
        out: dict[str, dict[str, list[tuple[str, float]]]] = {}
        for name, path in self.files.items():
            if not path.exists():
                continue
            leaf: dict[str, int] = {}
            ours: dict[str, int] = {}
            total = 0
            for line in path.read_text(errors="replace").splitlines():
                stack, _, count = line.rpartition(" ")
                if not count.isdigit() or not stack:
                    continue
                n = int(count)
                total += n
                frames = [f"{f.split(' (', 1)[0]} {_module(f)}" for f in stack.split(";")]
                leaf[frames[-1]] = leaf.get(frames[-1], 0) + n
                for frame in set(frames):
                    where = frame.rsplit(" ", 1)[-1]
                    if where.startswith(OURS) and not frame.startswith(ENTRY):
                        ours[frame] = ours.get(frame, 0) + n

            def ranked(counts: dict[str, int], total: int = total) -> list[tuple[str, float]]:
                best = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
                return [(f, round(c / max(total, 1), 3)) for f, c in best]

            out[name] = {"self": ranked(leaf), "ours": ranked(ours)}
        return out


OURS = ("bcd/", "control/", "store/", "keys/", "helper/")
ENTRY = ("cmd_serve", "main ", "_run ", "_connection ", "_gated ", "serve ", "_one_session ",
         "session_task ", "renew_once ", "_finish ", "post_as_node ", "handle ")  # fmt: skip


def _module(frame: str) -> str:
    """``(control/joinservice.py:123)`` of a py-spy frame, without the line number."""
    inside = frame.partition(" (")[2].rstrip(")")
    path = inside.rsplit(":", 1)[0]
    parts = Path(path).parts
    return "/".join(parts[-2:]) if parts else ""


class Instructions:
    """Instructions (valgrind's Ir) of each control-plane process over a phase, with
    ``--instructions``: every ``serve`` runs under callgrind, and ``callgrind_control
    --dump`` at a phase's start and end takes its count (a dump resets the counters, so
    the second dump holds the phase's alone). PostgreSQL's backends are not counted."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self._dumps: dict[int, int] = {}

    def wrapper(self) -> list[str]:
        """The command a ``serve`` starts under (``tests.e2e.SERVE_WRAPPER``)."""
        return [
            "valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no",
            f"--callgrind-out-file={self.out}/callgrind-%p",
        ]  # fmt: skip

    def _dump(self, pid: int) -> int | None:
        """Dump ``pid``'s counters; the Ir since its previous dump (None if it is gone)."""
        done = subprocess.run(
            ["callgrind_control", "--dump", str(pid)], capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        if done.returncode != 0 or "OK" not in done.stdout:
            return None
        self._dumps[pid] = self._dumps.get(pid, 0) + 1
        path = self.out / f"callgrind-{pid}.{self._dumps[pid]}"
        try:
            text = path.read_text(errors="replace")
        finally:
            path.unlink(missing_ok=True)
        for line in text.splitlines():
            if line.startswith("totals:"):
                return int(line.split()[1])
        return None

    def clean(self) -> None:
        """Remove what callgrind wrote at each process's exit."""
        if self.enabled:
            for path in self.out.glob("callgrind-*"):
                path.unlink(missing_ok=True)

    def start(self, pids: dict[str, int]) -> None:
        if self.enabled:
            for pid in pids.values():
                self._dump(pid)

    def stop(self, pids: dict[str, int]) -> dict[str, int]:
        """Per role, the instructions since :meth:`start`."""
        if not self.enabled:
            return {}
        got = {role: self._dump(pid) for role, pid in pids.items()}
        return {role: ir for role, ir in got.items() if ir is not None}


class Run:
    def __init__(
        self,
        roles: Roles,
        workers: list[Worker],
        sampler: Sampler,
        profiler: Profiler | None = None,
        instructions: Instructions | None = None,
    ) -> None:
        self.roles = roles
        self.workers = workers
        self.sampler = sampler
        self.phases: list[Phase] = []
        self._meter: Meter | None = None
        self._xact = 0
        self._counters: dict[str, dict[str, float]] = {}
        self._tables: dict[str, tuple[int, int, int, int]] = {}
        self._sims = 0.0
        self.profiler = profiler or Profiler(Path("."), False)
        self.instructions = instructions or Instructions(Path("."), False)

    def begin(self, name: str) -> Phase:
        self._meter = Meter(self.roles)
        self._xact = xact_commit()
        self._tables = table_reads(self.roles.fleet.schema)
        self._counters = gateway_counters(self.roles)
        self._sims = self.simulators_cpu_s()
        self._meter.start()
        targets = {"api": self.roles.pids["api"], "gw2": self.roles.pids["gw2"]}
        self.profiler.start(name, {**targets, "sim0": self.workers[0].proc.pid})
        self.instructions.start(self.roles.pids)
        phase = Phase(name, time.monotonic() - self.sampler.t0)
        self.phases.append(phase)
        print(f"\n[{name}] …", flush=True)
        return phase

    def simulators_cpu_s(self) -> float:
        """The simulator processes' CPU so far: bcd's own code for every node."""
        return sum(proc_cpu_or_none(w.proc.pid) or 0.0 for w in self.workers)

    def end(self, phase: Phase, errors: int) -> Phase:
        assert self._meter is not None
        phase.spent = self._meter.stop()
        phase.detail["simulators_cpu_s"] = self.simulators_cpu_s() - self._sims
        phase.end = time.monotonic() - self.sampler.t0
        self.profiler.stop()
        phase.instructions = self.instructions.stop(self.roles.pids)
        phase.xacts = xact_commit() - self._xact
        tables = table_reads(self.roles.fleet.schema)
        reads = {
            name: [a - b for a, b in zip(now, self._tables.get(name, (0, 0, 0, 0)), strict=True)]
            for name, now in tables.items()
        }
        # the tables read most by sequential scans: what PostgreSQL's CPU went to
        phase.detail["table_reads"] = dict(
            sorted(reads.items(), key=lambda kv: -kv[1][1])[:TABLES_SHOWN]
        )
        phase.errors = errors
        grown = counter_deltas(self._counters, gateway_counters(self.roles))
        phase.detail["handshakes"] = {o: grown.get(f"hs:{o}", 0.0) for o in HANDSHAKE_OUTCOMES}
        phase.detail["delivery"] = {k: v for k, v in grown.items() if k.startswith("le:")}
        phase.detail["written"] = {
            "le:" + k[3:]: v for k, v in grown.items() if k.startswith("wr:")
        }
        phase.detail["relay"] = {k[6:]: v for k, v in grown.items() if k.startswith("relay:")}
        print(
            f"[{phase.name}] {phase.wall_s:.2f} s, errors {errors}, control-plane CPU "
            f"{phase.control_cpu_s():.2f} s ({phase.pg_cpu_s():.2f} s PostgreSQL), "
            f"{phase.xacts} PostgreSQL transactions; the gateways' TLS handshakes: "
            + ", ".join(f"{k} {v:.0f}" for k, v in phase.detail["handshakes"].items())
            + "; relayed calls: "
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(phase.detail["relay"].items())),
            flush=True,
        )
        scans = "; ".join(
            f"{name} {v[0]} ({v[1]}) / {v[2]} ({v[3]})"
            for name, v in phase.detail["table_reads"].items()
            if any(v)
        )
        print(
            "  sequential scans (rows read) / index scans (rows fetched): " + (scans or "none"),
            flush=True,
        )
        return phase

    def total(self, key: str) -> int:
        return sum(w.count(key) for w in self.workers)

    def wait_for(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Poll ``cond`` until true or ``timeout``; the counters printed every 15 s."""
        deadline = time.monotonic() + timeout
        shown = time.monotonic()
        while time.monotonic() < deadline:
            if cond():
                return True
            if time.monotonic() - shown >= 15.0:
                shown = time.monotonic()
                self.progress()
            time.sleep(0.05)
        return cond()

    def progress(self) -> None:
        keys = ("joined", "renewed", "up", "losses", "revoked")
        print("  … " + ", ".join(f"{k} {self.total(k)}" for k in keys), flush=True)

    def broadcast(self, cmd: str, timeout: float, **fields: Any) -> list[dict[str, Any]]:
        for w in self.workers:
            w.command(cmd, **fields)
        return self.collect(cmd, timeout)

    def collect(self, cmd: str, timeout: float) -> list[dict[str, Any]]:
        """Every worker's answer to ``cmd``; the counters printed every 15 s meanwhile."""
        deadline = time.monotonic() + timeout
        answers = []
        for w in self.workers:
            while True:
                try:
                    answers.append(w.wait(cmd, min(15.0, max(0.1, deadline - time.monotonic()))))
                    break
                except RuntimeError:
                    if time.monotonic() >= deadline or w.proc.poll() is not None:
                        raise
                    self.progress()
        return answers


def gateway_counters(roles: Roles) -> dict[str, dict[str, float]]:
    """Each running gateway's counters the run reads (a killed gateway's are gone with
    it): ``bc_tls_handshakes_total`` of its gateway listener by outcome (``hs:OUTCOME``),
    the cumulative buckets of ``bc_revocation_delivery_seconds`` (``le:BOUND``) and of
    ``bc_revocation_written_seconds`` (``wr:BOUND``, as ``le:`` in the phase's detail), the
    relayed calls by outcome and the relay attempts that reached no replica
    (``relay:answered``, ``relay:unavailable``, ``relay:not-sent``)."""
    out: dict[str, dict[str, float]] = {}
    for i, gw in enumerate(roles.fleet.gateways):
        name = f"gw{i + 1}"
        if name not in roles.pids:
            continue
        try:
            answer = httpx.get(f"{gw.ready['metrics']}/metrics", timeout=10)
            answer.raise_for_status()
        except httpx.HTTPError as exc:  # a figure lost, not the run
            print(f"  (no counters from {name}: {exc})", flush=True)
            continue
        counts = out[name] = {f"hs:{o}": 0.0 for o in HANDSHAKE_OUTCOMES}
        for family in text_string_to_metric_families(answer.text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "bc_tls_handshakes_total" and labels["listener"] == "gateway":
                    counts[f"hs:{labels['outcome']}"] = sample.value
                elif sample.name == "bc_revocation_delivery_seconds_bucket":
                    counts[f"le:{labels['le']}"] = sample.value
                elif sample.name == "bc_revocation_written_seconds_bucket":
                    counts[f"wr:{labels['le']}"] = sample.value
                elif sample.name == "bc_relay_not_sent_total":
                    counts["relay:not-sent"] = sample.value
                elif sample.name == "bc_relay_duration_seconds_count":
                    counts[f"relay:{labels['outcome']}"] = sample.value
    return out


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Each counter's growth, summed over the gateways read at both ends."""
    both = after.keys() & before.keys()
    keys = {k for gw in both for k in after[gw]}
    return {k: sum(after[gw].get(k, 0.0) - before[gw].get(k, 0.0) for gw in both) for k in keys}


def bucket_quantile(deltas: dict[str, float], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative ``le:`` buckets, interpolated linearly
    within its bucket as PromQL's histogram_quantile does (None with no observation;
    the largest finite bound when it falls in +Inf)."""
    bounds = sorted((float(k[3:]), v) for k, v in deltas.items() if k.startswith("le:"))
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def error_count(answers: list[dict[str, Any]], phase: str) -> int:
    return sum(
        n for a in answers for what, n in a.get("errors", {}).items() if what.startswith(phase)
    )


def error_texts(answers: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        for what, n in a.get("errors", {}).items():
            out[what] = out.get(what, 0) + n
    return out


def show_error_texts(phase: Phase, answers: list[dict[str, Any]]) -> dict[str, int]:
    """The phase's error texts (its own and its retries'; a worker's counts are the
    whole run's), counted, and printed at once (a run stopped later keeps them)."""
    kinds = (f"{phase.name}:", f"retried {phase.name}:")
    texts = {k: v for k, v in error_texts(answers).items() if k.startswith(kinds)}
    for what, count in sorted(texts.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  [{phase.name}] {count} × {what}", flush=True)
    return texts


# --- the phases ---------------------------------------------------------------------


def make_tokens(roles: Roles, sizes: list[int], each: int, sites: int) -> list[list[str]]:
    """Per simulator process of ``sizes[p]`` nodes, ``each`` join tokens sharing its nodes'
    uses (``maxUses``), over ``sites`` sites' pools."""
    api = roles.fleet.api
    client = api.client()
    tenant = api.root_tenant
    pools = []
    for s in range(sites):
        site = client.call("POST", f"/v1/tenants/{tenant}/sites", {"name": f"fleet-site-{s}"})
        pool = client.call(
            "POST",
            f"/v1/tenants/{tenant}/pools",
            {"siteId": site["id"], "name": f"fleet-{s}", "agent": "bcd", "policy": {}},
        )
        pools.append(pool["id"])
    tokens: list[list[str]] = []
    for p, size in enumerate(sizes):
        uses = max(1, math.ceil(size / each)) + 1
        pool_of = [pools[(p * each + k) % sites] for k in range(each)]
        tokens.append([api.token(pool, maxUses=uses)["token"] for pool in pool_of])
    return tokens


def phase_join(run: Run, tokens_per_worker: list[list[str]], jwk: dict[str, Any]) -> Phase:
    phase = run.begin("join")
    for w, tokens in zip(run.workers, tokens_per_worker, strict=True):
        w.command("join", tokens=tokens, encryption_jwk=jwk)
    answers = run.collect("join", 3600)
    phase = run.end(phase, error_count(answers, "join"))
    phase.detail["nodes"] = {i: nid for a in answers for i, nid in a["nodes"]}
    phase.detail["error_texts"] = show_error_texts(phase, answers)
    phase.detail["retried"] = error_count(answers, "retried join")
    return phase


def phase_sessions(run: Run, n: int, timeout: float) -> Phase:
    phase = run.begin("sessions")
    run.broadcast("sessions", 60)
    ok = run.wait_for(lambda: run.total("up") >= n, timeout)
    return run.end(phase, 0 if ok else n - run.total("up"))


def phase_steady(run: Run, n: int, hold_s: float) -> Phase:
    gw_pids = {k: p for k, p in run.roles.pids.items() if k.startswith("gw")}
    losses = run.total("losses")
    phase = run.begin("steady")
    time.sleep(hold_s)
    phase.detail["rss_kb"] = {k: rss_kb(p) for k, p in gw_pids.items()}
    return run.end(phase, run.total("losses") - losses + (n - run.total("up")))


def phase_renewal(run: Run) -> Phase:
    phase = run.begin("renewal")
    answers = run.broadcast("renew", 3600)
    phase = run.end(phase, error_count(answers, "renewal"))
    phase.detail["error_texts"] = show_error_texts(phase, answers)
    phase.detail["retried"] = error_count(answers, "retried renewal")
    return phase


def phase_revocation(
    run: Run, nodes: dict[int, str], count: int, timeout: float, among: range | None = None
) -> Phase:
    """``count`` nodes revoked, drawn at random from ``among`` (indexes: the probe
    process's nodes, :func:`probe_default`) or from all of them."""
    api = run.roles.fleet.api
    client = api.client()
    pool = sorted(nid for i, nid in nodes.items() if among is None or i in among)
    chosen = random.Random(14).sample(pool, count)
    losses = run.total("losses")
    calls: dict[str, tuple[float, float]] = {}
    failed: list[str] = []

    def revoke(node_id: str) -> None:
        path = f"/v1/tenants/{api.root_tenant}/nodes/{node_id}/revoke-identity"
        start = time.monotonic()
        try:
            client.call("POST", path, {"reason": "fleet bench"})
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            return
        calls[node_id] = (start, time.monotonic())

    phase = run.begin("revocation")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(revoke, chosen))

    def arrived() -> dict[str, float]:
        out: dict[str, float] = {}
        for w in run.workers:
            out.update(w.revoked)
        return out

    run.wait_for(lambda: len(set(arrived()) & set(calls)) >= len(calls), timeout)
    seen = arrived()
    phase = run.end(phase, 0)
    from_start = sorted(seen[nid] - calls[nid][0] for nid in calls if nid in seen)
    from_return = sorted(seen[nid] - calls[nid][1] for nid in calls if nid in seen)
    verified = {nid: t for w in run.workers for nid, t in w.verified.items()}
    # when each node's bcd had verified the notice, from the call's start
    to_verified = sorted(verified[nid] - calls[nid][0] for nid in calls if nid in verified)
    # the simulator's own share after the check: bcd unwinding the session, the task's end
    verified_to_end = sorted(seen[nid] - verified[nid] for nid in seen.keys() & verified.keys())
    missing = len(calls) - len(from_start)
    dropped = run.total("losses") - losses
    phase.errors = len(failed) + missing + dropped
    # the gateways' own share: from the revoking transaction (the database's clock) to
    # the notice queued on the session (bc_revocation_delivery_seconds), without the
    # simulator's receiving and checking it
    delivery = phase.detail["delivery"]
    pushed = int(delivery.get("le:+Inf", 0))
    on_gateway = [bucket_quantile(delivery, q) for q in (0.5, 0.99)]
    # and to the notice written on the session's connection (bc_revocation_written_seconds)
    written = [bucket_quantile(phase.detail["written"], q) for q in (0.5, 0.99)]
    drawn = "all the nodes" if among is None else f"the probe process's {len(among):,} nodes"
    print(
        f"  {len(calls)} revoked, drawn from {drawn}; "
        f"the gateways pushed {pushed} notices; revoking transaction to the notice "
        "queued, p50 / p99 (their histogram's buckets): "
        + " / ".join("-" if v is None else f"{v * 1000:.0f} ms" for v in on_gateway)
        + "; to the notice written: "
        + " / ".join("-" if v is None else f"{v * 1000:.0f} ms" for v in written)
        + "; the revoking call's start to the node's bcd having verified it, p50 / p99: "
        + " / ".join("-" if v is None else f"{v:.0f} ms"
                     for v in (pct_ms(to_verified, 0.5), pct_ms(to_verified, 0.99)))
        + "; from the check to the session's end in the simulator, p50 / p99: "
        + " / ".join("-" if v is None else f"{v:.0f} ms"
                     for v in (pct_ms(verified_to_end, 0.5), pct_ms(verified_to_end, 0.99))),
        flush=True,
    )  # fmt: skip
    phase.detail.update(
        gateway_pushed=pushed,
        gateway_p50_s=on_gateway[0],
        gateway_p99_s=on_gateway[1],
        gateway_written_p50_s=written[0],
        gateway_written_p99_s=written[1],
        revoked=len(calls),
        latency_s=from_start,
        from_return_s=from_return,
        verified_s=to_verified,
        verified_to_end_s=verified_to_end,
        missing=missing,
        other_sessions_dropped=dropped,
        call_failures=failed[:5],
        probe_nodes=0 if among is None else len(among),
        # how many of the revoked sessions ended in the probe process (the last worker)
        ended_in_probe=None if among is None else len(run.workers[-1].revoked.keys() & calls),
    )
    return phase


def phase_restart(run: Run, expected: int, timeout: float) -> Phase:
    """``kill -9`` of gw1; the time until each of its nodes lost its session and every
    live node holds one again. The simulators count gw1's sessions before the kill
    (and send their later redials to the others), so a stale count cannot end the
    phase before the nodes even noticed."""
    victim = "gw1"
    gw = run.roles.fleet.gateways[0]
    run.wait_for(lambda: run.total("up") >= expected, 30)
    phase = run.begin("restart")
    answers = run.broadcast("dead", 30, gateway=0)
    held = sum(int(a["held"]) for a in answers)
    before = sum(int(a["up"]) for a in answers)
    losses = sum(int(a["losses"]) for a in answers)
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    killed_at = time.monotonic()
    run.roles.pids.pop(victim)
    run.roles.apps.pop(victim)
    low = [before]

    def all_back() -> bool:
        up = run.total("up")
        low[0] = min(low[0], up)
        return run.total("losses") - losses >= held and up >= expected

    ok = run.wait_for(all_back, timeout)
    back = time.monotonic() - killed_at
    phase = run.end(phase, 0 if ok else max(expected - run.total("up"), 1))
    phase.detail.update(
        time_to_all_s=back if ok else None, sessions_before=before, min_up=low[0], held=held
    )
    return phase


# --- figures, plot ------------------------------------------------------------------


def rate_series(samples: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    out = []
    for a, b in itertools.pairwise(samples):
        dt = b["t"] - a["t"]
        if dt > 0:
            out.append((b["t"], (b[key] - a[key]) / dt))
    return out


def cpu_series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Cores busy per role (API, gateways, PostgreSQL, simulators) between samples:
    the processes' over the time between their own reads (``t_procs``), PostgreSQL's
    over the samples' ``t`` (read after them)."""
    out: dict[str, list[tuple[float, float]]] = {
        "api": [], "gateways": [], "postgres": [], "simulators": []
    }  # fmt: skip
    for a, b in itertools.pairwise(samples):
        dt, dt_procs = b["t"] - a["t"], b["t_procs"] - a["t_procs"]
        if dt <= 0 or dt_procs <= 0:
            continue
        api = b["cpu"].get("api", 0.0) - a["cpu"].get("api", 0.0)
        gws = sum(
            b["cpu"][k] - a["cpu"][k] for k in b["cpu"] if k.startswith("gw") and k in a["cpu"]
        )
        out["api"].append((b["t"], api / dt_procs))
        out["gateways"].append((b["t"], gws / dt_procs))
        out["postgres"].append((b["t"], max(0.0, b["pg"] - a["pg"]) / dt))
        out["simulators"].append((b["t"], (b["simulators"] - a["simulators"]) / dt_procs))
    return out


def figures(
    args: argparse.Namespace, phases: dict[str, Phase], samples: list[dict[str, Any]],
    floors: dict[str, float], n: int,
) -> dict[str, Any]:  # fmt: skip
    join, steady = phases["join"], phases["steady"]
    sessions, rev, restart = phases["sessions"], phases["revocation"], phases["restart"]
    joined = len(join.detail["nodes"])
    steady_spent = steady.spent
    assert steady_spent is not None
    gw_cpu_steady = sum(v for k, v in steady_spent.procs.items() if k.startswith("gw"))
    base = sessions.detail.get("rss_before_kb", {})
    rss_growth = sum(steady.detail["rss_kb"][k] - base.get(k, 0) for k in steady.detail["rss_kb"])
    lat = rev.detail["latency_s"]
    cpus = cpu_series(samples)
    in_restart = [
        sum(cpus[r][i][1] for r in ("api", "gateways", "postgres"))
        for i in range(len(cpus["api"]))
        if restart.start <= cpus["api"][i][0] <= restart.end + SAMPLE_S
    ]
    reconnects = [
        (t - restart.start, r)
        for t, r in rate_series(samples, "welcomes")
        if restart.start <= t <= restart.end + SAMPLE_S
    ]
    totals: dict[str, float] = {}
    for p in phases.values():
        for k, v in p.role_cpu().items():
            totals[k] = totals.get(k, 0.0) + v
    join_cpu = join.control_cpu_s() / max(joined, 1)
    renew = phases.get("renewal")  # None with --skip-renewal
    renewals = max(renew.detail.get("renewed", 0), 1) if renew else 0
    return {
        "nodes": n,
        "procs": args.procs,
        "gateways": args.gateways,
        "concurrency_per_proc": args.concurrency,
        "ping_interval_s": args.ping_seconds,
        "cert_ttl_s": args.cert_ttl,
        "errors": {name: p.errors for name, p in phases.items()},
        "wall_s": {name: round(p.wall_s, 3) for name, p in phases.items()},
        "joins_per_s": joined / join.wall_s,
        "join_cpu_ms": join_cpu * 1000,
        "join_cpu_by_role_ms": {k: v * 1000 / max(joined, 1) for k, v in join.role_cpu().items()},
        "join_floor_ms": floors["join"],
        "join_floor_ratio": join_cpu * 1000 / floors["join"],
        "join_pg_xacts": join.xacts / max(joined, 1),
        "join_pg_cpu_ms": join.pg_cpu_s() * 1000 / max(joined, 1),
        "join_retried": join.detail.get("retried", 0),
        "session_open_gateway_cpu_ms": sum(
            v
            for k, v in (sessions.spent.procs if sessions.spent else {}).items()
            if k.startswith("gw")
        )
        * 1000
        / max(n, 1),
        "gateway_rss_kb_per_session": rss_growth / max(n, 1),
        "gateway_cpu_us_per_session_s": gw_cpu_steady * 1e6 / max(n * steady.wall_s, 1e-9),
        "gateway_cpu_us_per_ping": gw_cpu_steady
        * 1e6
        / max(n * steady.wall_s, 1e-9)
        * args.ping_seconds,
        # the simulators' CPU (bcd's own code, every node's) per operation, the
        # simulator's own bookkeeping included: what a node spends on each
        "node_cpu_ms_per_join": join.detail["simulators_cpu_s"] * 1000 / max(joined, 1),
        "node_cpu_ms_per_session_open": sessions.detail["simulators_cpu_s"] * 1000 / max(n, 1),
        "node_cpu_us_per_ping": steady.detail["simulators_cpu_s"]
        * 1e6
        / max(n * steady.wall_s, 1e-9)
        * args.ping_seconds,
        **renewal_figures(renew, renewals, floors, steady),
        "revocations": rev.detail["revoked"],
        "revocation_p50_ms": pct_ms(lat, 0.5),
        "revocation_p99_ms": pct_ms(lat, 0.99),
        "revocation_gateway_pushed": rev.detail["gateway_pushed"],
        "revocation_gateway_p50_ms": ms_or_none(rev.detail["gateway_p50_s"]),
        "revocation_gateway_p99_ms": ms_or_none(rev.detail["gateway_p99_s"]),
        "revocation_written_p50_ms": ms_or_none(rev.detail["gateway_written_p50_s"]),
        "revocation_written_p99_ms": ms_or_none(rev.detail["gateway_written_p99_s"]),
        "revocation_verified_p50_ms": pct_ms(rev.detail["verified_s"], 0.5),
        "revocation_verified_p99_ms": pct_ms(rev.detail["verified_s"], 0.99),
        "revocation_from_return_p99_ms": pct_ms(rev.detail["from_return_s"], 0.99),
        "revocation_verified_to_end_p99_ms": pct_ms(rev.detail["verified_to_end_s"], 0.99),
        "revocation_probe_nodes": rev.detail["probe_nodes"],
        "revocation_ended_in_probe": rev.detail["ended_in_probe"],
        "reconnect_nodes": restart.detail["held"],
        "reconnect_min_up": restart.detail["min_up"],
        "reconnect_time_s": restart.detail["time_to_all_s"],
        "reconnect_peak_cpu_cores": max(in_restart, default=0.0),
        # the surviving gateways' TLS handshakes over the phase, by outcome
        "reconnect_handshakes": restart.detail.get("handshakes"),
        "reconnect_rate_per_s": [(round(t, 2), round(r, 1)) for t, r in reconnects],
        # each phase's relayed calls by outcome, and the attempts that reached no replica
        "relay_by_phase": {name: p.detail.get("relay") for name, p in phases.items()},
        "cpu_total_by_role_s": totals,
        **instruction_figures(phases, floors, joined, renewals, n),
        "revocation_latencies_ms": [round(x * 1000, 1) for x in lat],
    }


def ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def pct_ms(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted samples in seconds, in ms (None with no sample)."""
    return pct(ordered, q) * 1000 if ordered else None


def renewal_figures(
    renew: Phase | None, renewals: int, floors: dict[str, float], steady: Phase
) -> dict[str, Any]:
    """The renewal wave's figures; each None when the run skipped it (``--skip-renewal``).

    The wave runs with every session held, as a fleet's does, so its control-plane CPU
    includes holding them (the gateways' pings, the API's sightings, the polls, and
    the bench's own scrapes of the metrics): ``renewal_cpu_held_ms`` is that share, at
    the steady phase's whole control-plane rate over the wave's time, per renewal, and
    ``renewal_cpu_net_ms`` and ``renewal_floor_ratio_net`` are what is left, the
    renewals' own. Work still trailing the sessions' opening when the steady phase
    began would make the held share too large; a small run can leave a net below 0."""
    if renew is None:
        return dict.fromkeys(RENEWAL_KEYS)
    cpu_ms = renew.control_cpu_s() / renewals * 1000
    held_ms = steady.control_cpu_s() / max(steady.wall_s, 1e-9) * renew.wall_s / renewals * 1000
    return {
        "node_cpu_ms_per_renewal": renew.detail["simulators_cpu_s"] * 1000 / renewals,
        "renewals_per_s": renewals / renew.wall_s,
        "renewal_cpu_ms": cpu_ms,
        "renewal_cpu_by_role_ms": {k: v * 1000 / renewals for k, v in renew.role_cpu().items()},
        "renewal_floor_ms": floors["renewal"],
        "renewal_floor_ratio": cpu_ms / floors["renewal"],
        "renewal_cpu_held_ms": held_ms,
        "renewal_cpu_net_ms": cpu_ms - held_ms,
        "renewal_floor_ratio_net": (cpu_ms - held_ms) / floors["renewal"],
        "renewal_pg_xacts": renew.xacts / renewals,
        "renewal_pg_cpu_ms": renew.pg_cpu_s() * 1000 / renewals,
        "renewal_retried": renew.detail.get("retried", 0),
    }


RENEWAL_KEYS = (
    "node_cpu_ms_per_renewal", "renewals_per_s", "renewal_cpu_ms", "renewal_cpu_by_role_ms",
    "renewal_floor_ms", "renewal_floor_ratio", "renewal_cpu_held_ms", "renewal_cpu_net_ms",
    "renewal_floor_ratio_net", "renewal_pg_xacts", "renewal_pg_cpu_ms", "renewal_retried",
)  # fmt: skip


FIGURE_KEYS = (
    "errors", "joins_per_s", "join_cpu_ms", "join_floor_ratio", "join_pg_xacts",
    "join_pg_cpu_ms", "gateway_rss_kb_per_session", "gateway_cpu_us_per_session_s",
    "gateway_cpu_us_per_ping", "node_cpu_ms_per_join", "node_cpu_ms_per_session_open",
    "node_cpu_us_per_ping", "node_cpu_ms_per_renewal", "renewals_per_s", "renewal_cpu_ms", "renewal_floor_ratio",
    "renewal_cpu_held_ms", "renewal_cpu_net_ms", "renewal_floor_ratio_net", "renewal_pg_xacts", "renewal_pg_cpu_ms", "join_retried", "renewal_retried", "revocation_p50_ms",
    "revocation_p99_ms", "revocation_gateway_pushed", "revocation_gateway_p50_ms",
    "revocation_gateway_p99_ms", "revocation_written_p50_ms", "revocation_written_p99_ms",
    "revocation_verified_p50_ms", "revocation_verified_p99_ms", "reconnect_time_s",
    "reconnect_peak_cpu_cores", "reconnect_handshakes", "reconnect_rate_per_s", "relay_by_phase",
    "cpu_total_by_role_s", "pg_vacuum_runs", "pg_vacuum_cpu_s",
)  # fmt: skip


def plot(
    path: Path, samples: list[dict[str, Any]], phases: dict[str, Phase], lat: list[float]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(11, 13))
    ts = [s["t"] for s in samples]
    ax[0].plot(ts, [s["up"] for s in samples], label="sessions held")
    ax[0].plot(ts, [s["joined"] for s in samples], label="nodes joined", alpha=0.6)
    ax[0].set_ylabel("nodes")
    for name, series in (("joins/s", "joined"), ("renewals/s", "renewed"),
                         ("session opens/s", "welcomes")):  # fmt: skip
        pts = rate_series(samples, series)
        ax[1].plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax[1].set_ylabel("per second")
    for role, pts in cpu_series(samples).items():
        ax[2].plot([p[0] for p in pts], [p[1] for p in pts], label=role)
    ax[2].set_ylabel("CPU cores busy")
    ax[2].set_xlabel("seconds since the fleet started")
    for a in ax[:3]:
        for j, p in enumerate(phases.values()):
            a.axvline(p.start, color="grey", lw=0.6, ls="--")
            a.text(p.start, 1.0 + 0.06 * (j % 2), p.name, transform=a.get_xaxis_transform(),
                   fontsize=7, va="bottom")  # fmt: skip
        a.legend(fontsize=8, loc="upper right")
    if lat:
        ax[3].hist([x * 1000 for x in lat], bins=40)
    ax[3].set_xlabel("revocation latency, revoke call to the session's end (ms)")
    ax[3].set_ylabel("nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def instruction_floors() -> dict[str, float]:
    """The raw floors' instructions per join and per renewal (``bench/join.py`` and
    ``bench/renew.py`` under callgrind, as their ``--instructions`` count them)."""
    from bench.common import instructions_per_op
    from bench.join import CALLGRIND_LARGE, CALLGRIND_SMALL

    out: dict[str, float] = {}
    for op, script in (("join", "bench/join.py"), ("renewal", "bench/renew.py")):
        ir = instructions_per_op(str(ROOT / script), "floor", CALLGRIND_SMALL, CALLGRIND_LARGE)
        if ir is not None:
            out[f"{op}_ir"] = ir
    return out


def instruction_figures(
    phases: dict[str, Phase], floors: dict[str, float], joined: int, renewals: int, n: int
) -> dict[str, Any]:
    """With ``--instructions``: the control plane's instructions (the API replica and
    the gateways, not PostgreSQL) per join, session opened, idle session-second and
    renewal, and per join and renewal over the raw floor's instructions."""
    if not any(p.instructions for p in phases.values()):
        return {}

    def per(phase: str, count: float) -> float:
        return sum(phases[phase].instructions.values()) / max(count, 1e-9)

    steady = phases["steady"]
    gw_steady = sum(v for k, v in steady.instructions.items() if k.startswith("gw"))
    out: dict[str, Any] = {
        "instructions_by_phase_M": {
            name: round(sum(p.instructions.values()) / 1e6, 1) for name, p in phases.items()
        },
        "join_instructions_M": per("join", joined) / 1e6,
        "join_instructions_by_role_M": {
            k: v / max(joined, 1) / 1e6 for k, v in phases["join"].instructions.items()
        },
        "session_open_instructions_M": per("sessions", n) / 1e6,
        "gateway_instructions_per_session_s": gw_steady / max(n * steady.wall_s, 1e-9),
    }
    if "renewal" in phases:
        out["renewal_instructions_M"] = per("renewal", renewals) / 1e6
    for op, count in (("join", joined), ("renewal", renewals)):
        if op not in phases:
            continue
        floor_ir = floors.get(f"{op}_ir")
        if floor_ir:
            out[f"{op}_floor_instructions_M"] = floor_ir / 1e6
            out[f"{op}_instructions_floor_ratio"] = per(op, count) / floor_ir
    return out


def print_figures(fig: dict[str, Any]) -> None:
    print("\nFigures (CPU = utime+stime of the API replica, gateways, their PostgreSQL backends):")
    for key, value in fig.items():
        if key in ("revocation_latencies_ms", "reconnect_rate_per_s"):
            continue
        if isinstance(value, float):
            value = round(value, 3)
        elif isinstance(value, dict):
            value = {k: round(v, 3) if isinstance(v, float) else v for k, v in value.items()}
        print(f"  {key:<34} {value}")
    rates = fig["reconnect_rate_per_s"]
    if rates:  # at most 30 spans of the phase, each its mean rate
        span = max(SAMPLE_S, rates[-1][0] / 30)
        spans: dict[int, list[float]] = {}
        for t, r in rates:
            spans.setdefault(int(t // span), []).append(r)
        print(f"  reconnects/s after the kill (from s: mean rate over {span:.1f} s): " + ", ".join(
            f"{k * span:.0f}: {sum(v) / len(v):.0f}" for k, v in sorted(spans.items())))  # fmt: skip


def print_extrapolation(fig: dict[str, Any], target: int = 100_000) -> None:
    """What the measured per-unit costs come to for ``target`` nodes."""
    gws = math.ceil(target / (GATEWAY_SESSIONS_MAX * 0.9))
    idle_cores = fig["gateway_cpu_us_per_session_s"] * target / 1e6
    at_15s = fig["gateway_cpu_us_per_ping"] / 15 * target / 1e6
    rss_gb = fig["gateway_rss_kb_per_session"] * target / 1e6
    join_cpu_s = fig["join_cpu_ms"] * target / 1000
    net_ms = fig["renewal_cpu_net_ms"]
    renew_cpu_s = (math.nan if net_ms is None else net_ms) * target / 1000
    print(f"\nExtrapolated to {target:,} nodes (the per-unit costs above, linearly):")
    print(f"  gateways: at least {gws} (≤ {GATEWAY_SESSIONS_MAX:,} sessions each, the "
          f"listener's limit, under the {FILE_LIMIT:,}-file limit); simulator processes: "
          f"at least {math.ceil(target / (FILE_LIMIT * 0.8))}")  # fmt: skip
    print(
        f"  idle sessions: {idle_cores:.2f} cores at this run's ping interval "
        f"({at_15s:.2f} at the production 15 s, from the CPU per ping) and {rss_gb:.2f} GB "
        "in the gateways"
    )
    print(f"  join storm: {join_cpu_s:.0f} control-plane CPU-s, "
          f"{join_cpu_s / 120:.1f} cores for a 2-minute storm; "
          f"renewal wave: {renew_cpu_s:.0f} CPU-s beyond holding the sessions")  # fmt: skip
    print(f"  PostgreSQL: {fig['join_pg_xacts'] * target:,.0f} transactions for the joins")


# --- main ---------------------------------------------------------------------------


PINGS_PER_S = 700
PING_MAX_S = 30.0
"""What the simulator processes receive per second, at most, by the default ping
interval: about 0.25 ms of simulator CPU a ping (bcd's session code, httpx, TLS; N =
10,000), so a fifth of a core. At a 2 s ping N = 10,000 (5,000 pings/s) starved two
simulator processes on this shared machine until no new session opened."""


def ping_default(n: int) -> float:
    """2 s for a small fleet, longer for a large one (N/700 s, at most 30 s); production
    pings every 15 s. A node drops a session after 50 s without a byte: at 45 s pings a
    simulator stalled 5 s by its own collector (N = 50,000, 12,500 nodes a process)
    dropped 4,000 sessions in the renewal wave; 30 s leaves 20 s for a stall."""
    return round(max(2.0, min(PING_MAX_S, n / PINGS_PER_S)), 1)


CERT_TTL_MIN_S = 1800
CERT_TTL_S_PER_NODE = 0.072


def cert_ttl_default(n: int) -> int:
    """1,800 s, or 72 ms a node where that is longer (3,600 s at N = 50,000, 7,200 s at
    100,000). The first-joined nodes' certificates must outlive the join storm, the
    sessions' opening and the steady state, until the renewal wave reaches them: at
    N = 100,000 on this 2-core machine those took about 40 minutes, and with 1,800 s the
    gateways ended the first nodes' sessions at their certificates' end and the redials
    queued past bcd's connect timeout (the tenth session's attempt)."""
    return max(CERT_TTL_MIN_S, math.ceil(n * CERT_TTL_S_PER_NODE))


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def split(n: int, parts: int) -> list[list[int]]:
    return [list(range(p, n, parts)) for p in range(parts)]


PROBE_FROM = 10_000
"""The N from which :func:`probe_default` gives the revoked nodes a process of their own."""


def probe_default(n: int, revocations: int) -> int:
    """The nodes of the probe, an extra simulator process whose nodes the revocation phase
    draws its targets from: five times the revocations, at least 1,000, from
    :data:`PROBE_FROM` nodes on (none below).

    Why: a real node is one bcd on its own machine, but a simulator process holds up to
    12,500 and, on this 2-core machine, runs 1-2 s late while it holds them (the
    eleventh session's 100,000 run: 1,387 ms at p50 from a node's check of the notice to
    its session's end, where the same code takes 2 ms with 40 nodes). Measured in those
    processes, a revocation's end-to-end latency is mostly the simulator's own queue.
    The probe's nodes join, hold their sessions, are pinged and move off a dead gateway
    like every other node, over the same gateways under the same load; only their own
    process is light, as a node's is. The figures say which nodes were revoked."""
    return 0 if n < PROBE_FROM else max(1_000, 5 * revocations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--procs", type=int, default=2, help="simulator processes")
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="per simulator process")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument(
        "--ping-seconds",
        type=float,
        default=None,
        help="the gateways' ping interval (default: N/700 s within 2 to 30 s)",
    )
    parser.add_argument("--steady-pings", type=int, default=3)
    parser.add_argument(
        "--cert-ttl",
        type=int,
        default=None,
        help="the certificates' life in seconds (default: 1,800, or 72 ms a node if longer)",
    )
    parser.add_argument("--revocations", type=int, default=None)
    parser.add_argument(
        "--probe-nodes",
        type=int,
        default=None,
        help="nodes of an extra, light simulator process from which the revoked nodes are "
        f"drawn (default: none below {PROBE_FROM:,} nodes, else 5 per revocation, at "
        "least 1,000; 0: drawn from all)",
    )
    parser.add_argument(
        "--skip-renewal",
        action="store_true",
        help="no renewal wave (its figures None): the revocations and the gateway loss at "
        "an N whose renewal wave the simulator cannot drive in the time at hand",
    )
    parser.add_argument(
        "--no-vacuum",
        action="store_true",
        help="no VACUUM (ANALYZE) where the server's autovacuum is off: what a database "
        "left without either costs",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--quick-floor", action="store_true", help="time the crypto floor briefly (tests)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the API, gw2 and a simulator per phase"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="run every serve under valgrind's callgrind: instructions per phase and per "
        "operation (its CPU figures are then valgrind's, not the control plane's)",
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main()
    n = args.nodes
    if n < 10 or args.procs < 1 or args.gateways < 2 or args.concurrency < 1:
        parser.error("--nodes at least 10, --procs at least 1, --gateways at least 2")
    if n / args.procs > FILE_LIMIT * 0.9:
        parser.error(f"more than {int(FILE_LIMIT * 0.9)} nodes per simulator process")
    if n / (args.gateways - 1) > GATEWAY_SESSIONS_MAX:
        parser.error(f"after a gateway dies the others hold {GATEWAY_SESSIONS_MAX} each at most")
    revocations = args.revocations if args.revocations is not None else min(200, n // 10)
    probe = args.probe_nodes if args.probe_nodes is not None else probe_default(n, revocations)
    if probe and not revocations <= probe <= n // 2:
        parser.error("--probe-nodes at least the revocations and at most half the nodes")
    if args.ping_seconds is None:
        args.ping_seconds = ping_default(n)
    if args.cert_ttl is None:
        args.cert_ttl = cert_ttl_default(n)
    files = raise_file_limit()
    if n / args.procs + 256 > files:
        parser.error(f"{math.ceil(n / args.procs)} nodes per simulator process: the open-file "
                     f"limit is {files}")  # fmt: skip
    # the cleanup below (simulators, gateways, the schema) also on SIGTERM, and on
    # SIGINT where a shell's background job would ignore it
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)

    print_environment()
    import tests.e2e
    from bench.join import crypto_floor
    from bench.renew import renew_floor
    from control import pki as cpki
    from tests.e2e import SECRET, make_pki

    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick_floor:  # one short round per primitive: rough, but in a second
        import bench.common

        bench.common.FLOOR_ROUNDS, bench.common.FLOOR_ROUND_S = 1, 0.01
    with tempfile.TemporaryDirectory(prefix="bcd-fleet-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        loaded = cpki.load_pki(template / "pki", SECRET.encode("utf-8"))
        floors = {
            "join": crypto_floor(loaded).total_us / 1000,
            "renewal": renew_floor(loaded).total_us / 1000,
        }
        instructions = Instructions(args.out, args.instructions)
        if args.instructions:
            floors.update(instruction_floors())
            tests.e2e.SERVE_WRAPPER[:] = instructions.wrapper()
            tests.e2e.SERVE_READY_S = 600.0
        print(f"crypto floor (bench/join.py, bench/renew.py): {floors['join']:.3f} ms/join, "
              f"{floors['renewal']:.3f} ms/renewal")  # fmt: skip
        # the gateways' access log and failed handshakes with BCD_FLEET_GW_LOG=debug
        gateway_flags = ["--session-ping-seconds", str(args.ping_seconds),
                         "--log-level", os.environ.get("BCD_FLEET_GW_LOG", "info"),
                         "--metrics-listen", "127.0.0.1:0"]  # fmt: skip
        with bench_fleet(
            tmp / "fleet",
            template,
            args.gateways,
            api_extra=["--cert-ttl-seconds", str(args.cert_ttl)],
            gateway_extra=gateway_flags,
        ) as roles:
            api = roles.fleet.api
            pins = api.pins()
            site = api.site_and_pool()[0]
            jwk = api.well_known()["join"]["encryptionJwk"]
            workers: list[Worker] = []
            vacuumer: Vacuumer | None = None
            try:
                # the probe's nodes are the last ones, in a process of their own (the last)
                parts = split(n - probe, args.procs) + (
                    [list(range(n - probe, n))] if probe else []
                )
                for p, indexes in enumerate(parts):
                    spec = {
                        "home": str(tmp / f"sim{p}"), "ports": roles.gateway_ports,
                        "pins": pins, "site": site, "indexes": indexes,
                        "concurrency": args.concurrency,
                    }  # fmt: skip
                    workers.append(Worker(spec, args.out / f"fleet-sim{p}.log"))
                per_worker = make_tokens(
                    roles, [len(part) for part in parts], args.concurrency, args.sites
                )
                sampler = Sampler(roles, workers)
                profiler = Profiler(args.out, args.profile)
                run = Run(roles, workers, sampler, profiler, instructions)
                vacuumer = Vacuumer(roles.fleet.schema, wanted=not args.no_vacuum)
                phases: dict[str, Phase] = {}
                phases["join"] = phase_join(run, per_worker, jwk)
                joined = len(phases["join"].detail["nodes"])
                rss_before = {k: rss_kb(p) for k, p in roles.pids.items() if k.startswith("gw")}
                phases["sessions"] = phase_sessions(run, joined, 120 + joined / 10)
                phases["sessions"].detail["rss_before_kb"] = rss_before
                phases["steady"] = phase_steady(run, joined, args.ping_seconds * args.steady_pings)
                if not args.skip_renewal:
                    phases["renewal"] = phase_renewal(run)
                    phases["renewal"].detail["renewed"] = run.total("renewed")
                phases["revocation"] = phase_revocation(
                    run,
                    phases["join"].detail["nodes"],
                    revocations,
                    60,
                    range(n - probe, n) if probe else None,
                )
                phases["restart"] = phase_restart(run, joined - revocations, 180 + joined / 100)
                time.sleep(2.0)  # a tail after the last phase, for the plot
                sampler.stop()
            finally:
                if vacuumer is not None:  # before the schema is dropped, however it ended
                    vacuumer.stop()
                for w in workers:
                    w.close()
                for g, gw in enumerate(roles.fleet.gateways):
                    with contextlib.suppress(OSError):
                        (args.out / f"fleet-gw{g + 1}.log").write_text(gw.log())
                with contextlib.suppress(OSError):
                    (args.out / "fleet-api.log").write_text(
                        (roles.fleet.api.home / "serve.log").read_text(errors="replace")
                    )
    instructions.clean()
    fig = figures(args, phases, sampler.samples, floors, n)
    # None: the server's autovacuum did it, unmeasured
    assert vacuumer is not None  # the phases ran
    fig["pg_vacuum_runs"] = vacuumer.runs if vacuumer.enabled else None
    fig["pg_vacuum_cpu_s"] = vacuumer.cpu_s if vacuumer.enabled else None
    print_figures(fig)
    print_extrapolation(fig)
    if args.profile:
        fig["profile_top"] = profiler.top()
        print("\nWhere the time goes (py-spy, share of samples in a function and what it calls):")
        for name, views in fig["profile_top"].items():
            for view, rows in views.items():
                shown = "; ".join(f"{f} {share:.0%}" for f, share in rows)
                print(f"  {name} {view}: {shown}")
    doc = {
        **fig,
        "samples": sampler.samples,
        "phases": {
            k: {
                "start": p.start,
                "end": p.end,
                "errors": p.errors,
                "table_reads": p.detail.get("table_reads"),
            }
            for k, p in phases.items()
        },
    }
    json_path = args.out / f"fleet-{n}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    plot(
        args.out / f"fleet-{n}.png",
        sampler.samples,
        phases,
        phases["revocation"].detail["latency_s"],
    )
    print(f"\nfigures: {json_path}\nplot:    {args.out / f'fleet-{n}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
