"""Which nodes of a typed graph are layers of their own, and which only move data for another.

A view, reshape, transpose, unflatten or contiguous copy computes nothing: it
runs in whatever precision its input has, and keeping it alone in fp32 changes
nothing. Listed as layers, such nodes crowd out the ones that compute.
:func:`fold_data_movement` gives each of them to the layer that produced its
input (through chains of them), so a layer's row stands for the layer and the
data movement after it, and keeping the layer in fp32 keeps those too.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

aten = torch.ops.aten
_COPIES = frozenset({
    aten.clone.default,
    aten.contiguous.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
})  # fmt: skip


def moves_data_only(node: torch.fx.Node) -> bool:
    """A view (or views: ``unbind``) or plain copy of its first input, in that input's dtype."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    source = node.args[0] if node.args else None
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    after = node.meta.get("val")
    results = list(after) if isinstance(after, (list, tuple)) else [after]  # unbind, split: views too
    if not isinstance(before, torch.Tensor) or not results:
        return False
    if not all(isinstance(r, torch.Tensor) and r.dtype == before.dtype for r in results):
        return False
    if op in _COPIES:
        return True
    returns = op._schema.returns
    alias = returns[0].alias_info if len(returns) == 1 else None
    return not op._schema.is_mutable and alias is not None and not alias.is_write


def _producer(node: torch.fx.Node, layers: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The layer whose value ``node`` moves: up its first input through data movement, casts and getitems."""
    current = node.args[0] if node.args else None
    while isinstance(current, torch.fx.Node) and current not in layers:
        passes = moves_data_only(current) or current.meta.get("inserted_cast") or current.target is operator.getitem
        if not passes or not current.args:
            return None
        current = current.args[0]
    return current if isinstance(current, torch.fx.Node) else None


def fold_data_movement(layers: Sequence[torch.fx.Node]) -> tuple[list[torch.fx.Node], dict[str, list[str]]]:
    """``layers`` without the nodes that only move data, and for each remaining layer the names folded into it.

    A data-movement node whose input comes from no layer (a graph input, a
    weight) is dropped without an owner.
    """
    movers = {n for n in layers if moves_data_only(n)}
    kept = [n for n in layers if n not in movers]
    owners = set(kept)
    folded: dict[str, list[str]] = {n.name: [] for n in kept}
    for node in layers:
        if node in movers:
            owner = _producer(node, owners)
            if owner is not None:
                folded[owner.name].append(node.name)
    return kept, folded
