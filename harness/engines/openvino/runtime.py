"""The one place that imports OpenVINO, and its vocabulary (types, tensors, errors) in the harness's.

OpenVINO is an optional dependency (the ``openvino`` extra): importing this
module without it raises an ImportError that names the extra, which the
backend registry turns into "backend 'openvino' is not available here: ...".

OpenVINO names element types its own way (``f32``, ``bf16``, ``i64``,
``boolean``); the engines speak the harness's dtype names (``fp32``,
``int64``, ``bool``: :data:`harness.dtypes.DTYPES`). The table
below only pairs OpenVINO's types with torch dtypes; the names themselves come
from the shared vocabulary. OpenVINO's errors are chains of C++ source
locations; :func:`error_text` and :func:`frontend_failures` keep what a user
can act on.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import torch

from harness.dtypes import DTYPES, dtype_name
from harness.extras import install_command

try:
    import openvino as ov
except (ImportError, OSError) as exc:  # OSError: a wheel whose native libraries do not load
    raise ImportError(
        f"OpenVINO is not installed or does not load ({exc}); install it with {install_command('openvino')}"
    ) from exc

VERSION: str = ov.__version__
DEVICE = "CPU"
# OpenVINO raises RuntimeError (not a class of its own) for a model it cannot read,
# compile or run and for a property value it refuses.
OV_ERRORS = (RuntimeError,)

_TORCH_BY_OV: dict[str, torch.dtype] = {
    ov.Type.f32.get_type_name(): torch.float32,
    ov.Type.f16.get_type_name(): torch.float16,
    ov.Type.bf16.get_type_name(): torch.bfloat16,
    ov.Type.f64.get_type_name(): torch.float64,
    ov.Type.i64.get_type_name(): torch.int64,
    ov.Type.i32.get_type_name(): torch.int32,
    ov.Type.i16.get_type_name(): torch.int16,
    ov.Type.i8.get_type_name(): torch.int8,
    ov.Type.u8.get_type_name(): torch.uint8,
    ov.Type.boolean.get_type_name(): torch.bool,
}
assert set(_TORCH_BY_OV.values()) == set(DTYPES.values()), "one OpenVINO type per engine dtype"
_OV_BY_NAME = {dtype_name(t): name for name, t in _TORCH_BY_OV.items()}


def dtype_of(ov_type: Any) -> str:
    """The harness's name of an OpenVINO element type or type name ("f32" -> "fp32").

    Types the engines do not use (``u4``, ``dynamic``) keep OpenVINO's name, so
    a report still shows what ran.
    """
    name = ov_type if isinstance(ov_type, str) else ov_type.get_type_name()
    dtype = _TORCH_BY_OV.get(name)
    return dtype_name(dtype) if dtype is not None else name


def ov_type_name(dtype: str) -> str:
    """OpenVINO's name ("bf16", "f32") for a harness dtype name, as its properties take it."""
    return _OV_BY_NAME[dtype]


@functools.cache
def core() -> Any:
    """One ``ov.Core`` per process: it loads the CPU plugin once; every engine passes its own
    properties to ``compile_model`` and none is set on the core, so engines never share settings."""
    return ov.Core()


def host_view(tensor: Any) -> np.ndarray:
    """A numpy view of an OpenVINO tensor's memory (bf16, which numpy lacks, as its 16-bit pattern)."""
    array: np.ndarray = tensor.data
    return array.view(np.int16) if tensor.element_type == ov.Type.bf16 else array


def copy_in(buffer: np.ndarray, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into a request's input ``buffer`` (:func:`host_view`).

    Filling the request's own input memory costs less per call than wrapping
    every input in a new ``ov.Tensor``, which dominates on small models.
    """
    data = tensor.detach()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    np.copyto(buffer, data.cpu().numpy(), casting="no")


def to_torch(tensor: Any) -> torch.Tensor:
    """A torch copy of an OpenVINO output (the request reuses its output memory on the next run)."""
    copy = torch.from_numpy(np.array(host_view(tensor), copy=True))
    return copy.view(torch.bfloat16) if tensor.element_type == ov.Type.bf16 else copy


def error_text(exc: BaseException) -> str:
    """OpenVINO's message without its chain of C++ source locations."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Exception from", "Check '"))]
    return (useful or lines or [type(exc).__name__])[-1]


_FAILED_OP = re.compile(r"^-- (?P<op>\S+) with a message:$")
_ONNX_NODE = re.compile(r"<Node\((?P<type>[^)]*)\): (?P<name>[^>]*)>")


def frontend_failures(exc: BaseException) -> str:
    """The ONNX nodes OpenVINO's frontend could not convert, each with its reason, else the message.

    The frontend reports one block per op type (``-- BatchNormalization-22 with
    a message:``, the ONNX node, a chain of C++ checks, the reason last).
    """
    lines = [line.strip() for line in str(exc).splitlines()]
    reasons = []
    for index, line in enumerate(lines):
        failed = _FAILED_OP.match(line)
        if failed is None:
            continue
        block = []
        for text in lines[index + 1 :]:
            if not text or text.startswith("-- ") or text == "Summary:":
                break
            block.append(text)
        node = next((m for m in map(_ONNX_NODE.search, block) if m is not None), None)
        where = f"{failed['op']} node {node['name']!r}" if node is not None else failed["op"]
        reasons.append(f"{where}: {block[-1] if block else 'no reason given'}")
    if not reasons:
        return error_text(exc)
    return "; ".join(reasons[:4]) + (f"; ... ({len(reasons) - 4} more)" if len(reasons) > 4 else "")
