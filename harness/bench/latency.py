"""Latency: of a callable on the host clock, or of a staged GPU query as trtexec measures it.

The loop is kept as small as Python allows (two clock reads, the call, one
``list.append`` of an int) so that its own cost, reported as ``overhead``
and measured with the same loop around an empty function, stays far below
the latencies it measures. The garbage collector is paused during the loop,
as ``timeit`` does, so a collection triggered by someone else's garbage does
not land in a sample. Reported samples are *not* corrected for the overhead;
the overhead is stored next to them so a reader can judge.

A GPU query (:class:`~harness.engines.device.DeviceQuery`: inputs staged on
the device once, the engine on a stream of its own) is timed as trtexec
times it (:func:`measure_device_latency`): per query, CUDA events on that
stream bracket the input copies, the inference and the output copies apart.
The headline figure is the **GPU compute time**: the events around the
enqueue alone, never a copy. Beside it: the host-to-device and
device-to-host transfer times, the end-to-end latency (their sum with the
compute time), the enqueue time (the host clock around the enqueue call) and
the throughput (queries over the loop's host wall time).

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
from typing import TYPE_CHECKING, Any, Literal

from harness.bench.stats import SlowPhase, Summary, slow_phase
from harness.errors import HarnessError

if TYPE_CHECKING:  # the gate reads results without torch, which harness.engines.device imports
    from harness.engines.device import DeviceEvent, DeviceQuery

Timer = Literal["cpu", "cuda"]
# The clock each figure of a result comes from: the host's perf_counter, or CUDA events on the query's stream.
Clock = Literal["host", "cuda-event"]
# Queries a GPU loop keeps queued at once: the next one's copies and enqueue are issued while the
# device still runs the last, as trtexec keeps its stream busy; more would only add host waiting.
QUERIES_IN_FLIGHT = 2

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
    device: DeviceFigures | None = None  # a GPU query's other figures (timer "cuda")

    @property
    def samples_ns(self) -> tuple[float, ...]:
        return self.summary.samples

    @property
    def unstable(self) -> bool:
        return self.summary.spread > self.spread_threshold or self.slow_phase is not None

    @property
    def throughput_per_s(self) -> float | None:
        """Items per second at the median latency (:meth:`Summary.throughput`): the row's own figure."""
        return self.summary.throughput(self.batch_size)

    @property
    def offline_throughput_per_s(self) -> float | None:
        """Total items over the loop's host wall time: an offline run's throughput (trtexec's
        "Throughput" for a GPU query, with its queries in flight)."""
        return self.iterations * self.batch_size / self.duration_s if self.duration_s > 0 else None

    def clocks(self) -> dict[str, Clock]:
        """Which clock each figure of :meth:`to_dict` came from."""
        median: Clock = "host" if self.device is None else "cuda-event"
        figures: dict[str, Clock] = {"summary": median, "throughput_per_s": median, "offline_throughput_per_s": "host"}
        if self.device is not None:
            figures.update({"h2d": "cuda-event", "d2h": "cuda-event", "end_to_end": "cuda-event", "enqueue": "host"})
        return figures

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
            "throughput_per_s": self.throughput_per_s,
            "offline_throughput_per_s": self.offline_throughput_per_s,
            "spread_threshold": self.spread_threshold,
            "unstable": self.unstable,
            "slow_phase": dataclasses.asdict(self.slow_phase) if self.slow_phase is not None else None,
            "remeasured": self.remeasured,
            "overhead": self.overhead.stats_dict() if self.overhead is not None else None,
            "clocks": self.clocks(),
            **({} if self.device is None else {"device": self.device.to_dict()}),
        }


@dataclass(frozen=True)
class DeviceFigures:
    """A GPU query's figures beside its compute time, per query, in nanoseconds (trtexec's names:
    H2D Latency, D2H Latency, Latency, Enqueue Time)."""

    h2d: Summary
    d2h: Summary
    end_to_end: Summary  # h2d + compute + d2h of each query
    enqueue: Summary  # host clock around the enqueue call
    cuda_graph: bool
    queries_in_flight: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "h2d": self.h2d.stats_dict(),
            "d2h": self.d2h.stats_dict(),
            "end_to_end": self.end_to_end.stats_dict(),
            "enqueue": self.enqueue.stats_dict(),
            "cuda_graph": self.cuda_graph,
            "queries_in_flight": self.queries_in_flight,
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


