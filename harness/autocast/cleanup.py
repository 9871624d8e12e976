"""Cast clean-up passes, each taking a graph module and returning a ``PassResult``.

The rules are about values, not just types: a widening cast is exact, so
widening-then-narrowing equals one narrowing cast (or nothing, when the
result type is the source type); a narrowing cast rounds, so
narrowing-then-widening must stay as it is.

Each pass rewrites the graph in place and reports ``modified`` as whether it
changed anything, so that running a pass twice reports ``False`` the second time.
"""

from __future__ import annotations

import torch

from harness.autocast.casts import arg_node, is_cast, node_dtype
from harness.fxutil import drop_unused_attributes
from harness.lowering.pass_manager import PassManager, PassResult

_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _src_dtype(cast: torch.fx.Node) -> torch.dtype:
    return node_dtype(arg_node(cast))


def _cast_dtype(cast: torch.fx.Node) -> torch.dtype | None:
    """The cast's target dtype; ``None`` (``_to_copy(x, dtype=None)``) keeps the source's."""
    dtype = cast.kwargs["dtype"]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"cast {cast.name}: dtype is {dtype!r}, not a torch.dtype")
    return dtype


def _widens(src: torch.dtype, dst: torch.dtype | None) -> bool:
    """Exact conversion: every value of ``src`` is representable in ``dst``."""
    return src in _RANK and dst in _RANK and _RANK[dst] > _RANK[src]


def remove_noop_casts(gm: torch.fx.GraphModule) -> PassResult:
    removed = 0
    for node in list(gm.graph.nodes):
        if is_cast(node) and _src_dtype(node) == _cast_dtype(node):
            node.replace_all_uses_with(arg_node(node))
            gm.graph.erase_node(node)
            removed += 1
    return PassResult(gm, removed > 0)


def fold_cast_chains(gm: torch.fx.GraphModule) -> PassResult:
    """cast(cast(x, wide), d) -> cast(x, d) when the first cast widens x exactly."""
    changes = 0
    for node in list(gm.graph.nodes):
        if not is_cast(node):
            continue
        inner = arg_node(node)
        if not (is_cast(inner) and _widens(_src_dtype(inner), _cast_dtype(inner))):
            continue
        source = arg_node(inner)
        if node_dtype(source) == _cast_dtype(node):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
        else:
            node.args = (source,)
        changes += 1
        if not inner.users:
            gm.graph.erase_node(inner)
            changes += 1
    return PassResult(gm, changes > 0)


def dedupe_casts(gm: torch.fx.GraphModule) -> PassResult:
    seen: dict[tuple[torch.fx.Node, torch.dtype | None], torch.fx.Node] = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if not is_cast(node):
            continue
        key = (arg_node(node), _cast_dtype(node))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return PassResult(gm, removed > 0)


def _attribute_count(gm: torch.fx.GraphModule) -> int:
    """Buffers, parameters and submodules held directly by ``gm`` (what dead-code removal may drop)."""
    return sum(
        1
        for _ in (*gm.named_buffers(recurse=False), *gm.named_parameters(recurse=False), *gm.named_children())
    )


def eliminate_dead_code(gm: torch.fx.GraphModule) -> PassResult:
    before = (len(gm.graph.nodes), _attribute_count(gm))
    drop_unused_attributes(gm)
    return PassResult(gm, (len(gm.graph.nodes), _attribute_count(gm)) != before)


CLEANUP = PassManager(
    [
        ("fold_cast_chains", fold_cast_chains),
        ("remove_noop_casts", remove_noop_casts),
        ("dedupe_casts", dedupe_casts),
        ("eliminate_dead_code", eliminate_dead_code),
    ],
    name="cleanup",
)
