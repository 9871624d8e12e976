"""Dtype arguments that follow a tensor: resolved against the dtypes the typed graph decided.

The frontend marks a node whose ``dtype`` argument is, in the model's source,
another tensor's dtype read at run time (``x.to(y)``, ``x.type_as(y)``,
``x.to(y.device)``, ``torch.zeros(n, dtype=y.dtype)``; see
:mod:`harness.frontend.provenance`). Cast insertion walks the graph in
topological order; just before it types such a node, :meth:`DtypeLinks.resolve`
writes the source's decided dtype into the argument, so the node computes in
the dtype eager would read there under the same autocast state. The typed
graph keeps plain constant dtypes: engines see ordinary ops.
"""

from __future__ import annotations

import torch

from harness.frontend.provenance import DTYPE_FOLLOWS, VALUE_ID


def _dtype_position(op: torch._ops.OpOverload) -> tuple[int, bool] | None:
    """Where ``op`` takes its ``dtype``: (schema index, keyword-only), or ``None``."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dtype":
            return i, arg.kwarg_only
    return None


class DtypeLinks:
    """The graph's dtype links, resolvable node by node while the graph is being typed."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self._by_id: dict[str, list[torch.fx.Node]] = {}
        for node in gm.graph.nodes:
            if VALUE_ID in node.meta:
                self._by_id.setdefault(str(node.meta[VALUE_ID]), []).append(node)

    def source(self, node: torch.fx.Node) -> torch.fx.Node | None:
        """The node whose dtype ``node``'s dtype argument follows: the nearest one before it carrying the id."""
        value_id = node.meta.get(DTYPE_FOLLOWS)
        if value_id is None:
            return None
        before = [n for n in self._by_id.get(str(value_id), ()) if n.graph is node.graph and n < node]
        return before[-1] if before else None

    def resolve(self, node: torch.fx.Node) -> bool:
        """Set ``node``'s dtype argument to its source's current dtype; whether it changed."""
        source = self.source(node)
        op = node.target
        val = source.meta.get("val") if source is not None else None
        if not isinstance(val, torch.Tensor) or not isinstance(op, torch._ops.OpOverload):
            return False
        where = _dtype_position(op)
        if where is None:
            return False
        index, kwarg_only = where
        if not kwarg_only and index < len(node.args):
            if node.args[index] == val.dtype:
                return False
            node.args = (*node.args[:index], val.dtype, *node.args[index + 1 :])
            return True
        if node.kwargs.get("dtype") == val.dtype:
            return False
        node.kwargs = {**node.kwargs, "dtype": val.dtype}
        return True
