"""Timing loop structure and memory measurement on real callables (no timing thresholds)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from harness.bench.latency import (
    DEFAULT_SPREAD_THRESHOLD,
    QUERIES_IN_FLIGHT,
    measure_device_latency,
    measure_latency,
    measure_overhead,
)
from harness.bench.memory import MemoryReport, measure_memory
from harness.bench.stats import Summary
from harness.errors import HarnessError


class Counter:
    def __init__(self, fn=None) -> None:  # type: ignore[no-untyped-def]
        self.calls = 0
        self.fn = fn

    def __call__(self) -> None:
        self.calls += 1
        if self.fn is not None:
            self.fn()


def test_measure_latency_structure_on_real_torch_op() -> None:
    a = torch.randn(32, 32)
    fn = Counter(lambda: torch.mm(a, a))
    sync = Counter()
    r = measure_latency(
        fn, warmup_s=0.01, min_iters=25, min_duration_s=0.05, sync=sync, batch_size=4
    )
    assert r.iterations >= 25 and r.duration_s >= 0.05
    assert len(r.samples_ns) == r.iterations == r.summary.count
    assert all(isinstance(s, int) and s > 0 for s in r.samples_ns)
    assert r.warmup_iterations >= 1 and r.warmup_s >= 0.01
    # every call is either warm-up or measured, and sync follows each one (a machine busy
    # for a stretch of the loop makes it measure once more: calls of the first run then count too)
    assert fn.calls == sync.calls
    if not r.remeasured:
        assert fn.calls == r.warmup_iterations + r.iterations
    # the loop's wall time covers the sum of the per-call samples
    assert sum(r.samples_ns) <= r.duration_s * 1e9
    assert r.summary.min <= r.summary.median <= r.summary.p95 <= r.summary.max
    assert r.timer == "cpu" and r.spread_threshold == DEFAULT_SPREAD_THRESHOLD["cpu"] == 0.05
    assert r.unstable == (r.summary.spread > 0.05 or r.slow_phase is not None)
    assert isinstance(r.overhead, Summary) and r.overhead.count >= 1

    d = r.to_dict()
    assert d["samples_ns"] == list(r.samples_ns) and d["iterations"] == r.iterations
    assert d["summary"]["median"] == r.summary.median and "samples" not in d["summary"]
    assert d["throughput_per_s"] == pytest.approx(4 / (r.summary.median * 1e-9))  # the row's own median
    assert d["offline_throughput_per_s"] == pytest.approx(r.iterations * 4 / r.duration_s)  # items over time
    assert d["overhead"]["count"] == r.overhead.count


def test_max_iters_caps_the_loop_and_threshold_override() -> None:
    fn = Counter()
    shared = Summary.from_samples([50, 60, 70])
    r = measure_latency(
        fn,
        warmup_s=0.0,
        min_iters=5,
        max_iters=5,
        min_duration_s=60.0,
        spread_threshold=0.5,
        overhead=shared,
    )
    assert r.iterations == 5 and r.warmup_iterations == 1 and fn.calls == 6
    assert r.overhead is shared and r.spread_threshold == 0.5 and r.unstable == (r.summary.spread > 0.5)


class SlowFor:
    """A call that advances a fake clock: 10 us normally, 100 us in the given ranges of calls.

    The timing loop reads ``time.perf_counter_ns``; replacing it with this
    clock makes every sample exact, so the test depends on no real timing.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *ranges: tuple[int, int]) -> None:
        import time

        self.calls, self.now, self.ranges = 0, 0, ranges
        monkeypatch.setattr(time, "perf_counter_ns", lambda: self.now)

    def __call__(self) -> None:
        self.calls += 1
        slow = any(start <= self.calls < end for start, end in self.ranges)
        self.now += 100_000 if slow else 10_000


