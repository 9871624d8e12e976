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
from typing import TYPE_CHECKING

from harness.cache.timing_cache import CacheEntry, Provenance, TimingCache
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
        value = trt_cache.query(trt_key)
        if not math.isfinite(value.timingMSec) or value.timingMSec < 0:
            raise HarnessError(
                f"TensorRT timing cache: key {key} has an invalid time {value.timingMSec!r}"
            )
        tactic_hash = f"0x{value.tacticHash:x}"
        parsed = by_key.get(key.lower())
        if parsed is None:
            entry = CacheEntry(key, UNKNOWN_LAYER, tactic_hash, tactic_hash, value.timingMSec)
        else:
            entry = CacheEntry(
                key=key,
                layer=parsed.layer,
                tactic=parsed.name_of(tactic_hash) or tactic_hash,
                tactic_hash=tactic_hash,
                time_ms=value.timingMSec,
                candidates=parsed.candidates,
            )
        cache.update(entry)
    return cache


def apply_pins(
    trt_cache: tensorrt.ITimingCache, cache: TimingCache, trt_module: TrtApi | None = None
) -> list[str]:
    """Write every JSON entry into ``trt_cache``; returns one message per entry it refused.

    All entries are pushed, pinned or not, so that TensorRT's cache says
    exactly what the JSON says. ``trt_module`` replaces ``import tensorrt``
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
        key = trt.TimingCacheKey.parse(entry.key)
        value = trt.TimingCacheValue(int(entry.tactic_hash, 16), entry.time_ms)
        if not trt_cache.update(key, value):
            errors.append(
                f"{where}: TensorRT refused the update; the key is absent from its cache (build "
                "once with EDITABLE_TIMING_CACHE to record it) or the value is invalid"
            )
    return errors
