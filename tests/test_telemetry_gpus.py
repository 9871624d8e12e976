"""Which GPU NVML reads: CUDA's device, mapped by UUID, never NVML's index of the same number.

No GPU here, so two thin doubles stand in for what needs one: :class:`NvmlDouble`
(pynvml on a machine of several GPUs, with pynvml's own constants and error
class) and :func:`cuda_double` (the UUIDs torch.cuda reports, as torch prints them).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch

from harness.bench.memory import gpu_memory
from harness.bench.telemetry import TelemetrySampler
from harness.nvml import NvmlUnavailable, cuda_device_uuid, nvml_uuid, open_nvml

# Three GPUs of one model, as torch prints their UUIDs (NVML adds "GPU-").
A, B, C = "aaaaaaaa-0000-4000-8000-00000000000a", "bbbbbbbb-0000-4000-8000-00000000000b", "cccccccc-0000-4000-8000-00000000000c"


@dataclass
class Gpu:
    """One GPU of the double; ``lock_error``/``reset_error`` are NVML error codes its lock calls raise."""

    uuid: str
    mem_used: int
    base_mhz: int | None = 1410
    max_mhz: int = 1980
    supported: tuple[int, ...] = (1395, 1410, 1425, 1980)
    locked: int | None = None
    lock_error: int | None = None
    partial: bool = False  # the failing lock call changes the clock before it raises
    reset_error: int | None = None


@dataclass
class NvmlDouble:
    """pynvml on a machine whose GPUs are ``gpus`` in NVML's (PCI) order; a handle is the Gpu itself.

    A device query it does not model raises NVML's "Not Supported", as a GPU
    without that sensor does. ``calls`` records every lock and reset.
    """

    gpus: list[Gpu]
    inits: int = 0
    shutdowns: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    NVMLError = pynvml.NVMLError

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "nvmlClocksEventReason")):
            return getattr(pynvml, name)
        if name.startswith("nvmlDevice"):
            return self._unsupported
        raise AttributeError(name)

    @staticmethod
    def _unsupported(*args: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @staticmethod
    def fail(code: int) -> Any:
        raise pynvml.NVMLError(code)

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        return self.gpus[index] if 0 <= index < len(self.gpus) else self.fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        return next((g for g in self.gpus if g.uuid == uuid), None) or self.fail(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, gpu: Gpu) -> str:
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: Gpu) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetCudaComputeCapability(self, gpu: Gpu) -> tuple[int, int]:
        return 9, 0

    def nvmlDeviceGetMemoryInfo(self, gpu: Gpu) -> Any:
        return SimpleNamespace(used=gpu.mem_used, total=80 << 30)

    def nvmlDeviceGetUtilizationRates(self, gpu: Gpu) -> Any:
        return SimpleNamespace(gpu=90, memory=40)

    def nvmlDeviceGetClockInfo(self, gpu: Gpu, clock: int) -> int:
        return {pynvml.NVML_CLOCK_SM: gpu.locked or gpu.max_mhz, pynvml.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetClock(self, gpu: Gpu, clock: int, clock_id: int) -> int:
        if clock == pynvml.NVML_CLOCK_MEM:
            return 2619
        return gpu.base_mhz if gpu.base_mhz is not None else self.fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMaxClockInfo(self, gpu: Gpu, clock: int) -> int:
        return gpu.max_mhz

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: Gpu) -> int:
        return 700_000

    def nvmlDeviceGetSupportedMemoryClocks(self, gpu: Gpu) -> list[int]:
        return [2619]

    def nvmlDeviceGetSupportedGraphicsClocks(self, gpu: Gpu, memory_mhz: int) -> list[int]:
        return list(gpu.supported)

    def nvmlDeviceSetGpuLockedClocks(self, gpu: Gpu, low: int, high: int) -> None:
        self.calls.append(("lock", gpu.uuid, low, high))
        if gpu.lock_error is not None:
            if gpu.partial:
                gpu.locked = low
            self.fail(gpu.lock_error)
        gpu.locked = low

    def nvmlDeviceResetGpuLockedClocks(self, gpu: Gpu) -> None:
        self.calls.append(("reset", gpu.uuid))
        if gpu.reset_error is not None:
            self.fail(gpu.reset_error)
        gpu.locked = None


def gpus() -> NvmlDouble:
    """NVML lists A, B, C (PCI order), each with its own memory use, so a reading tells which GPU it came from."""
    return NvmlDouble([Gpu(f"GPU-{A}", mem_used=1 << 30), Gpu(f"GPU-{B}", mem_used=2 << 30), Gpu(f"GPU-{C}", mem_used=3 << 30)])


def cuda_double(monkeypatch: pytest.MonkeyPatch, *uuids: str) -> None:
    """This process's CUDA, initialised, with devices 0, 1, ... of these UUIDs (as torch prints them)."""

    class CUuuid:  # torch's _CUuuid prints the bare 8-4-4-4-12 hex
        def __init__(self, text: str) -> None:
            self.text = text

        def __str__(self) -> str:
            return self.text

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=CUuuid(uuids[i])))


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_cuda_devices_map_to_their_gpus_whatever_nvmls_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA enumerates fastest first, here C, A, B; CUDA_VISIBLE_DEVICES=2,0 then makes
    # CUDA's B device 0 and its C device 1. NVML's index 0 is A, its index 2 is C:
    # by index (or by reading the variable as NVML indices) both would be wrong.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    cuda_double(monkeypatch, B, C)
    nvml = gpus()
    assert open_nvml(0, nvml).handle is nvml.gpus[1] and open_nvml(1, nvml).handle is nvml.gpus[2]
    assert open_nvml(0, nvml).uuid == f"GPU-{B}"
    assert nvml.inits == 3 and nvml.shutdowns == 0  # each open is a session, left to its owner to close
    with TelemetrySampler(interval_s=0.01, gpu_index=0, nvml_module=nvml) as sampler:
        pass
    assert [s.gpu["uuid"] for s in sampler.samples if s.gpu] == [f"GPU-{B}"] * len(sampler.samples)
    summary = sampler.summary()["gpu"]
    assert summary["uuid"] == f"GPU-{B}" and summary["mem_used_bytes"]["max"] == 2 << 30


