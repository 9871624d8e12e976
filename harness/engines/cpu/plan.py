"""The CPU engine's plan: a typed op graph with one chosen tactic per layer.

The plan is what the engine executes and what it saves (``plan.json`` next to
``weights.safetensors``). It must be self-contained, pickle-free and safe to
load from an untrusted file, so ops are stored by name (``aten::conv2d.default``)
and resolved through ``torch.ops.aten`` only when they are pure functions
(:func:`unrunnable_reason`); arguments are JSON with tagged objects for
references, weights, dtypes and non-finite floats. A loaded plan is checked
whole on fake tensors (:func:`check_on_fake_tensors`) before any kernel runs.

The plan's fingerprint is the digest of its canonical JSON (graph, dtypes,
tactic per layer, weight names/shapes/dtypes) without the weight values, which
have their own digest, so "same kernels" and "same weights" are separate facts.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
import torch.utils._pytree as pytree
from pydantic import Field
from pydantic import dataclasses as pydantic_dataclasses
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.documents import DOCUMENT, Digest, OneOf, document_json
from harness.dtypes import DTYPES, dtype_from_name, dtype_name
from harness.engines.protocol import LayerInfo, LayerRecord
from harness.engines.saved import PlanFormat, PlanHeader
from harness.errors import HarnessError, first_line
from harness.fileio import canonical_json, digest
from harness.opnames import is_plan_name, plan_name, plan_packet, resolve_op
from harness.outputs import OutputSpec
from harness.weights import weights_digest

PLAN_FORMAT = "harness-cpu-plan"
# 3: compiler_settings holds the settings themselves, not their digest;
# 4: layers may add a residual input to their result (Node.residual), more epilogues.
PLAN_VERSION = 4
WEIGHTS_FILE = "weights.safetensors"  # the plan's payload
# No tensor of a loaded plan may be larger (a crafted plan must not exhaust memory).
MAX_TENSOR_BYTES = 1 << 36
GETITEM = "builtin::getitem"
# Activations a convolution or GEMM layer may apply to its own result.
EPILOGUES = ("", "relu", "gelu", "gelu_tanh", "hardswish", "hardsigmoid")

# What a plan may name: any ATen op that is a pure function of its inputs.
# Refused: ops that write an argument or have an out= form (the engine's
# values are immutable), random ops (an engine is deterministic), and ops that
# address memory by raw strides or offsets without checks a plan can rely on
# (unchecked indexing, uninitialized or aliased memory); the fake-tensor check
# at load catches the rest.
_RAW_MEMORY_OPS = frozenset(
    """
    as_strided_ _reshape_alias set_ resize_
    resize_as_ _unsafe_index_put _unsafe_masked_index _unsafe_masked_index_put_accumulate
    from_file empty_strided new_empty_strided _efficientzerotensor
    """.split()
)
# Strided ops are allowed (the compiler's functionalization emits as_strided_scatter,
# models call x.as_strided) on two conditions a plan is checked for, at build and at
# load (check_strided_ops): they address a compact copy of their input, so the memory
# order is the value order whatever layout the producing layer's tactic chose; and
# every element they address lies inside that copy.
STRIDED_PACKETS = frozenset(("as_strided", "as_strided_copy", "as_strided_scatter"))
_CLONE = "aten::clone.default"
_CAST = "aten::_to_copy.default"

_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


@dataclass(frozen=True)
class Ref:
    """The output of another node, or a graph input."""

    name: str


@dataclass(frozen=True)
class WeightRef:
    """A tensor stored in the engine's weights."""

    name: str


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # short dtype name (harness.dtypes)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype))


