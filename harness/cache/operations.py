"""What users do with timing caches: diff, pin, merge, and verify an engine against one.

Every function works on :class:`TimingCache` objects in memory and raises
:class:`HarnessError` before changing anything when the request is invalid, so
a caller that saves only after success never writes a half-edited cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from harness.cache.timing_cache import (
    CacheEntry,
    Candidate,
    TimingCache,
    check_compatible,
    normalize_hash,
)
from harness.errors import HarnessError

DiffStatus = Literal["same", "changed", "only-a", "only-b"]

# Long caches (hundreds of layers) would drown the actual error; the full list
# is one `harness cache show` away.
_MAX_LISTED = 40
_T = TypeVar("_T")


@dataclass(frozen=True)
class LayerDiff:
    """One key compared across two caches. ``same`` means the same tactic hash or, where
    a side knows its kernel by name only (an unknown hash: a keyless TensorRT layer whose
    kernel name several measured variants share), the same kernel name. Timings are
    expected to differ between runs and do not count."""

    layer: str
    key: str
    status: DiffStatus
    tactic_a: str | None
    tactic_hash_a: str | None
    time_ms_a: float | None
    tactic_b: str | None
    tactic_hash_b: str | None
    time_ms_b: float | None


def diff(a: TimingCache, b: TimingCache) -> list[LayerDiff]:
    """Per-key comparison in ``a``'s order, then keys only ``b`` has in ``b``'s order."""
    rows: list[LayerDiff] = []
    for ea in a.entries():
        eb = b.query(ea.key)
        if eb is None:
            status: DiffStatus = "only-a"
        elif same_decision(ea, eb):
            status = "same"
        else:
            status = "changed"
        rows.append(LayerDiff(ea.layer, ea.key, status, *_side(ea), *_side(eb)))
    rows += [
        LayerDiff(eb.layer, eb.key, "only-b", *_side(None), *_side(eb))
        for eb in b.entries()
        if a.query(eb.key) is None
    ]
    return rows


def same_decision(a: CacheEntry, b: CacheEntry) -> bool:
    """The same tactic hash; by kernel name where either hash is unknown (never "0", which
    is what an empty hash would normalize to)."""
    if a.hash_known and b.hash_known:
        return normalize_hash(a.tactic_hash) == normalize_hash(b.tactic_hash)
    return a.tactic == b.tactic


def _side(entry: CacheEntry | None) -> tuple[str | None, str | None, float | None]:
    if entry is None:
        return None, None, None
    return entry.tactic, entry.tactic_hash, entry.time_ms


def pin(cache: TimingCache, layer: str, tactic: str) -> CacheEntry:
    """Select ``tactic`` (a candidate's name or hash) for ``layer`` and mark it pinned.

    ``layer`` is a layer name or, when one layer owns several keys, a key.
    Only a recorded candidate can be pinned: the builder would reject a tactic
    it never offered for that key.
    """
    entry = _find_entry(cache, layer)
    candidate = _find_candidate(entry, tactic)
    pinned = _select(entry, candidate.tactic, candidate.tactic_hash, candidate.time_ms)
    cache.update(pinned)
    return pinned


def _select(entry: CacheEntry, tactic: str, tactic_hash: str, time_ms: float) -> CacheEntry:
    return replace(entry, tactic=tactic, tactic_hash=tactic_hash, time_ms=time_ms, pinned=True)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        shown += f", ... ({len(names) - _MAX_LISTED} more; `harness cache show` lists all)"
    return shown



def _only(found: Sequence[_T], ambiguous: Callable[[Sequence[_T]], str]) -> _T | None:
    """The one item of ``found`` (None: there is none); refused with ``ambiguous`` when several."""
    if len(found) > 1:
        raise HarnessError(ambiguous(found))
    return found[0] if found else None

def _find_entry(cache: TimingCache, layer: str) -> CacheEntry:
    found = _only(
        cache.by_layer(layer),
        lambda matches: f"layer {layer!r} has {len(matches)} cache entries (keys "
        f"{', '.join(e.key for e in matches)}); pin one of them by key: --layer KEY=TACTIC",
    )
    if found is None:
        found = cache.query(layer)
    if found is not None:
        return found
    names = sorted({e.layer for e in cache.entries()})
    raise HarnessError(
        f"no layer or key {layer!r} in the timing cache; valid layers: {_listing(names)}"
    )


def _find_candidate(entry: CacheEntry, tactic: str) -> Candidate:
    where = f"layer {entry.layer!r} (key {entry.key})"
    if not entry.candidates:
        raise HarnessError(
            f"{where} has no recorded candidates, so there is nothing to choose from; "
            "rebuild with candidate recording (TensorRT: a VERBOSE build log) to pin it"
        )
    if _looks_like_hash(tactic):
        by_hash = [
            c for c in entry.candidates if normalize_hash(c.tactic_hash) == normalize_hash(tactic)
        ]
        if by_hash:
            return by_hash[0]
    by_name = _only(
        [c for c in entry.candidates if c.tactic == tactic],
        lambda same: f"{where}: tactic name {tactic!r} is ambiguous (hashes "
        f"{', '.join(c.tactic_hash for c in same)}); pin it by hash",
    )
    if by_name is not None:
        return by_name
    valid = [f"{c.tactic} ({c.tactic_hash}, {c.time_ms:.4g} ms)" for c in entry.candidates]
    raise HarnessError(
        f"{where}: {tactic!r} is not one of its candidates; valid tactics: {_listing(valid)}"
    )


_HEX = re.compile(r"^(0x)?[0-9a-fA-F]+$")


def _looks_like_hash(text: str) -> bool:
    return bool(_HEX.match(text))


def pin_from(
    cache: TimingCache, other: TimingCache, ignore_mismatch: bool = False, source: str = "the other cache"
) -> list[str]:
    """Copy ``other``'s selections into ``cache`` for every key both have; returns those layers.

    Our candidates are kept. A cache from another configuration is refused
    unless ``ignore_mismatch``: its hashes name kernels that may not exist
    here; accepted, the mismatch is written into ``cache``'s provenance.
    """
    check_compatible(other, cache.provenance, ignore_mismatch, f"cannot copy tactic selections from {source}")
    record_mismatch(cache, other, source)
    layers: list[str] = []
    for entry in cache.entries():
        chosen = other.query(entry.key)
        if chosen is not None:
            cache.update(_select(entry, chosen.tactic, chosen.tactic_hash, chosen.time_ms))
            layers.append(entry.layer)
    return layers


def merge(a: TimingCache, b: TimingCache, ignore_mismatch: bool = False, source: str = "B") -> TimingCache:
    """A new cache with all of ``a`` plus ``b``'s keys that ``a`` lacks (``a`` wins conflicts)."""
    merged = TimingCache(a.provenance, a.entries())
    check_compatible(b, a.provenance, ignore_mismatch, f"cannot merge {source}")
    merged.combine(b, ignore_mismatch=True)
    record_mismatch(merged, b, source)
    return merged


def record_mismatch(cache: TimingCache, other: TimingCache, source: str) -> None:
    """Say in ``cache``'s provenance that it took entries from another configuration.

    The compared provenance stays this cache's, so the record goes into the
    informative device details, where ``harness cache show`` prints it: a
    cache never claims a configuration some of its entries were not timed on.
    """
    differences = other.provenance.mismatches(cache.provenance)
    if differences:
        notes = list(cache.provenance.device_details.get("entries_from_other_configurations", []))
        notes.append(f"{source}: {'; '.join(differences)}")
        cache.provenance = replace(
            cache.provenance,
            device_details={**cache.provenance.device_details, "entries_from_other_configurations": notes},
        )


def verify(cache: TimingCache, engine_layers: Iterable[tuple[str, str, str]]) -> list[str]:
    """Describe every engine layer whose tactic disagrees with the cache (empty: it agrees).

    The engine's tactic may be given by name or by hash. Cache keys the engine
    does not use are not an error: a cache also holds timings of variants the
    builder considered and dropped.
    """
    problems: list[str] = []
    for layer, key, tactic in engine_layers:
        entry = cache.query(key)
        if entry is None:
            problems.append(
                f"layer {layer!r}: key {key} is not in the cache (the builder timed it afresh)"
            )
        elif not _same_tactic(entry, tactic):
            problems.append(
                f"layer {layer!r} (key {key}): engine uses {tactic!r}, "
                f"cache selects {entry.tactic!r} ({entry.tactic_hash})"
            )
    return problems


def _same_tactic(entry: CacheEntry, tactic: str) -> bool:
    if tactic == entry.tactic:
        return True
    return (
        entry.hash_known
        and _looks_like_hash(tactic)
        and normalize_hash(tactic) == normalize_hash(entry.tactic_hash)
    )
