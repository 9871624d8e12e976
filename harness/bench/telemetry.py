"""Background telemetry: CPU through psutil, GPU through NVML.

A sampler thread reads the counters every ``interval_s`` while a benchmark
runs, so a slow result can be explained afterwards (clocks dropped, the GPU
hit its power cap, another process ate the CPU). NVML comes from the
``nvidia-ml-py`` distribution, imported as ``pynvml``. When it cannot be
imported or initialised (no driver, no GPU) the GPU part is recorded as
``"unavailable (<reason>)"`` and CPU telemetry carries on: telemetry must
never be the reason a benchmark fails.

Which GPU: a device index here is CUDA's (``torch.cuda.current_device()``),
and NVML numbers GPUs its own way (PCI order, ignoring ``CUDA_VISIBLE_DEVICES``).
:func:`device_handle` maps one to the other by the GPU's UUID, so the
readings are of the GPU the benchmark runs on, never of a neighbour's.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import psutil

# NVML clock-event ("throttle") reasons by name; their bits come from the NVML
# module itself (pynvml's nvmlClocksEventReason<name>), never from a copied table.
CLOCK_EVENT_REASONS: tuple[str, ...] = (
    "GpuIdle",
    "ApplicationsClocksSetting",
    "SwPowerCap",
    "HwSlowdown",
    "SyncBoost",
    "SwThermalSlowdown",
    "HwThermalSlowdown",
    "HwPowerBrakeSlowdown",
    "DisplayClockSetting",
)
# Reasons that mean the GPU ran slower than it was asked to. Idle, application
# clocks, sync boost and display clocks are configuration, not throttling.
THROTTLE_REASONS = frozenset(
    {"SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"}
)


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message is the reason."""


VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

# The graphics (SM) clock this process holds locked, by GPU UUID: set by
# :func:`harness.bench.clocks.locked_clocks` while it holds a lock, read into
# every case's clock record. NVML sets locked clocks but has no call that reads them back.
LOCKED_GRAPHICS_MHZ: dict[str, int] = {}


