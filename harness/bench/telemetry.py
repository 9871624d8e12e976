"""Background telemetry: CPU through psutil, GPU through NVML (:mod:`harness.nvml`).

A sampler thread reads the counters every ``interval_s`` while a benchmark
runs, so a slow result can be explained afterwards (clocks dropped, the GPU
hit its power cap, another process ate the CPU). NVML comes from the
``nvidia-ml-py`` distribution, imported as ``pynvml``. When it cannot be
imported or initialised (no driver, no GPU) the GPU part is recorded as
``"unavailable (<reason>)"`` and CPU telemetry carries on: telemetry must
never be the reason a benchmark fails.

Which GPU: a device index here is CUDA's (``torch.cuda.current_device()``),
mapped to NVML's by the GPU's UUID (:func:`harness.nvml.device_handle`), so the
readings are of the GPU the benchmark runs on, never of a neighbour's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import psutil

from harness.nvml import Nvml, NvmlUnavailable, open_nvml

# Reasons that mean the GPU ran slower than it was asked to. Idle, application
# clocks, sync boost and display clocks are configuration, not throttling.
THROTTLE_REASONS = frozenset(
    {"SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"}
)


def _cpu_temperature() -> float | None:
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    currents = [entry.current for entries in read().values() for entry in entries]
    return max(currents) if currents else None


@dataclass
class TelemetrySample:
    t_s: float
    cpu_percent: float | None
    cpu_percent_per_core: list[float] | None
    process_cpu_percent: float | None
    cpu_freq_mhz: float | None
    rss_bytes: int
    cpu_temp_c: float | None
    gpu: dict[str, Any] | None = None


def _mean_max(values: list[float]) -> dict[str, float] | None:
    return {"mean": sum(values) / len(values), "max": max(values)} if values else None


_CPU_METRICS = ("cpu_percent", "process_cpu_percent", "cpu_freq_mhz", "rss_bytes", "cpu_temp_c")
_GPU_METRICS = (
    "util_percent",
    "mem_util_percent",
    "mem_used_bytes",
    "power_mw",
    "temp_c",
    "sm_clock_mhz",
    "mem_clock_mhz",
)


def summarize(
    samples: list[TelemetrySample],
    *,
    interval_s: float,
    gpu_status: str,
    gpu_name: str | None = None,
    gpu_clocks: dict[str, int | None] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """Mean and max of every metric that was read at least once.

    GPU energy is the difference of NVML's cumulative counter between the
    first and last sample. ``throttled`` is true when any sample carried a
    clock-event reason in :data:`THROTTLE_REASONS`. The GPU's ``uuid`` is the
    one its samples carry; ``clocks`` is ``gpu_clocks``, its clock settings
    (:meth:`Nvml.clock_settings`).
    """
    cpu: dict[str, Any] = {}
    for key in _CPU_METRICS:
        stats = _mean_max([v for s in samples if (v := getattr(s, key)) is not None])
        if stats is not None:
            cpu[key] = stats
    per_core = [s.cpu_percent_per_core for s in samples if s.cpu_percent_per_core]
    if per_core:
        cpu["cpu_percent_per_core_mean"] = [
            sum(col) / len(col) for col in zip(*per_core, strict=True)
        ]
    gpu: dict[str, Any] | str = gpu_status
    reasons_seen: set[str] = set()
    gpu_samples = [s.gpu for s in samples if s.gpu is not None]
    if gpu_samples:
        gpu = {"name": gpu_name, "uuid": gpu_samples[0].get("uuid"), "clocks": gpu_clocks}
        for key in _GPU_METRICS:
            stats = _mean_max([v for g in gpu_samples if (v := g.get(key)) is not None])
            if stats is not None:
                gpu[key] = stats
        energies = [g["energy_mj"] for g in gpu_samples if g.get("energy_mj") is not None]
        gpu["energy_mj"] = energies[-1] - energies[0] if len(energies) >= 2 else None
        for g in gpu_samples:
            reasons_seen.update(g.get("clock_event_reasons") or [])
        gpu["clock_event_reasons"] = sorted(reasons_seen)
    return {
        "interval_s": interval_s,
        "samples": len(samples),
        "duration_s": samples[-1].t_s - samples[0].t_s if samples else 0.0,
        "cpu": cpu,
        "gpu": gpu,
        "throttled": bool(reasons_seen & THROTTLE_REASONS),
        "error": error,
    }


@dataclass
class TelemetrySampler:
    """Context manager running a sampler thread; read :meth:`summary` afterwards.

    One sample is taken on entry and one on exit, so even a run shorter than
    the interval has a first and last reading (needed for energy); CPU
    percentages start with the second sample. ``gpu_index`` is the CUDA
    device (:func:`device_handle` finds its NVML handle); its clock settings
    are read once, on entry.
    """

    interval_s: float = 0.1
    gpu_index: int = 0
    nvml_module: Any = None
    samples: list[TelemetrySample] = field(default_factory=list)
    gpu_status: str = "not started"
    gpu_name: str | None = None
    gpu_clocks: dict[str, int | None] | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"telemetry interval must be positive, got {self.interval_s}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Nvml | None = None
        self._process = psutil.Process()
        self._t0 = 0.0
        self._started = False

    def _sample(self) -> None:
        # psutil's percentages cover the time since its previous call; the
        # first sample follows the priming call at once, so it has none.
        first = not self.samples
        per_core = None if first else list(psutil.cpu_percent(interval=None, percpu=True))
        freq = psutil.cpu_freq()
        self.samples.append(
            TelemetrySample(
                t_s=time.monotonic() - self._t0,
                cpu_percent=sum(per_core) / len(per_core) if per_core else None,
                cpu_percent_per_core=per_core,
                process_cpu_percent=None if first else self._process.cpu_percent(interval=None),
                cpu_freq_mhz=freq.current if freq is not None else None,
                rss_bytes=self._process.memory_info().rss,
                cpu_temp_c=_cpu_temperature(),
                gpu=self._nvml.read() if self._nvml is not None else None,
            )
        )

    def _safe_sample(self) -> bool:
        if self.error is not None:
            return False
        try:
            self._sample()
        except Exception as exc:  # recorded in the summary, never raised into the benchmark
            self.error = f"telemetry sampler stopped: {type(exc).__name__}: {exc}"
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._safe_sample():
                return

    def start(self) -> None:
        if self._started:
            raise RuntimeError("a telemetry sampler runs once; create a new one per run")
        self._started = True
        try:
            self._nvml = open_nvml(self.gpu_index, self.nvml_module)
            self.gpu_status = "ok"
            self.gpu_name = self._nvml.name()
            self.gpu_clocks = self._nvml.clock_settings()
        except NvmlUnavailable as exc:
            self.gpu_status = f"unavailable ({exc})"
        # psutil's percentages are relative to the previous call: prime them.
        psutil.cpu_percent(interval=None, percpu=True)
        self._process.cpu_percent(interval=None)
        self._t0 = time.monotonic()
        self._safe_sample()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._safe_sample()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        return summarize(
            self.samples,
            interval_s=self.interval_s,
            gpu_status=self.gpu_status,
            gpu_name=self.gpu_name,
            gpu_clocks=self.gpu_clocks,
            error=self.error,
        )
