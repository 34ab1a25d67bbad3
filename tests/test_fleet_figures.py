"""The fleet simulator's figures read from the gateways' histograms (pure logic).

``bench.fleet.bucket_quantile`` turns the growth of ``bc_revocation_delivery_seconds``'s
cumulative buckets over a phase into a quantile, as PromQL's histogram_quantile does;
``counter_deltas`` sums that growth over the gateways read at both ends of the phase.
``renewal_figures`` takes from the wave's CPU what holding the sessions costs meanwhile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import (
    RENEWAL_KEYS,
    Phase,
    bucket_quantile,
    counter_deltas,
    cpu_series,
    renewal_figures,
)
from bench.replicas import Spent


def buckets(**counts: float) -> dict[str, float]:
    return {f"le:{k.replace('_', '.').replace('inf', '+Inf')}": v for k, v in counts.items()}


def test_quantile_interpolates_within_its_bucket() -> None:
    # 100 observations: 50 up to 0.1 s, 40 in (0.1, 0.5], 10 in (0.5, 1.0]
    got = buckets(**{"0_1": 50, "0_5": 90, "1_0": 100, "inf": 100})
    assert bucket_quantile(got, 0.5) == pytest.approx(0.1)
    assert bucket_quantile(got, 0.7) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert bucket_quantile(got, 0.99) == pytest.approx(0.5 + 0.5 * 9 / 10)


def test_quantile_in_the_open_bucket_is_the_largest_bound() -> None:
    got = buckets(**{"0_1": 1, "1_0": 1, "inf": 10})
    assert bucket_quantile(got, 0.99) == 1.0


def test_no_observation_is_none() -> None:
    assert bucket_quantile(buckets(**{"0_1": 0, "inf": 0}), 0.5) is None
    assert bucket_quantile({}, 0.5) is None


def test_deltas_count_only_the_gateways_read_at_both_ends() -> None:
    before = {"gw1": {"le:+Inf": 3.0, "hs:completed": 10.0}, "gw2": {"le:+Inf": 1.0}}
    after = {"gw1": {"le:+Inf": 5.0, "hs:completed": 14.0}, "gw3": {"le:+Inf": 9.0}}
    assert counter_deltas(before, after) == {"le:+Inf": 2.0, "hs:completed": 4.0}


def _phase(name: str, wall_s: float, procs: dict[str, float], pg: float) -> Phase:
    spent = Spent(wall_s=wall_s, procs=procs, pg={"api": pg}, client_s=0.0)
    return Phase(name, start=100.0, end=100.0 + wall_s, spent=spent, xacts=10)


def test_a_renewal_s_own_cpu_leaves_out_holding_the_sessions() -> None:
    """The wave runs with every session held: at the steady phase's rate (1 CPU-s over
    10 s: 0.1 CPU-s a second), 20 s of wave spend 2 CPU-s holding them, so of 10 CPU-s
    over 1,000 renewals 8 ms each are the renewals' own."""
    steady = _phase("steady", 10.0, {"api": 0.4, "gw1": 0.5}, pg=0.1)
    renew = _phase("renewal", 20.0, {"api": 5.0, "gw1": 4.0}, pg=1.0)
    renew.detail["simulators_cpu_s"] = 3.0
    fig = renewal_figures(renew, 1000, {"renewal": 0.5}, steady)
    assert fig["renewal_cpu_ms"] == pytest.approx(10.0)
    assert fig["renewal_cpu_held_ms"] == pytest.approx(2.0)
    assert fig["renewal_cpu_net_ms"] == pytest.approx(8.0)
    assert fig["renewal_floor_ratio"] == pytest.approx(20.0)
    assert fig["renewal_floor_ratio_net"] == pytest.approx(16.0)
    assert set(fig) == set(RENEWAL_KEYS)
    assert renewal_figures(None, 0, {"renewal": 0.5}, steady) == dict.fromkeys(RENEWAL_KEYS)


def test_the_processes_cpu_is_a_rate_over_their_own_reads() -> None:
    """The processes were read 2 s apart, PostgreSQL's backends (slow to read on a
    saturated machine) stamped 0.5 s apart: the processes' cores are over 2 s."""
    a = {"t": 10.0, "t_procs": 9.0, "cpu": {"api": 1.0, "gw1": 5.0}, "pg": 3.0, "simulators": 2.0}
    b = {"t": 10.5, "t_procs": 11.0, "cpu": {"api": 2.0, "gw1": 7.0}, "pg": 3.5, "simulators": 3.0}
    cores = cpu_series([a, b])
    assert cores["api"] == [(10.5, pytest.approx(0.5))]
    assert cores["gateways"] == [(10.5, pytest.approx(1.0))]
    assert cores["simulators"] == [(10.5, pytest.approx(0.5))]
    assert cores["postgres"] == [(10.5, pytest.approx(1.0))]
