"""The same architecture with other weights: results that hold for one draw may not hold for the next."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def draw_parameters_(module: torch.nn.Module, seed: int) -> None:
    """Draw ``module``'s parameters anew from ``seed``, in place, each with its own mean and spread.

    Each floating parameter of more than one element that is not constant is
    replaced by ``randn * std + mean`` of its current values, in the order of
    ``module.parameters()``, from one generator seeded with ``seed``. A constant
    parameter (a norm's ones, a zero bias) stays as it is; buffers (running
    statistics, masks, position ids) are kept. The Parameter objects stay the
    same, so an export of ``module`` (which holds them) computes with the new values.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 1 and float(p.std()) > 0:
                p.copy_(torch.randn(p.shape, generator=generator) * p.std() + p.mean())


def reseeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``module`` in eval mode whose parameters are drawn anew from ``seed`` (:func:`draw_parameters_`)."""
    copied = copy.deepcopy(module)
    draw_parameters_(copied, seed)
    return copied.eval()


@contextmanager
def redrawn(module: torch.nn.Module, seed: int) -> Iterator[torch.nn.Module]:
    """``module`` itself with its parameters drawn from ``seed`` (:func:`draw_parameters_`) for the
    body; afterwards, normally or on an exception, every parameter holds its former bits again.

    The same draw as :func:`reseeded` without copying the module, so one export
    of it serves every draw; the body must not keep results that alias the
    parameters past the block (an fp32 graph compiled from the export does).
    """
    saved = [p.detach().clone() for p in module.parameters()]
    try:
        draw_parameters_(module, seed)
        yield module
    finally:
        with torch.no_grad():
            for p, value in zip(module.parameters(), saved, strict=True):
                p.copy_(value)