def measure_overhead(*, min_iters: int = 10_000, min_duration_s: float = 0.0) -> Summary:
    """Per-iteration cost of the host timing loop itself, around an empty call (ns).

    By count, not duration: an empty call takes tens of nanoseconds, so any
    useful duration would mean millions of stored samples.
    """
    with _gc_paused():
        samples, _ = _cpu_loop(_noop, None, _LoopBounds(min_iters, int(min_duration_s * 1e9), None))
    return Summary.from_samples(samples, unit="ns")


def measure_latency(
    fn: Callable[[], object],
    *,
    warmup_s: float = 0.5,
    min_iters: int = 20,
    min_duration_s: float = 1.0,
    max_iters: int | None = None,
    sync: Callable[[], object] | None = None,
    batch_size: int = 1,
    spread_threshold: float | None = None,
    overhead: Summary | None = None,
) -> LatencyResult:
    """Warm up for ``warmup_s`` (at least one call), then time ``fn`` on the host clock.

    The loop runs until it has at least ``min_iters`` samples *and* has
    lasted ``min_duration_s``; ``max_iters`` caps it regardless of duration.
    ``sync`` waits for asynchronous work and is inside the timed interval.
    ``overhead`` may be passed in to share one :func:`measure_overhead`
    across many cases; otherwise it is measured after the run.
    """
    bounds = _bounds(min_iters, max_iters, warmup_s, min_duration_s, batch_size)
    threshold = DEFAULT_SPREAD_THRESHOLD["cpu"] if spread_threshold is None else spread_threshold

    def warm() -> None:
        fn()
        if sync is not None:
            sync()

    with _gc_paused():
        warm_iters, warm_ns = _warm_up(warm, warmup_s)
        run = _kept_run(lambda: _host_run(fn, sync, bounds))

    return LatencyResult(
        summary=Summary.from_samples(run.samples, unit="ns"),
        iterations=len(run.samples),
        duration_s=run.elapsed_ns / 1e9,
        warmup_iterations=warm_iters,
        warmup_s=warm_ns / 1e9,
        timer="cpu",
        batch_size=batch_size,
        spread_threshold=threshold,
        slow_phase=run.phase,
        remeasured=run.remeasured,
        overhead=overhead if overhead is not None else measure_overhead(),
    )


def measure_device_latency(
    query: DeviceQuery,
    *,
    warmup_s: float = 0.5,
    min_iters: int = 20,
    min_duration_s: float = 1.0,
    max_iters: int | None = None,
    batch_size: int = 1,
    spread_threshold: float | None = None,
) -> LatencyResult:
    """Warm up for ``warmup_s`` (at least one whole query), then time ``query`` as trtexec does.

    Each timed query queues, on the query's stream: an event, the input
    copies, an event; an event, the enqueue (its host time read around the
    call), an event; an event, the output copies, an event. So the compute
    events bracket the enqueue alone. At most :data:`QUERIES_IN_FLIGHT`
    queries are queued at once (the host waits on the last event of the one
    before them); the events are read after the loop. The loop stops by the
    host loop's rule; the result's samples are the GPU compute times and its
    ``device`` holds the other figures.
    """
    bounds = _bounds(min_iters, max_iters, warmup_s, min_duration_s, batch_size)
    threshold = DEFAULT_SPREAD_THRESHOLD["cuda"] if spread_threshold is None else spread_threshold

    def warm() -> None:
        query.h2d()
        query.enqueue()
        query.d2h()
        query.synchronize()

    with _gc_paused():
        warm_iters, warm_ns = _warm_up(warm, warmup_s)
        run = _kept_run(lambda: _device_loop(query, bounds))

    assert run.device is not None
    return LatencyResult(
        summary=Summary.from_samples(run.samples, unit="ns"),
        iterations=len(run.samples),
        duration_s=run.elapsed_ns / 1e9,
        warmup_iterations=warm_iters,
        warmup_s=warm_ns / 1e9,
        timer="cuda",
        batch_size=batch_size,
        spread_threshold=threshold,
        slow_phase=run.phase,
        remeasured=run.remeasured,
        overhead=None,
        device=DeviceFigures(
            h2d=Summary.from_samples(run.device["h2d"], unit="ns"),
            d2h=Summary.from_samples(run.device["d2h"], unit="ns"),
            end_to_end=Summary.from_samples(run.device["end_to_end"], unit="ns"),
            enqueue=Summary.from_samples(run.device["enqueue"], unit="ns"),
            cuda_graph=query.cuda_graph,
            queries_in_flight=QUERIES_IN_FLIGHT,
        ),
    )


