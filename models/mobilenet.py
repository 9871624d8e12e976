"""A MobileNetV3-Small re-creation: the depthwise / hardswish / squeeze-excite workload.

torchvision is not a dependency, so the architecture is written out here
after Howard et al., "Searching for MobileNetV3" (table 2) and torchvision's
``mobilenet_v3_small``: a hardswish stem, eleven inverted-residual blocks
(1x1 expand, depthwise 3x3/5x5, optional squeeze-excite with a hardsigmoid
gate, 1x1 project, residual when shapes allow), a 1x1 head conv, global
pooling and a two-layer classifier. Its layers are many and small (16 to 576
channels, depthwise convolutions with one channel per group, 1x1 convolutions
on 1x1 maps inside the squeeze-excite), which is what makes per-layer overhead
and depthwise kernels, rather than big GEMMs, decide its speed.

BatchNorm gets random (seeded) statistics as in the resnet model, so folding
it is visible; the input is one 224x224 image, the usual deployment case.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec, default_calibration_data, register, seeded_init

# The resnet model's seeded BatchNorm statistics: the same reason, the same draw.
from .resnet import _randomize_batchnorm

SEED = 6000
# (kernel, expanded channels, output channels, squeeze-excite, activation, stride)
BLOCKS = (
    (3, 16, 16, True, "relu", 2),
    (3, 72, 24, False, "relu", 2),
    (3, 88, 24, False, "relu", 1),
    (5, 96, 40, True, "hardswish", 2),
    (5, 240, 40, True, "hardswish", 1),
    (5, 240, 40, True, "hardswish", 1),
    (5, 120, 48, True, "hardswish", 1),
    (5, 144, 48, True, "hardswish", 1),
    (5, 288, 96, True, "hardswish", 2),
    (5, 576, 96, True, "hardswish", 1),
    (5, 576, 96, True, "hardswish", 1),
)
STEM, HEAD, HIDDEN, CLASSES = 16, 576, 1024, 10  # 10 classes, as every zoo model
INPUT_SHAPE = (1, 3, 224, 224)
_ACTIVATIONS = {"relu": nn.ReLU, "hardswish": nn.Hardswish}


def make_divisible(value: float, divisor: int = 8) -> int:
    """Channel count rounded to a multiple of ``divisor``, never below 90% of ``value`` (torchvision's rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class ConvBN(nn.Sequential):
    """Convolution without bias, BatchNorm, then the activation (none for projections)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, activation: str = ""
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if activation:
            layers.append(_ACTIVATIONS[activation]())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """Channel attention: global average, 1x1 reduce + relu, 1x1 expand + hardsigmoid, rescale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = make_divisible(channels / 4)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(scale))))
        return x * scale


class InvertedResidual(nn.Module):
    def __init__(
        self, cin: int, kernel: int, expanded: int, cout: int, se: bool, activation: str, stride: int
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(ConvBN(cin, expanded, 1, activation=activation))
        layers.append(ConvBN(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if se:
            layers.append(SqueezeExcite(expanded))
        layers.append(ConvBN(expanded, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x)
        return x + out if self.residual else out


class MobileNetV3Small(nn.Module):
    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvBN(3, STEM, 3, stride=2, activation="hardswish")]
        cin = STEM
        for kernel, expanded, cout, se, activation, stride in BLOCKS:
            layers.append(InvertedResidual(cin, kernel, expanded, cout, se, activation, stride))
            cin = cout
        layers.append(ConvBN(cin, HEAD, 1, activation="hardswish"))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(HEAD, HIDDEN), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(HIDDEN, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        logits: torch.Tensor = self.classifier(torch.flatten(x, 1))
        return logits


@register("mobilenet")
def build() -> ModelSpec:
    generator = torch.Generator().manual_seed(SEED)
    module = MobileNetV3Small()
    # He-uniform keeps activations O(1) through the relu/hardswish stack.
    seeded_init(module, generator, gain=math.sqrt(6))
    _randomize_batchnorm(module, generator)
    example = (torch.rand(*INPUT_SHAPE, generator=generator) * 2 - 1,)
    return ModelSpec(
        name="mobilenet",
        description="MobileNetV3-Small (depthwise conv, hardswish, squeeze-excite), "
        f"{len(BLOCKS)} inverted-residual blocks; input {INPUT_SHAPE}, {CLASSES} classes",
        module=module.eval(),
        example_inputs=example,
        calibration_data=default_calibration_data(example, seed=SEED),
        batch_dim=0,
    )
