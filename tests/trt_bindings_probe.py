"""Run the backend's TensorRT-facing code against the real bindings of one TensorRT version.

Started by tests/trt_bindings.py in a subprocess whose ``PYTHONPATH`` holds one
unpacked ``tensorrt-cu12-bindings`` wheel and whose ``LD_LIBRARY_PATH`` holds
the stand-in native library (argv[1] names it). Prints one JSON object of what
it observed; tests/test_trt_real_bindings.py judges it.
"""

from __future__ import annotations

import ctypes
import json
import sys
import warnings
from pathlib import Path

import tensorrt_bindings

sys.modules["tensorrt"] = tensorrt_bindings  # what the `tensorrt` meta-package re-exports

import tensorrt as trt  # noqa: E402

from harness.cache.operations import pin  # noqa: E402
from harness.cache.timing_cache import Provenance, TimingCache  # noqa: E402
from harness.engines.onnx_export import TensorSpec  # noqa: E402
from harness.engines.protocol import PRECISION_MODES, BatchProfile, BuildConfig  # noqa: E402
from harness.engines.tensorrt.backend import TensorRTBackend  # noqa: E402
from harness.engines.tensorrt.builder import (  # noqa: E402
    TrtModule,
    add_batch_profile,
    build_settings,
    capture_log,
    process_logger,
    run_builder,
    set_builder_flags,
)
from harness.engines.tensorrt.cache_bridge import apply_selections, export_trt_cache  # noqa: E402
from harness.engines.tensorrt.log_parser import parse_log_file  # noqa: E402
from harness.engines.tensorrt.versions import TrtApi, TrtVersion, flag_bits, installed_version  # noqa: E402
from harness.errors import HarnessError  # noqa: E402

DATA = Path(__file__).parent / "data" / "trt"
KEY = "0x1814870c44ff0f8574df6e3dda04cbd7"  # matMul1 of NVIDIA's sampleEditableTimingCache

# Every method and attribute backend.py, builder.py, cache_bridge.py and inspector.py use.
CALLED = {
    "Builder": ("create_network", "create_builder_config", "build_serialized_network", "create_optimization_profile"),
    "IBuilderConfig": (
        "set_flag", "clear_flag", "create_timing_cache", "set_timing_cache", "get_timing_cache",
        "profiling_verbosity", "builder_optimization_level", "avg_timing_iterations", "add_optimization_profile",
    ),
    "IOptimizationProfile": ("set_shape",),
    "ITimingCache": ("queryKeys", "query", "update", "serialize"),
    "OnnxParser": ("parse", "get_error", "num_errors"),
    "Runtime": ("deserialize_cuda_engine",),
    "ICudaEngine": (
        "create_engine_inspector", "create_execution_context", "num_io_tensors", "get_tensor_name",
        "get_tensor_mode", "device_memory_size_v2",
    ),
    "IExecutionContext": ("set_tensor_address", "execute_async_v3", "set_input_shape", "get_tensor_shape"),
    "EngineInspector": ("get_engine_information",),
    "TimingCacheValue": ("tacticHash", "timingMSec"),
    "TimingCacheKey": ("parse",),
}  # fmt: skip


def signature(obj: object) -> str:
    return (getattr(obj, "__doc__", None) or "").strip().splitlines()[0] if getattr(obj, "__doc__", None) else ""


class RecordingConfig:
    """Stands in for IBuilderConfig (which needs a builder): records what it is given."""

    def __init__(self) -> None:
        self.set: list[object] = []
        self.cleared: list[object] = []

    def set_flag(self, flag: object) -> None:
        self.set.append(flag)

    def clear_flag(self, flag: object) -> None:
        self.cleared.append(flag)


