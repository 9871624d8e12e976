"""Digests of weights: which numbers a model or engine computes with.

Two runs that used different weights compare different models; ``compare``
and ``gate`` need to say so rather than report the difference as a
regression. One digest serves engines (their stored weights) and models
(their state dict), independent of memory layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.fileio import canonical_json, digest


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """Digest of names, dtypes, shapes and raw bytes, independent of storage layout."""
    parts = []
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous()
        header = canonical_json([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        parts += [header, tensor.reshape(-1).view(torch.uint8).numpy().tobytes()]
    return digest(b"\0".join(parts))


def module_weights_digest(module: torch.nn.Module) -> str:
    """:func:`weights_digest` of a module's parameters and buffers (its state dict)."""
    return weights_digest(module.state_dict())
