"""The benchmark runner on the real CPU engine: failures, interrupts, caches, shards."""

from __future__ import annotations

import dataclasses
import io
import os
import re

import pytest
import torch
from harness.zoo import digits

from harness import models
from harness.bench import runner as runner_mod
from harness.bench.results import ResultsWriter, load_results
from harness.bench.runner import (
    BenchRunner,
    MeasureSettings,
    build_matrix,
    cache_file,
    case_messages,
    parse_shard,
)
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BatchProfile, BuildConfig, BuildLog, EngineBase
from harness.errors import HarnessError, StaticBatchError
from harness.precision import PrecisionMode

TINY = MeasureSettings(warmup_s=0.01, min_iters=5, min_duration_s=0.02, max_iters=50, telemetry_interval_s=0.02)

BROKEN_MODEL = """
import torch
from torch import nn


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("broken model: forward always fails")


def build():
    return Broken(), (torch.ones(2, 3),)
"""


class NoWeakTypingBackend(CpuBackend):
    """The CPU engine refusing weak typing, as the TensorRT 11 backend does."""

    def supported_modes(self) -> tuple[PrecisionMode, ...]:
        return tuple(m for m in super().supported_modes() if not m.weak)

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        mode = super().check_mode(mode)
        if mode.weak:
            raise HarnessError(f"mode {str(mode)!r}: weak typing was removed from this backend")
        return mode


def rss_read_error_bytes() -> int:
    """How far two reads of a process's RSS (VmHWM, psutil's statm) may disagree about one moment.

    Since Linux 6.2 an mm's RSS counters (file, anon and shmem pages) are
    ``percpu_counter``s: each CPU adds its page faults and frees to a local
    count and folds it into the shared count only when it reaches
    ``percpu_counter_batch`` (``max(32, 2 * CPUs)``), and ``/proc`` reads the
    shared count alone. One read of RSS, the sum of three counters, is off by
    less than ``3 * CPUs * batch`` pages; the peak and the sampler's maximum
    are two such reads, each off in its own direction. (Kernels before 6.2
    batched per thread instead, 64 events each; this project's machines run
    6.2 or later, this one 6.18.)
    """
    cpus = os.cpu_count() or 1
    batch = max(32, 2 * cpus)
    return 2 * 3 * cpus * batch * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def writer(tmp_path):
    return ResultsWriter.create(tmp_path / "run.json", settings={"quick": True})


def test_shards_partition_the_matrix_in_order():
    full = build_matrix(["a", "b", "c"], ["fp32", "bf16"])
    assert full[:3] == [("a", "fp32", None), ("a", "bf16", None), ("b", "fp32", None)]
    swept = build_matrix(["a"], ["fp32", "bf16"], batch_sizes=[1, 8])
    assert swept == [("a", "fp32", 1), ("a", "bf16", 1), ("a", "fp32", 8), ("a", "bf16", 8)]
    parts = [build_matrix(["a", "b", "c"], ["fp32", "bf16"], (i, 3)) for i in (1, 2, 3)]
    assert sorted(case for part in parts for case in part) == sorted(full)
    assert parts[1] == [full[1], full[4]]


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "2", "a/b", "1/2/3"])
def test_bad_shard_is_refused(text):
    with pytest.raises(HarnessError, match="--shard"):
        parse_shard(text)


