"""Run a graph once and keep every intermediate value by node name, or swap one in.

Attributing error to layers needs the value of every node of two graphs
(the fp32 reference and the typed graph) on the same batch, which neither
``CompiledGraph.run`` nor an engine hands out; measuring a layer's impact
needs the reference run with that one layer's value replaced. The graph
runs as the typed graph always runs: ambient autocast off (its dtypes are
the ones written in it) and under inference mode. Values are held for one
batch at a time. Measuring what keeping one layer in fp32 buys needs the
typed graph run with that layer's fp32 value, handed on as a recompiled graph
would: rounded for consumers that run low, kept for casts and the outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.utils._pytree as pytree

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


class _KeptWide(_Recorder):
    """Runs with node ``name`` yielding ``value``, a wider value than the graph's own there.

    Inserted casts and the graph's outputs take the wide value (a graph
    recompiled with that node in fp32 casts from the fp32 value, and returns
    it as is); every other consumer takes it in the dtype the typed graph
    has there (the cast a recompiled graph inserts in front of a low consumer).
    """

    def __init__(self, gm: torch.fx.GraphModule, name: str, value: Any) -> None:
        super().__init__(gm, keep=False, overrides={name: value})
        self.name = name
        node = next(n for n in gm.graph.nodes if n.name == name)
        self.node = node
        self.narrow = pytree.tree_map(
            lambda v, like: v.to(like.dtype) if isinstance(v, torch.Tensor) and isinstance(like, torch.Tensor) else v,
            value,
            node.meta.get("val"),
        )

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.node not in n.all_input_nodes or n.op == "output" or n.meta.get("inserted_cast"):
            return super().run_node(n)
        wide = self.env[self.node]
        self.env[self.node] = self.narrow
        try:
            return super().run_node(n)
        finally:
            self.env[self.node] = wide


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


def outputs_kept_wide(compiled: CompiledGraph, batch: Sequence[torch.Tensor], name: str, value: Any) -> Any:
    """The graph's flat outputs on ``batch`` when node ``name`` yields the wider ``value`` (see :class:`_KeptWide`)."""
    return _run(_KeptWide(compiled.graph_module, name, value), compiled, batch)


def outputs_with(compiled: CompiledGraph, batch: Sequence[torch.Tensor], overrides: Mapping[str, Any]) -> Any:
    """The graph's flat outputs on ``batch`` when the nodes in ``overrides`` yield the given values."""
    return _run(_Recorder(compiled.graph_module, keep=False, overrides=overrides), compiled, batch)
