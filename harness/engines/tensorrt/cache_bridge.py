"""Move decisions between TensorRT's binary ``ITimingCache`` and the neutral JSON cache.

TensorRT's cache knows keys and (tactic hash, time) values but not which layer
a key belongs to nor what the alternatives were; the verbose build log knows
those. Exporting joins the two. Importing goes through ``ITimingCache.update``,
which only replaces existing entries (editable caches, TensorRT >= 10.8): the
binary cache must come from a build of the same network with
``BuilderFlag.EDITABLE_TIMING_CACHE``, and a key it lacks is reported.

After a build from such a cache, the selections are verified twice: key by key
in TensorRT's cache (:func:`moved_selections`), and layer by layer in the
engine (:func:`check_pinned_layers`), where a layer whose kernel cannot be tied
to one measured candidate of its key is *unverifiable*, never kept or moved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from harness.cache.timing_cache import (
    CacheEntry,
    Candidate,
    Provenance,
    TimingCache,
    normalize_hash,
)
from harness.engines.tensorrt.inspector import InspectedLayer
from harness.engines.tensorrt.log_parser import ParsedLog
from harness.engines.tensorrt.versions import TrtApi, load_tensorrt
from harness.errors import HarnessError

if TYPE_CHECKING:
    import tensorrt

BACKEND = "tensorrt"
# Layer name for a key the build log does not mention (e.g. an entry carried
# over from an older cache that this build did not time).
UNKNOWN_LAYER = "(not in build log)"
_KEY = re.compile(r"^0x[0-9a-fA-F]{32}$")
# ITimingCache.query answers a key it lacks with this hash (UINT64_MAX): never a tactic.
INVALID_TACTIC_HASH = (1 << 64) - 1


def _valid_value(key: str, value: tensorrt.TimingCacheValue) -> tuple[str, float]:
    """The (hash, time) of a binary-cache value, refused when TensorRT marks it invalid."""
    if value.tacticHash == INVALID_TACTIC_HASH:
        raise HarnessError(
            f"TensorRT timing cache: key {key} has the invalid tactic hash 0x{INVALID_TACTIC_HASH:x} "
            "(TensorRT's answer for an absent or unusable entry)"
        )
    if not math.isfinite(value.timingMSec) or value.timingMSec < 0:
        raise HarnessError(f"TensorRT timing cache: key {key} has an invalid time {value.timingMSec!r}")
    return f"0x{value.tacticHash:x}", value.timingMSec


def selected_hash(trt_cache: tensorrt.ITimingCache, key: str, trt_module: TrtApi | None = None) -> str | None:
    """The tactic hash ``trt_cache`` selects for ``key`` (``cache.query``), None when it holds no
    such key (TensorRT answers an absent key with the invalid hash); an invalid time is refused."""
    trt = load_tensorrt(trt_module)
    value = trt_cache.query(trt.TimingCacheKey.parse(key))
    if value.tacticHash == INVALID_TACTIC_HASH:
        return None
    return _valid_value(key, value)[0]


def export_trt_cache(
    trt_cache: tensorrt.ITimingCache, parsed_log: ParsedLog, provenance: Provenance
) -> TimingCache:
    """The neutral cache for every key in ``trt_cache``, named and annotated from the log.

    The selected hash and time come from the binary cache (what the next build
    will actually read); the layer name and candidates come from the log.
    """
    by_key = parsed_log.by_key()
    cache = TimingCache(provenance)
    for trt_key in trt_cache.queryKeys():
        key = str(trt_key)
        tactic_hash, time_ms = _valid_value(key, trt_cache.query(trt_key))
        parsed = by_key.get(key.lower())
        if parsed is None:
            entry = CacheEntry(key, UNKNOWN_LAYER, tactic_hash, tactic_hash, time_ms)
        else:
            entry = CacheEntry(
                key=key,
                layer=parsed.layer,
                tactic=parsed.name_of(tactic_hash) or tactic_hash,
                tactic_hash=tactic_hash,
                time_ms=time_ms,
                candidates=parsed.candidates,
            )
        cache.update(entry)
    return cache


def apply_selections(
    trt_cache: tensorrt.ITimingCache, cache: TimingCache, trt_module: TrtApi | None = None
) -> list[str]:
    """Write every JSON entry into ``trt_cache``; returns one message per entry it refused.

    All entries are pushed, whether a user pinned them (``CacheEntry.pinned``)
    or a build recorded them, so that TensorRT's cache says exactly what the
    JSON says: every entry is a selection the build must keep. ``trt_module`` replaces ``import tensorrt``
    (tests pass a small namespace).
    """
    if cache.provenance.backend != BACKEND:
        raise HarnessError(
            f"timing cache is for backend {cache.provenance.backend!r}, not {BACKEND!r}; "
            "its keys mean nothing to TensorRT"
        )
    trt = load_tensorrt(trt_module)
    errors: list[str] = []
    for entry in cache.entries():
        where = f"layer {entry.layer!r} (key {entry.key})"
        if not _KEY.match(entry.key):
            errors.append(f"{where}: not a TensorRT cache key (expected 0x and 32 hex digits)")
            continue
        if not entry.hash_known:
            errors.append(f"{where}: its kernel {entry.tactic} is known by name only, so TensorRT cannot be told to select it")
            continue
        key = trt.TimingCacheKey.parse(entry.key)
        value = trt.TimingCacheValue(int(entry.tactic_hash, 16), entry.time_ms)
        if not trt_cache.update(key, value):
            errors.append(
                f"{where}: TensorRT refused the update; the key is absent from its cache (build "
                "once with EDITABLE_TIMING_CACHE to record it) or the value is invalid"
            )
    return errors


def moved_selections(
    trt_cache: tensorrt.ITimingCache, cache: TimingCache, trt_module: TrtApi | None = None, *, error_on_miss: bool
) -> list[str]:
    """One line per key of ``cache`` whose selection TensorRT's cache after the build does not
    hold, and (``error_on_miss``) per key of TensorRT's cache that ``cache`` lacks.

    ``trt_cache`` is the build's editable timing cache (``get_timing_cache()``
    of its config); each selected key is looked up with ``query``. TensorRT
    11.0 re-timed layers despite ``ERROR_ON_TIMING_CACHE_MISS`` (NVIDIA's
    TensorRT-Model-Connect, PR #449, compares the cache after the build the
    same way), so the flag alone proves nothing. A selected key the built cache
    lacks was never applied (``update`` refuses a key TensorRT's cache does not
    hold), so nothing says the build used it. Entries that are no TensorRT key
    (``op:`` entries of a trtexec build) can never be applied and are reported
    by :func:`apply_selections` instead.
    """
    lines = []
    for entry in cache.entries():
        if not _KEY.match(entry.key):
            continue
        actual = selected_hash(trt_cache, entry.key, trt_module)
        where = f"layer {entry.layer!r} (key {entry.key}): the cache selects {entry.tactic} ({entry.tactic_hash})"
        if actual is None:
            lines.append(f"{where}, but the built cache has no such key, so the selection was never applied")
        elif normalize_hash(actual) != normalize_hash(entry.tactic_hash):
            lines.append(f"{where}, built {actual}")
    if error_on_miss:
        selected = {entry.key.lower() for entry in cache.entries()}
        for trt_key in trt_cache.queryKeys():
            key = str(trt_key).lower()
            if key not in selected:
                tactic = _valid_value(key, trt_cache.query(trt_key))[0]
                lines.append(f"key {key}: not in the timing cache, yet the build timed and kept tactic {tactic}")
    return lines


Verdict = Literal["kept", "moved", "unverifiable"]


@dataclass(frozen=True)
class PinCheck:
    """What the engine says about one keyed layer's selected tactic; ``detail`` says why."""

    layer: str
    key: str
    verdict: Verdict
    detail: str

    def line(self) -> str:
        return f"layer {self.layer!r} (key {self.key}): {self.detail}"


