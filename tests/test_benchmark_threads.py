"""The peer benchmarks (engine_bench, compile_bench) time every candidate at one pinned thread count.

PyTorch's default intra-op count (every core) on a shared machine lets another
process decide a latency for seconds at a time; ``harness bench`` pins 1, and
so must the scripts whose ratios the README quotes. The counts are observed
where the work happens (builds, timing loops), not read back from a setting.
"""

from __future__ import annotations

import pytest
import torch

from harness.bench.runner import DEFAULT_THREADS
from harness.benchmarks import compile_bench, engine_bench
from harness.engines.cpu import CpuBackend

pytestmark = pytest.mark.slow  # the benchmarks build and time real models


@pytest.fixture
def many_threads():
    """The process starts at 2 threads, so a pinned 1 is visible (and restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_engine_bench_pins_one_thread_for_builds_eager_and_engines(monkeypatch, capsys, many_threads):
    seen: dict[str, set[int]] = {"build": set(), "build config": set(), "timed": set()}
    real_build, real_measure = CpuBackend.build, engine_bench.measure_latency

    def build(self, compiled, config, cache):
        seen["build"].add(torch.get_num_threads())
        seen["build config"].add(config.threads)
        return real_build(self, compiled, config, cache)

    def measure(fn, **kwargs):
        seen["timed"].add(torch.get_num_threads())
        return real_measure(fn, **kwargs)

    monkeypatch.setattr(CpuBackend, "build", build)
    monkeypatch.setattr(engine_bench, "measure_latency", measure)
    assert engine_bench.main(["--models", "digits", "--seconds", "0.06"]) == 0
    out = capsys.readouterr().out
    assert DEFAULT_THREADS == 1
    assert seen == {"build": {1}, "build config": {1}, "timed": {1}}
    assert out.startswith("threads: 1 (pinned for eager, engines and builds)")
    assert "1 intra-op thread(s) pinned for every candidate" in out
    assert torch.get_num_threads() == many_threads  # the caller's count is back


def test_compile_bench_pins_the_thread_count_it_prints(monkeypatch, capsys, many_threads):
    counts: list[int] = []

    # the measurements only record the count they run at (their tables are not the point here)
    monkeypatch.setattr(compile_bench, "measure_scaling", lambda *a: counts.append(torch.get_num_threads()))
    monkeypatch.setattr(compile_bench, "scaling_table", lambda rows: "")
    monkeypatch.setattr(compile_bench, "measure_latency", lambda *a: counts.append(torch.get_num_threads()))
    monkeypatch.setattr(compile_bench, "latency_table", lambda rows: "")
    assert compile_bench.main(["--quick"]) == 0
    assert counts == [1, 1, 1, 1]  # two graph sizes, two models: all at the default
    assert "threads: 1 (pinned for every candidate)" in capsys.readouterr().out
    assert compile_bench.main(["--quick", "--threads", "2"]) == 0
    assert counts[4:] == [2, 2, 2, 2]
    assert torch.get_num_threads() == many_threads
    with pytest.raises(SystemExit):
        compile_bench.main(["--threads", "0"])
    assert "--threads: threads 0: expected an integer from 1 to 1024" in capsys.readouterr().err
