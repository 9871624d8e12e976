"""Bias correction of the rule policy: what it subtracts, and that it lowers the error against fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import models
from harness.autocast import compile
from harness.autocast.compiler import CompiledGraph
from harness.autocast.options import settings_from
from harness.autocast.settings import AutocastSettings
from harness.outputs import tensor_paths


class ReluLinear(nn.Module):
    """A layer whose input has a mean far from zero (after a ReLU), where the shift is largest."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.conv = conv
        shape = (16, 8, 3, 3) if conv else (16, 64)
        self.weight = nn.Parameter(torch.randn(shape, generator=generator) * 0.3)
        self.bias = nn.Parameter(torch.randn(16, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x) + 1.0
        return F.conv2d(x, self.weight, self.bias, padding=1) if self.conv else F.linear(x, self.weight, self.bias)


def _batches(conv: bool, seed: int, count: int) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 8, 6, 6) if conv else (32, 64)
    return [(torch.randn(shape, generator=generator),) for _ in range(count)]


def _lowered_bias(compiled: CompiledGraph) -> torch.Tensor:
    """The low-precision bias the layer runs with."""
    layer = next(n for n in compiled.graph_module.graph.nodes if n.target in (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default))
    return getattr(compiled.graph_module, str(layer.args[2].target))


def _compile(module: nn.Module, calibration: list[tuple[torch.Tensor]], *, correct: bool) -> CompiledGraph:
    settings = AutocastSettings(
        low_precision_type="fp16", data_max=None, fp32_output_tail=False, bias_correction=correct
    )
    return compile(module, calibration[0], policy="rule", settings=settings, calibration_data=calibration)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
def test_the_bias_is_the_rounded_bias_minus_the_mean_shift_of_the_rounded_weight(conv: bool) -> None:
    module = ReluLinear(conv).eval()
    calibration = _batches(conv, seed=1, count=3)
    plain = _compile(module, calibration, correct=False)
    assert torch.equal(_lowered_bias(plain), module.bias.detach().half())
    rounded = module.weight.detach().half().float()
    with torch.no_grad():
        shifts = []
        for (x,) in calibration:
            x = torch.relu(x) + 1.0
            if conv:
                shift = F.conv2d(x, rounded - module.weight, padding=1).transpose(1, -1)
            else:
                shift = F.linear(x, rounded - module.weight)
            shifts.append(shift.reshape(-1, 16).double())
        mean_shift = torch.cat(shifts).mean(0).float()
    assert mean_shift.abs().max() > 1e-3  # the case is one where the correction matters
    assert plain.report.biases_corrected == 0
    compiled = _compile(module, calibration, correct=True)
    assert compiled.report.biases_corrected == 1
    assert "1 biases corrected for their layers' rounded weights" in compiled.report.table()
    corrected = _lowered_bias(compiled)
    assert corrected.dtype == torch.float16
    # equal up to one fp16 step: the graph sums the shift in another order than this test does
    torch.testing.assert_close(corrected.float(), (module.bias.detach() - mean_shift).half().float(), rtol=2**-10, atol=2**-24)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
def test_corrected_layers_are_nearer_fp32_on_data_they_were_not_fitted_on(conv: bool) -> None:
    module = ReluLinear(conv).eval()
    calibration, held_out = _batches(conv, seed=1, count=3), _batches(conv, seed=2, count=3)
    errors = {}
    for correct in (False, True):
        compiled = _compile(module, calibration, correct=correct)
        with torch.no_grad():
            diffs = [compiled(x).float() - module(x) for (x,) in held_out]
        signed = torch.cat([d.transpose(1, -1).reshape(-1, 16) if conv else d for d in diffs]).mean(0)
        errors[correct] = (signed.abs().max().item(), torch.cat([d.flatten() for d in diffs]).abs().mean().item())
    # the mean signed error per channel: the weights' shift was most of it; the rounding of the
    # layer's input and output, which correction does not touch, is what is left
    assert errors[True][0] < errors[False][0] / 1.5, errors
    assert errors[True][1] < errors[False][1], errors


@pytest.mark.slow  # two rule compiles and fp32 runs of each zoo model
@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_zoo_models_mean_error_against_fp32_falls(name: str) -> None:
    spec = models.load(name)
    generator = torch.Generator().manual_seed(7)
    held_out = [
        tuple(
            torch.randint_like(t, int(t.max()) + 1, generator=generator) if not t.is_floating_point()
            else torch.randn(t.shape, generator=generator)
            for t in spec.example_inputs
        )
        for _ in range(3)
    ]
    error = {}
    for correct in (False, True):
        settings = AutocastSettings(low_precision_type="fp16", bias_correction=correct)
        compiled = compile(spec.module, spec.example_inputs, policy="rule", settings=settings,
                           calibration_data=spec.calibration_data)  # fmt: skip
        total = 0.0
        with torch.no_grad():
            for batch in held_out:
                for (_, got), (_, want) in zip(tensor_paths(compiled(*batch)), tensor_paths(spec.module(*batch)), strict=True):
                    total += (got.float() - want).abs().mean().item()
        error[correct] = total
    assert error[True] < error[False], error


def test_calibration_data_with_a_nan_leaves_the_bias_uncorrected() -> None:
    module = ReluLinear(conv=False).eval()
    calibration = _batches(False, seed=1, count=2)
    calibration[1][0][3, 5] = float("nan")
    compiled = _compile(module, calibration, correct=True)
    assert torch.equal(_lowered_bias(compiled), module.bias.detach().half())
    assert torch.isfinite(compiled(calibration[0][0])).all()


def test_the_flag_and_the_project_key_turn_it_off_and_change_the_digest() -> None:
    on, off = settings_from({}), settings_from({"bias_correction": False})
    assert on.bias_correction is True and off.bias_correction is False
    assert on.to_json()["bias_correction"] is True and off.to_json()["bias_correction"] is False
    assert on.digest() != off.digest()
