"""Build orchestration: model + precision mode + backend + timing cache file -> engine + log.

:func:`build_engine` is ``harness build``: the cache file is read when it
exists (a corrupt or foreign cache stops the build before anything is
written), and written back atomically only when the build added entries.
:func:`rebuild` is ``harness rebuild``: the same build N times, reporting what
moved between builds (fingerprints, per-layer tactics, output bits). Without a
cache every build times from scratch, as two independent builds would; with a
cache holding every key and error-on-miss, every build takes each tactic from
the cache and must come out identical. (Every entry of a cache is a selection a
build keeps; "pinned" is only the mark ``harness cache pin`` leaves on an entry
a user chose by hand.)

Every step logs one DEBUG line on this module's logger (``harness -v`` shows
them): the timing cache read, each compiler phase (export, lowering, ...,
with its time), the typed graph (nodes, casts inserted, weights converted),
the engine build (backend, layers, cache hits, time) and the cache write.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from harness.cache.timing_cache import TimingCache, check_compatible
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import Backend, BuildConfig, BuildLog, Engine, engine_inputs
from harness.engines.saved import write_engine_dir
from harness.errors import HarnessError
from harness.fileio import check_writable, json_bytes, locked
from harness.globalstate import preserves_global_state
from harness.limits import MAX_REBUILDS, check_int

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec

logger = logging.getLogger(__name__)

BUILD_LOG_FILE = "build_log.json"


@dataclass
class BuildResult:
    engine: Engine
    log: BuildLog
    cache_path: Path | None
    cache_entries_added: int  # 0 also when the cache file was left as it was

    @property
    def cache_hits(self) -> int:
        return sum(1 for layer in self.log.layers if layer.from_cache)

    @property
    def cache_misses(self) -> int:
        """Layers that had to be timed (their key was not in the cache)."""
        return sum(1 for layer in self.log.layers if layer.candidates and not layer.from_cache)


def compile_graph(
    spec: ModelSpec, config: BuildConfig, backend: Backend, program: ExportedProgram | None = None
) -> CompiledGraph:
    """The typed graph for ``config.mode``, refused early if ``backend`` cannot build that mode
    (``program``: the spec's export, as :func:`~harness.engines.modes.compile_for_mode` takes it)."""
    backend.check_mode(config.mode)
    start = time.perf_counter()
    compiled = compile_for_mode(spec, config.mode, config.explicit_path, config.autocast, program)
    _log_compiled(spec.name, config.mode, compiled, time.perf_counter() - start)
    return compiled


def graph_for_build(
    spec: ModelSpec, config: BuildConfig, backend: Backend, program: ExportedProgram | None = None
) -> CompiledGraph:
    """What ``backend`` builds: :func:`compile_graph`'s typed graph, or, for an ONNX file
    (:mod:`harness.sources`) in a mode an ONNX backend takes the file as given, that file
    (:class:`~harness.engines.given_onnx.GivenOnnx`, which only the backends read)."""
    if getattr(spec, "source", None) is not None:
        backend.check_mode(config.mode)
        given = _given_graph(spec, config, backend)
        if given is not None:
            return given
    return compile_graph(spec, config, backend, program)


def _given_graph(spec: ModelSpec, config: BuildConfig, backend: Backend) -> CompiledGraph | None:
    """What an ONNX backend builds for an ONNX file's spec in a mode that takes the file as given
    (:class:`~harness.engines.given_onnx.GivenOnnx`, which stands for the typed graph there), None
    where the compiler's graph is built instead. A file that did not convert is refused here, with
    its reason, for every mode that needs the conversion."""
    from harness.sources import reference_outputs, route, source_of

    source = source_of(spec)
    if source is None:
        return None
    how = route(spec, backend.name, config.mode)
    if how == "graph":
        if source.conversion_error is not None:
            raise HarnessError(source.conversion_error)
        return None
    from harness.engines.given_onnx import (
        GivenOnnx,
        GivenReport,
        lowered,
        output_specs,
        structure_of,
    )

    assert source.onnx is not None
    data = source.onnx.data
    if how == "lowered":
        low = config.mode.low
        assert low is not None
        data = lowered(data, low, config.autocast.keep_io_types, source.onnx.where)
    outputs = reference_outputs(spec)
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    given = GivenOnnx(
        data,
        tuple(spec.example_inputs),
        structure_of(len(flat)),
        output_specs(source.onnx.output_names, flat),
        spec.batch_dim,
        GivenReport(),
    )
    return cast("CompiledGraph", given)


def _log_compiled(model: str, mode: str, compiled: CompiledGraph, seconds: float) -> None:
    """One DEBUG line per compiler phase, then one for the typed graph it produced."""
    for phase, phase_seconds in compiled.timings.items():
        if phase != "total":
            logger.debug("build: compile %s: %s (%.1f ms)", model, phase, phase_seconds * 1e3)
    report = compiled.report
    rules = ", ".join(f"{rule} {count}" for rule, count in report.counts().items())
    logger.debug(
        "build: compiled %s mode=%s: policy %s, %d nodes, %d casts inserted, %d weights converted, rules: %s (%.1f ms)",
        model,
        mode,
        compiled.policy,
        len(compiled.graph_module.graph.nodes),
        report.casts_inserted,
        report.weights_converted,
        rules or "none",
        seconds * 1e3,
    )


def _log_engine(log: BuildLog, seconds: float, what: str = "engine") -> None:
    hits = sum(1 for layer in log.layers if layer.from_cache)
    timed = sum(1 for layer in log.layers if layer.candidates and not layer.from_cache)
    logger.debug(
        "build: %s backend=%s mode=%s: %d layers, %d from the cache, %d timed, %d new cache entries (%.1f ms)",
        what,
        log.backend,
        log.mode,
        len(log.layers),
        hits,
        timed,
        len(log.new_entries),
        seconds * 1e3,
    )


def load_cache(path: str | os.PathLike[str], backend: Backend, config: BuildConfig) -> TimingCache:
    """Read and check a cache file (compatibility refused unless ``ignore_cache_mismatch``)."""
    cache = TimingCache.load(path)
    check_compatible(
        cache,
        backend.provenance(config),
        config.ignore_cache_mismatch,
        f"timing cache {os.fspath(path)}",
    )
    return cache


@preserves_global_state
def build_engine(
    spec: ModelSpec,
    config: BuildConfig,
    backend: Backend,
    cache_path: str | os.PathLike[str] | None = None,
    program: ExportedProgram | None = None,
) -> BuildResult:
    """Compile and build once, then add the new timings to ``cache_path``.

    ``program``: the spec's export, for a caller building one spec in several
    modes (:func:`~harness.engines.modes.compile_for_mode`); None: exported here.

    The cache is read before the (slow) compile, so a bad cache fails fast.
    New entries are merged into the file as it is *then*, under its lock, so
    two builds sharing one cache file both keep what they timed. A cache
    accepted with ``ignore_cache_mismatch`` is used read-only: timings made
    here never go into a file whose provenance names another configuration.
    """
    backend.check_mode(config.mode)
    if config.threads is not None:
        torch.set_num_threads(config.threads)  # restored on return (preserves_global_state)
    path = Path(cache_path) if cache_path is not None else None
    if path is not None:
        check_writable(path, "timing cache")
    provenance = backend.provenance(config)
    if config.disable_cache:
        cache = None
        logger.debug("build: timing cache disabled")
    elif path is not None and path.exists():
        cache = load_cache(path, backend, config)
        logger.debug("build: timing cache %s: %d entries read", path, len(cache))
    else:
        cache = TimingCache(provenance)
        logger.debug("build: timing cache %s: new, empty", path if path is not None else "(in memory)")
    compiled = graph_for_build(spec, config, backend, program)
    start = time.perf_counter()
    engine, log = backend.build(compiled, config, cache)
    for warning in compiled.report.warnings:  # asked of the compiler, changed nothing: said with the build
        log.warnings.append(warning)
        log.messages.append(warning)
    _log_engine(log, time.perf_counter() - start)
    new = log.new_entries if cache is not None and config.editable_cache else []
    foreign = cache is not None and bool(cache.provenance.mismatches(provenance))
    if foreign and new:
        log.messages.append(
            f"timing cache {path}: recorded for another configuration, used read-only; "
            f"{len(new)} new timing(s) were not written to it"
        )
    added = 0
    if new and path is not None and not foreign:
        with locked(path):
            current = load_cache(path, backend, config) if path.exists() else TimingCache(provenance)
            for entry in new:
                if current.query(entry.key) is None:  # another build may have timed it meanwhile
                    current.update(entry)
                    added += 1
            if added:
                current.save(path)
    if path is not None:
        logger.debug(
            "build: timing cache %s: %d new entries written%s",
            path,
            added,
            " (read-only: recorded for another configuration)" if foreign and new else "",
        )
    return BuildResult(engine, log, path, added)


def save_build(result: BuildResult, output: str | os.PathLike[str]) -> Path:
    """Write the engine directory with its ``build_log.json``, replaced as a whole."""
    return write_engine_dir(output, {**result.engine.files(), BUILD_LOG_FILE: json_bytes(result.log.to_json())})


@dataclass
class RebuildReport:
    model: str
    mode: str
    backend: str
    cache: str | None
    fingerprints: list[str]
    tactics: list[dict[str, str]]  # per build: layer -> tactic
    outputs_identical: bool
    output_mismatches: list[int] = field(
        default_factory=list
    )  # builds whose outputs differ from build 0

    @property
    def distinct_fingerprints(self) -> list[str]:
        return list(dict.fromkeys(self.fingerprints))

    @property
    def flipped(self) -> dict[str, list[str]]:
        """Layers whose tactic differed between builds, with every tactic seen (first-seen order)."""
        seen: dict[str, dict[str, None]] = {}
        for build in self.tactics:
            for layer, tactic in build.items():
                seen.setdefault(layer, {})[tactic] = None
        return {layer: list(tactics) for layer, tactics in seen.items() if len(tactics) > 1}

    @property
    def identical(self) -> bool:
        return len(self.distinct_fingerprints) == 1 and self.outputs_identical

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "backend": self.backend,
            "cache": self.cache,
            "builds": len(self.fingerprints),
            "fingerprints": self.fingerprints,
            "distinct_fingerprints": self.distinct_fingerprints,
            "flipped_layers": self.flipped,
            "outputs_identical": self.outputs_identical,
            "builds_with_different_outputs": self.output_mismatches,
            "identical": self.identical,
        }


