"""The batches a debug command runs on: the model's own, or a user's safetensors file.

A model's own batches are its example inputs followed by its calibration
batches (what ``harness bench`` and the compiler already use), so an error
found here is the error those commands see. A user file has the format of
``--calibration-data`` (tensors ``input0``, ``input1``, ... with the batches
stacked on a new first dimension) and is checked against the example inputs
before anything runs.
"""

from __future__ import annotations

import os

import torch

from harness.autocast.calibrate import check_calibration_data
from harness.autocast.settings import load_calibration_file
from harness.errors import HarnessError
from harness.models import ModelSpec

Batch = tuple[torch.Tensor, ...]


def model_batches(spec: ModelSpec) -> list[Batch]:
    """The example inputs, then every calibration batch."""
    return [tuple(spec.example_inputs), *(tuple(b) for b in spec.calibration_data)]


def load_batches(spec: ModelSpec, path: str | os.PathLike[str] | None) -> list[Batch]:
    """Batches from ``path`` (``--inputs FILE``), or the model's own when no file is given."""
    if path is None:
        return model_batches(spec)
    batches = load_calibration_file(path)
    try:
        return check_calibration_data(batches, spec.example_inputs)
    except HarnessError as exc:
        detail = str(exc).replace("calibration batch", "batch", 1)
        raise HarnessError(f"--inputs {os.fspath(path)}: {detail}") from None
