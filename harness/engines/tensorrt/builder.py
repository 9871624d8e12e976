"""One TensorRT builder run: ONNX bytes + settings (+ timing cache) -> plan, binary cache, log.

Everything that decides kernels is expressed as flag *names* and plain
numbers (:class:`BuildSettings`) and turned into enum members of the loaded
TensorRT only inside :func:`run_builder`, so a record written under TensorRT
10 still reads correctly under 11 (enum integers changed between them).

The builder's VERBOSE log is the only map from op to timing-cache key, so
every run captures it (:func:`capture_log`, fed by the process's one
``trt.ILogger``, :func:`process_logger`) and :func:`layer_timings` turns it into
the backend-neutral :class:`~harness.engines.protocol.LayerTiming` records.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from harness.cache.timing_cache import CacheEntry, TimingCache
from harness.engines.onnx_export import TensorSpec
from harness.engines.protocol import BatchProfile, LayerTiming
from harness.engines.tensorrt.cache_bridge import (
    apply_selections,
    moved_selections,
    selections_not_kept,
)
from harness.engines.tensorrt.inspector import InspectedLayer
from harness.engines.tensorrt.join import Joined
from harness.engines.tensorrt.log_parser import ParsedLayer, ParsedLog
from harness.engines.tensorrt.versions import (
    DISABLE_COMPILATION_CACHE,
    EDITABLE_TIMING_CACHE,
    ERROR_ON_TIMING_CACHE_MISS,
    TF32,
    TrtApi,
    TrtVersion,
    builder_flag_names,
    flag_bits,
    installed_version,
    load_tensorrt,
    network_flag_names,
)
from harness.errors import HarnessError

if TYPE_CHECKING:
    import tensorrt


class TrtModule(TrtApi, Protocol):
    """The parts of the ``tensorrt`` module the backend calls besides ``TrtApi``'s.

    :func:`load_trt` returns the real module as this protocol, so mypy checks
    every use against the TensorRT type stubs; tests pass a small namespace.
    """

    Builder: type[tensorrt.Builder]
    OnnxParser: type[tensorrt.OnnxParser]
    Runtime: type[tensorrt.Runtime]
    ILogger: type[tensorrt.ILogger]
    ProfilingVerbosity: type[tensorrt.ProfilingVerbosity]
    TensorIOMode: type[tensorrt.TensorIOMode]
    Dims: type[tensorrt.Dims]


def load_trt(trt_module: TrtModule | None = None) -> TrtModule:
    """``trt_module`` if given, else the installed bindings (clear HarnessError without them)."""
    if trt_module is not None:
        return trt_module
    load_tensorrt()
    import tensorrt

    module: TrtModule = tensorrt  # checked against the protocol where the stubs type the module
    return module


# Without a timing cache every build times every layer from scratch.
DISABLE_TIMING_CACHE = "DISABLE_TIMING_CACHE"
_CACHE_FLAGS = frozenset(
    (EDITABLE_TIMING_CACHE, ERROR_ON_TIMING_CACHE_MISS, DISABLE_TIMING_CACHE, DISABLE_COMPILATION_CACHE)
)

OPTION_DEFAULTS: dict[str, Any] = {
    "tf32": True,  # TensorRT's own default; recorded either way
    "builder_optimization_level": 3,
    "avg_timing_iterations": 1,
}


@dataclass(frozen=True)
class BuildSettings:
    """What one build asks of TensorRT, as names and numbers only."""

    version: TrtVersion
    mode: str
    network_flags: tuple[str, ...]
    builder_flags: tuple[str, ...]
    tf32: bool
    optimization_level: int
    avg_timing_iterations: int
    # One engine for a batch sweep: the optimization profile over the inputs' batch axis.
    batch_profile: BatchProfile | None = None

    def kernel_options(self) -> dict[str, Any]:
        """The options that change which kernels a build may pick (cache provenance).

        Cache-handling flags (editable, error-on-miss, disabled) are left out:
        they change how a cache is used, not which tactics exist. The batch
        profile is in (TensorRT tunes for its shapes), only when there is one,
        so caches of static builds stay valid.
        """
        options: dict[str, Any] = {
            "mode": self.mode,
            "network_flags": list(self.network_flags),
            "builder_flags": [f for f in self.builder_flags if f not in _CACHE_FLAGS],
            "tf32": self.tf32,
            "builder_optimization_level": self.optimization_level,
            "avg_timing_iterations": self.avg_timing_iterations,
        }
        if self.batch_profile is not None:
            options["batch_profile"] = self.batch_profile.to_json()
        return options

    @property
    def editable_cache(self) -> bool:
        """Whether the build's timing cache is editable (``EDITABLE_TIMING_CACHE``): only such a
        cache has its keys listed (``queryKeys``) and its selections written and checked."""
        return EDITABLE_TIMING_CACHE in self.builder_flags

    def to_json(self) -> dict[str, Any]:
        return {
            "tensorrt_version": str(self.version),
            "mode": self.mode,
            "network_flags": list(self.network_flags),
            "builder_flags": list(self.builder_flags),
            "tf32": self.tf32,
            "builder_optimization_level": self.optimization_level,
            "avg_timing_iterations": self.avg_timing_iterations,
            "batch_profile": None if self.batch_profile is None else self.batch_profile.to_json(),
        }


def build_settings(
    version: TrtVersion,
    mode: str,
    options: Mapping[str, Any],
    *,
    timing_cache: bool,
    editable: bool,
    error_on_cache_miss: bool,
    batch_profile: BatchProfile | None = None,
) -> BuildSettings:
    """Validate builder options and derive the flag names; refuses what ``version`` cannot do."""
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise HarnessError(
            f"unknown tensorrt builder option(s) {', '.join(unknown)}; valid: {', '.join(OPTION_DEFAULTS)}"
        )
    merged = {**OPTION_DEFAULTS, **options}
    tf32 = merged["tf32"]
    level = merged["builder_optimization_level"]
    iterations = merged["avg_timing_iterations"]
    if not isinstance(tf32, bool):
        raise HarnessError(f"tensorrt option tf32={tf32!r}; expected true or false")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 5:
        raise HarnessError(f"tensorrt option builder_optimization_level={level!r}; expected 0..5")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= 1000:
        raise HarnessError(f"tensorrt option avg_timing_iterations={iterations!r}; expected an integer from 1 to 1000")
    if error_on_cache_miss and not timing_cache:
        raise HarnessError("error-on-cache-miss needs a timing cache; it cannot be combined with disabling the cache")
    names = builder_flag_names(
        version,
        mode,
        tf32=tf32,
        editable_timing_cache=timing_cache and editable,
        error_on_cache_miss=error_on_cache_miss,
    )
    if not timing_cache:
        names = (*names, DISABLE_TIMING_CACHE)
    return BuildSettings(version, mode, network_flag_names(mode), names, tf32, level, iterations, batch_profile)


_SEVERITY_TAGS = {"INTERNAL_ERROR": "F", "ERROR": "E", "WARNING": "W", "INFO": "I", "VERBOSE": "V"}


class LogCapture:
    """Everything a TensorRT logger received, as trtexec-style text plus the problems."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def record(self, severity: str, message: str) -> None:
        tag = _SEVERITY_TAGS.get(severity, "?")
        self.lines.append(f"[{tag}] [TRT] {message}")
        if severity in ("INTERNAL_ERROR", "ERROR"):
            self.problems.append(message)
        elif severity == "WARNING":
            self.warnings.append(message)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# TensorRT keeps the first ILogger handed to createInferBuilder/createInferRuntime and