def test_cache_files_are_keyed_by_model_mode_backend_threads_device_and_settings(tmp_path, monkeypatch):
    from harness.autocast import AutocastSettings
    from harness.engines import cpu as cpu_backend
    from harness.engines.onnxruntime import OnnxRuntimeBackend

    cpu = CpuBackend()
    base = BuildConfig("autocast-bf16", threads=1)
    path = cache_file(tmp_path, "my model/x", base, cpu)
    assert path.parent == tmp_path and "/" not in path.name and " " not in path.name
    assert path.name.startswith("my_model_x-autocast-bf16-cpu-t1-d")
    others = {
        cache_file(tmp_path, "my model/x", BuildConfig("autocast-bf16", threads=2), cpu),
        cache_file(tmp_path, "my model/x", base, OnnxRuntimeBackend()),
        cache_file(tmp_path, "my model/x", BuildConfig("autocast-bf16", threads=1,
                   autocast=AutocastSettings(nodes_to_exclude=["^conv"])), cpu),
    }  # fmt: skip
    assert path not in others and len(others) == 3
    # settings do not shape an fp32 graph: they do not split its cache
    fp32 = cache_file(tmp_path, "m", BuildConfig("fp32", threads=1), cpu)
    assert re.fullmatch(r"m-fp32-cpu-t1-d[0-9a-f]{8}\.json", fp32.name)
    # a CPU whose kernel-relevant ISA differs under the same machine id keeps a cache of its own
    other = cpu_backend.cpu_flags() ^ {"amx_fp16"}  # this CPU's flags with one that picks kernels toggled
    monkeypatch.setattr(cpu_backend, "cpu_flags", lambda: other)
    assert cache_file(tmp_path, "m", BuildConfig("fp32", threads=1), cpu) != fp32


def test_failed_cases_are_recorded_and_the_run_goes_on(tmp_path, writer):
    model_file = tmp_path / "broken.py"
    model_file.write_text(BROKEN_MODEL)
    broken = f"{model_file}:build"
    runner = BenchRunner(NoWeakTypingBackend(), cache_dir=tmp_path / "caches", settings=TINY)
    matrix = [("digits", "fp32", None), ("digits", "weak-fp16", None), (broken, "fp32", None), ("digits", "amp-bf16", None)]
    seen: list[str] = []
    doc = runner.run(matrix, writer, progress=False, on_case=lambda c: seen.append(c["status"]))

    assert seen == ["ok", "failed", "failed", "ok"]
    on_disk = load_results(writer.path)
    assert on_disk["complete"] is True
    assert [c["status"] for c in on_disk["cases"]] == seen
    refused, crashed = on_disk["cases"][1], on_disk["cases"][2]
    assert refused["error"].startswith("build: ") and "weak typing was removed" in refused["error"]
    assert crashed["error"].startswith("fp32 eager reference: RuntimeError")
    assert "forward always fails" in crashed["error"]
    assert doc["cases"] == on_disk["cases"]


def test_ok_case_measures_against_eager_fp32_and_pins_on_rerun(tmp_path):
    cache_dir = tmp_path / "caches"
    first = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert first["status"] == "ok", first["error"]

    spec = models.load("digits")
    with torch.inference_mode():
        eager = spec.module.float()(*spec.example_inputs)
        eager_task = spec.evaluate(spec.module)
    acc = first["accuracy"]
    assert acc["max_abs_error"] < 1e-4 and acc["cosine"] > 0.99999
    assert acc["top1_agreement"] == 1.0
    task = first["task_accuracy"]
    assert task["samples"] == digits.HELD_OUT
    assert abs(task["value"] - eager_task) <= 2 / digits.HELD_OUT
    assert first["latency"]["iterations"] >= TINY.min_iters
    assert first["latency"]["batch_size"] == spec.example_inputs[0].shape[0]
    assert first["memory"]["weight_bytes_total"] == sum(
        p.numel() * 4 for p in spec.module.parameters()
    )
    assert first["telemetry"]["samples"] >= 2 and first["telemetry"]["gpu"].startswith("unavailable")
    # the peak covers the whole case, the timing loop the sampler watched included
    memory = first["memory"]
    assert memory["peak_rss_method"] == "vmhwm" and memory["engine_bytes"] > 0
    assert memory["peak_rss_bytes"] >= first["telemetry"]["cpu"]["rss_bytes"]["max"] - rss_read_error_bytes()
    assert first["latency"]["overhead"]["count"] == 10_000
    assert eager.shape == (spec.example_inputs[0].shape[0], 10)

    # cold cache: tactics were timed and written; the recorded digest is the file's
    path = cache_file(cache_dir, "digits", BuildConfig("fp32", threads=TINY.threads), CpuBackend())
    assert first["from_cache"] is False and first["build"]["cache_misses"] > 0
    assert first["timing_cache_digest"] == TimingCache.load(path).digest()
    assert {layer["name"] for layer in first["layers"]} >= {e.layer for e in TimingCache.load(path).entries()}

    second = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert second["from_cache"] is True and second["build"]["cache_misses"] == 0
    assert second["engine_fingerprint"] == first["engine_fingerprint"]
    assert second["timing_cache_digest"] == first["timing_cache_digest"]
    assert second["output_digest"] == first["output_digest"]


