"""Locking a GPU's graphics clock for a benchmark run (``harness bench --lock-clocks``).

Left alone, a GPU boosts as far as its temperature and power allow, so two
runs of one engine can differ by their clocks alone; locked, every case runs
at one clock. :func:`locked_clocks` locks the graphics (SM) clock of the GPU
that is the run's CUDA device through NVML (``nvmlDeviceSetGpuLockedClocks``,
which needs root and a Volta or newer GPU), and resets it
(``nvmlDeviceResetGpuLockedClocks``) when its block ends, however it ends:
normally, by an exception, by Ctrl-C, or by SIGTERM, which raises
:class:`Terminated` (a KeyboardInterrupt) in the main thread while the lock is
held. The GPU is the one CUDA names (by UUID, :mod:`harness.nvml`),
never a neighbour's.

Resetting gives the driver's default, unlocked clocks: NVML has no call that
reads a lock back, so a lock set before the run by other means
(``nvidia-smi -lgc``) is not put back either.

Whatever prevents the lock (no GPU, a clock the GPU does not support, no
permission) is a HarnessError naming ``--lock-clocks`` and what to do instead.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, get_args

from harness import nvml as nvml_access
from harness.errors import HarnessError
from harness.nvml import LOCKED_GRAPHICS_MHZ, Nvml, NvmlUnavailable, open_nvml

# What --lock-clocks takes (harness.cli.argtypes.lock_clocks parses it): a named clock or one in MHz.
NamedClock = Literal["base", "max"]
NAMED_CLOCKS: tuple[str, ...] = get_args(NamedClock)
LockRequest = str | int


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while clocks were locked; handled as Ctrl-C is, so the lock is released."""


@dataclass(frozen=True)
class ClockLock:
    """A lock held: the GPU (NVML's UUID, its name) and the graphics clock it is locked at."""

    uuid: str
    name: str | None
    graphics_mhz: int


@contextmanager
def locked_clocks(request: LockRequest, cuda_index: int = 0, *, module: Any = None) -> Iterator[ClockLock]:
    """Lock the graphics clock of CUDA device ``cuda_index`` for the block, and reset it on every exit.

    ``request`` is ``"base"`` (the GPU's default applications clock), ``"max"``
    (its maximum graphics clock) or a clock in MHz among those the GPU lists
    as supported. ``cuda_index`` is the device the run uses (the runner's
    ``torch.cuda.current_device()``, 0 unless a caller changed it); CUDA is
    initialised to learn its UUID. ``module`` replaces ``pynvml``. While the
    lock is held its clock is in :data:`~harness.nvml.LOCKED_GRAPHICS_MHZ`,
    so every case's telemetry records it. A reset that fails raises
    HarnessError saying how to reset by hand.
    """
    flag = f"--lock-clocks {request}"
    cuda_uuid = nvml_access.cuda_device_uuid(cuda_index, initialize=True)
    if cuda_uuid is None:
        raise HarnessError(
            f"{flag}: this process has no CUDA GPU (no GPU or driver, or a CPU build of PyTorch), and "
            "only a GPU's clocks can be locked; drop the flag"
        )
    try:
        nvml = open_nvml(cuda_index, module)
    except NvmlUnavailable as exc:
        raise HarnessError(f"{flag}: NVML cannot reach the GPU of CUDA device {cuda_index}: {exc}") from None
    try:
        uuid = nvml.uuid or cuda_uuid
        name = nvml.name()
        gpu = f"{name or 'the GPU'} ({uuid})"
        if uuid in LOCKED_GRAPHICS_MHZ:
            raise HarnessError(f"{flag}: this process holds a clock lock on {gpu} already; nest no second one")
        mhz = target_mhz(nvml, request, flag, gpu)
        with _sigterm_interrupts():
            refused = False  # True: NVML refused the lock outright, so nothing was set
            try:
                try:
                    nvml.module.nvmlDeviceSetGpuLockedClocks(nvml.handle, mhz, mhz)
                except nvml.module.NVMLError as exc:
                    refused = getattr(exc, "value", None) in _refusals(nvml)
                    raise HarnessError(_lock_failure(exc, nvml, flag, gpu, mhz)) from None
                LOCKED_GRAPHICS_MHZ[uuid] = mhz
                yield ClockLock(uuid, name, mhz)
            finally:
                LOCKED_GRAPHICS_MHZ.pop(uuid, None)
                _reset(nvml, uuid, gpu, mhz, refused)
    finally:
        nvml.close()


