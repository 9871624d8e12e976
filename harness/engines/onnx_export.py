"""Hand a typed graph to ONNX with exactly the casts the autocast compiler placed.

ONNX is the hand-off to TensorRT (and to ONNX Runtime, which runs the same
file): the engine follows the types written in it, so the file must hold one
``Cast`` per compiler cast (an ``aten._to_copy`` node of the typed graph),
none removed and none merged, and every weight in the dtype the compiler
converted it to.

The graph goes through ``torch.onnx.export(dynamo=True)``; the TorchScript
exporter cannot translate ``aten._to_copy`` at all. The exporter's own
optimizer is *not* used: its rewrite rules fuse patterns across types (it
folds an fp32 BatchNormalization into an fp16 Conv, leaving a Conv with mixed
input types). Instead the graph gets only semantics-preserving clean-up:
function inlining, constant folding that never touches a compiler cast or a
weight, and dead-node removal.

Casts are attributed through PyTorch's node provenance (``from_node``): every
ONNX node knows the FX node of the re-exported program it was translated
from, and that node knows which node of the typed graph it came from. ONNX
nodes are renamed after those typed-graph nodes (``conv2d``, ``x_fp16``;
``gelu/Erf`` when one FX node became several ONNX nodes), so TensorRT's layer
names and build log speak the compiler's names. A ``Cast`` whose origin is
not a compiler cast was placed by the exporter; the known sources are
implicit type promotion (``aten.add(fp32, bf16)`` runs in fp32 in PyTorch,
while ONNX ``Add`` needs equal types), as in AMP graphs, and batch norms (or
layer norms with computed parameters) with fp32 parameters under a
low-precision input (:func:`_widen_mixed_norms`). Those are recorded
separately, not hidden. A layer norm whose fp32 scale and bias are weights is
written all in its input's dtype instead (:func:`_narrow_mixed_layer_norms`),
as ModelOpt AutoCast writes it: runtimes normalize a low-precision
``LayerNormalization`` in fp32 inside the kernel, so a Cast pair around it
only moves data.

Opset: the newest that the exporter, the ``onnx`` package and ONNX Runtime
(when installed) all support, at most :data:`MAX_OPSET` (the newest TensorRT's
parser reads) and at least :data:`BF16_OPSET` (ONNX types ``Conv``, ``MaxPool``
and the other pooling ops in bf16 only from 22; ``Gelu`` is one node from 20).
Shapes are static (the example inputs' shapes); the engines are built for them.
With ``batch_dim`` (TensorRT's one engine for a batch sweep) that dimension of
every input is dynamic instead (``-1`` in the recorded :class:`TensorSpec`);
a typed graph that fixes the batch size (a reshape to a constant shape, as
models exported at one batch size often hold) cannot have one and is refused
with :class:`StaticBatchError`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol, runtime_checkable

import onnx
import onnx.numpy_helper
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
import torch
from onnxscript.optimizer import fold_constants_ir
from pydantic import Field
from pydantic import dataclasses as pydantic_dataclasses

from harness.documents import DOCUMENT, OneOf
from harness.dtypes import DTYPES, FLOAT_DTYPES, dtype_from_name, dtype_label, dtype_name
from harness.errors import HarnessError, StaticBatchError
from harness.fileio import atomic_write_bytes, canonical_json
from harness.naming import fresh_name

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph

MAX_OPSET = 21
BF16_OPSET = 22
# Cast to bfloat16 exists from 13; the exporter's translations target 18.
MIN_OPSET = 18
COMPILER = "compiler"
EXPORTER = "exporter"

# ONNX TensorProto element types -> torch dtypes (named by harness.dtypes).
_TORCH_BY_ONNX = {
    int(ir.DataType.FLOAT): torch.float32,
    int(ir.DataType.FLOAT16): torch.float16,
    int(ir.DataType.BFLOAT16): torch.bfloat16,
    int(ir.DataType.DOUBLE): torch.float64,
    int(ir.DataType.INT64): torch.int64,
    int(ir.DataType.INT32): torch.int32,
    int(ir.DataType.INT16): torch.int16,
    int(ir.DataType.INT8): torch.int8,
    int(ir.DataType.UINT8): torch.uint8,
    int(ir.DataType.BOOL): torch.bool,
}
assert set(_TORCH_BY_ONNX.values()) == set(DTYPES.values()), "one ONNX element type per engine dtype"


def onnx_dtype_name(elem_type: int) -> str:
    """Short name ("fp16", "int64", ...) of an ONNX element type; unknown types keep ONNX's name."""
    dtype = _TORCH_BY_ONNX.get(int(elem_type))
    return dtype_name(dtype) if dtype is not None else ir.DataType(elem_type).name.lower()


