"""The fleet simulator's figures read from the gateways' histograms (pure logic).

``bench.fleet.bucket_quantile`` turns the growth of ``bc_revocation_delivery_seconds``'s
cumulative buckets over a phase into a quantile, as PromQL's histogram_quantile does;
``counter_deltas`` sums that growth over the gateways read at both ends of the phase.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import bucket_quantile, counter_deltas


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
