"""Telemetry: a real CPU run, the real NVML-unavailable path, and a thin fake NVML."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pynvml
import pytest

from harness.bench.telemetry import TelemetrySample, TelemetrySampler, summarize
from harness.nvml import CLOCK_EVENT_REASONS, NvmlUnavailable, clock_event_names, open_nvml


def _busy(seconds: float) -> int:
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(range(1000))
    return n


def _real_nvml_reason() -> str | None:
    """None if NVML initialises on this machine, else pynvml's own error text."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


def test_real_run_cpu_telemetry_and_real_nvml_state() -> None:
    with TelemetrySampler(interval_s=0.02) as sampler:
        _busy(0.2)
    s = sampler.summary()
    assert s["samples"] == len(sampler.samples) >= 2 and s["error"] is None
    assert s["duration_s"] > 0
    rss = s["cpu"]["rss_bytes"]
    assert 0 < rss["mean"] <= rss["max"]
    assert rss["max"] <= psutil.Process().memory_info().rss * 2
    assert 0.0 <= s["cpu"]["cpu_percent"]["mean"] <= s["cpu"]["cpu_percent"]["max"] <= 100.0
    assert len(s["cpu"]["cpu_percent_per_core_mean"]) == psutil.cpu_count()
    assert s["cpu"]["process_cpu_percent"]["max"] > 0  # this process was busy
    # the first sample has no percentages (no interval yet), later ones do
    assert sampler.samples[0].cpu_percent is None and sampler.samples[-1].cpu_percent is not None
    reason = _real_nvml_reason()
    if reason is None:  # a GPU machine
        assert isinstance(s["gpu"], dict) and s["gpu"]["name"]
    else:  # this machine: pynvml installed, no driver
        assert s["gpu"] == f"unavailable (nvmlInit failed: {reason})"
        assert s["throttled"] is False


def test_nvml_not_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import now raises ImportError
    with pytest.raises(NvmlUnavailable, match="cannot import pynvml"):
        open_nvml()
    with TelemetrySampler(interval_s=0.05) as sampler:
        pass
    assert sampler.summary()["gpu"].startswith("unavailable (cannot import pynvml")
    assert sampler.summary()["cpu"]["rss_bytes"]["max"] > 0


def test_reason_names_exist_in_pynvml_and_take_its_bits() -> None:
    for name in CLOCK_EVENT_REASONS:
        assert isinstance(getattr(pynvml, f"nvmlClocksEventReason{name}"), int)
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle
    assert clock_event_names(mask, pynvml) == ["GpuIdle", "SwPowerCap"]


class FakeNvml:
    """Just enough of pynvml: readings advance with every utilisation query."""

    class NVMLError(Exception):
        pass

    # pynvml's own constants: the harness reads them from the module it is given.
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("nvmlClocksEventReason", "NVML_")):
            return getattr(pynvml, name)
        if name.startswith("nvmlDevice"):  # a query this fake does not model: its GPU does not support it
            raise self.NVMLError("Not Supported")
        raise AttributeError(name)

    def __init__(self, *, unsupported: tuple[str, ...] = (), init_error: bool = False) -> None:
        self.unsupported = unsupported
        self.init_error = init_error
        self.reads = 0
        self.shutdowns = 0

    def _check(self, name: str) -> None:
        if name in self.unsupported:
            raise self.NVMLError("Not Supported")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index != 0:
            raise self.NVMLError("Invalid Argument")
        return "gpu0"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"Fake GPU 80GB"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self.reads += 1
        return SimpleNamespace(gpu=10 * self.reads, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(used=1000 + self.reads, total=8000)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        self._check("power")
        return 200_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        return 50_000 + 700 * self.reads

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 60

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1800, pynvml.NVML_CLOCK_MEM: 9000}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return 0x4 if self.reads == 2 else 0x1  # power capped on the second reading


def test_fake_nvml_through_the_sampler_thread() -> None:
    fake = FakeNvml(unsupported=("power",))
    with TelemetrySampler(interval_s=0.01, nvml_module=fake) as sampler:
        _busy(0.1)
    s = sampler.summary()
    n = fake.reads
    assert n == len(sampler.samples) >= 2 and fake.shutdowns == 1
    gpu = s["gpu"]
    assert gpu["name"] == "Fake GPU 80GB"
    assert gpu["util_percent"] == {"mean": 10 * (n + 1) / 2, "max": 10 * n}
    assert gpu["mem_used_bytes"]["max"] == 1000 + n
    assert gpu["energy_mj"] == 700 * (n - 1)  # counter difference, first to last reading
    assert gpu["sm_clock_mhz"] == {"mean": 1800, "max": 1800}
    assert "power_mw" not in gpu  # not supported by this device: absent, not a crash
    assert gpu["clock_event_reasons"] == ["GpuIdle", "SwPowerCap"]
    assert s["throttled"] is True


def test_nvml_init_failure_keeps_cpu_telemetry() -> None:
    with TelemetrySampler(interval_s=0.05, nvml_module=FakeNvml(init_error=True)) as sampler:
        pass
    s = sampler.summary()
    assert s["gpu"] == "unavailable (nvmlInit failed: Driver Not Loaded)"
    assert s["cpu"]["rss_bytes"]["max"] > 0 and s["throttled"] is False
    with pytest.raises(NvmlUnavailable, match="no GPU at index 3"):
        open_nvml(3, FakeNvml())


def test_summarize_hand_values() -> None:
    def sample(t: float, cpu: float | None, gpu: dict[str, Any]) -> TelemetrySample:
        per_core = None if cpu is None else [cpu, cpu / 2]
        return TelemetrySample(t, cpu, per_core, cpu, 2000.0, 100, None, gpu)

    samples = [
        sample(
            0.0, None, {"util_percent": 0, "energy_mj": 1000, "clock_event_reasons": ["GpuIdle"]}
        ),
        sample(0.1, 80.0, {"util_percent": 90, "energy_mj": 1500, "clock_event_reasons": []}),
        sample(
            0.2, 40.0, {"util_percent": 60, "energy_mj": 2600, "clock_event_reasons": ["SyncBoost"]}
        ),
    ]
    s = summarize(samples, interval_s=0.1, gpu_status="ok", gpu_name="G")
    assert s["duration_s"] == pytest.approx(0.2)
    assert s["cpu"]["cpu_percent"] == {"mean": 60.0, "max": 80.0}
    assert s["cpu"]["cpu_percent_per_core_mean"] == [60.0, 30.0]
    assert "cpu_temp_c" not in s["cpu"]
    assert s["gpu"]["util_percent"] == {"mean": 50.0, "max": 90}
    assert s["gpu"]["energy_mj"] == 1600
    # idle and sync boost are not throttling
    assert s["gpu"]["clock_event_reasons"] == ["GpuIdle", "SyncBoost"] and s["throttled"] is False


def test_sampler_errors_are_recorded_not_raised() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
            raise TypeError("bad reading")

    with TelemetrySampler(interval_s=0.01, nvml_module=Broken()) as sampler:
        _busy(0.05)
    assert sampler.summary()["error"] == "telemetry sampler stopped: TypeError: bad reading"
    with pytest.raises(RuntimeError, match="runs once"):
        sampler.start()