# A dimension the engine takes at run time (the batch axis of a dynamic-batch export).
DYNAMIC = -1


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class TensorSpec:
    """A graph input or output of the exported model (:data:`DYNAMIC` for a run-time dimension).

    Engine plans store it as it is declared (its class is the schema of their ``inputs`` and
    ``outputs``).
    """

    name: Annotated[str, Field(min_length=1)]
    dtype: Annotated[str, Field(min_length=1)]
    shape: tuple[Annotated[int, Field(ge=DYNAMIC)], ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class CastRecord:
    """One ``Cast`` node of the ONNX model and who put it there (as engine plans store it)."""

    node: str
    origin: str | None  # the typed-graph FX node it was translated from
    source: str
    target: str
    placed_by: Annotated[str, OneOf((COMPILER, EXPORTER))]

    @property
    def float_to_float(self) -> bool:
        return self.source in FLOAT_DTYPES and self.target in FLOAT_DTYPES


def check_inputs(
    inputs: tuple[torch.Tensor, ...], specs: tuple[TensorSpec, ...], where: str
) -> None:
    """Refuse inputs whose count, dtype or shape differ from what the engine was built for."""
    if len(inputs) != len(specs):
        raise HarnessError(f"{where} takes {len(specs)} input(s), got {len(inputs)}")
    for tensor, spec in zip(inputs, specs, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise HarnessError(f"{where} input {spec.name!r}: expected a tensor, got {type(tensor).__name__}")
        got = (dtype_label(tensor.dtype), tuple(tensor.shape))
        shape = tuple(g if d == DYNAMIC else d for d, g in zip(spec.shape, got[1], strict=False))
        if got != (spec.dtype, shape) or len(got[1]) != len(spec.shape):
            raise HarnessError(
                f"{where} input {spec.name!r}: expected {spec.dtype} {spec.shape}, got {got[0]} {got[1]}"
            )


@dataclass(frozen=True)
class OnnxExport:
    """The exported file and what a reader needs to trust it."""

    path: Path
    opset: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    initializers: dict[str, str]  # name -> dtype
    # layer norm weights written in their input's dtype: typed-graph name -> initializer name
    narrowed: dict[str, str] = field(default_factory=dict)

    @property
    def cast_count(self) -> int:
        return len(self.casts)

    @property
    def compiler_casts(self) -> tuple[CastRecord, ...]:
        return tuple(c for c in self.casts if c.placed_by == COMPILER)

    @property
    def exporter_casts(self) -> tuple[CastRecord, ...]:
        return tuple(c for c in self.casts if c.placed_by == EXPORTER)


def initializers_digest(model: onnx.ModelProto) -> str:
    """Digest of the weights (name, type, shape, bytes), independent of their order in the file."""
    h = hashlib.sha256()
    for tensor in sorted(model.graph.initializer, key=lambda t: t.name):
        h.update(canonical_json([tensor.name, tensor.data_type, list(tensor.dims)]))
        h.update(_tensor_bytes(tensor))
    return "sha256:" + h.hexdigest()


def initializer_bytes_by_dtype(model: onnx.ModelProto) -> dict[str, int]:
    sizes: dict[str, int] = defaultdict(int)
    for tensor in model.graph.initializer:
        sizes[onnx_dtype_name(tensor.data_type)] += len(_tensor_bytes(tensor))
    return dict(sizes)


def _tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    return tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()


def compiler_casts(gm: torch.fx.GraphModule) -> dict[str, torch.dtype]:
    """The casts the compiler placed: ``aten._to_copy`` node name -> target dtype."""
    return {
        node.name: node.kwargs["dtype"]
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is torch.ops.aten._to_copy.default
    }


@functools.cache
def newest_opset() -> int:
    """The newest default-domain opset the exporter, ``onnx`` and ONNX Runtime all take, at most :data:`MAX_OPSET`."""
    newest = min(MAX_OPSET, torch.onnx._constants.ONNX_MAX_OPSET, onnx.defs.onnx_opset_version())
    try:
        import onnxruntime
    except ImportError:
        return newest
    for opset in range(newest, MIN_OPSET - 1, -1):
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )  # fmt: skip
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=10)
        try:
            onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - ORT refuses an opset it does not know with its own error types
            continue
        return opset
    return MIN_OPSET


