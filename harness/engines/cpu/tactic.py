"""What one tactic of the CPU engine is, and what its checks and its binder see of a layer.

A :class:`Tactic` is one implementation of one layer, one object: its name,
where it applies (a structural check on the layer), the capability question
it asks (whether this machine has a native kernel for it, and why not), its
part in the emulation rule, its part in regions and oneDNN primitives, and
its binder. A :class:`Family` is the ordered catalogue of the tactics of one
kind of layer; :mod:`harness.engines.cpu.families` holds them all and
:mod:`harness.engines.cpu.tactics` walks them.

The checks see a :class:`Layer` (the node, its arguments by schema name, the
metas of its inputs, the weights and the capability asked); the binders see
a :class:`Ctx` (the arguments with dynamic inputs as slots and weights as
tensors), and return a callable of the layer's dynamic inputs.
"""

from __future__ import annotations

import functools
import keyword
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from types import CodeType
from typing import Any

import torch

from harness.dtypes import LOW_DTYPES, dtype_from_name, dtype_name
from harness.engines import capability
from harness.engines.cpu import kernels, onednn_attention, onednn_primitive
from harness.engines.cpu.plan import Node, Ref, TensorMeta, WeightRef, map_leaves, runnable_op
from harness.errors import HarnessError
from harness.opnames import plan_packet

Bound = Callable[..., Any]
# Precisions whose products are exact in fp32, so a widened tactic keeps their numbers.
WIDENABLE = frozenset(LOW_DTYPES)
# The types oneDNN's primitives compute in.
ONEDNN_PRECISIONS = frozenset(capability.PRECISIONS)
PrimitiveClass = type[onednn_primitive._Primitive] | type[onednn_attention.Attention]


@dataclass(frozen=True)
class Slot:
    """Placeholder for the i-th dynamic (Ref) input in a bound argument template."""

    index: int


# An op's function, its schema's arguments as (name, keyword-only, has a default, the default),
# and their names.
_Schema = tuple[Callable[..., Any], tuple[tuple[str, bool, bool, Any], ...], frozenset[str]]
# op name -> the function runnable_op resolves it to: a plan's op name always stands for the
# same function, so torch is asked once per op and process.
_OPS: dict[str, Callable[..., Any]] = {}
# op name -> its _Schema: what named_args and context read of the op, the same for every
# layer of the op, so asked of torch once per op and process.
_SCHEMAS: dict[str, _Schema] = {}


def op_function(op: str, where: str) -> Callable[..., Any]:
    """:func:`~harness.engines.cpu.plan.runnable_op` of ``op``: a refused name is a HarnessError
    naming ``where`` on every ask, a valid one is resolved once per process."""
    fn = _OPS.get(op)
    if fn is None:
        fn = _OPS[op] = runnable_op(op, where)
    return fn


def _schema(node: Node) -> _Schema:
    """``node``'s op and its schema's arguments (a HarnessError naming the layer for an op a plan
    may not hold, never remembered)."""
    found = _SCHEMAS.get(node.op)
    if found is None:
        fn = op_function(node.op, f"layer {node.name!r}")
        arguments = tuple(_argument(a) for a in fn._schema.arguments)  # type: ignore[attr-defined]
        found = _SCHEMAS[node.op] = (fn, arguments, frozenset(a[0] for a in arguments))
    return found


def _argument(argument: Any) -> tuple[str, bool, bool, Any]:
    """A schema argument as (name, keyword-only, has a default, the default or None)."""
    known = argument.has_default_value()
    return argument.name, argument.kwarg_only, known, argument.default_value if known else None


