"""The model description every stage takes: the module, the data it runs on, its batch axis."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model plus the data every harness stage runs it on.

    ``eq=False``: field-wise equality would compare tensors elementwise and
    fail; two specs are the same only if they are the same object.
    """

    name: str
    description: str
    module: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    calibration_data: list[tuple[torch.Tensor, ...]]
    evaluate: Callable[[Callable[..., Any]], float] | None = None
    # The dimension of every input that is the batch, if the model has one: declaring it
    # lets a benchmark sweep batch sizes (``--batch-sizes``) by resizing the inputs.
    batch_dim: int | None = None
