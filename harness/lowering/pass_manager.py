"""A small pass manager.

A pass is a function from GraphModule to GraphModule. The manager runs the
registered passes in order and, after each one, lints and recompiles the graph
so that a broken pass is caught where it broke the graph rather than several
passes later (the rule of seed 004: the graph stays valid and callable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from harness.errors import HarnessError

GraphPass = Callable[[torch.fx.GraphModule], torch.fx.GraphModule]

_REGISTRY: dict[str, GraphPass] = {}


def register_pass(name: str) -> Callable[[GraphPass], GraphPass]:
    """Register a pass under a name users can enable or disable."""

    def wrap(fn: GraphPass) -> GraphPass:
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered_passes() -> dict[str, GraphPass]:
    import harness.lowering.fold_batch_norm  # noqa: F401  (registers on import)
    import harness.lowering.functionalize  # noqa: F401
    import harness.lowering.layout  # noqa: F401
    import harness.lowering.structural  # noqa: F401

    return dict(_REGISTRY)


def validate(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass
class PassManager:
    passes: list[tuple[str, GraphPass]] = field(default_factory=list)

    @classmethod
    def from_names(cls, names: Iterable[str]) -> PassManager:
        available = registered_passes()
        chosen = []
        for name in names:
            if name not in available:
                raise HarnessError(f"unknown lowering pass {name!r}; valid: {', '.join(sorted(available))}")
            chosen.append((name, available[name]))
        return cls(chosen)

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for _, fn in self.passes:
            gm = validate(fn(gm))
        return gm


# functionalize_inplace runs before remove_detach: the latter drops lift_fresh_copy, after
# which a write into a fresh copy of a constant (``t = torch.tensor(...); t[0] = x``) would
# look like a write into the constant itself, which functionalization refuses.
# pin_strided_layouts runs after functionalize_inplace, which emits as_strided_scatter.
DEFAULT_PASSES = ("remove_asserts", "remove_dropout", "functionalize_inplace", "remove_detach", "pin_strided_layouts")


# Passes that change the last bits (never run in the exact modes amp / fp32).
INFERENCE_PASSES = DEFAULT_PASSES + ("fold_batch_norm",)


def default_pass_manager(exact: bool = True) -> PassManager:
    return PassManager.from_names(DEFAULT_PASSES if exact else INFERENCE_PASSES)
