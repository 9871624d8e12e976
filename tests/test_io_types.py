"""``keep_io_types=False`` end to end: the typed graph's low-precision inputs reach every engine.

Without kept I/O types the compiler lowers a floating input consumed only in
the low precision to that precision (and leaves the outputs low). Whatever
runs the graph or an engine must then feed inputs of those dtypes: the CPU
builder's timing runs, the ONNX export's trace, an engine's first run, the
bench, ``rebuild`` and ``debug layers``. Accuracy is still measured against
eager fp32 on the model's own inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness import models
from harness.autocast import AutocastSettings, compile
from harness.bench.accuracy import compare_outputs
from harness.bench.runner import BenchRunner, MeasureSettings, ModelPlan
from harness.build import build_engine, rebuild
from harness.cli.main import main
from harness.engines.cpu import CpuBackend, CpuEngine
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import BuildConfig, engine_inputs
from harness.errors import HarnessError
from harness.fxutil import cast_floating
from tests.helpers import as_tuple, bits_equal

FAST = {"timing_runs": 2, "warmup_runs": 1}
FAST_FLAGS = ["--option", "timing_runs=2", "--option", "warmup_runs=1"]
NOT_KEPT = AutocastSettings(keep_io_types=False)
TINY = MeasureSettings(warmup_s=0.01, min_iters=5, min_duration_s=0.02, max_iters=50, telemetry_interval_s=0.02)


def config(mode: str) -> BuildConfig:
    return BuildConfig(mode=mode, options=FAST, autocast=NOT_KEPT)


def eager_fp32(spec: models.ModelSpec) -> object:
    with torch.inference_mode():
        return spec.module.float().eval()(*spec.example_inputs)


@pytest.mark.parametrize(
    ("model", "mode", "low", "out"),
    [
        ("lenet", "fp16", torch.float16, torch.float16),
        ("lenet", "autocast-fp16", torch.float16, torch.float32),  # its last layer is an fp32 region
        ("resnet", "autocast-bf16", torch.bfloat16, torch.bfloat16),
        ("resnet", "bf16", torch.bfloat16, torch.bfloat16),
        ("transformer", "autocast-bf16", torch.bfloat16, torch.bfloat16),
    ],
)
def test_the_cpu_engine_builds_and_runs_on_the_graphs_low_precision_inputs(model, mode, low, out):
    spec = models.load(model)
    result = build_engine(spec, config(mode), CpuBackend())
    engine = result.engine
    typed = compile_for_mode(spec, mode, None, NOT_KEPT)
    floating = [x.is_floating_point() for x in spec.example_inputs]
    # the contract: floating inputs are low (the transformer's token ids stay int64), and the engine says so
    assert typed.input_dtypes == tuple(low if f else x.dtype for f, x in zip(floating, spec.example_inputs, strict=True))
    assert engine.input_dtypes() == typed.input_dtypes
    assert [x.dtype for x in typed.example_inputs] == list(typed.input_dtypes)
    inputs = engine_inputs(engine, spec.example_inputs)
    assert [x.dtype for x in inputs] == list(typed.input_dtypes)
    outputs = engine.run(*inputs)
    assert {o.dtype for o in outputs} == {out}  # a low output is not cast back either
    # The engine computes the typed graph (within the low precision's rounding: its tactics and
    # folds differ in bits), and the typed graph is within the low precision of eager fp32.
    graph_out = typed.run(*typed.typed_inputs(spec.example_inputs))
    reference = as_tuple(eager_fp32(spec))
    for got, want, ref in zip(outputs, graph_out, reference, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
        assert compare_outputs(got, ref).max_abs_error < 0.1


def test_the_graph_refuses_fp32_inputs_by_name_and_takes_typed_ones():
    spec = models.load("lenet")
    typed = compile(spec.module, spec.example_inputs, settings=dataclasses.replace(NOT_KEPT, low_precision_type="bf16"))
    with pytest.raises(HarnessError, match=r"typed graph input 'x': expected torch.bfloat16, got torch.float32.*typed_inputs"):
        typed.run(*spec.example_inputs)
    kept = compile(spec.module, spec.example_inputs, settings=AutocastSettings(low_precision_type="bf16"))
    # the same computation with the I/O casts moved out of the graph, bit for bit
    assert bits_equal(typed(*typed.typed_inputs(spec.example_inputs)).float(), kept(*spec.example_inputs))


def test_cast_floating_leaves_integer_inputs_and_count_mismatches_to_the_consumers_check():
    ids, x = torch.arange(3), torch.ones(2)
    assert [t.dtype for t in cast_floating((ids, x), (torch.int64, torch.bfloat16))] == [torch.int64, torch.bfloat16]
    assert cast_floating((ids,), (torch.float16,))[0] is ids  # an int where a float is declared: not hidden
    assert cast_floating((x,), (torch.float16, torch.float16)) == (x,)


def test_rebuild_compares_outputs_on_the_engines_input_dtypes(tmp_path):
    spec = models.load("resnet")
    cache = tmp_path / "cache.json"
    build_engine(spec, config("autocast-bf16"), CpuBackend(), cache)  # every tactic pinned: builds must agree
    report = rebuild(spec, config("autocast-bf16"), CpuBackend(), times=2, cache_path=cache)
    assert len(report.distinct_fingerprints) == 1
    assert report.outputs_identical and report.output_mismatches == []


def test_cli_build_and_rebuild_with_no_keep_io_types(tmp_path, capsys):
    out = tmp_path / "engine"
    common = ["--model", "resnet", "--mode", "autocast-bf16", "--no-keep-io-types", *FAST_FLAGS]
    cache = str(tmp_path / "cache.json")
    assert main(["build", *common, "--cache", cache, "-o", str(out)]) == 0
    engine = CpuEngine.load(out)
    assert engine.input_dtypes() == (torch.bfloat16,)
    assert engine.compiler_settings()["keep_io_types"] is False
    # the per-layer profile feeds the model's fp32 batch as the engine takes it
    assert main(["inspect", str(out), "--profile", "--model", "resnet", "--iters", "2", "--warmup", "1"]) == 0
    assert main(["rebuild", *common, "--cache", cache, "--times", "2"]) == 0
    assert "bit-identical across all builds" in capsys.readouterr().out
    assert main(["compile", "--model", "resnet", "--low", "bf16", "--no-keep-io-types", "--json"]) == 0


@pytest.mark.parametrize("model", ["digits", "resnet"])
def test_bench_measures_accuracy_against_eager_fp32_on_the_models_inputs(model, tmp_path):
    backend = CpuBackend()
    runner = BenchRunner(backend, cache_dir=tmp_path, settings=TINY, plans={model: ModelPlan(autocast=NOT_KEPT)})
    entry = runner.run_case(model, "autocast-bf16")
    assert entry["status"] == "ok", entry.get("error")
    spec = models.load(model)
    # The same engine again (the case's cache holds every tactic it chose): its accuracy, computed
    # directly against eager fp32, is what the case recorded.
    cfg = runner.config(model, "autocast-bf16")
    again = build_engine(spec, cfg, backend, runner.cache_path(model, cfg, None)).engine
    assert again.fingerprint() == entry["engine_fingerprint"]
    direct = compare_outputs(again(*engine_inputs(again, spec.example_inputs)), eager_fp32(spec))
    assert entry["accuracy"]["max_abs_error"] == direct.max_abs_error
    assert entry["accuracy"]["mean_abs_error"] == direct.mean_abs_error
    if spec.evaluate is not None:  # held-out accuracy: evaluate() feeds fp32 batches, the engine takes bf16
        with torch.inference_mode():
            eager = float(spec.evaluate(spec.module))
        assert entry["task_accuracy"]["samples"] > 0
        assert abs(entry["task_accuracy"]["value"] - eager) < 0.02


def test_debug_layers_reads_the_cpu_engine_on_low_precision_inputs():
    from harness.debug.inputs import model_batches
    from harness.debug.layers import debug_layers

    spec = models.load("lenet")
    report = debug_layers(spec, "autocast-fp16", model_batches(spec), backend=CpuBackend(), settings=NOT_KEPT)
    assert report.engine_outputs is not None and report.engine_outputs.value("max-abs-err") < 0.05
    assert any(layer.engine is not None for layer in report.layers)


@pytest.mark.parametrize(
    ("backend_name", "mode", "low"),
    [("onnxruntime", "autocast-fp16", "fp16"), ("openvino", "bf16", "bf16"), ("openvino", "fp16", "fp16")],
)
def test_onnx_backends_export_and_run_low_precision_inputs(backend_name, mode, low, tmp_path):
    """Either the backend builds the low-precision-input engine, or it refuses the mode at build as it says up front.

    Whether OpenVINO follows fp16/bf16 graph types depends on the CPU's ISA
    (its probe decides); both outcomes are checked, neither is skipped.
    """
    from harness.engines.registry import get_backend

    backend = get_backend(backend_name)
    spec = models.load("lenet")
    try:
        backend.check_mode(mode)
    except HarnessError as refused:
        assert f"cannot build {mode}" in str(refused)
        with pytest.raises(HarnessError, match=f"cannot build {mode}"):
            build_engine(spec, BuildConfig(mode=mode, autocast=NOT_KEPT), backend)
        return
    engine = build_engine(spec, BuildConfig(mode=mode, autocast=NOT_KEPT), backend).engine
    assert [s.dtype for s in engine.record.inputs] == [low]  # the ONNX graph's input is low, traced as such
    outputs = engine.run(*engine_inputs(engine, spec.example_inputs))
    assert compare_outputs(outputs, as_tuple(eager_fp32(spec))).max_abs_error < 0.05
    engine.save(tmp_path / "e")
    loaded = backend.load(tmp_path / "e")
    assert loaded.input_dtypes() == engine.input_dtypes() == (getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[low]),)


def test_engine_inputs_follow_a_saved_engines_own_contract(tmp_path):
    spec = models.load("lenet")
    result = build_engine(spec, config("fp16"), CpuBackend())
    result.engine.save(tmp_path / "e")
    loaded = CpuEngine.load(Path(tmp_path / "e"))
    assert bits_equal(
        loaded.run(*engine_inputs(loaded, spec.example_inputs))[0],
        result.engine.run(*engine_inputs(result.engine, spec.example_inputs))[0],
    )
