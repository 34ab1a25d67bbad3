"""The cost of the gateways' session reports to the API (``nodefacts.record_sessions``).

Run from the repository root::

    .venv/bin/python bench/sightings.py [--nodes N] [--rounds R] [--store sqlite|postgres|both]

It prints figures and judges nothing; it is not part of the test suite.

N nodes (default 2,000) join for real (JoinService with a token, through
``tests/world/renewals.py``'s ``Env``) into a fresh store: a SQLite file, or a new
PostgreSQL schema at ``BCD_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/test``) dropped afterwards. Then their
serials are reported in reports of 1,000 (``MAX_REPORT_SERIALS``), one transaction
each, as the API applies a gateway's report, in four phases:

- ``first Hello``: each node's first report (last seen, and the adoption of a node of
  a pool without acceptance checks: its audit row and event); before each round
  every node is made ``adopting`` and never seen again (outside the timing);
- ``re-report``: the same reports again, right after: what a gateway's 5-minute
  re-report of every live session and a re-opened session mostly are, nothing new;
- ``stale``: every node's last seen moved 10 minutes back (outside the timing), then
  reported again: last seen is written;
- ``new version``: every node reports another daemon version (a fleet's upgrade).

Each phase runs R rounds (default 3) of every node's report.

Per phase: this process's CPU (``time.process_time``: the Python side, psycopg or
sqlite3 included; on SQLite the engine runs in it too), the PostgreSQL backend's CPU
(``/proc/<pid>/stat`` of the backends named by the bench's ``application_name``),
per report, and the statements per report (every ``execute`` and ``query`` of the
transaction, the read of the database's time included).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    opened_store,
    pg_backends_cpu_s,
    print_environment,
    recorded_statements,
)
from control import nodefacts  # noqa: E402
from control import pki as cpki  # noqa: E402
from control.store import Store  # noqa: E402

APP_NAME = "bcd-bench-sightings"
STALE_BY_MS = 600_000


@dataclass
class Phase:
    name: str
    reports: int
    statements: int
    py_cpu_s: float
    pg_cpu_s: float | None
    wall_s: float
    seen: int
    adopted: int


def _pg_cpu(kind: str) -> dict[int, float] | None:
    return pg_backends_cpu_s(APP_NAME) if kind == "postgres" else None


def run_phase(
    name: str,
    kind: str,
    store: Store,
    reports: Callable[[int], list[dict[str, str]]],
    rounds: int,
    before_round: str | None = None,
) -> Phase:
    """``rounds`` rounds of ``reports(round)``; ``before_round`` (SQL) runs before
    each, outside the timing."""
    phase = Phase(name, 0, 0, 0.0, None if kind == "sqlite" else 0.0, 0.0, 0, 0)
    for k in range(rounds):
        if before_round is not None:
            with store.tx() as tx:
                tx.execute(before_round)
        todo = reports(k)
        pg_before = _pg_cpu(kind)
        with recorded_statements(store) as recorded:
            wall = time.perf_counter()
            cpu = time.process_time()
            for report in todo:
                with store.tx() as tx:
                    got = nodefacts.record_sessions(tx, report)
                phase.seen += got["seen"]
                phase.adopted += got["adopted"]
            phase.py_cpu_s += time.process_time() - cpu
            phase.wall_s += time.perf_counter() - wall
        pg_after = _pg_cpu(kind)
        if pg_before is not None and pg_after is not None and phase.pg_cpu_s is not None:
            phase.pg_cpu_s += sum(v - pg_before.get(pid, 0.0) for pid, v in pg_after.items())
        phase.reports += len(todo)
        phase.statements += len(recorded.statements)
    return phase


def run_store(kind: str, n: int, rounds: int, tmp: Path) -> list[Phase]:
    from tests.world.renewals import make_env

    with opened_store(kind, tmp, APP_NAME) as store:
        store.migrate()
        env = make_env(store, cpki.build_pki("bench.example", datetime.now(UTC)))
        start = time.perf_counter()
        serials = [env.join(i).serial for i in range(n)]
        print(f"\n[{kind}] {n} nodes joined in {time.perf_counter() - start:.1f} s")
        size = nodefacts.MAX_REPORT_SERIALS
        groups = [serials[i : i + size] for i in range(0, n, size)]

        def same(k: int) -> list[dict[str, str]]:
            return [dict.fromkeys(g, "1.0.0") for g in groups]

        def upgraded(k: int) -> list[dict[str, str]]:
            return [dict.fromkeys(g, f"1.{k + 1}.0") for g in groups]

        fresh = "UPDATE nodes SET state = 'adopting', last_seen_at = NULL"
        stale = f"UPDATE nodes SET last_seen_at = last_seen_at - {STALE_BY_MS}"
        phases = [
            run_phase("first Hello", kind, store, same, rounds, fresh),
            run_phase("re-report", kind, store, same, rounds),
            run_phase("stale", kind, store, same, rounds, stale),
            run_phase("new version", kind, store, upgraded, rounds),
        ]
    return phases


def print_phases(kind: str, phases: list[Phase]) -> None:
    head = (
        f"{'phase':<12} {'reports':>7} {'stmts/report':>12} {'py CPU ms/report':>17} "
        f"{'PG CPU ms/report':>17} {'wall ms/report':>15} {'seen':>6} {'adopted':>8}"
    )
    print(f"[{kind}] reports of up to {nodefacts.MAX_REPORT_SERIALS} serials:")
    print(head)
    print("-" * len(head))
    for p in phases:
        pg = "-" if p.pg_cpu_s is None else f"{p.pg_cpu_s * 1000 / p.reports:.2f}"
        print(
            f"{p.name:<12} {p.reports:>7} {p.statements / p.reports:>12.1f} "
            f"{p.py_cpu_s * 1000 / p.reports:>17.2f} {pg:>17} "
            f"{p.wall_s * 1000 / p.reports:>15.2f} {p.seen:>6} {p.adopted:>8}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=2000, help="nodes (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each phase (default 3)")
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 100_000 or args.rounds < 1:
        parser.error("--nodes must be from 1 to 100000, --rounds at least 1")
    kinds = {"both": ["sqlite", "postgres"]}.get(args.store, [args.store])
    print_environment()
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as tmp_name:
        for kind in kinds:
            print_phases(kind, run_store(kind, args.nodes, args.rounds, Path(tmp_name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
