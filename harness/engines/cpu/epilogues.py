"""The activations a convolution or linear layer may carry as its epilogue, as each kind of tactic applies them.

Lowering (:mod:`harness.engines.cpu.lowering`) folds an activation, and a
residual add before it, into the convolution or linear layer that produces
its input; every tactic of that layer then computes ``act(layer(x) [+ r])``:
in place on the layer's fresh result, out of place in a traced oneDNN graph,
as a post-op of torch's oneDNN ops or of oneDNN's primitives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.engines.cpu.onednn_primitive import Eltwise

Bound = Callable[..., Any]


@dataclass(frozen=True)
class Epilogue:
    """How each kind of tactic applies one epilogue activation."""

    in_place: Callable[[torch.Tensor], torch.Tensor] | None  # on the layer's fresh result
    traced: Callable[[torch.Tensor], torch.Tensor] | None  # out of place, in a traced oneDNN graph
    onednn: tuple[str, str]  # torch's oneDNN post-op (attr, algorithm)
    primitive: Eltwise | None  # oneDNN's own eltwise post-op, through its C API
    graph: bool = True  # whether PyTorch's oneDNN Graph bridge computes ``traced`` as written


_F = torch.nn.functional


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return _F.gelu(t, approximate="tanh")


EPILOGUES = {
    "": Epilogue(None, None, ("none", ""), None),
    # The layer's result is a fresh tensor: in place is safe.
    "relu": Epilogue(torch.relu_, _F.relu, ("relu", ""), Eltwise("relu")),
    "gelu": Epilogue(_F.gelu, _F.gelu, ("gelu", "none"), Eltwise("gelu_erf")),
    # PyTorch's oneDNN Graph bridge maps gelu(approximate="tanh") to the erf gelu, another function.
    "gelu_tanh": Epilogue(_gelu_tanh, _gelu_tanh, ("gelu", "tanh"), Eltwise("gelu_tanh"), graph=False),
    # x * clamp(x/6 + 1/2, 0, 1) and clamp(x/6 + 1/2, 0, 1): oneDNN's alpha and beta.
    "hardswish": Epilogue(torch._C._nn.hardswish_, _F.hardswish, ("hardswish", ""), Eltwise("hardswish", 1 / 6, 0.5)),
    "hardsigmoid": Epilogue(
        torch._C._nn.hardsigmoid_, _F.hardsigmoid, ("hardsigmoid", ""), Eltwise("hardsigmoid", 1 / 6, 0.5)
    ),
}
assert all(e.primitive for name, e in EPILOGUES.items() if name), "the primitives fuse every epilogue as a post-op"
# The epilogues each kind of layer can carry.
CONV_EPILOGUES = ("relu", "hardswish", "hardsigmoid")
LINEAR_EPILOGUES = ("relu", "gelu", "gelu_tanh", "hardswish", "hardsigmoid")


def with_epilogue(fn: Bound, epilogue: str, residual: bool = False) -> Bound:
    """``fn``'s result plus the residual (the layer's last input), then the activation.

    Both work in place on the layer's fresh result: the same additions and
    roundings as the separate add and activation layers, without a new tensor
    for each.
    """
    post = EPILOGUES[epilogue].in_place
    # Layers with an epilogue or a residual have one other dynamic input (convolutions
    # and linear layers with constant weights), so these wrappers take it alone.
    if residual:
        if post is None:
            return lambda x, r: fn(x).add_(r)
        return lambda x, r: post(fn(x).add_(r))
    if post is None:
        return fn
    return lambda x: post(fn(x))
