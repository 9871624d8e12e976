"""Per-layer implementations ("tactics") of the CPU engine.

Like GPU kernels, the implementations of one layer compute the same function
with different memory layouts, libraries or orders of accumulation, so their
results can differ in the last bits while all stay close to the exact value:
convolution in NCHW, channels-last, without oneDNN or on oneDNN with a
prepacked weight, and a 1x1 convolution as one GEMM over the pixels of its
channels-last input; GEMM directly, on a pre-transposed weight, on oneDNN, or
split-K (partial products over chunks of the reduction dimension,
accumulated in the layer's own dtype); fp16/bf16 GEMMs also widened exactly
to fp32 and rounded once; convolution and linear layers as oneDNN Graph
partitions (fp16 ones widened to fp32 partitions and rounded once) or
oneDNN primitives called through its C API; softmax, layer norm and
attention fused or decomposed, attention also as three oneDNN primitives; an
adaptive average pooling whose output divides its input also as the
fixed-window pooling it equals. Every other op has the single tactic
``direct``. A convolution or linear layer may carry an epilogue
activation and a residual input (see :mod:`harness.engines.cpu.lowering`),
which every one of its tactics applies.

A tactic is named ``impl[precision]`` (``gemm_splitk2[bf16]``): the precision
is part of the name because in weak modes it is one of the builder's choices.
:func:`bind` turns (node, tactic) into a callable of the node's dynamic inputs
with weights already prepared (pre-transposed, channels-last, contiguous), so
the engine pays layout conversions once, at build or load, not per call.
"""

from __future__ import annotations

import functools
import hashlib
import keyword
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from harness.dtypes import LOW_DTYPES, dtype_from_name, dtype_name
from harness.engines import capability
from harness.engines.cpu import kernels, onednn_attention, onednn_graph, onednn_primitive
from harness.engines.cpu.onednn_primitive import Eltwise
from harness.engines.cpu.plan import (
    GETITEM,
    Node,
    Ref,
    TensorMeta,
    WeightRef,
    map_leaves,
    runnable_op,
)
from harness.errors import HarnessError, first_line
from harness.opnames import plan_packet

Bound = Callable[..., Any]

_TACTIC_NAME = re.compile(r"^(\w+)\[(\w+)\]$")
_CL = torch.channels_last
# The families with a oneDNN Graph tactic, and the layout their partitions take inputs in.
_GRAPH_LAYOUTS = {"conv": _CL, "gemm": torch.contiguous_format}
# Linear layers, convolutions, poolings, binary ops, casts and layer norms on oneDNN's
# primitives through its C API (:mod:`harness.engines.cpu.onednn_primitive`).
PRIMITIVE_GEMM = onednn_primitive.Matmul.tactic
PRIMITIVE_CONV = onednn_primitive.Convolution.tactic
PRIMITIVE_POOL = onednn_primitive.Pooling.tactic
PRIMITIVE_BINARY = onednn_primitive.Binary.tactic
PRIMITIVE_CAST = onednn_primitive.Cast.tactic
PRIMITIVE_LNORM = onednn_primitive.LayerNorm.tactic
PRIMITIVE_IMPLS = (PRIMITIVE_GEMM, PRIMITIVE_CONV, PRIMITIVE_POOL, PRIMITIVE_BINARY, PRIMITIVE_CAST, PRIMITIVE_LNORM)
# Attention on three oneDNN primitives: a layer like any other, its result a new tensor per call.
SDPA_DNNL = onednn_attention.Attention.tactic
# ATen's elementwise ops by plan packet -> oneDNN's binary algorithm doing the same.
_BINARY_ALGORITHMS = {"mul": "binary_mul"}
# The tactics that compile a layer into a oneDNN Graph partition (regions are made of them).
GRAPH_IMPLS = tuple(f"{family}_onednn_graph{suffix}" for family in _GRAPH_LAYOUTS for suffix in ("", "_widened"))
# A plain layer's form that a region traces into oneDNN partitions, where its own tactic stays
# one ATen call there: attention's explicit matmuls, scaling and softmax, not ATen's fused call.
REGION_FORMS = {"sdpa_fused": "sdpa_math", "sdpa_dnnl": "sdpa_math"}
# Smallest reduction-chunk a split-K tactic may use: below it the extra
# partial-sum traffic can only lose, so the candidate is not worth timing.
_MIN_SPLIT_CHUNK = 16

_LAYER_TYPES = {
    "convolution": "conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d conv_transpose3d",
    "matmul": "linear addmm mm bmm matmul baddbmm einsum",
    "softmax": "softmax _softmax log_softmax _log_softmax",
    "normalization": "layer_norm native_layer_norm batch_norm _native_batch_norm_legit_no_training "
    "group_norm native_group_norm rms_norm",
    "attention": "scaled_dot_product_attention",
    "gather": "embedding index_select gather index",
    "pooling": "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices avg_pool1d avg_pool2d "
    "avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool2d",
    "reduce": "mean sum amax amin max min argmax argmin var std prod cumsum linalg_vector_norm logsumexp",
    "shuffle": "view reshape _unsafe_view flatten unflatten transpose t permute unsqueeze squeeze "
    "expand slice select contiguous clone alias split split_with_sizes chunk unbind narrow repeat "
    "tile flip roll movedim pixel_shuffle pad constant_pad_nd dropout lift_fresh_copy",
    "concatenation": "cat stack",
    "cast": "_to_copy to type_as",
    "constant": "arange zeros ones full zeros_like ones_like full_like scalar_tensor",
    "resize": "upsample_nearest2d upsample_bilinear2d",
}
_TYPE_OF = {packet: kind for kind, packets in _LAYER_TYPES.items() for packet in packets.split()}


@dataclass(frozen=True)
class Slot:
    """Placeholder for the i-th dynamic (Ref) input in a bound argument template."""

    index: int


def layer_type(node: Node) -> str:
    """TensorRT-style layer type of a node ("convolution", "matmul", ..., "elementwise")."""
    return _TYPE_OF.get(plan_packet(node.op), "elementwise")


def tactic_name(impl: str, precision: str) -> str:
    return f"{impl}[{precision}]"


def parse_tactic(name: str) -> tuple[str, str]:
    """``gemm_splitk2[bf16]`` -> ("gemm_splitk2", "bf16")."""
    match = _TACTIC_NAME.match(name)
    if match is None:
        raise HarnessError(
            f"malformed tactic name {name!r}; expected impl[precision], e.g. gemm_direct[fp32]"
        )
    return match.group(1), match.group(2)


def on_graph_tactic(node: Node) -> bool:
    """Whether ``node`` is a layer compiled into a oneDNN Graph partition (regions start at one)."""
    return node.op != GETITEM and parse_tactic(node.tactic)[0] in GRAPH_IMPLS


def on_primitive(node: Node) -> bool:
    """Whether ``node`` is a layer on one of oneDNN's primitives (:data:`PRIMITIVE_IMPLS`)."""
    return node.op != GETITEM and parse_tactic(node.tactic)[0] in PRIMITIVE_IMPLS


