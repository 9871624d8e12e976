"""The softmax and layer-normalization families: each ATen's fused kernel or its formula
decomposed into ATen ops; a layer norm also on oneDNN's layer normalization primitive."""

from __future__ import annotations

import torch

from harness.dtypes import dtype_from_name
from harness.engines.cpu import onednn_primitive
from harness.engines.cpu.plan import Ref
from harness.engines.cpu.tactic import (
    ONEDNN_PRECISIONS,
    Bound,
    Ctx,
    Family,
    Layer,
    PrimitiveCall,
    Tactic,
    direct,
    primitive_call,
    primitive_tactic,
)

_SOFTMAX = ("softmax", "_softmax", "log_softmax", "_log_softmax")


def _decomposable(layer: Layer) -> bool:
    """A softmax computed in its input's type (no ``dtype``, no ``half_to_float``)."""
    return not (layer.named.get("dtype") is not None or layer.named.get("half_to_float", False))


def _softmax(ctx: Ctx) -> Bound:
    """``exp(x - max) / sum`` (its log for ``log_softmax``) in ATen ops."""
    dim = ctx.named["dim"]
    log = "log" in ctx.packet

    def decomposed(x: torch.Tensor) -> torch.Tensor:
        shifted = x - x.amax(dim, keepdim=True)
        e = shifted.exp()
        if log:
            return shifted - e.sum(dim, keepdim=True).log()
        return e / e.sum(dim, keepdim=True)

    return decomposed


def _layer_norm(ctx: Ctx) -> Bound:
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


def _layernorm_fits(layer: Layer) -> bool:
    """A computed input normalized over its last dimension alone, into its own type."""
    named, node = layer.named, layer.node
    source = named["input"]
    if node.multi or not isinstance(source, Ref) or len(named["normalized_shape"]) != 1:
        return False
    meta = layer.metas[source.name]
    return (
        2 <= len(meta.shape) <= onednn_primitive.MAX_DIMS
        and meta.dtype == node.out().dtype
        and meta.dtype in ONEDNN_PRECISIONS
    )


def _layernorm_dnnl(ctx: Ctx) -> PrimitiveCall:
    """oneDNN's layer normalization through its C API, plain layout in and out (see
    :class:`harness.engines.cpu.onednn_primitive.LayerNorm`)."""
    named = ctx.named
    return primitive_call(
        ctx.dtype,
        dtype_from_name(ctx.inputs[0].dtype),
        ctx.input_shape,
        named["weight"],
        named["bias"],
        named["eps"],
        ctx.result,
    )


SOFTMAX = Family(
    "softmax",
    lambda layer: layer.packet in _SOFTMAX,
    (
        Tactic("softmax_fused", direct, "ATen's softmax kernel", traceable=True, aten_call=True),
        Tactic("softmax_decomposed", _softmax, "exp, sum and divide as ATen ops", applies=_decomposable),
    ),
)
LAYER_NORM = Family(
    "layer norm",
    lambda layer: layer.packet == "layer_norm" and not any(isinstance(layer.named[a], Ref) for a in ("weight", "bias")),
    (
        Tactic("layernorm_fused", direct, "ATen's layer norm kernel", traceable=True, aten_call=True),
        Tactic("layernorm_decomposed", _layer_norm, "mean, variance and scale as ATen ops, statistics in fp32"),
        primitive_tactic(
            onednn_primitive.LayerNorm,
            _layernorm_dnnl,
            "oneDNN's layer normalization primitive through its C API",
            applies=_layernorm_fits,
        ),
    ),
)
