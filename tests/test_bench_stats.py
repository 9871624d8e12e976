"""Statistics against numpy, scipy and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench.stats import Summary, bootstrap_ratio_ci, mann_whitney_u, percentile

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0.0, max_value=100.0))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    x = np.sort(np.asarray(values, dtype=np.float64))
    assert percentile(x, q) == pytest.approx(float(np.percentile(x, q)), rel=1e-12, abs=1e-9)


def test_percentile_hand_values() -> None:
    x = np.array([10.0, 20.0, 30.0, 40.0])
    # h = 3 * 0.9 = 2.7 -> 30 + 0.7 * 10
    assert percentile(x, 90) == pytest.approx(37.0)
    assert percentile(x, 50) == pytest.approx(25.0)
    assert percentile(x, 0) == 10.0 and percentile(x, 100) == 40.0
    with pytest.raises(ValueError):
        percentile(x, 101)
    with pytest.raises(ValueError):
        percentile(np.array([]), 50)


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
    # mean 2 ms per batch of 8 -> 4000 items per second
    assert s.throughput(batch_size=8) == pytest.approx(4000.0)
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


@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
@pytest.mark.parametrize("case", range(6))
def test_mann_whitney_matches_scipy(case: int, alternative: str) -> None:
    a, b = _sample_sets()[case]
    ours = mann_whitney_u(a, b, alternative)  # type: ignore[arg-type]
    ref = scipy.stats.mannwhitneyu(a, b, alternative=alternative)
    assert ours.statistic == pytest.approx(float(ref.statistic))
    if math.isnan(ref.pvalue):  # scipy gives NaN when every value is tied
        assert ours.pvalue == 1.0
    else:
        assert ours.pvalue == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_mann_whitney_forced_methods_match_scipy(alternative: str) -> None:
    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 1, 6), rng.normal(0.8, 1, 8)
    for method in ("exact", "asymptotic"):
        ours = mann_whitney_u(a, b, alternative, method=method)  # type: ignore[arg-type]
        ref = scipy.stats.mannwhitneyu(a, b, alternative=alternative, method=method)
        assert ours.method == method
        assert ours.pvalue == pytest.approx(float(ref.pvalue), rel=1e-9)


def test_mann_whitney_hand_values() -> None:
    # a entirely below b: U1 = 0; exactly 1 of the C(4, 2) = 6 orderings is that extreme.
    r = mann_whitney_u([1.0, 2.0], [3.0, 4.0], "less")
    assert r.statistic == 0.0 and r.method == "exact"
    assert r.pvalue == pytest.approx(1 / 6)
    assert mann_whitney_u([1.0, 2.0], [3.0, 4.0], "two-sided").pvalue == pytest.approx(2 / 6)
    assert mann_whitney_u([1.0, 2.0], [3.0, 4.0], "greater").pvalue == pytest.approx(1.0)
    with pytest.raises(ValueError):
        mann_whitney_u([1.0, 1.0], [1.0, 2.0], method="exact")
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