def test_gpu_memory_is_read_from_the_gpu_cuda_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_double(monkeypatch, C)
    monkeypatch.setitem(sys.modules, "pynvml", gpus())  # what `import pynvml` finds
    assert gpu_memory(0) == {"nvml_used_bytes": 3 << 30, "nvml_total_bytes": 80 << 30}


def test_nvmls_spelling_of_the_uuid_torch_prints() -> None:
    assert nvml_uuid(A) == f"GPU-{A}"
    assert nvml_uuid(f"GPU-{A}") == f"GPU-{A}" and nvml_uuid(f"MIG-{A}") == f"MIG-{A}"


def test_without_cuda_here_cuda_visible_devices_says_which_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cuda_device_uuid(0) is None  # this machine: no CUDA, and none is initialised for a reading
    nvml = gpus()
    assert open_nvml(1, nvml).handle is nvml.gpus[1]  # unset: NVML's index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert open_nvml(0, nvml).handle is nvml.gpus[2] and open_nvml(1, nvml).handle is nvml.gpus[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"GPU-{C[:8]}, GPU-{A}")  # UUIDs, one a unique prefix
    assert open_nvml(0, nvml).handle is nvml.gpus[2] and open_nvml(1, nvml).handle is nvml.gpus[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,junk,0")  # CUDA stops at the first entry it cannot read
    with pytest.raises(NvmlUnavailable, match=r"CUDA device 1 is not visible: CUDA_VISIBLE_DEVICES='1,junk,0' makes 1"):
        open_nvml(1, nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-")
    with pytest.raises(NvmlUnavailable, match="3 GPUs in NVML with a UUID starting 'GPU-'"):
        open_nvml(0, nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(NvmlUnavailable, match="no GPU at index 7 in NVML: Invalid Argument"):
        open_nvml(0, nvml)
    assert nvml.inits == nvml.shutdowns + 5  # a refused open closes its session


@pytest.mark.parametrize("cuda", [False, True])
def test_a_mig_instance_is_one_clear_reason_and_cpu_telemetry_goes_on(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    mig = f"MIG-{A}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    if cuda:  # what CUDA reports for a MIG instance does not matter: it is refused first
        cuda_double(monkeypatch, A)
    with pytest.raises(NvmlUnavailable, match=f"CUDA device 0 is the MIG instance {mig}") as exc:
        open_nvml(0, gpus())
    assert "whole GPU" in str(exc.value)
    with TelemetrySampler(interval_s=0.01, nvml_module=gpus()) as sampler:
        pass
    s = sampler.summary()
    assert s["gpu"] == f"unavailable ({exc.value})" and s["cpu"]["rss_bytes"]["max"] > 0


def test_a_uuid_cuda_reports_that_nvml_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_double(monkeypatch, "dddddddd-0000-4000-8000-00000000000d")
    with pytest.raises(NvmlUnavailable, match="no GPU with UUID GPU-dddddddd-.* \\(CUDA device 0\\) in NVML: Not Found"):
        open_nvml(0, gpus())


def test_clock_settings_are_recorded_with_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_double(monkeypatch, A)
    with TelemetrySampler(interval_s=0.01, nvml_module=gpus()) as sampler:
        pass
    gpu = sampler.summary()["gpu"]
    assert gpu["clocks"] == {
        "applications_graphics_mhz": 1410,
        "applications_mem_mhz": 2619,
        "default_applications_graphics_mhz": 1410,
        "max_graphics_mhz": 1980,
        "power_limit_mw": 700_000,
        "locked_graphics_mhz": None,  # nothing in this process locked it
    }
    assert gpu["sm_clock_mhz"] == {"mean": 1980, "max": 1980} and gpu["mem_clock_mhz"]["max"] == 2619
    assert "clock_event_reasons" in gpu and "power_mw" not in gpu  # not supported by this GPU: absent
