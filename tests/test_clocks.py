"""GPU clock locks: the right GPU, the right clock, and always unlocked afterwards.

The GPU is :class:`tests.test_telemetry_gpus.NvmlDouble` (three GPUs in NVML's
order) with CUDA's device 0 on its second GPU, so a lock on NVML's index 0
would be the neighbour's. Without a GPU here, the no-GPU error is the real one.
"""

from __future__ import annotations

import argparse
import os
import signal

import pynvml
import pytest

from harness.bench.clocks import NAMED_CLOCKS, Terminated, locked_clocks
from harness.bench.telemetry import TelemetrySampler
from harness.cli import argtypes
from harness.errors import HarnessError
from harness.nvml import LOCKED_GRAPHICS_MHZ
from tests.test_telemetry_gpus import B, NvmlDouble, cuda_double, gpus

UUID = f"GPU-{B}"


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> NvmlDouble:
    """NVML's GPUs A, B, C; CUDA's device 0 is B."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda_double(monkeypatch, B)
    return gpus()


def assert_unlocked(nvml: NvmlDouble) -> None:
    """Every GPU as it was, this process holds no lock, and every NVML session it opened is closed."""
    assert [g.locked for g in nvml.gpus] == [None, None, None]
    assert LOCKED_GRAPHICS_MHZ == {} and nvml.inits == nvml.shutdowns


@pytest.mark.parametrize(("request_", "mhz"), [("base", 1410), ("max", 1980), (1425, 1425)])
def test_the_lock_holds_the_asked_clock_on_cudas_gpu_for_the_block(nvml: NvmlDouble, request_: str | int, mhz: int) -> None:
    with locked_clocks(request_, module=nvml) as lock:
        assert (lock.uuid, lock.graphics_mhz) == (UUID, mhz)
        assert [g.locked for g in nvml.gpus] == [None, mhz, None]  # B: not NVML's index 0
        with TelemetrySampler(interval_s=0.01, nvml_module=nvml) as sampler:
            pass
    assert nvml.calls == [("lock", UUID, mhz, mhz), ("reset", UUID)]
    assert_unlocked(nvml)
    gpu = sampler.summary()["gpu"]  # each case's telemetry records the lock it ran under
    assert gpu["uuid"] == UUID and gpu["clocks"]["locked_graphics_mhz"] == mhz
    assert gpu["sm_clock_mhz"]["max"] == mhz


def test_a_clock_the_gpu_does_not_list_is_refused_naming_the_nearest(nvml: NvmlDouble) -> None:
    with pytest.raises(HarnessError) as exc, locked_clocks(1400, module=nvml):
        pass
    assert str(exc.value) == (
        f"--lock-clocks 1400: NVIDIA H100 80GB HBM3 ({UUID}) does not support a graphics clock of 1400 MHz; "
        "valid: one of its 4 clocks from 1395 to 1980 MHz (nearest: 1395 and 1410), base or max"
    )
    nvml.gpus[1].supported = ()  # a GPU that lists none: a MHz value cannot be checked, so it is refused
    with pytest.raises(HarnessError, match="lists no supported clocks through NVML, so 1410 MHz cannot be checked; use base or max"):
        with locked_clocks(1410, module=nvml):
            pass
    assert nvml.calls == []
    assert_unlocked(nvml)


def test_a_gpu_without_a_base_clock_says_what_else_to_give(nvml: NvmlDouble) -> None:
    nvml.gpus[1].base_mhz = None
    with pytest.raises(HarnessError, match="reports no default applications \\(base\\) clock through NVML; use max or a clock in MHz"):
        with locked_clocks("base", module=nvml):
            pass
    assert nvml.calls == []
    assert_unlocked(nvml)


def test_a_run_that_fails_under_the_lock_still_unlocks(nvml: NvmlDouble) -> None:
    with pytest.raises(RuntimeError, match="engine failed"), locked_clocks("max", module=nvml):
        raise RuntimeError("engine failed")
    assert nvml.calls[-1] == ("reset", UUID)
    assert_unlocked(nvml)


def test_a_lock_call_that_fails_after_changing_the_clock_is_undone(nvml: NvmlDouble) -> None:
    nvml.gpus[1].lock_error, nvml.gpus[1].partial = pynvml.NVML_ERROR_UNKNOWN, True
    with pytest.raises(HarnessError) as exc, locked_clocks("max", module=nvml):
        pytest.fail("the block must not run without the lock")
    assert str(exc.value) == f"--lock-clocks max: locking the graphics clock of NVIDIA H100 80GB HBM3 ({UUID}) at 1980 MHz failed: Unknown Error"
    assert nvml.calls == [("lock", UUID, 1980, 1980), ("reset", UUID)]
    assert_unlocked(nvml)


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "SIGTERM"])
def test_ctrl_c_and_sigterm_unlock(nvml: NvmlDouble, how: str) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as exc, locked_clocks("base", module=nvml):
        if how == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # its handler raises here, in the main thread
        raise KeyboardInterrupt
    assert isinstance(exc.value, Terminated) == (how == "SIGTERM")
    assert nvml.calls[-1] == ("reset", UUID)
    assert_unlocked(nvml)
    assert signal.getsignal(signal.SIGTERM) is before


def test_no_permission_is_one_clear_error_and_changes_nothing(nvml: NvmlDouble) -> None:
    # A process that may not lock may not reset either: that second refusal is not news.
    nvml.gpus[1].lock_error = nvml.gpus[1].reset_error = pynvml.NVML_ERROR_NO_PERMISSION
    with pytest.raises(HarnessError) as exc, locked_clocks("base", module=nvml):
        pass
    assert str(exc.value) == (
        f"--lock-clocks base: NVML refused to lock the clocks of NVIDIA H100 80GB HBM3 ({UUID}) "
        "(Insufficient Permissions): locking clocks needs root; run the benchmark as root (e.g. with sudo), "
        "or drop --lock-clocks"
    )
    assert_unlocked(nvml)


def test_a_gpu_that_cannot_lock_says_so(nvml: NvmlDouble) -> None:
    nvml.gpus[1].lock_error = nvml.gpus[1].reset_error = pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(HarnessError, match="cannot lock its clocks \\(NVML: Not Supported; .*\\); drop --lock-clocks"):
        with locked_clocks(1410, module=nvml):
            pass
    assert_unlocked(nvml)


def test_an_unlock_that_fails_says_how_to_unlock_by_hand(nvml: NvmlDouble) -> None:
    nvml.gpus[1].reset_error = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(HarnessError) as exc, locked_clocks("max", module=nvml):
        pass
    assert str(exc.value) == (
        f"could not unlock the clocks of NVIDIA H100 80GB HBM3 ({UUID}) (GPU is lost): they may still be "
        f"locked at 1980 MHz; unlock them with `sudo nvidia-smi -rgc -i {UUID}`"
    )
    assert LOCKED_GRAPHICS_MHZ == {} and nvml.inits == nvml.shutdowns


def test_a_second_lock_of_the_same_gpu_is_refused(nvml: NvmlDouble) -> None:
    with locked_clocks("max", module=nvml):
        with pytest.raises(HarnessError, match="holds a clock lock on .* already"), locked_clocks("base", module=nvml):
            pass
        assert nvml.gpus[1].locked == 1980  # the outer lock stands
    assert_unlocked(nvml)


def test_without_a_gpu_the_lock_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine, as it is: a CPU build of PyTorch and no NVIDIA driver.
    with pytest.raises(HarnessError, match="^--lock-clocks max: this process has no CUDA GPU .*; drop the flag$"):
        with locked_clocks("max"):
            pass
    cuda_double(monkeypatch, B)  # CUDA, but the real NVML finds no driver
    reason = pynvml_init_error()
    with pytest.raises(HarnessError, match=f"^--lock-clocks max: NVML cannot reach the GPU of CUDA device 0: nvmlInit failed: {reason}$"):
        with locked_clocks("max"):
            pass


def pynvml_init_error() -> str:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    pytest.skip("NVML initialises on this machine")


def test_the_flag_parses_what_the_lock_takes() -> None:
    assert [argtypes.lock_clocks(name.upper()) for name in NAMED_CLOCKS] == list(NAMED_CLOCKS)
    assert argtypes.lock_clocks(" 1410 ") == 1410
    for bad in ("fast", "0", "-5", "1e3", "99999"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected base, max or a clock in MHz"):
            argtypes.lock_clocks(bad)