@dataclass
class Node:
    """One op of the plan. Every node except a getitem is an engine layer."""

    name: str
    op: str  # "aten::<packet>.<overload>" or GETITEM
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[TensorMeta | None, ...]  # one per returned tensor
    multi: bool = False  # the op returns a tuple (consumed through getitem nodes)
    layer_type: str = ""
    key: str = ""
    tuned: bool = False  # the builder chose among several tactics (consulting the timing cache)
    tactic: str = ""
    tactic_hash: str = ""
    fused: tuple[str, ...] = ()  # graph nodes folded into this layer (conv + batch_norm + relu)
    epilogue: str = ""  # activation applied to the op's result inside the layer (EPILOGUES)
    # A tensor added to the op's result before the epilogue (a residual connection
    # folded into the convolution or GEMM producing the other summand).
    residual: Ref | None = None

    @property
    def is_layer(self) -> bool:
        return self.op != GETITEM

    def refs(self) -> list[Ref]:
        """Tensor inputs coming from other nodes, in argument order (one per occurrence),
        then the residual: the order a bound layer takes its inputs in."""
        refs = [a for a in iter_leaves((self.args, self.kwargs)) if isinstance(a, Ref)]
        return refs if self.residual is None else [*refs, self.residual]

    def map_refs(self, fn: Callable[[Ref], Ref]) -> None:
        """Replace every reference to another node (arguments and residual) by ``fn(ref)``, in ``refs()`` order."""

        def swap(leaf: Any) -> Any:
            return fn(leaf) if isinstance(leaf, Ref) else leaf

        self.args = map_leaves(self.args, swap)
        self.kwargs = map_leaves(self.kwargs, swap)
        if self.residual is not None:
            self.residual = fn(self.residual)

    def weight_refs(self) -> list[WeightRef]:
        return [a for a in iter_leaves((self.args, self.kwargs)) if isinstance(a, WeightRef)]

    def out(self) -> TensorMeta:
        meta = self.outputs[0] if self.outputs else None
        if self.multi or meta is None:
            raise HarnessError(
                f"layer {self.name!r} ({self.op}) must have exactly one tensor output"
            )
        return meta


@dataclass
class Plan:
    """A complete, typed engine graph. ``weights`` holds the tensors by name."""

    mode: str
    inputs: list[tuple[str, TensorMeta]]
    nodes: list[Node]
    outputs: list[Ref | WeightRef]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    # How the flat outputs nest in the model's return value (a flat tuple if not given).
    structure: OutputSpec | None = None
    # The autocast settings the graph was compiled under, as JSON (None: they did not apply).
    compiler_settings: dict[str, Any] | None = None

    @property
    def output_structure(self) -> OutputSpec:
        return self.structure if self.structure is not None else OutputSpec.flat(len(self.outputs))

    def layers(self) -> list[LayerInfo]:
        metas = self.value_metas()
        result = []
        for node in self._layer_nodes():
            ins = tuple(metas[r.name].dtype for r in node.refs())
            ins += tuple(dtype_name(self.weights[w.name].dtype) for w in node.weight_refs())
            outs = tuple(m.dtype for m in node.outputs if m is not None)
            # Like TensorRT's log, only autotuned layers name a key: the ones
            # `harness cache verify` checks against a cache.
            key = node.key if node.tuned else ""
            result.append(
                LayerInfo(node.name, node.layer_type, key, ins, outs, node.tactic, node.tactic_hash)
            )
        return result

    def _layer_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.is_layer]

    def value_metas(self) -> dict[str, TensorMeta]:
        """Metadata of every value a Ref can name (graph inputs and single-output nodes)."""
        metas = dict(self.inputs)
        for node in self.nodes:
            if not node.multi and node.outputs and node.outputs[0] is not None:
                metas[node.name] = node.outputs[0]
        return metas

    def body_json(self) -> dict[str, Any]:
        """Everything the fingerprint covers: the canonical plan without digests."""
        return {
            **PLAN.header(),
            "mode": self.mode,
            "inputs": [{"name": n, **m.to_json()} for n, m in self.inputs],
            "weights": [
                {"name": n, **TensorMeta.of(t).to_json()} for n, t in sorted(self.weights.items())
            ],
            "nodes": [_node_json(n) for n in self.nodes],
            "outputs": [encode_arg(o) for o in self.outputs],
            "output_structure": self.output_structure.to_json(),
            "compiler_settings": self.compiler_settings,
            "layers": [document_json(LayerRecord.of(layer, layer.key or None)) for layer in self.layers()],
        }

    def fingerprint(self) -> str:
        return digest(canonical_json(self.body_json()))

    def weights_digest(self) -> str:
        return weights_digest(self.weights)

    def to_json(self) -> dict[str, Any]:
        """The plan's ``plan.json`` (a :class:`CpuPlan`)."""
        body = self.body_json()
        return PLAN.dump({**body, "fingerprint": digest(canonical_json(body)), "weights_digest": self.weights_digest()})