@preserves_global_state
def rebuild(
    spec: ModelSpec,
    config: BuildConfig,
    backend: Backend,
    times: int,
    cache_path: str | os.PathLike[str] | None = None,
) -> RebuildReport:
    """Build ``times`` times from one compiled graph and compare the engines.

    Every build reads the same cache (a fresh empty one without
    ``cache_path``) and none writes it, so nothing one build times leaks into
    the next.
    """
    check_int(times, "--times", 2, MAX_REBUILDS)  # a comparison needs 2 builds; each is a full build
    backend.check_mode(config.mode)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    base = load_cache(cache_path, backend, config) if cache_path is not None else None
    compiled = graph_for_build(spec, config, backend)
    fingerprints: list[str] = []
    per_build: list[dict[str, str]] = []
    first: tuple[torch.Tensor, ...] | None = None
    mismatches: list[int] = []
    for index in range(times):
        # Backends never change the cache they read, so every build starts from the same one.
        cache = base if base is not None else TimingCache(backend.provenance(config))
        start = time.perf_counter()
        engine, log = backend.build(compiled, config, cache)
        _log_engine(log, time.perf_counter() - start, f"rebuild {index + 1}/{times}")
        fingerprints.append(engine.fingerprint())
        per_build.append({layer.name: layer.tactic for layer in engine.layers()})
        outputs = tuple(t.detach().cpu() for t in engine.run(*engine_inputs(engine, spec.example_inputs)))
        if first is None:
            first = outputs
        elif not _bits_equal(first, outputs):
            mismatches.append(index)
    return RebuildReport(
        model=spec.name,
        mode=config.mode,
        backend=backend.name,
        cache=None if cache_path is None else os.fspath(cache_path),
        fingerprints=fingerprints,
        tactics=per_build,
        outputs_identical=not mismatches,
        output_mismatches=mismatches,
    )


def _bits_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bit-for-bit equality of output tuples (NaNs with equal payloads count as equal)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():
            x, y = (t.contiguous().reshape(-1).view(torch.uint8) for t in (x, y))
        if not torch.equal(x, y):
            return False
    return True
