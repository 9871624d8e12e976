"""The OpenVINO backend follows the typed graph, lowers by its hint only in weak modes, and says so.

References are independent of the backend's own bookkeeping: outputs are
compared with the eager model (fp32) or the typed graph run in PyTorch, and
per-layer precisions are read straight from OpenVINO's runtime model
(``rt_info``) and checked against the dtypes the autocast compiler gave the
FX nodes. Which reduced precisions the CPU runs is probed, so the tests hold
on CPUs with and without AVX512-FP16/AMX: where a mode is refused here, the
refusal itself is checked against what OpenVINO really does.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

pytest.importorskip("openvino", reason="the openvino extra is not installed")

from harness import models  # noqa: E402
from harness.build import build_engine  # noqa: E402
from harness.cache.timing_cache import CacheEntry, TimingCache, check_compatible  # noqa: E402
from harness.cli.main import main  # noqa: E402
from harness.dtypes import dtype_name  # noqa: E402
from harness.engines.modes import compile_for_mode  # noqa: E402
from harness.engines.onnx_plan import MODEL_FILE  # noqa: E402
from harness.engines.openvino import OpenVinoBackend, OpenVinoEngine  # noqa: E402
from harness.engines.openvino.probe import probe  # noqa: E402
from harness.engines.protocol import BuildConfig  # noqa: E402
from harness.engines.registry import get_backend  # noqa: E402
from harness.engines.saved import PLAN_FILE  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.extras import install_command  # noqa: E402
from harness.fileio import digest  # noqa: E402
from harness.outputs import tensor_paths  # noqa: E402
from harness.precision import PrecisionMode  # noqa: E402
from tests.helpers import bits_equal  # noqa: E402

BF16_ULP = 2.0**-8
BACKEND = OpenVinoBackend()
HEAVY = ("Convolution", "FullyConnected", "MatMul")


def _supported(mode: str) -> bool:
    return mode in BACKEND.supported_modes()


needs_bf16 = pytest.mark.skipif(not _supported("bf16"), reason="this CPU's OpenVINO has no bf16 kernels")
needs_weak_bf16 = pytest.mark.skipif(not _supported("weak-bf16"), reason="no bf16 kernels under the hint")


@pytest.fixture(scope="module")
def built():
    """(model, mode, explicit file) -> (spec, compiled graph, engine, build log), built once, 1 thread."""
    cache: dict[Any, Any] = {}

    def get(model: str, mode: str, explicit: str | None = None):
        if (model, mode, explicit) not in cache:
            spec = models.load(model)
            compiled = compile_for_mode(spec, mode, explicit)
            engine, log = BACKEND.build(compiled, BuildConfig(mode, explicit_path=explicit, threads=1), None)
            cache[model, mode, explicit] = (spec, compiled, engine, log)
        return cache[model, mode, explicit]

    return get


def runtime_layers(engine: OpenVinoEngine) -> list[dict[str, Any]]:
    """OpenVINO's own report of every executed layer (rt_info of the runtime model)."""
    layers = []
    for op in engine.compiled.get_runtime_model().get_ordered_ops():
        info = {key: value.astype(str) for key, value in op.get_rt_info().items()}
        info["origins"] = [n for n in info["originalLayersNames"].split(",") if n]
        layers.append(info)
    return layers


def layer_computing(engine: OpenVinoEngine, fx_node: str) -> dict[str, Any]:
    """The runtime layer that computes the typed graph's node ``fx_node`` (ONNX nodes keep FX names)."""
    found = [
        layer for layer in runtime_layers(engine)
        if layer["layerType"] in HEAVY and any(o == fx_node or o.startswith(f"{fx_node}/") for o in layer["origins"])
    ]  # fmt: skip
    assert len(found) == 1, (fx_node, [(f["layerType"], f["origins"]) for f in found])
    return found[0]


