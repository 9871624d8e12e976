"""Inline ``torch.autocast`` regions, remembering the region each node came from.

``torch.export`` records ``with torch.autocast(device, dtype, enabled)`` as a
``wrap_with_autocast`` higher-order op calling a submodule. Engines cannot run
that, and the classifier needs to see the region's ops one by one, so the body
is inlined into the parent graph and every inlined node gets the stack of
regions around it in ``meta["autocast_regions"]`` (outermost first). Nested
regions are inlined first, innermost out.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from harness.fxutil import copy_body, drop_unused_attributes

WRAP_WITH_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


@dataclass(frozen=True)
class Region:
    """One ``torch.autocast`` context as written in the model."""

    device: str
    dtype: torch.dtype
    enabled: bool

    def describe(self) -> str:
        state = f"dtype={str(self.dtype).removeprefix('torch.')}"
        return f"torch.autocast({self.device!r}, {state}{'' if self.enabled else ', disabled'})"


def regions_of(node: torch.fx.Node) -> tuple[Region, ...]:
    return tuple(node.meta.get("autocast_regions", ()))


def inline_autocast_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace every ``wrap_with_autocast`` node by its body, tagged with its regions."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is WRAP_WITH_AUTOCAST:
            _inline_one(gm, node, ())
    drop_unused_attributes(gm)  # the inlined bodies
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline_one(owner: torch.fx.GraphModule, node: torch.fx.Node, outer: tuple[Region, ...]) -> None:
    device, dtype, enabled, _cache, sub_ref, *operands = node.args
    body: torch.fx.GraphModule = getattr(owner, sub_ref.target)
    region = Region(str(device), dtype or torch.get_autocast_dtype(str(device)), bool(enabled))
    stack = outer + (region,)
    for inner in list(body.graph.nodes):  # nested regions first, with the deeper stack
        if inner.op == "call_function" and inner.target is WRAP_WITH_AUTOCAST:
            _inline_one(body, inner, stack)
    def annotate(new: torch.fx.Node) -> None:
        if new.op == "call_function":
            new.meta.setdefault("autocast_regions", stack)  # nested nodes keep their deeper stack

    results, _ = copy_body(owner, node, body, list(operands), annotate=annotate)
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{node.name}: wrap_with_autocast results must be unpacked with getitem")
        user.replace_all_uses_with(results[user.args[1]])
        owner.graph.erase_node(user)
    owner.graph.erase_node(node)
