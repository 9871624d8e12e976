"""This machine's identity: its CPU, its GPUs and the id that names its results.

Computed here once for every part of the harness: the CPU engine's cache
provenance, the results' machine record, the gate's baseline directory.

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

import functools
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from harness.errors import HarnessError
from harness.nvml import NvmlUnavailable, init_nvml, nvml_text, shutdown_nvml

MACHINE_ID_ENV = "HARNESS_MACHINE_ID"
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# ISA extensions that decide which kernels can run (SIMD widths, fp16/bf16
# arithmetic, AMX tiles); the rest of /proc/cpuinfo's flags is noise here.
_ISA_FLAG = re.compile(r"^(sse|ssse3|avx|amx|fma|f16c)")
CPUINFO = "/proc/cpuinfo"


@functools.cache
def _parsed(cpuinfo: str) -> tuple[str, frozenset[str]]:
    """The CPU model and every feature flag ``cpuinfo`` lists (x86 ``flags``, Arm ``Features``)."""
    model = platform.processor() or platform.machine()
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        model = m.group(1).strip()
    flags: frozenset[str] = frozenset()
    if m := re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.MULTILINE):
        flags = frozenset(m.group(1).split())
    return model, flags


def cpu_model(cpuinfo: str | os.PathLike[str] = CPUINFO) -> str:
    """The CPU's model name (``platform``'s where /proc/cpuinfo has none)."""
    return _parsed(os.fspath(cpuinfo))[0]


def cpu_flags(cpuinfo: str | os.PathLike[str] = CPUINFO) -> frozenset[str]:
    """Every feature flag the CPU reports (empty where /proc/cpuinfo cannot be read)."""
    return _parsed(os.fspath(cpuinfo))[1]


def isa_flags(flags: Iterable[str]) -> list[str]:
    """The kernel-relevant ISA extensions among a CPU's feature flags, sorted (a machine record's ``isa_flags``)."""
    return sorted({f for f in flags if _ISA_FLAG.match(f)})


def cpu_info(cpuinfo: str | os.PathLike[str] = CPUINFO) -> dict[str, Any]:
    """CPU model, kernel-relevant ISA flags and core counts."""
    return {
        "model": cpu_model(cpuinfo),
        "isa_flags": isa_flags(cpu_flags(cpuinfo)),
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
    Processor") for CPUs with and without AMX, whose bf16 latencies are not
    comparable, so the model name alone would file both under one baseline.
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