def named_args(node: Node) -> dict[str, Any]:
    """``node``'s arguments by schema name, defaults filled in; unknown keywords are refused."""
    _, arguments, names = _schema(node)
    unknown = sorted(set(node.kwargs) - names)
    if unknown or len(node.args) > len(arguments):
        raise HarnessError(
            f"layer {node.name!r}: arguments do not match {node.op} ({', '.join(unknown) or 'too many'})"
        )
    named: dict[str, Any] = {}
    args, kwargs = node.args, node.kwargs
    for i, (name, kwarg_only, has_default, default) in enumerate(arguments):
        if i < len(args) and not kwarg_only:
            named[name] = args[i]
        elif name in kwargs:
            named[name] = kwargs[name]
        elif has_default:  # a list default is the layer's own, as torch gives a new one per ask
            named[name] = list(default) if type(default) is list else default
    return named


def make_call(fn: Callable[..., Any], args: Any, kwargs: Mapping[str, Any]) -> Bound:
    """A generated ``lambda d0, d1: fn(d0, <const>, d1)``: no per-call argument shuffling.

    Small scalars become literals, everything else (tensors, dtypes, floats,
    strings) is bound by name, so plan contents never become code. An invalid
    keyword name is a HarnessError.
    """
    # An OpOverload's __call__ only forwards to its C++ op: calling that directly
    # saves a Python frame per layer per run.
    consts: dict[str, Any] = {"fn": fn._op if isinstance(fn, torch._ops.OpOverload) else fn}
    slots: set[int] = set()

    def expr(value: Any) -> str:
        if isinstance(value, Slot):
            slots.add(value.index)
            return f"d{value.index}"
        if isinstance(value, list):
            return "[" + ", ".join(expr(v) for v in value) + "]"
        if isinstance(value, tuple):
            return "(" + "".join(expr(v) + ", " for v in value) + ")"
        if value is None or isinstance(value, (bool, int)):
            return repr(value)
        name = f"c{len(consts)}"
        consts[name] = value
        return name

    parts = [expr(a) for a in args]
    for name, value in kwargs.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise HarnessError(f"invalid keyword argument name {name!r}")
        parts.append(f"{name}={expr(value)}")
    params = ", ".join(f"d{i}" for i in range(max(slots, default=-1) + 1))
    return eval(compiled(f"lambda {params}: fn({', '.join(parts)})", "<string>", "eval"), consts)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1024)
def compiled(source: str, filename: str, mode: str) -> CodeType:
    """``compile(source, filename, mode)``, once per process for each: generated code depends
    only on its text (everything it names comes from the namespace it runs in), and a
    rebuild generates the same text again."""
    return compile(source, filename, mode)


def getter(value: Any) -> Callable[[tuple[Any, ...]], Any]:
    """Read a template value at call time: a dynamic input by slot, or the constant."""
    if isinstance(value, Slot):
        index = value.index
        return lambda d: d[index]
    return lambda d: value


def pair(value: Any) -> list[int]:
    """A conv attribute as the two-element list oneDNN wants (ATen also accepts 1 or an int)."""
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    return values * 2 if len(values) == 1 else values


@dataclass(frozen=True)
class Ctx:
    """What a binder sees of a layer (see :func:`context`)."""

    name: str  # the layer's
    fn: Any  # the resolved OpOverload
    named: dict[str, Any]  # schema name -> Slot | tensor | constant
    packet: str
    epilogue: str  # activation to apply to the result ("" for none)
    residual: bool  # the layer adds its last dynamic input to its result (before the epilogue)
    inputs: tuple[TensorMeta, ...]  # of the dynamic inputs, in slot order
    output: tuple[int, ...]  # the shape of the first result
    dtype: str  # the first result's ("" without one)
    result: onednn_primitive.ResultSlot | None  # see harness.engines.cpu.tactics.bind

    @property
    def low(self) -> bool:
        """Some dynamic input is fp16/bf16."""
        return any(meta.dtype in LOW_DTYPES for meta in self.inputs)

    @property
    def residual_dtype(self) -> torch.dtype | None:
        """The residual's type (the last dynamic input's), None without one."""
        return dtype_from_name(self.inputs[-1].dtype) if self.residual else None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The first dynamic input's."""
        return self.inputs[0].shape if self.inputs else ()

    def call(self, /, **changes: Any) -> Bound:
        """The node's op on the node's arguments, some replaced (e.g. a prepared weight)."""
        named = {**self.named, **changes}
        args, kwargs = [], {}
        for arg in self.fn._schema.arguments:
            if arg.name not in named:
                continue
            if arg.kwarg_only:
                kwargs[arg.name] = named[arg.name]
            else:
                args.append(named[arg.name])
        return make_call(self.fn, args, kwargs)


