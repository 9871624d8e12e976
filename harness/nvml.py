"""The GPU a CUDA device is, as NVML sees it: sessions, UUIDs, clocks.

NVML (the ``nvidia-ml-py`` distribution, imported as ``pynvml``) numbers GPUs
its own way (PCI order, ignoring ``CUDA_VISIBLE_DEVICES``), while a device
index in the harness is CUDA's (``torch.cuda.current_device()``).
:func:`device_handle` maps one to the other by the GPU's UUID, so telemetry,
memory and clock locks act on the GPU a benchmark runs on, never on a
neighbour's. Where NVML cannot be used, :class:`NvmlUnavailable` says why.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

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


