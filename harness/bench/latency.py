"""Latency of a callable: warm-up by time, then a bounded timing loop.

The loop is kept as small as Python allows (two clock reads, the call, one
``list.append`` of an int) so that its own cost, reported as ``overhead``
and measured with the same loop around an empty function, stays far below
the latencies it measures. The garbage collector is paused during the loop,
as ``timeit`` does, so a collection triggered by someone else's garbage does
not land in a sample. Reported samples are *not* corrected for the overhead;
the overhead is stored next to them so a reader can judge.

A run is *unstable* when its spread (IQR/median) exceeds a threshold or it
holds a slow phase (a sustained stretch of slow calls: the machine was busy
for a while). A run with a slow phase is measured once more, and the second
run is kept if it has none.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from harness.bench.stats import SlowPhase, Summary, slow_phase
from harness.errors import HarnessError

Timer = Literal["cpu", "cuda"]

# Largest IQR/median of a stable run. trtexec warns at 2.5% spread on GPU; a
# CPU shared with other processes is noisier, so it gets twice the tolerance.
DEFAULT_SPREAD_THRESHOLD: dict[str, float] = {"cpu": 0.05, "cuda": 0.025}


@dataclass(frozen=True)
class LatencyResult:
    """One measured run. ``summary`` is in nanoseconds and holds the raw samples."""

    summary: Summary
    iterations: int
    duration_s: float
    warmup_iterations: int
    warmup_s: float
    timer: Timer
    batch_size: int
    spread_threshold: float
    slow_phase: SlowPhase | None
    remeasured: bool  # the first run had a slow phase, so the loop ran again
    overhead: Summary | None

    @property
    def samples_ns(self) -> tuple[float, ...]:
        return self.summary.samples

    @property
    def unstable(self) -> bool:
        return self.summary.spread > self.spread_threshold or self.slow_phase is not None

    def to_dict(self) -> dict[str, Any]:
        """The ``latency`` field of a results case (see :mod:`harness.bench.results`)."""
        return {
            "timer": self.timer,
            "batch_size": self.batch_size,
            "iterations": self.iterations,
            "duration_s": self.duration_s,
            "warmup_iterations": self.warmup_iterations,
            "warmup_s": self.warmup_s,
            "summary": self.summary.stats_dict(),
            "samples_ns": [int(s) for s in self.summary.samples],
            "throughput_per_s": self.summary.throughput(self.batch_size),
            "spread_threshold": self.spread_threshold,
            "unstable": self.unstable,
            "slow_phase": dataclasses.asdict(self.slow_phase) if self.slow_phase is not None else None,
            "remeasured": self.remeasured,
            "overhead": self.overhead.stats_dict() if self.overhead is not None else None,
        }


def _noop() -> None:
    return None


@contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class _LoopBounds:
    """When a timing loop stops: once it has ``min_iters`` samples *and* has lasted
    ``min_duration_ns``, or at ``max_iters`` samples regardless of duration."""

    min_iters: int
    min_duration_ns: int
    max_iters: int | None


# (fn, sync, bounds) -> (samples in ns, the loop's duration in ns)
_Loop = Callable[
    [Callable[[], object], Callable[[], object] | None, _LoopBounds], tuple[list[int], int]
]


def _cpu_loop(
    fn: Callable[[], object], sync: Callable[[], object] | None, bounds: _LoopBounds
) -> tuple[list[int], int]:
    """Samples (ns) of ``fn`` then ``sync`` on the host clock, and the loop's duration (ns)."""
    # locals: the loop reads them on every call
    min_iters, max_iters = bounds.min_iters, bounds.max_iters
    clock = time.perf_counter_ns
    samples: list[int] = []
    append = samples.append
    n = 0
    begin = clock()
    deadline = begin + bounds.min_duration_ns
    while True:
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        t1 = clock()
        append(t1 - t0)
        n += 1
        if (n >= min_iters and t1 >= deadline) or n == max_iters:
            return samples, t1 - begin