def default_opset(gm: torch.fx.GraphModule) -> int:
    """The opset a typed graph is exported at: :func:`newest_opset`, and never below :data:`BF16_OPSET` with bf16."""
    newest = newest_opset()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16:
            return max(newest, BF16_OPSET)
    if any(t.dtype == torch.bfloat16 for t in (*gm.parameters(), *gm.buffers())):
        return max(newest, BF16_OPSET)
    return newest


@runtime_checkable
class GivenModel(Protocol):
    """A user's ONNX file standing for the typed graph (:class:`~harness.engines.given_onnx.GivenOnnx`):
    it writes itself, as it is, where an export would be written."""

    def export(self, path: str | os.PathLike[str], *, batch_dim: int | None = None) -> OnnxExport: ...


def export_onnx(
    compiled: CompiledGraph,
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    batch_dim: int | None = None,
) -> OnnxExport:
    """Export ``compiled`` to ``path`` (written atomically) and check what was written.

    With ``batch_dim`` that dimension of every input is dynamic, and so is
    every output dimension that depends on it; the export is refused
    (:class:`StaticBatchError`) when the graph pins the batch size.

    Raises HarnessError when the exporter cannot translate the graph, when
    the result is not a valid ONNX model (e.g. an op with mixed input types
    that PyTorch accepted but ONNX does not), or when a compiler cast or a
    weight dtype did not survive the export.

    A user's ONNX file taken as given (:class:`~harness.engines.given_onnx.GivenOnnx`)
    is written as it is, its input shapes fixed.
    """
    if isinstance(compiled, GivenModel):
        return compiled.export(path, batch_dim=batch_dim)
    gm = compiled.graph_module
    bare = [n.name for n in gm.graph.nodes if n.op == "call_function" and not n.meta]
    if bare:
        # PyTorch records provenance only for nodes that carry metadata; without it
        # no ONNX node could be traced back to its cast.
        raise HarnessError(
            f"typed graph nodes {', '.join(bare)} carry no metadata (meta['val']); export_onnx "
            "takes graphs from harness.autocast.compile, which record it on every node"
        )
    placed = compiler_casts(gm)
    opset = default_opset(gm) if opset is None else opset
    if opset < MIN_OPSET:
        raise HarnessError(f"ONNX opset {opset} is too old; the exporter needs opset >= {MIN_OPSET}")
    output_count = _output_count(gm)
    model = _torch_export(compiled, opset, output_count, batch_dim)
    if batch_dim is not None:
        _check_dynamic_batch(model, batch_dim)
    origins = _origins(model.graph, id(gm.graph))
    weights = _weight_dtypes(gm)
    protected = {n for n, origin in origins.items() if n.op_type == "Cast" and origin in placed}
    _clean(model, protected, set(weights))
    names = _rename(model.graph, origins)
    narrowed = _narrow_mixed_layer_norms(model.graph)
    _drop_widening_pairs(model.graph, protected, model.opset_imports.get("", MIN_OPSET))
    _widen_mixed_norms(model.graph)
    _global_average_pools(model)
    proto = ir.to_proto(model)
    _check(proto, path)
    record = _record(model, Path(path), opset, names, placed, narrowed, dynamic=batch_dim is not None)
    _verify(record, placed, {name: dtype for name, dtype in weights.items() if name not in narrowed}, narrowed)
    atomic_write_bytes(path, proto.SerializeToString())
    return record