def test_a_cache_timed_before_a_tactic_existed_is_a_case_warning(tmp_path):
    """A committed cache from an older harness pins every layer; the case says which tactics
    its layers never raced, so a reader comparing speeds knows the engine may not be the
    fastest this harness can build."""
    cache_dir = tmp_path / "caches"
    first = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert first["status"] == "ok", first["error"]
    assert not [w for w in first["warnings"] if "timed before" in w]
    path = cache_file(cache_dir, "digits", BuildConfig("fp32", threads=TINY.threads), CpuBackend())
    cache = TimingCache.load(path)
    newest = "gemm_nn[fp32]"  # stands for a tactic a later harness added
    for entry in cache.entries():
        kept = tuple(c for c in entry.candidates if c.tactic != newest)
        best = min(kept, key=lambda c: c.time_ms)
        cache.update(dataclasses.replace(
            entry, candidates=kept, tactic=best.tactic, tactic_hash=best.tactic_hash, time_ms=best.time_ms
        ))
    cache.save(path)
    second = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert second["from_cache"] is True
    (warning,) = [w for w in second["warnings"] if "timed before" in w]
    assert warning.startswith("2 layer(s) use cached tactics timed before this harness had gemm_nn")
    assert f"case digits/fp32: {warning}" in case_messages(second)


def test_corrupt_cache_fails_the_case_and_is_not_overwritten(tmp_path):
    cache_dir = tmp_path / "caches"
    path = cache_file(cache_dir, "digits", BuildConfig("fp32", threads=TINY.threads), CpuBackend())
    path.parent.mkdir()
    path.write_text('{"schema_version": 1, "truncated')
    case = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert case["status"] == "failed" and case["error"].startswith("build: ")
    assert str(path) in case["error"]
    assert path.read_text() == '{"schema_version": 1, "truncated'


def test_interrupt_keeps_finished_cases_marked_incomplete(tmp_path, writer, monkeypatch):
    calls = []
    real = runner_mod.measure_latency

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "measure_latency", interrupting)
    runner = BenchRunner(CpuBackend(), cache_dir=tmp_path / "caches", settings=TINY)
    with pytest.raises(KeyboardInterrupt):
        runner.run([("digits", "fp32", None), ("digits", "bf16", None), ("digits", "fp16", None)], writer, progress=False)
    doc = load_results(writer.path)
    assert doc["complete"] is False
    assert [(c["model"], c["mode"], c["status"]) for c in doc["cases"]] == [("digits", "fp32", "ok")]


# --- batch sweeps: one engine per (model, mode) on a backend with batch profiles ------------------

SWEEP_MODEL = """
import torch
from torch import nn

def make(batch_size=2):
    return nn.Linear(4, 3), (torch.arange(batch_size * 4, dtype=torch.float32).reshape(batch_size, 4) / 10,)
"""


class GraphEngine(EngineBase):
    """Runs the typed graph itself (any batch size); the rest of an engine, as little as the runner reads."""

    backend = "cpu"

    def __init__(self, graph, config: BuildConfig) -> None:
        self.graph, self.mode, self.outputs, self.config = graph, config.mode, graph.outputs, config

    def run(self, *inputs):
        return self.graph.run(*inputs)

    def input_dtypes(self):
        return self.graph.input_dtypes

    def layers(self):
        return []

    def fingerprint(self) -> str:
        return f"{self.mode}:{self.config.batch_profile}"

    def weights_digest(self) -> str:
        return "w"

    def size_bytes(self) -> int:
        return 0

    def weight_bytes_by_dtype(self):
        return {}

    def device_memory_bytes(self):
        return None

    def compiler_settings(self):
        return self.config.compiler_settings()


