"""The families of layers that run as their op's own ATen call, some also on one of oneDNN's
primitives: views, adaptive average poolings that equal a fixed-window one, elementwise
products, float casts, and every other op (``direct`` alone)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

from harness.dtypes import dtype_from_name, dtype_name
from harness.engines.cpu import onednn_primitive
from harness.engines.cpu.plan import Node, Ref, TensorMeta
from harness.engines.cpu.tactic import (
    ONEDNN_PRECISIONS,
    Bound,
    Ctx,
    Family,
    Layer,
    PrimitiveCall,
    Tactic,
    anywhere,
    direct,
    make_call,
    primitive_call,
    primitive_tactic,
)
from harness.opnames import plan_packet

# ATen's elementwise ops by plan packet -> oneDNN's binary algorithm doing the same.
_BINARY_ALGORITHMS = {"mul": "binary_mul"}

DIRECT = Tactic("direct", direct, "the op's own ATen call", traceable=True, aten_call=True)


def _reshape(ctx: Ctx) -> Bound:
    """A view as a reshape: a view of a channels-last tensor may be impossible, a reshape gives
    the same values whatever the layout the producer's tactic chose."""
    return make_call(torch.ops.aten.reshape.default, [ctx.named["self"], ctx.named["size"]], {})


def avg_pool_window(node: Node, metas: Mapping[str, TensorMeta]) -> tuple[int, ...] | None:
    """The window of the fixed-window pooling that an adaptive average pooling equals, where
    its output size divides its input's (a squeeze-excite block's global pooling), else None.

    The two compute the same means; ATen's fixed-window kernel is the faster
    on channels-last inputs, and PyTorch's oneDNN Graph bridge maps only that
    one to oneDNN.
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
    return functools.partial(torch.nn.functional.avg_pool2d, kernel_size=window, stride=window)


def _ctx_window(ctx: Ctx) -> tuple[int, ...]:
    window = _window(ctx.input_shape[-2:], ctx.output[-2:])
    assert window is not None, "offered only where the output divides the input"
    return window


def _pool_window(ctx: Ctx) -> Bound:
    return window_pool(_ctx_window(ctx))


def _pool_fits(layer: Layer) -> bool:
    """A 4-D input of the result's type."""
    source = layer.metas[layer.node.refs()[0].name]
    return len(source.shape) == 4 and source.dtype == layer.precision


def _pool_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's pooling primitive through its C API, channels-last in and out: from a
    convolution's result into the next one's input without leaving oneDNN's layout."""
    dtype = dtype_from_name(ctx.inputs[0].dtype)
    return primitive_call(ctx.dtype, dtype, ctx.input_shape, _ctx_window(ctx), ctx.result)


def _binary_fits(layer: Layer) -> bool:
    """Two computed 4-D operands of the result's precision, one of the result's shape and the
    other broadcast over it."""
    named, node = layer.named, layer.node
    operands = [named["self"], named["other"]]
    if node.multi or not all(isinstance(o, Ref) for o in operands):
        return False
    out = node.out()
    first, second = (layer.metas[o.name] for o in operands)
    if out.dtype not in ONEDNN_PRECISIONS or first.dtype != out.dtype or second.dtype != out.dtype:
        return False
    shape = tuple(out.shape)
    return (tuple(first.shape) == shape and onednn_primitive.broadcasts(shape, second.shape)) or (
        tuple(second.shape) == shape and onednn_primitive.broadcasts(shape, first.shape)
    )


def _binary_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's binary primitive through its C API, channels-last in and out (see
    :class:`harness.engines.cpu.onednn_primitive.Binary`): the operand of the result's shape
    first, whichever the layer lists first."""
    first, second = (meta.shape for meta in ctx.inputs)
    scale_first = tuple(first) != tuple(ctx.output)
    return primitive_call(
        ctx.dtype,
        _BINARY_ALGORITHMS[ctx.packet],
        dtype_from_name(ctx.inputs[0].dtype),
        ctx.output,
        first if scale_first else second,
        ctx.result,
        scale_first=scale_first,
    )


def _cast_fits(layer: Layer) -> bool:
    """A computed float tensor converted to another float type and nothing else (no device,
    layout or memory format asked for)."""
    named, node = layer.named, layer.node
    source = named["self"]
    if node.multi or not isinstance(source, Ref) or not isinstance(named["dtype"], torch.dtype):
        return False
    if named["memory_format"] not in (None, torch.preserve_format) or any(
        named[k] is not None for k in ("layout", "device", "pin_memory")
    ):
        return False
    meta = layer.metas[source.name]
    target = dtype_name(named["dtype"])
    return (
        1 <= len(meta.shape) <= onednn_primitive.MAX_DIMS
        and meta.dtype in ONEDNN_PRECISIONS
        and target in ONEDNN_PRECISIONS
        and meta.dtype != target
    )


def _cast_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's reorder between float types through its C API, plain layout in and out (see
    :class:`harness.engines.cpu.onednn_primitive.Cast`)."""
    source = ctx.inputs[0].dtype
    conversion = f"{source}>{dtype_name(ctx.named['dtype'])}"
    return primitive_call(conversion, dtype_from_name(source), ctx.named["dtype"], ctx.input_shape, ctx.result)


VIEW = Family(
    "view",
    lambda layer: layer.packet in ("view", "_unsafe_view"),
    (Tactic("reshape", _reshape, "the view as a reshape, whatever its input's layout", traceable=True),),
)
POOL = Family(
    "adaptive pooling",
    lambda layer: avg_pool_window(layer.node, layer.metas) is not None,
    (
        DIRECT,
        Tactic(
            "pool_window",
            _pool_window,
            "the fixed-window average pooling it equals",
            traceable=True,
            aten_call=True,
        ),
        primitive_tactic(
            onednn_primitive.Pooling,
            _pool_dnnl,
            "oneDNN's pooling primitive through its C API, channels-last",
            applies=_pool_fits,
        ),
    ),
)
BINARY = Family(
    "binary",
    lambda layer: layer.packet in _BINARY_ALGORITHMS,
    (
        DIRECT,
        primitive_tactic(
            onednn_primitive.Binary,
            _binary_dnnl,
            "oneDNN's binary primitive through its C API, channels-last",
            applies=_binary_fits,
        ),
    ),
)
CAST = Family(
    "cast",
    lambda layer: layer.packet == "_to_copy",
    (
        DIRECT,
        primitive_tactic(
            onednn_primitive.Cast,
            _cast_dnnl,
            "oneDNN's reorder between float types through its C API",
            applies=_cast_fits,
        ),
    ),
)
PLAIN = Family("plain", anywhere, (DIRECT,))