def graph_input_layout(node: Node) -> torch.memory_format:
    """The layout the partition of ``node``'s oneDNN Graph tactic takes its inputs in."""
    return _GRAPH_LAYOUTS[parse_tactic(node.tactic)[0].split("_", 1)[0]]


def tactic_hash(name: str) -> str:
    """Stable 64-bit id of a tactic name, written like TensorRT's tactic hashes."""
    return "0x" + hashlib.sha256(name.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Offer:
    """The implementations that can run a layer on this CPU, and those it leaves out, with why."""

    impls: tuple[str, ...]
    left_out: Mapping[str, str]  # implementation -> why this CPU does not offer it


def impl_names(
    node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> list[str]:
    """The implementations :func:`offer` offers for ``node``."""
    return list(offer(node, metas, weights).impls)


def offer(node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]) -> Offer:
    """Implementations that can run ``node`` here; the first is the plain ATen call unless
    this CPU leaves it out.

    A tactic whose kernel here is a reference or emulated fallback for the
    layer's shape and type is left out, with its reason, as the current
    capability (:mod:`harness.engines.capability`) answers: a oneDNN
    primitive whose descriptor names a reference loop or no kernel; torch's
    oneDNN ops and Graph partitions in a type torch has no native kernels
    for; and, in such a type, ATen's own matmuls, convolutions and explicit
    attention, which convert every element in software (the ``*_widened``
    tactics then compute the same products, exactly, on fp32 kernels and
    round once). An emulated ATen call stays where nothing else can run the
    layer.
    """
    packet = plan_packet(node.op)
    named = _named(node)
    if node.epilogue and not epilogue_ok(node, node.epilogue):
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) cannot apply epilogue {node.epilogue!r}; only convolutions "
            f"({', '.join(_CONV_EPILOGUES)}) and linear layers with constant weights "
            f"({', '.join(_LINEAR_EPILOGUES)}) can"
        )
    if node.residual is not None and not residual_ok(node):
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) cannot add a residual; only convolutions and linear "
            "layers with constant weights can"
        )
    found = _Found(node, metas, weights)
    if packet in ("view", "_unsafe_view"):
        # A view of a channels-last tensor may be impossible; a reshape gives
        # the same values whatever the layout the producer's tactic chose.
        found.add("reshape")
    elif packet in ("conv2d", "convolution") and _conv_ok(node, named):
        precision = node.out().dtype
        found.add("conv_nchw", "conv_channels_last")
        # Without oneDNN, reduced-precision convolution falls back to a naive
        # loop 50-100x slower: never a sensible candidate, so never timed.
        if precision == "fp32" and not isinstance(named["padding"], str):
            found.add("conv_no_mkldnn")
        if packet == "conv2d" and not isinstance(named["padding"], str):
            found.aten_onednn("conv_onednn", precision)
            found.graph_variants("conv", precision)
            if _dnnl_fits(node, named, metas, weights):
                found.primitive(PRIMITIVE_CONV)
        if _pointwise_conv(packet, named, weights):
            found.add("conv1x1_gemm")
            found.gemm_variants("conv1x1", precision)
        found.emulation(precision, "conv_widened")
    elif packet in _GEMM_OPERANDS:
        k = _reduction_size(packet, named, metas, weights)
        found.add("gemm_direct", *(f"gemm_splitk{n}" for n in (2, 4) if k // n >= _MIN_SPLIT_CHUNK))
        precision = node.out().dtype
        if packet == "linear" and _linear_ok(named):
            found.add("gemm_nn")
            found.gemm_variants("gemm", precision)
            found.graph_variants("gemm", precision)
            if _dnnl_fits(node, named, metas, weights):
                found.primitive(PRIMITIVE_GEMM)
        found.emulation(precision, "gemm_widened")
    elif avg_pool_window(node, metas) is not None:
        precision = node.out().dtype
        in_meta = metas[node.refs()[0].name]
        found.add("direct", "pool_window")
        if len(in_meta.shape) == 4 and in_meta.dtype == precision:
            found.primitive(PRIMITIVE_POOL)
    elif packet in _BINARY_ALGORITHMS and _binary_fits(node, named, metas):
        found.add("direct")
        found.primitive(PRIMITIVE_BINARY)
    elif packet == "_to_copy" and _cast_fits(node, named, metas):
        found.add("direct")
        found.primitive(PRIMITIVE_CAST)
    elif packet in _SOFTMAX_LOG:
        undecomposable = named.get("dtype") is not None or named.get("half_to_float", False)
        found.add("softmax_fused", *([] if undecomposable else ["softmax_decomposed"]))
    elif packet == "layer_norm" and not any(isinstance(named[a], Ref) for a in ("weight", "bias")):
        found.add("layernorm_fused", "layernorm_decomposed")
        if _layernorm_fits(node, named, metas):
            found.primitive(PRIMITIVE_LNORM)
    elif (
        packet == "scaled_dot_product_attention"
        and all(isinstance(named[a], Ref) for a in ("query", "key", "value"))
        and named["dropout_p"] == 0.0
        and not named["enable_gqa"]
    ):
        found.add("sdpa_fused", "sdpa_math")
        if _sdpa_fits(node, named, metas, weights):
            found.primitive(SDPA_DNNL)
        found.emulation(node.out().dtype)
    else:
        found.add("direct")
    return Offer(tuple(found.impls), dict(found.left_out))


# ATen's own kernels that compute a layer's matmuls or convolutions in its type: where torch has
# no native kernels for that type, generic loops that convert every element in software.
_ATEN_LOW = frozenset(
    {"conv_nchw", "conv_channels_last", "conv1x1_gemm", "gemm_direct", "gemm_nn", "gemm_splitk2", "gemm_splitk4", "sdpa_math"}
)


class _Found:
    """The implementations found for one layer so far, and those left out with their reasons."""

    def __init__(self, node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]) -> None:
        self.node, self.metas, self.weights = node, metas, weights
        self.impls: list[str] = []
        self.left_out: dict[str, str] = {}
        self.capability = capability.current()

    def add(self, *impls: str) -> None:
        self.impls += impls

    def aten_onednn(self, impl: str, precision: str) -> None:
        """``impl``, one of torch's own oneDNN ops, where torch has native kernels for ``precision``."""
        if self.capability.aten_native(precision):
            self.add(impl)
        else:
            self.left_out[impl] = _no_native_aten(precision)

    def gemm_variants(self, family: str, precision: str) -> None:
        """``family``'s widened and oneDNN tactics, where ``precision`` has them."""
        if precision in _WIDENABLE:
            self.add(f"{family}_widened")
        self.aten_onednn(f"{family}_onednn", precision)

    def graph_variants(self, family: str, precision: str) -> None:
        """``family``'s oneDNN Graph tactic: in ``precision`` where the bridge has its kernels, else
        widened to fp32 (an fp16 layer, or bf16 without native kernels; see
        :mod:`harness.engines.cpu.onednn_graph`)."""
        if not _EPILOGUES[self.node.epilogue].graph:
            return
        if onednn_graph.available(precision):
            self.add(f"{family}_onednn_graph")
            return
        if precision == "bf16":
            self.left_out[f"{family}_onednn_graph"] = _no_native_aten(precision)
        if precision in _WIDENABLE and onednn_graph.available("fp32"):
            self.add(f"{family}_onednn_graph_widened")

    def primitive(self, impl: str) -> None:
        """The primitive tactic ``impl``, where the primitive the layer would create gets a native kernel."""
        call = _PRIMITIVE_CALLS[impl](_context(self.node, self.metas, self.weights))
        reason = kernels.missing(call.make.kind, call.precision, call.make, *call.args, **call.kwargs)
        if reason is None:
            self.add(impl)
        else:
            self.left_out[impl] = reason

    def emulation(self, precision: str, widened: str | None = None) -> None:
        """In a ``precision`` ATen has no native kernels for: ``widened`` (the layer on fp32
        kernels) offered, and ATen's own low-precision kernels (:data:`_ATEN_LOW`) left out
        where anything else remains."""
        if precision not in _WIDENABLE or self.capability.aten_native(precision):
            return
        if widened is not None and widened not in self.impls:
            self.add(widened)
        emulated = [impl for impl in self.impls if impl in _ATEN_LOW]
        if len(emulated) == len(self.impls):
            return
        reason = _no_native_aten(precision) + "; ATen converts every element in software"
        for impl in emulated:
            self.impls.remove(impl)
            self.left_out[impl] = reason


def _no_native_aten(precision: str) -> str:
    return f"torch has no native {precision} matmul or convolution kernels here"


def epilogue_ok(node: Node, epilogue: str) -> bool:
    """Whether ``node`` can absorb the activation ``epilogue`` (every tactic of it applies it)."""
    packet = plan_packet(node.op)
    if node.multi or not node.outputs:
        return False
    if packet in ("conv2d", "convolution"):
        return epilogue in _CONV_EPILOGUES and _conv_ok(node, _named(node))
    if packet == "linear":
        return epilogue in _LINEAR_EPILOGUES and _linear_ok(_named(node))
    return False


def residual_ok(node: Node) -> bool:
    """Whether ``node`` can add a residual to its result (every tactic of it does)."""
    if node.multi or not node.outputs:
        return False
    packet = plan_packet(node.op)
    if packet in ("conv2d", "convolution"):
        return _conv_ok(node, _named(node))
    return packet == "linear" and _linear_ok(_named(node))


def bind(
    node: Node,
    impl: str,
    metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
    result: onednn_primitive.ResultSlot | None = None,
) -> Bound:
    """Callable computing ``node`` with ``impl`` from its dynamic inputs (``node.refs()`` order).

    ``result``: the caller reads no result after its last reader in the run,
    so a tactic may write every result of a thread into the one tensor this
    gives that thread, which may share memory with other layers' results once
    dead (the oneDNN primitives do: see
    :class:`harness.engines.cpu.onednn_primitive.Matmul`); other tactics ignore it.
    """
    found = offer(node, metas, weights)
    if impl not in found.impls:
        why = f" ({found.left_out[impl]})" if impl in found.left_out else ""
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) has no implementation {impl!r} here{why}; "
            f"valid: {', '.join(found.impls)}"
        )
    return _BINDERS[impl](_context(node, metas, weights, result))