def _bounds(
    min_iters: int, max_iters: int | None, warmup_s: float, min_duration_s: float, batch_size: int
) -> _LoopBounds:
    if min_iters < 1:
        raise HarnessError(f"min_iters must be at least 1, got {min_iters}")
    if max_iters is not None and max_iters < min_iters:
        raise HarnessError(f"max_iters ({max_iters}) must be at least min_iters ({min_iters})")
    if warmup_s < 0 or min_duration_s < 0:
        raise HarnessError("warmup_s and min_duration_s must not be negative")
    if batch_size < 1:
        raise HarnessError(f"batch_size must be at least 1, got {batch_size}")
    return _LoopBounds(min_iters, int(min_duration_s * 1e9), max_iters)


def _warm_up(call: Callable[[], None], seconds: float) -> tuple[int, int]:
    """Call ``call`` until ``seconds`` have passed (at least once): (calls, nanoseconds)."""
    begin = time.perf_counter_ns()
    deadline = begin + int(seconds * 1e9)
    calls = 0
    while True:
        call()
        calls += 1
        end = time.perf_counter_ns()
        if end >= deadline:
            return calls, end - begin


@dataclass(frozen=True)
class _Run:
    samples: list[int]
    elapsed_ns: int
    phase: SlowPhase | None
    remeasured: bool
    device: dict[str, list[int]] | None = None  # a device loop's other figures, per query


def _kept_run(loop: Callable[[], _Run]) -> _Run:
    """A run of ``loop``; one with a slow phase (the machine was busy for a while) is run once
    more, and the run with the smaller slow phase is kept."""
    first = loop()
    if first.phase is None:
        return first
    again = loop()
    kept = again if again.phase is None or again.phase.fraction < first.phase.fraction else first
    return dataclasses.replace(kept, remeasured=True)


def _host_run(fn: Callable[[], object], sync: Callable[[], object] | None, bounds: _LoopBounds) -> _Run:
    samples, elapsed_ns = _cpu_loop(fn, sync, bounds)
    return _Run(samples, elapsed_ns, slow_phase(samples), False)


def _device_loop(query: DeviceQuery, bounds: _LoopBounds) -> _Run:
    """Timed queries until ``bounds`` say stop (see :func:`measure_device_latency`)."""
    clock = time.perf_counter_ns
    queued: list[tuple[DeviceEvent, ...]] = []
    enqueue_ns: list[int] = []

    def one_query() -> None:
        if len(queued) >= QUERIES_IN_FLIGHT:
            queued[-QUERIES_IN_FLIGHT][-1].synchronize()
        events = tuple(query.event() for _ in range(6))
        events[0].record()
        query.h2d()
        events[1].record()
        events[2].record()
        start = clock()
        query.enqueue()
        enqueue_ns.append(clock() - start)
        events[3].record()
        events[4].record()
        query.d2h()
        events[5].record()
        queued.append(events)

    query.synchronize()  # warm-up work still queued must not overlap the first query
    begin = clock()
    _cpu_loop(one_query, None, bounds)
    query.synchronize()
    elapsed_ns = max(clock() - begin, 1)
    h2d = [e[0].elapsed_ns(e[1]) for e in queued]
    compute = [e[2].elapsed_ns(e[3]) for e in queued]
    d2h = [e[4].elapsed_ns(e[5]) for e in queued]
    figures = {
        "h2d": h2d,
        "d2h": d2h,
        "end_to_end": [a + b + c for a, b, c in zip(h2d, compute, d2h, strict=True)],
        "enqueue": enqueue_ns,
    }
    return _Run(compute, elapsed_ns, slow_phase(compute), False, figures)
