"""The error metrics both debug commands speak, and accuracy targets written ``METRIC<=X``.

Errors are the bench's own (:func:`harness.bench.accuracy.compare_outputs`:
float64, paired by output path, relative error with a floor), so a number
printed here means what the same number means in a results table. A
comparison is summarised as :class:`ErrorStats`, the worst over outputs;
:meth:`ErrorStats.worst` folds batches together, because a plan must meet its
target on *every* batch. Non-finite outputs (NaN, Inf) count as an infinite
error under every metric: they never meet a target and always rank first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from harness.bench.accuracy import AccuracyResult
from harness.errors import HarnessError

# Output-error metrics, then the task metric of models with labelled data.
ERROR_METRICS = ("max-abs-err", "max-rel-err", "1-cosine")
TASK_METRIC = "task-accuracy-drop"
METRICS = (*ERROR_METRICS, TASK_METRIC)
# A target's limit may be this word: the value eager torch.autocast reaches on the same batches.
EAGER_AUTOCAST = "eager-autocast"

_TARGET = re.compile(r"^\s*(?P<metric>[a-z0-9-]+)\s*<=\s*(?P<limit>\S+)\s*$")


@dataclass(frozen=True)
class ErrorStats:
    """One comparison (or the worst of several) against the fp32 reference.

    ``None`` errors mean nothing finite was compared; ``nonfinite`` counts
    NaN and Inf values in the output under test.
    """

    max_abs: float | None
    max_rel: float | None
    cosine: float | None
    nonfinite: int

    @classmethod
    def of(cls, result: AccuracyResult) -> ErrorStats:
        nonfinite = sum(m.nan_count + m.inf_count for m in result.outputs)
        return cls(result.max_abs_error, result.max_rel_error, result.cosine, nonfinite)

    @classmethod
    def exact(cls) -> ErrorStats:
        return cls(0.0, 0.0, 1.0, 0)

    def worst(self, other: ErrorStats) -> ErrorStats:
        """The worse of two comparisons in every field (batches fold together with this)."""

        def pick(a: float | None, b: float | None, fn: Any) -> float | None:
            present = [v for v in (a, b) if v is not None]
            return fn(present) if present else None

        return ErrorStats(
            pick(self.max_abs, other.max_abs, max),
            pick(self.max_rel, other.max_rel, max),
            pick(self.cosine, other.cosine, min),
            self.nonfinite + other.nonfinite,
        )

    def value(self, metric: str) -> float:
        """The error under ``metric`` (one of :data:`ERROR_METRICS`); inf when not finite."""
        if self.nonfinite:
            return math.inf
        if metric == "max-abs-err":
            raw = self.max_abs
        elif metric == "max-rel-err":
            raw = self.max_rel
        elif metric == "1-cosine":
            raw = None if self.cosine is None else max(0.0, 1.0 - self.cosine)
        else:
            raise HarnessError(f"unknown error metric {metric!r}; valid: {', '.join(ERROR_METRICS)}")
        return math.inf if raw is None else raw

    def to_json(self) -> dict[str, Any]:
        return {"max_abs_err": self.max_abs, "max_rel_err": self.max_rel, "cosine": self.cosine, "nonfinite": self.nonfinite}


def check_metric(metric: str, what: str, allowed: tuple[str, ...] = METRICS) -> str:
    if metric not in allowed:
        raise HarnessError(f"{what}: unknown metric {metric!r}; valid: {', '.join(allowed)}")
    return metric


@dataclass(frozen=True)
class Target:
    """``metric <= limit``; ``limit`` is None while it still names eager autocast's value."""

    metric: str
    limit: float | None
    relative_to: str | None = None  # EAGER_AUTOCAST: the limit is eager autocast's own error

    def met(self, value: float) -> bool:
        if self.limit is None:
            raise AssertionError("a target relative to eager autocast must be resolved before use")
        return math.isfinite(value) and value <= self.limit

    def resolved(self, limit: float) -> Target:
        return Target(self.metric, limit, self.relative_to)

    @property
    def ranking_metric(self) -> str:
        """The per-layer metric that ranks layers for this target (task accuracy: relative error)."""
        return "max-rel-err" if self.metric == TASK_METRIC else self.metric

    def describe(self) -> str:
        if self.limit is None:
            return f"{self.metric}<={self.relative_to}"
        text = f"{self.metric}<={self.limit:.4g}"
        return text + (f" ({self.relative_to})" if self.relative_to else "")

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "limit": self.limit, "relative_to": self.relative_to}


def parse_target(text: str) -> Target:
    """``max-abs-err<=0.01``, ``1-cosine<=1e-5``, ``max-abs-err<=eager-autocast`` -> Target."""
    match = _TARGET.match(text)
    form = f"expected METRIC<=X with METRIC one of {', '.join(METRICS)} and X a number >= 0 or {EAGER_AUTOCAST!r}"
    if match is None:
        raise HarnessError(f"--target {text!r}: {form}")
    metric = check_metric(match["metric"], f"--target {text!r}")
    limit_text = match["limit"]
    if limit_text == EAGER_AUTOCAST:
        if metric == TASK_METRIC:
            raise HarnessError(f"--target {text!r}: {EAGER_AUTOCAST!r} applies to output errors; give a number for {TASK_METRIC}")
        return Target(metric, None, EAGER_AUTOCAST)
    try:
        limit = float(limit_text)
    except ValueError:
        raise HarnessError(f"--target {text!r}: limit {limit_text!r} is not a number; {form}") from None
    if not math.isfinite(limit) or limit < 0:
        raise HarnessError(f"--target {text!r}: limit {limit_text!r} must be a finite number >= 0")
    return Target(metric, limit)


def format_error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "non-finite"
    return f"{value:.3e}"