def _context(
    node: Node,
    metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
    result: onednn_primitive.ResultSlot | None = None,
) -> _Ctx:
    """What a binder needs of ``node``: its arguments with dynamic inputs as slots and weights as tensors."""
    fn = runnable_op(node.op, f"layer {node.name!r}")
    counter = iter(range(len(node.refs())))

    def template(leaf: Any) -> Any:
        if isinstance(leaf, Ref):
            return Slot(next(counter))
        if isinstance(leaf, WeightRef):
            return weights[leaf.name]
        return leaf

    # Slots are numbered in argument order, the order node.refs() lists them.
    named = {name: map_leaves(value, template) for name, value in _named(node).items()}
    inputs = tuple(metas[r.name] for r in node.refs())
    first = node.outputs[0] if node.outputs else None
    output = () if first is None else first.shape
    dtype = "" if first is None else first.dtype
    return _Ctx(
        node.name, fn, named, plan_packet(node.op), node.epilogue, node.residual is not None, inputs, output, dtype,
        result,
    )  # fmt: skip


@contextmanager
def layer_failures(node: Node) -> Iterator[None]:
    """Turn a kernel's exception while building into an error naming the layer.

    A typed graph can hold an op PyTorch refuses (e.g. an exact-AMP graph of a
    model that also fails under eager autocast); the user needs the layer.
    """
    try:
        yield
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = first_line(exc)
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) fails on its inputs: {first}; the typed graph cannot run as given"
        ) from exc


