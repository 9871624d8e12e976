"""Remove autograd bookkeeping (``detach``, ``alias``, ``lift_fresh_copy``): values are unchanged.

The FX counterpart of TorchScript's legacy "remove detach" lowering pass. It
runs after ``functionalize_inplace``, which needs ``lift_fresh_copy`` to tell a
write into a fresh copy of a constant from a write into the constant itself.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassResult

from harness.lowering.bypass import bypass_first_arg
from harness.lowering.registry import register_pass

logger = logging.getLogger(__name__)
aten = torch.ops.aten

IDENTITY_OPS: frozenset[object] = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default})


@register_pass("remove_detach")
def remove_detach(gm: torch.fx.GraphModule) -> PassResult:
    """Users of a detach/alias/lift_fresh_copy read its input instead."""
    removed = bypass_first_arg(gm, IDENTITY_OPS)
    logger.debug("remove_detach: %d identity node(s) removed", removed)
    return PassResult(gm, removed > 0)