OV_NAMES = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def fx_dtypes(compiled, op_names: tuple[str, ...] = ("conv2d", "linear")) -> dict[str, str]:
    """FX node -> the dtype the compiler gave it, for the convolutions and linears of the graph."""
    return {
        node.name: dtype_name(node.meta["val"].dtype)
        for node in compiled.graph_module.graph.nodes
        if node.op == "call_function" and node.target.__name__.split(".")[0] in op_names
    }


# ---------------------------------------------------------------- modes and refusals


def test_every_mode_is_supported_exactly_when_the_probe_says_so():
    supported = BACKEND.supported_modes()
    assert "fp32" in supported and "explicit" in supported
    for mode in PrecisionMode:
        if mode.low is None:
            expected = True
        elif mode.weak:
            expected = probe("fp32", OV_NAMES[mode.low]).honoured
        else:
            expected = probe(mode.low, "f32").honoured
        assert (mode in supported) == expected, mode
        if expected:
            BACKEND.check_mode(mode)
        else:
            with pytest.raises(HarnessError, match=f"backend openvino cannot build {mode}: .*on this CPU"):
                BACKEND.check_mode(mode)


def test_strong_fp16_is_accepted_or_refused_for_what_openvino_really_does(tmp_path):
    """The probe's claim holds on a real graph: under the f32 hint the fp16 convolutions run f16 exactly when fp16 is accepted."""
    supported = _supported("fp16")
    if supported:
        BACKEND.check_mode("fp16")
    else:
        with pytest.raises(HarnessError, match=r"INFERENCE_PRECISION_HINT=f32 .* it would not follow the graph's fp16 casts"):
            BACKEND.check_mode("fp16")
    from harness.engines.onnx_export import export_onnx
    from harness.engines.openvino.runtime import core

    compiled = compile_for_mode(models.load("lenet"), "fp16", None)
    model = core().read_model(export_onnx(compiled, tmp_path / "fp16.onnx").path.read_bytes())
    assert fx_dtypes(compiled)["conv2d"] == "fp16"
    ran = core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    precisions = {
        op.get_rt_info()["runtimePrecision"].astype(str)
        for op in ran.get_runtime_model().get_ordered_ops()
        if op.get_rt_info()["layerType"].astype(str) == "Convolution"
    }
    assert precisions == ({"f16"} if supported else {"f32"})


def test_unknown_modes_and_builder_options_are_refused(built):
    with pytest.raises(HarnessError, match="unknown precision mode 'fp8'; valid modes: fp32"):
        BACKEND.check_mode("fp8")
    compiled = built("lenet", "fp32")[1]
    with pytest.raises(HarnessError, match="backend openvino takes no builder options"):
        BACKEND.build(compiled, BuildConfig("fp32", options={"num_streams": 2}), None)


def test_the_registry_knows_the_backend_and_the_bench_defaults_to_its_modes():
    from harness.bench.runner import default_modes
    from harness.engines.registry import BACKEND_NAMES

    assert "openvino" in BACKEND_NAMES
    backend = get_backend("openvino")
    assert backend.name == "openvino"
    assert default_modes(backend) == tuple(m for m in backend.supported_modes() if m != "explicit")


