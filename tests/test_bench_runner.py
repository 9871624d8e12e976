"""The benchmark runner on the real CPU engine: failures, interrupts, caches, shards."""

from __future__ import annotations

import pytest
import torch

from harness import models
from harness.bench import runner as runner_mod
from harness.bench.results import ResultsWriter, load_results
from harness.bench.runner import BenchRunner, MeasureSettings, build_matrix, cache_file, parse_shard
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend
from harness.engines.modes import is_weak
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.zoo import digits

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

    def supported_modes(self) -> tuple[str, ...]:
        return tuple(m for m in super().supported_modes() if not is_weak(m))

    def check_mode(self, mode: str) -> None:
        super().check_mode(mode)
        if is_weak(mode):
            raise HarnessError(f"mode {mode!r}: weak typing was removed from this backend")


@pytest.fixture
def writer(tmp_path):
    return ResultsWriter.create(tmp_path / "run.json", settings={"test": True})


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


def test_cache_files_are_keyed_by_model_mode_backend_threads_and_settings(tmp_path):
    from harness.autocast import AutocastSettings

    base = BuildConfig("autocast-bf16", threads=1)
    path = cache_file(tmp_path, "my model/x", base, "cpu")
    assert path.parent == tmp_path and "/" not in path.name and " " not in path.name
    assert path.name.startswith("my_model_x-autocast-bf16-cpu-t1-")
    others = {
        cache_file(tmp_path, "my model/x", BuildConfig("autocast-bf16", threads=2), "cpu"),
        cache_file(tmp_path, "my model/x", base, "onnxruntime"),
        cache_file(tmp_path, "my model/x", BuildConfig("autocast-bf16", threads=1,
                   autocast=AutocastSettings(nodes_to_exclude=["^conv"])), "cpu"),
    }  # fmt: skip
    assert path not in others and len(others) == 3
    # settings do not shape an fp32 graph: they do not split its cache
    assert cache_file(tmp_path, "m", BuildConfig("fp32", threads=1), "cpu").name == "m-fp32-cpu-t1.json"


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
    # Linux batches each thread's RSS counter updates (up to 64 page faults) before they reach
    # the counters VmHWM and psutil read, so the two may disagree by that much.
    slack = 64 * 4096
    assert memory["peak_rss_bytes"] >= first["telemetry"]["cpu"]["rss_bytes"]["max"] - slack
    assert first["latency"]["overhead"]["count"] == 10_000
    assert eager.shape == (spec.example_inputs[0].shape[0], 10)

    # cold cache: tactics were timed and written; the recorded digest is the file's
    path = cache_file(cache_dir, "digits", BuildConfig("fp32", threads=TINY.threads), "cpu")
    assert first["from_cache"] is False and first["build"]["cache_misses"] > 0
    assert first["timing_cache_digest"] == TimingCache.load(path).digest()
    assert {layer["name"] for layer in first["layers"]} >= {e.layer for e in TimingCache.load(path).entries()}

    second = BenchRunner(CpuBackend(), cache_dir=cache_dir, settings=TINY).run_case("digits", "fp32")
    assert second["from_cache"] is True and second["build"]["cache_misses"] == 0
    assert second["engine_fingerprint"] == first["engine_fingerprint"]
    assert second["timing_cache_digest"] == first["timing_cache_digest"]
    assert second["output_digest"] == first["output_digest"]


def test_corrupt_cache_fails_the_case_and_is_not_overwritten(tmp_path):
    cache_dir = tmp_path / "caches"
    path = cache_file(cache_dir, "digits", BuildConfig("fp32", threads=TINY.threads), "cpu")
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