def test_a_slow_phase_is_measured_again_and_the_clean_run_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm-up is one call; calls 40-80 of the first run are slow, the second run is clean.
    fn = SlowFor(monkeypatch, (40, 80))
    r = measure_latency(fn, warmup_s=0.0, min_iters=200, max_iters=200, min_duration_s=0.0,
                        overhead=Summary.from_samples([1]))
    assert r.remeasured and r.slow_phase is None and r.iterations == 200
    assert set(r.samples_ns) == {10_000} and fn.calls == 1 + 200 + 200


def test_a_slow_phase_in_both_runs_is_kept_and_makes_the_run_unstable(monkeypatch: pytest.MonkeyPatch) -> None:
    fn = SlowFor(monkeypatch, (40, 80), (250, 270))  # one stretch in each run (calls 2-201, 202-401)
    r = measure_latency(fn, warmup_s=0.0, min_iters=200, max_iters=200, min_duration_s=0.0,
                        spread_threshold=10.0, overhead=Summary.from_samples([1]))
    # The second run's stretch is shorter: it is the one kept, still marked.
    assert r.remeasured and r.unstable and r.slow_phase is not None
    # Samples 48-67 are slow; whole windows of 5 whose median is slow: 50-70.
    assert (r.slow_phase.start, r.slow_phase.end, r.slow_phase.ratio) == (50, 70, 10.0)


