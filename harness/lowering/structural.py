"""Structural clean-up passes: training-only and guard nodes that survive export.

These are the FX counterparts of the legacy TorchScript passes in seed 004
(remove dropout, remove exceptions/guards, remove detach): an inference
engine has no use for them, and they would otherwise be classified as layers.
"""

from __future__ import annotations

import torch

from harness.lowering.pass_manager import register_pass

aten = torch.ops.aten

_ASSERTS = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten._assert_async.msg,
    aten._assert_async.default,
    aten.sym_constrain_range_for_size.default,
}
_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default}
_IDENTITIES = {aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default}


def _replace_with_first_arg(gm: torch.fx.GraphModule, targets: set[object]) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in targets:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm


@register_pass("remove_asserts")
def remove_asserts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Shape and value guards are checked at export time; engines have no exceptions."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            gm.graph.erase_node(node)
    return gm


@register_pass("remove_dropout")
def remove_dropout(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Dropout is the identity at inference (export records ``train=False``)."""
    return _replace_with_first_arg(gm, _DROPOUTS)


@register_pass("remove_detach")
def remove_detach(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Autograd bookkeeping; values are unchanged."""
    return _replace_with_first_arg(gm, _IDENTITIES)


def _out_of_place(target: object) -> object | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


@register_pass("functionalize_inplace")
def functionalize_inplace(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``relu_(x)`` becomes ``y = relu(x)`` and later uses of ``x`` read ``y``.

    Cast insertion gives a mutated tensor a copy of another type, so an in-place
    op would update the copy and not the tensor later nodes read. Export keeps
    in-place ops in its pre-dispatch graph; this pass turns them into values.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        pure = _out_of_place(node.target) if node.op == "call_function" else None
        if pure is None:
            continue
        mutated = node.args[0]
        with gm.graph.inserting_before(node):
            new = gm.graph.create_node("call_function", pure, node.args, node.kwargs, name=f"{node.name.rstrip('_')}_value")
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        for user in list(mutated.users):
            if user is not new and order.get(user, -1) > order[node]:
                user.replace_input_with(mutated, new)
        gm.graph.erase_node(node)
    return gm