def test_a_missing_openvino_names_the_extra_to_install(monkeypatch):
    for name in [n for n in sys.modules if n == "openvino" or n.startswith(("openvino.", "harness.engines.openvino"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino -> ImportError
    with pytest.raises(HarnessError, match=rf"backend 'openvino' needs openvino, which is not installed.*{re.escape(install_command('openvino'))}"):
        get_backend("openvino")


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("model", ["lenet", "resnet", "transformer"])
def test_the_fp32_engine_matches_eager_fp32(built, model):
    spec, _, engine, _ = built(model, "fp32")
    with torch.inference_mode():
        reference = spec.module(*spec.example_inputs)
    output = engine(*spec.example_inputs)
    assert output.dtype == reference.dtype and output.shape == reference.shape
    assert (output.double() - reference.double()).abs().max().item() <= 1e-5 * reference.abs().max().item()
    assert engine.compiled_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
    floats = {layer.precision for layer in engine.executed if layer.from_graph} - {"int64", "int32"}
    assert floats == {"fp32"}


def test_the_fp32_engine_matches_a_transformers_model(built):
    pytest.importorskip("transformers")
    spec, _, engine, _ = built("hf-bert", "fp32")
    with torch.inference_mode():
        reference = spec.module(*spec.example_inputs)
    output = engine(*spec.example_inputs)
    got, want = tensor_paths(output), tensor_paths(reference)
    assert [path for path, _ in got] == [path for path, _ in want]  # same ModelOutput structure
    for (path, a), (_, b) in zip(got, want, strict=True):
        assert (a.double() - b.double()).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0), path


# ---------------------------------------------------------------- strong typing: the graph's types


@needs_bf16
def test_a_strongly_typed_bf16_build_runs_each_layer_in_the_graphs_type(built):
    """lenet autocast-bf16: convolutions bf16 (the compiler's casts), the fp32 autocast region f32."""
    spec, compiled, engine, log = built("lenet", "autocast-bf16")
    wanted = fx_dtypes(compiled)
    assert wanted == {"conv2d": "bf16", "conv2d_1": "bf16", "linear": "fp32"}
    for node, dtype in wanted.items():
        layer = layer_computing(engine, node)
        assert layer["runtimePrecision"] == OV_NAMES[dtype], (node, layer)
        assert layer["primitiveType"].endswith(f"_{OV_NAMES[dtype]}"), (node, layer["primitiveType"])
    assert engine.compiled_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
    assert any("strong typing (INFERENCE_PRECISION_HINT=f32)" in m and "every layer computes in a type the graph gives it" in m
               for m in log.messages)  # fmt: skip
    ran = engine.executed_precision()  # the results' record: the bf16 layers, none computed wider
    assert ran is not None and ran.asked == "bf16" and ran.wider == () and not ran.chosen
    assert ran.layers >= 2  # the two convolutions at least
    # Numerically it is the typed graph, to bf16 accuracy, and not the fp32 model.
    reference = compiled(*compiled.example_inputs)
    output = engine(*compiled.example_inputs)
    scale = reference.abs().max().item()
    assert (output - reference).abs().max().item() <= 4 * BF16_ULP * scale
    fp32_output = built("lenet", "fp32")[2](*spec.example_inputs)
    assert not torch.equal(output, fp32_output)


@needs_bf16
def test_a_batch_norm_with_fp32_parameters_under_a_bf16_input_is_read_and_computed(built):
    """resnet amp-bf16 keeps its batch norms' parameters fp32 under bf16 activations, as
    PyTorch's mixed batch norm allows; OpenVINO refuses mixed BatchNormalization types, so
    the export widens each to its parameters' dtype and rounds back once: the engine builds
    and computes the typed graph, to bf16 accuracy."""
    _, compiled, engine, _ = built("resnet", "amp-bf16")
    reference = compiled(*compiled.example_inputs)
    output = engine(*compiled.example_inputs)
    scale = reference.abs().max().item()
    assert (output - reference).abs().max().item() <= 0.05 * scale


@needs_bf16
def test_an_explicit_file_decides_the_runtime_precision_node_by_node(built, tmp_path):
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"^conv2d_1$": "bf16"}))
    _, compiled, engine, _ = built("lenet", "explicit", str(explicit))
    assert fx_dtypes(compiled) == {"conv2d": "fp32", "conv2d_1": "bf16", "linear": "fp32"}
    assert layer_computing(engine, "conv2d")["runtimePrecision"] == "f32"
    assert layer_computing(engine, "conv2d_1")["runtimePrecision"] == "bf16"
    assert layer_computing(engine, "linear")["runtimePrecision"] == "f32"


