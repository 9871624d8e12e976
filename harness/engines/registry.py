"""Backend lookup by name, importing each backend only when asked for.

TensorRT, ONNX Runtime and OpenVINO pull in heavy (or, off GPU runners,
missing) libraries; importing them lazily keeps ``harness build --backend
cpu`` working on a machine that has none of them. The optional packages a
backend needs are checked before its module is imported
(:func:`harness.extras.require`), so a missing one is an error naming the
extra that installs it, not an ImportError from deep inside the backend.
This module imports neither torch nor any backend itself: the command line
reads :data:`BACKEND_NAMES` while building its parser.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from harness.errors import HarnessError
from harness.extras import ONNX_EXPORT_MODULES, ONNX_MODULES, require_all

if TYPE_CHECKING:
    from harness.engines.protocol import Backend

# name -> (module, class); "auto" resolves to one of these.
_BACKENDS = {
    "cpu": ("harness.engines.cpu", "CpuBackend"),
    "onnxruntime": ("harness.engines.onnxruntime.backend", "OnnxRuntimeBackend"),
    "openvino": ("harness.engines.openvino.backend", "OpenVinoBackend"),
    "tensorrt": ("harness.engines.tensorrt.backend", "TensorRTBackend"),
}
# name -> (the optional modules it imports, the extra that installs them). The
# TensorRT wheel itself is no extra (it comes from NVIDIA's index with CUDA); its
# ONNX hand-off is.
_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "onnxruntime": (ONNX_MODULES, "onnx"),
    "openvino": (("openvino", *ONNX_EXPORT_MODULES), "openvino"),
    "tensorrt": (ONNX_EXPORT_MODULES, "onnx"),
}
BACKEND_NAMES = (*_BACKENDS, "auto")


def resolve_name(name: str) -> str:
    """The concrete backend ``name`` stands for ("auto": TensorRT on a CUDA machine, else cpu)."""
    if name == "auto":
        if not _tensorrt_importable():
            return "cpu"
        import torch

        return "tensorrt" if torch.cuda.is_available() else "cpu"
    if name not in _BACKENDS:
        raise HarnessError(f"unknown backend {name!r}; valid backends: {', '.join(BACKEND_NAMES)}")
    return name


def check_extras(name: str) -> None:
    """Raise :class:`harness.extras.MissingExtra` when an optional package backend ``name`` needs is missing."""
    if name in _NEEDS:
        modules, extra = _NEEDS[name]
        require_all(modules, extra, f"backend {name!r}")


def get_backend(name: str) -> Backend:
    """Instantiate the backend called ``name`` (one of :data:`BACKEND_NAMES`)."""
    resolved = resolve_name(name)
    check_extras(resolved)
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