def test_overhead_of_empty_call() -> None:
    o = measure_overhead(min_iters=500, min_duration_s=0.0)
    assert o.unit == "ns" and o.count == 500 and o.min >= 0  # by count when no duration is asked


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_iters": 0},
        {"min_iters": 10, "max_iters": 5},
        {"warmup_s": -1.0},
        {"batch_size": 0},
    ],
)
def test_invalid_settings_are_harness_errors(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(HarnessError):
        measure_latency(lambda: None, **kwargs)


class FakeQuery:
    """A GPU query double: one in-order stream on which each queued step takes a fixed device
    time. Events take the device clock of the work queued before them; every call is logged."""

    cuda_graph = False

    def __init__(self, h2d_ns: int = 1_000_000, compute_ns: int = 2_000_000, d2h_ns: int = 500_000) -> None:
        self.durations = {"h2d": h2d_ns, "enqueue": compute_ns, "d2h": d2h_ns}
        self.queued_ns = 0  # device time when everything queued so far has run
        self.log: list[str] = []
        self.issued = self.completed = self.most_in_flight = 0

    def _step(self, name: str) -> None:
        self.log.append(name)
        self.queued_ns += self.durations[name]
        if name == "h2d":
            self.issued += 1
            self.most_in_flight = max(self.most_in_flight, self.issued - self.completed)

    def h2d(self) -> None:
        self._step("h2d")

    def enqueue(self) -> None:
        self._step("enqueue")

    def d2h(self) -> None:
        self._step("d2h")

    def synchronize(self) -> None:
        self.log.append("sync")
        self.completed = self.issued

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        return ()


class FakeEvent:
    def __init__(self, query: FakeQuery) -> None:
        self.query, self.at, self.query_number = query, None, None

    def record(self) -> None:
        self.query.log.append("record")
        self.at, self.query_number = self.query.queued_ns, self.query.issued

    def synchronize(self) -> None:
        self.query.completed = max(self.query.completed, self.query_number)

    def elapsed_ns(self, end: FakeEvent) -> int:
        return end.at - self.at


def _device_run(query: FakeQuery, **kwargs):  # type: ignore[no-untyped-def]
    return measure_device_latency(query, warmup_s=0.0, min_iters=9, min_duration_s=0.0, max_iters=9, **kwargs)


def test_the_gpu_compute_time_brackets_the_enqueue_alone_never_a_copy() -> None:
    """Per query: event, input copies, event; event, enqueue, event; event, output copies, event.
    A copy between the compute events would add its device time to every compute sample."""
    query = FakeQuery()
    r = _device_run(query)
    assert r.samples_ns == (2_000_000,) * 9  # the enqueue's device time exactly
    timed = query.log[query.log.index("sync", 4) + 1 :]  # after the warm-up's query and the loop's first sync
    one = ["record", "h2d", "record", "record", "enqueue", "record", "record", "d2h", "record"]
    assert timed == one * 9 + ["sync"]


def test_a_gpu_query_reports_trtexecs_figures_each_from_its_clock() -> None:
    query = FakeQuery(h2d_ns=1_000_000, compute_ns=3_000_000, d2h_ns=250_000)
    r = _device_run(query, batch_size=4)
    assert r.timer == "cuda" and r.overhead is None and r.device is not None
    assert r.device.h2d.samples == (1_000_000,) * 9 and r.device.d2h.samples == (250_000,) * 9
    assert r.device.end_to_end.samples == (4_250_000,) * 9
    assert all(s >= 0 for s in r.device.enqueue.samples) and r.device.enqueue.count == 9
    assert r.throughput_per_s == pytest.approx(4 / 3e-3)  # at the median compute time
    assert r.offline_throughput_per_s == pytest.approx(9 * 4 / r.duration_s)  # trtexec's: queries over wall time
    d = r.to_dict()
    assert d["clocks"] == {
        "summary": "cuda-event", "throughput_per_s": "cuda-event", "offline_throughput_per_s": "host",
        "h2d": "cuda-event", "d2h": "cuda-event", "end_to_end": "cuda-event", "enqueue": "host",
    }  # fmt: skip
    assert d["device"]["end_to_end"]["median"] == 4_250_000 and d["device"]["queries_in_flight"] == QUERIES_IN_FLIGHT
    assert d["summary"]["median"] == 3_000_000 and d["spread_threshold"] == DEFAULT_SPREAD_THRESHOLD["cuda"]


def test_a_gpu_loop_keeps_at_most_its_queries_in_flight_and_warms_up_whole_queries() -> None:
    query = FakeQuery()
    r = measure_device_latency(query, warmup_s=0.0, min_iters=30, min_duration_s=0.0, max_iters=30)
    assert r.iterations == 30 and 1 < query.most_in_flight <= QUERIES_IN_FLIGHT
    warm = query.log[: query.log.index("sync") + 1]
    assert warm == ["h2d", "enqueue", "d2h", "sync"] * r.warmup_iterations


def test_host_timed_results_say_their_clock() -> None:
    r = measure_latency(lambda: None, warmup_s=0.0, min_iters=3, min_duration_s=0.0, max_iters=3)
    clocks = {"summary": "host", "throughput_per_s": "host", "offline_throughput_per_s": "host"}
    assert r.to_dict()["clocks"] == clocks and "device" not in r.to_dict()


def test_peak_rss_measures_the_run() -> None:
    size = 64 << 20

    def allocate() -> float:
        block = np.ones(size // 8)  # written, so the pages are resident
        return float(block[-1])

    result, report = measure_memory(allocate)
    assert result == 1.0
    assert report.peak_rss_bytes is not None and report.rss_before_bytes is not None
    if sys.platform.startswith("linux"):
        assert report.peak_rss_method == "vmhwm"
    # the 64 MiB block was resident during the call, on top of what was there before
    # (within a tenth: the allocator and page accounting may round either way)
    assert report.peak_rss_bytes - report.rss_before_bytes >= size * 0.9
    # a later small run does not inherit that peak (the high-water mark is reset)
    _, small = measure_memory(lambda: None)
    if small.peak_rss_method == "vmhwm":
        assert small.peak_rss_bytes is not None and small.peak_rss_bytes < report.peak_rss_bytes


def test_memory_report_totals_weight_bytes() -> None:
    d = MemoryReport(weight_bytes={"float16": 20, "float32": 48}, engine_bytes=100).to_dict()
    assert d["weight_bytes_total"] == 68 and d["engine_bytes"] == 100
    assert d["peak_rss_bytes"] is None and MemoryReport().to_dict()["weight_bytes_total"] is None