def test_an_explicit_file_with_a_type_openvino_would_not_keep_is_refused_naming_the_casts(tmp_path):
    """Each reduced type in an explicit file is either kept by OpenVINO, or refused naming the file and the casts."""
    for low in ("fp16", "bf16"):
        explicit = tmp_path / f"explicit-{low}.json"
        explicit.write_text(json.dumps({"^conv2d$": low}))
        compiled = compile_for_mode(models.load("lenet"), "explicit", str(explicit))
        config = BuildConfig("explicit", explicit_path=str(explicit), threads=1)
        if probe(low, "f32").honoured:
            engine, _ = BACKEND.build(compiled, config, None)
            assert layer_computing(engine, "conv2d")["runtimePrecision"] == OV_NAMES[low], low
            continue
        with pytest.raises(HarnessError, match=rf"explicit file {re.escape(str(explicit))}\) casts to {low} at x_{low}"):
            BACKEND.build(compiled, config, None)


# ---------------------------------------------------------------- weak typing: the hint decides


@needs_weak_bf16
def test_a_weak_build_lowers_the_fp32_graph_by_the_hint_and_says_so(built):
    _, compiled, engine, log = built("lenet", "weak-bf16")
    assert set(fx_dtypes(compiled).values()) == {"fp32"}  # the graph itself is fp32 ...
    assert not engine.record.casts
    # ... and OpenVINO lowered it, the fp32-region linear included (strong modes keep it f32).
    for node in ("conv2d", "conv2d_1", "linear"):
        assert layer_computing(engine, node)["runtimePrecision"] == "bf16", node
    assert engine.compiled_property("INFERENCE_PRECISION_HINT").get_type_name() == "bf16"
    [note] = [m for m in log.messages if m.startswith("weak typing")]
    assert "OpenVINO chose each layer's precision by INFERENCE_PRECISION_HINT=bf16 on the fp32 graph" in note
    lowered = note.split("; in bf16: ")[1].split("; kept in fp32: ")[0].split(", ")
    assert {"linear", "max_pool2d"} <= set(lowered)
    ran = engine.executed_precision()  # OpenVINO's choice, recorded as such: what it kept in fp32
    kept = note.split("; kept in fp32: ")[1]
    assert ran is not None and ran.chosen and ran.asked == "bf16"
    assert set(ran.wider) == (set() if kept == "none" else set(kept.split(", ")))
    assert ran.layers == len(lowered) + len(ran.wider)
    with torch.inference_mode():
        reference = models.load("lenet").module(*compiled.example_inputs)
    output = engine(*compiled.example_inputs)
    assert 0 < (output - reference).abs().max().item() <= 8 * BF16_ULP * reference.abs().max().item()


# ---------------------------------------------------------------- tactics and the timing cache


def test_layers_carry_the_executed_primitive_as_tactic_in_engine_and_build_log(built):
    _, _, engine, log = built("lenet", "fp32")
    reported = [(r["layerType"], r["primitiveType"]) for r in runtime_layers(engine)
                if r["layerType"] not in ("Const", "Input", "Output")]  # fmt: skip
    assert [(layer.layer_type, layer.tactic) for layer in engine.layers()] == reported
    assert [(t.layer, t.chosen, t.chosen_hash) for t in log.layers] == [
        (layer.name, layer.tactic, layer.tactic_hash) for layer in engine.layers()
    ]
    assert all(not t.candidates and not t.from_cache for t in log.layers)
    assert not any(layer.key for layer in engine.layers())  # nothing autotuned: no cache keys
    assert any("not by timing, so nothing was timed" in m for m in log.messages)
    convs = [layer for layer in engine.layers() if layer.layer_type == "Convolution"]
    assert len(convs) == 2 and all(layer.tactic.endswith("_f32") for layer in convs)


def test_two_builds_of_one_graph_are_identical(built):
    """OpenVINO's process-wide node counter must not leak into names, fingerprints or outputs."""
    _, compiled, engine, _ = built("transformer", "fp32")
    again, _ = BACKEND.build(compiled, BuildConfig("fp32", threads=1), None)
    assert again.fingerprint() == engine.fingerprint()
    assert again.layers() == engine.layers()
    assert bits_equal(again(*compiled.example_inputs), engine(*compiled.example_inputs))


