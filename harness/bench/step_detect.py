"""Step changes in a series of benchmark medians: a penalized piecewise-constant fit.

The model (as airspeed velocity's, after Friedrich et al. 2008, "Complexity
Penalized M-Estimation"): the log of a case's median latency, run after run,
is constant between the commits that changed it, plus noise. The fit chooses
the segments that minimize

    gamma * (number of segments - 1) + sum_i w_i * |y_i - level(segment of i)|

exactly, by dynamic programming over every segmentation (optimal
partitioning). ``y`` is the log of each median, so a level difference is a
ratio whatever the case's scale; the absolute (L1) error with each segment's
weighted median as its level keeps one noisy run from bending a level; a
run's weight is the inverse of its recorded spread (IQR/median of its
samples), so an unstable run counts less than a steady one. The penalty
``gamma = PENALTY * sigma * ln(n)`` is a Schwarz-type (BIC) penalty per
break, with ``sigma`` the run-to-run noise estimated robustly from the
series itself (the median absolute difference of consecutive runs, which a
few steps do not move): a step must explain more than the noise of ``n``
runs would by chance.

Then what the fit found is judged for size: a step whose ratio is within
the run-to-run spread the results record (the larger of the two segments'
median IQR/median), or below ``min_change``, is not reported, and its two
segments are merged (the smallest such step first, then the levels are
recomputed). A segment has at least ``min_segment`` runs (default 2): one
slow run is an outlier until the next run confirms it (the gate judges the
newest run on its own).

Cost: the fit is cubic in the number of points (numpy; well under a second
for 500 runs), memory quadratic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

# The penalty per break in units of sigma * ln(n): a Schwarz criterion's ln(n) with a
# factor chosen on simulated series: pure noise (Gaussian or Laplace) gets a break in
# about 2% of series of 10 runs and practically none of 30 or more (before the size
# filter below; tests/test_history.py checks it), while a break of 4 sigma with 3 runs
# after it is placed exactly in about two thirds of series of 10 runs.
PENALTY = 3.0
# Consecutive-difference MAD to a Gaussian sigma: median |x - y| = 0.6745 * sqrt(2) * sigma.
_MAD_DIFF_TO_SIGMA = 1.0 / (0.6745 * math.sqrt(2.0))
# Below these the data say nothing more: a median repeats no better than 0.1% between
# runs, and a spread under 0.5% is taken as 0.5% when it weights a run.
NOISE_FLOOR = 1e-3
SPREAD_FLOOR = 5e-3
MIN_SEGMENT = 2


@dataclass(frozen=True)
class Segment:
    """Points ``start`` (inclusive) to ``end`` (exclusive) at one level (the weighted median, in the
    values' own unit), with the median of their recorded spreads."""

    start: int
    end: int
    level: float
    spread: float


@dataclass(frozen=True)
class Step:
    """A change of level between point ``index - 1`` (the last before it) and point ``index``.

    ``ratio`` is ``after / before``: above 1 a regression for a latency, below 1 an
    improvement. ``threshold`` is the relative change the step had to exceed
    (``max(min_change, spread)``) to be reported.
    """

    index: int
    before: float
    after: float
    threshold: float

    @property
    def ratio(self) -> float:
        return self.after / self.before

    @property
    def kind(self) -> Literal["regression", "improvement"]:
        return "regression" if self.after > self.before else "improvement"


@dataclass(frozen=True)
class Fit:
    """The reported segmentation: consecutive segments covering every point, and the steps between them."""

    segments: tuple[Segment, ...]
    steps: tuple[Step, ...]
    sigma: float  # the noise estimate the penalty used (log units: a relative noise)
    penalty: float


def _weighted_median(y: npt.NDArray[np.float64], w: npt.NDArray[np.float64]) -> float:
    """The smallest ``m`` among ``y`` with at least half the weight at or below it."""
    order = np.argsort(y, kind="stable")
    cum = np.cumsum(w[order])
    return float(y[order][int(np.searchsorted(cum, cum[-1] / 2.0))])


def _segment_costs(y: npt.NDArray[np.float64], w: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``C[l, r]``: the least weighted L1 cost of points ``l..r-1`` at one level (inf where r <= l).

    The best level of a segment is a weighted median, one of its own points,
    so ``C[l, r] = min over k in [l, r) of sum_{l <= i < r} w_i |y_i - y_k|``:
    with ``P[k, r]`` the prefix sums over ``i`` of ``w_i |y_i - y_k|``, a
    running minimum over ``k`` gives every ``r`` for one ``l`` at once.
    """
    n = y.size
    prefix = np.zeros((n, n + 1))
    np.cumsum(w[None, :] * np.abs(y[None, :] - y[:, None]), axis=1, out=prefix[:, 1:])
    costs = np.full((n + 1, n + 1), np.inf)
    for left in range(n):
        # rows: level y_k for k = left..n-1; columns: segment end r = left+1..n
        within = prefix[left:, left + 1 :] - prefix[left:, left][:, None]
        best = np.minimum.accumulate(within, axis=0)  # row j: the best level among points left..left+j
        costs[left, left + 1 :] = np.diagonal(best)  # end r = left+1+j takes row j
    return costs


def _optimal_breaks(costs: npt.NDArray[np.float64], n: int, penalty: float, min_segment: int) -> list[int]:
    """The segment starts (after 0) minimizing total cost + penalty per break, each segment >= min_segment."""
    best = np.full(n + 1, np.inf)
    best[0] = -penalty  # the first segment pays no break
    prev = np.zeros(n + 1, dtype=np.int64)
    for end in range(min_segment, n + 1):
        starts = np.arange(0, end - min_segment + 1)
        starts = starts[(starts == 0) | (starts >= min_segment)]
        totals = best[starts] + costs[starts, end] + penalty
        i = int(np.argmin(totals))
        best[end], prev[end] = totals[i], starts[i]
    breaks = []
    end = n
    while end > 0:
        end = int(prev[end])
        if end > 0:
            breaks.append(end)
    return sorted(breaks)


def noise_sigma(y: npt.NDArray[np.float64]) -> float:
    """Run-to-run noise of a log series, from the median absolute difference of consecutive points.

    A step moves one difference only, so a few steps leave it unchanged; never below :data:`NOISE_FLOOR`.
    """
    if y.size < 2:
        return NOISE_FLOOR
    return max(float(np.median(np.abs(np.diff(y)))) * _MAD_DIFF_TO_SIGMA, NOISE_FLOOR)


def fit_steps(
    values: Sequence[float],
    spreads: Sequence[float],
    *,
    min_change: float = 0.05,
    min_segment: int = MIN_SEGMENT,
    penalty_factor: float = PENALTY,
) -> Fit:
    """Segments and reported steps of ``values`` (positive, in run order), each with its recorded
    ``spread`` (IQR/median, >= 0).

    A step is reported when the fit puts a break there and its ratio differs
    from 1 by more than ``max(min_change, spread)`` (in log terms:
    ``|ln ratio| > ln(1 + that)``), ``spread`` being the larger of the two
    segments' median spreads. Fewer than ``2 * min_segment`` points give one
    segment and no step. Raises ValueError for non-positive or non-finite
    values, negative spreads, or sequences of different lengths.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    s = np.asarray(spreads, dtype=np.float64).reshape(-1)
    if s.shape != v.shape:
        raise ValueError(f"{v.size} values but {s.size} spreads")
    if not np.all(np.isfinite(v) & (v > 0)) or not np.all(np.isfinite(s) & (s >= 0)):
        raise ValueError("values must be positive and finite, spreads finite and >= 0")
    y = np.log(v)
    if min_segment < 1 or min_change < 0:
        raise ValueError("min_segment must be >= 1 and min_change >= 0")
    n = y.size
    if n == 0:
        return Fit((), (), NOISE_FLOOR, 0.0)
    floored = np.maximum(s, SPREAD_FLOOR)
    w = float(np.median(floored)) / floored  # relative weights: the median run weighs 1
    sigma = noise_sigma(y)
    penalty = penalty_factor * sigma * math.log(max(n, 2))
    breaks = _optimal_breaks(_segment_costs(y, w), n, penalty, min_segment) if n >= 2 * min_segment else []
    bounds = [0, *breaks, n]

    def level(a: int, b: int) -> float:
        return _weighted_median(y[a:b], w[a:b])

    def threshold(i: int) -> float:
        """The relative change the break at ``bounds[i]`` must exceed."""
        left, right = s[bounds[i - 1] : bounds[i]], s[bounds[i] : bounds[i + 1]]
        return max(min_change, float(np.median(left)), float(np.median(right)))

    while len(bounds) > 2:  # merge the smallest step that is within its threshold, then look again
        margins = []
        for i in range(1, len(bounds) - 1):
            change = abs(level(bounds[i], bounds[i + 1]) - level(bounds[i - 1], bounds[i]))
            margins.append(change - math.log1p(threshold(i)))
        worst = int(np.argmin(margins))
        if margins[worst] > 0:
            break
        del bounds[worst + 1]
    segments = tuple(
        Segment(a, b, math.exp(level(a, b)), float(np.median(s[a:b]))) for a, b in zip(bounds, bounds[1:], strict=False)
    )
    steps = tuple(
        Step(after.start, before.level, after.level, threshold(i + 1))
        for i, (before, after) in enumerate(zip(segments, segments[1:], strict=False))
    )
    return Fit(segments, steps, sigma, penalty)