def nvml_text(value: str | bytes) -> str:
    """A string NVML returned (bytes from older nvidia-ml-py versions) as str."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Nvml:
    """An initialised NVML session bound to one device (``index``: its CUDA index; ``uuid``: NVML's)."""

    module: Any
    handle: Any
    index: int
    uuid: str | None = None

    def query(self, name: str, *args: Any) -> Any:
        """One NVML call; a metric the device does not support reads as None."""
        try:
            return getattr(self.module, name)(self.handle, *args)
        except self.module.NVMLError:
            return None

    def name(self) -> str | None:
        raw = self.query("nvmlDeviceGetName")
        return nvml_text(raw) if raw is not None else None

    def read(self) -> dict[str, Any]:
        util = self.query("nvmlDeviceGetUtilizationRates")
        mem = self.query("nvmlDeviceGetMemoryInfo")
        reasons = self.query("nvmlDeviceGetCurrentClocksEventReasons")
        return {
            "uuid": self.uuid,
            "util_percent": util.gpu if util is not None else None,
            "mem_util_percent": util.memory if util is not None else None,
            "mem_used_bytes": mem.used if mem is not None else None,
            "mem_total_bytes": mem.total if mem is not None else None,
            "power_mw": self.query("nvmlDeviceGetPowerUsage"),
            "energy_mj": self.query("nvmlDeviceGetTotalEnergyConsumption"),
            "temp_c": self.query("nvmlDeviceGetTemperature", self.module.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": self.query("nvmlDeviceGetClockInfo", self.module.NVML_CLOCK_SM),
            "mem_clock_mhz": self.query("nvmlDeviceGetClockInfo", self.module.NVML_CLOCK_MEM),
            "clock_event_reasons": (
                clock_event_names(reasons, self.module) if reasons is not None else None
            ),
        }

    def clock_settings(self) -> dict[str, int | None]:
        """What the device's clocks are set to (:data:`CLOCK_SETTINGS`); None where NVML does not say.

        Application clocks and the maximum are of the graphics domain, the one
        ``nvmlDeviceSetGpuLockedClocks`` locks; ``locked_graphics_mhz`` is this
        process's own lock (:data:`LOCKED_GRAPHICS_MHZ`), None when it holds none.
        """
        m = self.module
        graphics, memory = m.NVML_CLOCK_GRAPHICS, m.NVML_CLOCK_MEM
        target, default = m.NVML_CLOCK_ID_APP_CLOCK_TARGET, m.NVML_CLOCK_ID_APP_CLOCK_DEFAULT
        locked = LOCKED_GRAPHICS_MHZ.get(self.uuid) if self.uuid is not None else None
        return {
            "applications_graphics_mhz": self.query("nvmlDeviceGetClock", graphics, target),
            "applications_mem_mhz": self.query("nvmlDeviceGetClock", memory, target),
            "default_applications_graphics_mhz": self.query("nvmlDeviceGetClock", graphics, default),
            "max_graphics_mhz": self.query("nvmlDeviceGetMaxClockInfo", graphics),
            "power_limit_mw": self.query("nvmlDeviceGetEnforcedPowerLimit"),
            "locked_graphics_mhz": locked,
        }

    def close(self) -> None:
        shutdown_nvml(self.module)


# The keys of Nvml.clock_settings(), as the results schema lists them.
CLOCK_SETTINGS: tuple[str, ...] = (
    "applications_graphics_mhz",
    "applications_mem_mhz",
    "default_applications_graphics_mhz",
    "max_graphics_mhz",
    "power_limit_mw",
    "locked_graphics_mhz",
)


def init_nvml(module: Any = None) -> Any:
    """The initialised NVML module (``module``, else ``pynvml``), or :class:`NvmlUnavailable` saying why.

    ``module`` replaces ``pynvml`` (tests pass a small fake). Pair with :func:`shutdown_nvml`.
    """
    if module is None:
        try:
            module = importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlUnavailable(f"cannot import pynvml (install nvidia-ml-py): {exc}") from None
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
    return module


def shutdown_nvml(module: Any) -> None:
    try:
        module.nvmlShutdown()
    except module.NVMLError:
        pass


def open_nvml(device_index: int = 0, module: Any = None) -> Nvml:
    """NVML bound to CUDA device ``device_index`` (:func:`device_handle`), or :class:`NvmlUnavailable` saying why."""
    module = init_nvml(module)
    try:
        handle = device_handle(module, device_index)
    except NvmlUnavailable:
        shutdown_nvml(module)
        raise
    nvml = Nvml(module=module, handle=handle, index=device_index)
    uuid = nvml.query("nvmlDeviceGetUUID")
    nvml.uuid = nvml_text(uuid) if uuid is not None else None
    return nvml


def nvml_uuid(cuda_uuid: str) -> str:
    """NVML's spelling of a GPU UUID that CUDA (PyTorch) prints without NVML's ``GPU-`` prefix."""
    text = cuda_uuid.strip()
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def cuda_device_uuid(index: int, *, initialize: bool = False) -> str | None:
    """NVML's form of the UUID this process's CUDA gives device ``index``; None where CUDA is not initialised.

    CUDA is initialised only with ``initialize`` (then None means this process
    has no CUDA GPU): telemetry never does, as that would cost a CPU benchmark
    hundreds of MB of host memory, and a process that runs on a GPU has
    initialised it already.
    """
    torch = importlib.import_module("torch") if initialize else sys.modules.get("torch")
    if torch is None or not (torch.cuda.is_initialized() or (initialize and torch.cuda.is_available())):
        return None
    return nvml_uuid(str(torch.cuda.get_device_properties(index).uuid))


def visible_devices() -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` CUDA takes, in order (None when it is unset).

    An entry is an index, a GPU UUID (``GPU-...``, or a prefix of one) or a MIG
    instance (``MIG-...``); as CUDA does, the list ends at the first entry that
    is none of these.
    """
    raw = os.environ.get(VISIBLE_DEVICES_ENV)
    if raw is None:
        return None
    entries = []
    for entry in (part.strip() for part in raw.split(",")):
        if not (re.fullmatch(r"[0-9]+", entry) or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def device_handle(module: Any, cuda_index: int) -> Any:
    """NVML's handle of the GPU that is CUDA device ``cuda_index`` in this process.

    Where this process has initialised CUDA, by the UUID CUDA reports for the
    device (:func:`cuda_device_uuid`): exact under any ``CUDA_VISIBLE_DEVICES``
    and ``CUDA_DEVICE_ORDER``. Elsewhere (a process that runs nothing on a GPU)
    from ``CUDA_VISIBLE_DEVICES`` as PyTorch reads it for NVML: an index is
    NVML's, a UUID or UUID prefix is looked up among NVML's GPUs, unset means
    NVML's index ``cuda_index`` (CUDA's own order agrees with NVML's where
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are alike). A MIG instance
    cannot be mapped (NVML's per-GPU readings and clock locks do not apply to
    one), nor a device ``CUDA_VISIBLE_DEVICES`` does not make visible: each
    raises :class:`NvmlUnavailable` saying so.
    """
    visible = visible_devices()
    setting = f"{VISIBLE_DEVICES_ENV}={os.environ.get(VISIBLE_DEVICES_ENV)!r}"
    if visible is not None:
        if cuda_index >= len(visible):
            raise NvmlUnavailable(f"CUDA device {cuda_index} is not visible: {setting} makes {len(visible)} visible")
        if visible[cuda_index].startswith("MIG-"):
            raise NvmlUnavailable(
                f"CUDA device {cuda_index} is the MIG instance {visible[cuda_index]} ({setting}); NVML's GPU "
                "telemetry and clock locks apply to whole GPUs, not to MIG instances: run on a whole GPU "
                f"(a GPU index or GPU- UUID in {VISIBLE_DEVICES_ENV})"
            )
    uuid = cuda_device_uuid(cuda_index)
    entry = str(cuda_index) if visible is None else visible[cuda_index]
    try:
        if uuid is not None:
            return module.nvmlDeviceGetHandleByUUID(uuid)
        if entry.startswith("GPU-"):
            return _handle_by_uuid_prefix(module, entry, setting)
        return module.nvmlDeviceGetHandleByIndex(int(entry))
    except module.NVMLError as exc:
        where = f"with UUID {uuid} (CUDA device {cuda_index})" if uuid is not None else f"at index {entry}"
        raise NvmlUnavailable(f"no GPU {where} in NVML: {exc}") from None


def _handle_by_uuid_prefix(module: Any, prefix: str, setting: str) -> Any:
    """The one NVML GPU whose UUID starts with ``prefix`` (CUDA accepts a unique prefix)."""
    handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]
    matches = [h for h in handles if nvml_text(module.nvmlDeviceGetUUID(h)).startswith(prefix)]
    if len(matches) != 1:
        found = "no GPU" if not matches else f"{len(matches)} GPUs"
        raise NvmlUnavailable(f"{found} in NVML with a UUID starting {prefix!r} ({setting})")
    return matches[0]


def clock_event_names(mask: int, module: Any) -> list[str]:
    """The reasons set in ``mask``, with bits read from the NVML ``module`` in use."""
    return [name for name in CLOCK_EVENT_REASONS if mask & getattr(module, f"nvmlClocksEventReason{name}")]


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