def test_the_timing_cache_is_read_never_written_and_pins_are_refused(tmp_path):
    spec = models.load("digits")
    config = BuildConfig("fp32", threads=1)
    path = tmp_path / "cache.json"
    result = build_engine(spec, config, BACKEND, path)
    assert result.cache_entries_added == 0 and not path.exists()
    provenance = BACKEND.provenance(config)
    assert provenance.builder_options["inference_precision_hint"] == "f32"
    assert provenance.builder_options["inference_num_threads"] == 1
    assert "OpenVINO CPU" in provenance.device
    with pytest.raises(HarnessError, match="inference_num_threads: 2 != 1"):
        check_compatible(TimingCache(BACKEND.provenance(BuildConfig("fp32", threads=2))), provenance, False, "cache")
    pinned = TimingCache(provenance, [CacheEntry("0xabc", "linear", "gemm_mlas_f32", "0x1", 0.0, pinned=True)])
    compiled = compile_for_mode(spec, "fp32", None)
    with pytest.raises(HarnessError, match="cannot honour pinned tactics"):
        BACKEND.build(compiled, config, pinned)


# ---------------------------------------------------------------- saved engines


def test_save_and_load_round_trip_runs_bit_identically(built, tmp_path):
    _, compiled, engine, _ = built("lenet", "fp32")
    engine.save(tmp_path / "engine")
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == [MODEL_FILE, PLAN_FILE]
    loaded = get_backend("openvino").load(tmp_path / "engine")
    assert loaded.fingerprint() == engine.fingerprint()
    assert loaded.layers() == engine.layers()
    assert loaded.weights_digest() == engine.weights_digest()
    assert loaded.record == engine.record
    assert bits_equal(loaded(*compiled.example_inputs), engine(*compiled.example_inputs))


def _edit_plan(directory: Path, change) -> None:
    plan = json.loads((directory / PLAN_FILE).read_text())
    change(plan)
    (directory / PLAN_FILE).write_text(json.dumps(plan))


def _forge_model(directory: Path, data: bytes) -> None:
    """Replace model.onnx and re-sign its digest, as a forger would."""
    (directory / MODEL_FILE).write_bytes(data)
    _edit_plan(directory, lambda plan: plan.update(model_digest=digest(data)))


def _external_model(directory: Path) -> bytes:
    model = onnx.load(directory / MODEL_FILE)
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../../etc/passwd")
    return model.SerializeToString()


