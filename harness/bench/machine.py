"""What machine and what code produced a result.

Latency numbers only mean something next to the hardware, software versions
and commit that produced them, so every results file carries this record
(pytest-benchmark does the same).

The machine id names the directory that holds a machine's runs and its
baseline (``results/<id>/baseline.json``). It is deliberately built from the
hardware class (GPU name, or CPU model, core count and the ISA features
that decide low-precision kernels) and not from the
hostname: CI runners and containers get a fresh hostname on every job, and
a baseline recorded on one runner must apply to every runner of the same
type. ``HARNESS_MACHINE_ID`` overrides it, e.g. to separate two machines of
one type that are tuned differently.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from harness.bench.telemetry import NvmlUnavailable, init_nvml, nvml_text, shutdown_nvml
from harness.errors import HarnessError

MACHINE_ID_ENV = "HARNESS_MACHINE_ID"
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# ISA extensions that decide which kernels can run (SIMD widths, fp16/bf16
# arithmetic, AMX tiles); the rest of /proc/cpuinfo's flags is noise here.
_ISA_FLAG = re.compile(r"^(sse|ssse3|avx|amx|fma|f16c)")
_PACKAGES = ("numpy", "onnx", "onnxruntime", "nvidia-ml-py", "tensorrt")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def cpu_info(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> dict[str, Any]:
    """CPU model, kernel-relevant ISA flags and core counts."""
    model = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        model = m.group(1).strip()
    if m := re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE):
        flags = sorted(f for f in m.group(1).split() if _ISA_FLAG.match(f))
    return {
        "model": model,
        "isa_flags": flags,
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
    }


def gpu_info(module: Any = None) -> dict[str, Any]:
    """Every GPU NVML lists (also when PyTorch is a CPU build), in NVML's order, or the reason for none.

    Each with its UUID, which tells two GPUs of one model apart (the machine
    id does not: it names the hardware class). ``module`` replaces ``pynvml``.
    """
    try:
        mod = init_nvml(module)
    except NvmlUnavailable as exc:
        return {"status": f"unavailable ({exc})", "driver": None, "devices": []}
    try:
        driver = mod.nvmlSystemGetDriverVersion()
        devices = []
        for i in range(mod.nvmlDeviceGetCount()):
            handle = mod.nvmlDeviceGetHandleByIndex(i)
            major, minor = mod.nvmlDeviceGetCudaComputeCapability(handle)
            devices.append(
                {
                    "name": nvml_text(mod.nvmlDeviceGetName(handle)),
                    "uuid": nvml_text(mod.nvmlDeviceGetUUID(handle)),
                    "capability": f"{major}.{minor}",
                    "memory_bytes": int(mod.nvmlDeviceGetMemoryInfo(handle).total),
                }
            )
    except mod.NVMLError as exc:
        return {"status": f"unavailable (NVML query failed: {exc})", "driver": None, "devices": []}
    finally:
        shutdown_nvml(mod)
    return {"status": "ok", "driver": nvml_text(driver), "devices": devices}


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


def slug(text: str) -> str:
    """Lower-case ``a-z0-9-`` form of a hardware name, trademarks dropped."""
    text = re.sub(r"\((r|tm)\)", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:80] or "unknown"


def check_machine_id(machine_id: str) -> str:
    if not isinstance(machine_id, str) or not _ID_PATTERN.fullmatch(machine_id):
        raise HarnessError(
            f"machine id {machine_id!r} is not a valid directory name; "
            "use letters, digits, '.', '_' and '-' (at most 100, not starting with '.' or '-')"
        )
    return machine_id


# The ISA features that change which low-precision kernels a CPU has, most
# capable first, with the tag each adds to a CPU machine id.
_PRECISION_ISA = (("amx_fp16", "amxfp16"), ("amx_bf16", "amxbf16"), ("avx512_fp16", "avx512fp16"),
                  ("avx512_bf16", "avx512bf16"))
# Without any of those, the widest SIMD names the class.
_SIMD_ISA = (("avx512f", "avx512"), ("avx2", "avx2"))


def isa_tag(flags: list[str]) -> str:
    """The part of a CPU machine id that tells kernel-relevant ISAs apart.

    Virtual machines often report a generic model name ("Intel(R) Xeon(R)
    Processor") for CPUs with and without AMX, where bf16 runs 9x apart, so
    the model name alone would file both under one baseline.
    """
    present = set(flags)
    tags = [tag for flag, tag in _PRECISION_ISA if flag in present]
    if not tags:
        tags = [next((tag for flag, tag in _SIMD_ISA if flag in present), "base")]
    return "-".join(tags)


def machine_id(cpu: dict[str, Any], gpus: dict[str, Any]) -> str:
    """Stable hardware-class id: first GPU's name (with count), else CPU model, cores and ISA.

    Never a GPU's UUID: every runner of one type shares the baseline, and the
    gate notes when two runs ran on different GPUs of the model.
    """
    override = os.environ.get(MACHINE_ID_ENV)
    if override:
        return check_machine_id(override)
    devices = gpus.get("devices") or []
    if devices:
        suffix = f"-x{len(devices)}" if len(devices) > 1 else ""
        return slug(devices[0]["name"]) + suffix
    return f"{slug(cpu['model'])}-{cpu['logical_cores']}c-{isa_tag(cpu.get('isa_flags', []))}"


def current_machine_id() -> str:
    """This machine's id, as :func:`machine_info` records it, without importing torch (for the gate)."""
    return machine_id(cpu_info(), gpu_info())


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
