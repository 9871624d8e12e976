"""ONNX Runtime runs the TensorRT hand-off file and agrees with the typed graph.

The reference for every output is the compiled graph run in PyTorch. The
tolerance follows the graph's precision: fp32 graphs agree to 1e-5 of the
output magnitude; fp16 graphs to 4 fp16 ulps (4 * 2**-10) of it, because ORT's
CPU provider runs most fp16 nodes in fp32 (see the backend's docstring) while
PyTorch rounds every intermediate to fp16 - the two round differently, never
by more than a few ulps of the result on these small models.
"""

from __future__ import annotations

import json
import re
import shutil

import onnx
import pytest
import torch

from harness import models
from harness.engines.modes import compile_for_mode
from harness.engines.onnx_plan import MODEL_FILE
from harness.engines.onnxruntime import OnnxRuntimeBackend, OnnxRuntimeEngine
from harness.engines.onnxruntime.backend import (
    _TOKEN,
    TACTIC,
    _layers,
    _open_session,
    _value_dtypes,
)
from harness.engines.protocol import BuildConfig
from harness.engines.saved import PLAN_FILE
from harness.errors import HarnessError
from tests.helpers import bits_equal

FP16_ULP = 2.0**-10
NOTED_NODE = re.compile(r"(?P<name>[\w/]+) \(\w+ [\w/]+ -> [\w/]+\)")
TO_COPY = torch.ops.aten._to_copy.default


@pytest.fixture(scope="module")
def built():
    """(model, mode) -> (compiled graph, engine, build log), built on first use."""
    cache = {}
    backend = OnnxRuntimeBackend()

    def get(model: str, mode: str):
        if (model, mode) not in cache:
            compiled = compile_for_mode(models.load(model), mode, None)
            engine, log = backend.build(compiled, BuildConfig(mode), None)
            cache[model, mode] = (compiled, engine, log)
        return cache[model, mode]

    return get


def max_error(engine, compiled) -> tuple[float, float]:
    reference = compiled(*compiled.example_inputs)
    output = engine(*compiled.example_inputs)
    assert output.dtype == reference.dtype and output.shape == reference.shape
    error = (output.double() - reference.double()).abs().max().item()
    return error, reference.abs().max().item()


def test_fp32_engine_matches_the_typed_graph(built):
    compiled, engine, _ = built("lenet", "fp32")
    error, scale = max_error(engine, compiled)
    assert error <= 1e-5 * scale


@pytest.mark.parametrize("model", ["lenet", "transformer"])
def test_autocast_fp16_engine_matches_the_typed_graph_to_fp16_accuracy(built, model):
    compiled, engine, _ = built(model, "autocast-fp16")
    error, scale = max_error(engine, compiled)
    assert error <= 4 * FP16_ULP * scale
    # Not trivially equal to an fp32 run: the fp16 graph really rounds somewhere.
    with torch.inference_mode():
        fp32_out = models.load(model).module(*compiled.example_inputs)
    out = engine(*compiled.example_inputs)
    assert not torch.equal(out, fp32_out)


def test_engine_model_holds_exactly_the_compiler_casts(built, tmp_path):
    compiled, engine, log = built("lenet", "autocast-fp16")
    fx_casts = [n for n in compiled.graph_module.graph.nodes if n.target is TO_COPY]
    engine.save(tmp_path / "engine")
    model = onnx.load(tmp_path / "engine" / MODEL_FILE)
    assert sum(n.op_type == "Cast" for n in model.graph.node) == len(fx_casts) == 2
    assert {c.node for c in engine.record.casts} == {n.name for n in fx_casts}
    assert f"{len(fx_casts)} cast(s) placed by the compiler, 0 by the exporter" in log.messages[0]


def test_executed_precision_changes_are_reported(built, tmp_path):
    """Every layer that runs in another dtype than the ONNX states is named in the build log."""
    _, engine, log = built("lenet", "autocast-fp16")
    engine.save(tmp_path / "engine")
    model = onnx.shape_inference.infer_shapes(onnx.load(tmp_path / "engine" / MODEL_FILE))
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.output)}
    names = {1: "fp32", 10: "fp16"}
    stated = {n.name: tuple(names[types[o]] for o in n.output) for n in model.graph.node}
    changed = [
        layer.name
        for layer in engine.layers()
        if layer.layer_type != "Cast" and layer.name in stated and layer.output_dtypes != stated[layer.name]
    ]
    listed = {m["name"] for note in log.messages for m in NOTED_NODE.finditer(note)}
    assert listed == set(changed)
    assert all(layer.tactic == TACTIC for layer in engine.layers())