def _output_count(gm: torch.fx.GraphModule) -> int:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    return len(result) if isinstance(result, (tuple, list)) else 1


def _torch_export(compiled: CompiledGraph, opset: int, output_count: int, batch_dim: int | None) -> ir.Model:
    gm = compiled.graph_module
    input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    dynamic_shapes = None
    if batch_dim is not None:
        # One symbol for every input's batch axis: they are one batch. (torch.export keeps
        # a dimension symbolic only when the example's size is not 0 or 1.)
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({batch_dim: batch} for _ in compiled.example_inputs)
    try:
        # The typed graph must be traced as written: no ambient autocast.
        with torch.autocast("cpu", enabled=False), quiet_exporter(), _contiguous_weights(gm):
            program = torch.onnx.export(
                gm,
                tuple(compiled.example_inputs),
                dynamo=True,
                opset_version=opset,
                optimize=False,
                verbose=False,
                input_names=input_names,
                output_names=[f"output_{i}" for i in range(output_count)],
                dynamic_shapes=dynamic_shapes,
            )
    except torch.onnx.OnnxExporterError as exc:
        raise HarnessError(f"the typed graph cannot be exported to ONNX (opset {opset}): {exc}") from None
    assert program is not None, "the dynamo exporter always returns a program"
    return program.model


