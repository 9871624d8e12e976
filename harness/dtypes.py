"""The dtype vocabulary: torch dtypes and the short names users and saved files write.

One table pairs every dtype the harness handles with its short name ("fp16",
not "torch.float16" or TensorRT's "Half"). Command lines, explicit-precision
files, plans, reports and cache keys use these names; each runtime's own type
table (ONNX element types, OpenVINO types, TensorRT spellings) maps its types
to torch dtypes and takes the names from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from harness.errors import HarnessError

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp64": torch.float64,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
)
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Names of the floating dtypes ("fp32", "fp16", "bf16", "fp64").
FLOAT_DTYPES = frozenset(name for name, dtype in DTYPES.items() if dtype.is_floating_point)
# The reduced precisions a mode or the compiler works in, and what an explicit-precision file may assign.
LOW_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: DTYPES[name] for name in ("fp16", "bf16")})
EXPLICIT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({"fp32": torch.float32, **LOW_DTYPES})


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a tensor dtype ("fp32", "bf16", "int64", ...); other dtypes are refused."""
    if dtype not in _NAMES:
        raise HarnessError(f"dtype {dtype} is not supported by the engines; supported: {', '.join(DTYPES)}")
    return _NAMES[dtype]


def dtype_label(dtype: torch.dtype) -> str:
    """The short name of ``dtype`` if it has one, torch's name ("complex64") otherwise: for reports and messages."""
    return _NAMES.get(dtype) or torch_name(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; an unknown name is an error naming the valid ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise HarnessError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def torch_name(dtype: torch.dtype) -> str:
    """torch's own spelling of ``dtype`` ("float16"), which settings accept besides the short name."""
    return str(dtype).removeprefix("torch.")


def with_torch_names(table: Mapping[str, torch.dtype]) -> dict[str, torch.dtype]:
    """``table`` (short name -> dtype) plus torch's spelling of each of its dtypes."""
    return {**table, **{torch_name(dtype): dtype for dtype in table.values()}}
