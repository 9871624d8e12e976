"""Bias correction: the mean output shift that rounding a layer's weights causes, taken out of its bias.

A linear or convolution lowered to fp16 (bf16) computes with its weights
rounded: ``W + dW``. For an input ``x`` its output moves by ``dW x``, and the
expectation of that, ``dW E[x]``, is the same shift for every input drawn like
the calibration data: a systematic error, not noise. Where ``E[x]`` is far from
zero (after a ReLU or GELU, or a normalization with a bias) it is the largest
part of the rounding error a layer adds, and it accumulates through the
network. Measured on the fp32 graph over the calibration batches (the output
with the rounded weights minus the output with the exact ones, averaged over
every position but the output channel) and subtracted from the layer's bias,
it costs nothing at run time: no Cast, no op, the bias is rounded once like
any weight (the correction of Nagel et al., "Data-Free Quantization Through
Weight Equalization and Bias Correction", 2019, measured empirically).

Only layers that are lowered, whose weight and bias are constants of the
graph, are corrected; the bias keeps its name with a ``_corrected`` suffix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from harness.autocast.casts import FP16_MAX
from harness.autocast.decision import Action, Decision
from harness.dtypes import dtype_name

aten = torch.ops.aten

# op -> the dimension of its output that is the output channel
_CHANNEL_DIM: dict[object, int] = {aten.linear.default: -1, aten.conv1d.default: 1, aten.conv2d.default: 1, aten.conv3d.default: 1}


def _rounded(t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    if low == torch.float16:
        t = t.clamp(-FP16_MAX, FP16_MAX)
    return t.to(low).to(t.dtype)


def candidates(gm: torch.fx.GraphModule, decisions: Mapping[str, Decision], low: torch.dtype) -> dict[str, str]:
    """Lowered linears and convolutions whose weight and bias are fp32 constants: node name -> the
    attribute of its bias."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CHANNEL_DIM or len(node.args) < 3:
            continue
        decision = decisions.get(node.name)
        if decision is None or decision.action is not Action.CAST or decision.dtype != low:
            continue
        weight, bias = node.args[1], node.args[2]
        if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (weight, bias)):
            continue
        if any(getattr(gm, str(a.target)).dtype != torch.float32 for a in (weight, bias)):
            continue
        found[node.name] = str(bias.target)
    return found


class _Shifts(torch.fx.Interpreter):
    """Runs the fp32 graph; at each candidate, adds up the output shift of rounding its weight."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Collection[str], low: torch.dtype) -> None:
        super().__init__(gm)
        self.nodes, self.low = nodes, low
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.nodes:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args = (args[0], _rounded(args[1], self.low), *args[2:])
            assert callable(n.target)
            shift = (n.target(*args, **kwargs) - result).double()
            dim = _CHANNEL_DIM[n.target] % shift.dim()
            flat = shift.movedim(dim, -1).reshape(-1, shift.shape[dim])
            self.sums[n.name] = self.sums.get(n.name, 0) + flat.sum(0)
            self.counts[n.name] = self.counts.get(n.name, 0) + flat.shape[0]
        return result


class Correction(NamedTuple):
    """A layer's fp32 bias (its attribute on the graph module) and the mean shift to take out of it."""

    bias: str
    shift: torch.Tensor


def measure(
    gm: torch.fx.GraphModule, decisions: Mapping[str, Decision], low: torch.dtype, batches: Sequence[Sequence[torch.Tensor]]
) -> dict[str, Correction]:
    """Node name -> its fp32 bias and the mean output shift (per output channel) that rounding its
    weight to ``low`` causes, read on the fp32 graph (before casts are inserted).

    A layer whose shift is not finite on the calibration data (a NaN or infinity in it) is left out:
    it is not corrected.
    """
    nodes = candidates(gm, decisions, low)
    if not nodes:
        return {}
    shifts = _Shifts(gm, nodes, low)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        for batch in batches:
            shifts.run(*batch)
    means = {name: (total / shifts.counts[name]).float() for name, total in shifts.sums.items()}
    return {
        name: Correction(nodes[name], mean)
        for name, mean in means.items()
        if bool(torch.isfinite(mean).all())
    }


def apply(gm: torch.fx.GraphModule, corrections: Mapping[str, Correction], low: torch.dtype) -> int:
    """Give each corrected node (by name) its own bias ``b - shift`` in ``low``; returns how many."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    done = 0
    for name, (source, shift) in corrections.items():
        node = by_name.get(name)
        if node is None or not isinstance(node.args[2], torch.fx.Node):
            continue
        corrected = (getattr(gm, source).detach() - shift).to(low).contiguous()
        attr = f"{source}_{dtype_name(low)}_corrected"
        while hasattr(gm, attr):
            attr += "_"
        gm.register_buffer(attr, corrected)
        old = node.args[2]
        with gm.graph.inserting_after(old):
            new = gm.graph.get_attr(attr)
        new.meta = {**old.meta, "val": old.meta["val"].fake_mode.from_tensor(corrected, static_shapes=True)}
        node.args = (node.args[0], node.args[1], new, *node.args[3:])
        if not old.users:  # the uncorrected copy, unless another layer shares it
            target = str(old.target)
            gm.graph.erase_node(old)
            if target != source and not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
                delattr(gm, target)
        done += 1
    return done