TAMPERING = {
    "mode": (lambda d: _edit_plan(d, lambda p: p.update(mode="autocast-bf16")), "fingerprint mismatch"),
    "hint": (lambda d: _edit_plan(d, lambda p: p["settings"].update(inference_precision_hint="bf16")),
             "mode fp32 compiles with INFERENCE_PRECISION_HINT=f32, the plan says bf16"),
    "threads": (lambda d: _edit_plan(d, lambda p: p["settings"].update(inference_num_threads=2)), "fingerprint mismatch"),
    "version": (lambda d: _edit_plan(d, lambda p: p.update(openvino_version="2099.1")), "fingerprint mismatch"),
    "input spec": (lambda d: _edit_plan(d, lambda p: p["inputs"][0].update(dtype="int64")),
                   r"the compiled model's input 'x' is fp32 \(8, 1, 28, 28\), the plan says int64"),
    "casts": (lambda d: _edit_plan(d, lambda p: p.update(casts=[{"node": "x_bf16", "origin": "x_bf16", "source": "fp32",
                                                                  "target": "bf16", "placed_by": "compiler"}])),
              "fingerprint mismatch"),
    "tactic": (lambda d: _edit_plan(d, lambda p: p["layers"][2].update(tactic="ref_any_f32")),
               "executes other layers than the plan records"),
    "fixed property": (lambda d: _edit_plan(d, lambda p: p["settings"]["fixed"].update(ENABLE_CPU_PINNING=True)),
                       "invalid at settings/fixed"),
    "model bytes": (lambda d: (d / MODEL_FILE).write_bytes((d / MODEL_FILE).read_bytes()[:-7]),
                    "digest does not match"),
    "model not onnx, re-signed": (lambda d: _forge_model(d, b"\x08\x07garbage"), "not an ONNX model"),
    "external data, re-signed": (lambda d: _forge_model(d, _external_model(d)), "stores tensors in external files"),
    "plan not json": (lambda d: (d / PLAN_FILE).write_text("{"), "not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_engine_is_refused_on_load_naming_the_problem(built, tmp_path, case):
    _, _, engine, _ = built("lenet", "fp32")
    engine.save(tmp_path / "engine")
    tamper, message = TAMPERING[case]
    tamper(tmp_path / "engine")
    with pytest.raises(HarnessError, match=message):
        OpenVinoEngine.load(tmp_path / "engine")


def test_wrong_inputs_are_refused(built):
    spec, _, engine, _ = built("lenet", "fp32")
    with pytest.raises(HarnessError, match=r"openvino engine input 'x': expected fp32 \(8, 1, 28, 28\), got fp64"):
        engine(spec.example_inputs[0].double())


# ---------------------------------------------------------------- threads and the command line


def test_thread_pinning_is_openvinos_own_and_leaves_the_caller_alone(tmp_path):
    spec = models.load("digits")
    before = (torch.get_num_threads(), os.sched_getaffinity(0))
    torch.set_num_threads(2)
    try:
        result = build_engine(spec, BuildConfig("fp32", threads=1), BACKEND)
        assert torch.get_num_threads() == 2
        assert result.engine.compiled_property("INFERENCE_NUM_THREADS") == 1
        result.engine(*spec.example_inputs)
        default, _ = BACKEND.build(compile_for_mode(spec, "fp32", None), BuildConfig("fp32"), None)
        assert default.compiled_property("INFERENCE_NUM_THREADS") == 2  # no --threads: torch's count
        default(*spec.example_inputs)
        assert (torch.get_num_threads(), os.sched_getaffinity(0)) == (2, before[1])
        assert not result.engine.compiled_property("ENABLE_CPU_PINNING")
    finally:
        torch.set_num_threads(before[0])


def test_build_and_inspect_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "engine"
    assert main(["build", "--model", "digits", "--mode", "fp32", "--backend", "openvino", "--threads", "1",
                 "-o", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "openvino"
    loaded = OpenVinoEngine.load(out)
    assert [layer["tactic"] for layer in report["layers"]] == [layer.tactic for layer in loaded.layers()]
    log = json.loads((out / "build_log.json").read_text())
    assert log["backend"] == "openvino" and any("INFERENCE_NUM_THREADS=1" in m for m in log["messages"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_cross_into_openvino_and_back_bit_for_bit(dtype):
    """bf16, which numpy lacks, travels as its bit pattern; strided inputs are copied as values."""
    import openvino as ov

    from harness.engines.openvino.runtime import copy_in, host_view, to_torch

    source = (torch.randn(6, 4) * 100).to(dtype).t()  # not contiguous
    tensor = ov.Tensor({torch.float32: ov.Type.f32, torch.bfloat16: ov.Type.bf16, torch.float16: ov.Type.f16,
                        torch.int64: ov.Type.i64}[dtype], [4, 6])  # fmt: skip
    copy_in(host_view(tensor), source)
    back = to_torch(tensor)
    assert back.dtype == dtype and bits_equal(back, source.contiguous())


def test_a_graph_openvino_cannot_read_is_refused_naming_the_node():
    """Mixed-type BatchNormalization is valid ONNX (resnet's amp-bf16 export has one); OpenVINO cannot read it."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from harness.engines.openvino.engine import _read

    params = [numpy_helper.from_array(np.ones(4, np.float32), name) for name in ("scale", "bias", "mean", "var")]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], name="my_norm")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 4, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 4, 2, 2])], params,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    onnx.checker.check_model(model, full_check=True)
    with pytest.raises(HarnessError, match=r"cannot read the exported model: BatchNormalization-\d+ node 'my_norm': "):
        _read(model.SerializeToString())
