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

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from harness.documents import DOCUMENT, Digest, document_json, read_document, schema_of
from harness.errors import HarnessError
from harness.fileio import atomic_write_json, canonical_json, digest, read_json

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

_Name = Annotated[str, Field(min_length=1)]
# NaN and infinities pass pydantic to __post_init__, whose error names the layer; a file cannot hold them.
_Time = Annotated[float, Field(allow_inf_nan=True, json_schema_extra={"minimum": 0, "maximum": MAX_TIME_MS})]


def normalize_hash(tactic_hash: str) -> str:
    """Canonical spelling of a tactic hash, so "0x0AbC" and "abc" compare equal."""
    return tactic_hash.lower().removeprefix("0x").lstrip("0") or "0"


def _check_time(value: float, what: str) -> None:
    # A NaN time would *delete* the entry when pushed into TensorRT's ITimingCache.update,
    # so refuse it at the source, naming the layer.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise HarnessError(f"{what}: time_ms must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, config=DOCUMENT)
class Candidate:
    """One evaluated implementation of a layer."""

    tactic: _Name
    tactic_hash: Annotated[str, Field(pattern=_HASH_PATTERN)]
    time_ms: _Time

    def __post_init__(self) -> None:
        _check_time(self.time_ms, f"candidate {self.tactic!r}")


@dataclass(frozen=True, config=DOCUMENT)
class CacheEntry:
    """The decision for one backend key: selected tactic plus the candidates it beat."""

    key: _Name
    layer: str
    tactic: _Name
    tactic_hash: Annotated[str, Field(pattern=_ENTRY_HASH_PATTERN)]
    time_ms: _Time
    candidates: tuple[Candidate, ...] = ()
    pinned: bool = False

    def __post_init__(self) -> None:
        _check_time(self.time_ms, f"layer {self.layer!r} (key {self.key})")

    @property
    def hash_known(self) -> bool:
        """False for an entry known by kernel name only (:data:`UNKNOWN_HASH`): such an entry
        is compared by that name, and can be neither pinned nor written into a backend."""
        return self.tactic_hash != UNKNOWN_HASH


@dataclass(frozen=True, config=DOCUMENT)
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

    backend: _Name
    backend_version: str
    device: str
    device_details: dict[str, Any] = dataclasses.field(default_factory=dict)
    builder_options: dict[str, Any] = dataclasses.field(default_factory=dict)

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


@dataclass(frozen=True, config=DOCUMENT)
class CacheFile:
    """A timing cache as its file holds it: the document :data:`SCHEMA` is generated from."""

    schema_version: Literal[1]
    provenance: Provenance
    entries: list[CacheEntry]
    digest: Digest


SCHEMA: dict[str, Any] = schema_of(CacheFile, "harness timing cache")


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
            "provenance": document_json(self.provenance),
            "entries": [document_json(e) for e in self._entries.values()],
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
        document = read_document(CacheFile, obj, SCHEMA, where)
        seen: set[str] = set()
        for entry in document.entries:
            if entry.key in seen:
                raise HarnessError(f"{where}: key {entry.key} appears more than once")
            seen.add(entry.key)
        provenance, entries = document.provenance, document.entries
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
