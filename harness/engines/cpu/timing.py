"""Timing one candidate implementation the way an engine builder does.

Each candidate runs on the layer's real input values (shapes, dtypes and
memory layouts as the engine will see them): a few warm-up calls first, which
absorb one-off costs such as oneDNN kernel generation and cache fills, then
several timed calls, interleaved with the other candidates', of which the
median is kept, so neither one preempted call nor a burst of load while one
candidate is timed decides a tactic. Close calls are still decided by noise; that is the
point of recording the choice in a timing cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.errors import HarnessError

DEFAULT_WARMUP_RUNS = 2
DEFAULT_TIMING_RUNS = 7
# Upper bounds: beyond them a build would run for hours (10**12 runs never ends).
MAX_RUNS = 1000


@dataclass(frozen=True)
class TimingOptions:
    warmup_runs: int = DEFAULT_WARMUP_RUNS
    timing_runs: int = DEFAULT_TIMING_RUNS

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> TimingOptions:
        """Read ``warmup_runs``/``timing_runs`` from builder options, refusing nonsense."""
        warmup = options.get("warmup_runs", DEFAULT_WARMUP_RUNS)
        runs = options.get("timing_runs", DEFAULT_TIMING_RUNS)
        for name, value, least in (("warmup_runs", warmup, 0), ("timing_runs", runs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_RUNS:
                raise HarnessError(
                    f"builder option {name}={value!r}: expected an integer from {least} to {MAX_RUNS}"
                )
        return TimingOptions(warmup_runs=warmup, timing_runs=runs)


def median_ms(fns: Sequence[Callable[..., Any]], inputs: Sequence[Any], options: TimingOptions) -> list[float]:
    """Median wall time of each ``fn(*inputs)`` in milliseconds, after warm-up, under inference mode.

    The candidates are timed in rounds, not one candidate's calls after
    another's: on a shared machine a burst of load then slows every candidate
    alike instead of deciding the choice. In each round a candidate is called
    once untimed before its timed call, so its time does not depend on what
    the candidate before it left in the caches (a slow candidate streaming
    megabytes would otherwise penalize whichever is timed next).
    """
    samples: list[list[int]] = [[] for _ in fns]
    with torch.inference_mode():
        for fn in fns:
            for _ in range(options.warmup_runs):
                fn(*inputs)
        for _ in range(options.timing_runs):
            for fn, own in zip(fns, samples, strict=True):
                fn(*inputs)
                start = time.perf_counter_ns()
                fn(*inputs)
                own.append(time.perf_counter_ns() - start)
    return [statistics.median(own) / 1e6 for own in samples]
