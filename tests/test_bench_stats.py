"""Statistics against numpy, scipy and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import strategies as st

from harness.bench.stats import Summary, bootstrap_ratio_ci, mann_whitney_u, slow_phase

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)



def test_summary_matches_numpy() -> None:
    rng = np.random.default_rng(7)
    samples = rng.lognormal(mean=10, sigma=0.3, size=501).round().astype(int).tolist()
    s = Summary.from_samples(samples, unit="ns")
    x = np.asarray(samples, dtype=np.float64)
    assert s.samples == tuple(samples)  # raw samples kept, in measurement order
    assert s.count == 501
    assert s.min == x.min() and s.max == x.max()
    assert s.mean == pytest.approx(x.mean(), rel=1e-12)
    for name, q in (("median", 50), ("p90", 90), ("p95", 95), ("p99", 99)):
        assert getattr(s, name) == pytest.approx(np.percentile(x, q), rel=1e-12)
    assert s.std == pytest.approx(np.std(x, ddof=1), rel=1e-12)
    assert s.cov == pytest.approx(np.std(x, ddof=1) / x.mean(), rel=1e-12)


def test_summary_hand_values_and_throughput() -> None:
    s = Summary.from_samples([2_000_000, 2_000_000, 2_000_000, 2_000_000], unit="ns")
    assert s.std == 0.0 and s.cov == 0.0
    # median 2 ms per batch of 8 -> 4000 items per second
    assert s.throughput(batch_size=8) == pytest.approx(4000.0)
    # under load the mean runs far above the median: the throughput follows the median, as the row does
    skewed = Summary.from_samples([1_000_000] * 9 + [91_000_000], unit="ns")
    assert skewed.mean == 10_000_000 and skewed.throughput(batch_size=1) == pytest.approx(1000.0)
    one = Summary.from_samples([5.0], unit="ms")
    assert one.std == 0.0 and one.median == 5.0
    assert one.throughput() == pytest.approx(200.0)
    assert Summary.from_samples([1, 3], unit="ns").std == pytest.approx(math.sqrt(2.0))
    with pytest.raises(ValueError):
        Summary.from_samples([], unit="ns")
    with pytest.raises(ValueError):
        Summary.from_samples([1.0], unit="minutes")


def test_stats_dict_has_no_samples() -> None:
    d = Summary.from_samples([1, 2, 3]).stats_dict()
    assert "samples" not in d and d["median"] == 2.0 and d["count"] == 3


def _sample_sets() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(2024)
    return [
        (rng.normal(0, 1, 5), rng.normal(1, 1, 7)),  # small, no ties: exact
        (rng.normal(0, 1, 3), rng.normal(0, 1, 400)),  # one small sample: exact
        (rng.normal(0, 1, 40), rng.normal(0.4, 1, 55)),  # asymptotic
        (rng.integers(0, 6, 30), rng.integers(1, 7, 35)),  # heavy ties
        (rng.integers(1000, 1010, 6), rng.integers(1003, 1012, 5)),  # small with ties
        (np.full(12, 5.0), np.full(9, 5.0)),  # all tied
    ]

def test_robust_spread_ignores_the_tail_the_cov_is_made_of() -> None:
    # 95 calls at 100 us +-1%, 5 preempted calls at 10 ms: the CoV explodes, the IQR does not.
    samples = [100_000 + (i % 5 - 2) * 500 for i in range(95)] + [10_000_000] * 5
    s = Summary.from_samples(samples)
    assert s.cov > 2  # a CoV threshold would call this run unusable
    assert s.q1 == 99_500 and s.q3 == 100_500 and s.median == 100_000
    assert s.spread == pytest.approx(0.01) and s.mad == pytest.approx(0.005)
    assert s.outliers == pytest.approx(0.05)


def test_slow_phase_finds_a_sustained_stretch_not_scattered_outliers() -> None:
    rng = np.random.default_rng(3)
    noise = rng.normal(100.0, 2.0, 1000)
    assert slow_phase(noise) is None
    scattered = noise.copy()
    scattered[::37] = 1000.0  # isolated preemptions: outliers, not a phase
    assert slow_phase(scattered) is None
    busy = noise.copy()
    busy[300:450] *= 1.6  # the machine got busy for a while
    phase = slow_phase(busy)
    assert phase is not None
    assert 275 <= phase.start <= 300 and 450 <= phase.end <= 475
    assert phase.ratio == pytest.approx(1.6, rel=0.03) and phase.fraction == pytest.approx(0.15, abs=0.03)
    assert "slow phase: samples" in phase.describe()
    assert slow_phase([100.0] * 10) is None  # too few samples to tell


def test_mann_whitney_hand_values() -> None:
    # All of a below all of b: exact p for "less" is 1 / C(4, 2).
    assert mann_whitney_u([1.0, 2.0], [3.0, 4.0], "less") == pytest.approx(1 / 6)
    assert mann_whitney_u([1.0, 2.0], [3.0, 4.0], "two-sided") == pytest.approx(2 / 6)
    assert mann_whitney_u([1.0, 2.0], [3.0, 4.0], "greater") == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    slow, fast = rng.normal(110, 5, 300), rng.normal(100, 5, 300)
    assert mann_whitney_u(slow, fast, "greater") < 1e-10 < mann_whitney_u(slow, fast, "less")
    with pytest.raises(ValueError):
        mann_whitney_u([], [1.0])


def test_bootstrap_deterministic_and_close_to_scipy() -> None:
    rng = np.random.default_rng(11)
    slow = rng.normal(110.0, 8.0, 400)
    fast = rng.normal(100.0, 8.0, 300)
    a = bootstrap_ratio_ci(slow, fast, n_resamples=3000, confidence=0.95, seed=5)
    assert a == bootstrap_ratio_ci(slow, fast, n_resamples=3000, confidence=0.95, seed=5)
    assert a != bootstrap_ratio_ci(slow, fast, n_resamples=3000, confidence=0.95, seed=6)
    assert a.ratio == pytest.approx(np.median(slow) / np.median(fast))
    assert a.low < a.ratio < a.high
    ref = scipy.stats.bootstrap(
        (slow, fast),
        lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis),
        n_resamples=3000,
        confidence_level=0.95,
        method="percentile",
        rng=np.random.default_rng(0),
    ).confidence_interval
    # Different random streams: the two intervals agree to Monte-Carlo precision.
    assert a.low == pytest.approx(ref.low, rel=0.005)
    assert a.high == pytest.approx(ref.high, rel=0.005)


def test_bootstrap_interval_widens_with_confidence_and_takes_other_stats() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.normal(50, 5, 200), rng.normal(50, 5, 200)
    narrow = bootstrap_ratio_ci(x, y, confidence=0.5, seed=0)
    wide = bootstrap_ratio_ci(x, y, confidence=0.99, seed=0)
    assert wide.low < narrow.low <= narrow.high < wide.high
    mean_ci = bootstrap_ratio_ci(x, y, stat=np.mean, seed=0)
    assert mean_ci.ratio == pytest.approx(x.mean() / y.mean())
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(x, y, confidence=1.0)
