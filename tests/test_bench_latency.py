"""Timing loop structure and memory measurement on real callables (no timing thresholds)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from harness.bench.latency import DEFAULT_COV_THRESHOLD, measure_latency, measure_overhead
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
    # every call is either warm-up or measured, and sync follows each one
    assert fn.calls == sync.calls == r.warmup_iterations + r.iterations
    # the loop's wall time covers the sum of the per-call samples
    assert sum(r.samples_ns) <= r.duration_s * 1e9
    assert r.summary.min <= r.summary.median <= r.summary.p95 <= r.summary.max
    assert r.timer == "cpu" and r.cov_threshold == DEFAULT_COV_THRESHOLD["cpu"] == 0.05
    assert r.unstable == (r.summary.cov > 0.05)
    assert isinstance(r.overhead, Summary) and r.overhead.count >= 1

    d = r.to_dict()
    assert d["samples_ns"] == list(r.samples_ns) and d["iterations"] == r.iterations
    assert d["summary"]["median"] == r.summary.median and "samples" not in d["summary"]
    assert d["throughput_per_s"] == pytest.approx(4 / (r.summary.mean * 1e-9))
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
        cov_threshold=0.5,
        overhead=shared,
    )
    assert r.iterations == 5 and r.warmup_iterations == 1 and fn.calls == 6
    assert r.overhead is shared and r.cov_threshold == 0.5 and r.unstable == (r.summary.cov > 0.5)


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
        {"timer": "wallclock"},
    ],
)
def test_invalid_settings_are_harness_errors(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(HarnessError):
        measure_latency(lambda: None, **kwargs)


def test_cuda_timer_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HarnessError, match="timer 'cuda' needs a CUDA device"):
        measure_latency(lambda: None, timer="cuda")


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
    assert report.peak_rss_bytes - report.rss_before_bytes >= size * 0.9
    # a later small run does not inherit that peak (the high-water mark is reset)
    _, small = measure_memory(lambda: None)
    if small.peak_rss_method == "vmhwm":
        assert small.peak_rss_bytes is not None and small.peak_rss_bytes < report.peak_rss_bytes


def test_memory_report_totals_weight_bytes() -> None:
    d = MemoryReport(weight_bytes={"float16": 20, "float32": 48}, engine_bytes=100).to_dict()
    assert d["weight_bytes_total"] == 68 and d["engine_bytes"] == 100
    assert d["peak_rss_bytes"] is None and MemoryReport().to_dict()["weight_bytes_total"] is None
