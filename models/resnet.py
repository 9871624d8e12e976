"""A small CIFAR-style ResNet: the conv + BatchNorm + residual workload.

BatchNorm gets random (seeded) running statistics and affine parameters:
with PyTorch's defaults (mean 0, var 1, scale 1, shift 0) it would be the
identity in eval mode and a BN-folding or BN-precision bug would go unseen.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec, default_calibration_data, register, seeded_init

SEED = 2000
WIDTHS = (32, 64, 128)


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = WIDTHS, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        blocks = []
        for i, width in enumerate(widths):
            in_channels = widths[max(i - 1, 0)]
            blocks.append(BasicBlock(in_channels, width, stride=1 if i == 0 else 2))
        self.stages = nn.Sequential(*blocks)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = self.stages(x)
        x = F.adaptive_avg_pool2d(x, 1)
        logits: torch.Tensor = self.fc(torch.flatten(x, 1))
        return logits


def _randomize_batchnorm(module: nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for bn in module.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.weight.uniform_(0.5, 1.5, generator=generator)
                bn.bias.uniform_(-0.2, 0.2, generator=generator)
                bn.get_buffer("running_mean").uniform_(-0.2, 0.2, generator=generator)
                bn.get_buffer("running_var").uniform_(0.5, 2.0, generator=generator)


@register("resnet")
def build() -> ModelSpec:
    generator = torch.Generator().manual_seed(SEED)
    module = ResNet()
    # He-uniform keeps activations O(1) through the ReLU stack.
    seeded_init(module, generator, gain=math.sqrt(6))
    _randomize_batchnorm(module, generator)
    example = (torch.rand(8, 3, 32, 32, generator=generator) * 2 - 1,)
    return ModelSpec(
        name="resnet",
        description=f"ResNet with BasicBlocks, stages {WIDTHS} channels; "
        "input (8, 3, 32, 32), 10 classes",
        module=module.eval(),
        example_inputs=example,
        calibration_data=default_calibration_data(example, seed=SEED),
        batch_dim=0,
    )