# ignores every later one ("the current new logger is ignored"), so a second build in one
# process would log into the first build's capture. One logger per loaded TensorRT module,
# whose sink is switched per build (capture_log), is what TensorRT actually talks to.
_LOGGERS: dict[int, tuple[object, tensorrt.ILogger]] = {}
_SINKS: list[LogCapture] = []
_LOCK = threading.Lock()
_LEVELS = {"INTERNAL_ERROR": logging.CRITICAL, "ERROR": logging.ERROR, "WARNING": logging.WARNING}
_log = logging.getLogger("harness.tensorrt")


def _deliver(severity: str, message: str) -> None:
    with _LOCK:
        sink = _SINKS[-1] if _SINKS else None
    if sink is not None:
        sink.record(severity, message)
    elif severity in _LEVELS:  # outside any build or run: errors and warnings still show
        _log.log(_LEVELS[severity], "%s", message)


def process_logger(trt: TrtModule) -> tensorrt.ILogger:
    """The one ``trt.ILogger`` of this process for ``trt``; it hands every message to the
    innermost :func:`capture_log`.

    The class must derive from the loaded module's ``ILogger`` (a pybind11
    trampoline), hence it is created here rather than at import time.
    """
    with _LOCK:
        known = _LOGGERS.get(id(trt))
        if known is None:
            base: Any = trt.ILogger

            class ProcessLogger(base):  # type: ignore[misc]  # the loaded module's ILogger: a class known at run time only
                def __init__(self) -> None:
                    base.__init__(self)

                def log(self, severity: tensorrt.ILogger.Severity, msg: str) -> None:
                    _deliver(severity.name, msg)

            # The module is kept with its logger so that its id is never reused.
            known = (trt, ProcessLogger())
            _LOGGERS[id(trt)] = known
        return known[1]


