"""The OpenVINO backend: the TensorRT hand-off file, compiled by OpenVINO's CPU plugin.

OpenVINO's ``INFERENCE_PRECISION_HINT`` is the CPU counterpart of TensorRT's
weak typing, so the backend maps the precision modes onto it:

* ``fp32`` and the strongly typed modes (``fp16``, ``bf16``, ``autocast-*``,
  ``amp-*``, ``explicit``): the typed graph, exported to ONNX with one
  ``Cast`` per compiler cast (OpenVINO's ``Convert``), compiled with the hint
  at ``f32``. Under that hint OpenVINO runs each op in the type the graph
  gives it, so the compiler's casts decide. Every build checks it: a layer
  OpenVINO computes in a narrower type than its source ops have fails the
  build; one it computes wider (no kernel for the narrow type) is reported.
* ``weak-fp16``/``weak-bf16``: the fp32 graph with the hint at ``f16``/``bf16``.
  OpenVINO lowers the graph itself and keeps what it deems precision-sensitive
  in f32; the build log lists which layers it lowered and which it kept.

What a mode needs is probed, not assumed from the CPU's name or flags
(:mod:`.probe`): OpenVINO 2025-2026 runs a graph's f16 ops in f32 under the f32
hint, so the strongly typed fp16 modes are refused with that reason (use
``weak-fp16``, where the hint does it); a CPU without bf16 kernels (e.g. AMD
before AVX512-BF16) refuses the bf16 modes, one without f16 kernels the
weak-fp16 mode.

Tactics: each layer's tactic is the primitive OpenVINO's runtime model reports
for it (oneDNN/MLAS/JIT kernel and precision). OpenVINO chooses primitives by
ISA and shape heuristics, never by timing, so, as with ONNX Runtime, nothing
is timed and no timing cache entry is read or written; the cache's provenance
still keys caches and results by OpenVINO version, CPU ISA, hint and threads.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cache.timing_cache import Provenance, TimingCache
from harness.dtypes import LOW_DTYPES
from harness.engines.onnx_export import OnnxExport, export_notes, export_onnx, listed
from harness.engines.openvino.engine import OpenVinoEngine
from harness.engines.openvino.layers import ExecutedLayer, layers_in, precision_summary, tactic_hash
from harness.engines.openvino.plan import BACKEND, EngineRecord
from harness.engines.openvino.probe import Probe, probe
from harness.engines.openvino.runtime import DEVICE, OV_ERRORS, VERSION, core, ov_type_name
from harness.engines.openvino.settings import CompileSettings
from harness.engines.protocol import BuildConfig, BuildLog, LayerTiming
from harness.errors import HarnessError
from harness.machine import cpu_info
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph



class OpenVinoBackend:
    name = BACKEND

    def check_available(self) -> None:
        """The import worked (this module loaded); the CPU plugin must load as well."""
        try:
            devices = core().available_devices
        except OV_ERRORS as exc:
            raise HarnessError(f"OpenVINO {VERSION} cannot list its devices: {exc}") from None
        if DEVICE not in devices:
            raise HarnessError(
                f"OpenVINO {VERSION} has no {DEVICE} plugin here (devices: {', '.join(devices) or 'none'})"
            )

    def supported_modes(self) -> tuple[PrecisionMode, ...]:
        """The modes this CPU's OpenVINO can honour, probed (see :mod:`.probe`)."""
        return tuple(mode for mode in PrecisionMode if _refusal(mode) is None)

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        mode = PrecisionMode.parse(mode)
        reason = _refusal(mode)
        if reason is not None:
            raise HarnessError(reason)
        return mode

    def provenance(self, config: BuildConfig) -> Provenance:
        settings = CompileSettings.for_build(config)
        cpu = cpu_info()
        return Provenance(
            backend=BACKEND,
            backend_version=VERSION,
            # The CPU plugin picks its primitives by ISA extension, so they belong to the device.
            device=f"{cpu['model']} [{' '.join(cpu['isa_flags'])}] (OpenVINO {DEVICE})",
            device_details={**cpu, "optimization_capabilities": _capabilities()},
            builder_options={"mode": config.mode, **settings.to_json(), "autocast": config.compiler_settings()},
        )

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[OpenVinoEngine, BuildLog]:
        settings = CompileSettings.for_build(config)
        cache_notes = _cache_notes(cache)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="harness-openvino-") as tmp:
            exported = export_onnx(graph, Path(tmp) / "model.onnx")
            model_bytes = exported.path.read_bytes()
        if not config.mode.weak:
            _check_graph_types(exported, config)
        record = EngineRecord(
            config.mode, VERSION, settings, exported.inputs, exported.outputs, exported.casts,
            graph.outputs, config.compiler_settings(),
        )  # fmt: skip
        engine = OpenVinoEngine(model_bytes, record)
        engine(*graph.example_inputs)  # a first run surfaces kernels that fail only when executed
        messages = [
            *export_notes(exported),
            f"OpenVINO {VERSION} {DEVICE} plugin, INFERENCE_PRECISION_HINT={settings.inference_precision_hint}, "
            f"INFERENCE_NUM_THREADS={settings.inference_num_threads}: it picks each layer's primitive by ISA "
            "and shape, not by timing, so nothing was timed and no timing-cache entry was read or "
            "written; each layer's tactic is the primitive its runtime model reports",
            *_precision_notes(engine, config.mode, settings),
            *cache_notes,
        ]
        timings = [_timing(layer) for layer in engine.executed]
        return engine, BuildLog(BACKEND, config.mode, timings, messages, time.perf_counter() - start)

    def load(self, path: str | os.PathLike[str]) -> OpenVinoEngine:
        return OpenVinoEngine.load(path)


