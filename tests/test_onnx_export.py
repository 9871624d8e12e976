"""The ONNX hand-off holds exactly the compiler's casts and weights, as a valid model.

References are independent of the exporter: cast nodes are counted in the
typed FX graph and in the ONNX file as written (``onnx.load``), weights are
compared byte for byte with the graph module's buffers, and the expected
implicit-promotion casts of an AMP graph are derived from the FX node dtypes.
"""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from harness import models
from harness.autocast import CompiledGraph
from harness.engines.modes import compile_for_mode
from harness.engines.onnx_export import (
    BF16_OPSET,
    COMPILER,
    EXPORTER,
    OnnxExport,
    export_onnx,
    newest_opset,
)
from harness.errors import HarnessError
from harness.outputs import OutputSpec

TO_COPY = torch.ops.aten._to_copy.default
ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}


def fx_casts(compiled: CompiledGraph) -> dict[str, torch.dtype]:
    return {
        n.name: n.kwargs["dtype"]
        for n in compiled.graph_module.graph.nodes
        if n.op == "call_function" and n.target is TO_COPY
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model, mode) -> (compiled graph, export record, loaded ONNX), built on first use."""
    cache: dict[tuple[str, str], tuple[CompiledGraph, OnnxExport, onnx.ModelProto]] = {}
    directory = tmp_path_factory.mktemp("onnx")

    def get(model: str, mode: str):
        if (model, mode) not in cache:
            compiled = compile_for_mode(models.load(model), mode, None)
            record = export_onnx(compiled, directory / f"{model}-{mode}.onnx")
            cache[model, mode] = (compiled, record, onnx.load(record.path))
        return cache[model, mode]

    return get


RULE_GRAPHS = [(m, d) for m in ("lenet", "resnet", "transformer") for d in ("autocast-fp16", "autocast-bf16")]


@pytest.mark.parametrize(("model", "mode"), RULE_GRAPHS)
def test_onnx_holds_exactly_the_compiler_casts(exported, model, mode):
    compiled, record, proto = exported(model, mode)
    placed = fx_casts(compiled)
    assert placed, "the rule-mode graph should contain casts (input to low, output back to fp32)"
    mixed = mixed_layer_norms(compiled)
    casts = [n for n in proto.graph.node if n.op_type == "Cast"]
    assert len(casts) == len(placed) == record.cast_count
    # One ONNX Cast per compiler cast, named after it and converting to the same dtype.
    assert {n.name: n.attribute[0].i for n in casts if n.name in placed} == {
        name: ONNX_TYPES[dtype] for name, dtype in placed.items()
    }
    assert [c.origin for c in record.compiler_casts] == [c.node for c in record.compiler_casts]
    assert len(record.compiler_casts) == len(placed)
    # A mixed layer norm takes its weights in its input's dtype (as ModelOpt writes it): no cast pair.
    assert not record.exporter_casts
    norms = {n.name: n for n in proto.graph.node if n.op_type == "LayerNormalization"}
    initializers = {t.name: t.data_type for t in proto.graph.initializer}
    for name, (low, _) in mixed.items():
        assert {initializers[i] for i in norms[name].input[1:] if i} == {ONNX_TYPES[DTYPES[low]]}, name
    assert all(c.float_to_float for c in record.casts)
    onnx.checker.check_model(proto, full_check=True)


SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = {v: k for k, v in SHORT.items()}


def mixed_layer_norms(compiled: CompiledGraph) -> dict[str, tuple[str, str]]:
    """FX layer norms whose input dtype differs from their weight's: name -> (input, weight) dtype."""
    mixed = {}
    for node in compiled.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.layer_norm.default:
            x, weight = node.args[0].meta["val"].dtype, node.args[2].meta["val"].dtype
            if x != weight:
                mixed[node.name] = (SHORT[x], SHORT[weight])
    return mixed


@pytest.mark.parametrize(("model", "mode"), RULE_GRAPHS)
def test_weights_are_initializers_in_their_converted_dtypes(exported, model, mode):
    compiled, record, proto = exported(model, mode)
    gm = compiled.graph_module
    initializers = {t.name: t for t in proto.graph.initializer}
    weights = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert weights
    low = {"autocast-fp16": torch.float16, "autocast-bf16": torch.bfloat16}[mode]
    for name in weights:
        tensor = getattr(gm, name)
        if name in record.narrowed:  # a mixed layer norm's weight, in its input's dtype
            name, tensor = record.narrowed[name], tensor.to(low)
        init = initializers[name]
        assert init.data_type == ONNX_TYPES[tensor.dtype], name
        assert list(init.dims) == list(tensor.shape), name
        assert init.raw_data == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert record.initializers[name] == SHORT[tensor.dtype]