@contextmanager
def capture_log(trt: TrtModule) -> Iterator[LogCapture]:
    """Everything TensorRT logs while the block runs (builds and runs are sequential)."""
    process_logger(trt)
    capture = LogCapture()
    with _LOCK:
        _SINKS.append(capture)
    try:
        yield capture
    finally:
        with _LOCK:
            _SINKS.remove(capture)


def set_builder_flags(trt: TrtModule, config: tensorrt.IBuilderConfig, settings: BuildSettings) -> None:
    """Apply ``settings`` to a builder config by flag name (unknown names are refused)."""
    members = trt.BuilderFlag.__members__
    for name in settings.builder_flags:
        if name not in members:
            raise HarnessError(
                f"BuilderFlag.{name} does not exist in the installed TensorRT {installed_version(trt)} "
                f"(the settings are for {settings.version}); valid names: "
                + ", ".join(sorted(members))
            )
        config.set_flag(members[name])
    if not settings.tf32 and TF32 in members:
        config.clear_flag(members[TF32])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    config.builder_optimization_level = settings.optimization_level
    config.avg_timing_iterations = settings.avg_timing_iterations


def add_batch_profile(
    trt: TrtModule,
    builder: tensorrt.Builder,
    config: tensorrt.IBuilderConfig,
    inputs: Sequence[TensorSpec],
    profile: BatchProfile,
) -> dict[str, list[list[int]]]:
    """Add the one optimization profile of a batch sweep; returns input -> [min, opt, max] shapes.

    Every input whose batch dimension the ONNX export left dynamic (-1) ranges
    over ``profile.min`` to ``profile.max`` and is tuned for ``profile.opt``;
    an input without a dynamic dimension needs no range. A dynamic dimension
    other than the batch cannot be given a range from a batch sweep, so it is
    refused, as is a profile TensorRT rejects (``add_optimization_profile``
    answers -1).
    """
    shapes: dict[str, list[list[int]]] = {}
    optimization_profile = builder.create_optimization_profile()
    for spec in inputs:
        dynamic = [i for i, d in enumerate(spec.shape) if d == -1]
        if not dynamic:
            continue
        if dynamic != [profile.dim]:
            raise HarnessError(
                f"input {spec.name!r} of shape {list(spec.shape)} has dynamic dimension(s) {dynamic}; a batch "
                f"profile gives a range to dimension {profile.dim} only"
            )
        sizes = [list(profile.shape(spec.shape, n)) for n in (profile.min, profile.opt, profile.max)]
        optimization_profile.set_shape(spec.name, *(trt.Dims(shape) for shape in sizes))
        shapes[spec.name] = sizes
    if not shapes:
        raise HarnessError(
            f"a batch profile {profile.to_json()} was asked for, but no input has a dynamic batch dimension"
        )
    if config.add_optimization_profile(optimization_profile) < 0:
        raise HarnessError(f"TensorRT refused the optimization profile {shapes} (input -> [min, opt, max] shapes)")
    return shapes