def make_call(fn: Callable[..., Any], args: Any, kwargs: Mapping[str, Any]) -> Bound:
    """A generated ``lambda d0, d1: fn(d0, <const>, d1)``: no per-call argument shuffling.

    Small scalars become literals, everything else (tensors, dtypes, floats,
    strings) is bound by name, so plan contents never become code.
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
    return eval(f"lambda {params}: fn({', '.join(parts)})", consts)  # type: ignore[no-any-return]


# --- binding ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    name: str  # the layer's
    fn: Any  # the resolved OpOverload
    named: dict[str, Any]  # schema name -> Slot | tensor | constant
    packet: str
    epilogue: str  # activation to apply to the result ("" for none)
    residual: bool  # the layer adds its last dynamic input to its result (before the epilogue)
    inputs: tuple[TensorMeta, ...]  # of the dynamic inputs, in slot order
    output: tuple[int, ...]  # the shape of the first result
    dtype: str  # the first result's ("" without one)
    result: onednn_primitive.ResultSlot | None  # see bind()

    @property
    def low(self) -> bool:
        """Some dynamic input is fp16/bf16."""
        return any(meta.dtype in LOW_DTYPES for meta in self.inputs)

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


class _PrimitiveCall:
    """The primitive a tactic on oneDNN's primitives creates for a layer, not yet created: its
    class, its precision as :mod:`harness.engines.capability` names it, and its arguments."""

    def __init__(self, make: _PrimitiveClass, precision: str, *args: Any, **kwargs: Any) -> None:
        self.make, self.precision, self.args, self.kwargs = make, precision, args, kwargs

    def make_it(self) -> Bound:
        return self.make(*self.args, **self.kwargs)


_PrimitiveClass = type[onednn_primitive._Primitive] | type[onednn_attention.Attention]


def _direct(ctx: _Ctx) -> Bound:
    return ctx.call()


def _reshape(ctx: _Ctx) -> Bound:
    return make_call(torch.ops.aten.reshape.default, [ctx.named["self"], ctx.named["size"]], {})


def _conv(layout: torch.memory_format) -> Callable[[_Ctx], Bound]:
    def binder(ctx: _Ctx) -> Bound:
        base = ctx.call(weight=ctx.named["weight"].contiguous(memory_format=layout))
        return _with_epilogue(
            lambda x: base(x.contiguous(memory_format=layout)), ctx.epilogue, ctx.residual
        )

    return binder


def _conv_native(ctx: _Ctx) -> Bound:
    """ATen's own im2col convolution (``thnn_conv2d``, or ``slow_conv_dilated2d``
    when dilated), one call per group as ATen splits it, never oneDNN.

    The kernels are called by name rather than through ``conv2d`` with
    ``torch.backends.mkldnn.enabled`` turned off: that switch is process-wide,
    so a run flipping it would move every other thread's matmuls and
    convolutions off oneDNN (other kernels, other bits) for the length of the
    call. NNPACK, which ATen may pick instead for batches of 16 and more, is
    not this tactic.
    """
    named = ctx.named
    padding, stride, dilation = (_pair(named[k]) for k in ("padding", "stride", "dilation"))
    groups, bias = int(named["groups"]), named["bias"]
    weight = named["weight"].contiguous()
    kernel = list(weight.shape[2:])
    native: Callable[..., torch.Tensor] = torch.ops.aten.thnn_conv2d.default
    extra: list[list[int]] = []
    if dilation != [1, 1]:
        native, extra = torch.ops.aten.slow_conv_dilated2d.default, [dilation]
    weights = weight.chunk(groups)
    biases = [None] * groups if bias is None else list(bias.chunk(groups))

    def conv(x: torch.Tensor) -> torch.Tensor:
        parts = x.contiguous().chunk(groups, dim=1)
        outs = [
            native(part, w, kernel, b, stride, padding, *extra)
            for part, w, b in zip(parts, weights, biases, strict=True)
        ]
        return outs[0] if groups == 1 else torch.cat(outs, dim=1)

    return _with_epilogue(conv, ctx.epilogue, ctx.residual)


def _conv_onednn(ctx: _Ctx) -> Bound:
    """oneDNN convolution on a weight reordered once into its blocked layout, activation
    (and residual add) fused as post-ops: one pass over the output."""
    named = ctx.named
    padding, stride, dilation = (_pair(named[k]) for k in ("padding", "stride", "dilation"))
    groups, bias = int(named["groups"]), named["bias"]
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        named["weight"], padding, stride, dilation, groups, list(ctx.input_shape)
    )
    attr, algorithm = _EPILOGUES[ctx.epilogue].onednn
    if ctx.residual:
        binary = torch.ops.mkldnn._convolution_pointwise.binary._op
        unary = None if attr == "none" else attr
        return lambda x, r: binary(
            x.contiguous(memory_format=_CL), r, packed, bias, padding, stride, dilation, groups,
            "add", None, unary, [], algorithm,
        )
    conv = torch.ops.mkldnn._convolution_pointwise.default._op
    return lambda x: conv(
        x.contiguous(memory_format=_CL),
        packed,
        bias,
        padding,
        stride,
        dilation,
        groups,
        attr,
        [],
        algorithm,
    )


def _onednn_graph(
    op: Callable[..., torch.Tensor],
    layout: torch.memory_format,
    attr_names: tuple[str, ...],
    widened: bool = False,
) -> Callable[[_Ctx], Bound]:
    """The layer as a compiled oneDNN Graph partition (:mod:`harness.engines.cpu.onednn_graph`),
    on ``layout``-contiguous inputs; ``widened``, computed in fp32 and rounded once."""

    def binder(ctx: _Ctx) -> Bound:
        named = ctx.named
        layouts = [onednn_graph.input_meta(m.shape, m.dtype, layout) for m in ctx.inputs]
        return onednn_graph.compile_layer(
            ctx.name,
            op,
            named["weight"],
            named["bias"],
            [named[k] for k in attr_names],
            _EPILOGUES[ctx.epilogue].traced,
            layouts,
            layout,
            widened,
        )

    return binder


def _row_gemm(
    ctx: _Ctx, weight: torch.Tensor, kind: str, rows: int
) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """``x2 (rows, K) -> x2 @ weight.T + bias`` for a 2-D ``weight`` (N, K), and whether it applies the epilogue.

    ``mm``: ``addmm`` on the weight transposed once to (K, N), so both GEMM
    operands are read row-major. ``widen``: the same in fp32 on operands
    widened exactly from fp16/bf16 (their products are exact in fp32), then
    one rounding to the layer's dtype: the numbers of a low-precision GEMM
    with fp32 accumulation, at fp32 kernel speed, which wins on layers too
    small to amortize a low-precision kernel's call. ``onednn``: oneDNN's
    GEMM on a weight prepacked for ``rows`` rows, the activation fused unless
    a residual must be added first.
    """
    bias = ctx.named["bias"]
    if kind == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)
        fused = not ctx.residual
        attr, algorithm = _EPILOGUES[ctx.epilogue if fused else ""].onednn
        linear = torch.ops.mkldnn._linear_pointwise.default._op
        return (lambda x2: linear(x2, packed, bias, attr, [], algorithm)), fused
    mm, addmm = torch.mm, torch.addmm
    if kind == "widen":
        wt = weight.float().t().contiguous()
        wide_bias = None if bias is None else _bias_rows(bias.float(), rows)

        def widened(x2: torch.Tensor) -> torch.Tensor:
            xf = x2.float()
            return (mm(xf, wt) if wide_bias is None else addmm(wide_bias, xf, wt)).to(x2.dtype)

        return widened, False
    wt = weight.t().contiguous()
    if bias is None:
        return (lambda x2: mm(x2, wt)), False
    rows_bias = _bias_rows(bias, rows)
    if ctx.epilogue == "relu" and not ctx.residual:
        # ATen's CPU kernel is addmm then relu_ in place: the same bits, one dispatch fewer.
        addmm_relu = torch._addmm_activation
        return (lambda x2: addmm_relu(rows_bias, x2, wt)), True
    return (lambda x2: addmm(rows_bias, x2, wt)), False


# The largest bias _bias_rows expands: past this the copy no longer stays in cache anyway.
_BIAS_ROWS_BYTES = 1 << 18


def _bias_rows(bias: torch.Tensor, rows: int) -> torch.Tensor:
    """``bias`` expanded once to the GEMM result's ``rows``, where that is small.

    ``addmm`` first copies its bias into the result; a broadcast (stride-0)
    bias makes that a strided copy that costs about a microsecond, as much as
    the kernel of a small layer's GEMM, where a materialized one is a plain
    copy. The sums are the same, so are the bits.
    """
    if rows * bias.numel() * bias.element_size() > _BIAS_ROWS_BYTES:
        return bias
    return bias.expand(rows, bias.numel()).contiguous()


def _gemm_rows(kind: str) -> Callable[[_Ctx], Bound]:
    """A linear layer as one 2-D GEMM over its input's rows (see :func:`_row_gemm`)."""

    def binder(ctx: _Ctx) -> Bound:
        weight = ctx.named["weight"]
        n, k = int(weight.shape[0]), int(weight.shape[1])
        gemm, fused = _row_gemm(ctx, weight, kind, math.prod(ctx.input_shape[:-1]))
        shape = (*ctx.input_shape[:-1], n)  # engine shapes are static

        def linear(x: torch.Tensor) -> torch.Tensor:
            return gemm(x.reshape(-1, k)).view(shape)

        return _with_epilogue(gemm if len(shape) == 2 else linear, "" if fused else ctx.epilogue, ctx.residual)

    return binder


