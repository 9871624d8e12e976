"""The results document: schema, incremental writer, loader, shard merge, baselines.

One JSON document per run::

    {"schema_version": 2, "created": "2025-01-01T00:00:00Z", "complete": false,
     "machine": {...machine_info()...}, "git": {"commit": ..., "dirty": ...},
     "settings": {...runner settings...}, "cases": [case, ...]}

A case is one (model, mode, backend, batch, scenario) measurement; see
:class:`harness.bench.results_doc.Case` for its fields. A case without a ``scenario`` (every file
written before scenarios existed) is a single-stream case
(:mod:`harness.bench.scenarios`). :class:`ResultsWriter` rewrites the whole file atomically after
every case, with ``complete: false`` until :meth:`ResultsWriter.finish`: an
interrupted run leaves a valid file holding every case that finished, and
says that it is partial. Raw latency samples are kept (``samples_ns``) so
that the gate can test significance instead of comparing two medians.

Layout on disk: ``<root>/<machine id>/run-<UTC timestamp>.json`` for runs and
``<root>/<machine id>/baseline.json`` for the promoted baseline.

Older files: ``load_results(path, upgrade=True)`` (``harness report``,
``harness compare``) reads a schema-1 file as schema 2 (:func:`upgrade_results`:
everything derived recomputed from its raw samples, ``upgraded_from`` saying
that its contents are unverified, as schema 1 has no digest); everything that
trusts or writes a run (gate, baseline promote, merge, resume) refuses it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from harness.bench.accuracy import AccuracyResult, TaskAccuracy
from harness.bench.latency import DEFAULT_SPREAD_THRESHOLD, LatencyResult
from harness.bench.machine import git_info, machine_info
from harness.bench.memory import MemoryReport
from harness.bench.results_doc import CASE_SCHEMA, Run
from harness.bench.results_doc import MAX_SPREAD_THRESHOLD as MAX_SPREAD_THRESHOLD
from harness.bench.results_doc import PEER_PREFIX as PEER_PREFIX
from harness.bench.results_doc import RESULTS_SCHEMA as RESULTS_SCHEMA
from harness.bench.results_doc import SCHEMA_VERSION as SCHEMA_VERSION
from harness.bench.results_doc import SINGLE_STREAM as SINGLE_STREAM
from harness.bench.results_doc import STATUSES as STATUSES
from harness.bench.results_doc import CaseKey as CaseKey
from harness.bench.stats import SUMMARY_FIELDS, Summary, slow_phase
from harness.errors import HarnessError
from harness.fileio import (
    atomic_write_bytes,
    canonical_json,
    digest,
    locked,
    read_json,
    validate,
)
from harness.machine import check_machine_id


def is_peer(case: Mapping[str, Any]) -> bool:
    """Whether a case is a peer's reference row rather than an engine's."""
    return str(case["backend"]).startswith(PEER_PREFIX)


# How the warning a case stores when the machine was busier than its cores begins
# (harness.bench.runner.load_warnings): the table says it once, in a footnote.
BUSY_PREFIX = "the machine was busier than its"


def case_key(case: Mapping[str, Any]) -> CaseKey:
    """(model, mode, backend, batch, scenario): what identifies a case within a run and across runs.

    ``batch`` is the batch size a sweep asked for, None for the model's own;
    ``scenario`` the scenario's label with its parameters (``server[rate=50/s,bound=10ms]``),
    ``single-stream`` for a case that records none, so the gate compares like with like.
    """
    scenario = case.get("scenario")
    label = str(scenario["label"]) if isinstance(scenario, Mapping) else SINGLE_STREAM
    return (case["model"], case["mode"], case["backend"], case.get("batch"), label)


def case_order(key: CaseKey) -> tuple[str, str, str, int, str]:
    """A sort key for case keys: a sweep's batch sizes in order, the model's own batch (None) first.

    Sorting the keys themselves compares None with an int when one run holds
    both kinds of case, which Python refuses.
    """
    model, mode, backend, batch, scenario = key
    return (model, mode, backend, -1 if batch is None else batch, "" if scenario == SINGLE_STREAM else scenario)


def format_key(key: CaseKey) -> str:
    model, mode, backend, batch, scenario = key
    return (
        f"{model}/{mode}/{backend}"
        + ("" if batch is None else f"/b{batch}")
        + ("" if scenario == SINGLE_STREAM else f"/{scenario}")
    )


@dataclass
class CaseResult:
    """One case as the runner assembles it; :meth:`to_dict` gives the JSON form."""

    model: str
    mode: str
    backend: str
    status: Literal["ok", "non-finite", "failed"] = "ok"
    batch: int | None = None  # the batch size a sweep asked for; None: the model's own
    error: str | None = None
    latency: LatencyResult | None = None
    memory: MemoryReport | None = None
    accuracy: AccuracyResult | None = None
    task_accuracy: TaskAccuracy | None = None
    telemetry: dict[str, Any] | None = None
    engine_fingerprint: str | None = None
    timing_cache_digest: str | None = None
    from_cache: bool = False  # every tuned layer's tactic came from the timing cache: nothing was timed
    output_digest: str | None = None
    model_weights_digest: str | None = None
    threads: int | None = None
    load_average: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    layers: list[dict[str, str]] | None = None
    scenario: dict[str, Any] | None = None  # absent: single-stream (harness.bench.scenarios)
    source: dict[str, Any] | None = None  # the model file the model came from (harness.sources)
    executed_precision: dict[str, Any] | None = None  # ExecutedPrecision.to_json(); None: no low type asked

    def __post_init__(self) -> None:
        acc = self.accuracy
        if self.status == "ok" and acc is not None and any(m.nan_count or m.inf_count for m in acc.outputs):
            self.status = "non-finite"  # outputs hold NaN/Inf: never shown as fine

    @classmethod
    def failed(
        cls, model: str, mode: str, backend: str, error: str, batch: int | None = None,
        scenario: dict[str, Any] | None = None,
    ) -> CaseResult:  # fmt: skip
        return cls(model=model, mode=mode, backend=backend, status="failed", error=error, batch=batch, scenario=scenario)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "backend": self.backend,
            "batch": self.batch,
            "status": self.status,
            "error": self.error,
            "latency": self.latency.to_dict() if self.latency is not None else None,
            "memory": self.memory.to_dict() if self.memory is not None else None,
            "accuracy": self.accuracy.to_dict() if self.accuracy is not None else None,
            "task_accuracy": self.task_accuracy.to_dict()
            if self.task_accuracy is not None
            else None,
            "telemetry": self.telemetry,
            "engine_fingerprint": self.engine_fingerprint,
            "timing_cache_digest": self.timing_cache_digest,
            "from_cache": self.from_cache,
            "output_digest": self.output_digest,
            "model_weights_digest": self.model_weights_digest,
            "threads": self.threads,
            "load_average": self.load_average,
            "warnings": list(self.warnings),
            "layers": self.layers,
            # only where there is one: a single-stream case of a factory model is written as before
            **({} if self.scenario is None else {"scenario": self.scenario}),
            **({} if self.source is None else {"source": self.source}),
            **({} if self.executed_precision is None else {"executed_precision": self.executed_precision}),
        }


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _check_latency(lat: Mapping[str, Any], where: str) -> None:
    """The stored summary, throughput and stability flag must be what the raw samples say.

    A file whose summary disagrees with its samples is refused: the gate
    tests the samples, a reader looks at the summary, and both must tell the
    same story (a 10x slower set of samples under the old median must not pass).
    """
    samples = lat["samples_ns"]
    if not all(type(s) is int and s > 0 for s in samples):
        raise HarnessError(f"{where}: latency samples must be positive integers (nanoseconds)")
    if len(samples) != lat["iterations"]:
        raise HarnessError(f"{where}: {len(samples)} latency samples but {lat['iterations']} iterations")
    stored, actual = lat["summary"], Summary.from_samples(samples, unit="ns")
    wrong = [k for k in SUMMARY_FIELDS if not _close(stored[k], getattr(actual, k))]
    if stored["unit"] != "ns" or wrong:
        raise HarnessError(
            f"{where}: the latency summary disagrees with its raw samples ({', '.join(wrong) or 'unit'}); "
            "the file was edited or corrupted"
        )
    # Files written before the figures said their clock stored the mean's throughput.
    mean_based = "clocks" not in lat
    seconds = (actual.mean if mean_based else actual.median) * 1e-9
    if not _close(lat["throughput_per_s"], lat["batch_size"] / seconds):
        raise HarnessError(f"{where}: throughput_per_s disagrees with the samples")
    offline = lat.get("offline_throughput_per_s")
    if offline is not None and not _close(offline, lat["iterations"] * lat["batch_size"] / lat["duration_s"]):
        raise HarnessError(f"{where}: offline_throughput_per_s disagrees with the iterations and duration")
    phase = lat["slow_phase"]
    if phase is not None and not phase["start"] < phase["end"] <= len(samples):
        raise HarnessError(f"{where}: slow_phase lies outside the samples")
    if lat["unstable"] != (actual.spread > lat["spread_threshold"] or phase is not None):
        raise HarnessError(f"{where}: the unstable flag disagrees with the spread and slow phase")


def _check_cases(doc: Mapping[str, Any], where: str) -> None:
    """What the schema cannot say: unique case keys, summaries recomputed, statuses that fit."""
    seen: set[CaseKey] = set()
    for i, case in enumerate(doc["cases"]):
        key = case_key(case)
        case_where = f"{where}: case {i} ({format_key(key)})"
        if key in seen:
            raise HarnessError(f"{case_where} appears twice")
        seen.add(key)
        if case["status"] == "failed":
            continue
        _check_latency(case["latency"], case_where)
        acc = case["accuracy"]
        nonfinite = acc["nan_count"] + acc["inf_count"] > 0
        if nonfinite != (case["status"] == "non-finite"):
            raise HarnessError(
                f"{case_where}: status {case['status']!r} but the outputs hold "
                f"{acc['nan_count']} NaN and {acc['inf_count']} Inf"
            )


def content_digest(doc: Mapping[str, Any]) -> str:
    """Digest of everything in a results document but the digest itself."""
    return digest(canonical_json({k: v for k, v in doc.items() if k != "digest"}))


def check_results(doc: Any, where: str) -> None:
    """Validate a results document (version first, so an old file gets a clear message)."""
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise HarnessError(f"{where}: not a results document (no schema_version)")
    if doc["schema_version"] in UPGRADABLE_VERSIONS:
        raise HarnessError(
            f"{where}: schema_version {doc['schema_version']!r} is an old results format: `harness report` "
            "and `harness compare` read it (upgraded, its contents unverified), but nothing is gated on, "
            "promoted, merged or resumed from it; rerun the benchmark"
        )
    if doc["schema_version"] != SCHEMA_VERSION:
        raise HarnessError(
            f"{where}: schema_version {doc['schema_version']!r} is not supported; "
            f"this harness reads version {SCHEMA_VERSION} (rerun the benchmark)"
        )
    validate(doc, RESULTS_SCHEMA, where)
    if doc["digest"] != content_digest(doc):
        raise HarnessError(f"{where}: contents do not match the recorded digest; the file was edited or corrupted")
    try:
        check_machine_id(doc["machine"]["id"])
    except HarnessError as exc:
        raise HarnessError(f"{where}: {exc}") from None
    _check_cases(doc, where)


def load_results(path: str | os.PathLike[str], *, upgrade: bool = False) -> dict[str, Any]:
    """Read and validate a results file; any problem is a HarnessError naming it.

    ``upgrade`` reads an older schema too, upgraded by :func:`upgrade_results`
    (for the commands that only show a run: report, compare). Without it an
    old file is refused: the gate, baselines, merges and resumes need what
    only a current file has (a verified digest, weights digests, pinned threads).
    """
    return results_from_json(read_json(path, None, "results file"), f"results file {path}", upgrade=upgrade)


def results_from_json(doc: Any, where: str, *, upgrade: bool = False) -> dict[str, Any]:
    """A parsed results document, validated (and upgraded, with ``upgrade``) as :func:`load_results` does."""
    if upgrade and isinstance(doc, dict) and doc.get("schema_version") in UPGRADABLE_VERSIONS:
        doc = upgrade_results(doc, where)
    check_results(doc, where)
    return dict(doc)


def peek_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A results file's top-level fields as written, not validated (to choose among runs cheaply;
    the one chosen is read with :func:`load_results`). A file that is no JSON object reads as {}."""
    doc = read_json(path, None, "results file")
    return {k: v for k, v in doc.items() if k != "cases"} if isinstance(doc, dict) else {}


