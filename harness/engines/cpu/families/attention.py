"""The attention family: ``scaled_dot_product_attention`` on computed query, key and value,
without dropout or grouped heads.

An attention runs as ATen's fused call, as explicit matmuls, scaling and
softmax (the form a region traces into oneDNN partitions), and on three of
oneDNN's primitives.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.dtypes import dtype_from_name
from harness.engines.cpu import onednn_attention
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
    getter,
    primitive_call,
    primitive_tactic,
)
from harness.errors import HarnessError


def _plain_attention(layer: Layer) -> bool:
    named = layer.named
    return (
        layer.packet == "scaled_dot_product_attention"
        and all(isinstance(named[a], Ref) for a in ("query", "key", "value"))
        and named["dropout_p"] == 0.0
        and not named["enable_gqa"]
    )


def _sdpa_math(ctx: Ctx) -> Bound:
    """Explicit attention: scores in the input dtype, softmax in fp32, then @ v. A query
    whose every key is masked gets zeros, as from ATen (its softmax alone would give NaN)."""
    get_mask = getter(ctx.named["attn_mask"])
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


def _sdpa_fits(layer: Layer) -> bool:
    """An attention with a constant mask or none, its three inputs and result of one precision
    and of shapes :class:`~harness.engines.cpu.onednn_attention.Attention` takes."""
    named, node = layer.named, layer.node
    mask = named["attn_mask"]
    if isinstance(mask, Ref) or node.multi:
        return False
    q, k, v = (layer.meta(a) for a in ("query", "key", "value"))
    precision = node.out().dtype
    if precision not in ONEDNN_PRECISIONS or not (
        q.dtype == k.dtype == v.dtype == precision and onednn_attention.fits(q.shape, k.shape, v.shape)
    ):
        return False
    scores = (*q.shape[:-1], k.shape[-2])
    try:
        onednn_attention.additive_mask(scores, None if mask is None else layer.weights[mask.name], named["is_causal"])
    except HarnessError:
        return False
    return True


def _sdpa_dnnl(ctx: Ctx) -> PrimitiveCall:
    """Attention on three oneDNN primitives through its C API, on the operands' strides (see
    :class:`harness.engines.cpu.onednn_attention.Attention`)."""
    q, k, v = (meta.shape for meta in ctx.inputs)
    named = ctx.named
    return primitive_call(
        ctx.dtype,
        dtype_from_name(ctx.inputs[0].dtype),
        q,
        k,
        v,
        named["scale"],
        mask=named["attn_mask"],
        causal=bool(named["is_causal"]),
    )


_SDPA_MATH = Tactic(
    "sdpa_math",
    _sdpa_math,
    "explicit matmuls, scaling and softmax",
    aten_low=True,
    traceable=True,
)
ATTENTION = Family(
    "attention",
    _plain_attention,
    (
        Tactic(
            "sdpa_fused",
            direct,
            "ATen's fused attention",
            region_form=_SDPA_MATH,
            traceable=True,
            aten_call=True,
        ),
        _SDPA_MATH,
        primitive_tactic(
            onednn_attention.Attention,
            _sdpa_dnnl,
            "three oneDNN primitives through its C API (matmul, softmax, matmul)",
            applies=_sdpa_fits,
            region_form=_SDPA_MATH,
        ),
    ),
)