def _conv1x1(kind: str) -> Callable[[_Ctx], Bound]:
    """A 1x1 convolution as one GEMM over the pixels of a channels-last tensor.

    ``(N*H*W, Cin) @ (Cin, Cout)`` reads the channels-last input in place and
    writes the channels-last output in place (the GEMM's rows are the
    pixels), so the layer costs one GEMM call: no convolution primitive, whose
    per-call setup dominates the small 1x1 layers of mobile networks. The
    arithmetic is the convolution's (same products, accumulated by the GEMM),
    so only the summation order differs. ``kind`` as in :func:`_row_gemm`.
    """

    def binder(ctx: _Ctx) -> Bound:
        weight = ctx.named["weight"]
        cout, cin = int(weight.shape[0]), int(weight.shape[1])
        step_h, step_w = _pair(ctx.named["stride"])
        strided = (step_h, step_w) != (1, 1)
        batch, _, height, width = ctx.input_shape  # engine shapes are static
        pixels = (batch, len(range(0, height, step_h)), len(range(0, width, step_w)))
        rows = math.prod(pixels)
        gemm, fused = _row_gemm(ctx, weight.reshape(cout, cin), kind, rows)
        out_shape = (batch, cout, pixels[1], pixels[2])
        out_strides = torch.empty(out_shape, device="meta", memory_format=_CL).stride()

        # A channels-last-contiguous tensor's memory is dense N,H,W,C whatever the strides
        # of its size-1 dimensions, so one as_strided is the (rows, C) view (and back),
        # where permute + reshape cost two dispatches each way.
        def pointwise(x: torch.Tensor) -> torch.Tensor:
            if strided:
                x = x[:, :, ::step_h, ::step_w]
            rows_in = x.contiguous(memory_format=_CL).as_strided((rows, cin), (cin, 1))
            return gemm(rows_in).as_strided(out_shape, out_strides)

        return _with_epilogue(pointwise, "" if fused else ctx.epilogue, ctx.residual)

    return binder


def _gemm_direct(ctx: _Ctx) -> Bound:
    if ctx.packet == "linear" and isinstance(ctx.named["weight"], torch.Tensor):
        return _with_epilogue(
            ctx.call(weight=ctx.named["weight"].contiguous()), ctx.epilogue, ctx.residual
        )
    return ctx.call()


def _gemm_onednn(ctx: _Ctx) -> Bound:
    """oneDNN GEMM on a weight reordered once for this batch size, activation fused
    (a residual is added by oneDNN too, the activation then in place)."""
    rows = math.prod(ctx.input_shape[:-1])
    packed = torch.ops.mkldnn._reorder_linear_weight(ctx.named["weight"], rows)
    bias = ctx.named["bias"]
    if ctx.residual:
        binary = torch.ops.mkldnn._linear_pointwise.binary._op
        post = _EPILOGUES[ctx.epilogue].in_place
        if post is None:
            return lambda x, r: binary(x, r, packed, bias, "add")
        return lambda x, r: post(binary(x, r, packed, bias, "add"))
    attr, algorithm = _EPILOGUES[ctx.epilogue].onednn
    linear = torch.ops.mkldnn._linear_pointwise.default._op
    return lambda x: linear(x, packed, bias, attr, [], algorithm)


def _gemm_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's matmul primitive through its C API (:mod:`harness.engines.cpu.onednn_primitive`):
    weight prepacked, bias, residual and activation fused, one rounding."""
    return _PrimitiveCall(
        onednn_primitive.Matmul,
        ctx.dtype,
        ctx.named["weight"],
        ctx.named["bias"],
        ctx.input_shape,
        _EPILOGUES[ctx.epilogue].primitive,
        dtype_from_name(ctx.inputs[-1].dtype) if ctx.residual else None,
        ctx.result,
    )


def _conv_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's convolution primitive through its C API, channels-last in and out: weight
    prepacked, bias, residual and activation fused, one rounding."""
    named = ctx.named
    stride, padding, dilation = (_pair(named[k]) for k in ("stride", "padding", "dilation"))
    return _PrimitiveCall(
        onednn_primitive.Convolution,
        ctx.dtype,
        named["weight"],
        named["bias"],
        ctx.input_shape,
        stride,
        padding,
        dilation,
        int(named["groups"]),
        _EPILOGUES[ctx.epilogue].primitive,
        dtype_from_name(ctx.inputs[-1].dtype) if ctx.residual else None,
        ctx.result,
    )


def _widened(ctx: _Ctx) -> Bound:
    """The layer's op on its fp16/bf16 operands widened exactly to fp32 (constants once), the
    residual and activation added in fp32, the result rounded once to the layer's type: what a
    native low-precision kernel computes (exact products, fp32 accumulation), on fp32 kernels."""
    wide = {k: v.float() for k, v in ctx.named.items() if isinstance(v, torch.Tensor) and v.dtype in _LOW_TORCH}
    base = ctx.call(**wide)
    post = _EPILOGUES[ctx.epilogue].in_place
    dtype = dtype_from_name(ctx.dtype)
    operands = len(ctx.inputs) - ctx.residual

    def widened(*d: Any) -> Any:
        y = base(*(t.float() if t.dtype in _LOW_TORCH else t for t in d[:operands]))
        if ctx.residual:
            y = y.add_(d[operands])
        if post is not None:
            y = post(y)
        return y.to(dtype)

    return widened


def _gemm_widened(ctx: _Ctx) -> Bound:
    """A linear layer as one widened row GEMM (:func:`_row_gemm`); any other matmul widened whole."""
    if ctx.packet == "linear" and isinstance(ctx.named["weight"], torch.Tensor):
        return _gemm_rows("widen")(ctx)
    return _widened(ctx)


def _with_epilogue(fn: Bound, epilogue: str, residual: bool = False) -> Bound:
    """``fn``'s result plus the residual (the layer's last input), then the activation.

    Both work in place on the layer's fresh result: the same additions and
    roundings as the separate add and activation layers, without a new tensor
    for each.
    """
    post = _EPILOGUES[epilogue].in_place
    # Layers with an epilogue or a residual have one other dynamic input (convolutions
    # and linear layers with constant weights), so these wrappers take it alone.
    if residual:
        if post is None:
            return lambda x, r: fn(x).add_(r)
        return lambda x, r: post(fn(x).add_(r))
    if post is None:
        return fn
    return lambda x: post(fn(x))


