"""Remove dropout, the identity at inference (export records ``train=False``).

The FX counterpart of TorchScript's legacy "remove dropout" lowering pass.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassResult

from harness.lowering.bypass import bypass_first_arg
from harness.lowering.registry import register_pass

logger = logging.getLogger(__name__)
aten = torch.ops.aten

DROPOUT_OPS: frozenset[object] = frozenset({
    aten.dropout.default,
    aten.feature_dropout.default,
    aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
})  # fmt: skip


@register_pass("remove_dropout")
def remove_dropout(gm: torch.fx.GraphModule) -> PassResult:
    """Users of a dropout read its input instead."""
    removed = bypass_first_arg(gm, DROPOUT_OPS)
    logger.debug("remove_dropout: %d dropout node(s) removed", removed)
    return PassResult(gm, removed > 0)