def _is_value(obj: Any) -> bool:
    # pytree flattens None to nothing; in arguments it is a value (an omitted optional).
    return obj is None


def iter_leaves(obj: Any) -> list[Any]:
    """Leaves of nested args (lists, tuples, dict values), in order, None included: what
    ``pytree.tree_leaves`` gives with None a leaf. Plain lists, tuples and dicts are walked
    here, because a build asks for every node's references many times; their subclasses
    (torch.Size, named tuples) go to pytree."""
    leaves: list[Any] = []
    _collect_leaves(obj, leaves)
    return leaves


def _collect_leaves(obj: Any, leaves: list[Any]) -> None:
    kind = type(obj)
    if kind is list or kind is tuple:
        items: Iterable[Any] = obj
    elif kind is dict:
        items = obj.values()
    elif isinstance(obj, (list, tuple, dict)):
        leaves.extend(pytree.tree_leaves(obj, is_leaf=_is_value))
        return
    else:
        leaves.append(obj)
        return
    for item in items:  # a leaf is appended here, not in a call of its own
        if isinstance(item, (list, tuple, dict)):
            _collect_leaves(item, leaves)
        else:
            leaves.append(item)


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild nested args with ``fn`` applied to every leaf, None included (containers keep
    their types): ``pytree.tree_map`` with None a leaf, plain containers walked as in
    :func:`iter_leaves`."""
    kind = type(obj)
    if kind is list:
        return [map_leaves(item, fn) for item in obj]
    if kind is tuple:
        return tuple(map_leaves(item, fn) for item in obj)
    if kind is dict:
        return {key: map_leaves(item, fn) for key, item in obj.items()}
    if isinstance(obj, (list, tuple, dict)):
        return pytree.tree_map(fn, obj, is_leaf=_is_value)
    return fn(obj)


@functools.cache
def unrunnable_reason(op: torch._ops.OpOverload) -> str | None:
    """Why the engine may not run ``op`` (None when it may): see the rules above."""
    arguments = op._schema.arguments
    if op.namespace != "aten":
        return "only ATen ops can be stored in a plan"
    if any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
        return "it writes one of its arguments"
    if any(a.name == "out" for a in arguments):
        return "it is an out= variant"
    if torch.Tag.nondeterministic_seeded in op.tags and not _random_switch(op):
        return "it draws random numbers"
    if op.overloadpacket.__name__ in _RAW_MEMORY_OPS:
        return "it addresses memory through raw strides or offsets"
    return None


# Arguments that turn a random op (dropout, attention with dropout) into a
# deterministic one, and the value that does it.
_RANDOM_SWITCHES = {"dropout_p": 0.0, "train": False}


def _random_switch(op: torch._ops.OpOverload) -> str | None:
    names = [a.name for a in op._schema.arguments]
    return next((n for n in ("dropout_p", "train") if n in names), None)


def random_switch_off(op: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call of ``op`` draws no random numbers (always true for ops that never do)."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return True
    name = _random_switch(op)
    if name is None:
        return False
    arguments = op._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == name)
    if name in kwargs:
        value = kwargs[name]
    elif index < len(args):
        value = args[index]
    else:
        value = arguments[index].default_value
    return bool(value == _RANDOM_SWITCHES[name])


def runnable_op(op: str, where: str) -> Callable[..., Any]:
    """The function a plan's op name stands for, refusing names and ops a plan may not hold."""
    if op == GETITEM:
        return operator.getitem
    if not is_plan_name(op):
        raise HarnessError(
            f"{where}: op {op!r} is not an ATen op name (expected aten::<op>.<overload>)"
        )
    try:
        overload = resolve_op(op)
    except HarnessError:
        raise HarnessError(
            f"{where}: op {op!r} does not exist in this PyTorch ({torch.__version__})"
        ) from None
    reason = unrunnable_reason(overload)
    if reason is not None:
        raise HarnessError(f"{where}: op {op!r} cannot run in the CPU engine: {reason}")
    return overload


