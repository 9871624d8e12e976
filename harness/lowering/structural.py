"""Structural clean-up passes: training-only and guard nodes that survive export.

These are the FX counterparts of TorchScript's legacy lowering passes
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
