"""What machine and what code produced a result: the ``machine`` and ``git`` records of results.

Latency numbers only mean something next to the hardware, software versions
and commit that produced them, so every results file carries this record
(pytest-benchmark does the same). The machine's identity itself is
:mod:`harness.machine`'s.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from harness.machine import cpu_info, gpu_info, machine_id

_PACKAGES = ("numpy", "onnx", "onnxruntime", "nvidia-ml-py", "tensorrt")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def tensorrt_version() -> str | None:
    """Version of an importable TensorRT, None without one.

    The type stubs install a ``tensorrt`` namespace package without
    ``__version__``; that is not a TensorRT.
    """
    try:
        import tensorrt
    except ImportError:
        return None
    version = getattr(tensorrt, "__version__", None)
    return str(version) if version is not None else None


def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_info(repo: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Commit of the project checkout and whether tracked files differ from it.

    Untracked files do not count as dirty: result files written into the
    checkout are untracked and would otherwise mark every run dirty.
    Outside a repository (or before the first commit) both are None.
    """
    root = Path(repo) if repo is not None else _PROJECT_ROOT

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def machine_info() -> dict[str, Any]:
    """The ``machine`` record of a results file."""
    import torch

    cpu = cpu_info()
    gpus = gpu_info()
    uname = platform.uname()
    return {
        "id": machine_id(cpu, gpus),
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "memory_bytes": int(psutil.virtual_memory().total),
        "os": {"system": uname.system, "release": uname.release, "platform": platform.platform()},
        "python": {"version": platform.python_version(), "implementation": sys.implementation.name},
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
        },
        "gpu": gpus,
        "tensorrt": tensorrt_version(),
        "packages": _package_versions(),
    }