def check_pinned_layers(
    cache: TimingCache, keyed_layers: Iterable[tuple[InspectedLayer, str]]
) -> list[PinCheck]:
    """Kept, moved or unverifiable, for every engine layer whose key ``cache`` selects a tactic for.

    ``keyed_layers`` are the built engine's layers with the key each was joined
    to; layers of keys ``cache`` lacks are not checked (:func:`moved_selections`
    reports those keys). A layer is compared with its key's selection only
    through the one measured candidate it runs: the candidate of its
    ``TacticValue`` (Cask layers), else the one candidate of its kernel name
    (Myelin layers, every TensorRT 11 layer). Where no candidate or several fit
    (a kernel no table lists, a tactic the key did not time, variants that
    share a kernel name) the layer is unverifiable, with the reason, never kept
    and never moved: the key's selection is then checked in TensorRT's cache only.
    """
    selected = {entry.key.lower(): entry for entry in cache.entries()}
    return [
        _check_layer(layer, key, selected[key.lower()])
        for layer, key in keyed_layers
        if key.lower() in selected
    ]


def _check_layer(layer: InspectedLayer, key: str, entry: CacheEntry) -> PinCheck:
    wanted = f"{entry.tactic} ({entry.tactic_hash or 'hash unknown'})"
    runs = _run_candidate(layer, entry.candidates) if entry.hash_known else "the cache knows its tactic by name only"
    if isinstance(runs, str):
        return PinCheck(layer.name, key, "unverifiable", f"unverifiable: {runs}; the cache selects {wanted}")
    if normalize_hash(runs.tactic_hash) == normalize_hash(entry.tactic_hash):
        return PinCheck(layer.name, key, "kept", f"the engine runs the selected {wanted}")
    return PinCheck(
        layer.name, key, "moved", f"the cache selects {wanted}, the engine runs {runs.tactic} ({runs.tactic_hash})"
    )


def _run_candidate(layer: InspectedLayer, candidates: Sequence[Candidate]) -> Candidate | str:
    """The measured candidate ``layer`` runs, or why no single one can be named."""
    if not candidates:
        return "the cache records no measured candidates for its key"
    if layer.tactic_value:
        wanted = normalize_hash(layer.tactic_value)
        by_hash = [c for c in candidates if normalize_hash(c.tactic_hash) == wanted]
        if by_hash:
            return by_hash[0]
        return (
            f"its tactic {layer.tactic_value} ({layer.tactic_name or 'no kernel name'}) is none of the "
            f"{len(candidates)} candidates its key measured"
        )
    if not layer.tactic_name:
        return "the engine names no kernel for it"
    named = [c for c in candidates if c.tactic == layer.tactic_name]
    if len(named) == 1:
        return named[0]
    if not named:
        return f"its kernel {layer.tactic_name} is none of the {len(candidates)} candidates its key measured"
    return (
        f"{len(named)} candidates its key measured are kernel {layer.tactic_name} "
        f"({', '.join(c.tactic_hash for c in named)}), and the engine does not say which one it runs"
    )


def selections_not_kept(mode: str, lines: list[str]) -> HarnessError:
    """The error of a build whose tactics moved from its cache's selections: its engine must not be used."""
    return HarnessError(
        f"TensorRT did not keep the timing cache's tactics ({mode}); the engine is discarded:\n  " + "\n  ".join(lines)
    )
