"""Instructions and statements per join and per renewal through ``NodeCalls.handle``.

Run from the repository root::

    .venv/bin/python bench/nodecalls.py [--store sqlite|postgres|both] [--cpu N]

It prints figures and judges nothing; it is not part of the test suite.

What the API side of the control plane does for one node call, in process, without
TLS or HTTP: :class:`control.gateway.NodeCalls` (the dispatch, the worker-thread
hop, the live-certificate and rate checks of a renewal), JoinService or
RenewService, their transactions, on a SQLite file or a fresh PostgreSQL schema
(``BCD_TEST_PG``). For each store it prints:

- **statements** per join and per renewal, as the store's transactions run them,
  and the transactions; on PostgreSQL the round trips: each transaction's ``BEGIN``
  (which carries the ``compute_now()`` read) and ``COMMIT``, and each statement not
  deferred (``Tx.defer``: sent with the next statement or the ``COMMIT``, in one
  pipeline);
- **instructions** per join and per renewal of this process (valgrind's callgrind,
  the difference of 4 and 24 operations over 20: the same from run to run; the
  PostgreSQL server's own work is not in it);
- with ``--cpu N``: CPU ms per operation over N operations (``time.process_time``;
  moves with the machine's load), and the PostgreSQL backend's;
- with ``--compare-deferred BLOCK`` (PostgreSQL): CPU, backend CPU and wall time per
  operation with the deferred statements pipelined, as the store sends them, and
  with each sent at once, the two ways alternated in blocks in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bench.common import (  # noqa: E402
    callgrind_instructions,
    opened_store,
    pg_backends_cpu_s,
    recorded_statements,
)
from control import pki as cpki  # noqa: E402
from control.gateway import NodeCalls  # noqa: E402
from control.http import Request  # noqa: E402
from control.store import Store  # noqa: E402
from tests.e2e import TRUST_DOMAIN  # noqa: E402

SMALL, LARGE = 4, 24
WARMUP = 8
APP = "bcdnodecalls"


class World:
    """Joins and renewals ready to send: ``n`` of each after a warm-up."""

    def __init__(self, store: Store, n: int) -> None:
        from control import tokens
        from tests.world.joins import join_body, machine
        from tests.world.renewals import make_env

        store.migrate()
        env = make_env(store, cpki.build_pki(TRUST_DOMAIN, datetime.now(UTC)))
        self.calls = NodeCalls(store, env.joins, env.renewals, trio.CapacityLimiter(8))
        with store.tx() as tx:
            created = tokens.create(tx, env.tenant, env.pool, max_uses=n + WARMUP, ttl_s=3600)
        token = str(created["token"])

        enc = env.pki.join_encryption_key.public_key()
        self.joins = [join_body(token, enc, machine(10_000 + i)).body for i in range(n + WARMUP)]
        nodes = [env.join(i) for i in range(n + WARMUP)]
        self.renewals = [(env.body(node).body, node.der) for node in nodes]

    def join(self, i: int) -> Request:
        return Request("POST", "/v1/join", {}, {}, self.joins[i], None, "127.0.0.1:4000")

    def renew(self, i: int) -> Request:
        body, der = self.renewals[i]
        return Request("POST", "/v1/renew", {}, {}, body, der, "127.0.0.1:4000")

    def run(self, what: str, start: int, stop: int) -> None:
        async def go() -> None:
            for i in range(start, stop):
                req = self.join(i) if what == "join" else self.renew(i)
                answer = await self.calls.handle(req)
                if answer.status != 200:
                    raise RuntimeError(f"{what} {i}: {answer.status} {answer.body[:200]!r}")

        trio.run(go)


def compare_deferred(world: World, start: int, block: int, rounds: int) -> None:
    """PostgreSQL: each operation's CPU (this process and its backends) and wall time,
    with ``Tx.defer`` pipelined as the store does and with every deferred statement
    sent at once as its own round trip, in blocks of ``block`` operations, the two ways
    alternated ``rounds`` times each (the same run, so the machine's load moves both),
    from operation ``start`` on."""
    from control.store.postgres import _PgTx

    pipelined = _PgTx.defer

    def at_once(tx: _PgTx, sql: str, params: Any = ()) -> None:
        tx.execute(sql, params)

    def backends() -> float:
        return sum((pg_backends_cpu_s(APP) or {}).values())

    try:
        for what in ("join", "renew"):
            i = start  # joins and renewals are separate lists
            sums = {"pipelined": [0.0, 0.0, 0.0], "at once": [0.0, 0.0, 0.0]}
            for r in range(rounds):
                for way in ("pipelined", "at once") if r % 2 == 0 else ("at once", "pipelined"):
                    _PgTx.defer = pipelined if way == "pipelined" else at_once  # type: ignore[method-assign]
                    b0, c0, w0 = backends(), time.process_time(), time.perf_counter()
                    world.run(what, i, i + block)
                    for k, v in enumerate((time.process_time() - c0, backends() - b0,
                                           time.perf_counter() - w0)):  # fmt: skip
                        sums[way][k] += v
                    i += block
            for way, (cpu, backend, wall) in sums.items():
                per = 1000 / (block * rounds)
                print(f"  {what}, deferred statements {way}: CPU {cpu * per:.3f} ms, "
                      f"PostgreSQL backend {backend * per:.3f} ms, wall {wall * per:.3f} ms")  # fmt: skip
    finally:
        _PgTx.defer = pipelined  # type: ignore[method-assign]


def callgrind_child(kind: str, what: str, n: int) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="bcd-nodecalls-") as name,
        opened_store(kind, Path(name), APP) as store,
    ):
        world = World(store, LARGE)
        world.run("join", 0, WARMUP)
        world.run("renew", 0, WARMUP)
        world.run(what, WARMUP, WARMUP + n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--cpu", type=int, default=0, help="also CPU per op over N ops")
    parser.add_argument("--no-instructions", action="store_true")
    parser.add_argument(
        "--compare-deferred",
        type=int,
        default=0,
        metavar="BLOCK",
        help="PostgreSQL: deferred statements pipelined against sent at once, "
        "blocks of BLOCK operations alternated 6 times each",
    )
    parser.add_argument("--callgrind", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.callgrind:
        kind, what, n = args.callgrind
        callgrind_child(kind, what, int(n))
        return 0
    kinds = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    for kind in kinds:
        print(f"\n[{kind}]")
        with (
            tempfile.TemporaryDirectory(prefix="bcd-nodecalls-") as name,
            opened_store(kind, Path(name), APP) as store,
        ):
            world = World(store, max(args.cpu, 1) + 12 * args.compare_deferred)
            world.run("join", 0, WARMUP)
            world.run("renew", 0, WARMUP)
            for what in ("join", "renew"):
                with recorded_statements(store) as seen:
                    world.run(what, WARMUP, WARMUP + 1)
                trips = seen.round_trips(store.dialect)
                print(f"  one {what}: {seen.transactions} transactions, "
                      f"{len(seen.statements)} statements"
                      + ("" if trips is None else f", {seen.deferred} of them deferred: "
                         f"{trips} round trips"))  # fmt: skip
                for sql in seen.statements:
                    print(f"      {' '.join(sql.split())[:100]}")
            if args.cpu:
                for what in ("join", "renew"):
                    pg0 = pg_backends_cpu_s(APP) if kind == "postgres" else None
                    start = time.process_time()
                    world.run(what, WARMUP + 1, WARMUP + 1 + args.cpu - 1)
                    ms = (time.process_time() - start) * 1000 / (args.cpu - 1)
                    extra = ""
                    if pg0 is not None:
                        pg1 = pg_backends_cpu_s(APP) or {}
                        pg = sum(v - pg0.get(k, 0.0) for k, v in pg1.items())
                        extra = f", PostgreSQL backend {pg * 1000 / (args.cpu - 1):.3f} ms"
                    print(f"  CPU per {what}: {ms:.3f} ms{extra}")
            if args.compare_deferred and kind == "postgres":
                compare_deferred(world, WARMUP + max(args.cpu, 1), args.compare_deferred, 6)
        if not args.no_instructions:
            script = str(Path(__file__).resolve())
            for what in ("join", "renew"):
                runs = [
                    callgrind_instructions([script, "--callgrind", kind, what, str(n)])
                    for n in (SMALL, LARGE)
                ]
                if runs[0] is None or runs[1] is None:
                    print("  instructions: callgrind not usable")
                    continue
                per = (runs[1] - runs[0]) / (LARGE - SMALL)
                print(f"  instructions per {what}: {per / 1e6:.2f} M")
    return 0


if __name__ == "__main__":
    sys.exit(main())
