"""``harness debug precision``: the search keeps exactly what the target needs, and its file builds.

Subjects are the planted-layer models of tests/test_debug_layers.py. Errors
are always measured for real (engines built on the backend, against eager
fp32 or eager autocast). Where a test asserts which plan is *chosen*, the
latencies are injected (a cost per fp32 or per low-precision layer of the
built engine), because that choice is made on timings; with real timings,
tests assert only what timing cannot change (``--choose pruned``, the file
round trip, the pruned plan).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness import models
from harness.bench.stats import Summary
from harness.cli.main import main
from harness.debug import parse_target, search_precision
from harness.debug.inputs import model_batches
from harness.debug.layers import debug_layers
from harness.engines.cpu import CpuBackend, CpuEngine
from harness.engines.onnxruntime.backend import OnnxRuntimeBackend
from harness.errors import HarnessError
from harness.fileio import json_bytes
from harness.globalstate import GlobalState
from tests.helpers import exit_code
from tests.test_debug_layers import HEAD, MODEL_FILE

FAST = ["--seconds", "0.02", "--final-seconds", "0.1", "--no-progress"]
LOW = ("fp16", "bf16")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("precision-model") / "planted.py"
    path.write_text(MODEL_FILE)
    return path


def load(model_file: Path, factory: str):
    return models.load(f"{model_file}:{factory}")


def _count(engine, dtypes) -> int:
    return sum(1 for layer in engine.layers() if set(layer.output_dtypes) & set(dtypes))


def fp32_is_slow(engine, inputs, seconds) -> Summary:
    """1 us per fp32 layer: fewer fp32 layers is faster."""
    return Summary.from_samples([1000.0 * (1 + _count(engine, ("fp32",)))] * 5)


def low_is_slow(engine, inputs, seconds) -> Summary:
    """1 us per low-precision layer: all fp32 is by far the fastest."""
    return Summary.from_samples([1000.0 * (1 + _count(engine, LOW))] * 5)


def fp32_slightly_faster(engine, inputs, seconds) -> Summary:
    """All fp32 5% faster than any plan with a low layer: inside the default 10% margin."""
    return Summary.from_samples([1000.0 if _count(engine, LOW) == 0 else 1050.0] * 5)


def _search(spec, low, target, **kwargs):
    kwargs.setdefault("meter", fp32_is_slow)
    kwargs.setdefault("final_seconds", 0.01)
    return search_precision(spec, low, parse_target(target), model_batches(spec), backend=CpuBackend(), **kwargs)


def test_planted_overflow_keeps_exactly_that_layer(model_file):
    spec = load(model_file, "planted_fp16")
    result = _search(spec, "fp16", "1-cosine<=1e-5")
    assert result.minimal.kept == (HEAD,)
    assert result.plan.kept == (HEAD,)
    assert result.sensitivity[0] == (HEAD, math.inf)
    assert result.plan.file_bytes() == json_bytes({f"^{HEAD}$": "fp32", ".*": "fp16"})
    first, second = result.steps[:2]
    assert (first.kept, first.met, math.isinf(first.error)) == ((), False, True)  # all fp16 overflows
    assert second.kept == result.layers and second.met
    assert result.chosen.error <= 1e-5 and all(step.latency_ms > 0 for step in result.steps)
    # The chosen plan was verified on the engine: it runs head in fp32 and everything else in fp16.
    engine = result.chosen.engine
    assert engine is not None
    head = [layer for layer in engine.layers() if layer.name == HEAD]
    assert head and head[0].output_dtypes == ("fp32",)


def test_clearly_faster_plan_replaces_the_pruned_one(model_file):
    spec = load(model_file, "planted_fp16")
    result = _search(spec, "fp16", "1-cosine<=1e-5", meter=low_is_slow)
    assert result.minimal.kept == (HEAD,)
    assert result.plan.all_fp32
    assert result.plan.file_bytes() == json_bytes({".*": "fp32"})
    chosen = next(f for f in result.finalists if f.evaluation is result.chosen)
    assert chosen.role == "all fp32" and chosen.speedup is not None and chosen.speedup.low >= 1.1


def test_a_speedup_inside_the_margin_keeps_the_pruned_plan(model_file):
    spec = load(model_file, "planted_fp16")
    result = _search(spec, "fp16", "1-cosine<=1e-5", meter=fp32_slightly_faster)
    assert result.plan.kept == (HEAD,)
    faster = next(f for f in result.finalists if f.role == "all fp32")
    assert faster.speedup is not None and faster.speedup.ratio == pytest.approx(1.05)
    # With --min-speedup below 5% the same timings switch to all fp32.
    again = _search(spec, "fp16", "1-cosine<=1e-5", meter=fp32_slightly_faster, min_speedup=0.02)
    assert again.plan.all_fp32


def test_same_inputs_give_the_same_file(model_file):
    spec = load(model_file, "planted_bf16")
    files = {_search(spec, "bf16", "max-abs-err<=0.5").plan.file_bytes() for _ in range(2)}
    assert files == {json_bytes({f"^{HEAD}$": "fp32", ".*": "bf16"})}


def test_eager_autocast_target_is_eager_autocasts_own_error(model_file):
    spec = load(model_file, "harmless")
    batches = model_batches(spec)
    with torch.inference_mode():
        eager = 0.0
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = spec.module(*batch)
            eager = max(eager, float((low.double() - spec.module(*batch).double()).abs().max()))
    result = _search(spec, "bf16", "max-abs-err<=eager-autocast")
    assert result.target.limit == pytest.approx(eager, rel=1e-9)
    assert result.target.relative_to == "eager-autocast"
    assert result.chosen.error <= eager
    assert result.steps[0].met == (result.steps[0].error <= eager)


def test_task_accuracy_drop_target(model_file):
    spec = load(model_file, "planted_fp16_labelled")
    result = _search(spec, "fp16", "task-accuracy-drop<=0")
    assert result.steps[0].error > 0  # all fp16: NaN logits lose predictions
    assert result.minimal.kept == (HEAD,) and result.chosen.error <= 0
    with pytest.raises(HarnessError, match="no labelled data"):
        _search(load(model_file, "harmless"), "fp16", "task-accuracy-drop<=0.01")


def test_onnxruntime_candidates_are_verified_on_onnxruntime(model_file):
    """The typed graph overflows in head, but ONNX Runtime runs fp16 Gemm in fp32 (its CPU
    provider inserts casts): verified on the engine, all fp16 already meets the target."""
    spec = load(model_file, "planted_fp16")
    result = search_precision(
        spec, "fp16", parse_target("1-cosine<=1e-5"), model_batches(spec)[:2], backend=OnnxRuntimeBackend(),
        meter=fp32_is_slow, final_seconds=0.01, min_speedup=math.inf,
    )  # fmt: skip
    assert result.backend == "onnxruntime"
    assert result.sensitivity[0] == (HEAD, math.inf)  # the typed graph: head overflows alone
    assert result.steps[0].kept == () and result.steps[0].met  # the engine: it does not
    assert result.plan.file_bytes() == json_bytes({".*": "fp16"})


def test_entry_points_leave_global_state_as_it_was(model_file):
    spec = load(model_file, "planted_bf16")
    original = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        before = GlobalState.capture()
        _search(spec, "bf16", "max-abs-err<=0.5", threads=1)
        assert GlobalState.capture() == before
        debug_layers(spec, "bf16", model_batches(spec)[:1], backend=CpuBackend(), threads=1)
        assert GlobalState.capture() == before
    finally:
        torch.set_num_threads(original)


def test_cli_plan_round_trips_through_build_and_bench(model_file, tmp_path, capsys):
    """Real timings, --choose pruned: the file keeps exactly head, and build and bench accept it."""
    plan, ref = tmp_path / "plan.json", f"{model_file}:planted_bf16"
    code = main(["debug", "precision", "--model", ref, "--low", "bf16", "--target", "max-abs-err<=0.5",
                 "--choose", "pruned", "-o", str(plan), *FAST])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert json.loads(plan.read_text()) == {f"^{HEAD}$": "fp32", ".*": "bf16"}
    assert "chosen: 1 fp32: linear_2" in out and (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"

    engine_dir = tmp_path / "engine"
    assert main(["build", "--model", ref, "--mode", "explicit", "--explicit", str(plan), "-o", str(engine_dir),
                 "--option", "timing_runs=1", "--option", "warmup_runs=0"]) == 0  # fmt: skip
    engine = CpuEngine.load(engine_dir)
    layers = {layer.name: layer.output_dtypes for layer in engine.layers()}
    assert layers[HEAD] == ("fp32",) and ("bf16",) in layers.values()
    spec = load(model_file, "planted_bf16")
    with torch.inference_mode():
        worst = max(float((engine(*b) - spec.module(*b)).abs().max()) for b in model_batches(spec))
    assert worst <= 0.5

    run = tmp_path / "run.json"
    assert main(["bench", "--models", ref, "--modes", "explicit", "--explicit", str(plan), "--backend", "cpu",
                 "--quick", "--no-plots", "--no-progress", "-o", str(run)]) == 0  # fmt: skip
    (case,) = json.loads(run.read_text())["cases"]
    assert case["status"] == "ok" and case["accuracy"]["max_abs_error"] <= 0.5


def test_cli_file_is_byte_identical_across_runs_and_uses_the_cache(model_file, tmp_path, capsys):
    cache = tmp_path / "cache.json"
    outputs = []
    for run in range(2):
        out = tmp_path / f"plan{run}.json"
        code = main(["debug", "precision", "--model", f"{model_file}:planted_fp16", "--low", "fp16",
                     "--target", "1-cosine<=1e-5", "--choose", "pruned", "--cache", str(cache), "--json",
                     "--no-plot", "-o", str(out), *FAST])  # fmt: skip
        assert code == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["chosen"]["kept"] == [HEAD] and doc["output"] == str(out)
        outputs.append(out.read_bytes())
        if run == 0:
            first_cache = cache.read_bytes()
    assert outputs[0] == outputs[1] == json_bytes({f"^{HEAD}$": "fp32", ".*": "fp16"})
    assert cache.read_bytes() == first_cache  # the second run found every tactic in the cache


def test_unreachable_target_reports_the_best_value(model_file, capsys):
    # Folding batch norm into the convolution moves fp32's own last bits: an error of 0 is out of reach.
    code = main(["debug", "precision", "--model", f"{model_file}:folded", "--low", "bf16",
                 "--target", "max-abs-err<=0", "--no-plot", *FAST])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot be met on backend cpu, not even with every layer in fp32" in err
    assert "the best max-abs-err reached is" in err and "(all fp32)" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--low", "bf16", "--backend", "onnxruntime"], "no bf16 kernels"),
        (["--low", "fp16", "--backend", "tensorrt"], "TensorRT backend needs the `tensorrt` Python package"),
        (["--low", "fp16", "--target", "max-err<=1"], "unknown metric 'max-err'; valid: max-abs-err"),
        (["--low", "fp16", "--target", "max-abs-err<1"], "expected METRIC<=X"),
        (["--low", "fp16", "--target", "1-cosine<=-1"], "must be a finite number >= 0"),
        (["--low", "fp16", "--target", "task-accuracy-drop<=eager-autocast"], "give a number"),
        (["--low", "fp16", "--target", "task-accuracy-drop<=0.1"], "has no labelled data"),
        (["--low", "fp16", "--min-speedup", "fast"], "argument --min-speedup: 'fast': expected a percentage"),
        (["--low", "fp16", "--seconds", "0"], "argument --seconds: '0': expected a number of seconds above 0"),
        (["--low", "fp16", "-o", "."], "is a directory"),
    ],
)
def test_bad_input_is_one_clear_error(model_file, capsys, argv, message):
    argv = ["--target", "1-cosine<=1e-5", *argv] if "--target" not in argv else argv
    code = exit_code(["debug", "precision", "--model", f"{model_file}:harmless", "--no-plot", *FAST, *argv])
    assert code == 2
    assert message in capsys.readouterr().err