class ProfileBackend(CpuBackend):
    """The thinnest backend that builds batch profiles: it records each build and returns a GraphEngine;
    ``refuse`` is what a build with a profile raises (a graph that fixes its batch size, a failure)."""

    batch_profiles = True

    def __init__(self, refuse: Exception | None = None) -> None:
        self.builds: list[tuple[str, BatchProfile | None, tuple[int, ...]]] = []
        self.refuse = refuse

    def build(self, graph, config, cache):
        self.builds.append((config.mode, config.batch_profile, tuple(graph.example_inputs[0].shape)))
        if config.batch_profile is not None and self.refuse is not None:
            raise self.refuse
        return GraphEngine(graph, config), BuildLog("cpu", config.mode, [], [], 0.0)


def sweep(tmp_path, backend, writer, sizes=(2, 1, 4)):
    (tmp_path / "sweep.py").write_text(SWEEP_MODEL)
    ref = f"{tmp_path / 'sweep.py'}:make"
    runner = BenchRunner(backend, cache_dir=tmp_path / "caches", settings=TINY, batch_sizes=sizes)
    doc = runner.run(build_matrix([ref], ["fp32", "autocast-bf16"], None, sizes), writer, progress=False)
    return {(c["mode"], c["batch"]): c for c in doc["cases"]}


def test_a_backend_with_batch_profiles_builds_once_per_model_and_mode(tmp_path, writer):
    backend = ProfileBackend()
    cases = sweep(tmp_path, backend, writer)
    assert {c["status"] for c in cases.values()} == {"ok"} and len(cases) == 6
    # one build per mode, from the model at the sweep's largest size, for the whole sweep (opt: its first size)
    profile = BatchProfile(dim=0, min=1, opt=2, max=4)
    assert backend.builds == [("fp32", profile, (4, 4)), ("autocast-bf16", profile, (4, 4))]
    for mode in ("fp32", "autocast-bf16"):
        runs = [cases[mode, b] for b in (2, 1, 4)]
        assert [c["latency"]["batch_size"] for c in runs] == [2, 1, 4]  # every size ran on that engine
        assert [c["build"]["reused"] for c in runs] == [False, True, True]
        assert {c["build"]["cache_file"] for c in runs} == {runs[0]["build"]["cache_file"]}
        assert "make-b1to4opt2-" in runs[0]["build"]["cache_file"]
        assert runs[0]["build"]["batch_profile"] == profile.to_json()
        assert len({c["engine_fingerprint"] for c in runs}) == 1
        assert all(c["accuracy"]["max_abs_error"] < 0.05 for c in runs)


def test_a_graph_that_fixes_its_batch_falls_back_to_one_engine_per_size(tmp_path, writer):
    backend = ProfileBackend(StaticBatchError("the typed graph fixes the batch size of input 'x'"))
    cases = sweep(tmp_path, backend, writer, sizes=(1, 4))
    assert {c["status"] for c in cases.values()} == {"ok"}
    assert [(mode, profile is None, shape) for mode, profile, shape in backend.builds] == [
        ("fp32", False, (4, 4)), ("fp32", True, (1, 4)), ("autocast-bf16", False, (4, 4)),
        ("autocast-bf16", True, (1, 4)), ("fp32", True, (4, 4)), ("autocast-bf16", True, (4, 4)),
    ]  # fmt: skip
    assert cases["fp32", 4]["build"]["note"] == "one engine per batch size: the typed graph fixes the batch size of input 'x'"
    assert cases["fp32", 4]["build"]["batch_profile"] is None and "make-b4-" in cases["fp32", 4]["build"]["cache_file"]


def test_a_failed_sweep_build_fails_every_size_once(tmp_path, writer):
    backend = ProfileBackend(HarnessError("out of GPU memory"))
    cases = sweep(tmp_path, backend, writer)
    assert [c["error"] for c in cases.values()] == ["build: out of GPU memory"] * 6
    assert len(backend.builds) == 2  # once per mode, not once per size


def _fake_load(monkeypatch, *readings: tuple[float, float, float]) -> None:
    """``os.getloadavg`` returns ``readings`` in turn (a case's start, then its end), then the last one again."""
    queue = list(readings)
    monkeypatch.setattr(runner_mod.os, "getloadavg", lambda: queue.pop(0) if len(queue) > 1 else queue[0])


