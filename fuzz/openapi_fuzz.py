"""Schemathesis against a real ``better-compute serve``, from the API's own description.

Run from the repository root (``make fuzz`` runs it after fuzz/http_fuzz.py)::

    .venv/bin/python fuzz/openapi_fuzz.py [--max-examples N] [--negative-examples M]
                                          [--seed S] [--keep]

It starts ``serve`` as tests/e2e.py does (role all, SQLite, a PKI made with
``tests.e2e.make_pki`` in a temporary directory), seeds a root tenant with its
credential, a second tenant, a site, a pool, a token and two nodes joined with real
``bcd join`` processes, and loads the schema from
the running server (``GET /api/compute/v1/openapi.json``). Then, per documented
operation, hypothesis draws ``--max-examples`` positive cases (default 1000) and
``--negative-examples`` cases that violate the schema (default 200), derandomized
from ``--seed``, each sent with the root tenant's credential (a tenant path names that
tenant; one case in four keeps the made-up bearer schemathesis drew). Every answer is checked: no 5xx (``not_a_server_error``), a documented
status, content type and headers, and a body that validates against the schema of its
status. The credential is handed to schemathesis in this process, never in argv or a
child's environment. A table of figures (cases, statuses, failures per operation) is
printed; the exit status is 1 when any check failed. Not part of ``make test``
(tests/test_openapi.py runs a small deterministic pass of the same probe).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import requests  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from control import openapi  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
"""What every answer must pass. Not negative_data_rejection: the API ignores unknown
body keys and query parameters by design, and reads ``includeInactive`` as true only
when it is ``true``, so some schema-violating inputs are rightly answered 200."""


@dataclass
class OpStats:
    label: str
    cases: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Fixed:
    """Real ids a drawn case may name, so some cases reach past NOT_FOUND."""

    tenant: str
    credential: str = field(repr=False)
    ids: dict[str, list[str]] = field(default_factory=dict)
    """Path parameter name (poolId, siteId, nodeId, requestId, tokenId) to real ids."""


def load(api: str) -> Any:
    """The schema as the running server serves it (no credential needed)."""
    return schemathesis.openapi.from_url(api + openapi.BASE + openapi.PATH)


def operations(schema: Any) -> Iterator[Any]:
    for result in schema.get_all_operations():
        yield result.ok()


def probe(
    schema: Any,
    api: str,
    fixed: Fixed,
    *,
    examples: int,
    mode: GenerationMode = GenerationMode.POSITIVE,
    seed_value: int = 0,
    only: Callable[[Any], bool] = lambda _op: True,
    on_case: Callable[[Any, Any], None] = lambda _c, _r: None,
    on_done: Callable[[OpStats], None] = lambda _s: None,
) -> dict[str, OpStats]:
    """Draw ``examples`` cases of each operation, send them to ``api``, check each answer.

    Deterministic for one ``seed`` (hypothesis seeded, no example database),
    without shrinking (bounded time); a failing case is recorded with its curl
    command (the credential elided), never raised.
    """
    out: dict[str, OpStats] = {}
    session = requests.Session()
    session.trust_env = False  # never a proxy from the environment: the bearer is in clear
    auth = {"Authorization": f"Bearer {fixed.credential}"}
    for op in operations(schema):
        if not only(op):
            continue
        stats = out.setdefault(op.label, OpStats(op.label))
        names = {p.name for p in op.path_parameters}
        pinned = {"tenantId": fixed.tenant} if "tenantId" in names else {}
        strategy = op.as_strategy(mode, path_parameters=pinned or None)

        run = settings(
            max_examples=examples,
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(
            seed(seed_value)(
                given(case=strategy)(_checker(api, session, auth, fixed, stats, names, on_case))
            )
        )
        started = time.monotonic()
        with contextlib.suppress(Unsatisfiable):  # nothing to violate: no negative case
            run()
        stats.seconds += time.monotonic() - started
        on_done(stats)
    return out


def _checker(
    api: str,
    session: requests.Session,
    auth: dict[str, str],
    fixed: Fixed,
    stats: OpStats,
    names: set[str],
    on_case: Callable[[Any, Any], None],
) -> Callable[[Any], None]:
    """The test hypothesis runs on each drawn case of one operation."""

    def one(case: Any) -> None:
        _use_real_ids(case, names, fixed, stats.cases)
        if stats.cases % 4 or not case.headers:  # else keep the credential drawn for it
            case.headers = {**(case.headers or {}), **auth}
        stats.cases += 1
        response = case.call(base_url=api, session=session, timeout=15)
        stats.statuses[response.status_code] += 1
        on_case(case, response)
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except (Exception, BaseExceptionGroup) as exc:  # a FailureGroup of the failed checks
            curl = case.as_curl_command().replace(fixed.credential, "bcak_…")
            # a failing value may be a token the API just made: never printed whole
            text = _TOKENS.sub(r"bc\1_…", f"{_describe(exc)} [{response.status_code}]\n  {curl}")
            stats.failures.append(text)

    return one


_TOKENS = re.compile(r"bc(jt|ak)_[^\s\"']+", re.IGNORECASE)


def _describe(exc: BaseException) -> str:
    """The checks that failed, one line each (schemathesis' own text is pages long)."""
    found = getattr(exc, "exceptions", None) or [exc]
    parts = []
    for failure in found:
        title = getattr(failure, "title", type(failure).__name__)
        message = str(getattr(failure, "message", failure)).strip().splitlines()
        parts.append(f"{title}: {message[0][:300] if message else ''}")
    return "; ".join(parts)


def _use_real_ids(case: Any, names: set[str], fixed: Fixed, n: int) -> None:
    """Every other case names real ids (when there are any) instead of drawn ones."""
    if n % 2 or not isinstance(case.path_parameters, dict):
        return
    for name in names:
        real = fixed.ids.get(name)
        if real:
            case.path_parameters[name] = real[(n // 2) % len(real)]


def figures(results: Sequence[dict[str, OpStats]]) -> tuple[str, int]:
    """The table of figures and the number of failures."""
    merged: dict[str, OpStats] = {}
    for result in results:
        for label, s in result.items():
            m = merged.setdefault(label, OpStats(label))
            m.cases += s.cases
            m.statuses.update(s.statuses)
            m.failures += s.failures
            m.seconds += s.seconds
    lines = [f"{'operation':<64} {'cases':>6} {'fail':>5} {'s':>6}  statuses"]
    for m in merged.values():
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(m.statuses.items()))
        lines.append(
            f"{m.label:<64} {m.cases:>6} {len(m.failures):>5} {m.seconds:>6.1f}  {statuses}"
        )
    total = sum(m.cases for m in merged.values())
    failed = sum(len(m.failures) for m in merged.values())
    lines.append(f"{'total':<64} {total:>6} {failed:>5}")
    for m in merged.values():
        for text in m.failures[:3]:
            lines.append(f"FAIL {m.label}: {text[:2000]}")
    return "\n".join(lines), failed


# --- the script -------------------------------------------------------------------------


def seed_world(cp: Any, workdir: Path, nodes: int = 2) -> Fixed:
    """A second tenant, a site, a pool and a token of the root tenant (through the API),
    and ``nodes`` machines joined to the pool with real ``bcd join`` processes."""
    from tests.e2e import Node

    credential = cp.root_credential_file.read_text().strip()
    cp.tenant("other")
    site, pool = cp.site_and_pool()
    token = cp.token(pool, maxUses=max(1, nodes))
    node_ids = []
    for i in range(nodes):
        node = Node.make(workdir / f"node{i}", cp, site, seed=100 + i)
        done = node.join(token["token"])
        if done.returncode != 0:
            raise RuntimeError(f"bcd join failed: {done.stderr.strip()}")
        node_ids.append(done.stdout.strip().splitlines()[-1].split()[2])
    return Fixed(
        cp.root_tenant,
        credential,
        {"siteId": [site], "poolId": [pool], "tokenId": [token["id"]], "nodeId": node_ids},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=1000,
                        help="positive cases per operation (default 1000)")  # fmt: skip
    parser.add_argument("--negative-examples", type=int, default=200,
                        help="schema-violating cases per operation (default 200)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)

    from tests.e2e import ControlPlane, make_pki

    tmp = Path(tempfile.mkdtemp(prefix="bcd-openapi-fuzz-"))
    print(f"openapi-fuzz: working in {tmp}", flush=True)
    started = time.monotonic()
    try:
        template = tmp / "template"
        template.mkdir()
        make_pki(template)
        home = tmp / "cp"
        home.mkdir()
        cp = ControlPlane.start(home, template, f"sqlite:///{tmp / 'store.db'}")
        try:
            fixed = seed_world(cp, tmp)
            schema = load(cp.api)
            print(
                f"openapi-fuzz: {len(list(operations(schema)))} operations, "
                f"{args.max_examples} positive and {args.negative_examples} negative "
                f"cases each, seed {args.seed}",
                flush=True,
            )
            results = [
                probe(schema, cp.api, fixed, examples=n, mode=mode, seed_value=args.seed,
                      on_done=lambda s, m=mode: print(
                          f"openapi-fuzz: {m.value} {s.label}: {s.cases} cases, "
                          f"{len(s.failures)} failed, {s.seconds:.1f} s", flush=True))
                for n, mode in ((args.max_examples, GenerationMode.POSITIVE),
                                (args.negative_examples, GenerationMode.NEGATIVE))
            ]  # fmt: skip
            alive = cp.proc.poll() is None
            log = (home / "serve.log").read_text(errors="replace")
        finally:
            cp.stop()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    table, failed = figures(results)
    print(table)
    tracebacks = log.count("Traceback")
    print(
        f"openapi-fuzz: {time.monotonic() - started:.0f} s; serve "
        f"{'alive' if alive else 'DIED'}; {tracebacks} tracebacks in its log; "
        f"{failed} failed checks",
        flush=True,
    )
    return 1 if failed or tracebacks or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