@contextlib.contextmanager
def _contiguous_weights(gm: torch.fx.GraphModule) -> Iterator[None]:
    """The graph's weights in contiguous layout while it is traced for export, given back after.

    The compiler stores convolution weights channels-last for PyTorch's and the
    CPU engine's kernels; traced with them, activations are channels-last too,
    and the exporter writes a layout-restoring ``as_strided`` (Reshape + Gather)
    after every global pooling. ONNX has no memory layout: the values are the
    same, and runtimes optimize the plain graph better.
    """
    changed = []
    for tensor in (*gm.parameters(), *gm.buffers()):
        if not tensor.is_contiguous():
            changed.append((tensor, tensor.data))
            tensor.data = tensor.data.contiguous()
    try:
        yield
    finally:
        for tensor, data in changed:
            tensor.data = data


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """Silence the exporter's progress chatter (deprecation notes, "torchvision is not installed")."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _origins(graph: ir.Graph, graph_id: int) -> dict[ir.Node, str | None]:
    """Each ONNX node -> name of the typed-graph FX node it was translated from (None: unknown)."""
    origins: dict[ir.Node, str | None] = {}
    for node in graph:
        fx_node = node.meta.get("node")
        stack = list(fx_node.meta.get("from_node", ())) if isinstance(fx_node, torch.fx.Node) else []
        origin = None
        while stack:
            source = stack.pop()
            if source.graph_id == graph_id:
                origin = source.name
                break
            stack.extend(source.from_node)
        origins[node] = origin
    return origins


def _weight_dtypes(gm: torch.fx.GraphModule) -> dict[str, torch.dtype]:
    """get_attr target -> dtype of the (already converted) tensor it reads."""
    weights: dict[str, torch.dtype] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                weights[str(node.target)] = value.dtype
    return weights


def _clean(model: ir.Model, protected: set[ir.Node], weight_names: set[str]) -> None:
    """Inline functions, fold constants and drop dead nodes; never touch casts or weights."""

    def should_fold(node: ir.Node) -> bool | None:
        if node in protected:
            return False
        if any(v is not None and v.name in weight_names for v in node.inputs):
            return False
        return None

    ir_passes.InlinePass()(model)
    fold_constants_ir(model, onnx_shape_inference=True, should_fold=should_fold)
    ir_passes.RemoveUnusedNodesPass()(model)
    ir_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    ir_passes.RemoveUnusedNodesPass()(model)
    ir_passes.RemoveUnusedOpsetsPass()(model)
    # Stack traces hold local file paths: the same graph must give the same bytes anywhere.
    ir_passes.ClearMetadataAndDocStringPass()(model)
    ir_passes.OutputFixPass()(model)
    ir_passes.NameFixPass()(model)


def _rename(graph: ir.Graph, origins: dict[ir.Node, str | None]) -> dict[str, str | None]:
    """Name ONNX nodes after their typed-graph origin; returns new name -> origin."""
    groups: dict[str, list[ir.Node]] = defaultdict(list)
    for node in graph:
        origin = origins.get(node)
        if origin is not None:
            groups[origin].append(node)
    taken = {node.name for node in graph if origins.get(node) is None}
    names: dict[str, str | None] = {}
    for node in graph:
        origin = origins.get(node)
        if origin is None:
            names[str(node.name)] = None
            continue
        group = groups[origin]
        if len(group) == 1:
            wanted = origin
        else:
            same_op = [n for n in group if n.op_type == node.op_type]
            index = same_op.index(node)
            wanted = f"{origin}/{node.op_type}" + (f"_{index}" if index else "")
        name = fresh_name(wanted, taken.__contains__, sep="#")
        node.name = name
        taken.add(name)
        names[name] = origin
    return names


def _narrow_mixed_layer_norms(graph: ir.Graph) -> dict[str, str]:
    """Write each layer norm with a low-precision input and fp32 weights all in the input's dtype.

    The compiler keeps a lowered layer norm's scale and bias fp32 (PyTorch's
    mixed kernel normalizes in fp32 and rounds once). ONNX types X, Scale and
    B alike; ONNX Runtime's and TensorRT's low-precision LayerNormalization
    compute their statistics in fp32 as well, so the weights are converted
    to the input's dtype (as ModelOpt AutoCast writes the node) instead of a
    Cast pair around an fp32 node. Returns each converted weight's name ->
    the name of its low-precision copy (the fp32 weight stays while anything
    else reads it).
    """
    narrowed: dict[str, str] = {}
    copies: dict[tuple[str, ir.DataType], ir.Value] = {}
    for node in list(graph):
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        x, params = node.inputs[0], [(i, v) for i, v in enumerate(node.inputs) if i > 0 and v is not None]
        if x is None or x.dtype is None or x.dtype not in _LOW_ONNX:
            continue
        wide = [(i, v) for i, v in params if v.dtype != x.dtype]
        if not wide or not all(v.name in graph.initializers and v.const_value is not None for _, v in wide):
            continue  # a computed scale: widened instead
        for i, value in wide:
            key = (str(value.name), x.dtype)
            if key not in copies:
                array = value.const_value.numpy().astype(x.dtype.numpy())  # type: ignore[union-attr]
                name = f"{value.name}_{onnx_dtype_name(int(x.dtype))}"
                copy = ir.Value(name=name, shape=value.shape, type=ir.TensorType(x.dtype), const_value=ir.tensor(array, name=name))
                graph.register_initializer(copy)
                copies[key] = copy
                narrowed[str(value.name)] = name
            node.replace_input_with(i, copies[key])
    for original in narrowed:
        value = graph.initializers[original]
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(original)
    return {name: copy for name, copy in narrowed.items() if name not in graph.initializers}


_LOW_ONNX = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _widening(node: ir.Node | None, protected: set[ir.Node]) -> bool:
    """An exporter ``Cast`` from a low precision to a wider float type."""
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node in protected:
        return False
    source, target = node.inputs[0], node.outputs[0]
    return source is not None and source.dtype in _LOW_ONNX and target.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _takes(node: ir.Node, dtype: ir.DataType, opset: int) -> bool:
    """Whether ONNX types ``node``'s op at ``opset`` for ``dtype`` (its first type constraint)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except onnx.defs.SchemaError:
        return False
    wanted = f"tensor({dtype.name.lower()})"
    return bool(schema.type_constraints) and wanted in schema.type_constraints[0].allowed_type_strs


