"""An engine's intermediate values, where the backend can expose them.

The CPU engine's plan is a list of layers named after the typed graph's
nodes, each with the tactic the build chose; replaying it layer by layer
with those tactics gives every intermediate the engine computes, so the
accumulated error can be read off the engine itself (its tactics, fusions
and folds included) and not only off the typed graph. A layer that absorbed
others (a folded batch norm, a fused activation) yields the value of the
last node it absorbed. ONNX Runtime and TensorRT engines hand out their
outputs only: for them this returns None and the typed graph stands in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.engines.protocol import Engine, engine_inputs


def engine_values(engine: Engine, batch: Sequence[torch.Tensor]) -> dict[str, Any] | None:
    """Every layer's value on ``batch`` keyed by typed-graph node name, or None if not exposed."""
    from harness.engines.cpu import CpuEngine, tactics
    from harness.engines.cpu.plan import GETITEM

    if not isinstance(engine, CpuEngine):
        return None
    plan = engine.plan
    metas = plan.value_metas()
    typed = engine_inputs(engine, batch)
    values: dict[str, Any] = {name: tensor for (name, _), tensor in zip(plan.inputs, typed, strict=True)}
    exposed: dict[str, Any] = {}
    with torch.inference_mode():
        for node in plan.nodes:
            args = [values[ref.name] for ref in node.refs()]
            if node.op == GETITEM:
                value = args[0][node.args[1]]
            else:
                impl, _ = tactics.parse_tactic(node.tactic)
                value = tactics.bind(node, impl, metas, plan.weights)(*args)
            values[node.name] = value
            exposed[node.fused[-1] if node.fused else node.name] = value
    return exposed
