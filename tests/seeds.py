"""The same architecture with other weights: results that hold for one draw may not hold for the next."""

from __future__ import annotations

import copy

import torch


def reseeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``module`` whose parameters are drawn anew from ``seed``, each with its own mean and spread.

    A constant parameter (a norm's ones, a zero bias) stays as it is; buffers
    (running statistics, masks, position ids) are kept.
    """
    copied = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copied.parameters():
            if p.is_floating_point() and p.numel() > 1 and float(p.std()) > 0:
                p.copy_(torch.randn(p.shape, generator=generator) * p.std() + p.mean())
    return copied.eval()
