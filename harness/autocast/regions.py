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
from typing import Any

import torch
import torch.utils._pytree as pytree

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
    gm.graph.eliminate_dead_code()  # the bodies' get_attr nodes are dead now
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, child in list(gm.named_children()):
        if isinstance(child, torch.fx.GraphModule) and name not in used:
            delattr(gm, name)
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
    results = _copy_body(owner, node, body, operands, stack)
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{node.name}: wrap_with_autocast results must be unpacked with getitem")
        user.replace_all_uses_with(results[user.args[1]])
        owner.graph.erase_node(user)
    owner.graph.erase_node(node)


def _copy_body(
    owner: torch.fx.GraphModule,
    at: torch.fx.Node,
    body: torch.fx.GraphModule,
    operands: list[Any],
    regions: tuple[Region, ...],
) -> list[Any]:
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, operands, strict=True):
        env[ph] = arg

    def mapped(a: Any) -> Any:
        return pytree.tree_map(lambda x: env[x] if isinstance(x, torch.fx.Node) else x, a)

    outputs: list[Any] = []
    with owner.graph.inserting_before(at):
        for sn in body.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                outputs = list(mapped(sn.args[0]))
                continue
            if sn.op == "get_attr" and not sn.users:
                continue  # a nested region's body, already inlined into this one
            if sn.op == "get_attr":
                # A constant the body reads: move it onto the owner.
                name = _fresh_attr(owner, str(sn.target))
                setattr(owner, name, getattr(body, str(sn.target)))
                new = owner.graph.get_attr(name)
            else:
                new = owner.graph.create_node(sn.op, sn.target, mapped(sn.args), mapped(sn.kwargs), name=sn.name)
            new.meta.update(sn.meta)
            if new.op == "call_function":
                new.meta.setdefault("autocast_regions", regions)  # nested nodes keep their deeper stack
            env[sn] = new
    return outputs


def _fresh_attr(owner: torch.nn.Module, base: str) -> str:
    name, i = f"{base}_inlined", 0
    while hasattr(owner, name):
        i += 1
        name = f"{base}_inlined_{i}"
    return name
