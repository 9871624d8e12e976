"""Run a graph once and keep every intermediate value by node name, or swap one in.

Attributing error to layers needs the value of every node of two graphs
(the fp32 reference and the typed graph) on the same batch, which neither
``CompiledGraph.run`` nor an engine hands out; measuring a layer's impact
needs the reference run with that one layer's value replaced. The graph
runs as the typed graph always runs: ambient autocast off (its dtypes are
the ones written in it) and under inference mode. Values are held for one
batch at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from harness.autocast import CompiledGraph


class _Recorder(torch.fx.Interpreter):
    """Keeps every value; a node named in ``overrides`` yields the given value instead of running."""

    def __init__(self, gm: torch.fx.GraphModule, keep: bool, overrides: Mapping[str, Any]) -> None:
        super().__init__(gm, garbage_collect_values=not keep)
        self.keep = keep
        self.overrides = overrides
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = self.overrides[n.name] if n.name in self.overrides else super().run_node(n)
        if self.keep and n.op in ("placeholder", "call_function"):
            self.values[n.name] = result
        return result


def _run(recorder: _Recorder, compiled: CompiledGraph, batch: Sequence[torch.Tensor]) -> Any:
    with ExitStack() as stack:
        for device in {"cpu", compiled.device}:
            stack.enter_context(torch.autocast(device, enabled=False))
        stack.enter_context(torch.inference_mode())
        return recorder.run(*compiled.typed_inputs(batch))


def node_values(compiled: CompiledGraph, batch: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Every placeholder's and call_function node's value on ``batch``, keyed by node name."""
    recorder = _Recorder(compiled.graph_module, keep=True, overrides={})
    _run(recorder, compiled, batch)
    return recorder.values


def outputs_with(compiled: CompiledGraph, batch: Sequence[torch.Tensor], overrides: Mapping[str, Any]) -> Any:
    """The graph's flat outputs on ``batch`` when the nodes in ``overrides`` yield the given values."""
    return _run(_Recorder(compiled.graph_module, keep=False, overrides=overrides), compiled, batch)