def _drop_widening_pairs(graph: ir.Graph, protected: set[ir.Node], opset: int) -> None:
    """Remove the exporter's Cast pairs around one node that runs in the low precision anyway.

    PyTorch's decompositions compute some low-precision ops in fp32
    (``abs``, ``sum``, ``cumsum``, ``prod``: up, op, down); the typed graph
    put the op in the low precision, and ONNX types it there, so the node
    takes the low-precision inputs and gives its result in that type, as
    ModelOpt AutoCast writes it. A pair is dropped only when every floating
    input comes through such a widening cast from one low type and every use
    of the single output is a cast back to it; the compiler's casts are never
    touched.
    """
    for node in list(graph):
        if node.op_type == "Cast" or len(node.outputs) != 1:
            continue
        widened = [(i, v) for i, v in enumerate(node.inputs) if v is not None and v.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)]
        ups = [v.producer() for _, v in widened]
        if not widened or not all(_widening(up, protected) for up in ups):
            continue
        lows = {up.inputs[0].dtype for up in ups if up is not None and up.inputs[0] is not None}
        out = node.outputs[0]
        downs = [use.node for use in out.uses()]
        if len(lows) != 1 or not downs or out.is_graph_output():
            continue
        (low,) = lows
        if low is None:
            continue
        back = all(
            d.op_type == "Cast" and d not in protected and d.attributes["to"].as_int() == int(low) for d in downs
        )
        if not back or not _takes(node, low, opset):
            continue
        for (i, _), up in zip(widened, ups, strict=True):
            assert up is not None
            node.replace_input_with(i, up.inputs[0])
        out.dtype = low
        for down in downs:
            down.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
            if down.outputs[0].is_graph_output():
                continue
            graph.remove(down, safe=True)
        for up in {u for u in ups if u is not None}:
            if not up.outputs[0].uses():
                graph.remove(up, safe=True)

# Normalizations the exporter widens when their input and scale dtypes differ.
_NORMALIZATIONS = ("LayerNormalization", "BatchNormalization")


def _widen_mixed_norms(graph: ir.Graph) -> None:
    """Run each normalization whose input and scale dtypes differ in the scale's dtype.

    The compiler keeps normalization parameters in fp32 under a low-precision
    input, as PyTorch's mixed layer norm and batch norm allow: they normalize
    in fp32 and round the result to the input's dtype once. ONNX types X,
    Scale and B of LayerNormalization alike, and runtimes read
    BatchNormalization that way too (OpenVINO refuses mixed types: "Input
    element types do not match"), so the exporter writes exactly that
    computation with two casts of its own (recorded as exporter casts): X up
    to the scale's dtype, Y back.
    """
    taken: set[str | None] = {node.name for node in graph}
    for node in list(graph):
        if node.op_type not in _NORMALIZATIONS or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            continue
        x, scale = node.inputs[0], node.inputs[1]
        if x is None or scale is None or x.dtype is None or scale.dtype is None or x.dtype == scale.dtype:
            continue
        narrow, wide = x.dtype, scale.dtype
        cast_in = ir.Node("", "Cast", [x], [ir.AttrInt64("to", int(wide))], name=fresh_name(f"{node.name}/Cast_input", taken.__contains__, sep="#"))
        taken.add(cast_in.name)
        cast_in.outputs[0].name = f"{cast_in.name}:0"
        cast_in.outputs[0].dtype, cast_in.outputs[0].shape = wide, x.shape
        graph.insert_before(node, cast_in)
        node.replace_input_with(0, cast_in.outputs[0])
        y = node.outputs[0]
        # Consumers (and a graph output) keep the narrow value under its name;
        # the layer norm now produces a new wide value feeding the cast.
        narrow_y = ir.Value(name=y.name, shape=y.shape)
        narrow_y.dtype = narrow
        y.replace_all_uses_with(narrow_y, replace_graph_outputs=True)
        y.name, y.dtype = f"{y.name}:{wide.name.lower()}", wide
        cast_out = ir.Node(
            "", "Cast", [y], [ir.AttrInt64("to", int(narrow))], outputs=[narrow_y],
            name=fresh_name(f"{node.name}/Cast_output", taken.__contains__, sep="#"),
        )
        taken.add(cast_out.name)
        graph.insert_after(node, cast_out)


