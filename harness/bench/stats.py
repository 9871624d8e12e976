"""Statistics over raw latency samples.

The raw samples are always kept next to their summary (as pytest-benchmark
does): a later gate or comparison re-tests them instead of trusting a few
summary numbers. The tests here are implemented directly, without scipy, so
the harness's verdicts do not move when a scipy release changes defaults;
the test suite checks them against scipy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Alternative = Literal["two-sided", "less", "greater"]
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def percentile(sorted_values: npt.NDArray[np.float64], q: float) -> float:
    """Percentile ``q`` (0..100) by linear interpolation between closest ranks.

    This is Hyndman & Fan type 7, numpy's default ``method="linear"``: the
    value at fractional rank ``h = (n - 1) * q / 100`` interpolated between
    ``x[floor(h)]`` and ``x[floor(h) + 1]``. ``sorted_values`` must be sorted
    ascending and non-empty.
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} is outside 0..100")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    x_lo = float(sorted_values[lo])
    return x_lo + (h - lo) * (float(sorted_values[hi]) - x_lo)


@dataclass(frozen=True)
class Summary:
    """Descriptive statistics of one set of samples, with the samples kept.

    ``std`` is the sample standard deviation (ddof=1), 0.0 for a single
    sample; ``cov`` is ``std / mean`` (0.0 when the mean is 0).
    """

    unit: str
    samples: tuple[float, ...]
    count: int
    min: float
    max: float
    mean: float
    median: float
    p90: float
    p95: float
    p99: float
    std: float
    cov: float

    @classmethod
    def from_samples(cls, samples: Sequence[float] | npt.ArrayLike, unit: str = "ns") -> Summary:
        if unit not in _UNIT_SECONDS:
            raise ValueError(f"unit {unit!r} is not one of {sorted(_UNIT_SECONDS)}")
        raw = tuple(np.asarray(samples).tolist())
        x = np.sort(np.asarray(raw, dtype=np.float64))
        n = len(x)
        if n == 0:
            raise ValueError("cannot summarize zero samples")
        mean = float(np.mean(x))
        std = float(math.sqrt(float(np.sum((x - mean) ** 2)) / (n - 1))) if n > 1 else 0.0
        return cls(
            unit=unit,
            samples=raw,
            count=n,
            min=float(x[0]),
            max=float(x[-1]),
            mean=mean,
            median=percentile(x, 50.0),
            p90=percentile(x, 90.0),
            p95=percentile(x, 95.0),
            p99=percentile(x, 99.0),
            std=std,
            cov=std / mean if mean != 0.0 else 0.0,
        )

    def throughput(self, batch_size: int = 1) -> float | None:
        """Items per second, from the *mean* latency (None if the mean is 0).

        The mean, not the median: sustained throughput is total items over
        total time, and total time is ``count * mean``.
        """
        seconds = self.mean * _UNIT_SECONDS[self.unit]
        return batch_size / seconds if seconds > 0 else None

    def stats_dict(self) -> dict[str, Any]:
        """The summary numbers without the raw samples (those are stored once, elsewhere)."""
        return {
            "unit": self.unit,
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "median": self.median,
            "p90": self.p90,
            "p95": self.p95,
            "p99": self.p99,
            "std": self.std,
            "cov": self.cov,
        }


@dataclass(frozen=True)
class MannWhitneyResult:
    """``statistic`` is U of the first sample (scipy's convention)."""

    statistic: float
    pvalue: float
    method: Literal["exact", "asymptotic"]


