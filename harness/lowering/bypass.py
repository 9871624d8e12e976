"""Bypass nodes that return their first input unchanged: their users read that input instead."""

from __future__ import annotations

from collections.abc import Collection

import torch


def bypass_first_arg(gm: torch.fx.GraphModule, targets: Collection[object]) -> int:
    """Replace every ``call_function`` node whose target is in ``targets`` by its first argument.

    Returns the number of nodes removed.
    """
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in targets:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
    return removed
