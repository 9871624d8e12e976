"""The convolution family: 2-D convolutions with a constant weight and bias, fed by a computed input.

A convolution runs in NCHW or channels-last memory format, without oneDNN
(fp32 only: ATen's reduced-precision fallback is a naive loop), on torch's
oneDNN op with a prepacked weight, as a oneDNN Graph partition, and on
oneDNN's convolution primitive; a 1x1 one also as one GEMM over the pixels of
its channels-last input. Its epilogue and residual are applied by every one of
them. Where torch emulates the layer's type, it also runs widened.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from harness.engines.cpu import onednn_primitive
from harness.engines.cpu.epilogues import EPILOGUES, with_epilogue
from harness.engines.cpu.families import graph
from harness.engines.cpu.families.gemm import row_gemm, widened
from harness.engines.cpu.plan import Node, Ref, WeightRef
from harness.engines.cpu.tactic import (
    Bound,
    Ctx,
    Family,
    Layer,
    PrimitiveCall,
    Tactic,
    aten_native,
    emulated,
    every,
    onednn_operands,
    pair,
    primitive_call,
    primitive_tactic,
    widenable,
)

PACKETS = ("conv2d", "convolution")
_CL = torch.channels_last
_ATTRS = ("stride", "padding", "dilation", "groups")


def conv_ok(node: Node, named: dict[str, Any]) -> bool:
    """A 2-D convolution with a constant weight and bias, fed by a computed input."""
    return (
        isinstance(named["input"], Ref)
        and isinstance(named["weight"], WeightRef)
        and not isinstance(named["bias"], Ref)
        and len(node.out().shape) == 4
        and not named.get("transposed", False)
    )


def _explicit_padding(layer: Layer) -> bool:
    return not isinstance(layer.named["padding"], str)


def _conv2d(layer: Layer) -> bool:
    """A ``conv2d`` with its padding given in numbers: what torch's oneDNN ops and oneDNN take."""
    return layer.packet == "conv2d" and _explicit_padding(layer)


def _pointwise(layer: Layer) -> bool:
    """A 1x1, unpadded, ungrouped 2-D convolution (any stride): a GEMM over pixels."""
    named = layer.named
    weight = named["weight"]
    if layer.packet != "conv2d" or not isinstance(weight, WeightRef) or isinstance(named["padding"], str):
        return False
    shape = tuple(layer.weights[weight.name].shape)
    return len(shape) == 4 and shape[2:] == (1, 1) and int(named["groups"]) == 1 and not any(pair(named["padding"]))


def _conv(layout: torch.memory_format) -> Callable[[Ctx], Bound]:
    """ATen's convolution on input and weight in ``layout``."""

    def binder(ctx: Ctx) -> Bound:
        base = ctx.call(weight=ctx.named["weight"].contiguous(memory_format=layout))
        return with_epilogue(lambda x: base(x.contiguous(memory_format=layout)), ctx.epilogue, ctx.residual)

    return binder


def _conv_native(ctx: Ctx) -> Bound:
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
    padding, stride, dilation = (pair(named[k]) for k in ("padding", "stride", "dilation"))
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

    return with_epilogue(conv, ctx.epilogue, ctx.residual)


def _conv_onednn(ctx: Ctx) -> Bound:
    """oneDNN convolution on a weight reordered once into its blocked layout, activation
    (and residual add) fused as post-ops: one pass over the output."""
    named = ctx.named
    padding, stride, dilation = (pair(named[k]) for k in ("padding", "stride", "dilation"))
    groups, bias = int(named["groups"]), named["bias"]
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        named["weight"], padding, stride, dilation, groups, list(ctx.input_shape)
    )
    attr, algorithm = EPILOGUES[ctx.epilogue].onednn
    if ctx.residual:
        binary = torch.ops.mkldnn._convolution_pointwise.binary._op
        unary = None if attr == "none" else attr
        return lambda x, r: binary(
            x.contiguous(memory_format=_CL), r, packed, bias, padding, stride, dilation, groups,
            "add", None, unary, [], algorithm,
        )  # fmt: skip
    conv = torch.ops.mkldnn._convolution_pointwise.default._op
    return lambda x: conv(
        x.contiguous(memory_format=_CL), packed, bias, padding, stride, dilation, groups, attr, [], algorithm
    )


