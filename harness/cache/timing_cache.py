"""The backend-neutral timing cache: which tactic each layer uses, and why we trust it.

A timing cache is what makes a rebuild pick the same kernels as before. Every
backend (TensorRT, the CPU reference engine, ...) records its decisions in this
one JSON format so that the same tools can show, diff, pin, merge and verify
them. The file carries its provenance (a tactic hash is only meaningful for the
backend version, device and kernel-changing builder options that produced it)
and a content digest, so a hand edit or a truncated copy is detected on load
instead of silently steering a build.

Entries are kept in insertion order (normally the order the builder timed the
layers, which is the order a reader expects), but the digest is computed over
entries sorted by key, so two caches with the same content have the same digest
however they were assembled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from harness.errors import HarnessError
from harness.fileio import atomic_write_json, canonical_json, digest, read_json, validate

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)

_HASH_PATTERN = "^(0x)?[0-9a-fA-F]{1,64}$"
# An entry's (never a candidate's) hash may be UNKNOWN_HASH: the builder's log named the
# kernel an engine layer runs but not which of its measured variants (TensorRT's Myelin
# kernels share names), so the entry can be compared by kernel name, never pinned. Every
# file written before this was allowed still matches, so schema_version stays 1.
UNKNOWN_HASH = ""
_ENTRY_HASH_PATTERN = "^((0x)?[0-9a-fA-F]{1,64})?$"
# A layer's time, in ms: an hour is beyond any kernel a build times, so a file that says
# more was not written by one (the range is named in the error).
MAX_TIME_MS = 3_600_000
_TIME = {"type": "number", "minimum": 0, "maximum": MAX_TIME_MS}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "harness timing cache",
    "type": "object",
    "required": ["schema_version", "provenance", "entries", "digest"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "digest": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        "provenance": {
            "type": "object",
            "required": [
                "backend",
                "backend_version",
                "device",
                "device_details",
                "builder_options",
            ],
            "additionalProperties": False,
            "properties": {
                "backend": {"type": "string", "minLength": 1},
                "backend_version": {"type": "string"},
                "device": {"type": "string"},
                "device_details": {"type": "object"},
                "builder_options": {"type": "object"},
            },
        },
        "entries": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "key",
                    "layer",
                    "tactic",
                    "tactic_hash",
                    "time_ms",
                    "candidates",
                    "pinned",
                ],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string", "minLength": 1},
                    "layer": {"type": "string"},
                    "tactic": {"type": "string", "minLength": 1},
                    "tactic_hash": {"type": "string", "pattern": _ENTRY_HASH_PATTERN},
                    "time_ms": _TIME,
                    "pinned": {"type": "boolean"},
                    "candidates": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["tactic", "tactic_hash", "time_ms"],
                            "additionalProperties": False,
                            "properties": {
                                "tactic": {"type": "string", "minLength": 1},
                                "tactic_hash": {"type": "string", "pattern": _HASH_PATTERN},
                                "time_ms": _TIME,
                            },
                        },
                    },
                },
            },
        },
    },
}


def normalize_hash(tactic_hash: str) -> str:
    """Canonical spelling of a tactic hash, so "0x0AbC" and "abc" compare equal."""
    return tactic_hash.lower().removeprefix("0x").lstrip("0") or "0"


def _check_time(value: float, what: str) -> None:
    # JSON schema cannot reject NaN (every comparison with NaN is false), and
    # json.loads happily reads "NaN"; a NaN time would also *delete* the entry
    # when pushed into TensorRT's ITimingCache.update, so refuse it at the source.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise HarnessError(f"{what}: time_ms must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Candidate:
    """One evaluated implementation of a layer."""

    tactic: str
    tactic_hash: str
    time_ms: float

    def __post_init__(self) -> None:
        _check_time(self.time_ms, f"candidate {self.tactic!r}")

    def to_json(self) -> dict[str, Any]:
        return {"tactic": self.tactic, "tactic_hash": self.tactic_hash, "time_ms": self.time_ms}


@dataclass(frozen=True)
class CacheEntry:
    """The decision for one backend key: selected tactic plus the candidates it beat."""

    key: str
    layer: str
    tactic: str
    tactic_hash: str
    time_ms: float
    candidates: tuple[Candidate, ...] = ()
    pinned: bool = False

    def __post_init__(self) -> None:
        _check_time(self.time_ms, f"layer {self.layer!r} (key {self.key})")
        # Callers may pass a list; a tuple keeps the entry immutable and hashable-by-value.
        object.__setattr__(self, "candidates", tuple(self.candidates))

    @property
    def hash_known(self) -> bool:
        """False for an entry known by kernel name only (:data:`UNKNOWN_HASH`): such an entry
        is compared by that name, and can be neither pinned nor written into a backend."""
        return self.tactic_hash != UNKNOWN_HASH

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "layer": self.layer,
            "tactic": self.tactic,
            "tactic_hash": self.tactic_hash,
            "time_ms": self.time_ms,
            "candidates": [c.to_json() for c in self.candidates],
            "pinned": self.pinned,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CacheEntry:
        return cls(
            key=obj["key"],
            layer=obj["layer"],
            tactic=obj["tactic"],
            tactic_hash=obj["tactic_hash"],
            time_ms=obj["time_ms"],
            candidates=tuple(
                Candidate(c["tactic"], c["tactic_hash"], c["time_ms"]) for c in obj["candidates"]
            ),
            pinned=obj["pinned"],
        )


@dataclass(frozen=True)
class Provenance:
    """Where a cache's timings come from.

    ``backend``, ``backend_version``, ``device`` and ``builder_options`` decide
    which kernels exist and how they are keyed, so they must match for a cache
    to be reused (see :meth:`mismatches`). ``device_details`` (driver, CUDA
    version, CPU flags, memory, ...) is recorded for the reader and never
    compared: it is too noisy to gate on (driver point releases, microcode
    flags). A backend for which such a property *does* change the kernels must
    put it into ``device`` (e.g. "NVIDIA A100 (sm_80)", or a CPU model string
    that names the ISA extensions it relies on) or into ``builder_options``.
    """

    backend: str
    backend_version: str
    device: str
    device_details: dict[str, Any] = field(default_factory=dict)
    builder_options: dict[str, Any] = field(default_factory=dict)

    def mismatches(self, other: Provenance) -> list[str]:
        """Human-readable ``field: mine != theirs`` lines for every kernel-relevant difference."""
        lines = [
            f"{name}: {getattr(self, name)} != {getattr(other, name)}"
            for name in ("backend", "backend_version", "device")
            if getattr(self, name) != getattr(other, name)
        ]
        lines += dict_differences("builder_options", self.builder_options, other.builder_options)
        return lines

    def detail_differences(self, other: Provenance) -> list[str]:
        """Differences in the informative ``device_details`` (shown, never enforced)."""
        return dict_differences("device_details", self.device_details, other.device_details)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "backend_version": self.backend_version,
            "device": self.device,
            "device_details": dict(self.device_details),
            "builder_options": dict(self.builder_options),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Provenance:
        return cls(
            backend=obj["backend"],
            backend_version=obj["backend_version"],
            device=obj["device"],
            device_details=dict(obj["device_details"]),
            builder_options=dict(obj["builder_options"]),
        )


_MISSING = "(unset)"


def dict_differences(prefix: str, mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """One line per differing leaf: nested settings name the very setting that differs."""
    lines = []
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name, _MISSING), theirs.get(name, _MISSING)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            lines += dict_differences(f"{prefix}.{name}", a, b)
        else:
            lines.append(f"{prefix}.{name}: {a} != {b}")
    return lines


class TimingCache:
    """Entries keyed by the backend's key, with the provenance they are valid for."""

    def __init__(self, provenance: Provenance, entries: Iterable[CacheEntry] = ()) -> None:
        self.provenance = provenance
        self._entries: dict[str, CacheEntry] = {}
        for entry in entries:
            self.update(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TimingCache):
            return NotImplemented
        return self.provenance == other.provenance and self._entries == other._entries

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def query_keys(self) -> list[str]:
        return list(self._entries)

    def query(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def update(self, entry: CacheEntry) -> None:
        """Insert or replace by key (TensorRT's ``update`` only replaces; here it also inserts)."""
        self._entries[entry.key] = entry

    def remove(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None

    def combine(self, other: TimingCache, ignore_mismatch: bool = False) -> int:
        """Add ``other``'s entries whose keys are missing here; existing keys win.

        Like ``ITimingCache.combine``: conflicting entries are skipped, and a
        cache from a different configuration is refused unless
        ``ignore_mismatch``, because its tactic hashes may not exist here.
        """
        check_compatible(other, self.provenance, ignore_mismatch, "cannot combine timing caches")
        added = 0
        for key, entry in other._entries.items():
            if key not in self._entries:
                self._entries[key] = entry
                added += 1
        return added

    def reset(self) -> None:
        self._entries.clear()

    def by_layer(self, layer: str) -> list[CacheEntry]:
        return [e for e in self._entries.values() if e.layer == layer]

    def _payload(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "provenance": self.provenance.to_json(),
            "entries": [e.to_json() for e in self._entries.values()],
        }

    def digest(self) -> str:
        payload = self._payload()
        payload["entries"] = sorted(payload["entries"], key=lambda e: e["key"])
        return digest(canonical_json(payload))

    def to_json(self) -> dict[str, Any]:
        obj = self._payload()
        obj["digest"] = self.digest()
        return obj

    @classmethod
    def from_json(cls, obj: Any, where: str) -> TimingCache:
        """Validate ``obj`` (schema version, schema, digest) and build the cache.

        ``where`` names the source (usually the file) in every error message.
        """
        if not isinstance(obj, dict):
            raise HarnessError(f"{where}: not a timing cache (expected a JSON object)")
        version = obj.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            supported = ", ".join(str(v) for v in SUPPORTED_SCHEMA_VERSIONS)
            raise HarnessError(
                f"{where}: schema_version {version!r} is not supported "
                f"(this harness reads version {supported})"
            )
        validate(obj, SCHEMA, where)
        try:
            provenance = Provenance.from_json(obj["provenance"])
            entries = [CacheEntry.from_json(e) for e in obj["entries"]]
        except HarnessError as exc:
            raise HarnessError(f"{where}: {exc}") from None
        seen: set[str] = set()
        for entry in entries:
            if entry.key in seen:
                raise HarnessError(f"{where}: key {entry.key} appears more than once")
            seen.add(entry.key)
        cache = cls(provenance, entries)
        actual = cache.digest()
        if actual != obj["digest"]:
            raise HarnessError(
                f"{where}: digest mismatch (stored {obj['digest']}, content {actual}); the file "
                "was edited by hand or damaged. Edit caches with `harness cache pin`, or "
                "rebuild the cache"
            )
        return cache

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TimingCache:
        obj = read_json(path, None, "timing cache")
        return cls.from_json(obj, f"timing cache {os.fspath(path)}")


def check_compatible(
    cache: TimingCache, expected: Provenance, ignore_mismatch: bool, where: str
) -> None:
    """Refuse a cache recorded for another configuration unless the user insists."""
    if ignore_mismatch:
        return
    differences = cache.provenance.mismatches(expected)
    if differences:
        raise HarnessError(
            f"{where}: the timing cache was recorded for a different configuration "
            f"(cache != expected: {'; '.join(differences)}); its tactics may not exist here. "
            "Rebuild the cache on this configuration, or pass --ignore-mismatch to use it anyway"
        )