@dataclass
class BuilderRun:
    """The products of one builder invocation.

    ``cache`` is the build's timing cache when it is editable (None without a
    cache or with a non-editable one, whose keys are never listed: ``queryKeys``
    is unconfirmed there); ``cache_bytes`` is the serialized cache either way.
    """

    plan: bytes
    cache: tensorrt.ITimingCache | None
    cache_bytes: bytes
    capture: LogCapture
    selection_messages: list[str]


def run_builder(
    trt: TrtModule,
    onnx_bytes: bytes,
    settings: BuildSettings,
    *,
    base_cache: bytes | None,
    enforced: TimingCache | None,
    ignore_mismatch: bool,
    inputs: Sequence[TensorSpec] = (),
) -> BuilderRun:
    """Parse the ONNX into a network, build it, and return the plan with cache and log.

    With a batch profile in ``settings`` the ONNX must have a dynamic batch
    axis; ``inputs`` (the export's input specs) get the profile's range.

    With ``base_cache`` (serialized ``ITimingCache`` bytes) the build starts
    from that cache; ``enforced`` (the JSON cache, every entry a selection
    to keep) then rewrites it so it says exactly what the
    JSON cache says: every JSON entry is pushed with ``update`` and every key
    the JSON lacks is deleted (a NaN time deletes), so such layers are timed
    again, or fail the build under ``ERROR_ON_TIMING_CACHE_MISS``. Enforcing
    needs the editable cache (``settings.editable_cache``); it is refused
    otherwise. After a build every selected key is looked up in the config's
    cache (``query``) and compared with the selection, since the flag has not
    stopped re-timing on every TensorRT version (:func:`moved_selections`);
    the engine's layers are checked too, once it is inspected
    (:func:`~harness.engines.tensorrt.cache_bridge.check_pinned_layers`).
    """
    if enforced is not None and not settings.editable_cache:
        raise HarnessError(
            f"enforcing a timing cache's tactic selections needs BuilderFlag.{EDITABLE_TIMING_CACHE}; "
            f"the build's flags are {', '.join(settings.builder_flags) or 'none'}"
        )
    with capture_log(trt) as capture:
        logger = process_logger(trt)
        builder = trt.Builder(logger)
        flags = flag_bits(
            trt.NetworkDefinitionCreationFlag.__members__, settings.network_flags, "NetworkDefinitionCreationFlag"
        )
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(onnx_bytes):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise HarnessError("TensorRT's ONNX parser rejected the exported model:\n  " + "\n  ".join(errors))
        config = builder.create_builder_config()
        set_builder_flags(trt, config, settings)
        if settings.batch_profile is not None:
            add_batch_profile(trt, builder, config, inputs, settings.batch_profile)
        selection_messages: list[str] = []
        use_cache = DISABLE_TIMING_CACHE not in settings.builder_flags
        if use_cache:
            cache = config.create_timing_cache(base_cache or b"")
            if enforced is not None:
                selection_messages = _enforce(trt, cache, enforced)
            if not config.set_timing_cache(cache, ignore_mismatch):
                raise HarnessError(
                    "TensorRT refused the timing cache: it was recorded on another device or TensorRT "
                    "version. Rebuild the cache here, or ignore the mismatch (--ignore-mismatch)"
                )
        host_plan = builder.build_serialized_network(network, config)
    if host_plan is None:
        details = "\n  ".join(capture.problems[-20:]) or "(no error was logged)"
        raise HarnessError(f"TensorRT failed to build the engine ({settings.mode}):\n  {details}")
    final_cache = config.get_timing_cache() if use_cache else None
    if final_cache is not None and enforced is not None:
        moved = moved_selections(
            final_cache, enforced, trt, error_on_miss=ERROR_ON_TIMING_CACHE_MISS in settings.builder_flags
        )
        if moved:
            raise selections_not_kept(settings.mode, moved)
    cache_bytes = bytes(final_cache.serialize()) if final_cache is not None else b""
    editable = final_cache if settings.editable_cache else None
    return BuilderRun(bytes(host_plan), editable, cache_bytes, capture, selection_messages)


