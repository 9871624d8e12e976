"""What the oneDNN Graph tactics of the convolution and GEMM families share: their binder and
where they apply.

A layer compiled into a oneDNN Graph partition
(:mod:`harness.engines.cpu.onednn_graph`) runs in its own type where
PyTorch's bridge has kernels for it (fp32, and bf16 where torch has native
bf16 kernels); an fp16 layer, or a bf16 one where torch emulates bf16, runs
as the widened partition instead: the fp32 partition on its values widened
exactly, rounded once. A layer whose epilogue the bridge would compute as
another function has neither.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.engines.cpu import onednn_graph
from harness.engines.cpu.epilogues import EPILOGUES
from harness.engines.cpu.tactic import (
    WIDENABLE,
    Binder,
    Bound,
    Check,
    Ctx,
    Layer,
    Tactic,
    every,
    no_native_aten,
)


def binder(
    op: Callable[..., torch.Tensor], layout: torch.memory_format, attr_names: tuple[str, ...], widened: bool = False
) -> Binder:
    """The layer as a compiled oneDNN Graph partition of ``op`` on ``layout``-contiguous
    inputs, its activation fused; ``widened``, computed in fp32 and rounded once."""

    def bind(ctx: Ctx) -> Bound:
        named = ctx.named
        layouts = [onednn_graph.input_meta(m.shape, m.dtype, layout) for m in ctx.inputs]
        return onednn_graph.compile_layer(
            ctx.name,
            op,
            named["weight"],
            named["bias"],
            [named[k] for k in attr_names],
            EPILOGUES[ctx.epilogue].traced,
            layouts,
            layout,
            widened,
        )

    return bind


def _traceable_epilogue(layer: Layer) -> bool:
    return EPILOGUES[layer.node.epilogue].graph


def in_type(layer: Layer) -> bool:
    """Where the partition in the layer's own type applies: fp32 where the bridge exists, and
    bf16 (left out, with :func:`native`'s reason, where torch emulates it)."""
    return _traceable_epilogue(layer) and (layer.precision == "bf16" or onednn_graph.available(layer.precision))


def native(layer: Layer) -> str | None:
    """Why the bridge has no kernels here for the layer's type (None: it has)."""
    return None if onednn_graph.available(layer.precision) else no_native_aten(layer.precision)


def widened(layer: Layer) -> bool:
    """Where the widened partition applies: an fp16/bf16 layer without the bridge's kernels for
    its type, on a bridge with fp32 ones."""
    return (
        _traceable_epilogue(layer)
        and layer.precision in WIDENABLE
        and not onednn_graph.available(layer.precision)
        and onednn_graph.available("fp32")
    )


def tactics(
    name: str,
    widened_name: str,
    op: Callable[..., torch.Tensor],
    layout: torch.memory_format,
    attr_names: tuple[str, ...],
    applies: Check,
) -> tuple[Tactic, Tactic]:
    """A family's two oneDNN Graph entries for the layers ``applies`` picks out: the partition
    of ``op`` in the layer's type (``name``) and the widened one (``widened_name``), inputs in
    ``layout``, the op's attributes ``attr_names``."""
    return (
        Tactic(
            name,
            binder(op, layout, attr_names),
            "a compiled oneDNN Graph partition",
            applies=every(applies, in_type),
            native=native,
            graph_layout=layout,
        ),
        Tactic(
            widened_name,
            binder(op, layout, attr_names, widened=True),
            "an fp32 oneDNN Graph partition on operands widened exactly, rounded once",
            applies=every(applies, widened),
            graph_layout=layout,
        ),
    )