def plan_op_name(target: Any) -> str:
    """Plan name of an FX call_function target (:func:`harness.opnames.plan_name` for an op)."""
    if target is operator.getitem:
        return GETITEM
    if isinstance(target, torch._ops.OpOverload):
        return plan_name(target)
    return repr(target)


def encode_arg(value: Any) -> Any:
    """Python argument -> JSON; tagged objects keep references and torch enums apart."""
    if isinstance(value, Ref):
        return {"ref": value.name}
    if isinstance(value, WeightRef):
        return {"weight": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [encode_arg(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise HarnessError(
        f"argument {value!r} of type {type(value).__name__} cannot be stored in a plan"
    )


def decode_arg(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [decode_arg(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise HarnessError(f"{where}: malformed argument {value!r}")
    ((tag, payload),) = value.items()
    if not isinstance(payload, str):
        raise HarnessError(f"{where}: malformed argument {value!r}")
    if tag == "ref":
        return Ref(payload)
    if tag == "weight":
        return WeightRef(payload)
    if tag == "dtype":
        return dtype_from_name(payload)
    if tag == "float" and payload in ("inf", "-inf", "nan"):
        return float(payload)
    if tag == "device" and payload == "cpu":
        return torch.device("cpu")
    if tag == "layout" and payload == "strided":
        return torch.strided
    if tag == "memory_format" and payload in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[payload]
    raise HarnessError(f"{where}: unsupported argument {value!r}")


def _node_json(node: Node) -> dict[str, Any]:
    return {
        "name": node.name,
        "op": node.op,
        "args": [encode_arg(a) for a in node.args],
        "kwargs": {k: encode_arg(v) for k, v in node.kwargs.items()},
        "outputs": [None if m is None else m.to_json() for m in node.outputs],
        "multi": node.multi,
        "layer_type": node.layer_type,
        "key": node.key,
        "tuned": node.tuned,
        "tactic": node.tactic,
        "tactic_hash": node.tactic_hash,
        "fused": list(node.fused),
        "epilogue": node.epilogue,
        "residual": None if node.residual is None else encode_arg(node.residual),
    }


_Dtype = Annotated[str, OneOf(sorted(DTYPES))]
_Name = Annotated[str, Field(min_length=1)]


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class MetaRecord:
    """A :class:`TensorMeta` as a plan stores it."""

    shape: tuple[Annotated[int, Field(ge=0)], ...]
    dtype: _Dtype


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class _Named:
    name: _Name


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class NamedMetaRecord(MetaRecord, _Named):
    """A graph input or a weight: its name, then its :class:`MetaRecord` (see
    :class:`~harness.engines.saved.PlanHeader` on the order of fields)."""


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class RefRecord:
    """A :class:`Ref` as a node's ``residual``."""

    ref: str


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class NodeRecord:
    """A :class:`Node` as a plan stores it: arguments encoded by :func:`encode_arg` (read back,
    and checked, by :func:`decode_arg`)."""

    name: _Name
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[MetaRecord | None, ...]
    multi: bool
    layer_type: str
    key: str
    tuned: bool
    tactic: str
    tactic_hash: str
    fused: tuple[str, ...]
    epilogue: Annotated[str, OneOf(EPILOGUES)]
    residual: RefRecord | None


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class CpuPlan(PlanHeader):
    """A saved CPU engine's ``plan.json`` (:meth:`Plan.to_json`): the header, the graph (inputs,
    weights without their values, nodes, outputs as encoded arguments), the output structure,
    the autocast settings, the layers, the fingerprint of everything before it and the digest
    of the weights."""

    mode: str
    inputs: tuple[NamedMetaRecord, ...]
    weights: tuple[NamedMetaRecord, ...]
    nodes: tuple[NodeRecord, ...]
    outputs: Annotated[tuple[Any, ...], Field(min_length=1)]
    output_structure: str
    compiler_settings: dict[str, Any] | None
    layers: tuple[LayerRecord, ...]
    fingerprint: Digest
    weights_digest: Digest


PLAN = PlanFormat("cpu", PLAN_FORMAT, PLAN_VERSION, WEIGHTS_FILE, CpuPlan)


def _meta(record: MetaRecord) -> TensorMeta:
    return TensorMeta(record.shape, record.dtype)


def plan_from_saved(saved: CpuPlan, weights: dict[str, torch.Tensor], where: str) -> Plan:
    """Rebuild a plan from its saved form (:meth:`PlanFormat.load` of :data:`PLAN`) and its
    weights, checking every reference and op before use (a HarnessError naming ``where`` and the
    node)."""
    declared = {w.name: _meta(w) for w in saved.weights}
    actual = {n: TensorMeta.of(t) for n, t in weights.items()}
    if declared != actual:
        raise HarnessError(
            f"{where}: weights.safetensors does not hold the weights the plan declares"
        )
    inputs = [(i.name, _meta(i)) for i in saved.inputs]
    # value name -> the node producing it (None for graph inputs)
    known: dict[str, Node | None] = {name: None for name, _ in inputs}
    nodes = []
    for raw in saved.nodes:
        node_where = f"{where}: node {raw.name!r}"
        runnable_op(raw.op, node_where)
        node = Node(
            name=raw.name,
            op=raw.op,
            args=tuple(decode_arg(a, node_where) for a in raw.args),
            kwargs={k: decode_arg(v, node_where) for k, v in raw.kwargs.items()},
            outputs=tuple(None if m is None else _meta(m) for m in raw.outputs),
            multi=raw.multi,
            layer_type=raw.layer_type,
            key=raw.key,
            tuned=raw.tuned,
            tactic=raw.tactic,
            tactic_hash=raw.tactic_hash,
            fused=raw.fused,
            epilogue=raw.epilogue,
            residual=None if raw.residual is None else Ref(raw.residual.ref),
        )
        _check_node(node, known, declared, node_where)
        known[node.name] = node
        nodes.append(node)
    outputs_refs = [decode_arg(o, f"{where}: outputs") for o in saved.outputs]
    if not all(isinstance(o, (Ref, WeightRef)) for o in outputs_refs):
        raise HarnessError(f"{where}: every output must name a node, an input or a weight")
    _check_refs(outputs_refs, known, declared, f"{where}: outputs")
    structure = OutputSpec.from_json(saved.output_structure, where)
    if structure.count != len(outputs_refs):
        raise HarnessError(
            f"{where}: the output structure holds {structure.count} outputs, the plan {len(outputs_refs)}"
        )
    plan = Plan(saved.mode, inputs, nodes, outputs_refs, weights, structure, saved.compiler_settings)
    check_on_fake_tensors(plan, where)
    return plan


@contextmanager
def _fake_tensor_log_silenced() -> Iterator[None]:
    """Keep torch's fake-tensor logger quiet while an untrusted op runs on fake tensors.

    When an op's meta function refuses its arguments (a pooling kernel of 0),
    FakeTensorMode logs the whole traceback at ERROR level before raising; the
    user needs the one error the harness makes of the exception, as for
    ``torch.export`` (harness/frontend/export.py).
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = previous


def check_on_fake_tensors(plan: Plan, where: str) -> None:
    """Run the whole plan on fake tensors before any real kernel sees it.

    Every op's own argument checks run (a convolution stride of 0, a stride
    list of the wrong length, negative padding, mismatched shapes), nothing is
    computed and no memory is allocated, and every layer's declared output
    shape and dtype must be what its op really returns. A plan is untrusted
    input: without this, bad arguments would reach oneDNN's weight reorder at
    load time and kill the process.
    """
    for label, meta in [*plan.inputs, *((n.name, m) for n in plan.nodes for m in n.outputs if m)]:
        size = math.prod(meta.shape) * dtype_from_name(meta.dtype).itemsize
        if size > MAX_TENSOR_BYTES:
            raise HarnessError(
                f"{where}: tensor {label!r} of shape {list(meta.shape)} would take {size} bytes "
                f"(the limit is {MAX_TENSOR_BYTES})"
            )
    check_strided_ops(plan, where)
    mode = FakeTensorMode()
    with mode:
        env: dict[str, Any] = {
            name: torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype)) for name, meta in plan.inputs
        }
    fake_weights = {name: mode.from_tensor(t) for name, t in plan.weights.items()}

    def value(leaf: Any) -> Any:
        if isinstance(leaf, Ref):
            return env[leaf.name]
        if isinstance(leaf, WeightRef):
            return fake_weights[leaf.name]
        return leaf

    for node in plan.nodes:
        node_where = f"{where}: layer {node.name!r} ({node.op})"
        fn = runnable_op(node.op, node_where)
        if not random_switch_off(fn, node.args, node.kwargs):
            raise HarnessError(f"{node_where}: draws random numbers (dropout is on)")
        args, kwargs = map_leaves((node.args, node.kwargs), value)
        _check_strided_bounds(fn, node, args, kwargs, node_where)
        try:
            with mode, _fake_tensor_log_silenced():
                result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every op raises its own types for bad arguments
            first = first_line(exc)
            raise HarnessError(f"{node_where}: invalid arguments: {first}") from None
        got = tuple(result) if node.multi else (result,)
        declared = node.outputs
        actual = tuple(TensorMeta.of(t) if isinstance(t, torch.Tensor) else None for t in got)
        if len(actual) != len(declared) or any(d is not None and d != a for d, a in zip(declared, actual, strict=False)):
            raise HarnessError(
                f"{node_where}: declares outputs {_describe(declared)} but its op returns {_describe(actual)}"
            )
        if node.residual is not None:
            residual = env[node.residual.name]
            added = (TensorMeta.of(residual) if isinstance(residual, torch.Tensor) else None,)
            if node.multi or added != actual:
                raise HarnessError(
                    f"{node_where}: residual {node.residual.name!r} is {_describe(added)}, "
                    f"its result {_describe(actual)}; a residual must have the result's shape and dtype"
                )
        env[node.name] = result


def check_strided_ops(plan: Plan, where: str) -> None:
    """Every strided op reads a compact copy of its input (see ``STRIDED_PACKETS``).

    ``as_strided`` reads memory, not values: given a channels-last tensor (a
    convolution tactic's choice) where eager had a row-major one, it returns
    other elements with no error. The compiler gives it a contiguous clone
    wherever eager's layout allows (lowering pass ``pin_strided_layouts``);
    the builder may only put a dtype cast in between (which keeps a compact
    layout). Weights are stored compact.
    """
    producers = {node.name: node for node in plan.nodes}
    for node in plan.nodes:
        if plan_packet(node.op) not in STRIDED_PACKETS:
            continue
        source = node.args[0] if node.args else None
        producer = producers.get(source.name) if isinstance(source, Ref) else None
        while producer is not None and producer.op == _CAST and "memory_format" not in producer.kwargs:
            parent = producer.args[0]
            producer = producers.get(parent.name) if isinstance(parent, Ref) else None
        compact_copy = producer is not None and producer.op == _CLONE and producer.kwargs.get(
            "memory_format"
        ) == torch.contiguous_format
        if not (isinstance(source, WeightRef) or compact_copy):
            raise HarnessError(
                f"{where}: layer {node.name!r} ({node.op}) addresses its input's memory by strides and offset, "
                "so its values would depend on the memory layout the engine's tactics choose; it must read a "
                "contiguous copy (aten::clone with memory_format=contiguous_format), which the compiler inserts "
                "when the memory it addresses is row-major in eager"
            )


def _check_strided_bounds(
    fn: Callable[..., Any], node: Node, args: Sequence[Any], kwargs: Mapping[str, Any], where: str
) -> None:
    """Fake tensors do not check ``as_strided`` against the storage: every addressed element must exist."""
    if plan_packet(node.op) not in STRIDED_PACKETS:
        return
    named = dict(zip([a.name for a in fn._schema.arguments], args, strict=False))  # type: ignore[attr-defined]
    named.update(kwargs)
    source, size, stride = named["self"], list(named["size"]), list(named["stride"])
    offset = named.get("storage_offset")
    offset = source.storage_offset() if offset is None else offset
    elements = source.untyped_storage().nbytes() // source.element_size()
    if len(size) != len(stride) or any(s < 0 for s in (*size, *stride)) or offset < 0:
        raise HarnessError(f"{where}: invalid arguments: size {size}, stride {stride}, offset {offset}")
    last = offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else -1
    if last >= elements:
        raise HarnessError(
            f"{where}: size {size}, stride {stride} and offset {offset} address element {last} "
            f"of an input holding {elements}"
        )


def _describe(metas: tuple[TensorMeta | None, ...]) -> str:
    return ", ".join("-" if m is None else f"{m.dtype}{list(m.shape)}" for m in metas)


def _check_node(
    node: Node, known: Mapping[str, Node | None], weights: Mapping[str, TensorMeta], where: str
) -> None:
    """Structure the engine relies on: a getitem picks an existing output of a tuple op,
    every other node returns something and takes single tensors (or weights)."""
    if node.name in known:
        raise HarnessError(f"{where}: name defined twice")
    if not node.outputs or (len(node.outputs) > 1 and not node.multi):
        raise HarnessError(f"{where}: a non-tuple op must declare exactly one output")
    if node.op != GETITEM:
        _check_refs((node.args, node.kwargs, node.residual), known, weights, where)
        return
    source = node.args[0] if len(node.args) == 2 else None
    producer = known.get(source.name) if isinstance(source, Ref) else None
    index = node.args[1] if len(node.args) == 2 else None
    if (
        producer is None
        or not producer.multi
        or not isinstance(index, int)
        or not 0 <= index < len(producer.outputs)
        or node.multi
        or node.residual is not None
    ):
        raise HarnessError(
            f"{where}: a getitem must pick an output of an earlier tuple-returning node"
        )


def _check_refs(
    args: Any, known: Mapping[str, Node | None], weights: Mapping[str, TensorMeta], where: str
) -> None:
    for leaf in iter_leaves(args):
        if isinstance(leaf, Ref) and leaf.name not in known:
            raise HarnessError(f"{where}: refers to {leaf.name!r}, which is not defined before it")
        if isinstance(leaf, Ref) and (producer := known[leaf.name]) is not None and producer.multi:
            raise HarnessError(
                f"{where}: refers to tuple {leaf.name!r} directly instead of through a getitem"
            )
        if isinstance(leaf, Ref) and (producer := known[leaf.name]) is not None and producer.outputs[0] is None:
            raise HarnessError(f"{where}: refers to {leaf.name!r}, which declares no tensor output")
        if isinstance(leaf, WeightRef) and leaf.name not in weights:
            raise HarnessError(
                f"{where}: refers to weight {leaf.name!r}, which the plan does not declare"
            )
