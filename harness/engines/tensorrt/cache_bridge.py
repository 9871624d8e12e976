"""Move decisions between TensorRT's binary ``ITimingCache`` and the neutral JSON cache.

TensorRT's cache knows keys and (tactic hash, time) values but not which layer
a key belongs to nor what the alternatives were; the verbose build log knows
those. Exporting joins the two. Importing goes through ``ITimingCache.update``,
which only replaces existing entries (editable caches, TensorRT >= 10.8): the
binary cache must come from a build of the same network with
``BuilderFlag.EDITABLE_TIMING_CACHE``, and a key it lacks is reported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from harness.cache.timing_cache import CacheEntry, Provenance, TimingCache, normalize_hash
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


def built_tactics(trt_cache: tensorrt.ITimingCache) -> dict[str, str]:
    """Lower-case key -> tactic hash of every entry of a binary cache (invalid values refused)."""
    tactics = {}
    for trt_key in trt_cache.queryKeys():
        key = str(trt_key)
        tactics[key.lower()] = _valid_value(key, trt_cache.query(trt_key))[0]
    return tactics


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


def moved_selections(built: dict[str, str], cache: TimingCache, *, error_on_miss: bool) -> list[str]:
    """One line per key of ``cache`` whose selected tactic the build changed or that the built
    cache lacks, and (``error_on_miss``) per key ``cache`` lacks.

    ``built`` is :func:`built_tactics` of the cache after the build. TensorRT
    11.0 re-timed layers despite ``ERROR_ON_TIMING_CACHE_MISS`` (NVIDIA's
    TensorRT-Model-Connect, PR #449), so the flag alone proves nothing: the
    tactics the build ended with are compared with the cache's selections, key by
    key. A selected key the built cache lacks was never applied (``update`` refuses
    a key TensorRT's cache does not hold), so nothing says the build used it.
    Entries that are no TensorRT key (``op:`` entries of a trtexec build) can
    never be applied and are reported by :func:`apply_selections` instead.
    """
    lines = []
    selected = {entry.key.lower(): entry for entry in cache.entries()}
    for key, entry in selected.items():
        actual = built.get(key)
        where = f"layer {entry.layer!r} (key {entry.key}): the cache selects {entry.tactic} ({entry.tactic_hash})"
        if actual is None and _KEY.match(key):
            lines.append(f"{where}, but the built cache has no such key, so the selection was never applied")
        elif actual is not None and normalize_hash(actual) != normalize_hash(entry.tactic_hash):
            lines.append(f"{where}, built {actual}")
    if error_on_miss:
        lines += [
            f"key {key}: not in the timing cache, yet the build timed and kept tactic {tactic}"
            for key, tactic in built.items()
            if key not in selected
        ]
    return lines


def _selected_kernel(entry: CacheEntry) -> str | None:
    """The kernel name an entry selects, when its candidates tell it (else it is a bare hash)."""
    names = {c.tactic for c in entry.candidates}
    if entry.tactic in names:
        return entry.tactic
    wanted = normalize_hash(entry.tactic_hash)
    by_hash = {c.tactic for c in entry.candidates if normalize_hash(c.tactic_hash) == wanted}
    return by_hash.pop() if len(by_hash) == 1 else None


def moved_kernels(cache: TimingCache, keyed_layers: Iterable[tuple[str, str, str]]) -> list[str]:
    """One line per engine layer whose kernel (the inspector's ``TacticName``) is not the one
    its key's entry in ``cache`` selects.

    ``keyed_layers`` are (layer, key, kernel) of the built engine's keyed
    layers. This does not rely on the timing cache, which :func:`moved_selections`
    does: whether a layer TensorRT re-timed shows up in ``get_timing_cache()``
    is unconfirmed on TensorRT 11. A layer is compared only where both sides
    are known: the entry names its kernel, and the layer's kernel is one of that
    key's measured candidates (a layer joined to a key may also run kernels no
    table lists, such as Myelin's generated ``__myl_*`` kernels). Variants that
    share a kernel name cannot be told apart here.
    """
    selected = {entry.key.lower(): entry for entry in cache.entries()}
    lines = []
    for layer, key, kernel in keyed_layers:
        entry = selected.get(key.lower())
        if entry is None or not kernel:
            continue
        wanted = _selected_kernel(entry)
        if wanted is not None and kernel != wanted and kernel in {c.tactic for c in entry.candidates}:
            lines.append(
                f"layer {layer!r} (key {entry.key}): the cache selects {wanted} ({entry.tactic_hash}), "
                f"the engine runs {kernel}"
            )
    return lines


def selections_not_kept(mode: str, lines: list[str]) -> HarnessError:
    """The error of a build whose tactics moved from its cache's selections: its engine must not be used."""
    return HarnessError(
        f"TensorRT did not keep the timing cache's tactics ({mode}); the engine is discarded:\n  " + "\n  ".join(lines)
    )