def _split_k(parts: int) -> Callable[[_Ctx], Bound]:
    """Partial GEMMs over ``parts`` chunks of K, summed in another order than the direct kernel.

    Each partial product runs in the layer's dtype (that is where the speed is);
    for fp16/bf16 layers the partials are summed in fp32 and rounded once, so the
    tactic changes the last bits without adding a rounding per chunk.
    """

    def binder(ctx: _Ctx) -> Bound:
        if ctx.packet == "linear":
            return _with_epilogue(_split_linear(ctx, parts), ctx.epilogue, ctx.residual)
        a_name, b_name = _GEMM_OPERANDS[ctx.packet]
        get_a, get_b = _getter(ctx.named[a_name]), _getter(ctx.named[b_name])
        get_bias = _getter(ctx.named["self"]) if ctx.packet == "addmm" else None
        first, rest = _SPLIT_FNS[ctx.packet]
        product = _PRODUCT_FNS[ctx.packet]
        low = ctx.low

        def split(*d: Any) -> Any:
            a, b = get_a(d), get_b(d)
            chunks = _chunks(a.shape[-1], parts)
            s0 = chunks[0]
            out = (
                first(get_bias(d), a[..., s0], b[..., s0, :])
                if get_bias
                else first(a[..., s0], b[..., s0, :])
            )
            if low:
                return _sum_in_fp32(out, (product(a[..., s], b[..., s, :]) for s in chunks[1:]))
            for s in chunks[1:]:
                out = rest(out, a[..., s], b[..., s, :])
            return out

        return split

    return binder


def _sum_in_fp32(first: torch.Tensor, partials: Iterable[torch.Tensor]) -> torch.Tensor:
    acc = first.float()
    for p in partials:
        acc.add_(p)
    return acc.to(first.dtype)


def _split_linear(ctx: _Ctx, parts: int) -> Bound:
    weight, bias = ctx.named["weight"], ctx.named["bias"]
    n, k = weight.shape
    wt = weight.t().contiguous()
    pieces = [(s, wt[s]) for s in _chunks(k, parts)]
    (s0, w0), rest = pieces[0], pieces[1:]
    low = ctx.low

    def split(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, k)
        out = torch.mm(x2[:, s0], w0) if bias is None else torch.addmm(bias, x2[:, s0], w0)
        if low:
            out = _sum_in_fp32(out, (torch.mm(x2[:, s], w) for s, w in rest))
        else:
            for s, w in rest:
                out = torch.addmm(out, x2[:, s], w)
        return out.reshape(*x.shape[:-1], n)

    return split


def avg_pool_window(node: Node, metas: Mapping[str, TensorMeta]) -> tuple[int, ...] | None:
    """The window of the fixed-window pooling that an adaptive average pooling equals, where
    its output size divides its input's (a squeeze-excite block's global pooling), else None.

    The two compute the same means; ATen's fixed-window kernel is the faster
    on channels-last inputs (a 1x576x7x7 global pooling: 3.5 µs against
    6.4 µs, an AMD EPYC, one thread), and PyTorch's oneDNN Graph bridge maps
    only that one to oneDNN.
    """
    if plan_packet(node.op) != "adaptive_avg_pool2d" or node.outputs[0] is None:
        return None
    return _window(metas[node.refs()[0].name].shape[-2:], node.outputs[0].shape[-2:])


def _window(size: Sequence[int], out: Sequence[int]) -> tuple[int, ...] | None:
    if any(i % o for i, o in zip(size, out, strict=True)):
        return None
    return tuple(i // o for i, o in zip(size, out, strict=True))


def window_pool(window: tuple[int, ...]) -> Bound:
    """The fixed-window average pooling of :func:`avg_pool_window`."""
    return functools.partial(_F.avg_pool2d, kernel_size=window, stride=window)


def _pool_window(ctx: _Ctx) -> Bound:
    return window_pool(_ctx_window(ctx))


def _pool_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's pooling primitive through its C API, channels-last in and out: from a
    convolution's result into the next one's input without leaving oneDNN's layout (a
    1x16x56x56 global pooling: 6.9 µs against 13.7 µs for ATen's, an AMD EPYC, one thread)."""
    dtype = dtype_from_name(ctx.inputs[0].dtype)
    return _PrimitiveCall(onednn_primitive.Pooling, ctx.dtype, dtype, ctx.input_shape, _ctx_window(ctx), ctx.result)


def _binary_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's binary primitive through its C API, channels-last in and out (see
    :class:`harness.engines.cpu.onednn_primitive.Binary`): the operand of the result's shape
    first, whichever the layer lists first."""
    first, second = (meta.shape for meta in ctx.inputs)
    scale_first = tuple(first) != tuple(ctx.output)
    return _PrimitiveCall(
        onednn_primitive.Binary,
        ctx.dtype,
        _BINARY_ALGORITHMS[ctx.packet],
        dtype_from_name(ctx.inputs[0].dtype),
        ctx.output,
        first if scale_first else second,
        ctx.result,
        scale_first=scale_first,
    )


def _cast_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's reorder between float types through its C API, plain layout in and out (see
    :class:`harness.engines.cpu.onednn_primitive.Cast`)."""
    source = ctx.inputs[0].dtype
    conversion = f"{source}>{dtype_name(ctx.named['dtype'])}"
    return _PrimitiveCall(
        onednn_primitive.Cast, conversion, dtype_from_name(source), ctx.named["dtype"], ctx.input_shape, ctx.result
    )


def _layernorm_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """oneDNN's layer normalization through its C API, plain layout in and out (see
    :class:`harness.engines.cpu.onednn_primitive.LayerNorm`)."""
    named = ctx.named
    return _PrimitiveCall(
        onednn_primitive.LayerNorm,
        ctx.dtype,
        dtype_from_name(ctx.inputs[0].dtype),
        ctx.input_shape,
        named["weight"],
        named["bias"],
        named["eps"],
        ctx.result,
    )


def _sdpa_dnnl(ctx: _Ctx) -> _PrimitiveCall:
    """Attention on three oneDNN primitives through its C API, on the operands' strides (see
    :class:`harness.engines.cpu.onednn_attention.Attention`)."""
    q, k, v = (meta.shape for meta in ctx.inputs)
    dtype, named = dtype_from_name(ctx.inputs[0].dtype), ctx.named
    return _PrimitiveCall(
        onednn_attention.Attention,
        ctx.dtype,
        dtype,
        q,
        k,
        v,
        named["scale"],
        mask=named["attn_mask"],
        causal=bool(named["is_causal"]),
    )


def _ctx_window(ctx: _Ctx) -> tuple[int, ...]:
    window = _window(ctx.input_shape[-2:], ctx.output[-2:])
    assert window is not None, "offered only where the output divides the input"
    return window


def _softmax(ctx: _Ctx) -> Bound:
    dim = ctx.named["dim"]
    log = "log" in ctx.packet

    def decomposed(x: torch.Tensor) -> torch.Tensor:
        shifted = x - x.amax(dim, keepdim=True)
        e = shifted.exp()
        if log:
            return shifted - e.sum(dim, keepdim=True).log()
        return e / e.sum(dim, keepdim=True)

    return decomposed


