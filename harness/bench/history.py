"""A machine's benchmark history: its runs, one series per case, markers, gate verdicts and steps.

:func:`collect` reads results directories (``results/<machine>/``, or a
results root holding several) or files, every document validated by
:func:`harness.bench.results.load_results` (schema-1 files upgraded, as
``harness report`` reads them), and builds a :class:`History`:

* per machine id, its runs in time order (the time a run finished, else
  started), each with its commit, date, flags (complete, ``--quick``,
  upgraded from schema 1) and, when the machine has a ``baseline.json``,
  the gate's outcome against it (:func:`harness.bench.gate.gate` with its
  default settings: what ``harness gate --current RUN`` says today). The
  baseline is the run it was promoted from (the same document but its
  ``promoted`` record), or a point of its own when that run is not there;
* per case (model, mode, backend, batch; peers' reference rows too, never
  gated), a point per run that has it: median latency with its quartiles
  and spread, the error against the reference, the engine fingerprint, the
  case's gate verdict;
* markers where a case's engine fingerprint changed (a rebuild picked other
  tactics, or the code built another engine), where the machine it ran on
  changed (hardware, drivers, software versions; not the hostname, which CI
  runners change every job) and where its clocks changed (``--lock-clocks``,
  the GPU's clock settings);
* step changes of each case's median latency (:mod:`harness.bench.step_detect`),
  each with the last run before and the first run after it: the commit range
  where the regression (or improvement) happened. ``--quick`` runs and failed
  cases are shown but not fitted.

Memory: one run document (and each machine's baseline), as loaded and typed, is held at a time;
what the history keeps of a run is a few numbers per case.

The history is a JSON document (:meth:`History.to_dict`, for other tools)
and a Markdown summary (:func:`markdown_summary`, for a CI job summary);
:mod:`harness.bench.dashboard` draws it as HTML.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.bench.clocks import NamedClock
from harness.bench.gate import GateSettings, gate
from harness.bench.results import CaseKey, content_digest, format_key, load_results
from harness.bench.results_doc import PEER_PREFIX, Case, GpuTelemetry, Machine, Run, read_run
from harness.bench.step_detect import fit_steps
from harness.bench.store import BASELINE, machine_files
from harness.bench.tables import format_ns
from harness.documents import document_json
from harness.errors import HarnessError

HISTORY_VERSION = 1
MarkerKind = Literal["fingerprint", "machine", "clock"]
MARKER_KINDS: tuple[MarkerKind, ...] = ("fingerprint", "machine", "clock")

# The gate's verdicts never depend on its bootstrap interval (it is reported beside the
# ratio, not judged): the history computes a token one, which takes a thousandth of the time.
_VERDICT_ONLY_RESAMPLES = 2
# Fields of the machine record that change without the machine changing.
VOLATILE_MACHINE_FIELDS = frozenset({"hostname"})


@dataclass
class RunInfo:
    """One run of a machine, as the history shows it; ``index`` is its place in time order."""

    index: int
    file: str
    machine_id: str
    commit: str | None
    dirty: bool | None
    created: str
    finished: str | None
    complete: bool
    quick: bool
    upgraded: bool
    digest: str
    machine: Machine = field(repr=False)
    lock_clocks: NamedClock | int | None = None
    baseline: bool = False
    gate_outcome: str | None = None  # PASS, FAIL, INCONCLUSIVE; None: not gated
    gate_summary: str | None = None
    gate_note: str | None = None  # why it was not gated

    @property
    def time(self) -> str:
        """When the run finished (else started): the history's order, as ``harness gate`` picks the newest."""
        return self.finished or self.created

    @property
    def date(self) -> str:
        """``YYYY-MM-DD HH:MM`` (UTC) of :attr:`time`."""
        return self.time.replace("T", " ")[:16]

    @property
    def short_commit(self) -> str:
        text = self.commit[:8] if self.commit else "no commit"
        return text + ("+dirty" if self.dirty else "")

    @property
    def label(self) -> str:
        return f"{self.short_commit} {self.date}"

    @functools.cached_property
    def machine_signature(self) -> dict[str, Any]:
        """What a machine marker compares of the run's machine record: its fields as JSON but the
        volatile ones (:data:`VOLATILE_MACHINE_FIELDS`); a field the file left out is null."""
        return {k: v for k, v in document_json(self.machine).items() if k not in VOLATILE_MACHINE_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        machine = self.machine
        return {
            "index": self.index,
            "file": self.file,
            "commit": self.commit,
            "dirty": self.dirty,
            "created": self.created,
            "finished": self.finished,
            "complete": self.complete,
            "quick": self.quick,
            "upgraded": self.upgraded,
            "digest": self.digest,
            "baseline": self.baseline,
            "gate": None if self.gate_outcome is None else {"outcome": self.gate_outcome, "summary": self.gate_summary},
            "gate_note": self.gate_note,
            "machine": {
                "hostname": machine.hostname,
                "cpu": machine.cpu.model,
                "torch": None if machine.torch is None else machine.torch.version,
                "tensorrt": machine.tensorrt,
            },
            "lock_clocks": self.lock_clocks,
        }


@dataclass
class Point:
    """One case in one run."""

    run: int
    status: str
    median_ns: float | None = None
    q1_ns: float | None = None
    q3_ns: float | None = None
    spread: float | None = None
    unstable: bool = False
    timer: str | None = None
    max_abs_error: float | None = None
    cosine: float | None = None
    engine_fingerprint: str | None = None
    timing_cache_digest: str | None = None
    error: str | None = None
    verdict: str | None = None  # the gate's; "baseline" for the baseline run; None: not gated
    findings: list[str] = field(default_factory=list)
    clocks: Any = None  # (--lock-clocks, the GPU's clock settings): what a clock marker compares
    gpu: str | None = None  # the GPU's UUID, part of what a machine marker compares

    @property
    def timed(self) -> bool:
        return self.median_ns is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "status": self.status,
            "median_ns": self.median_ns,
            "q1_ns": self.q1_ns,
            "q3_ns": self.q3_ns,
            "spread": self.spread,
            "unstable": self.unstable,
            "max_abs_error": self.max_abs_error,
            "cosine": self.cosine,
            "engine_fingerprint": self.engine_fingerprint,
            "timing_cache_digest": self.timing_cache_digest,
            "error": self.error,
            "verdict": self.verdict,
            "findings": self.findings,
        }


