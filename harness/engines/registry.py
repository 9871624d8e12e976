"""Backend lookup by name, importing each backend only when asked for.

TensorRT and ONNX Runtime pull in heavy (or, off GPU runners, missing)
libraries; importing them lazily keeps ``harness build --backend cpu`` working
on a machine that has neither.
"""

from __future__ import annotations

import importlib

import torch

from harness.engines.protocol import Backend
from harness.errors import HarnessError

# name -> (module, class); "auto" resolves to one of these.
_BACKENDS = {
    "cpu": ("harness.engines.cpu", "CpuBackend"),
    "onnxruntime": ("harness.engines.onnxruntime.backend", "OnnxRuntimeBackend"),
    # optional: the ``openvino`` extra (its ImportError names it)
    "openvino": ("harness.engines.openvino.backend", "OpenVinoBackend"),
    "tensorrt": ("harness.engines.tensorrt.backend", "TensorRTBackend"),
}
BACKEND_NAMES = (*_BACKENDS, "auto")


def resolve_name(name: str) -> str:
    """The concrete backend ``name`` stands for ("auto": TensorRT on a CUDA machine, else cpu)."""
    if name == "auto":
        return "tensorrt" if _tensorrt_importable() and torch.cuda.is_available() else "cpu"
    if name not in _BACKENDS:
        raise HarnessError(f"unknown backend {name!r}; valid backends: {', '.join(BACKEND_NAMES)}")
    return name


def get_backend(name: str) -> Backend:
    """Instantiate the backend called ``name`` (one of :data:`BACKEND_NAMES`)."""
    resolved = resolve_name(name)
    module_name, class_name = _BACKENDS[resolved]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HarnessError(f"backend {resolved!r} is not available here: {exc}") from exc
    backend: Backend = getattr(module, class_name)()
    backend.check_available()
    return backend


def _tensorrt_importable() -> bool:
    # Only type stubs may be installed (they are not an importable module), or
    # the wheel may lack its native libraries: both mean "no TensorRT here".
    try:
        importlib.import_module("tensorrt")
    except (ImportError, OSError):
        return False
    return True