UPGRADABLE_VERSIONS = (1,)


def _absent(*names: str) -> dict[str, Any]:
    return {"not": {"anyOf": [{"required": [n]} for n in names]}}


# What tells a schema-1 document from a later one relabelled (no digest, ``pinned``,
# ``cov_threshold``, none of schema 2's fields), plus the types the upgrade computes
# with; everything else is checked on the upgraded document by RESULTS_SCHEMA.
_SCHEMA_1_SHAPE: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "created", "complete", "machine", "git", "settings", "cases"],
    "additionalProperties": False,
    "properties": {
        **{k: {} for k in ("created", "complete", "machine", "git", "settings")},
        "schema_version": {"const": 1},
        "cases": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["model", "mode", "backend", "status", "pinned"],
                **_absent("from_cache", "batch", "threads", "model_weights_digest", "load_average", "warnings"),
                "properties": {
                    "pinned": {"type": "boolean"},
                    "latency": {
                        "anyOf": [
                            {"type": "null"},
                            {
                                "type": "object",
                                "required": ["samples_ns", "timer", "batch_size", "cov_threshold"],
                                **_absent("spread_threshold", "slow_phase", "remeasured"),
                                "properties": {
                                    "batch_size": {"type": "integer", "minimum": 1},
                                    "timer": {"enum": list(DEFAULT_SPREAD_THRESHOLD)},
                                    "samples_ns": {"type": "array", "minItems": 1},
                                },
                            },
                        ]
                    },
                    "accuracy": {
                        "anyOf": [
                            {"type": "null"},
                            {
                                "type": "object",
                                "required": ["nan_count", "inf_count", "outputs"],
                                "properties": {
                                    "nan_count": {"type": "integer", "minimum": 0},
                                    "inf_count": {"type": "integer", "minimum": 0},
                                    "outputs": {"type": "array", "items": {"type": "object"}},
                                },
                            },
                        ]
                    },
                },
            },
        },
    },
}
UNVERIFIED_NOTE = (
    "upgraded on read from schema 1, which has no digest: the contents are unverified; "
    "summaries, spread and stability were recomputed from the raw samples"
)