@dataclass(frozen=True)
class Marker:
    """A change seen at run ``run`` against the case's previous point."""

    kind: MarkerKind
    run: int
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "run": self.run, "detail": self.detail}


@dataclass(frozen=True)
class FoundStep:
    """A step of a case's median latency between two runs (``last_before`` and ``first_after``, run indices)."""

    kind: Literal["regression", "improvement"]
    ratio: float
    before_ns: float
    after_ns: float
    threshold: float
    last_before: int
    first_after: int
    coincides_with: tuple[str, ...]


@dataclass(frozen=True)
class Level:
    """The fitted median latency of runs ``first`` to ``last`` (run indices, inclusive)."""

    first: int
    last: int
    median_ns: float


@dataclass
class Series:
    machine_id: str
    key: CaseKey
    points: list[Point] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    steps: list[FoundStep] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)

    @property
    def name(self) -> str:
        return format_key(self.key)

    @property
    def peer(self) -> bool:
        return _is_peer(self.key)


def _is_peer(key: CaseKey) -> bool:
    """Whether the case of a key is a peer's reference row (its backend ``peer:<name>``)."""
    return key[2].startswith(PEER_PREFIX)


@dataclass
class MachineHistory:
    id: str
    runs: list[RunInfo]
    series: list[Series]
    baseline_file: str | None
    notes: list[str]

    @property
    def baseline_run(self) -> RunInfo | None:
        return next((r for r in self.runs if r.baseline), None)

    def step_dict(self, series: Series, step: FoundStep) -> dict[str, Any]:
        before, after = self.runs[step.last_before], self.runs[step.first_after]
        return {
            "case": series.name,
            "kind": step.kind,
            "ratio": step.ratio,
            "before_ns": step.before_ns,
            "after_ns": step.after_ns,
            "threshold": step.threshold,
            "last_before": {"run": before.index, "commit": before.commit, "time": before.time, "file": before.file},
            "first_after": {"run": after.index, "commit": after.commit, "time": after.time, "file": after.file},
            "coincides_with": list(step.coincides_with),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "baseline_file": self.baseline_file,
            "notes": self.notes,
            "runs": [r.to_dict() for r in self.runs],
            "series": [
                {
                    "case": s.name,
                    "model": s.key[0],
                    "mode": s.key[1],
                    "backend": s.key[2],
                    "batch": s.key[3],
                    "peer": s.peer,
                    "points": [p.to_dict() for p in s.points],
                    "markers": [m.to_dict() for m in s.markers],
                    "levels": [{"first_run": lv.first, "last_run": lv.last, "median_ns": lv.median_ns} for lv in s.levels],
                    "steps": [self.step_dict(s, st) for st in s.steps],
                }
                for s in self.series
            ],
        }


