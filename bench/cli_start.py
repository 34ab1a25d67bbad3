"""How fast ``bcd`` starts: ``bcd version``, ``bcd --help``, ``bcd join``, and the floor.

Run from the repository root::

    .venv/bin/python bench/cli_start.py [--runs N] [--joins M]

It prints figures and judges nothing; it is not part of the test suite.

What it measures, each as the wall time of a fresh process (``subprocess.run``, from
fork to exit; median, min and p90 of N runs, default 20, after one unmeasured run
so the page cache is warm):

1. **The import floor.** ``python -c pass`` (the interpreter and its ``site``, the
   venv's editable-install finders included) and ``python -c "import bcd.join"``
   (everything a join needs on import: trio, cryptography, jwcrypto, httpx, bcd's
   wire and TLS code). Nothing bcd does can start faster than the first; a join
   cannot start faster than the second.
2. **``bcd version`` and ``bcd --help``**, through the installed ``.venv/bin/bcd``
   entry point. Both import only :mod:`bcd.cli`, which imports what a command needs
   inside the command (issue 12 asks for 150 ms). The modules ``import bcd.cli``
   loads, and the ten slowest by cumulative time (``python -X importtime``), are
   printed too, so a heavy import that creeps back names itself.
3. **``bcd join`` on loopback** (M joins, default 5; ``--joins 0`` skips it): a real
   ``better-compute serve`` on SQLite (PKI made by the real CLI, started as
   ``tests/e2e.py`` starts it), and for each join a fresh node directory (its
   config.toml and join-encryption.jwk, as the install script leaves them) and a
   fresh one-use token on standard input, run as root as ``bcd join`` must. The
   figure to read is ``join - floor``: the median join minus the median
   ``import bcd.join``, which is what the join itself costs (loading the attestor
   plugins, config, key and CSR, the sealed token, one pinned TLS connection, the
   control plane's transaction, verifying and persisting the answer). Issue 12 asks
   that it stay within 0.1 s. A join imports more than ``bcd.join`` (the plan, the
   plugins, and what is imported only when used: httpx for the gateway, the
   attestors), so a second floor is printed: one process importing every module the
   (warm-up) join imported, found with ``-X importtime``; ``join - its imports`` is
   then the work alone.

How to read it: on a busy machine every figure moves by tens of ms from run to run
(the min is the least disturbed); compare the figures of one run with each other,
not with another machine's.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PYTHON = ROOT / ".venv" / "bin" / "python"
BCD = ROOT / ".venv" / "bin" / "bcd"


def wall_s(argv: Sequence[str], *, stdin: bytes = b"", env: dict[str, str] | None = None) -> float:
    """Wall time of one process from start to exit; it must succeed."""
    start = time.perf_counter()
    done = subprocess.run(list(argv), input=stdin, capture_output=True, env=env, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.decode(errors='replace')}")
    return elapsed


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return (
        f"median {statistics.median(ordered) * 1000:6.1f} ms   min {ordered[0] * 1000:6.1f} ms"
        f"   p90 {p90 * 1000:6.1f} ms   (n={len(ordered)})"
    )


def sample(runs: int, once: Callable[[], float]) -> list[float]:
    once()  # warm the page cache; not measured
    return [once() for _ in range(runs)]


def import_profile(module: str, top: int = 10) -> tuple[int, list[tuple[int, str]]]:
    """How many modules ``import module`` loads, and the ``top`` slowest (cumulative us)."""
    done = subprocess.run(
        [str(PYTHON), "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows: list[tuple[int, str]] = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        rows.append((int(parts[1]), parts[2].rstrip()))
    return len(rows), sorted(rows, reverse=True)[:top]


def print_floor_and_cli(runs: int) -> dict[str, list[float]]:
    cases = {
        "python -c pass": [str(PYTHON), "-c", "pass"],
        'python -c "import bcd.join"': [str(PYTHON), "-c", "import bcd.join"],
        "bcd version": [str(BCD), "version"],
        "bcd --help": [str(BCD), "--help"],
    }
    results: dict[str, list[float]] = {}
    for name, argv in cases.items():
        results[name] = sample(runs, functools.partial(wall_s, argv))
        print(f"{name:<30} {summary(results[name])}")
    count, slowest = import_profile("bcd.cli")
    print(f"\nimport bcd.cli loads {count} modules; the slowest (cumulative, -X importtime):")
    for us, name in slowest:
        print(f"  {us / 1000:7.1f} ms  {name}")
    return results


def modules_loaded_by(argv: Sequence[str], stdin: bytes, env: dict[str, str]) -> list[str]:
    """The modules a run imports after its first bcd module, in order (``-X importtime``;
    the outermost of each import, also one made inside a function)."""
    done = subprocess.run(
        [str(PYTHON), "-X", "importtime", *argv], input=stdin, capture_output=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"the profiled join failed: {done.stderr.decode(errors='replace')}")
    names: list[str] = []
    for line in done.stderr.decode(errors="replace").splitlines():
        parts = line.split("|")
        if len(parts) != 3 or parts[2].startswith("  "):
            continue
        name = parts[2].strip()
        if name.startswith("bcd") or names:
            names.append(name)
    return names


def measure_joins(joins: int, runs: int, floor_s: float) -> None:
    from tests.e2e import ControlPlane, Node, cli_env, make_pki

    if os.geteuid() != 0:
        print("\nbcd join: skipped (it must run as root)")
        return
    with tempfile.TemporaryDirectory(prefix="bcd-bench-cli-") as tmp_name:
        tmp = Path(tmp_name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        home = tmp / "cp"
        home.mkdir()
        cp = ControlPlane.start(home, template, f"sqlite:///{tmp / 'cp.db'}")
        try:
            site, pool = cp.site_and_pool()
            nodes = [Node.make(tmp / f"node-{i}", cp, site, seed=i + 1) for i in range(joins + 1)]
            tokens = [(cp.token(pool)["token"] + "\n").encode() for _ in nodes]

            def argv_env(i: int) -> tuple[list[str], dict[str, str]]:
                node = nodes[i]
                argv = [str(BCD), "join", "--sysfs-root", str(node.sysfs)]
                return [*argv, "--config", str(node.config)], cli_env(node.root, secret=False)

            # Warm (the control plane's first join, the page cache), and profiled: the
            # modules this join imports.
            argv, env = argv_env(joins)
            modules = modules_loaded_by(argv, tokens[joins], env)
            samples = []
            for i in range(joins):
                argv, env = argv_env(i)
                samples.append(wall_s(argv, stdin=tokens[i], env=env))
        finally:
            cp.stop()
    imports = sample(
        runs, functools.partial(wall_s, [str(PYTHON), "-c", "import " + ", ".join(modules)])
    )
    median = statistics.median(samples)
    print(f"\n{'bcd join (loopback, SQLite)':<30} {summary(samples)}")
    print(f"{'import what a join imports':<30} {summary(imports)}")
    print(f"  ({len(modules)} imports from the top: {', '.join(modules)})")
    print(
        f"{'join - floor':<30} {(median - floor_s) * 1000:6.1f} ms  "
        '(median join minus median python -c "import bcd.join")'
    )
    print(
        f"{'join - its imports':<30} {(median - statistics.median(imports)) * 1000:6.1f} ms  "
        "(the work: plugins, plan, key, TLS, the control plane's answer, persist)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per command (default 20)")
    parser.add_argument("--joins", type=int, default=5, help="bcd joins (default 5; 0 skips)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.joins < 0:
        parser.error("--runs must be at least 1 and --joins at least 0")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    results = print_floor_and_cli(args.runs)
    if args.joins:
        floor = statistics.median(results['python -c "import bcd.join"'])
        measure_joins(args.joins, args.runs, floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