class RecordingCache:
    """Stands in for ITimingCache (which needs a builder config); values are real TimingCacheValues."""

    def __init__(self, values: dict[str, object]) -> None:
        self.values = values
        self.updates: list[list[object]] = []

    def queryKeys(self) -> list[object]:  # noqa: N802 - TensorRT's spelling
        return [trt.TimingCacheKey.parse(k) for k in self.values]

    def query(self, key: object) -> object:
        return self.values[str(key)]

    def update(self, key: object, value: trt.TimingCacheValue) -> bool:
        self.updates.append([type(key).__name__, str(key), type(value).__name__, value.tacticHash, value.timingMSec])
        return True


def modes() -> dict[str, dict[str, object]]:
    backend = TensorRTBackend(trt)
    out: dict[str, dict[str, object]] = {}
    for mode in PRECISION_MODES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                settings = backend.settings(BuildConfig(mode, error_on_cache_miss=True))
            except HarnessError as exc:
                out[mode] = {"error": str(exc)}
                continue
        config = RecordingConfig()
        set_builder_flags(trt, config, settings)
        out[mode] = {
            "builder_flags": [flag.name for flag in config.set],  # type: ignore[attr-defined]
            "all_builder_flag_members": all(isinstance(f, trt.BuilderFlag) for f in config.set),
            "cleared": [flag.name for flag in config.cleared],  # type: ignore[attr-defined]
            "network_bits": flag_bits(
                trt.NetworkDefinitionCreationFlag.__members__, settings.network_flags, "NetworkDefinitionCreationFlag"
            ),
            "detailed": config.profiling_verbosity == trt.ProfilingVerbosity.DETAILED,  # type: ignore[attr-defined]
            "warnings": [str(w.message) for w in caught],
        }
    return out


class RecordingProfile:
    """Stands in for IOptimizationProfile (a builder makes it): records the shapes it is given."""

    def __init__(self) -> None:
        self.shapes: list[list[object]] = []

    def set_shape(self, name: str, low: object, opt: object, high: object) -> None:
        self.shapes.append([name, *([type(d).__name__, list(d)] for d in (low, opt, high))])  # type: ignore[call-overload]


class RecordingBuilder:
    def __init__(self) -> None:
        self.profiles: list[RecordingProfile] = []

    def create_optimization_profile(self) -> RecordingProfile:
        self.profiles.append(RecordingProfile())
        return self.profiles[-1]


class ProfileConfig(RecordingConfig):
    def __init__(self, answer: int) -> None:
        super().__init__()
        self.answer = answer
        self.added: list[RecordingProfile] = []

    def add_optimization_profile(self, profile: RecordingProfile) -> int:
        self.added.append(profile)
        return self.answer


def profiles() -> dict[str, object]:
    """One optimization profile for a batch sweep, its shapes as the real ``trt.Dims``."""
    inputs = (TensorSpec("x", "fp32", (-1, 3, 32, 32)), TensorSpec("scale", "fp32", (4,)))
    sweep = BatchProfile.for_sweep(0, [8, 1, 32])
    builder, config = RecordingBuilder(), ProfileConfig(0)
    shapes = add_batch_profile(trt, builder, config, inputs, sweep)  # type: ignore[arg-type]
    out: dict[str, object] = {
        "returned": shapes,
        "set": [p.shapes for p in builder.profiles],
        "added": len(config.added) == 1 and config.added[0] is builder.profiles[0],
        "kernel_options": TensorRTBackend(trt).settings(BuildConfig("fp16", batch_profile=sweep)).kernel_options(),
        "builder_record": TensorRTBackend(trt).settings(BuildConfig("fp16", batch_profile=sweep)).to_json(),
    }
    for name, config, specs in (
        ("refused", ProfileConfig(-1), inputs),
        ("other_dim", ProfileConfig(0), (TensorSpec("x", "fp32", (2, -1)),)),
        ("static", ProfileConfig(0), (TensorSpec("x", "fp32", (2, 3)),)),
    ):
        try:
            add_batch_profile(trt, RecordingBuilder(), config, specs, sweep)  # type: ignore[arg-type]
            out[name] = ""
        except HarnessError as exc:
            out[name] = str(exc)
    return out


