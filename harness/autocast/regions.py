"""Inline the higher-order ops export produces, remembering autocast regions.

``torch.export`` records ``with torch.autocast(device, dtype, enabled)`` as a
``wrap_with_autocast`` higher-order op calling a submodule, and a method under
``torch.no_grad()`` / ``torch.enable_grad()`` (rotary embeddings in
``transformers`` are one) as ``wrap_with_set_grad_enabled``. Engines cannot run
either, and the classifier needs to see their ops one by one, so both bodies
are inlined into the parent graph. Autocast bodies tag every inlined node with
the stack of regions around it in ``meta["autocast_regions"]`` (outermost
first); grad mode has no meaning for inference, so those bodies are inlined
untagged. Any other higher-order op (``cond``, ``map``, ...) is refused, all of
them named at once, before anything runs it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from harness.errors import HarnessError
from harness.fxutil import copy_body, drop_unused_attributes
from harness.opnames import op_name

WRAP_WITH_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
WRAP_WITH_SET_GRAD_ENABLED = torch.ops.higher_order.wrap_with_set_grad_enabled
INLINED_HIGHER_ORDER_OPS = (WRAP_WITH_AUTOCAST, WRAP_WITH_SET_GRAD_ENABLED)


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


def inline_higher_order_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace every autocast and grad-mode wrapper by its body; refuse any other higher-order op."""
    _refuse_other_higher_order_ops(gm)
    for node in list(gm.graph.nodes):
        if _is_inlined(node):
            _inline_one(gm, node, ())
    drop_unused_attributes(gm)  # the inlined bodies
    gm.graph.lint()
    gm.recompile()
    return gm


def _is_inlined(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in INLINED_HIGHER_ORDER_OPS


def _refuse_other_higher_order_ops(gm: torch.fx.GraphModule) -> None:
    found: list[str] = []

    def walk(module: torch.fx.GraphModule, where: str) -> None:
        for node in module.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
                continue
            if node.target not in INLINED_HIGHER_ORDER_OPS:
                found.append(f"{where}{node.name} ({op_name(node.target)})")
                continue
            walk(_body(module, node), f"{where}{node.name}/")

    walk(gm, "")
    if found:
        supported = ", ".join(op_name(op) for op in INLINED_HIGHER_ORDER_OPS)
        raise HarnessError(
            f"the exported graph contains higher-order ops with no meaning for an inference graph: "
            f"{'; '.join(found)}. Only {supported} are inlined; rewrite the model without the others "
            "(for example torch.cond -> torch.where on both branches)"
        )


def _body(owner: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """The submodule a wrapper calls: a ``get_attr`` argument naming a graph module of ``owner``."""
    ref = node.args[4] if node.target is WRAP_WITH_AUTOCAST else node.args[1]
    if not (isinstance(ref, torch.fx.Node) and ref.op == "get_attr" and isinstance(ref.target, str)):
        raise AssertionError(f"{node.name}: {op_name(node.target)} body is {ref!r}, not a get_attr node")
    body = getattr(owner, ref.target)
    if not isinstance(body, torch.fx.GraphModule):
        raise AssertionError(f"{node.name}: {op_name(node.target)} body {ref.target} is {type(body).__name__}")
    return body


def _inline_one(owner: torch.fx.GraphModule, node: torch.fx.Node, outer: tuple[Region, ...]) -> None:
    if node.target is WRAP_WITH_AUTOCAST:
        device, dtype, enabled, _cache, _sub, *operands = node.args
        if dtype is None:
            dtype = torch.get_autocast_dtype(str(device))
        if not isinstance(dtype, torch.dtype):
            raise AssertionError(f"{node.name}: autocast dtype is {dtype!r}, not a torch.dtype")
        region = Region(str(device), dtype, bool(enabled))
        stack = outer + (region,)
    else:  # wrap_with_set_grad_enabled: grad mode means nothing at inference
        _enabled, _sub, *operands = node.args
        stack = outer
    body = _body(owner, node)
    for inner in list(body.graph.nodes):  # nested wrappers first, with the deeper stack
        if _is_inlined(inner):
            _inline_one(body, inner, stack)

    def annotate(new: torch.fx.Node) -> None:
        if new.op == "call_function" and stack:
            new.meta.setdefault("autocast_regions", stack)  # nested nodes keep their deeper stack

    results, _ = copy_body(owner, node, body, list(operands), annotate=annotate)
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{node.name}: {op_name(node.target)} results must be unpacked with getitem")
        user.replace_all_uses_with(results[user.args[1]])
        owner.graph.erase_node(user)
    owner.graph.erase_node(node)
