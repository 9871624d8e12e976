"""A team's own model, as `harness` loads it: ``my_model.py:classifier`` (results name it "classifier", after the factory).

The factory takes ``batch_size`` so that ``batch_sizes`` in harness.toml can
sweep it; weights come from the seeded generator every factory starts from.
"""

import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16 * 16 * 16)
        self.head = nn.Linear(16 * 16 * 16, 10)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.relu(self.stem(images)).flatten(1)
        return {"logits": self.head(self.norm(features)), "features": features}


def classifier(batch_size: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Classifier(), (torch.randn(batch_size, 3, 16, 16),)
