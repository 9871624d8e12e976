"""A model that only works in mixed precision: the reason ``data_max`` exists.

``linear2`` has large (but fp16-representable) weights, so its outputs reach
~1e5, past fp16's 65504: the whole model in fp16 gives inf/NaN. The product
is scaled back down (``mul`` by 1e-3) and normalized, and everything around
it has small values, so keeping just ``linear2`` and ``mul`` in fp32 (what the
``data_max=512`` rule does on calibration data) is both finite and accurate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec, default_calibration_data, register, seeded_init

SEED = 4000
BIG_WEIGHT = 30000.0  # below fp16's max (65504) so the weights themselves fit
SCALE = 1e-3


class Overflow(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.linear1 = nn.Linear(features, hidden)
        self.linear2 = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.linear3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.linear1(x))
        x = self.linear2(x) * SCALE
        out: torch.Tensor = self.linear3(self.norm(x))
        return out


@register("overflow")
def build() -> ModelSpec:
    generator = torch.Generator().manual_seed(SEED)
    module = Overflow()
    seeded_init(module, generator)
    with torch.no_grad():
        module.linear2.weight.uniform_(-BIG_WEIGHT, BIG_WEIGHT, generator=generator)
    example = (torch.rand(8, 64, generator=generator) * 2 - 1,)
    return ModelSpec(
        name="overflow",
        description=f"MLP whose linear2 (weights up to {BIG_WEIGHT:g}) produces ~1e5 "
        f"intermediates, scaled by {SCALE:g} and layer-normed; fp16 overflows, "
        "fp32 is finite; input (8, 64)",
        module=module.eval(),
        example_inputs=example,
        calibration_data=default_calibration_data(example, seed=SEED),
        batch_dim=0,
    )