def keys() -> dict[str, object]:
    log = parse_log_file(DATA / "editable_10.8_sample_readme.log")
    provenance = Provenance("tensorrt", trt.__version__, "probe", {}, {})
    built = RecordingCache({KEY: trt.TimingCacheValue(0x665DED9ABBF88, 0.011264)})
    cache = export_trt_cache(built, log, provenance)
    entry = cache.entries()[0]
    pin(cache, "matMul1", "0x393e4ef8ad243")
    target = RecordingCache({KEY: trt.TimingCacheValue(0x665DED9ABBF88, 0.011264)})
    refused = apply_selections(target, cache, trt)
    odd = TimingCache(provenance, [entry.__class__("0x1234", "conv", "t", "0x1", 1.0)])
    invalid = RecordingCache({KEY: trt.TimingCacheValue((1 << 64) - 1, 0.5)})
    try:
        export_trt_cache(invalid, log, provenance)
        invalid_error = ""
    except HarnessError as exc:
        invalid_error = str(exc)
    try:
        trt.TimingCacheKey.parse("0x1234")
        parse_error = ""
    except ValueError as exc:
        parse_error = str(exc)
    return {
        "upper_case_round_trip": str(trt.TimingCacheKey.parse(KEY.upper().replace("0X", "0x"))),
        "exported": [entry.key, entry.layer, entry.tactic_hash, entry.time_ms],
        "updates": target.updates,
        "refused": refused,
        "odd": apply_selections(target, odd, trt),
        "invalid_hash": invalid_error,
        "parse_error": parse_error,
    }


def logging_and_builders(standin: str) -> dict[str, object]:
    logger = process_logger(trt)
    with capture_log(trt) as capture:
        for name, severity in trt.ILogger.Severity.__members__.items():
            logger.log(severity, f"message {name}")
    settings = build_settings(installed_version(trt), "fp16", {}, timing_cache=True, editable=True, error_on_cache_miss=False)
    failures = []
    for _ in range(2):  # two builds in one process: TensorRT must be handed one logger
        try:
            run_builder(trt, b"", settings, base_cache=None, enforced=None, ignore_mismatch=False)
        except TypeError as exc:  # the stand-in creates no builder
            failures.append(str(exc))
    try:
        trt.Runtime(process_logger(trt))
    except TypeError as exc:
        failures.append(str(exc))
    lib = ctypes.CDLL(standin)
    lib.standin_logger.restype = ctypes.c_void_p
    count = lib.standin_count()
    return {
        "is_ilogger": isinstance(logger, trt.ILogger),
        "same_logger": process_logger(trt) is logger,
        "captured": capture.lines,
        "failures": failures,
        "loggers_seen": [lib.standin_logger(i) for i in range(count)],
        "versions_seen": [lib.standin_version(i) for i in range(count)],
    }


def main() -> None:
    report = {
        "version": trt.__version__,
        "parsed_version": str(installed_version(trt)),
        "module_attributes_missing": [
            n for n in (*TrtApi.__annotations__, *TrtModule.__annotations__) if not hasattr(trt, n)
        ],
        "called_missing": [f"{c}.{m}" for c, names in CALLED.items() for m in names if not hasattr(getattr(trt, c), m)],
        "signatures": {
            f"{c}.{m}": signature(getattr(getattr(trt, c), m))
            for c, names in CALLED.items()
            for m in names
            if callable(getattr(getattr(trt, c), m, None))
        },
        "builder_flag_members": {name: int(value) for name, value in trt.BuilderFlag.__members__.items()},
        "modes": modes(),
        "weak_10_13_here": None,
        "keys": keys(),
        "profiles": profiles(),
        "logging": logging_and_builders(sys.argv[1]),
    }
    weak = build_settings(TrtVersion(10, 13), "weak-fp16", {}, timing_cache=True, editable=True, error_on_cache_miss=False)
    try:
        set_builder_flags(trt, RecordingConfig(), weak)  # type: ignore[arg-type]
    except HarnessError as exc:
        report["weak_10_13_here"] = str(exc)
    print(json.dumps(report))


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a 10.12+ weak-mode warning, checked in modes()
        main()