def _enforce(trt: TrtModule, cache: tensorrt.ITimingCache, enforced: TimingCache) -> list[str]:
    wanted = {key.lower() for key in enforced.query_keys()}
    for key in cache.queryKeys():
        if str(key).lower() not in wanted:
            cache.update(key, trt.TimingCacheValue(0, math.nan))
    return apply_selections(cache, enforced, trt)


def layer_timings(
    parsed: ParsedLog,
    final_entries: list[CacheEntry],
    known_keys: set[str],
    joined: Sequence[Joined[ParsedLayer]],
    layers: Sequence[InspectedLayer],
    keyed_layers: set[str],
) -> list[LayerTiming]:
    """Autotuned ops of the log, then the cache's other entries.

    A key the builder did not autotune in this run but that the JSON cache
    held before (``known_keys``, lower case) was served by the timing cache;
    its layer name and candidates come from that entry. Any other key was
    created by this build without a log block, and is reported as timed.
    An op the log gives no key (no editable cache, or a Cask layer) is
    reported with its measured candidates and the tactic the engine layer it
    joins uses (``joined``), unless that layer has a key (``keyed_layers``:
    engine layers joined to a keyed op) and so is reported by it.
    """
    timed = parsed.by_key()
    timings = [
        LayerTiming(
            layer=p.layer,
            key=str(p.key),
            candidates=p.candidates,
            chosen=p.selected_name or str(p.selected_hash),
            chosen_hash=str(p.selected_hash),
            from_cache=False,
        )
        for p in timed.values()
    ]
    timings += [
        LayerTiming(
            layer=e.layer,
            key=e.key,
            candidates=e.candidates,
            chosen=e.tactic,
            chosen_hash=e.tactic_hash,
            from_cache=e.key.lower() in known_keys,
        )
        for e in final_entries
        if e.key.lower() not in timed
    ]
    keyed_layers = keyed_layers | {name for item in joined if item.op.key is not None for name in item.layers}
    by_name = {layer.name: layer for layer in layers}
    for item in joined:
        if item.op.key is not None or not item.op.candidates or keyed_layers.intersection(item.layers):
            continue
        chosen, chosen_hash = kept_tactic(item.op, by_name[item.layers[0]] if item.layers else None)
        timings.append(LayerTiming(item.op.layer, "", item.op.candidates, chosen, chosen_hash, item.op.from_cache))
    return timings


def kept_tactic(op: ParsedLayer, layer: InspectedLayer | None) -> tuple[str, str]:
    """(kernel name, hash) the engine layer joined to a keyless op uses; "" where unknown.

    The inspector names the kernel; its hash is the layer's ``TacticValue``
    (Cask layers), else the hash of the one candidate of that name in the
    op's table. Several candidates may share a kernel name (different tile
    parameters): then the hash is unknown, never guessed.
    """
    if layer is None or not layer.tactic_name:
        return "", ""
    if layer.tactic_value:
        return layer.tactic_name, layer.tactic_value
    hashes = {c.tactic_hash for c in op.candidates if c.tactic == layer.tactic_name}
    return layer.tactic_name, hashes.pop() if len(hashes) == 1 else ""
