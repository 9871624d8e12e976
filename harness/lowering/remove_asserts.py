"""Remove shape and value guards that survive export.

``torch.export`` checks these guards when it traces; an inference engine has
no exceptions, and left in the graph they would be classified as layers. (The
FX counterpart of TorchScript's legacy "remove exceptions" lowering pass.)
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassResult

from harness.lowering.registry import register_pass

logger = logging.getLogger(__name__)
aten = torch.ops.aten

ASSERT_OPS: frozenset[object] = frozenset({
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten._assert_async.msg,
    aten._assert_async.default,
    aten.sym_constrain_range_for_size.default,
})  # fmt: skip


@register_pass("remove_asserts")
def remove_asserts(gm: torch.fx.GraphModule) -> PassResult:
    """Erase guard nodes nothing reads."""
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
            removed += 1
    logger.debug("remove_asserts: %d guard node(s) removed", removed)
    return PassResult(gm, removed > 0)