# GlobalAveragePool's types: float16, float and double, and bfloat16 from opset 22.
_POOL_TYPES = {ir.DataType.FLOAT16: 1, ir.DataType.FLOAT: 1, ir.DataType.DOUBLE: 1, ir.DataType.BFLOAT16: 22}


def _global_average_pools(model: ir.Model) -> None:
    """Write each mean over the spatial axes of an NCHW tensor as the GlobalAveragePool it is.

    The exporter translates ``adaptive_avg_pool2d(x, 1)`` (a squeeze-excite
    block's pooling) to ``ReduceMean``: the same function, but ONNX Runtime's
    NCHWc layout pass only keeps GlobalAveragePool in its blocked layout, so
    each ReduceMean cost a reorder out of and back into it (on a
    MobileNetV3-like model: 8 more reorders than the same model exported by
    ``torch.onnx.export`` from eager, which writes GlobalAveragePool).
    TensorRT reads either as a reduction over the same axes.
    """
    opset = model.opset_imports.get("", MIN_OPSET)
    for node in list(model.graph):
        if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        x, axes = node.inputs
        keepdims = node.attributes.get("keepdims")
        if (
            x is None
            or axes is None
            or axes.const_value is None
            or x.shape is None
            or len(x.shape) != 4
            or x.dtype is None
            or opset < _POOL_TYPES.get(x.dtype, opset + 1)
            or (keepdims is not None and keepdims.as_int() != 1)
            or sorted(int(a) % 4 for a in axes.const_value.numpy().ravel()) != [2, 3]
        ):
            continue
        pool = ir.Node("", "GlobalAveragePool", [x], name=node.name)
        # The pool's output takes the mean's name, type, shape and consumers.
        ir.convenience.replace_nodes_and_values(model.graph, node, [node], [pool], node.outputs, pool.outputs)
        if not axes.uses() and axes.name is not None and axes.name in model.graph.initializers:
            model.graph.initializers.pop(axes.name)


