"""Backend-neutral timing caches: the record that makes a rebuild pick the same tactics."""

from harness.cache.timing_cache import (
    SCHEMA_VERSION,
    CacheEntry,
    Candidate,
    Provenance,
    TimingCache,
    check_compatible,
    normalize_hash,
)

__all__ = [
    "SCHEMA_VERSION",
    "CacheEntry",
    "Candidate",
    "Provenance",
    "TimingCache",
    "check_compatible",
    "normalize_hash",
]