def test_a_busy_machine_is_warned_about_and_the_warning_is_stored_in_the_case(tmp_path, monkeypatch, writer):
    cpus = os.cpu_count() or 1
    start, end = (cpus * 0.75, 1.0, 0.5), (cpus + 1.25, 1.2, 0.6)  # busier than the cores by the end
    _fake_load(monkeypatch, start, end)
    runner = BenchRunner(CpuBackend(), cache_dir=tmp_path / "caches", settings=TINY)
    doc = runner.run([("digits", "fp32", None)], writer, progress=False)
    (case,) = load_results(writer.path)["cases"]
    assert case == doc["cases"][0] and case["status"] == "ok"
    assert case["load_average"] == {"start": list(start), "end": list(end), "cpus": cpus}
    warning = (f"the machine was busier than its {cpus} cores (load average {start[0]:.1f} -> {end[0]:.1f}); "
               "its latency may be inflated")  # fmt: skip
    assert case["warnings"] == [warning]
    assert f"case digits/fp32: {warning}" in runner_mod.case_messages(case)


@pytest.mark.parametrize(
    ("start", "end", "cpus", "busy"),
    [((0.4, 0, 0), (1.9, 0, 0), 2, False), ((2.0, 0, 0), (2.0, 0, 0), 2, False), ((2.01, 0, 0), (0.1, 0, 0), 2, True),
     ((7.0, 9.0, 9.0), (0.5, 9.0, 9.0), 8, False), ((0.1, 0, 0), (8.5, 0, 0), 8, True)],
)  # fmt: skip
def test_case_messages_warn_when_the_one_minute_load_exceeds_the_cores(start, end, cpus, busy):
    load = {"start": list(start), "end": list(end), "cpus": cpus}
    case = {
        "model": "m", "mode": "fp32", "backend": "cpu", "status": "ok", "accuracy": {"nan_count": 0, "inf_count": 0},
        "latency": {"slow_phase": None}, "load_average": load, "warnings": runner_mod.load_warnings(load),
    }  # fmt: skip
    lines = runner_mod.case_messages(case)
    assert bool(lines) == busy
    if busy:
        assert lines == [f"case m/fp32: the machine was busier than its {cpus} cores (load average "
                         f"{start[0]:.1f} -> {end[0]:.1f}); its latency may be inflated"]  # fmt: skip


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as tqdm asks before drawing a bar."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log-file"])
def test_warnings_and_log_records_go_above_the_progress_bar(tmp_path, monkeypatch, writer, terminal):
    """On a terminal the bar is drawn and every message gets a line of its own above it; where
    stderr is no terminal (a CI log) there is no bar, so no carriage-return fragments either."""
    import logging
    import sys
    import warnings

    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)

    log = logging.getLogger("harness.test_progress")
    real = BenchRunner.run_case

    def noisy(self, model, mode, batch=None):
        warnings.warn("hello from a case", UserWarning, stacklevel=1)
        log.warning("a log record from a case")
        return real(self, model, mode, batch)

    monkeypatch.setattr(BenchRunner, "run_case", noisy)
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # what -v installs: a root handler on stderr
    root.addHandler(console)
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning afterwards
            warnings.simplefilter("always")

            def to_stderr(message, category, filename, lineno, file=None, line=None):
                # Python's own display (pytest records warnings instead): straight onto stderr
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

            warnings.showwarning = before = to_stderr
            runner = BenchRunner(CpuBackend(), cache_dir=tmp_path / "caches", settings=TINY)
            runner.run([("digits", "fp32", None), ("digits", "bf16", None)], writer, progress=True)
            assert warnings.showwarning is before  # the hook is gone again
    finally:
        root.removeHandler(console)
    assert root.handlers.count(console) == 0 and console not in root.handlers
    err = stderr.getvalue()
    assert ("bench:" in err) is terminal and ("\r" in err) is terminal  # the bar, where there is a terminal
    lines = err.replace("\r", "\n").split("\n")
    for text in ("UserWarning: hello from a case", "a log record from a case"):
        hits = [line for line in lines if text in line]
        assert len(hits) == 2, (text, hits)  # one per case
        # a line of its own: written straight to stderr it would follow the bar's text ("bench: 50%|...")
        assert all("bench:" not in line and "%|" not in line for line in hits), hits