def _rank_with_ties(
    values: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Average ranks (1-based) and the size of every tie group."""
    uniq, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    del uniq
    first_rank = np.cumsum(counts) - counts + 1
    avg_rank = first_rank + (counts - 1) / 2.0
    return avg_rank[inverse], counts


def _u_distribution_counts(m: int, n: int) -> list[int]:
    """Number of orderings of m x's and n y's giving each U = 0..m*n.

    These are the coefficients of the Gaussian binomial ``[m+n choose m]_q =
    prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i)``; exact integer arithmetic, and
    O(m * m * n) work with ``m`` the smaller sample.
    """
    if m > n:
        m, n = n, m
    size = m * n + 1
    c = [0] * size
    c[0] = 1
    for i in range(1, m + 1):
        a = n + i
        for k in range(size - 1, a - 1, -1):  # multiply by (1 - q^a)
            c[k] -= c[k - a]
        for k in range(i, size):  # divide by (1 - q^i)
            c[k] += c[k - i]
    return c


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney_u(
    a: Sequence[float] | npt.ArrayLike,
    b: Sequence[float] | npt.ArrayLike,
    alternative: Alternative = "two-sided",
    method: Literal["auto", "exact", "asymptotic"] = "auto",
) -> MannWhitneyResult:
    """Mann-Whitney U test of ``a`` against ``b``.

    ``alternative="greater"`` tests whether ``a`` tends to be larger than
    ``b`` (for latencies: ``a`` is slower). ``asymptotic`` is the normal
    approximation with tie correction and continuity correction; ``exact``
    enumerates the null distribution and is only valid without ties. ``auto``
    picks exact when one sample has at most 8 values and there are no ties,
    like scipy. Latency runs have hundreds of samples, so the gate always
    takes the asymptotic path.
    """
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("Mann-Whitney U needs two non-empty samples")
    if alternative not in ("two-sided", "less", "greater"):
        raise ValueError(f"alternative {alternative!r} is not two-sided, less or greater")
    ranks, ties = _rank_with_ties(np.concatenate([x, y]))
    u1 = float(np.sum(ranks[:n1])) - n1 * (n1 + 1) / 2.0
    u2 = n1 * n2 - u1
    u = {"greater": u1, "less": u2, "two-sided": max(u1, u2)}[alternative]
    has_ties = bool(np.any(ties > 1))
    if method == "auto":
        method = "exact" if min(n1, n2) <= 8 and not has_ties else "asymptotic"
    if method == "exact":
        if has_ties:
            raise ValueError("the exact Mann-Whitney distribution does not allow ties")
        counts = _u_distribution_counts(n1, n2)
        p = sum(counts[int(round(u)) :]) / math.comb(n1 + n2, n1)
    else:
        n = n1 + n2
        tie_term = float(np.sum(ties.astype(np.float64) ** 3 - ties))
        sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))) if n > 1 else 0.0
        numerator = u - n1 * n2 / 2.0 - 0.5
        if sigma == 0.0:
            p = 1.0 if numerator <= 0 else 0.0
        else:
            p = _normal_sf(numerator / sigma)
    if alternative == "two-sided":
        p *= 2.0
    return MannWhitneyResult(statistic=u1, pvalue=min(max(p, 0.0), 1.0), method=method)


@dataclass(frozen=True)
class RatioInterval:
    """``ratio = stat(numerator) / stat(denominator)`` and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    confidence: float


_BOOTSTRAP_CHUNK_ELEMENTS = 1 << 21


def bootstrap_ratio_ci(
    numerator: Sequence[float] | npt.ArrayLike,
    denominator: Sequence[float] | npt.ArrayLike,
    *,
    stat: Callable[..., Any] = np.median,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Percentile bootstrap interval of ``stat(numerator) / stat(denominator)``.

    The two samples are resampled independently (unpaired runs). ``stat``
    must accept ``axis=`` like numpy reductions. Resampling runs in chunks
    of a fixed size so memory stays bounded, and the result depends only on
    the inputs and ``seed``.
    """
    x = np.asarray(numerator, dtype=np.float64).ravel()
    y = np.asarray(denominator, dtype=np.float64).ravel()
    if len(x) == 0 or len(y) == 0:
        raise ValueError("bootstrap needs two non-empty samples")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence} must be strictly between 0 and 1")
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    rng = np.random.default_rng(seed)
    chunk = max(1, _BOOTSTRAP_CHUNK_ELEMENTS // max(len(x), len(y)))
    ratios = np.empty(n_resamples, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        for start in range(0, n_resamples, chunk):
            k = min(chunk, n_resamples - start)
            sx = x[rng.integers(0, len(x), size=(k, len(x)))]
            sy = y[rng.integers(0, len(y), size=(k, len(y)))]
            ratios[start : start + k] = stat(sx, axis=1) / stat(sy, axis=1)
        point = float(stat(x) / stat(y))
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return RatioInterval(ratio=point, low=float(low), high=float(high), confidence=confidence)
