"""Leave the caller's process as it was: grad mode, autocast, RNG, threads.

Export, calibration, engine builds and benchmarks all touch process-wide
PyTorch state (a higher-order op switches grad mode, a user factory draws from
the global generator, timing pins the thread count). A failure halfway must
not leave that state changed, or the next call in the same process behaves
differently from the first. Every public entry point runs inside
:func:`preserved_global_state`, which snapshots the state and restores it on
success and on failure alike.

Grad mode, autocast and the thread count are each thread's own, and every
call gives them back. The CPU and CUDA RNGs and the fusion switch belong to
the process. Two threads inside entry points at once would each give those
back as they were when they entered, the later one what the earlier had set
meanwhile (the RNG rewound into the other's draws, or left where the earlier
had moved it), so the process's part is given back by the last thread to
leave, as it was when the first entered; a call nested in another on the same
thread gives it back as the outer call had it only while no other thread is
inside. (A thread count set also becomes the default of threads that have not
run torch yet; torch offers no way to read that default back.)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from harness.errors import HarnessError
from harness.limits import MAX_THREADS

AUTOCAST_DEVICES = ("cpu", "cuda")

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class GlobalState:
    """The process-wide PyTorch settings a library call could change."""

    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    num_threads: int
    cpu_rng: bytes
    onednn_fusion: bool  # TorchScript's oneDNN Graph fusion, which the CPU engine switches on briefly

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            autocast=tuple(
                (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
            num_threads=torch.get_num_threads(),
            cpu_rng=bytes(torch.random.get_rng_state().numpy().tobytes()),
            onednn_fusion=onednn_fusion_enabled(),
        )

    def restore(self) -> None:
        self.restore_thread()
        self.restore_process()

    def restore_thread(self) -> None:
        """The calling thread's own settings: grad mode, autocast and its thread count.

        (torch's thread count is each thread's OpenMP setting; a set also
        becomes the default of threads that have not run torch yet.)
        """
        torch.set_grad_enabled(self.grad_enabled)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def restore_process(self) -> None:
        """The settings every thread shares: the CPU RNG and oneDNN fusion."""
        torch.random.set_rng_state(torch.frombuffer(bytearray(self.cpu_rng), dtype=torch.uint8))
        if onednn_fusion_enabled() != self.onednn_fusion:
            torch.jit.enable_onednn_fusion(self.onednn_fusion)

    def differences(self, other: GlobalState) -> list[str]:
        """Names of the settings that differ, for a test's failure message."""
        return [name for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]


def onednn_fusion_enabled() -> bool:
    """TorchScript's process-wide oneDNN Graph fusion switch (False where this PyTorch has none)."""
    return bool(torch._C._jit_llga_enabled()) if hasattr(torch._C, "_jit_llga_enabled") else False


class _Occupancy:
    """Which threads are inside :func:`preserved_global_state`, and how to give back the
    process-wide state the first of them found."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depths: dict[int, int] = {}  # thread -> how deeply it is nested
        self.first: Callable[[], None] | None = None

    def enter(self) -> tuple[int, GlobalState, Callable[[], None]]:
        """This thread's id, its settings, and how to give back the process's as they are now.

        Read under the lock, so never while a thread leaving is giving the
        process's back: a snapshot taken just before would be of the state
        that thread had left, and would later be given back for good.
        """
        with self.lock:
            state = GlobalState.capture()
            initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # unannotated in torch
            cuda_rng = torch.cuda.get_rng_state_all() if initialized else None

            def restore_process() -> None:
                state.restore_process()
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)

            if not self.depths:
                self.first = restore_process
            me = threading.get_ident()
            self.depths[me] = self.depths.get(me, 0) + 1
            return me, state, restore_process

    def leave(self, me: int, restore_process: Callable[[], None]) -> None:
        """Give back the process's state as the module docstring says, under the lock."""
        with self.lock:
            self.depths[me] -= 1
            nested = self.depths[me] > 0
            if not nested:
                del self.depths[me]
            if nested and list(self.depths) == [me]:
                restore_process()  # what the outer call on this thread had set
            elif not self.depths and self.first is not None:
                first, self.first = self.first, None
                first()


_OCCUPANCY = _Occupancy()


@contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restore grad mode, autocast state, RNGs, thread count and oneDNN fusion on exit, whatever happened."""
    me, state, restore_process = _OCCUPANCY.enter()
    try:
        yield
    finally:
        try:
            state.restore_thread()
        finally:
            _OCCUPANCY.leave(me, restore_process)


@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count fixed at ``threads`` inside; the caller's state restored after.

    What a benchmark needs for every candidate it times (eager, engines,
    builds) to run at one count: PyTorch's default (all cores) on a shared
    machine lets another process decide the latency for seconds at a time.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise HarnessError(f"threads {threads!r}: expected an integer from 1 to {MAX_THREADS}")
    with preserved_global_state():
        torch.set_num_threads(threads)
        yield


def preserves_global_state(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of :func:`preserved_global_state` for entry points."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with preserved_global_state():
            return fn(*args, **kwargs)

    return wrapper