def target_mhz(nvml: Nvml, request: LockRequest, flag: str, gpu: str) -> int:
    """The graphics clock ``request`` names on this GPU; HarnessError if it names none."""
    if isinstance(request, int):
        supported = supported_graphics_clocks(nvml)
        if supported is None:
            raise HarnessError(
                f"{flag}: {gpu} lists no supported clocks through NVML, so {request} MHz cannot be "
                "checked; use base or max"
            )
        if request not in supported:
            nearest = sorted(sorted(supported, key=lambda mhz: abs(mhz - request))[:2])
            raise HarnessError(
                f"{flag}: {gpu} does not support a graphics clock of {request} MHz; valid: one of its "
                f"{len(supported)} clocks from {supported[0]} to {supported[-1]} MHz "
                f"(nearest: {' and '.join(map(str, nearest))}), base or max"
            )
        return request
    if request not in NAMED_CLOCKS:
        raise HarnessError(f"{flag}: valid: {', '.join(NAMED_CLOCKS)} or a clock in MHz")
    settings = nvml.clock_settings()
    key, what = (
        ("default_applications_graphics_mhz", "default applications (base) clock")
        if request == "base"
        else ("max_graphics_mhz", "maximum graphics clock")
    )
    value = settings[key]
    if value is None:
        other = "max" if request == "base" else "base"
        raise HarnessError(f"{flag}: {gpu} reports no {what} through NVML; use {other} or a clock in MHz")
    return value


def supported_graphics_clocks(nvml: Nvml) -> list[int] | None:
    """Every graphics clock the GPU supports at any memory clock, ascending; None if NVML lists none."""
    memory_clocks = nvml.query("nvmlDeviceGetSupportedMemoryClocks")
    if not memory_clocks:
        return None
    found: set[int] = set()
    for memory_mhz in memory_clocks:
        found.update(nvml.query("nvmlDeviceGetSupportedGraphicsClocks", memory_mhz) or [])
    return sorted(found) or None


def _refusals(nvml: Nvml) -> tuple[int, int]:
    """NVML's errors for a lock it refuses before changing anything: no permission, not supported."""
    return (nvml.module.NVML_ERROR_NO_PERMISSION, nvml.module.NVML_ERROR_NOT_SUPPORTED)


def _lock_failure(exc: Exception, nvml: Nvml, flag: str, gpu: str, mhz: int) -> str:
    code = getattr(exc, "value", None)
    if code == nvml.module.NVML_ERROR_NO_PERMISSION:
        return (
            f"{flag}: NVML refused to lock the clocks of {gpu} ({exc}): locking clocks needs root; "
            "run the benchmark as root (e.g. with sudo), or drop --lock-clocks"
        )
    if code == nvml.module.NVML_ERROR_NOT_SUPPORTED:
        return (
            f"{flag}: {gpu} cannot lock its clocks (NVML: {exc}; it takes a Volta or newer GPU, and a "
            "virtual machine's GPU may not allow it); drop --lock-clocks"
        )
    return f"{flag}: locking the graphics clock of {gpu} at {mhz} MHz failed: {exc}"


def _reset(nvml: Nvml, uuid: str, gpu: str, mhz: int, refused: bool) -> None:
    """Unlock the clocks; a failure is a HarnessError, unless the lock was refused (nothing to undo)."""
    try:
        nvml.module.nvmlDeviceResetGpuLockedClocks(nvml.handle)
    except nvml.module.NVMLError as exc:
        if refused:
            return
        raise HarnessError(
            f"could not unlock the clocks of {gpu} ({exc}): they may still be locked at {mhz} MHz; "
            f"unlock them with `sudo nvidia-smi -rgc -i {uuid}`"
        ) from None


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated`; the previous handler is put back on exit.

    Python runs signal handlers in the main thread only and lets no other
    thread set one: elsewhere nothing changes, and SIGTERM ends the process
    as before.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"{signal.Signals(signum).name} while the GPU clocks were locked")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        # None: a handler installed outside Python, which cannot be put back; the default stands in.
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
