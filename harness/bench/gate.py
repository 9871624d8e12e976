"""Regression gate: a run against its machine's baseline.

Latency: a case regresses only when the slowdown is both *large* (ratio of
medians current/baseline above ``1 + latency_threshold``) and *real* (a
one-sided Mann-Whitney U test on the raw samples says current is slower with
``p < alpha``). The threshold keeps statistically real but irrelevant shifts
(0.3% on 5000 samples) from failing CI; the test keeps a noisy median from
doing so. A run's samples are not independent draws, though: on a shared
machine the state drifts between two runs as it does within one, and the test
then calls an 8% shift of an unchanged commit real (p=1e-248 between two runs
of one commit, 2 minutes apart, on a shared 2-core VM). So a slowdown must
also exceed the spread (IQR/median) of a run that the runner marked unstable;
one that does not is reported, not judged (verdict ``unstable``, which ``fail_on_unstable``
fails). The bootstrap interval of the ratio is reported beside it so a reader
sees how uncertain the ratio is. Improvements mirror regressions.

Accuracy regressions are absolute (tolerances in :class:`AccuracyTolerances`,
each a flag of ``harness gate``): more error than the baseline by more than a
fixed amount, or outputs that became non-finite. Determinism regressions are
exact: built from the same timing cache (same digest) the engine fingerprint
must not change, and with an identical engine fingerprint the output digest
must not change.

The gate cannot pass on nothing: a baseline case the run lacks fails it
(unless ``allow_missing``), runs that share no case are refused outright,
an incomplete run fails, and a case whose model weights differ from the
baseline's fails (the two runs measured different models).

Every case gets one verdict, and the run one of three: FAIL (exit 1) when any
case fails; else PASS (exit 0) only when enough cases were *judged* (in both
runs, their latency compared, neither run unstable): ``min_judged`` of them,
by default every baseline case (every case the runs share, with
``allow_missing``); else INCONCLUSIVE (exit :data:`INCONCLUSIVE_EXIT`):
nothing failed, but too little was judged to say the run did not regress.
The counts it prints are counts of cases.

Peer rows (backend ``peer:<name>``, :mod:`harness.bench.peers`) are not
gated, in either run: they time other software (eager PyTorch, ONNX
Runtime, ...), not the commit's engines, so a new PyTorch must not fail a
pull request that changed nothing, and a run without ``--peers`` must not
miss them. The report notes how many were left out.

Two runs whose GPU cases ran at other clock settings (locked against
unlocked, or at other locked clocks) or on other GPUs of the model get a note
naming both sides (:func:`gpu_notes`): a reason for a latency change that is
not the code's, said, never failed on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from harness.bench.results import CaseKey, case_order, format_key
from harness.bench.results_doc import Case, GpuTelemetry, Run, Settings, read_run
from harness.bench.stats import bootstrap_ratio_ci, mann_whitney_u
from harness.errors import HarnessError

Severity = Literal["fail", "improvement", "info"]
Kind = Literal[
    "latency", "accuracy", "non-finite", "determinism", "weights", "failure", "unstable", "missing", "new",
    "warning",
]  # fmt: skip
# A case's verdict: the first failing label in this order, else the first
# informative one in the second order, else "ok". "regression" is latency
# only: an accuracy loss is "accuracy" and a changed engine or output under
# the same cache "determinism", so a reader knows which kind of failure
# (and which fix) a row is without reading its findings.
VERDICT_ORDER: tuple[str, ...] = (
    "failed", "non-finite", "weights-changed", "missing", "accuracy", "determinism", "regression", "unstable",
)  # fmt: skip
INFO_ORDER: tuple[str, ...] = ("non-finite", "missing", "improvement", "new", "unstable", "warning")
_VERDICT_OF_KIND = {
    "failure": "failed",
    "non-finite": "non-finite",
    "weights": "weights-changed",
    "missing": "missing",
    "latency": "regression",
    "accuracy": "accuracy",
    "determinism": "determinism",
    "unstable": "unstable",
    "new": "new",
    "warning": "warning",
}


@dataclass(frozen=True)
class AccuracyTolerances:
    """Largest accepted worsening against the baseline, in absolute units."""

    max_abs_error_increase: float = 1e-3
    cosine_drop: float = 1e-4
    top1_drop: float = 0.01
    task_accuracy_drop: float = 0.005


@dataclass(frozen=True)
class Finding:
    kind: Kind
    severity: Severity
    message: str


@dataclass(frozen=True)
class LatencyDelta:
    """Latency of one case in both runs; ``ratio`` is current/baseline medians."""

    baseline_median_ns: float
    current_median_ns: float
    ratio: float
    p_slower: float
    p_faster: float
    ci_low: float
    ci_high: float


@dataclass
class CaseVerdict:
    key: CaseKey
    findings: list[Finding] = field(default_factory=list)
    latency: LatencyDelta | None = None

    @property
    def fails(self) -> bool:
        return any(f.severity == "fail" for f in self.findings)

    @property
    def verdict(self) -> str:
        """What fails the case, else what a reader should know; a faster case is never a regression."""
        failing = {_VERDICT_OF_KIND[f.kind] for f in self.findings if f.severity == "fail"}
        if failing:
            return next(v for v in VERDICT_ORDER if v in failing)
        info = {"improvement" if f.severity == "improvement" else _VERDICT_OF_KIND[f.kind] for f in self.findings}
        return next((v for v in INFO_ORDER if v in info), "ok")

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": format_key(self.key),
            "verdict": self.verdict,
            "fails": self.fails,
            "latency": asdict(self.latency) if self.latency is not None else None,
            "findings": [asdict(f) for f in self.findings],
        }


# `harness gate`'s exit code when nothing failed but too few cases were judged to pass.
INCONCLUSIVE_EXIT = 3


@dataclass
class GateReport:
    cases: list[CaseVerdict]
    notes: list[str]
    problems: list[str]  # run-level reasons to fail (an incomplete run)
    settings: dict[str, Any]
    judged: int = 0  # cases in both runs whose latency was compared, neither run unstable
    required: int = 0  # cases that must be judged for a PASS

    @property
    def failing(self) -> list[CaseVerdict]:
        return [c for c in self.cases if c.fails]

    @property
    def outcome(self) -> str:
        """FAIL, PASS, or INCONCLUSIVE (nothing failed, fewer than ``required`` cases judged)."""
        if self.failing or self.problems:
            return "FAIL"
        return "PASS" if self.judged >= self.required else "INCONCLUSIVE"

    @property
    def exit_code(self) -> int:
        return {"FAIL": 1, "PASS": 0, "INCONCLUSIVE": INCONCLUSIVE_EXIT}[self.outcome]

    def counts(self) -> dict[str, int]:
        """Cases per verdict (each case counted once)."""
        out: dict[str, int] = {}
        for c in self.cases:
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return out

    def summary(self) -> str:
        counts = ", ".join(f"{n} {v}" for v, n in sorted(self.counts().items(), key=lambda kv: kv[0]))
        text = f"gate {self.outcome}: {len(self.failing)} of {len(self.cases)} cases fail ({counts}); "
        text += f"{self.judged} judged, {self.required} needed"
        if self.outcome == "INCONCLUSIVE":
            text += (
                " (the others missing or unstable: re-run them on a quieter machine, or lower the number "
                "needed with --min-judged or [gate] min_judged)"
            )
        return text + "".join(f"; {p}" for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "outcome": self.outcome,
            "judged": self.judged,
            "required": self.required,
            "summary": self.summary(),
            "counts": self.counts(),
            "problems": self.problems,
            "settings": self.settings,
            "notes": self.notes,
            "cases": [c.to_dict() for c in self.cases],
        }


@dataclass(frozen=True)
class GateSettings:
    latency_threshold: float = 0.05
    alpha: float = 0.01
    tolerances: AccuracyTolerances = AccuracyTolerances()
    fail_on_unstable: bool = False
    allow_missing: bool = False
    # Gate a CPU run against a baseline whose CPU has other ISA extensions.
    ignore_isa: bool = False
    # Cases that must be judged for a PASS; None: every baseline case (every shared case with allow_missing).
    min_judged: int | None = None
    bootstrap_resamples: int = 1000

    def __post_init__(self) -> None:
        if self.latency_threshold < 0 or not 0 < self.alpha < 1:
            raise HarnessError("latency threshold must be >= 0 and alpha strictly between 0 and 1")
        if any(v < 0 for v in asdict(self.tolerances).values()):
            raise HarnessError("accuracy tolerances must not be negative")
        if self.min_judged is not None and self.min_judged < 0:
            raise HarnessError(f"min_judged {self.min_judged}: must be 0 or more")


def _latency(base: Case, cur: Case, s: GateSettings, verdict: CaseVerdict) -> None:
    bl, cl = base.latency, cur.latency
    assert bl is not None and cl is not None  # a case that did not fail was measured (RESULTS_SCHEMA)
    if bl.timer != cl.timer:
        verdict.findings.append(Finding("latency", "info", "timers differ; latency not compared"))
        return
    if base.threads != cur.threads:
        verdict.findings.append(
            Finding("latency", "info", f"threads differ ({base.threads} vs {cur.threads}); latency not compared")
        )
        return
    b, c = bl.samples_ns, cl.samples_ns
    ratio = cl.summary.median / bl.summary.median
    p_slower = mann_whitney_u(c, b, "greater")
    p_faster = mann_whitney_u(c, b, "less")
    ci = bootstrap_ratio_ci(c, b, n_resamples=max(s.bootstrap_resamples, 1), confidence=1 - s.alpha)
    verdict.latency = LatencyDelta(bl.summary.median, cl.summary.median, ratio, p_slower, p_faster, ci.low, ci.high)
    detail = f"median x{ratio:.3f} (threshold {s.latency_threshold:.1%})"
    # Samples are not independent draws: a shared machine drifts between runs as much as
    # within them, so an unstable run resolves no change smaller than its spread, however small p.
    spreads = [lat.summary.spread for lat in (bl, cl) if lat.unstable]
    margin = max([s.latency_threshold, *spreads])
    unjudged: Severity = "fail" if s.fail_on_unstable else "info"
    if ratio > 1 + s.latency_threshold and p_slower < s.alpha:
        if ratio > 1 + margin:
            verdict.findings.append(Finding("latency", "fail", f"slower: {detail}, p={p_slower:.2g}"))
        else:
            verdict.findings.append(
                Finding("unstable", unjudged, f"slower: {detail}, p={p_slower:.2g}, but within the spread of "
                        f"an unstable run (IQR/median {margin:.1%}): not judged; re-run on a quieter machine")
            )  # fmt: skip
    elif ratio < 1 / (1 + margin) and p_faster < s.alpha:
        verdict.findings.append(Finding("latency", "improvement", f"faster: {detail}, p={p_faster:.2g}"))
    for side, lat in (("baseline", bl), ("current", cl)):
        if lat.unstable:
            why = f"spread (IQR/median) {lat.summary.spread:.1%} > {lat.spread_threshold:.1%}"
            if lat.slow_phase is not None:
                why = "a slow phase remained after re-measuring"
            severity: Severity = "fail" if s.fail_on_unstable and side == "current" else "info"
            verdict.findings.append(Finding("unstable", severity, f"{side} run unstable: {why}"))


def _accuracy(base: Case, cur: Case, tol: AccuracyTolerances, verdict: CaseVerdict) -> None:
    ba, ca = base.accuracy, cur.accuracy
    assert ba is not None and ca is not None  # a case that did not fail was measured (RESULTS_SCHEMA)
    if cur.status == "non-finite":
        counts = f"{ca.nan_count} NaN, {ca.inf_count} Inf"
        if base.status != "non-finite":
            verdict.findings.append(Finding("non-finite", "fail", f"outputs became non-finite ({counts})"))
        elif ca.nan_count + ca.inf_count > ba.nan_count + ba.inf_count:
            verdict.findings.append(Finding("non-finite", "fail", f"more non-finite outputs ({counts})"))
        else:
            verdict.findings.append(Finding("non-finite", "info", f"non-finite in both runs ({counts})"))

    def worse(what: str, b: float | None, c: float | None, limit: float, higher_is_worse: bool) -> None:
        if b is None or c is None:
            return
        change = (c - b) if higher_is_worse else (b - c)
        if change > limit:
            verdict.findings.append(Finding("accuracy", "fail", f"{what} {b:.6g} -> {c:.6g} (tolerance {limit:g})"))

    worse("max abs error", ba.max_abs_error, ca.max_abs_error, tol.max_abs_error_increase, True)
    worse("cosine", ba.cosine, ca.cosine, tol.cosine_drop, False)
    worse("top-1 agreement", ba.top1_agreement, ca.top1_agreement, tol.top1_drop, False)
    bt, ct = base.task_accuracy, cur.task_accuracy
    if bt is not None and ct is not None and bt.name == ct.name:
        worse(f"task {bt.name}", bt.value, ct.value, tol.task_accuracy_drop, False)


def _determinism(base: Case, cur: Case, verdict: CaseVerdict, commits: tuple[str | None, str | None]) -> None:
    """Same timing cache (same digest) must give the same engine; same engine, the same bits.

    A cache the user edited on purpose (``harness cache pin``) has another
    digest, so the engine it builds may differ: that is the point of pinning.
    Between two commits the same plan can also run on another runtime (the
    CPU engine's regions changed bits that way): still a failure, since a
    pull request must say so, but the finding names the commits, so the
    reader knows to ask which it was.
    """
    bf, cf = base.engine_fingerprint, cur.engine_fingerprint
    bc, cc = base.timing_cache_digest, cur.timing_cache_digest
    if bc is not None and bc == cc and bf is not None and cf is not None and bf != cf:
        verdict.findings.append(
            Finding("determinism", "fail", f"engine fingerprint changed ({bf} -> {cf}) although both runs "
                    "built from the same timing cache")
        )  # fmt: skip
    bo, co = base.output_digest, cur.output_digest
    if bf is not None and bf == cf and bo is not None and co is not None and bo != co:
        message = "same engine fingerprint but the outputs changed"
        if commits[0] != commits[1]:
            message += (
                f" (the runs are of commits {commits[0] or 'unknown'} and {commits[1] or 'unknown'}: a change "
                "of how a plan runs changes outputs too; if intended, promote a baseline of this commit)"
            )
        verdict.findings.append(Finding("determinism", "fail", message))


def _check_case(base: Case, cur: Case, s: GateSettings, commits: tuple[str | None, str | None]) -> CaseVerdict:
    verdict = CaseVerdict(cur.key)
    if cur.status == "failed":
        severity: Severity = "fail" if base.status != "failed" else "info"
        verdict.findings.append(Finding("failure", severity, f"failed: {cur.error}"))
        return verdict
    if base.status == "failed":
        verdict.findings.append(Finding("new", "info", f"the baseline failed ({base.error}); this run has it"))
        return verdict
    bw, cw = base.model_weights_digest, cur.model_weights_digest
    if bw is not None and cw is not None and bw != cw:
        verdict.findings.append(
            Finding("weights", "fail", "the model's weights differ from the baseline's: the runs measured "
                    "different models (promote a baseline of the new model)")
        )  # fmt: skip
    _latency(base, cur, s, verdict)
    _accuracy(base, cur, s.tolerances, verdict)
    _determinism(base, cur, verdict, commits)
    for side, case in (("baseline", base), ("current", cur)):  # what the runner stored (a busy machine)
        verdict.findings += [Finding("warning", "info", f"{side} run: {w}") for w in case.warnings]
    return verdict


def gate(
    baseline_doc: Mapping[str, Any], current_doc: Mapping[str, Any], settings: GateSettings | None = None
) -> GateReport:
    """Compare a run with its baseline, case by case (documents as loaded by ``load_results``).

    Runs from different machine classes are refused: their latencies are
    not comparable (use :func:`harness.bench.compare.compare` instead); so
    are runs that share no case at all.
    """
    s = settings or GateSettings()
    baseline, current = read_run(baseline_doc, "the baseline"), read_run(current_doc, "the current run")
    base_id, cur_id = baseline.machine.id, current.machine.id
    if base_id != cur_id:
        raise HarnessError(
            f"baseline is from machine {base_id!r} but the run is from {cur_id!r}; "
            "gate a run against the baseline of its own machine"
        )
    if not _has_gpu(baseline) and not _has_gpu(current):
        base_isa, cur_isa = set(baseline.machine.cpu.isa_flags), set(current.machine.cpu.isa_flags)
        if base_isa != cur_isa and not s.ignore_isa:
            raise HarnessError(
                f"baseline and run share machine id {cur_id!r} but not the CPU's ISA (only in the baseline: "
                f"{', '.join(sorted(base_isa - cur_isa)) or '-'}; only in the run: "
                f"{', '.join(sorted(cur_isa - base_isa)) or '-'}); CPU latencies of different ISAs are not "
                "comparable. Promote a baseline on this CPU, or pass --ignore-isa"
            )
    base_cases = {c.key: c for c in baseline.cases if not c.is_peer}
    cur_cases = {c.key: c for c in current.cases if not c.is_peer}
    if not base_cases.keys() & cur_cases.keys():
        raise HarnessError(
            f"the run and the baseline share no case (run: {len(cur_cases)} cases, baseline: "
            f"{len(base_cases)}); nothing can be compared. Bench the baseline's models and modes "
            "(same names, same backend), or promote a new baseline"
        )
    notes: list[str] = []
    peers = sum(c.is_peer for c in current.cases)
    if peers:
        notes.append(f"{peers} peer reference row(s) not gated: they time other software, not this commit's engines")
    problems: list[str] = []
    if not current.complete:
        problems.append("the current run is incomplete (interrupted); finish it with --resume")
    if not baseline.complete:
        notes.append("the baseline is incomplete (interrupted run)")
    changed = settings_differ(baseline.settings, current.settings)
    if changed:
        notes.append("settings differ: " + ", ".join(changed))
    notes += gpu_notes(baseline, current)
    for side, run in (("baseline", baseline), ("current run", current)):
        if run.imported_from is not None:
            notes.append(f"{side}: {run.imported_from.note}")
    commits = (baseline.git.commit, current.git.commit)
    verdicts = [
        _check_case(base_cases[key], cur, s, commits) if key in base_cases
        else CaseVerdict(key, [Finding("new", "info", "not in the baseline (new case)")])
        for key, cur in cur_cases.items()
    ]  # fmt: skip
    missing_severity: Severity = "info" if s.allow_missing else "fail"
    verdicts += [
        CaseVerdict(key, [Finding("missing", missing_severity, "in the baseline but not in this run"
                                  + ("" if s.allow_missing else " (bench it, or gate a subset run with --allow-missing)"))])
        for key in base_cases.keys() - cur_cases.keys()
    ]  # fmt: skip
    verdicts.sort(key=lambda v: case_order(v.key))
    shared = base_cases.keys() & cur_cases.keys()
    judged = sum(1 for v in verdicts if v.key in shared and _judged(v))
    required = s.min_judged if s.min_judged is not None else len(shared if s.allow_missing else base_cases)
    return GateReport(verdicts, notes, problems, {**asdict(s)}, judged, required)


def settings_differ(baseline: Settings, current: Settings) -> list[str]:
    """The names of the settings two runs recorded differently, sorted: a setting one run lacks
    differs from any value but null in the other, and a nested one is named by its top-level field."""
    return sorted(f.name for f in fields(Settings) if getattr(baseline, f.name) != getattr(current, f.name))


def _judged(verdict: CaseVerdict) -> bool:
    """Whether the case's latency was compared with neither run unstable (its accuracy always is)."""
    return verdict.latency is not None and not any(f.kind == "unstable" for f in verdict.findings)


def gpu_notes(baseline: Run, current: Run) -> list[str]:
    """A note, naming both sides, when the runs' GPU cases ran at other clock settings or on other GPUs.

    Clocks: the graphics clock a run locked (``--lock-clocks``) or none; GPUs:
    their UUIDs (one machine id can be many GPUs of a model, each a little
    faster or slower). Both change latency without a change of the code, so
    the reader is told; neither fails the gate.
    """
    base, cur = _gpu_setup(baseline), _gpu_setup(current)
    notes = []
    if base.clocks and cur.clocks and base.clocks != cur.clocks:
        notes.append(
            f"clock settings differ: baseline {base.describe_clocks()}, current {cur.describe_clocks()}; "
            "latency differences may come from the clocks, not the code"
        )
    if base.gpus and cur.gpus and base.gpus != cur.gpus:
        notes.append(
            f"GPUs differ: baseline on {', '.join(sorted(base.gpus))}, current on {', '.join(sorted(cur.gpus))} "
            "(one machine id, other physical GPUs); latency differences may come from the GPU, not the code"
        )
    return notes


@dataclass(frozen=True)
class _GpuSetup:
    """What the GPU cases (timed with CUDA events) of a run ran on: clocks locked (MHz) or None, GPU UUIDs."""

    clocks: frozenset[int | None]
    gpus: frozenset[str]
    request: str | int | None  # the run's --lock-clocks

    def describe_clocks(self) -> str:
        described = sorted(
            "graphics clock not locked" if mhz is None else f"graphics clock locked at {mhz} MHz"
            for mhz in self.clocks
        )
        flag = "" if self.request is None else f" (--lock-clocks {self.request})"
        return " and ".join(described) + flag


def _gpu_setup(run: Run) -> _GpuSetup:
    """A case without a clock record (an older file, or no NVML) counts as not locked: nothing could lock it."""
    clocks: set[int | None] = set()
    gpus: set[str] = set()
    for case in run.cases:
        if case.is_peer or case.latency is None or case.latency.timer != "cuda":
            continue
        gpu = case.telemetry.gpu if case.telemetry is not None else None
        if not isinstance(gpu, GpuTelemetry):  # None, or why telemetry had no GPU
            clocks.add(None)
            continue
        clocks.add(gpu.clocks.locked_graphics_mhz if gpu.clocks is not None else None)
        if gpu.uuid is not None:
            gpus.add(gpu.uuid)
    return _GpuSetup(frozenset(clocks), frozenset(gpus), run.settings.lock_clocks)


def _has_gpu(run: Run) -> bool:
    return bool(run.machine.gpu.devices)