def _layer_norm(ctx: _Ctx) -> Bound:
    """mean/var formula; statistics in fp32 for fp16/bf16 input, as the fused kernel does."""
    dims = tuple(range(-len(ctx.named["normalized_shape"]), 0))
    eps = float(ctx.named["eps"])
    weight, bias = ctx.named["weight"], ctx.named["bias"]
    low = ctx.low
    if low:
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()

    def decomposed(x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if low else x
        centered = xf - xf.mean(dims, keepdim=True)
        y = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)

    return decomposed


def _sdpa_math(ctx: _Ctx) -> Bound:
    """Explicit attention: scores in the input dtype, softmax in fp32, then @ v. A query
    whose every key is masked gets zeros, as from ATen (its softmax alone would give NaN)."""
    get_mask = _getter(ctx.named["attn_mask"])
    causal, scale = bool(ctx.named["is_causal"]), ctx.named["scale"]
    # From the static shape, so that a region traces a constant (engine shapes are static).
    factor = scale if scale is not None else 1.0 / math.sqrt(ctx.input_shape[-1])

    def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *d: Any) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)).float() * factor
        mask = get_mask((q, k, v, *d))
        if causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if mask is None:
            return scores.softmax(-1).to(q.dtype) @ v
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(-1).masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
        return probs.to(q.dtype) @ v

    return math_attention


def _getter(value: Any) -> Callable[[tuple[Any, ...]], Any]:
    """Read a template value at call time: a dynamic input by slot, or the constant."""
    if isinstance(value, Slot):
        index = value.index
        return lambda d: d[index]
    return lambda d: value


def _pair(value: Any) -> list[int]:
    """A conv attribute as the two-element list oneDNN wants (ATen also accepts 1 or an int)."""
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    return values * 2 if len(values) == 1 else values


