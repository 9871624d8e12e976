"""Cast clean-up passes, each a function from graph module to graph module.

The rules are about values, not just types: a widening cast is exact, so
widening-then-narrowing equals one narrowing cast (or nothing, when the
result type is the source type); a narrowing cast rounds, so
narrowing-then-widening must stay as it is.
"""

from __future__ import annotations

import torch

from harness.autocast.casts import is_cast
from harness.fxutil import drop_unused_attributes
from harness.lowering.pass_manager import PassManager

_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _src_dtype(node: torch.fx.Node) -> torch.dtype:
    return node.args[0].meta["val"].dtype


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Exact conversion: every value of ``src`` is representable in ``dst``."""
    return src in _RANK and dst in _RANK and _RANK[dst] > _RANK[src]


def remove_noop_casts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if is_cast(node) and _src_dtype(node) == node.kwargs["dtype"]:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm


def fold_cast_chains(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """cast(cast(x, wide), d) -> cast(x, d) when the first cast widens x exactly."""
    for node in list(gm.graph.nodes):
        if not is_cast(node):
            continue
        inner = node.args[0]
        if not (is_cast(inner) and _widens(_src_dtype(inner), inner.kwargs["dtype"])):
            continue
        source = inner.args[0]
        target = node.kwargs["dtype"]
        if source.meta["val"].dtype == target:
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
        else:
            node.args = (source,)
        if not inner.users:
            gm.graph.erase_node(inner)
    return gm


def dedupe_casts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    seen: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_cast(node):
            continue
        key = (node.args[0], node.kwargs["dtype"])
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    return gm


def eliminate_dead_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    drop_unused_attributes(gm)
    return gm


CLEANUP = PassManager(
    [
        ("fold_cast_chains", fold_cast_chains),
        ("remove_noop_casts", remove_noop_casts),
        ("dedupe_casts", dedupe_casts),
        ("eliminate_dead_code", eliminate_dead_code),
    ]
)