def context(
    node: Node,
    metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
    result: onednn_primitive.ResultSlot | None = None,
    named: Mapping[str, Any] | None = None,
) -> Ctx:
    """What a binder needs of ``node``: its arguments with dynamic inputs as slots and weights as tensors.

    ``named``: ``named_args(node)`` where the caller has it (it is only read).
    """
    fn = _schema(node)[0]
    refs = node.refs()
    counter = iter(range(len(refs)))

    def template(leaf: Any) -> Any:
        if isinstance(leaf, Ref):
            return Slot(next(counter))
        if isinstance(leaf, WeightRef):
            return weights[leaf.name]
        return leaf

    # Slots are numbered in argument order, the order node.refs() lists them.
    arguments = named_args(node) if named is None else named
    templated = {name: map_leaves(value, template) for name, value in arguments.items()}
    inputs = tuple(metas[r.name] for r in refs)
    first = node.outputs[0] if node.outputs else None
    output = () if first is None else first.shape
    dtype = "" if first is None else first.dtype
    return Ctx(
        node.name, fn, templated, plan_packet(node.op), node.epilogue, node.residual is not None, inputs, output, dtype,
        result,
    )  # fmt: skip


class Layer:
    """What a tactic's checks see of one layer: the node, its arguments by schema name
    (:func:`named_args`, so unknown arguments are refused as the layer is looked at), the
    metas of the values it reads, the weights, and the capability every answer comes from
    (:func:`harness.engines.capability.current` when the layer is looked at)."""

    def __init__(self, node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]) -> None:
        self.node, self.metas, self.weights = node, metas, weights
        self.packet = plan_packet(node.op)
        self.named = named_args(node)
        self.capability = capability.current()

    @functools.cached_property
    def precision(self) -> str:
        """The type of its one result (a HarnessError for a layer without exactly one)."""
        return self.node.out().dtype

    @functools.cached_property
    def context(self) -> Ctx:
        """The binders' view of it, without a result slot (what a primitive tactic's question needs)."""
        return context(self.node, self.metas, self.weights, named=self.named)

    @property
    def emulated(self) -> bool:
        """Whether torch has no native matmul and convolution kernels here for its fp16/bf16 type:
        ATen then converts every element in software."""
        return self.precision in WIDENABLE and not self.capability.aten_native(self.precision)

    def meta(self, argument: str) -> TensorMeta:
        """The meta of the computed value given as ``argument``."""
        return self.metas[self.named[argument].name]


Check = Callable[[Layer], bool]
# Why this machine has no native kernel for a tactic on a layer; None where it has one.
Question = Callable[[Layer], str | None]
Binder = Callable[[Ctx], Bound]


def anywhere(layer: Layer) -> bool:
    """The check of a tactic that applies to every layer of its family."""
    return True


def every(*checks: Check) -> Check:
    """The check that passes where each of ``checks`` passes (asked in order, the first failing ends it)."""
    return lambda layer: all(check(layer) for check in checks)


def widenable(layer: Layer) -> bool:
    """An fp16/bf16 layer: its products are exact in fp32."""
    return layer.precision in WIDENABLE


def emulated(layer: Layer) -> bool:
    """A layer of a type torch emulates here (:attr:`Layer.emulated`)."""
    return layer.emulated


def onednn_operands(layer: Layer) -> bool:
    """A linear layer or convolution whose input, weight and result share a precision oneDNN computes in."""
    precision = layer.precision
    return (
        precision in ONEDNN_PRECISIONS
        and layer.meta("input").dtype == precision
        and dtype_name(layer.weights[layer.named["weight"].name].dtype) == precision
    )