def _check(proto: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    if proto.ByteSize() >= 2**31:
        raise HarnessError(
            f"ONNX model for {os.fspath(path)} exceeds protobuf's 2 GB limit; "
            "single-file export supports smaller models only"
        )
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise HarnessError(
            f"the exported ONNX model is invalid ({exc}). The typed graph holds an op that "
            "PyTorch accepts but ONNX does not type (e.g. mixed input dtypes); check the "
            "compiler's precision report for that node"
        ) from None


def _check_dynamic_batch(model: ir.Model, batch_dim: int) -> None:
    """Every input's ``batch_dim`` is dynamic, nothing else of it is (else StaticBatchError)."""
    for value in model.graph.inputs:
        shape = value.shape
        dims = list(shape) if shape is not None else []
        if len(dims) <= batch_dim or isinstance(dims[batch_dim], int):
            raise StaticBatchError(
                f"the typed graph fixes the batch size of input {value.name!r} (shape {dims}): an op "
                "depends on it (e.g. a reshape to a constant shape), so one engine cannot serve a batch sweep"
            )
        others = [i for i, d in enumerate(dims) if i != batch_dim and not isinstance(d, int)]
        if others:
            raise HarnessError(f"exported ONNX input {value.name!r} has dynamic dimension(s) {others} besides the batch")


def _tensor_spec(value: ir.Value, dynamic: bool = False) -> TensorSpec:
    if value.dtype is None or value.shape is None:
        raise HarnessError(f"exported ONNX value {value.name!r} has no known dtype or shape")
    dims = []
    for dim in value.shape:
        if not isinstance(dim, int):
            if not dynamic:
                raise HarnessError(f"exported ONNX value {value.name!r} has a dynamic dimension {dim}")
            dim = DYNAMIC
        dims.append(dim)
    return TensorSpec(str(value.name), onnx_dtype_name(int(value.dtype)), tuple(dims))


def _record(
    model: ir.Model,
    path: Path,
    opset: int,
    names: dict[str, str | None],
    placed: dict[str, torch.dtype],
    narrowed: dict[str, str],
    dynamic: bool = False,
) -> OnnxExport:
    graph = model.graph
    casts = []
    for node in graph:
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        origin = names.get(str(node.name))
        casts.append(
            CastRecord(
                node=str(node.name),
                origin=origin,
                source=onnx_dtype_name(int(source.dtype)) if source is not None and source.dtype else "?",
                target=onnx_dtype_name(node.attributes["to"].as_int()),
                placed_by=COMPILER if origin in placed else EXPORTER,
            )
        )
    initializers = {
        name: onnx_dtype_name(int(value.dtype))
        for name, value in graph.initializers.items()
        if value.dtype is not None
    }
    return OnnxExport(
        path=path,
        opset=opset,
        inputs=tuple(_tensor_spec(v, dynamic) for v in graph.inputs),
        outputs=tuple(_tensor_spec(v, dynamic) for v in graph.outputs),
        casts=tuple(casts),
        initializers=initializers,
        narrowed=narrowed,
    )


def _verify(
    record: OnnxExport,
    placed: dict[str, torch.dtype],
    weights: dict[str, torch.dtype],
    narrowed: dict[str, str] | None = None,
) -> None:
    """Every compiler cast exactly once with its dtype; every weight in its converted dtype.

    A weight ``narrowed`` for a layer norm is checked as its low-precision copy.
    """
    counts = Counter(c.origin for c in record.compiler_casts)
    problems = [f"cast {name} is missing" for name in placed if counts[name] == 0]
    problems += [f"cast {name} appears {n} times" for name, n in counts.items() if n > 1]
    problems += [
        f"cast {c.origin} converts to {c.target}, the compiler's to {dtype_name(placed[c.origin])}"
        for c in record.compiler_casts
        if c.origin is not None and c.target != dtype_name(placed[c.origin])
    ]
    for name in (narrowed or {}).values():
        if name not in record.initializers:
            problems.append(f"layer norm weight {name} is not an initializer")
    for name, dtype in weights.items():
        exported = record.initializers.get(name)
        if exported is None:
            problems.append(f"weight {name} is not an initializer")
        elif exported != dtype_name(dtype):
            problems.append(f"weight {name} is {exported}, the compiler converted it to {dtype_name(dtype)}")
    if problems:
        raise HarnessError(
            "the ONNX export does not hold the typed graph's precisions: " + "; ".join(problems)
        )


# What every backend that runs the exported file reports alike: the build notes
# on the hand-off and the graph its engine fingerprints cover.

LISTED = 12  # names shown per build note before "..."


def listed(names: list[str]) -> str:
    """The first :data:`LISTED` of ``names`` and a count of the rest: build notes stay one line."""
    shown = ", ".join(names[:LISTED])
    return shown + (f", ... ({len(names) - LISTED} more)" if len(names) > LISTED else "")


def export_notes(exported: OnnxExport) -> list[str]:
    """Build-log lines saying who placed the file's casts (exporter casts are listed, not hidden)."""
    notes = [
        f"ONNX opset {exported.opset}: {len(exported.compiler_casts)} cast(s) placed by the compiler, "
        f"{len(exported.exporter_casts)} by the exporter"
    ]
    if exported.exporter_casts:
        names = listed([f"{c.node} ({c.source}->{c.target})" for c in exported.exporter_casts])
        notes.append(f"exporter casts make PyTorch's implicit type promotion explicit: {names}")
    return notes


def graph_description(model: onnx.ModelProto) -> dict[str, Any]:
    """The model's graph without weight values: what engine fingerprints cover.

    Weights are left out (a fingerprint names the plan, not its values); the
    saved model's digest guards them.
    """
    graph = model.graph

    def io(values: Any) -> list[Any]:
        return [[v.name, onnx.helper.printable_type(v.type)] for v in values]

    return {
        "opsets": sorted([o.domain, o.version] for o in model.opset_import),
        "inputs": io(graph.input),
        "outputs": io(graph.output),
        "initializers": sorted([t.name, t.data_type, list(t.dims)] for t in graph.initializer),
        "nodes": [
            [
                n.name,
                n.domain,
                n.op_type,
                list(n.input),
                list(n.output),
                sorted(onnx.helper.printable_attribute(a) for a in n.attribute),
            ]
            for n in graph.node
        ],
    }