def test_the_newest_opset_every_reader_takes_and_gelu_stays_one_node(exported):
    # GELU is one ONNX node from opset 20; below it, five rounded in the low precision.
    assert newest_opset() >= 20
    _, record, proto = exported("transformer", "autocast-fp16")
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    assert ops["Gelu"] == 2 and ops["Erf"] == 0, ops


@pytest.mark.parametrize(("mode", "opset"), [("autocast-fp16", None), ("autocast-bf16", BF16_OPSET)])
def test_opset_follows_the_graph_dtypes(exported, mode, opset):
    opset = opset if opset is not None else newest_opset()
    _, record, proto = exported("lenet", mode)
    assert record.opset == opset
    assert {o.domain: o.version for o in proto.opset_import}[""] == opset


def test_inputs_and_outputs_keep_the_public_dtypes(exported):
    compiled, record, proto = exported("transformer", "autocast-fp16")
    (example,) = compiled.example_inputs
    reference = compiled(*compiled.example_inputs)
    assert [(s.name, s.dtype, s.shape) for s in record.inputs] == [("ids", "int64", tuple(example.shape))]
    assert [(s.name, s.dtype, s.shape) for s in record.outputs] == [("output_0", "fp32", tuple(reference.shape))]
    assert [i.name for i in proto.graph.input] == ["ids"]


def test_onnx_nodes_carry_the_typed_graph_names(exported):
    compiled, _, proto = exported("lenet", "autocast-fp16")
    fx_names = {n.name for n in compiled.graph_module.graph.nodes if n.op == "call_function"}
    onnx_names = {n.name for n in proto.graph.node}
    # lenet's ops translate one to one, so every ONNX node is named after its FX node.
    assert onnx_names == fx_names


ELEMENTWISE = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor}


def implicit_promotions(compiled: CompiledGraph) -> collections.Counter[str]:
    """Per elementwise FX node: float inputs PyTorch promotes (dtype differs from the result).

    ONNX's elementwise ops need equal input types, so each such input needs a Cast.
    """
    counts: collections.Counter[str] = collections.Counter()
    for node in compiled.graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in ELEMENTWISE:
            continue
        out = node.meta["val"]
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype != out.dtype:
                counts[node.name] += 1
    return counts


def test_amp_graph_promotions_become_separately_recorded_exporter_casts(exported):
    # amp keeps layer norms fp32 while matmuls run low: the residual adds mix dtypes.
    compiled, record, proto = exported("transformer", "amp-fp16")
    expected = implicit_promotions(compiled)
    assert sum(expected.values()) > 0
    assert collections.Counter(c.origin for c in record.exporter_casts) == expected
    assert len(record.compiler_casts) == len(fx_casts(compiled))
    assert sum(n.op_type == "Cast" for n in proto.graph.node) == len(fx_casts(compiled)) + sum(expected.values())
    assert {c.placed_by for c in record.exporter_casts} == {EXPORTER}


def typed_graph(op: object, example: torch.Tensor, weight: torch.Tensor, cast_weight: bool) -> CompiledGraph:
    """A hand-written typed graph ``op(x', w')`` with one explicit cast (of ``w`` or of ``x``)."""
    root = nn.Module()
    root.register_buffer("w", weight)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("w")
    if cast_weight:
        w = graph.call_function(TO_COPY, (w,), {"dtype": torch.float16})
    else:
        x = graph.call_function(TO_COPY, (x,), {"dtype": torch.float16})
    graph.output((graph.call_function(op, (x, w)),))
    gm = torch.fx.GraphModule(root, graph)
    # meta["val"] on every node, as the compiler leaves it.
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(example)
    return CompiledGraph(gm, None, (example,), "explicit", torch.float16, OutputSpec.flat(1))  # type: ignore[arg-type]


def cast_of_constant() -> CompiledGraph:
    # The cast's input is a weight: constant folding would remove it if allowed.
    weight = torch.linspace(-1, 1, 12).reshape(4, 3)
    return typed_graph(torch.ops.aten.mm.default, torch.ones(2, 4, dtype=torch.float16), weight, cast_weight=True)


def test_a_cast_of_a_constant_is_not_folded_away(tmp_path):
    compiled = cast_of_constant()
    (cast,) = fx_casts(compiled)
    record = export_onnx(compiled, tmp_path / "m.onnx")
    proto = onnx.load(record.path)
    assert [(n.op_type, n.name) for n in proto.graph.node] == [("Cast", cast), ("MatMul", "mm_default")]
    assert [(c.origin, c.source, c.target, c.placed_by) for c in record.casts] == [(cast, "fp32", "fp16", COMPILER)]