def _upgrade_latency_1(lat: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Schema-1 latency in schema 2's form: everything derived is recomputed from the raw samples.

    Schema 1 judged stability by CoV against ``cov_threshold``; schema 2 by
    IQR/median against ``spread_threshold`` (the timer's default here, as a run
    without ``--spread-threshold`` would use) or a slow phase in the samples.
    The samples are old, so a slow phase is marked, never re-measured. The
    loop-overhead summary has no samples behind it and lacks the robust
    fields, so it is dropped rather than guessed.
    """
    samples = lat.get("samples_ns")
    if not isinstance(samples, list) or not samples or not all(type(v) is int and v > 0 for v in samples):
        raise HarnessError(f"{where}: latency samples must be a non-empty list of positive integers (nanoseconds)")
    timer = lat["timer"]  # one of DEFAULT_SPREAD_THRESHOLD's (_SCHEMA_1_SHAPE)
    summary = Summary.from_samples(samples, unit="ns")
    phase = slow_phase(samples)
    threshold = DEFAULT_SPREAD_THRESHOLD[timer]
    upgraded = {k: v for k, v in lat.items() if k not in ("cov_threshold", "overhead")}
    return {
        **upgraded,
        "iterations": len(samples),
        "summary": summary.stats_dict(),
        "throughput_per_s": summary.throughput(lat["batch_size"]),
        "clocks": dict.fromkeys(("summary", "throughput_per_s"), "host" if timer == "cpu" else "cuda-event"),
        "spread_threshold": threshold,
        "unstable": summary.spread > threshold or phase is not None,
        "slow_phase": dataclasses.asdict(phase) if phase is not None else None,
        "remeasured": False,
        "overhead": None,
    }


def _upgrade_settings_1(settings: Any) -> Any:
    """Schema-1 settings in schema 2's form: ``measure`` without ``cov_threshold``, which schema 2
    replaced by the spread threshold (as in each case's latency); anything else as it was."""
    measure = settings.get("measure") if isinstance(settings, Mapping) else None
    if not isinstance(measure, Mapping):
        return settings
    return {**settings, "measure": {k: v for k, v in measure.items() if k != "cov_threshold"}}


def _upgrade_case_1(case: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One schema-1 case in schema 2's form; what schema 1 never recorded is null."""
    out = {k: v for k, v in case.items() if k != "pinned"}
    out["from_cache"] = bool(case.get("pinned", False))  # schema 1's name for it
    for absent in ("batch", "model_weights_digest", "threads", "load_average"):
        out.setdefault(absent, None)
    if case.get("latency") is not None:
        out["latency"] = _upgrade_latency_1(case["latency"], where)
    acc = case.get("accuracy")
    if isinstance(acc, Mapping) and isinstance(acc.get("outputs"), list):
        outputs = acc["outputs"]
        # schema 1 kept the flat output tuple; schema 2 names each by its path in the output structure
        paths = [""] if len(outputs) == 1 else [f"[{i}]" for i in range(len(outputs))]
        out["accuracy"] = {**acc, "outputs": [{"path": p, **o} for p, o in zip(paths, outputs, strict=True)]}
        if out.get("status") == "ok" and acc["nan_count"] + acc["inf_count"] > 0:
            out["status"] = "non-finite"  # schema 1 showed NaN outputs as ok
    return out


def upgrade_results(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A schema-1 results document as schema 2, marked ``upgraded_from`` with an absent digest.

    Schema 1 has no digest, so nothing vouches for the file's contents: the
    upgraded document says so (``upgraded_from.digest`` is null, with a
    note), and its own new digest covers only the upgrade. Every derived
    number (summaries, throughput, spread, stability) is recomputed from the
    raw samples, so what a reader sees is at least consistent with them.
    """
    version = doc.get("schema_version")
    if version not in UPGRADABLE_VERSIONS:
        raise HarnessError(f"{where}: cannot upgrade schema_version {version!r}")
    validate(doc, _SCHEMA_1_SHAPE, f"{where} (read as schema 1)")
    cases = doc["cases"]
    upgraded = dict(doc)
    upgraded["schema_version"] = SCHEMA_VERSION
    upgraded["settings"] = _upgrade_settings_1(doc["settings"])
    upgraded["cases"] = [_upgrade_case_1(c, f"{where}: case {i}") for i, c in enumerate(cases)]
    upgraded["upgraded_from"] = {"schema_version": version, "digest": None, "note": UNVERIFIED_NOTE}
    upgraded["digest"] = content_digest(upgraded)
    return upgraded


def sealed(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``doc`` with its content digest, validated."""
    out = {k: v for k, v in doc.items() if k != "digest"}
    out["digest"] = content_digest(out)
    check_results(out, where)
    return out


def write_results(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> dict[str, Any]:
    """Seal (digest), validate, then replace ``path`` atomically; the document as written.

    Compact JSON: a run holds thousands of raw samples per case, and the
    tables are the human view.
    """
    body = sealed(doc, f"results for {path}")
    atomic_write_bytes(path, json.dumps(body, allow_nan=False, separators=(",", ":")).encode() + b"\n")
    return body


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ResultsWriter:
    """Accumulates cases and rewrites the file after each one.

    Open with :meth:`create` or :meth:`resume`. Used as a context manager, a
    clean exit calls :meth:`finish`; an exception leaves the file with
    ``complete: false`` and every finished case.

    Every write is a read-modify-write under the file's lock
    (:func:`harness.fileio.locked`): two ``bench --resume`` of one file at once
    each re-read the other's cases before writing, so neither loses any.
    """

    def __init__(self, path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
        self.path = Path(path)
        self._doc = doc
        self._seen = _stamp(self.path)  # the file as this writer last wrote or read it
        # Cases this writer recorded or started from; others may appear in the file meanwhile.
        self._mine = {case_key(c) for c in doc["cases"]}

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        settings: Mapping[str, Any],
        machine: Mapping[str, Any] | None = None,
        git: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> ResultsWriter:
        """Start a run file (written at once, with no cases and ``complete: false``)."""
        doc = {
            "schema_version": SCHEMA_VERSION,
            "created": utc_now(),
            "complete": False,
            **_run_identity(settings, machine, git),
            "cases": [],
        }
        with locked(path):  # two runs started on one -o: one creates it, the other is refused
            if Path(path).exists() and not overwrite:
                raise HarnessError(
                    f"results file {path} already exists; choose a new path, or continue an "
                    "interrupted run with `harness bench --resume -o FILE`"
                )
            return cls(path, write_results(path, doc))

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike[str],
        *,
        settings: Mapping[str, Any],
        machine: Mapping[str, Any] | None = None,
        git: Mapping[str, Any] | None = None,
    ) -> ResultsWriter:
        """Continue an interrupted run; its finished cases stay and :meth:`has` reports them.

        The run must have been started on the same machine class, commit and
        settings, or its cases would not be one run.
        """
        with locked(path):  # the file as a writer left it, never between two writers' steps
            doc = load_results(path)
            writer = cls(path, doc)
        if doc["complete"]:
            raise HarnessError(f"results file {path} is complete; there is nothing to resume")
        mismatch = _run_mismatch(doc, _run_identity(settings, machine, git))
        if mismatch is not None:
            what, was, this = mismatch
            raise HarnessError(
                f"cannot resume {path}: its {what} is {was!r}, this run's is {this!r}; "
                "repeat the interrupted command's flags exactly or start a new run"
            )
        return writer

    @property
    def doc(self) -> dict[str, Any]:
        return self._doc

    def has(
        self, model: str, mode: str, backend: str, batch: int | None = None, scenario: str = SINGLE_STREAM
    ) -> bool:
        return any(case_key(c) == (model, mode, backend, batch, scenario) for c in self._doc["cases"])

    def add(self, case: CaseResult | Mapping[str, Any]) -> bool:
        """Record a case; False when another writer of this file recorded it meanwhile (theirs is kept).

        Adding a case this writer already holds is an error: it is a caller's bug.
        """
        entry = case.to_dict() if isinstance(case, CaseResult) else dict(case)
        validate(entry, CASE_SCHEMA, f"case for {self.path}")
        key = case_key(entry)
        if key in self._mine:
            raise HarnessError(f"{self.path}: case {format_key(key)} was already recorded")
        self._mine.add(key)
        added = []

        def append(doc: dict[str, Any]) -> None:
            if not any(case_key(c) == key for c in doc["cases"]):
                doc["cases"].append(entry)
                added.append(key)

        self._update(append)
        return bool(added)

    def finish(self) -> dict[str, Any]:
        """Mark the run complete, with the time it finished (the gate's "newest run" is by it)."""

        def finished(doc: dict[str, Any]) -> None:
            doc["complete"] = True
            doc["finished"] = utc_now()

        self._update(finished)
        return self._doc

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Apply ``change`` to the file as it is now, under its lock, and write it back.

        The file is re-read (and validated) only when another writer replaced
        it since this one wrote: every write is a rename, so its inode, size
        and time tell, and a run's own writes cost no re-read.
        """
        with locked(self.path):
            doc = self._doc
            if self.path.exists() and _stamp(self.path) != self._seen:
                doc = self._reread()
            change(doc)
            self._doc = write_results(self.path, doc)
            self._seen = _stamp(self.path)

    def _reread(self) -> dict[str, Any]:
        """The file another writer changed, refused unless it is still this run."""
        doc = load_results(self.path)
        if doc["created"] != self._doc["created"] or _run_mismatch(doc, self._doc) is not None:
            raise HarnessError(
                f"results file {self.path} was replaced by another run while this one was writing to it; "
                "its cases are kept as they are"
            )
        return doc

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finish()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of ``path``, None if absent: what changes when another writer replaces it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _run_identity(
    settings: Mapping[str, Any], machine: Mapping[str, Any] | None, git: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What makes cases one run: the machine, git and settings parts of a results document.

    ``machine`` and ``git`` default to this process's (:func:`machine_info`, :func:`git_info`).
    """
    return {
        "machine": dict(machine) if machine is not None else machine_info(),
        "git": dict(git) if git is not None else git_info(),
        "settings": dict(settings),
    }


def _run_mismatch(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of machine id, git commit, settings that differs between two parts of one run."""
    for what, x, y in (
        ("machine id", a["machine"]["id"], b["machine"]["id"]),
        ("git commit", a["git"]["commit"], b["git"]["commit"]),
        ("settings", a["settings"], b["settings"]),
    ):
        if x != y:
            return what, x, y
    return None


def merge_results(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Any]:
    """One document from the shards of a run.

    Shards must come from the same machine class, commit and settings
    (otherwise their numbers are not one run); a case in two shards is an
    error naming both files. The merge is complete only if every shard is.
    """
    files = [Path(p) for p in paths]
    if not files:
        raise HarnessError("merge needs at least one results file")
    docs = [load_results(p) for p in files]
    first, first_path = docs[0], files[0]
    origin: dict[CaseKey, Path] = {}
    cases: list[dict[str, Any]] = []
    for doc, path in zip(docs, files, strict=True):
        mismatch = _run_mismatch(first, doc)
        if mismatch is not None:
            what, a, b = mismatch
            raise HarnessError(
                f"cannot merge {path} with {first_path}: {what} differs ({b!r} vs {a!r})"
            )
        for case in doc["cases"]:
            key = case_key(case)
            if key in origin:
                raise HarnessError(
                    f"cannot merge: case {format_key(key)} is in both {origin[key]} and {path}"
                )
            origin[key] = path
            cases.append(case)
    finished = [d.get("finished") for d in docs]
    merged = {
        **{k: v for k, v in first.items() if k != "finished"},
        "created": min(d["created"] for d in docs),
        # the run finished when its last shard did (a shard without a finish time: not finished)
        **({"finished": max(f for f in finished if f)} if all(finished) else {}),
        "complete": all(d["complete"] for d in docs),
        "git": {
            "commit": first["git"]["commit"],
            "dirty": None
            if any(d["git"]["dirty"] is None for d in docs)
            else any(d["git"]["dirty"] for d in docs),
        },
        "cases": cases,
    }
    return sealed(merged, "merged results")


def doubts(run: Run) -> list[str]:
    """Why a run should not gate later runs: --quick, unstable cases, a machine busier than its cores."""
    reasons = []
    if run.settings.quick:
        reasons.append("it is a --quick run (its timing windows are too short)")
    engine_cases = [c for c in run.cases if not c.is_peer and c.latency is not None]
    unstable = [format_key(c.key) for c in engine_cases if c.latency is not None and c.latency.unstable]
    if unstable:
        reasons.append(f"{len(unstable)} of {len(engine_cases)} cases are unstable ({', '.join(unstable)})")
    busy = [format_key(c.key) for c in engine_cases if any(w.startswith(BUSY_PREFIX) for w in c.warnings)]
    if busy:
        reasons.append(f"{len(busy)} of {len(engine_cases)} cases ran while the machine was busier than its cores")
    return reasons
