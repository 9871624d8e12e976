"""Calibration: per-tensor statistics of the fp32 graph on representative data.

Only statistics are kept (absmax, min, max, shape), aggregated over batches,
never the tensors themselves: calibrating a large model on many batches must
not hold every activation in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.errors import HarnessError
from harness.fxutil import tensor_vals


@dataclass
class TensorStats:
    absmax: float
    min: float
    max: float
    shape: tuple[int, ...]

    def merge(self, other: TensorStats) -> None:
        self.absmax = max(self.absmax, other.absmax)
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)


# node name -> stats of each floating output tensor (in pytree leaf order)
Calibration = dict[str, list[TensorStats]]


def default_calibration_data(example_inputs: Sequence[torch.Tensor], batches: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """A few random batches in (-1, 1) shaped like the example inputs; integer inputs keep their values."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        batch = tuple(
            (torch.rand(x.shape, generator=gen, dtype=torch.float32) * 2 - 1).to(x.dtype) if x.is_floating_point() else x.clone()
            for x in example_inputs
        )
        out.append(batch)
    return out


def check_calibration_data(data: Sequence[Any], example_inputs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Every batch must match the example inputs in count, shape and dtype."""
    if isinstance(data, torch.Tensor) or not isinstance(data, Sequence) or len(data) == 0:
        raise HarnessError("calibration_data must be a non-empty list of input tuples (one tuple per batch)")
    batches = []
    for i, batch in enumerate(data):
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        if len(batch) != len(example_inputs):
            raise HarnessError(
                f"calibration batch {i} has {len(batch)} inputs; the model takes {len(example_inputs)} "
                f"({', '.join(_describe(x) for x in example_inputs)})"
            )
        for j, (got, want) in enumerate(zip(batch, example_inputs, strict=True)):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                have = _describe(got) if isinstance(got, torch.Tensor) else type(got).__name__
                raise HarnessError(f"calibration batch {i}, input {j}: got {have}, expected {_describe(want)}")
        batches.append(batch)
    return batches


def _describe(x: torch.Tensor) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"


def _stats(t: torch.Tensor) -> TensorStats:
    lo, hi = torch.aminmax(t.detach().float())
    lo_f, hi_f = float(lo), float(hi)
    return TensorStats(absmax=max(abs(lo_f), abs(hi_f)), min=lo_f, max=hi_f, shape=tuple(t.shape))


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, calib: Calibration) -> None:
        super().__init__(gm)
        self.calib = calib

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("call_function", "placeholder"):
            stats = [_stats(t) for t in tensor_vals(result) if t.is_floating_point() and t.numel() > 0]
            seen = self.calib.get(n.name)
            if seen is None:
                self.calib[n.name] = stats
            else:
                for old, new in zip(seen, stats, strict=False):
                    old.merge(new)
        return result


def calibrate(gm: torch.fx.GraphModule, batches: Sequence[Sequence[torch.Tensor]]) -> Calibration:
    """Run the fp32 graph on each batch (ambient autocast off) and aggregate statistics."""
    calib: Calibration = {}
    recorder = _Recorder(gm, calib)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        for batch in batches:
            recorder.run(*batch)
    return calib
