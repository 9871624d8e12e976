"""Choose among verified plans by latency, without letting noise rewrite the file.

The search ends with a few plans that all meet the target: the one with the
fewest fp32 layers (what accuracy alone asks for), the plan the greedy phase
grew, and everything in fp32. Fewer fp32 layers is usually faster, but not
always (casts cost more than small low-precision kernels save, and fp16 is
slow on CPUs without fp16 arithmetic), so they are timed side by side, in
alternating rounds with the thread count already pinned, as the benchmarks
do. The fewest-fp32 plan is the default; another replaces it only when it
is faster by at least ``min_speedup`` with the whole bootstrap confidence
interval of the median ratio beyond that margin. A difference inside the
measurement noise therefore never changes the written file, which keeps it
the same from run to run; a clear win always does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.bench.stats import RatioInterval, Summary, bootstrap_ratio_ci
from harness.debug.evaluate import Evaluation, LatencyMeter

ROUNDS = 3
DEFAULT_MIN_SPEEDUP = 0.10


@dataclass(frozen=True)
class Finalist:
    """A verified plan timed side by side with the others; ``speedup`` is against the first finalist."""

    role: str  # pruned | grown | all fp32
    evaluation: Evaluation
    latency: Summary
    speedup: RatioInterval | None  # None for the first finalist (the default)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "kept": list(self.evaluation.plan.kept),
            "error": self.evaluation.error,
            "median_ms": self.latency.median / 1e6,
            "speedup": None
            if self.speedup is None
            else {"ratio": self.speedup.ratio, "low": self.speedup.low, "high": self.speedup.high},
        }


def time_side_by_side(
    evaluations: Sequence[Evaluation], meter: LatencyMeter, inputs: tuple[torch.Tensor, ...], seconds: float
) -> list[Summary]:
    """Latency samples of each plan's engine, from ``ROUNDS`` alternating rounds."""
    samples: list[list[float]] = [[] for _ in evaluations]
    per_run = seconds / (ROUNDS * max(1, len(evaluations)))
    for _ in range(ROUNDS):
        for evaluation, own in zip(evaluations, samples, strict=True):
            assert evaluation.engine is not None, "a finalist keeps its engine"
            own.extend(meter(evaluation.engine, inputs, per_run).samples)
    return [Summary.from_samples(s) for s in samples]


def choose(
    finalists: Sequence[tuple[str, Evaluation]],
    meter: LatencyMeter,
    inputs: tuple[torch.Tensor, ...],
    seconds: float,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
) -> tuple[int, list[Finalist]]:
    """Index of the chosen finalist (0 unless another is clearly faster) and every finalist's timing.

    ``finalists`` are (role, evaluation) pairs, the default first; ``min_speedup``
    of ``math.inf`` keeps the default whatever the timings.
    """
    latencies = time_side_by_side([e for _, e in finalists], meter, inputs, seconds)
    timed = []
    for i, ((role, evaluation), latency) in enumerate(zip(finalists, latencies, strict=True)):
        interval = None if i == 0 else bootstrap_ratio_ci(latencies[0].samples, latency.samples)
        timed.append(Finalist(role, evaluation, latency, interval))
    clear = [i for i, f in enumerate(timed) if f.speedup is not None and f.speedup.low >= 1 + min_speedup]
    chosen = max(clear, key=lambda i: (timed[i].speedup.ratio, -i)) if clear else 0  # type: ignore[union-attr]
    return chosen, timed