@dataclass
class History:
    machines: list[MachineHistory]
    sources: list[str]
    min_step: float
    generated: str

    @property
    def run_count(self) -> int:
        return sum(len(m.runs) for m in self.machines)

    def steps(self) -> list[tuple[MachineHistory, Series, FoundStep]]:
        """Every step found, regressions first, then by size of the change."""
        found = [(m, s, st) for m in self.machines for s in m.series for st in s.steps]
        return sorted(found, key=lambda f: (f[2].kind != "regression", -abs(f[2].ratio - 1)))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the history (``history_version`` 1); run indices join points, markers
        and steps to ``machines[].runs``."""
        return {
            "history_version": HISTORY_VERSION,
            "generated": self.generated,
            "sources": self.sources,
            "settings": {"min_step": self.min_step},
            "steps": [m.step_dict(s, st) | {"machine": m.id} for m, s, st in self.steps()],
            "machines": [m.to_dict() for m in self.machines],
        }


# --- finding the files -------------------------------------------------------------------


@dataclass(frozen=True)
class _Sources:
    runs: list[Path]
    baselines: list[Path]
    notes: list[str]


def find_sources(paths: Sequence[str | os.PathLike[str]]) -> _Sources:
    """The results files under ``paths``: each a machine directory (``run-*.json``, ``baseline.json``),
    a results root (its subdirectories are machine directories) or a results file.

    Shard files (``-shard<i>of<n>``) are left out, with a note: their
    cases are in the merged run. A path that does not exist, or a directory
    with no results file in it or its subdirectories, is an error naming it.
    """
    runs: list[Path] = []
    baselines: list[Path] = []
    shards: list[Path] = []
    for given in paths:
        p = Path(given)
        if not p.exists():
            raise HarnessError(
                f"{p}: no such file or directory; give results/<machine>/ directories, a results root "
                "(such as results/) or results files"
            )
        if p.is_file():
            (baselines if p.name == BASELINE else runs).append(p)
            continue
        if not p.is_dir():
            raise HarnessError(f"{p}: not a directory nor a regular file")
        files = machine_files(p)
        found, shard = files.runs, files.shards
        own_baselines = [] if files.baseline is None else [files.baseline]
        if not found and files.baseline is None:  # a results root: one machine directory per subdirectory
            for sub in sorted(d for d in p.iterdir() if d.is_dir()):
                in_sub = machine_files(sub)
                found += in_sub.runs
                shard += in_sub.shards
                own_baselines += [] if in_sub.baseline is None else [in_sub.baseline]
        if not found and not own_baselines:
            raise HarnessError(
                f"{p}: no results files (run-*.json or baseline.json) in it or in its subdirectories; give "
                "a directory `harness bench` wrote runs to (results/<machine>/) or a results root"
            )
        runs += found
        baselines += own_baselines
        shards += shard
    notes = [f"{len(shards)} shard file(s) left out (their cases are in the run merged from them)"] if shards else []
    return _Sources(_unique(runs), _unique(baselines), notes)


def _unique(paths: Iterable[Path]) -> list[Path]:
    seen: dict[Path, Path] = {}
    for p in paths:
        seen.setdefault(p.resolve(), p)
    return list(seen.values())


# --- reading runs ------------------------------------------------------------------------


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a.b.c`` keys; anything else (lists too) is a value."""
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def describe_change(before: Any, after: Any, limit: int = 4) -> str:
    """What differs between two records, as ``key: old -> new`` (at most ``limit``, then a count)."""
    a, b = _flat(before), _flat(after)
    changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]

    def shown(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    parts = [f"{k or 'value'}: {shown(a.get(k))} -> {shown(b.get(k))}" for k in changed[:limit]]
    if len(changed) > limit:
        parts.append(f"and {len(changed) - limit} more")
    return "; ".join(parts)


def _gpu(case: Case) -> GpuTelemetry | None:
    """The GPU record of a case's telemetry; None without telemetry, or with only why it had no GPU."""
    gpu = case.telemetry.gpu if case.telemetry is not None else None
    return gpu if isinstance(gpu, GpuTelemetry) else None


def _point(run: RunInfo, case: Case) -> Point:
    lat, acc, gpu = case.latency, case.accuracy, _gpu(case)
    clocks = None if gpu is None or gpu.clocks is None else document_json(gpu.clocks)
    point = Point(
        run=run.index,
        status=case.status,
        max_abs_error=None if acc is None else acc.max_abs_error,
        cosine=None if acc is None else acc.cosine,
        engine_fingerprint=case.engine_fingerprint,
        timing_cache_digest=case.timing_cache_digest,
        error=case.error,
        clocks={"lock_clocks": run.lock_clocks, "gpu": clocks},
        gpu=None if gpu is None else gpu.uuid,
    )
    if lat is not None:
        summary = lat.summary
        point.median_ns, point.q1_ns, point.q3_ns = summary.median, summary.q1, summary.q3
        point.spread, point.unstable, point.timer = summary.spread, lat.unstable, lat.timer
    return point


@dataclass
class _Run:
    info: RunInfo
    points: dict[CaseKey, Point]


@dataclass(frozen=True)
class _Loaded:
    """A results file as loaded (what the gate and the digests read) and typed."""

    path: Path
    doc: Mapping[str, Any]
    run: Run


def _load(path: Path, *, upgrade: bool = False) -> _Loaded:
    """The results file at ``path``, validated (:func:`load_results`) and typed; a HarnessError names it."""
    doc = load_results(path, upgrade=upgrade)
    return _Loaded(path, doc, read_run(doc, f"results file {path}"))


def _run_info(loaded: _Loaded) -> RunInfo:
    run = loaded.run
    return RunInfo(
        index=-1,
        file=os.fspath(loaded.path),
        machine_id=run.machine.id,
        commit=run.git.commit,
        dirty=run.git.dirty,
        created=run.created,
        finished=run.finished,
        complete=run.complete,
        quick=bool(run.settings.quick),
        upgraded=run.upgraded_from is not None,
        digest=run.digest,
        machine=run.machine,
        lock_clocks=run.settings.lock_clocks,
    )


def _read_run(loaded: _Loaded, baseline: _Loaded | None) -> _Run:
    """A run's record and points, gated against ``baseline`` (when given and not this run itself)."""
    info = _run_info(loaded)
    points = {c.key: _point(info, c) for c in loaded.run.cases}
    if baseline is None:
        info.gate_note = "no baseline.json for this machine"
    elif info.upgraded:
        info.gate_note = "an old (schema 1) results file: the gate does not read it"
    else:
        try:
            settings = GateSettings(bootstrap_resamples=_VERDICT_ONLY_RESAMPLES)
            report = gate(baseline.doc, loaded.doc, settings)
        except HarnessError as exc:
            info.gate_note = f"not gated against {baseline.path}: {exc}"
        else:
            info.gate_outcome, info.gate_summary = report.outcome, report.summary()
            for verdict in report.cases:
                if verdict.key in points:
                    points[verdict.key].verdict = verdict.verdict
                    points[verdict.key].findings = [f.message for f in verdict.findings]
    return _Run(info, points)


def _source_digest(baseline: Mapping[str, Any]) -> str:
    """The digest of the run a baseline was promoted from (the baseline is that run plus ``promoted``)."""
    return content_digest({k: v for k, v in baseline.items() if k != "promoted"})


def _promoted_at(run: Run) -> str:
    """When a baseline was promoted (else created)."""
    at = run.promoted.at if run.promoted is not None else None
    return at or run.created


def _load_baselines(paths: Sequence[Path], notes: list[str]) -> dict[str, _Loaded]:
    """Each machine's baseline; of two for one machine, the one promoted (else created) later, with a note."""
    chosen: dict[str, _Loaded] = {}
    for path in paths:
        loaded = _load(path)
        machine = loaded.run.machine.id
        other = chosen.get(machine)
        if other is not None and other.run.digest != loaded.run.digest:
            later = _promoted_at(loaded.run) > _promoted_at(other.run)
            keep, drop = (loaded, other.path) if later else (other, path)
            notes.append(
                f"machine {machine}: two baselines ({keep.path}, {drop}); the later promoted one, "
                f"{keep.path}, is used"
            )
            chosen[machine] = keep
        else:
            chosen.setdefault(machine, loaded)
    return chosen


def collect(
    paths: Sequence[str | os.PathLike[str]],
    *,
    min_step: float = GateSettings().latency_threshold,
    generated: str | None = None,
) -> History:
    """The history of the results under ``paths`` (see :func:`find_sources`).

    ``min_step``: the smallest relative change of a case's median reported as
    a step (default: the gate's latency threshold); a step must also exceed
    the run-to-run spread the results record. Every file is validated: a
    corrupt, unreadable or foreign file is a HarnessError naming it.
    """
    from harness.bench.results import utc_now

    if not 0 <= min_step < 10:
        raise HarnessError(f"min_step {min_step}: must be between 0 and 10 (1000%)")
    sources = find_sources(paths)
    notes = list(sources.notes)
    baselines = _load_baselines(sources.baselines, notes)
    by_machine: dict[str, list[_Run]] = {}
    seen: dict[str, str] = {}
    for path in sources.runs:
        loaded = _load(path, upgrade=True)
        digest = loaded.run.digest
        if digest in seen:
            notes.append(f"{path} is the same run as {seen[digest]}; read once")
            continue
        seen[digest] = os.fspath(path)
        machine = loaded.run.machine.id
        baseline = baselines.get(machine)
        if baseline is not None and digest == _source_digest(baseline.doc):
            run = _read_run(loaded, None)
            _mark_baseline(run, baseline.path)
        else:
            run = _read_run(loaded, baseline)
        by_machine.setdefault(machine, []).append(run)
    for machine, baseline in baselines.items():
        runs = by_machine.setdefault(machine, [])
        if not any(r.info.baseline for r in runs):  # the run it came from is not among the files read
            run = _read_run(baseline, None)
            _mark_baseline(run, baseline.path)
            runs.append(run)
    baseline_files = {machine: baseline.path for machine, baseline in baselines.items()}
    machines = [
        _machine_history(machine, runs, baseline_files.get(machine), min_step)
        for machine, runs in sorted(by_machine.items())
    ]
    if not machines:
        raise HarnessError(f"no runs in {', '.join(os.fspath(p) for p in paths)}")
    if notes:
        machines[0].notes[:0] = notes
    return History(machines, [os.fspath(p) for p in paths], min_step, generated or utc_now())


def _mark_baseline(run: _Run, baseline_file: Path | None) -> None:
    run.info.baseline = True
    run.info.gate_note = f"the baseline ({baseline_file})"
    for point in run.points.values():
        point.verdict = "baseline"


def _machine_history(machine: str, runs: list[_Run], baseline_file: Path | None, min_step: float) -> MachineHistory:
    runs.sort(key=lambda r: (r.info.time, r.info.created, r.info.file))
    for i, run in enumerate(runs):
        run.info.index = i
        for point in run.points.values():
            point.run = i
    keys = list(dict.fromkeys(k for run in runs for k in run.points))  # order of first appearance
    keys.sort(key=_is_peer)  # engines first, peers after (stable)
    series = []
    for key in keys:
        s = Series(machine, key, [run.points[key] for run in runs if key in run.points])
        s.markers = _markers(s.points, [r.info for r in runs])
        _fit(s, [r.info for r in runs], min_step)
        series.append(s)
    notes = [] if baseline_file is not None else [f"no baseline.json for machine {machine}: no gate verdicts"]
    return MachineHistory(
        machine,
        [r.info for r in runs],
        series,
        None if baseline_file is None else os.fspath(baseline_file),
        notes,
    )


def _markers(points: Sequence[Point], runs: Sequence[RunInfo]) -> list[Marker]:
    """Where a case's fingerprint, machine or clocks differ from its previous point's."""
    markers: list[Marker] = []
    for prev, cur in zip(points, points[1:], strict=False):
        pf, cf = prev.engine_fingerprint, cur.engine_fingerprint
        if pf is not None and cf is not None and pf != cf:
            cache = "same timing cache" if prev.timing_cache_digest == cur.timing_cache_digest else "timing cache changed"
            markers.append(Marker("fingerprint", cur.run, f"engine fingerprint {pf[:15]}... -> {cf[:15]}... ({cache})"))
        before = {**runs[prev.run].machine_signature, "gpu_uuid": prev.gpu}
        after = {**runs[cur.run].machine_signature, "gpu_uuid": cur.gpu}
        if before != after:
            markers.append(Marker("machine", cur.run, describe_change(before, after)))
        if prev.clocks != cur.clocks:
            markers.append(Marker("clock", cur.run, describe_change(prev.clocks, cur.clocks)))
    return markers


def _fit(series: Series, runs: Sequence[RunInfo], min_step: float) -> None:
    """Levels and steps of the series' medians, over its timed points of full (not ``--quick``) runs."""
    fitted = [p for p in series.points if p.timed and not runs[p.run].quick]
    if not fitted:
        return
    fit = fit_steps(
        [p.median_ns or 0.0 for p in fitted], [p.spread or 0.0 for p in fitted], min_change=min_step
    )
    series.levels = [Level(fitted[s.start].run, fitted[s.end - 1].run, s.level) for s in fit.segments]
    for step in fit.steps:
        before, after = fitted[step.index - 1].run, fitted[step.index].run
        near = [f"{m.kind} change: {m.detail}" for m in series.markers if before < m.run <= after]
        if runs[before].commit is not None and runs[before].commit == runs[after].commit:
            near.append("both runs are of the same commit: not a change of the code")
        series.steps.append(
            FoundStep(step.kind, step.ratio, step.before, step.after, step.threshold, before, after, tuple(near))
        )


# --- Markdown ------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_summary(history: History) -> str:
    """A short Markdown report: per machine its runs, baseline and newest gate outcome, then every
    step found (regressions first) with its commit range."""
    lines = ["## Benchmark history", ""]
    lines.append(f"{_count(history.run_count, 'run')} on {_count(len(history.machines), 'machine')}; "
                 f"steps are reported beyond the run-to-run spread and {history.min_step:.1%}.")  # fmt: skip
    lines.append("")
    for m in history.machines:
        base = m.baseline_run
        newest = m.runs[-1]
        text = f"**{_md(m.id)}**: {_count(len(m.runs), 'run')}, {m.runs[0].date} to {newest.date} UTC"
        text += f"; baseline {base.short_commit} ({base.date})" if base is not None else "; no baseline"
        if newest.gate_outcome is not None:
            text += f"; newest run: {_md(newest.gate_summary or newest.gate_outcome)}"
        lines += [text + ".", ""]
        lines += [f"- note: {_md(n)}" for n in m.notes]
        if m.notes:
            lines.append("")
    steps = history.steps()
    if not steps:
        lines.append("No step change beyond the run-to-run spread in any case.")
        return "\n".join(lines) + "\n"
    lines += [
        "| machine | case | change | median | last run before | first run after | coincides with |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, s, st in steps:
        before, after = m.runs[st.last_before], m.runs[st.first_after]
        lines.append(
            f"| {_md(m.id)} | {_md(s.name)} | {st.kind} x{st.ratio:.3f} | {format_ns(st.before_ns)} -> "
            f"{format_ns(st.after_ns)} | `{before.short_commit}` {before.date} | `{after.short_commit}` "
            f"{after.date} | {_md('; '.join(st.coincides_with)) or '-'} |"
        )
    return "\n".join(lines) + "\n"