def _refusal(mode: PrecisionMode) -> str | None:
    """Why this CPU's OpenVINO cannot build ``mode`` (None: it can)."""
    name = mode.low
    if name is None:  # fp32, or explicit, whose types are known only from its file (checked at build)
        return None
    if mode.weak:
        result = probe("fp32", ov_type_name(name))
        if result.honoured:
            return None
        return (
            f"backend openvino cannot build {mode}: it compiles the fp32 graph with "
            f"INFERENCE_PRECISION_HINT={ov_type_name(name)}, and on this CPU ({_cpu()}) "
            f"{result.describe()}: OpenVINO has no {name} kernels here. Use fp32 here, or backend cpu"
        )
    result = probe(name, "f32")
    return None if result.honoured else _strong_refusal(mode, name, result)


def _strong_refusal(mode: str, name: str, result: Probe) -> str:
    weak = PrecisionMode.parse(f"weak-{name}")
    alternative = (
        f"Use {weak} here (OpenVINO lowers the fp32 graph by the hint), or backend cpu for {mode}"
        if _refusal(weak) is None
        else "Use backend cpu for it"
    )
    return (
        f"backend openvino cannot build {mode}: strongly typed modes compile with "
        "INFERENCE_PRECISION_HINT=f32 so that OpenVINO runs each op in the type the graph gives it, "
        f"and on this CPU ({_cpu()}) {result.describe()}: it would not follow the graph's {name} "
        f"casts. {alternative}"
    )


def _check_graph_types(exported: OnnxExport, config: BuildConfig) -> None:
    """Refuse a typed graph (an explicit file's, typically) holding a type OpenVINO would not keep."""
    present = {c.target for c in exported.compiler_casts} | set(exported.initializers.values())
    for name in LOW_DTYPES:
        if name not in present:
            continue
        result = probe(name, "f32")
        if result.honoured:
            continue
        casts = [c.node for c in exported.compiler_casts if c.target == name]
        source = f" (explicit file {config.explicit_path})" if config.explicit_path else ""
        raise HarnessError(
            f"{_strong_refusal(config.mode, name, result)}. The typed graph{source} casts to {name} at "
            f"{listed(casts) or 'its weights'}"
        )


def _precision_notes(engine: OpenVinoEngine, mode: PrecisionMode, settings: CompileSettings) -> list[str]:
    """What OpenVINO ran in which precision; a strongly typed build it lowered on its own fails."""
    layers, found = engine.executed, engine.deviations
    hint = settings.inference_precision_hint
    if mode.weak and mode.low is not None:
        low = mode.low
        return [
            f"weak typing: OpenVINO chose each layer's precision by INFERENCE_PRECISION_HINT={hint} on "
            f"the fp32 graph: {precision_summary(layers)}; in {low}: {layers_in(layers, low) or 'none'}; "
            f"kept in fp32: {layers_in(layers, 'fp32') or 'none'}"
        ]
    lowered = [d for d in found if not d.widened]
    if lowered:
        raise HarnessError(
            f"OpenVINO {VERSION} did not follow the typed graph under INFERENCE_PRECISION_HINT={hint}: "
            f"{len(lowered)} layer(s) compute in another precision than their graph types: "
            f"{listed([d.describe() for d in lowered])}"
        )
    summary = f"strong typing (INFERENCE_PRECISION_HINT={hint}): {precision_summary(layers)}"
    if not found:
        return [f"{summary}; every layer computes in a type the graph gives it"]
    return [
        summary,
        f"OpenVINO computes {len(found)} layer(s) wider than the graph gives them (no {DEVICE} kernel "
        f"for that type): {listed([d.describe() for d in found])}",
    ]


def _cache_notes(cache: TimingCache | None) -> list[str]:
    """A cache's entries cannot steer OpenVINO: pinned ones are refused, others reported unused."""
    if cache is None or not len(cache):
        return []
    pinned = [entry.layer for entry in cache.entries() if entry.pinned]
    if pinned:
        raise HarnessError(
            f"the timing cache pins {len(pinned)} layer(s) ({listed(pinned)}), but OpenVINO does not let "
            "a caller choose primitives: backend openvino cannot honour pinned tactics"
        )
    return [f"the timing cache holds {len(cache)} entries; OpenVINO does not choose by timing, none applied"]


def _timing(layer: ExecutedLayer) -> LayerTiming:
    """The build-log record of a layer: its primitive, chosen without timing (no candidates)."""
    return LayerTiming(layer.name, "", (), layer.primitive, tactic_hash(layer.primitive), False)


def _capabilities() -> list[str]:
    try:
        return sorted(core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES"))
    except OV_ERRORS:
        return []


def _cpu() -> str:
    return str(cpu_info()["model"])
