"""The CPU reference engine: real tactic choices on PyTorch/oneDNN, on any machine.

:class:`CpuBackend` implements :class:`harness.engines.protocol.Backend`; every
precision mode is supported (fp16 runs, slowly, where the CPU lacks fast fp16).
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.cache.timing_cache import Provenance, TimingCache
from harness.engines.cpu.builder import PlanBuilder
from harness.engines.cpu.engine import CpuEngine
from harness.engines.cpu.timing import TimingOptions
from harness.engines.modes import check_mode_name
from harness.engines.protocol import PRECISION_MODES, BuildConfig, BuildLog

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph

__all__ = ["CpuBackend", "CpuEngine"]

BUILDER_OPTIONS = ("timing_runs", "warmup_runs")
# CPU features that decide which kernels oneDNN and ATen may pick.
_RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "asimd",
    "sve",
)


class CpuBackend:
    name = "cpu"

    def check_available(self) -> None:
        """Always available: the engine runs on PyTorch's CPU kernels."""

    def supported_modes(self) -> tuple[str, ...]:
        return PRECISION_MODES

    def check_mode(self, mode: str) -> None:
        check_mode_name(mode)

    def provenance(self, config: BuildConfig) -> Provenance:
        timing = _timing_options(config)
        model, flags = _cpu_identity()
        capability = torch.backends.cpu.get_cpu_capability()
        return Provenance(
            backend="cpu",
            backend_version=f"torch {torch.__version__}",
            # The ISA extensions decide which kernels exist, so they are part of
            # the compared device string, not just informative details.
            device=f"{model} ({platform.machine()}, {capability}: {' '.join(flags)})",
            device_details={
                "model": model,
                "machine": platform.machine(),
                "flags": list(flags),
                "cpu_capability": capability,
                "mkldnn": torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
            },
            builder_options={
                "mode": config.mode,
                "timing_runs": timing.timing_runs,
                "warmup_runs": timing.warmup_runs,
                "num_threads": config.thread_count(),
                "autocast": config.compiler_settings(),
            },
        )

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[CpuEngine, BuildLog]:
        timing = _timing_options(config)
        start = time.perf_counter()
        builder = PlanBuilder(config, cache, timing)
        plan = builder.build(graph.graph_module, graph.example_inputs)
        plan.structure = graph.outputs
        plan.compiler_settings = config.compiler_settings()
        engine = CpuEngine(plan)
        log = BuildLog(
            "cpu",
            config.mode,
            builder.timings,
            builder.messages,
            time.perf_counter() - start,
            list(builder.added.values()),
            list(builder.warnings),
        )
        return engine, log

    def load(self, path: str | os.PathLike[str]) -> CpuEngine:
        return CpuEngine.load(path)


def _timing_options(config: BuildConfig) -> TimingOptions:
    from harness.errors import HarnessError

    unknown = sorted(set(config.options) - set(BUILDER_OPTIONS))
    if unknown:
        raise HarnessError(
            f"unknown cpu builder option(s) {', '.join(unknown)}; valid: {', '.join(BUILDER_OPTIONS)}"
        )
    return TimingOptions.from_options(config.options)


@functools.cache
def _cpu_identity() -> tuple[str, tuple[str, ...]]:
    """CPU model name and the kernel-relevant feature flags (Linux /proc/cpuinfo, else platform)."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name" and value.strip():
                model = value.strip()
            elif field.strip() in ("flags", "Features"):
                flags = set(value.split())
    return model, tuple(sorted(flags.intersection(_RELEVANT_FLAGS)))
