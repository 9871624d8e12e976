"""The CNN of Torch-TensorRT's rule-based autocast design page.

Kept op for op so that ``torch.export`` yields the node names the page's
classifier example refers to (``conv2d``, ``relu``, ``max_pool2d``,
``conv2d_1``, ...) and the ``torch.autocast(float32)`` block around ``fc1`` and
the add becomes a ``wrap_with_autocast`` node whose ops must stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec, default_calibration_data, register, seeded_init

SEED = 1000


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        with torch.autocast(x.device.type, enabled=True, dtype=torch.float32):
            x = self.fc1(x)
            x = torch.add(x, x)
        return x


@register("lenet")
def build() -> ModelSpec:
    generator = torch.Generator().manual_seed(SEED)
    module = LeNet()
    seeded_init(module, generator)
    example = (torch.rand(8, 1, 28, 28, generator=generator) * 2 - 1,)
    return ModelSpec(
        name="lenet",
        description="Torch-TensorRT rule-based autocast example CNN: 2x(conv3x3-relu-maxpool), fc1 + add inside autocast(fp32); "
        "input (8, 1, 28, 28)",
        module=module.eval(),
        example_inputs=example,
        calibration_data=default_calibration_data(example, seed=SEED),
        batch_dim=0,
    )