def test_save_and_load_runs_bit_identically(built, tmp_path):
    compiled, engine, _ = built("lenet", "autocast-fp16")
    engine.save(tmp_path / "engine")
    loaded = OnnxRuntimeBackend().load(tmp_path / "engine")
    assert loaded.fingerprint() == engine.fingerprint()
    assert loaded.layers() == engine.layers()
    assert loaded.weights_digest() == engine.weights_digest()
    assert loaded.weight_bytes_by_dtype() == engine.weight_bytes_by_dtype()
    for a, b in zip(loaded(*compiled.example_inputs), engine(*compiled.example_inputs), strict=True):
        assert bits_equal(a, b)


def test_weight_bytes_match_the_typed_graph_weights(built):
    compiled, engine, _ = built("lenet", "autocast-fp16")
    gm = compiled.graph_module
    expected: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            name = {torch.float32: "fp32", torch.float16: "fp16"}[t.dtype]
            expected[name] = expected.get(name, 0) + t.numel() * t.element_size()
    sizes = engine.weight_bytes_by_dtype()
    # Plus the int64 shape constant of the flatten (Reshape) node.
    assert {k: v for k, v in sizes.items() if k != "int64"} == expected


def test_a_modified_plan_or_model_is_refused_on_load(built, tmp_path):
    _, engine, _ = built("lenet", "fp32")
    engine.save(tmp_path / "good")
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "good", edited)
    plan = json.loads((edited / PLAN_FILE).read_text())
    plan["session"]["intra_op_num_threads"] += 1
    (edited / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(HarnessError, match="fingerprint mismatch"):
        OnnxRuntimeEngine.load(edited)
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "good", damaged)
    with open(damaged / MODEL_FILE, "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(HarnessError, match="digest does not match"):
        OnnxRuntimeEngine.load(damaged)


def test_wrong_inputs_are_refused(built):
    compiled, engine, _ = built("lenet", "fp32")
    (x,) = compiled.example_inputs
    with pytest.raises(HarnessError, match=r"input 'x': expected fp32 \(8, 1, 28, 28\), got fp16"):
        engine(x.half())
    with pytest.raises(HarnessError, match="takes 1 input"):
        engine(x, x)


def test_bf16_modes_are_refused_up_front_and_bf16_layers_name_op_and_dtype(tmp_path):
    backend = OnnxRuntimeBackend()
    assert not [m for m in backend.supported_modes() if "bf16" in m]
    with pytest.raises(HarnessError, match="cannot build autocast-bf16: ONNX Runtime has almost no bf16"):
        backend.check_mode("autocast-bf16")
    explicit = tmp_path / "explicit.json"
    explicit.write_text('{"^conv2d$": "bf16"}')
    compiled = compile_for_mode(models.load("lenet"), "explicit", str(explicit))
    with pytest.raises(HarnessError, match=r"no kernel for Conv .*\(bf16, bf16, bf16\).*'conv2d'"):
        backend.build(compiled, BuildConfig("explicit", explicit_path=str(explicit)), None)


def test_weak_modes_are_refused_with_the_reason():
    backend = OnnxRuntimeBackend()
    assert "weak-fp16" not in backend.supported_modes()
    assert "autocast-fp16" in backend.supported_modes()
    with pytest.raises(HarnessError, match="never times kernels.*autocast-fp16"):
        backend.check_mode("weak-fp16")


def test_options_are_validated_and_recorded():
    backend = OnnxRuntimeBackend()
    options = {"graph_optimization_level": "all", "intra_op_num_threads": 2}
    provenance = backend.provenance(BuildConfig("fp32", options=options))
    assert provenance.backend == "onnxruntime"
    assert provenance.builder_options == {"mode": "fp32", "provider": "CPUExecutionProvider", **options, "autocast": None}
    with pytest.raises(HarnessError, match="unknown onnxruntime builder option.*valid: graph_optimization_level"):
        backend.provenance(BuildConfig("fp32", options={"tf32": True}))
    with pytest.raises(HarnessError, match="graph_optimization_level='max'"):
        backend.provenance(BuildConfig("fp32", options={"graph_optimization_level": "max"}))


@pytest.mark.parametrize("model", ["lenet", "digits", "transformer"])
def test_fp32_engine_model_holds_no_cast(built, model):
    """fp32 needs no conversion anywhere: a Cast would cost time and is no part of the typed graph."""
    _, engine, _ = built(model, "fp32")
    exported = onnx.load_from_string(engine.files()[MODEL_FILE])
    assert [n.name for n in exported.graph.node if n.op_type == "Cast"] == []
    assert engine.record.casts == ()


def test_session_runs_with_the_settings_the_engine_records():
    """ORT_ENABLE_ALL and the build's threads by default (plain ONNX Runtime's speed); basic on request."""
    import onnxruntime as ort

    _, engine, _ = _build_lenet_fp32({})
    options = engine.session_options()
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 1
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert engine.record.settings.to_json() == {"graph_optimization_level": "all", "intra_op_num_threads": 1}
    _, basic, _ = _build_lenet_fp32({"graph_optimization_level": "basic", "intra_op_num_threads": 2})
    assert basic.session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert basic.session_options().intra_op_num_threads == 2
    assert basic.fingerprint() != engine.fingerprint()
    assert {layer.layer_type for layer in engine.layers()} != {layer.layer_type for layer in basic.layers()}


def _build_lenet_fp32(options):
    compiled = compile_for_mode(models.load("lenet"), "fp32", None)
    engine, log = OnnxRuntimeBackend().build(compiled, BuildConfig("fp32", threads=1, options=options), None)
    return compiled, engine, log


@pytest.mark.slow  # builds and loads ONNX Runtime sessions of two models
@pytest.mark.parametrize(("model", "mode"), [("lenet", "autocast-fp16"), ("mobilenet", "fp32")])
def test_layers_and_fingerprint_are_the_same_in_every_session(built, model, mode):
    """ORT numbers the nodes its NCHWc transformer adds (``ReorderOutput_token_<n>``, on x86 CPUs)
    in an order that changes per session; the engine's layer names must not."""
    _, engine, _ = built(model, mode)
    model_bytes = engine.files()[MODEL_FILE]
    for _ in range(4):
        again = OnnxRuntimeEngine(model_bytes, engine.record)
        assert again.layers() == engine.layers() and again.fingerprint() == engine.fingerprint()


def test_layers_do_not_depend_on_the_order_or_numbering_ort_gives_its_nodes(built):
    """mobilenet's executed graph put its squeeze-excite pooling before or after the reorder of
    the branch it rescales, depending on the session (a saved engine then failed to load with
    "fingerprint mismatch"). Another valid order of the same nodes, with ORT's token numbers
    dealt out again, must give the same layers."""
    compiled, engine, _ = built("mobilenet", "fp32")
    model = onnx.load_from_string(engine.files()[MODEL_FILE])
    _, executed = _open_session(engine.files()[MODEL_FILE], model, engine.record.settings)
    nodes = list(executed.graph.node)
    assert any(_TOKEN.search(n.name) for n in nodes)
    produced = {v: k for k, n in enumerate(nodes) for v in n.output}
    placed: list[int] = []
    while len(placed) < len(nodes):  # of the nodes ready, always the last one: another topological order
        ready = [
            k
            for k, n in enumerate(nodes)
            if k not in placed and all(produced.get(v) in placed for v in n.input if v in produced)
        ]
        placed.append(ready[-1])
    assert placed != sorted(placed)
    numbers = iter(range(900, 2000))
    reordered = onnx.ModelProto()
    reordered.CopyFrom(executed)
    del reordered.graph.node[:]
    for k in placed:
        node = reordered.graph.node.add()
        node.CopyFrom(nodes[k])
        node.name = _TOKEN.sub(lambda _: f"_token_{next(numbers)}", node.name)
    assert [layer.to_json() for layer in _layers(reordered, model, _value_dtypes(reordered))] == [
        layer.to_json() for layer in engine.layers()
    ]
    assert len({layer.name for layer in engine.layers()}) == len(nodes)


def test_inputs_numpy_cannot_view_run_like_plain_ones(built):
    compiled, engine, _ = built("lenet", "fp32")
    (x,) = compiled.example_inputs
    expected = engine(x)
    strided = x.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    assert not strided.is_contiguous()
    assert bits_equal(engine(strided), expected)
    assert bits_equal(engine(x.clone().requires_grad_()), expected)
    with pytest.raises(HarnessError, match="expected a tensor, got list"):
        engine([1.0])
