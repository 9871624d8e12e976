"""Memory of a run: peak host RSS, weight bytes by dtype, engine size, GPU memory.

Peak RSS uses the kernel's own high-water mark. On Linux, writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS, so ``VmHWM``
read after the call is exactly the peak *during* the call: no sampling
thread that can miss a short spike, and no inherited peak from earlier work
(the problem with ``ru_maxrss``, which is the process lifetime's peak and
cannot be reset). Where the reset is not possible the lifetime
``ru_maxrss`` is reported instead, labelled ``method="ru_maxrss"``: an upper
bound on the run's peak, not the run's peak.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from harness.nvml import NvmlUnavailable, open_nvml

T = TypeVar("T")
RssMethod = Literal["vmhwm", "ru_maxrss"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field_name: str) -> int:
    match = re.search(rf"^{field_name}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field_name} missing from {_STATUS}")
    return int(match.group(1)) * 1024


def _reset_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        _status_kib("VmHWM")
    except OSError:
        return False
    return True


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class MemoryReport:
    """The ``memory`` field of a results case; the runner fills the engine parts."""

    peak_rss_bytes: int | None = None
    rss_before_bytes: int | None = None
    peak_rss_method: RssMethod | None = None
    weight_bytes: dict[str, int] | None = None
    engine_bytes: int | None = None
    engine_device_bytes: int | None = None
    gpu: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_rss_bytes": self.peak_rss_bytes,
            "rss_before_bytes": self.rss_before_bytes,
            "peak_rss_method": self.peak_rss_method,
            "weight_bytes": dict(self.weight_bytes) if self.weight_bytes is not None else None,
            "weight_bytes_total": sum(self.weight_bytes.values())
            if self.weight_bytes is not None
            else None,
            "engine_bytes": self.engine_bytes,
            "engine_device_bytes": self.engine_device_bytes,
            "gpu": self.gpu,
        }


def measure_memory(fn: Callable[[], T], *, gpu_index: int | None = None) -> tuple[T, MemoryReport]:
    """Run ``fn`` once and report the host RSS peak during it (and GPU peaks if asked)."""
    import torch  # here, not at the top: harness.bench.results reads MemoryReport without torch

    if gpu_index is not None and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(gpu_index)
    before = _current_rss_bytes()
    exact = _reset_hwm()
    result = fn()
    peak = _status_kib("VmHWM") if exact else _ru_maxrss_bytes()
    report = MemoryReport(
        peak_rss_bytes=peak,
        rss_before_bytes=before,
        peak_rss_method="vmhwm" if exact else "ru_maxrss",
        gpu=gpu_memory(gpu_index) if gpu_index is not None else None,
    )
    return result, report


def gpu_memory(gpu_index: int = 0) -> dict[str, int] | None:
    """NVML device memory in use and the PyTorch allocator peaks, whichever exist.

    NVML sees every allocation on the device (TensorRT's included); the
    PyTorch numbers only cover tensors PyTorch allocated.
    """
    import torch

    out: dict[str, int] = {}
    try:
        nvml = open_nvml(gpu_index)
    except NvmlUnavailable:
        pass
    else:
        info = nvml.read()
        nvml.close()
        if info["mem_used_bytes"] is not None:
            out["nvml_used_bytes"] = int(info["mem_used_bytes"])
            out["nvml_total_bytes"] = int(info["mem_total_bytes"])
    if torch.cuda.is_available():
        out["torch_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(gpu_index))
        out["torch_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(gpu_index))
    return out or None
