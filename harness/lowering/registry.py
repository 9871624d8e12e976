"""The registry of lowering passes: each pass module registers its passes here by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.passes.infra.pass_base import PassResult

GraphPass = Callable[[torch.fx.GraphModule], PassResult]

_REGISTRY: dict[str, GraphPass] = {}


def register_pass(name: str) -> Callable[[GraphPass], GraphPass]:
    """Register a pass under a name users can enable or disable."""

    def wrap(fn: GraphPass) -> GraphPass:
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered() -> dict[str, GraphPass]:
    """The passes registered so far, by name."""
    return dict(_REGISTRY)