def test_a_graph_onnx_cannot_type_is_refused_naming_the_node(tmp_path):
    # fp16 activations into an fp32 weight: PyTorch's tracer accepts it, ONNX's Gemm does not.
    compiled = typed_graph(torch.ops.aten.linear.default, torch.ones(2, 4), torch.ones(3, 4), cast_weight=False)
    with pytest.raises(HarnessError, match=r"invalid.*linear"):
        export_onnx(compiled, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_opset_older_than_the_exporter_supports_is_refused(tmp_path):
    with pytest.raises(HarnessError, match="opset 13"):
        export_onnx(cast_of_constant(), tmp_path / "m.onnx", opset=13)


def test_a_graph_without_node_metadata_is_refused(tmp_path):
    compiled = cast_of_constant()
    for node in compiled.graph_module.graph.nodes:
        node.meta.clear()
    with pytest.raises(HarnessError, match="carry no metadata"):
        export_onnx(compiled, tmp_path / "m.onnx")


def test_a_dynamic_batch_export_runs_every_batch_size_like_the_typed_graph(tmp_path):
    """TensorRT's one engine for a sweep needs a dynamic batch axis: the file keeps every compiler
    cast and computes, at each size, what the typed graph compiled for that size computes."""
    import onnxruntime as ort

    compiled = compile_for_mode(models.load("lenet", 4), "autocast-fp16", None)
    record = export_onnx(compiled, tmp_path / "m.onnx", batch_dim=0)
    assert [s.shape for s in record.inputs] == [(-1, 1, 28, 28)] and [s.shape for s in record.outputs] == [(-1, 10)]
    assert {c.origin for c in record.compiler_casts} == set(fx_casts(compiled))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for size in (1, 3, 8):
        spec = models.load("lenet", size)
        (out,) = session.run(None, {"x": spec.example_inputs[0].numpy()})
        expected = compile_for_mode(spec, "autocast-fp16", None)(*spec.example_inputs)
        assert out.shape == (size, 10)
        torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-3, rtol=1e-3)


def test_a_graph_that_fixes_its_batch_size_cannot_get_a_dynamic_batch_axis(tmp_path):
    from harness.errors import StaticBatchError

    compiled = compile_for_mode(models.load("transformer", 4), "fp32", None)
    with pytest.raises(StaticBatchError, match="the typed graph fixes the batch size of input 'ids'"):
        export_onnx(compiled, tmp_path / "m.onnx", batch_dim=0)
    assert not (tmp_path / "m.onnx").exists()


def test_inputs_are_checked_against_a_dynamic_batch_axis():
    from harness.engines.onnx_export import TensorSpec, check_inputs

    spec = (TensorSpec("x", "fp32", (-1, 4)),)
    check_inputs((torch.ones(3, 4),), spec, "engine")
    check_inputs((torch.ones(1, 4),), spec, "engine")
    for bad in (torch.ones(3, 5), torch.ones(3, 4, 1), torch.ones(3, 4, dtype=torch.float16)):
        with pytest.raises(HarnessError, match=r"engine input 'x': expected fp32 \(-1, 4\)"):
            check_inputs((bad,), spec, "engine")


class Means(nn.Module):
    """Means over the spatial axes with the shape kept (a pooling to 1x1), and two that are not."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pooled = nn.functional.adaptive_avg_pool2d(x, 1) + x.mean((-2, -1), keepdim=True)
        return pooled, x.mean((2, 3)), x.mean(1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mean_over_the_spatial_axes_is_written_as_global_average_pool(tmp_path, dtype):
    """ONNX Runtime keeps GlobalAveragePool in its blocked layout and reorders around a
    ReduceMean; the file must say GlobalAveragePool wherever that is the same function (bf16
    from opset 22) and compute what the typed graph computes."""
    import onnxruntime as ort

    from harness.autocast import compile

    x = torch.randn(2, 8, 5, 5, generator=torch.Generator().manual_seed(3))
    policy = ("fp32", None) if dtype == torch.float32 else ("full", dtype)
    compiled = compile(Means().eval(), (x,), policy=policy[0], low_precision_type=policy[1])
    record = export_onnx(compiled, tmp_path / "m.onnx")
    proto = onnx.load(record.path)
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    assert ops["GlobalAveragePool"] == 2 and ops["ReduceMean"] == 2
    pools = [n.name for n in proto.graph.node if n.op_type == "GlobalAveragePool"]
    assert pools[0].startswith("adaptive_avg_pool2d") and pools[1].startswith("mean")
    # No axes constant left behind for the pools.
    used = {i for n in proto.graph.node for i in n.input}
    assert all(init.name in used for init in proto.graph.initializer)
    if dtype == torch.float32:  # ONNX Runtime's CPU provider has no bf16 kernels
        session = ort.InferenceSession(str(record.path), providers=["CPUExecutionProvider"])
        got = session.run(None, {record.inputs[0].name: x.numpy()})
        for out, expected in zip(got, compiled(x), strict=True):
            torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-6, atol=1e-6)
