"""Optional dependencies: import one, or fail naming the extra that installs it.

A plain install (``pip install .`` in a checkout) brings what the CPU engine
path needs (compile, build, bench, cache, gate). The rest comes with extras:

* ``onnx``: onnx, onnxscript, onnx-ir, onnxruntime (the ``onnxruntime``
  backend, the ONNX hand-off of the ``tensorrt`` backend, the
  ``onnxruntime`` peer);
* ``openvino``: OpenVINO and the ONNX exporter it reads from (the
  ``openvino`` backend and peer);
* ``onednn``: oneDNN's library built on GNU OpenMP (the CPU engine's
  ``gemm_dnnl``, ``conv_dnnl``, ``pool_dnnl``, ``binary_dnnl``, ``cast_dnnl``,
  ``layernorm_dnnl`` and ``sdpa_dnnl`` tactics; Linux x86-64; without it they are not offered);
* ``plots``: matplotlib (the PNGs of ``bench``, ``report`` and ``debug``);
* ``digits``: scikit-learn (the zoo's ``digits`` model and its data);
* ``hf``: transformers (the zoo's ``hf-*`` models, ``--model hf:DIR``);
* ``ray``: Ray (``harness bench --executor ray``: the matrix's cases as tasks on a cluster);
* ``onnx-import``: onnx2torch, converting an ONNX file (``--model x.onnx``)
  for the compiler's modes and the cpu engine (not in ``all``: it requires
  torchvision, which a CPU build of torch lacks; ``pip install --no-deps
  onnx2torch`` there);
* ``all``: every one of them;
* ``tensorrt-cu12``, ``tensorrt-cu13``: TensorRT for the ``tensorrt`` backend on a
  GPU machine, and its ONNX hand-off: the one for the CUDA major of the
  installed torch (:func:`tensorrt_extra`); TensorRT's native libraries come
  from NVIDIA's package host.

:func:`require` is where such a module enters: it returns the module, or
raises :class:`MissingExtra` (a :class:`HarnessError`, exit code 2) whose
message names the missing package and the exact ``pip install`` command.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from harness.errors import HarnessError

DISTRIBUTION = "mixed-precision-harness"

# import name -> the package pip installs it from
PACKAGES = {
    "onnx": "onnx",
    "onnxscript": "onnxscript",
    "onnx_ir": "onnx-ir",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "transformers": "transformers",
    "onnx2torch": "onnx2torch",
    "ray": "ray",
}


# The CUDA major of the installed torch -> the extra with the TensorRT built for it.
TENSORRT_EXTRAS = {"12": "tensorrt-cu12", "13": "tensorrt-cu13"}


def tensorrt_extra(cuda: str | None) -> str:
    """The extra that installs TensorRT for a torch built with CUDA ``cuda`` (``torch.version.cuda``).

    Raises HarnessError for a CPU build of torch (None) or a CUDA with no extra here.
    """
    if cuda is None:
        raise HarnessError(
            "the installed torch is a CPU build (torch.version.cuda is None): TensorRT needs a CUDA build of "
            f"torch first, then {' or '.join(install_command(e) for e in TENSORRT_EXTRAS.values())} for its CUDA"
        )
    major = cuda.split(".")[0]
    if major not in TENSORRT_EXTRAS:
        raise HarnessError(
            f"the installed torch is built with CUDA {cuda}; TensorRT comes as an extra for CUDA "
            f"{', '.join(TENSORRT_EXTRAS)} only: {', '.join(TENSORRT_EXTRAS.values())}"
        )
    return TENSORRT_EXTRAS[major]


def checkout() -> Path | None:
    """The source checkout this harness runs from (its ``pyproject.toml`` beside the package), or None
    for an install from a wheel."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def install_command(extra: str) -> str:
    """The command that installs ``extra`` into this environment, quoted for a POSIX shell.

    From a checkout (how the harness is installed: it is not on a package
    index), the checkout's path with the extra, relative to the current
    directory where that is shorter (``pip install '.[plots]'`` inside it);
    from a wheel, the distribution's name.
    """
    root = checkout()
    if root is None:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    relative = os.path.relpath(root)
    where = relative if len(relative) <= len(str(root)) else str(root)
    if not where.startswith((".", "/")):
        where = f"./{where}"  # a bare name would be looked up on the index
    return f"pip install '{where}[{extra}]'"


class MissingExtra(HarnessError):
    """An optional module is not installed; the message names its package and extra."""

    def __init__(self, module: str, extra: str, purpose: str, detail: str | None = None) -> None:
        self.module = module
        self.extra = extra
        self.package = PACKAGES.get(module.partition(".")[0], module)
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"{purpose} needs {self.package}, which is not installed{why}; it comes with the "
            f"'{extra}' extra: {install_command(extra)}"
        )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or raise :class:`MissingExtra` naming ``extra``.

    ``purpose`` says what needed it ("backend 'onnxruntime'"). An ImportError
    raised *inside* an installed module (a broken install: one of its own
    dependencies missing) is reported with the module that failed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        detail = None if missing == module else f"importing {module} failed: {exc}"
        raise MissingExtra(module, extra, purpose, detail) from exc


def require_all(modules: tuple[str, ...], extra: str, purpose: str) -> None:
    """:func:`require` each of ``modules`` (the first missing one is reported)."""
    for module in modules:
        require(module, extra, purpose)


def missing(modules: tuple[str, ...], extra: str, purpose: str) -> MissingExtra | None:
    """The error :func:`require_all` would raise, or None when every module imports."""
    try:
        require_all(modules, extra, purpose)
    except MissingExtra as exc:
        return exc
    return None


# The modules each extra's features import, for the checks above.
ONNX_MODULES = ("onnx", "onnxscript", "onnx_ir", "onnxruntime")
ONNX_EXPORT_MODULES = ("onnx", "onnxscript", "onnx_ir")  # torch.onnx.export (dynamo) and its optimizer
PLOT_MODULES = ("matplotlib",)
