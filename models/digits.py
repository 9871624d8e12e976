"""An MLP trained on scikit-learn's bundled 8x8 digits: the task-accuracy model.

scikit-learn is the ``digits`` extra (``pip install 'mixed-precision-harness[digits]'``).

Logit errors do not say whether a precision mode changes answers; a model
with labelled held-out data does. Training happens in process (no files, no
network) and is deterministic: a seeded generator for initialization, full
batch steps (no shuffling), and one intra-op thread so reduction order cannot
depend on the machine's core count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness.errors import HarnessError
from harness.extras import require
from harness.models import ModelSpec, register, seeded_init

SEED = 5000
BATCH = 64
HELD_OUT = 7 * BATCH  # whole batches, so evaluate() feeds example-shaped inputs only
CALIBRATION_BATCHES = 4
STEPS = 300
LEARNING_RATE = 1e-2


def make_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test), standardized with training statistics."""
    # Imported here: scikit-learn takes a while to import, only this model needs it, and it is
    # optional (the 'digits' extra): without it, loading this model is an error naming the extra.
    require("sklearn", "digits", "the zoo model 'digits' (its data set and split)")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=HELD_OUT, random_state=0, stratify=data.target
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0  # border pixels that are always blank

    def features(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((x - mean) / std).to(torch.float32)

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(y).to(torch.int64)

    return features(x_train), labels(y_train), features(x_test), labels(y_test)


def train(x: torch.Tensor, y: torch.Tensor, seed: int = SEED) -> nn.Sequential:
    """Full-batch Adam on (x, y); bit-identical for equal inputs and seed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The caller may be under no_grad or inference_mode; training needs autograd
    # and tensors (module, data) created outside inference mode.
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x, y = x.clone(), y.clone()
            module = make_mlp()
            seeded_init(module, torch.Generator().manual_seed(seed))
            optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE)
            for _ in range(STEPS):
                optimizer.zero_grad()
                torch.autograd.backward(F.cross_entropy(module(x), y))
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return module.eval()


def make_evaluate(
    x_test: torch.Tensor, y_test: torch.Tensor
) -> Callable[[Callable[..., Any]], float]:
    def evaluate(fn: Callable[..., Any]) -> float:
        """Held-out top-1 accuracy of ``fn``'s logits, fed one example-shaped batch at a time."""
        correct = 0
        with torch.no_grad():
            for xb, yb in zip(torch.split(x_test, BATCH), torch.split(y_test, BATCH), strict=True):
                logits = fn(xb)
                if isinstance(logits, (tuple, list)) and len(logits) == 1:
                    logits = logits[0]
                if not isinstance(logits, torch.Tensor) or logits.shape != (len(xb), 10):
                    raise HarnessError(
                        "digits evaluate: the model must return logits of shape "
                        f"({len(xb)}, 10), got {getattr(logits, 'shape', type(logits).__name__)}"
                    )
                correct += int((logits.argmax(dim=1) == yb).sum())
        return correct / len(y_test)

    return evaluate


@register("digits")
def build() -> ModelSpec:
    x_train, y_train, x_test, y_test = load_split()
    calibration = torch.split(x_train[: CALIBRATION_BATCHES * BATCH], BATCH)
    return ModelSpec(
        name="digits",
        description="MLP 64-64-10 (ReLU) trained on sklearn digits (8x8, standardized); "
        f"input ({BATCH}, 64); evaluate() = accuracy on {HELD_OUT} held-out samples",
        module=train(x_train, y_train),
        example_inputs=(x_test[:BATCH],),
        calibration_data=[(xb,) for xb in calibration],
        evaluate=make_evaluate(x_test, y_test),
        batch_dim=0,
    )
