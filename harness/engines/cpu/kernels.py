"""Whether oneDNN runs a native kernel for a layer here, asked of the current capability.

A tactic on one of oneDNN's primitives is offered only where the primitive
the layer would create gets a native kernel. oneDNN falls back to reference
C++ loops (``ref:any``) where the CPU lacks the ISA for a type or a shape, or
has no kernel at all (``unimplemented``): such a tactic is correct but far
slower than the others, so it is never worth timing. The answer comes
from the primitive's descriptor (:func:`~harness.engines.cpu.onednn_primitive.kernel_of`),
cached by the capability per layer signature and thread count, so a build
asks oneDNN once per distinct layer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from harness.dtypes import dtype_from_name
from harness.engines import capability
from harness.engines.cpu import onednn_attention, onednn_primitive
from harness.extras import install_command

_Make = Callable[..., Any]


def missing(primitive: str, precision: str, make: _Make, *args: Any, **kwargs: Any) -> str | None:
    """Why ``make(*args, **kwargs)`` (a ``primitive`` of ``precision``) gets no native kernel
    here; None where it does.

    ``primitive`` and ``precision`` are as :mod:`harness.engines.capability`
    names them (a reorder's precision is ``"source>target"``).
    """
    if onednn_primitive.library() is None:
        return f"no oneDNN library ({install_command('onednn')})"
    signature = (getattr(make, "__name__", repr(make)), _frozen(args), _frozen(kwargs))
    impl = capability.current().onednn_kernel(
        primitive, precision, signature, lambda: onednn_primitive.kernel_of(make, *args, **kwargs)
    )
    return capability.reference_kernel(primitive, precision, impl)


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable signature: a tensor by its shape, strides and dtype, not its values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, torch.dtype):
        return str(value)
    return value  # type: ignore[no-any-return]


def _matmul(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    # With a bias: oneDNN 3.2's fp16 matmul has native kernels only for an fp32 one, which
    # Matmul always gives it; a probe without one would not see a bias's fallback.
    return onednn_primitive.Matmul, (torch.zeros(16, 16, dtype=dtype), torch.zeros(16, dtype=dtype), (16, 16), None, None)


def _convolution(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    weight, bias = torch.zeros(16, 16, 3, 3, dtype=dtype), torch.zeros(16, dtype=dtype)
    return onednn_primitive.Convolution, (weight, bias, (1, 16, 8, 8), [1, 1], [1, 1], [1, 1], 1, None, None)


def _pooling(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    return onednn_primitive.Pooling, (dtype, (1, 16, 4, 4), (4, 4))


def _binary(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    return onednn_primitive.Binary, ("binary_mul", dtype, (1, 16, 4, 4), (1, 16, 1, 1))


def _layernorm(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    return onednn_primitive.LayerNorm, (dtype, (4, 64), torch.ones(64), torch.zeros(64), 1e-5)


def _attention(dtype: torch.dtype) -> tuple[_Make, tuple[Any, ...]]:
    return onednn_attention.Attention, (dtype, (1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16, 16))


# The smallest primitive of each kind whose kernel shows what oneDNN runs for that kind here.
STANDARD: dict[str, Callable[[torch.dtype], tuple[_Make, tuple[Any, ...]]]] = {
    "matmul": _matmul,
    "convolution": _convolution,
    "pooling": _pooling,
    "binary": _binary,
    "layernorm": _layernorm,
    "attention": _attention,
}


def _reorder(conversion: str) -> tuple[_Make, tuple[Any, ...]]:
    source, target = conversion.split(">")
    return onednn_primitive.Cast, (dtype_from_name(source), dtype_from_name(target), (4, 64))


def _probe(primitive: str, precision: str) -> tuple[_Make, tuple[Any, ...]]:
    """The standard probe of ``primitive`` in ``precision`` (a reorder's: ``"source>target"``)."""
    if primitive == "reorder":
        return _reorder(precision)
    return STANDARD[primitive](dtype_from_name(precision))


def available(primitive: str, precision: str) -> bool:
    """Whether the standard probe of ``primitive`` in ``precision`` gets a native kernel here."""
    make, args = _probe(primitive, precision)
    return missing(primitive, precision, make, *args) is None


def standard_kernels() -> dict[str, str | None]:
    """"primitive precision" -> the implementation oneDNN names here for the standard probe of
    each primitive and precision (None: no kernel), asked of the library itself: the table a
    :class:`~harness.engines.capability.CpuKind` records."""
    pairs = [(p, q) for p in STANDARD for q in capability.PRECISIONS]
    pairs += [("reorder", conversion) for conversion in capability.REORDERS]
    table: dict[str, str | None] = {}
    for primitive, precision in pairs:
        make, args = _probe(primitive, precision)
        table[f"{primitive} {precision}"] = onednn_primitive.kernel_of(make, *args)
    return table
