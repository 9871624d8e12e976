"""The GEMM family: linear layers and ATen's other matmuls (addmm, mm, bmm, matmul).

Every matmul runs as ATen's call or split-K (partial products over chunks of
the reduction dimension, summed in another order). A linear layer with a
constant weight also runs as one row GEMM on a weight transposed once, widened
exactly to fp32 and rounded once (fp16/bf16), on torch's oneDNN op with a
prepacked weight, as a oneDNN Graph partition, and on oneDNN's matmul
primitive; its epilogue and residual are applied by every one of them.
Where torch emulates the layer's type, any matmul also runs widened.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from harness.dtypes import LOW_DTYPES, dtype_from_name
from harness.engines.cpu import onednn_primitive
from harness.engines.cpu.epilogues import EPILOGUES, with_epilogue
from harness.engines.cpu.families import graph
from harness.engines.cpu.plan import Ref, WeightRef
from harness.engines.cpu.tactic import (
    Bound,
    Check,
    Ctx,
    Family,
    Layer,
    PrimitiveCall,
    Tactic,
    aten_native,
    emulated,
    every,
    getter,
    onednn_operands,
    primitive_call,
    primitive_tactic,
    widenable,
)

# op -> (first operand, second operand) names in its schema
OPERANDS = {
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
# Smallest reduction-chunk a split-K tactic may use: below it the extra
# partial-sum traffic can only lose, so the candidate is not worth timing.
MIN_SPLIT_CHUNK = 16
_LOW_TORCH = frozenset(dtype_from_name(name) for name in LOW_DTYPES)
# The largest bias _bias_rows expands: past this the copy no longer stays in cache anyway.
_BIAS_ROWS_BYTES = 1 << 18


def linear_ok(named: dict[str, Any]) -> bool:
    """A linear layer with a constant 2-D weight and bias, fed by a computed input."""
    return (
        isinstance(named["input"], Ref)
        and isinstance(named["weight"], WeightRef)
        and not isinstance(named["bias"], Ref)
    )


def _linear(layer: Layer) -> bool:
    return layer.packet == "linear" and linear_ok(layer.named)


def _reduction_size(layer: Layer) -> int:
    """K of a GEMM layer, or 0 when it is not a plain 2-operand GEMM split-K can cut."""
    named, packet = layer.named, layer.packet

    def shape(value: Any) -> tuple[int, ...] | None:
        if isinstance(value, Ref):
            return layer.metas[value.name].shape
        if isinstance(value, WeightRef):
            return tuple(layer.weights[value.name].shape)
        return None

    a_name, b_name = OPERANDS[packet]
    a, b = shape(named[a_name]), shape(named[b_name])
    if a is None or b is None or len(a) < 1 or len(b) < 2:
        return 0
    if packet == "linear":
        return b[1] if isinstance(named["weight"], WeightRef) and isinstance(named["input"], Ref) else 0
    if packet == "addmm" and (named["beta"] != 1 or named["alpha"] != 1):
        return 0
    if packet == "matmul" and len(a) < 2:
        return 0
    return a[-1]


def _splits(parts: int) -> Check:
    """Where K cuts into ``parts`` chunks of at least :data:`MIN_SPLIT_CHUNK`."""
    return lambda layer: _reduction_size(layer) // parts >= MIN_SPLIT_CHUNK


def row_gemm(ctx: Ctx, weight: torch.Tensor, kind: str, rows: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
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
        attr, algorithm = EPILOGUES[ctx.epilogue if fused else ""].onednn
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


def _bias_rows(bias: torch.Tensor, rows: int) -> torch.Tensor:
    """``bias`` expanded once to the GEMM result's ``rows``, where that is small.

    ``addmm`` first copies its bias into the result; a broadcast (stride-0)
    bias makes that a strided copy, slow next to the kernel of a small
    layer's GEMM, where a materialized one is a plain copy. The sums are the
    same, so are the bits.
    """
    if rows * bias.numel() * bias.element_size() > _BIAS_ROWS_BYTES:
        return bias
    return bias.expand(rows, bias.numel()).contiguous()


def _gemm_rows(kind: str) -> Callable[[Ctx], Bound]:
    """A linear layer as one 2-D GEMM over its input's rows (see :func:`row_gemm`)."""

    def binder(ctx: Ctx) -> Bound:
        weight = ctx.named["weight"]
        n, k = int(weight.shape[0]), int(weight.shape[1])
        gemm, fused = row_gemm(ctx, weight, kind, math.prod(ctx.input_shape[:-1]))
        shape = (*ctx.input_shape[:-1], n)  # engine shapes are static

        def linear(x: torch.Tensor) -> torch.Tensor:
            return gemm(x.reshape(-1, k)).view(shape)

        return with_epilogue(gemm if len(shape) == 2 else linear, "" if fused else ctx.epilogue, ctx.residual)

    return binder


def _gemm_direct(ctx: Ctx) -> Bound:
    """ATen's call of the op (a linear layer's on a contiguous weight)."""
    if ctx.packet == "linear" and isinstance(ctx.named["weight"], torch.Tensor):
        return with_epilogue(ctx.call(weight=ctx.named["weight"].contiguous()), ctx.epilogue, ctx.residual)
    return ctx.call()