def _conv_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's convolution primitive through its C API, channels-last in and out
    (:class:`harness.engines.cpu.onednn_primitive.Convolution`): weight prepacked, bias,
    residual and activation fused, one rounding."""
    named = ctx.named
    stride, padding, dilation = (pair(named[k]) for k in ("stride", "padding", "dilation"))
    return primitive_call(
        ctx.dtype,
        named["weight"],
        named["bias"],
        ctx.input_shape,
        stride,
        padding,
        dilation,
        int(named["groups"]),
        EPILOGUES[ctx.epilogue].primitive,
        ctx.residual_dtype,
        ctx.result,
    )


def _conv1x1(kind: str) -> Callable[[Ctx], Bound]:
    """A 1x1 convolution as one GEMM over the pixels of a channels-last tensor.

    ``(N*H*W, Cin) @ (Cin, Cout)`` reads the channels-last input in place and
    writes the channels-last output in place (the GEMM's rows are the
    pixels), so the layer costs one GEMM call: no convolution primitive, whose
    per-call setup dominates the small 1x1 layers of mobile networks. The
    arithmetic is the convolution's (same products, accumulated by the GEMM),
    so only the summation order differs. ``kind`` as in
    :func:`harness.engines.cpu.families.gemm.row_gemm`.
    """

    def binder(ctx: Ctx) -> Bound:
        weight = ctx.named["weight"]
        cout, cin = int(weight.shape[0]), int(weight.shape[1])
        step_h, step_w = pair(ctx.named["stride"])
        strided = (step_h, step_w) != (1, 1)
        batch, _, height, width = ctx.input_shape  # engine shapes are static
        pixels = (batch, len(range(0, height, step_h)), len(range(0, width, step_w)))
        rows = math.prod(pixels)
        gemm, fused = row_gemm(ctx, weight.reshape(cout, cin), kind, rows)
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

        return with_epilogue(pointwise, "" if fused else ctx.epilogue, ctx.residual)

    return binder


CONV = Family(
    "convolution",
    lambda layer: layer.packet in PACKETS and conv_ok(layer.node, layer.named),
    (
        Tactic("conv_nchw", _conv(torch.contiguous_format), "ATen's convolution in NCHW", aten_low=True),
        Tactic("conv_channels_last", _conv(_CL), "ATen's convolution in channels-last", aten_low=True),
        Tactic(
            "conv_no_mkldnn",
            _conv_native,
            "ATen's own im2col convolution, never oneDNN",
            applies=lambda layer: layer.precision == "fp32" and _explicit_padding(layer),
        ),
        Tactic(
            "conv_onednn",
            _conv_onednn,
            "torch's oneDNN convolution op on a prepacked weight",
            applies=_conv2d,
            native=aten_native,
        ),
        *graph.tactics("conv_onednn_graph", "conv_onednn_graph_widened", torch.conv2d, _CL, _ATTRS, _conv2d),
        primitive_tactic(
            onednn_primitive.Convolution,
            _conv_dnnl,
            "oneDNN's convolution primitive through its C API, channels-last",
            applies=every(_conv2d, onednn_operands),
        ),
        Tactic(
            "conv1x1_gemm",
            _conv1x1("mm"),
            "a 1x1 convolution as one GEMM over the pixels",
            applies=_pointwise,
            aten_low=True,
        ),
        Tactic(
            "conv1x1_widened",
            _conv1x1("widen"),
            "a 1x1 convolution as one GEMM on operands widened exactly to fp32, rounded once",
            applies=every(_pointwise, widenable),
        ),
        Tactic(
            "conv1x1_onednn",
            _conv1x1("onednn"),
            "a 1x1 convolution as torch's oneDNN GEMM on a weight prepacked for the pixel count",
            applies=_pointwise,
            native=aten_native,
        ),
        Tactic("conv_widened", widened, "on operands widened exactly to fp32, rounded once", applies=emulated),
    ),
)