def no_native_aten(precision: str) -> str:
    """Why a tactic on torch's own kernels of ``precision`` is left out where torch has none."""
    return f"torch has no native {precision} matmul or convolution kernels here"


def always_native(layer: Layer) -> str | None:
    """The question of a tactic that runs the same kernels on every machine: it never misses one."""
    return None


def aten_native(layer: Layer) -> str | None:
    """The question of a tactic on torch's own oneDNN ops: does torch have native kernels for the type?"""
    return None if layer.capability.aten_native(layer.precision) else no_native_aten(layer.precision)


@dataclass(frozen=True)
class Tactic:
    """One implementation of a layer, and everything the engine asks of it.

    ``name`` is the implementation's part of a tactic name (``gemm_splitk2``
    in ``gemm_splitk2[bf16]``), as timing caches record it: it never changes.
    A tactic is offered for a layer of its family where ``applies`` passes
    and ``native`` answers None; where ``applies`` passes and ``native`` gives
    a reason, it is left out with that reason. ``aten_low``: one of ATen's own
    low-precision matmuls, convolutions or explicit attention, which the
    emulation rule leaves out where torch emulates the layer's type
    (:func:`harness.engines.cpu.tactics.offer`). ``bind`` makes the layer's
    callable from a :class:`Ctx`.

    For regions and whole-run decisions: ``graph_layout``, a oneDNN Graph
    partition taking its inputs in that layout; ``region_form``, the tactic a
    region traces in its place; ``traceable``, a region may trace it beside
    its partitions (ATen calls the bridge maps); ``aten_call``, the op's own
    ATen call (or one that computes the same: it returns a new tensor where the
    op does); ``primitive``, the oneDNN primitive it runs on.
    """

    name: str
    bind: Binder
    doc: str  # what it computes, in one line
    _: KW_ONLY
    applies: Check = anywhere
    native: Question = always_native
    aten_low: bool = False
    graph_layout: torch.memory_format | None = None
    region_form: Tactic | None = None
    traceable: bool = False
    aten_call: bool = False
    primitive: PrimitiveClass | None = None


@dataclass(frozen=True)
class PrimitiveCall:
    """The arguments of the primitive a tactic creates for a layer, not created yet, and the
    primitive's precision as :mod:`harness.engines.capability` names it."""

    precision: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


def primitive_call(precision: str, *args: Any, **kwargs: Any) -> PrimitiveCall:
    return PrimitiveCall(precision, args, kwargs)


def primitive_tactic(
    make: PrimitiveClass, call: Callable[[Ctx], PrimitiveCall], doc: str, applies: Check, **flags: Any
) -> Tactic:
    """The tactic named ``make.tactic`` that runs a layer on the oneDNN primitive ``make(*call(ctx))``.

    Its question is the primitive's kernel (:func:`harness.engines.cpu.kernels.missing`):
    asked of the descriptor of the primitive the layer would create, so a tactic is left
    out where oneDNN has only a reference loop or no kernel for that layer.
    """

    def bind(ctx: Ctx) -> Bound:
        made = call(ctx)
        return make(*made.args, **made.kwargs)

    def missing(layer: Layer) -> str | None:
        made = call(layer.context)
        return kernels.missing(make.kind, made.precision, make, *made.args, **made.kwargs)

    return Tactic(make.tactic, bind, doc, applies=applies, native=missing, primitive=make, **flags)


@dataclass(frozen=True)
class Family:
    """The ordered catalogue of the tactics of one kind of layer: the layers ``matches``
    takes are offered ``tactics`` in this order (those that apply and are native here)."""

    name: str
    matches: Check
    tactics: tuple[Tactic, ...]


def direct(ctx: Ctx) -> Bound:
    """The layer's own ATen call."""
    return ctx.call()