def _gemm_onednn(ctx: Ctx) -> Bound:
    """oneDNN GEMM on a weight reordered once for this batch size, activation fused
    (a residual is added by oneDNN too, the activation then in place)."""
    rows = math.prod(ctx.input_shape[:-1])
    packed = torch.ops.mkldnn._reorder_linear_weight(ctx.named["weight"], rows)
    bias = ctx.named["bias"]
    if ctx.residual:
        binary = torch.ops.mkldnn._linear_pointwise.binary._op
        post = EPILOGUES[ctx.epilogue].in_place
        if post is None:
            return lambda x, r: binary(x, r, packed, bias, "add")
        return lambda x, r: post(binary(x, r, packed, bias, "add"))
    attr, algorithm = EPILOGUES[ctx.epilogue].onednn
    linear = torch.ops.mkldnn._linear_pointwise.default._op
    return lambda x: linear(x, packed, bias, attr, [], algorithm)


def _gemm_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's matmul primitive through its C API (:class:`harness.engines.cpu.onednn_primitive.Matmul`):
    weight prepacked, bias, residual and activation fused, one rounding."""
    return primitive_call(
        ctx.dtype,
        ctx.named["weight"],
        ctx.named["bias"],
        ctx.input_shape,
        EPILOGUES[ctx.epilogue].primitive,
        ctx.residual_dtype,
        ctx.result,
    )


def widened(ctx: Ctx) -> Bound:
    """The layer's op on its fp16/bf16 operands widened exactly to fp32 (constants once), the
    residual and activation added in fp32, the result rounded once to the layer's type: what a
    native low-precision kernel computes (exact products, fp32 accumulation), on fp32 kernels."""
    wide = {k: v.float() for k, v in ctx.named.items() if isinstance(v, torch.Tensor) and v.dtype in _LOW_TORCH}
    base = ctx.call(**wide)
    post = EPILOGUES[ctx.epilogue].in_place
    dtype = dtype_from_name(ctx.dtype)
    operands = len(ctx.inputs) - ctx.residual

    def run(*d: Any) -> Any:
        y = base(*(t.float() if t.dtype in _LOW_TORCH else t for t in d[:operands]))
        if ctx.residual:
            y = y.add_(d[operands])
        if post is not None:
            y = post(y)
        return y.to(dtype)

    return run


def _gemm_widened(ctx: Ctx) -> Bound:
    """A linear layer as one widened row GEMM (:func:`row_gemm`); any other matmul widened whole."""
    if ctx.packet == "linear" and isinstance(ctx.named["weight"], torch.Tensor):
        return _gemm_rows("widen")(ctx)
    return widened(ctx)


def _split_k(parts: int) -> Callable[[Ctx], Bound]:
    """Partial GEMMs over ``parts`` chunks of K, summed in another order than the direct kernel.

    Each partial product runs in the layer's dtype (that is where the speed is);
    for fp16/bf16 layers the partials are summed in fp32 and rounded once, so the
    tactic changes the last bits without adding a rounding per chunk.
    """

    def binder(ctx: Ctx) -> Bound:
        if ctx.packet == "linear":
            return with_epilogue(_split_linear(ctx, parts), ctx.epilogue, ctx.residual)
        a_name, b_name = OPERANDS[ctx.packet]
        get_a, get_b = getter(ctx.named[a_name]), getter(ctx.named[b_name])
        get_bias = getter(ctx.named["self"]) if ctx.packet == "addmm" else None
        first, rest = _SPLIT_FNS[ctx.packet]
        product = _PRODUCT_FNS[ctx.packet]
        low = ctx.low

        def split(*d: Any) -> Any:
            a, b = get_a(d), get_b(d)
            chunks = _chunks(a.shape[-1], parts)
            s0 = chunks[0]
            out = first(get_bias(d), a[..., s0], b[..., s0, :]) if get_bias else first(a[..., s0], b[..., s0, :])
            if low:
                return _sum_in_fp32(out, (product(a[..., s], b[..., s, :]) for s in chunks[1:]))
            for s in chunks[1:]:
                out = rest(out, a[..., s], b[..., s, :])
            return out

        return split

    return binder


def _chunks(k: int, parts: int) -> list[slice]:
    bounds = [k * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _sum_in_fp32(first: torch.Tensor, partials: Iterable[torch.Tensor]) -> torch.Tensor:
    acc = first.float()
    for p in partials:
        acc.add_(p)
    return acc.to(first.dtype)


def _split_linear(ctx: Ctx, parts: int) -> Bound:
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


_CONTIGUOUS = torch.contiguous_format

GEMM = Family(
    "gemm",
    lambda layer: layer.packet in OPERANDS,
    (
        Tactic("gemm_direct", _gemm_direct, "ATen's call of the op", aten_low=True),
        Tactic("gemm_splitk2", _split_k(2), "partial products over 2 chunks of K", applies=_splits(2), aten_low=True),
        Tactic("gemm_splitk4", _split_k(4), "partial products over 4 chunks of K", applies=_splits(4), aten_low=True),
        Tactic(
            "gemm_nn", _gemm_rows("mm"), "one row GEMM on the weight transposed once", applies=_linear, aten_low=True
        ),
        Tactic(
            "gemm_widened",
            _gemm_widened,
            "on operands widened exactly to fp32, rounded once",
            applies=lambda layer: widenable(layer) and (_linear(layer) or emulated(layer)),
        ),
        Tactic(
            "gemm_onednn",
            _gemm_onednn,
            "torch's oneDNN linear op on a weight prepacked for the row count",
            applies=_linear,
            native=aten_native,
        ),
        *graph.tactics(
            "gemm_onednn_graph", "gemm_onednn_graph_widened", torch.nn.functional.linear, _CONTIGUOUS, (), _linear
        ),
        primitive_tactic(
            onednn_primitive.Matmul,
            _gemm_dnnl,
            "oneDNN's matmul primitive through its C API",
            applies=every(_linear, onednn_operands),
        ),
    ),
)