def _cuda_loop(
    fn: Callable[[], object], sync: Callable[[], object] | None, bounds: _LoopBounds
) -> tuple[list[int], int]:
    """Time on the device with one event pair per iteration.

    The host only enqueues; events are read after one final synchronize, so
    host jitter does not enter the samples. ``sync`` (if given) runs after
    the end event, outside the timed interval, to bound the queue depth. The
    iterations are those of :func:`_cpu_loop` (whose host samples are not
    kept), so both timers stop by the same rule.
    """
    import torch

    torch.cuda.synchronize()  # warm-up work still queued must not overlap the first samples
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timing_event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def enqueue() -> None:  # events are created per iteration: cheap next to any GPU kernel
        start, end = timing_event(), timing_event()
        start.record()
        fn()
        end.record()
        if sync is not None:
            sync()
        pairs.append((start, end))

    begin = time.perf_counter_ns()
    _cpu_loop(enqueue, None, bounds)
    torch.cuda.synchronize()
    elapsed = time.perf_counter_ns() - begin
    return [round(s.elapsed_time(e) * 1e6) for s, e in pairs], elapsed


def _loop_for(timer: str) -> _Loop:
    if timer == "cpu":
        return _cpu_loop
    if timer == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise HarnessError(
                "timer 'cuda' needs a CUDA device but torch.cuda.is_available() is False; "
                "use timer 'cpu'"
            )
        return _cuda_loop
    raise HarnessError(f"timer {timer!r} is not valid; use 'cpu' or 'cuda'")


def measure_overhead(
    *, timer: Timer = "cpu", min_iters: int = 10_000, min_duration_s: float = 0.0
) -> Summary:
    """Per-iteration cost of the timing loop itself, around an empty call (ns).

    By count, not duration: an empty call takes tens of nanoseconds, so any
    useful duration would mean millions of stored samples.
    """
    loop = _loop_for(timer)
    with _gc_paused():
        samples, _ = loop(_noop, None, _LoopBounds(min_iters, int(min_duration_s * 1e9), None))
    return Summary.from_samples(samples, unit="ns")


def measure_latency(
    fn: Callable[[], object],
    *,
    warmup_s: float = 0.5,
    min_iters: int = 20,
    min_duration_s: float = 1.0,
    max_iters: int | None = None,
    sync: Callable[[], object] | None = None,
    timer: Timer = "cpu",
    batch_size: int = 1,
    spread_threshold: float | None = None,
    overhead: Summary | None = None,
) -> LatencyResult:
    """Warm up for ``warmup_s`` (at least one call), then time ``fn``.

    The loop runs until it has at least ``min_iters`` samples *and* has
    lasted ``min_duration_s``; ``max_iters`` caps it regardless of duration.
    ``sync`` waits for asynchronous work (e.g. ``torch.cuda.synchronize``)
    and is inside the timed interval on the CPU timer. ``overhead`` may be
    passed in to share one :func:`measure_overhead` across many cases;
    otherwise it is measured after the run.
    """
    if min_iters < 1:
        raise HarnessError(f"min_iters must be at least 1, got {min_iters}")
    if max_iters is not None and max_iters < min_iters:
        raise HarnessError(f"max_iters ({max_iters}) must be at least min_iters ({min_iters})")
    if warmup_s < 0 or min_duration_s < 0:
        raise HarnessError("warmup_s and min_duration_s must not be negative")
    if batch_size < 1:
        raise HarnessError(f"batch_size must be at least 1, got {batch_size}")
    loop = _loop_for(timer)
    bounds = _LoopBounds(min_iters, int(min_duration_s * 1e9), max_iters)
    threshold = DEFAULT_SPREAD_THRESHOLD[timer] if spread_threshold is None else spread_threshold

    with _gc_paused():
        warm_begin = time.perf_counter_ns()
        warm_deadline = warm_begin + int(warmup_s * 1e9)
        warm_iters = 0
        while True:
            fn()
            if sync is not None:
                sync()
            warm_iters += 1
            warm_end = time.perf_counter_ns()
            if warm_end >= warm_deadline:
                break
        samples, elapsed_ns = loop(fn, sync, bounds)
        phase = slow_phase(samples)
        remeasured = phase is not None
        if phase is not None:  # the machine was busy for a while: once more, and keep a clean run
            again, again_ns = loop(fn, sync, bounds)
            again_phase = slow_phase(again)
            if again_phase is None or again_phase.fraction < phase.fraction:
                samples, elapsed_ns, phase = again, again_ns, again_phase

    return LatencyResult(
        summary=Summary.from_samples(samples, unit="ns"),
        iterations=len(samples),
        duration_s=elapsed_ns / 1e9,
        warmup_iterations=warm_iters,
        warmup_s=(warm_end - warm_begin) / 1e9,
        timer=timer,
        batch_size=batch_size,
        spread_threshold=threshold,
        slow_phase=phase,
        remeasured=remeasured,
        overhead=overhead if overhead is not None else measure_overhead(timer=timer),
    )