def _dnnl_fits(
    node: Node, named: Mapping[str, Any], metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> bool:
    """A linear layer or convolution whose input, weight and result share a precision oneDNN computes in."""
    precision = node.out().dtype
    return (
        precision in _DNNL_PRECISIONS
        and metas[named["input"].name].dtype == precision
        and dtype_name(weights[named["weight"].name].dtype) == precision
    )


def _binary_fits(node: Node, named: Mapping[str, Any], metas: Mapping[str, TensorMeta]) -> bool:
    """Two computed 4-D operands of the result's precision, one of the result's shape and the
    other broadcast over it."""
    operands = [named["self"], named["other"]]
    if node.multi or not all(isinstance(o, Ref) for o in operands):
        return False
    out = node.out()
    first, second = (metas[o.name] for o in operands)
    if out.dtype not in _DNNL_PRECISIONS or first.dtype != out.dtype or second.dtype != out.dtype:
        return False
    shape = tuple(out.shape)
    return (tuple(first.shape) == shape and onednn_primitive.broadcasts(shape, second.shape)) or (
        tuple(second.shape) == shape and onednn_primitive.broadcasts(shape, first.shape)
    )


def _layernorm_fits(node: Node, named: Mapping[str, Any], metas: Mapping[str, TensorMeta]) -> bool:
    """A computed input normalized over its last dimension alone, into its own type."""
    source = named["input"]
    if node.multi or not isinstance(source, Ref) or len(named["normalized_shape"]) != 1:
        return False
    meta = metas[source.name]
    return (
        2 <= len(meta.shape) <= onednn_primitive.MAX_DIMS
        and meta.dtype == node.out().dtype
        and meta.dtype in _DNNL_PRECISIONS
    )


def _cast_fits(node: Node, named: Mapping[str, Any], metas: Mapping[str, TensorMeta]) -> bool:
    """A computed float tensor converted to another float type and nothing else (no device,
    layout or memory format asked for)."""
    source = named["self"]
    if node.multi or not isinstance(source, Ref) or not isinstance(named["dtype"], torch.dtype):
        return False
    if named["memory_format"] not in (None, torch.preserve_format) or any(
        named[k] is not None for k in ("layout", "device", "pin_memory")
    ):
        return False
    meta = metas[source.name]
    target = dtype_name(named["dtype"])
    return (
        1 <= len(meta.shape) <= onednn_primitive.MAX_DIMS
        and meta.dtype in _DNNL_PRECISIONS
        and target in _DNNL_PRECISIONS
        and meta.dtype != target
    )


def _sdpa_fits(
    node: Node, named: Mapping[str, Any], metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> bool:
    """An attention with a constant mask or none, its three inputs and result of one precision
    and of shapes :class:`~harness.engines.cpu.onednn_attention.Attention` takes."""
    mask = named["attn_mask"]
    if isinstance(mask, Ref) or node.multi:
        return False
    q, k, v = (metas[named[a].name] for a in ("query", "key", "value"))
    precision = node.out().dtype
    if precision not in _DNNL_PRECISIONS or not (
        q.dtype == k.dtype == v.dtype == precision and onednn_attention.fits(q.shape, k.shape, v.shape)
    ):
        return False
    scores = (*q.shape[:-1], k.shape[-2])
    try:
        onednn_attention.additive_mask(scores, None if mask is None else weights[mask.name], named["is_causal"])
    except HarnessError:
        return False
    return True


# The types oneDNN's primitives compute in.
_DNNL_PRECISIONS = frozenset(capability.PRECISIONS)


def _linear_ok(named: Mapping[str, Any]) -> bool:
    """A linear layer with a constant 2-D weight and bias, fed by a computed input."""
    return (
        isinstance(named["input"], Ref)
        and isinstance(named["weight"], WeightRef)
        and not isinstance(named["bias"], Ref)
    )


def _chunks(k: int, parts: int) -> list[slice]:
    bounds = [k * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _reduction_size(
    packet: str,
    named: Mapping[str, Any],
    metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
) -> int:
    """K of a GEMM node, or 0 when the node is not a plain 2-operand GEMM split-K can cut."""

    def shape(value: Any) -> tuple[int, ...] | None:
        if isinstance(value, Ref):
            return metas[value.name].shape
        if isinstance(value, WeightRef):
            return tuple(weights[value.name].shape)
        return None

    a_name, b_name = _GEMM_OPERANDS[packet]
    a, b = shape(named[a_name]), shape(named[b_name])
    if a is None or b is None or len(a) < 1 or len(b) < 2:
        return 0
    if packet == "linear":
        return (
            b[1]
            if isinstance(named["weight"], WeightRef) and isinstance(named["input"], Ref)
            else 0
        )
    if packet == "addmm" and (named["beta"] != 1 or named["alpha"] != 1):
        return 0
    if packet == "matmul" and len(a) < 2:
        return 0
    return a[-1]


# op -> (first operand, second operand) names in its schema
_GEMM_OPERANDS = {
    "linear": ("input", "weight"),
    "addmm": ("mat1", "mat2"),
    "mm": ("self", "mat2"),
    "bmm": ("self", "mat2"),
    "matmul": ("self", "other"),
}
# op -> (first partial product, accumulate a further partial into out)
_SPLIT_FNS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "addmm": (torch.addmm, torch.addmm),
    "mm": (torch.mm, torch.addmm),
    "bmm": (torch.bmm, torch.baddbmm),
    "matmul": (torch.matmul, lambda out, a, b: out + torch.matmul(a, b)),
}
_PRODUCT_FNS: dict[str, Callable[..., Any]] = {
    "addmm": torch.mm,
    "mm": torch.mm,
    "bmm": torch.bmm,
    "matmul": torch.matmul,
}
_SOFTMAX_LOG = ("softmax", "_softmax", "log_softmax", "_log_softmax")
# Precisions whose products are exact in fp32, so a widened GEMM keeps their numbers.
_WIDENABLE = frozenset(LOW_DTYPES)
_LOW_TORCH = frozenset(dtype_from_name(name) for name in LOW_DTYPES)


@dataclass(frozen=True)
class _Epilogue:
    """How each kind of tactic applies one epilogue activation."""

    in_place: Callable[[torch.Tensor], torch.Tensor] | None  # on the layer's fresh result
    traced: Callable[[torch.Tensor], torch.Tensor] | None  # out of place, in a traced oneDNN graph
    onednn: tuple[str, str]  # oneDNN post-op (attr, algorithm)
    primitive: Eltwise | None  # oneDNN's own eltwise post-op, through its C API
    graph: bool = True  # whether PyTorch's oneDNN Graph bridge computes ``traced`` as written


_F = torch.nn.functional


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return _F.gelu(t, approximate="tanh")


_EPILOGUES = {
    "": _Epilogue(None, None, ("none", ""), None),
    # The layer's result is a fresh tensor: in place is safe.
    "relu": _Epilogue(torch.relu_, _F.relu, ("relu", ""), Eltwise("relu")),
    "gelu": _Epilogue(_F.gelu, _F.gelu, ("gelu", "none"), Eltwise("gelu_erf")),
    # PyTorch's oneDNN Graph bridge maps gelu(approximate="tanh") to the erf gelu (0.0005 off).
    "gelu_tanh": _Epilogue(_gelu_tanh, _gelu_tanh, ("gelu", "tanh"), Eltwise("gelu_tanh"), graph=False),
    # x * clamp(x/6 + 1/2, 0, 1) and clamp(x/6 + 1/2, 0, 1): oneDNN's alpha and beta.
    "hardswish": _Epilogue(torch._C._nn.hardswish_, _F.hardswish, ("hardswish", ""), Eltwise("hardswish", 1 / 6, 0.5)),
    "hardsigmoid": _Epilogue(
        torch._C._nn.hardsigmoid_, _F.hardsigmoid, ("hardsigmoid", ""), Eltwise("hardsigmoid", 1 / 6, 0.5)
    ),
}
assert all(e.primitive for name, e in _EPILOGUES.items() if name), "the primitives fuse every epilogue as a post-op"
_CONV_EPILOGUES = ("relu", "hardswish", "hardsigmoid")
_CONV_ATTRS = ("stride", "padding", "dilation", "groups")
_LINEAR_EPILOGUES = ("relu", "gelu", "gelu_tanh", "hardswish", "hardsigmoid")

_BINDERS: dict[str, Callable[[_Ctx], Bound]] = {
    "direct": _direct,
    "reshape": _reshape,
    "conv_nchw": _conv(torch.contiguous_format),
    "conv_channels_last": _conv(_CL),
    "conv_no_mkldnn": _conv_native,
    "conv_onednn": _conv_onednn,
    "conv_onednn_graph": _onednn_graph(torch.conv2d, _GRAPH_LAYOUTS["conv"], _CONV_ATTRS),
    "conv_onednn_graph_widened": _onednn_graph(torch.conv2d, _GRAPH_LAYOUTS["conv"], _CONV_ATTRS, widened=True),
    "conv1x1_gemm": _conv1x1("mm"),
    "conv1x1_widened": _conv1x1("widen"),
    "conv1x1_onednn": _conv1x1("onednn"),
    "gemm_nn": _gemm_rows("mm"),
    "gemm_widened": _gemm_widened,
    "conv_widened": _widened,
    "gemm_direct": _gemm_direct,
    "gemm_onednn": _gemm_onednn,

    "gemm_onednn_graph": _onednn_graph(_F.linear, _GRAPH_LAYOUTS["gemm"], ()),
    "gemm_onednn_graph_widened": _onednn_graph(_F.linear, _GRAPH_LAYOUTS["gemm"], (), widened=True),
    "gemm_splitk2": _split_k(2),
    "gemm_splitk4": _split_k(4),
    "pool_window": _pool_window,

    "softmax_fused": _direct,
    "softmax_decomposed": _softmax,
    "layernorm_fused": _direct,
    "layernorm_decomposed": _layer_norm,
    "sdpa_fused": _direct,
    "sdpa_math": _sdpa_math,
}
# The tactics on oneDNN's primitives: the primitive each layer's tactic creates.
_PRIMITIVE_CALLS: dict[str, Callable[[_Ctx], _PrimitiveCall]] = {
    PRIMITIVE_GEMM: _gemm_dnnl,
    PRIMITIVE_CONV: _conv_dnnl,
    PRIMITIVE_POOL: _pool_dnnl,
    PRIMITIVE_BINARY: _binary_dnnl,
    PRIMITIVE_CAST: _cast_dnnl,
    PRIMITIVE_LNORM: _layernorm_dnnl,
    SDPA_DNNL: _sdpa_dnnl,
}


def _made(call: Callable[[_Ctx], _PrimitiveCall]) -> Callable[[_Ctx], Bound]:
    return lambda ctx: call(ctx).make_it()


_BINDERS.update({impl: _made(call) for impl, call in _PRIMITIVE_CALLS.items()})


def _named(node: Node) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in; unknown keywords are refused."""
    fn = runnable_op(node.op, f"layer {node.name!r}")
    arguments = fn._schema.arguments  # type: ignore[attr-defined]
    names = {a.name for a in arguments}
    unknown = sorted(set(node.kwargs) - names)
    if unknown or len(node.args) > len(arguments):
        raise HarnessError(
            f"layer {node.name!r}: arguments do not match {node.op} ({', '.join(unknown) or 'too many'})"
        )
    named: dict[str, Any] = {}
    for i, arg in enumerate(arguments):
        if i < len(node.args) and not arg.kwarg_only:
            named[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            named[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def _pointwise_conv(packet: str, named: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> bool:
    """A 1x1, unpadded, ungrouped 2-D convolution (any stride): a GEMM over pixels."""
    weight = named["weight"]
    if packet != "conv2d" or not isinstance(weight, WeightRef) or isinstance(named["padding"], str):
        return False
    shape = tuple(weights[weight.name].shape)
    return len(shape) == 4 and shape[2:] == (1, 1) and int(named["groups"]) == 1 and not any(
        _pair(named["padding"])
    )


def _conv_ok(node: Node, named: Mapping[str, Any]) -> bool:
    return (
        isinstance(named["input"], Ref)
        and isinstance(named["weight"], WeightRef)
        and not isinstance(named["bias"], Ref)
        and len(node.out().shape) == 4
        and not named.get("transposed", False)
    )
