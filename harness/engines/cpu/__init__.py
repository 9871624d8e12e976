"""The CPU reference engine: real tactic choices on PyTorch/oneDNN, on any machine.

:class:`CpuBackend` implements :class:`harness.engines.protocol.Backend`; every
precision mode is supported (fp16 runs, slowly, where the CPU lacks fast fp16).
"""

from __future__ import annotations

import os
import platform
import time
from typing import TYPE_CHECKING

import torch

from harness.cache.timing_cache import Provenance, TimingCache
from harness.engines.cpu.builder import PlanBuilder
from harness.engines.cpu.engine import CpuEngine
from harness.engines.cpu.timing import TimingOptions
from harness.engines.protocol import BuildConfig, BuildLog
from harness.machine import cpu_flags, cpu_model
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph

__all__ = ["CpuBackend", "CpuEngine"]

BUILDER_OPTIONS = ("timing_runs", "warmup_runs")
# CPU features that decide which kernels oneDNN and ATen may pick.
_RELEVANT_FLAGS = frozenset({
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
})


class CpuBackend:
    name = "cpu"

    def check_available(self) -> None:
        """Always available: the engine runs on PyTorch's CPU kernels."""

    def supported_modes(self) -> tuple[PrecisionMode, ...]:
        return tuple(PrecisionMode)

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        return PrecisionMode.parse(mode)

    def provenance(self, config: BuildConfig) -> Provenance:
        timing = _timing_options(config)
        model, flags = cpu_model(), sorted(cpu_flags() & _RELEVANT_FLAGS)
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


