"""The fleet simulator (bench/fleet.py) runs every phase with no error, small.

An outcome, not a speed: 40 nodes in 2 simulator processes against an API replica and
2 gateways on PostgreSQL join, hold their sessions, renew, lose 4 of them to
revocations and move off a gateway killed with SIGKILL; every phase reports 0 errors and
the JSON beside the plot holds every figure. With ``--skip-renewal`` the same without
the renewal wave, whose figures are then None, and with ``--probe-nodes 10``: a third
simulator process of 10 nodes, from which the revoked ones are drawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_OK, PG_URL

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import FIGURE_KEYS, PHASES, RENEWAL_KEYS  # noqa: E402


@pytest.mark.parametrize("skip_renewal", [False, True])
def test_every_phase_without_error(tmp_path: Path, skip_renewal: bool) -> None:
    assert PG_OK, f"PostgreSQL is not reachable at {PG_URL}"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "fleet.py"), "--nodes", "40", "--procs", "2",
            "--gateways", "2", "--concurrency", "4", "--ping-seconds", "1",
            "--steady-pings", "2", "--quick-floor", "--out", str(tmp_path),
            *(["--skip-renewal", "--probe-nodes", "10"] if skip_renewal else []),
        ],
        capture_output=True,
        text=True,
        timeout=150,  # about 45 s on an idle machine, 80 s under a full test run
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "fleet-40.json").read_text())
    ran = [p for p in PHASES if not (skip_renewal and p == "renewal")]
    assert figures["errors"] == dict.fromkeys(ran, 0), done.stdout[-3000:]
    missing = [k for k in FIGURE_KEYS if k not in figures]
    assert not missing, missing
    renewal = {k: figures[k] for k in RENEWAL_KEYS}
    if skip_renewal:
        assert renewal == dict.fromkeys(RENEWAL_KEYS), renewal
    else:
        assert None not in renewal.values(), renewal
        assert figures["renewals_per_s"] > 0
    assert figures["revocations"] == 4
    if skip_renewal:  # this run's revoked nodes are the probe's, in a process of its own
        assert figures["revocation_probe_nodes"] == 10
        assert figures["revocation_ended_in_probe"] == figures["revocations"]
    else:  # drawn from all the nodes
        assert figures["revocation_probe_nodes"] == 0
        assert figures["revocation_ended_in_probe"] is None
    # every revoked node's session got its signed notice from its gateway, which timed it
    assert figures["revocation_gateway_pushed"] == figures["revocations"]
    assert figures["revocation_gateway_p99_ms"] is not None
    # and each written on its connection, no sooner than it was queued
    assert figures["revocation_written_p99_ms"] >= figures["revocation_gateway_p99_ms"]
    # each node verified its notice before its session ended (bcd's "certificate revoked")
    assert 0 < figures["revocation_verified_p99_ms"] <= figures["revocation_p99_ms"]
    # gw1 held the sessions of half the nodes but its revoked ones; all moved to gw2
    assert figures["reconnect_nodes"] >= 20 - figures["revocations"]
    assert figures["reconnect_time_s"] is not None
    # each node that moved completed a handshake on gw2 (bc_tls_handshakes_total)
    assert figures["reconnect_handshakes"]["completed"] >= figures["reconnect_nodes"]
    # every join went through a gateway's relay, answered, as the gateways counted it
    join_relay = figures["relay_by_phase"]["join"]
    assert join_relay["answered"] >= 40, join_relay
    assert join_relay.get("unavailable", 0) == 0, join_relay
    assert (tmp_path / "fleet-40.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
