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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from harness.cache.timing_cache import TimingCache, check_compatible
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import Backend, BuildConfig, BuildLog, Engine, engine_inputs
from harness.engines.saved import write_engine_dir
from harness.fileio import check_writable, json_bytes, locked
from harness.globalstate import preserves_global_state
from harness.limits import MAX_REBUILDS, check_int

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec

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


def compile_graph(spec: ModelSpec, config: BuildConfig, backend: Backend) -> CompiledGraph:
    """The typed graph for ``config.mode``, refused early if ``backend`` cannot build that mode."""
    backend.check_mode(config.mode)
    return compile_for_mode(spec, config.mode, config.explicit_path, config.autocast)


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
) -> BuildResult:
    """Compile and build once, then add the new timings to ``cache_path``.

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
    elif path is not None and path.exists():
        cache = load_cache(path, backend, config)
    else:
        cache = TimingCache(provenance)
    compiled = compile_graph(spec, config, backend)
    engine, log = backend.build(compiled, config, cache)
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
    compiled = compile_graph(spec, config, backend)
    fingerprints: list[str] = []
    per_build: list[dict[str, str]] = []
    first: tuple[torch.Tensor, ...] | None = None
    mismatches: list[int] = []
    for index in range(times):
        # Backends never change the cache they read, so every build starts from the same one.
        cache = base if base is not None else TimingCache(backend.provenance(config))
        engine, _ = backend.build(compiled, config, cache)
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
