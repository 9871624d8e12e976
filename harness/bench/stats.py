"""Statistics over raw latency samples, with numpy and scipy.

The raw samples are always kept next to their summary (as pytest-benchmark
does): a later gate or comparison re-tests them instead of trusting a few
summary numbers, and a results file is checked by recomputing its summaries.

Spread is judged robustly. On a shared machine a few preempted calls take
100x the median and dominate the standard deviation, so the coefficient of
variation flags every case and tells the user nothing. The interquartile
range over the median (IQR/median) ignores that tail; the tail itself is
reported as the fraction of outlier samples (Tukey's fences, 1.5 IQR beyond
the quartiles), and a *sustained* slow stretch of calls (a second mode: the
machine got busy for a while) is detected separately by :func:`slow_phase`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import scipy.stats

Alternative = Literal["two-sided", "less", "greater"]
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
# Tukey's fences: samples this many IQRs beyond the quartiles are outliers.
OUTLIER_FENCE = 1.5


@dataclass(frozen=True)
class Summary:
    """Descriptive statistics of one set of samples, with the samples kept.

    Percentiles are numpy's default (linear interpolation). ``std`` is the
    sample standard deviation (ddof=1; 0 for one sample), ``cov`` = std/mean.
    ``spread`` is IQR/median, ``mad`` the median absolute deviation over
    the median, ``outliers`` the fraction of samples beyond Tukey's fences.
    """

    unit: str
    samples: tuple[float, ...]
    count: int
    min: float
    max: float
    mean: float
    median: float
    q1: float
    q3: float
    p90: float
    p95: float
    p99: float
    std: float
    cov: float
    spread: float
    mad: float
    outliers: float

    @classmethod
    def from_samples(cls, samples: Sequence[float] | npt.ArrayLike, unit: str = "ns") -> Summary:
        if unit not in _UNIT_SECONDS:
            raise ValueError(f"unit {unit!r} is not one of {sorted(_UNIT_SECONDS)}")
        raw = tuple(np.asarray(samples).tolist())
        x = np.asarray(raw, dtype=np.float64)
        if x.size == 0:
            raise ValueError("cannot summarize zero samples")
        q1, median, q3, p90, p95, p99 = (float(v) for v in np.percentile(x, [25, 50, 75, 90, 95, 99]))
        mean = float(np.mean(x))
        std = float(np.std(x, ddof=1)) if x.size > 1 else 0.0
        iqr = q3 - q1
        fences = (q1 - OUTLIER_FENCE * iqr, q3 + OUTLIER_FENCE * iqr)
        return cls(
            unit=unit,
            samples=raw,
            count=int(x.size),
            min=float(x.min()),
            max=float(x.max()),
            mean=mean,
            median=median,
            q1=q1,
            q3=q3,
            p90=p90,
            p95=p95,
            p99=p99,
            std=std,
            cov=std / mean if mean else 0.0,
            spread=iqr / median if median else 0.0,
            mad=float(np.median(np.abs(x - median))) / median if median else 0.0,
            outliers=float(np.mean((x < fences[0]) | (x > fences[1]))),
        )

    def throughput(self, batch_size: int = 1) -> float | None:
        """Items per second at the *median* latency: ``batch_size / median`` (None if the median is 0).

        The median, as every other figure of a row is: under load the mean can
        be several times the median, and a throughput from it would contradict
        the row's latency. Total items over total time (an offline run's
        throughput) is a different figure, kept apart by the timing loop.
        """
        seconds = self.median * _UNIT_SECONDS[self.unit]
        return batch_size / seconds if seconds > 0 else None

    def stats_dict(self) -> dict[str, Any]:
        """The summary numbers without the raw samples (those are stored once, elsewhere)."""
        return {
            "unit": self.unit,
            **{name: getattr(self, name) for name in SUMMARY_FIELDS},
        }


SUMMARY_FIELDS = (
    "count", "min", "max", "mean", "median", "q1", "q3", "p90", "p95", "p99",
    "std", "cov", "spread", "mad", "outliers",
)  # fmt: skip


@dataclass(frozen=True)
class SlowPhase:
    """A stretch of consecutive calls markedly slower than the rest (samples ``start:end``)."""

    start: int
    end: int
    fraction: float  # of all samples
    ratio: float  # median inside the stretch over the median outside it

    def describe(self) -> str:
        return (
            f"slow phase: samples {self.start}-{self.end} ({self.fraction:.0%} of the run) "
            f"at x{self.ratio:.2f} the median of the rest"
        )


# A window whose median is this much above the run's median is slow; a slow
# phase is at least this many slow windows in a row (isolated slow calls are
# outliers, not a phase).
SLOW_WINDOW_RATIO = 1.25
SLOW_PHASE_WINDOWS = 2
_WINDOWS = 40


def slow_phase(samples: Sequence[float]) -> SlowPhase | None:
    """The longest sustained slow stretch of a run, in call order, if any.

    The run is cut into up to 40 consecutive windows (at least 5 calls each);
    a phase is two or more windows in a row whose median exceeds the run's
    median by 25%, or by twice the run's own spread (IQR/median) when that is
    larger, so that plain noise is not taken for a phase: something else took
    the CPU for a while, so those samples measure the machine, not the engine.
    """
    x = np.asarray(samples, dtype=np.float64)
    width = max(5, x.size // _WINDOWS)
    count = x.size // width
    if count < 2 * SLOW_PHASE_WINDOWS:
        return None
    q1, median, q3 = np.percentile(x, [25, 50, 75])
    limit = max(SLOW_WINDOW_RATIO, 1 + 2 * (q3 - q1) / median) * median
    medians = np.median(x[: count * width].reshape(count, width), axis=1)
    slow = medians > limit
    best: tuple[int, int] | None = None
    start = None
    for i, flag in enumerate([*slow.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            if i - start >= SLOW_PHASE_WINDOWS and (best is None or i - start > best[1] - best[0]):
                best = (start, i)
            start = None
    if best is None:
        return None
    lo, hi = best[0] * width, best[1] * width
    inside, outside = x[lo:hi], np.concatenate([x[:lo], x[hi:]])
    return SlowPhase(lo, hi, inside.size / x.size, float(np.median(inside) / np.median(outside)))


def mann_whitney_u(
    a: Sequence[float] | npt.ArrayLike,
    b: Sequence[float] | npt.ArrayLike,
    alternative: Alternative = "two-sided",
) -> float:
    """p-value of the Mann-Whitney U test of ``a`` against ``b`` (scipy's, method chosen by it).

    ``alternative="greater"``: ``a`` tends to be larger than ``b`` (for
    latencies: ``a`` is slower).
    """
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.size == 0 or y.size == 0:
        raise ValueError("Mann-Whitney U needs two non-empty samples")
    return float(scipy.stats.mannwhitneyu(x, y, alternative=alternative).pvalue)


@dataclass(frozen=True)
class RatioInterval:
    """``ratio = stat(numerator) / stat(denominator)`` and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    confidence: float


_BOOTSTRAP_BATCH_ELEMENTS = 1 << 21


def bootstrap_ratio_ci(
    numerator: Sequence[float] | npt.ArrayLike,
    denominator: Sequence[float] | npt.ArrayLike,
    *,
    stat: Callable[..., Any] = np.median,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Percentile bootstrap interval of ``stat(numerator) / stat(denominator)`` (scipy's bootstrap).

    The two samples are resampled independently (unpaired runs); resampling
    runs in batches so memory stays bounded, and the result depends only on
    the inputs and ``seed``.
    """
    x = np.asarray(numerator, dtype=np.float64).ravel()
    y = np.asarray(denominator, dtype=np.float64).ravel()
    if x.size == 0 or y.size == 0:
        raise ValueError("bootstrap needs two non-empty samples")
    if not 0 < confidence < 1 or n_resamples < 1:
        raise ValueError(f"confidence {confidence} must lie strictly between 0 and 1, n_resamples be >= 1")

    def ratio(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64], axis: int = -1) -> Any:
        return stat(a, axis=axis) / stat(b, axis=axis)

    result = scipy.stats.bootstrap(
        (x, y),
        ratio,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        paired=False,
        vectorized=True,
        batch=max(1, _BOOTSTRAP_BATCH_ELEMENTS // max(x.size, y.size)),
        rng=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return RatioInterval(float(ratio(x, y)), float(low), float(high), confidence)
