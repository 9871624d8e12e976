"""Regression gate: a run against its machine's baseline.

Latency: a case regresses only when the slowdown is both *large* (ratio of
medians current/baseline above ``1 + latency_threshold``) and *real* (a
one-sided Mann-Whitney U test on the raw samples says current is slower with
``p < alpha``). The threshold keeps statistically real but irrelevant shifts
(0.3% on 5000 samples) from failing CI; the test keeps a noisy median from
doing so. Mann-Whitney rather than the bootstrap decides because it uses the
whole distribution, needs no resampling and is exact to reproduce; the
bootstrap interval of the ratio is still computed and reported so a reader
sees how uncertain the ratio is. Improvements mirror regressions: ratio below
``1 / (1 + latency_threshold)`` and significant in the other direction.

Accuracy regressions are absolute (tolerances in :class:`AccuracyTolerances`):
more error than the baseline by more than a fixed amount, or any new NaN/Inf.
Determinism regressions are exact: with a pinned timing cache (the case says
``pinned``, the run's settings say ``"pinned": true``, or both runs used a
cache with the same digest) the engine
fingerprint must not change, and with an identical engine fingerprint the
output digest must not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from harness.bench.results import CaseKey, case_key, format_key
from harness.bench.stats import bootstrap_ratio_ci, mann_whitney_u
from harness.errors import HarnessError

Severity = Literal["regression", "improvement", "info"]
Kind = Literal["latency", "accuracy", "determinism", "failure", "unstable", "missing"]


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
    ci_low: float | None
    ci_high: float | None


@dataclass
class CaseVerdict:
    key: CaseKey
    findings: list[Finding] = field(default_factory=list)
    latency: LatencyDelta | None = None

    @property
    def verdict(self) -> str:
        """The most severe finding: regression > improvement > unstable/missing/failed > ok."""
        severities = {f.severity for f in self.findings}
        if "regression" in severities:
            return "regression"
        if "improvement" in severities:
            return "improvement"
        for kind in ("missing", "unstable", "failure"):
            if any(f.kind == kind for f in self.findings):
                return kind
        return "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": format_key(self.key),
            "verdict": self.verdict,
            "latency": asdict(self.latency) if self.latency is not None else None,
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass
class GateReport:
    cases: list[CaseVerdict]
    notes: list[str]
    settings: dict[str, Any]

    @property
    def regressions(self) -> list[tuple[CaseKey, Finding]]:
        return [(c.key, f) for c in self.cases for f in c.findings if f.severity == "regression"]

    @property
    def improvements(self) -> list[tuple[CaseKey, Finding]]:
        return [(c.key, f) for c in self.cases for f in c.findings if f.severity == "improvement"]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "settings": self.settings,
            "notes": self.notes,
            "cases": [c.to_dict() for c in self.cases],
        }


def _latency(
    base: Mapping[str, Any],
    cur: Mapping[str, Any],
    threshold: float,
    alpha: float,
    resamples: int,
    verdict: CaseVerdict,
) -> None:
    if base["timer"] != cur["timer"]:
        verdict.findings.append(
            Finding(
                "latency",
                "info",
                f"timers differ ({base['timer']} vs {cur['timer']}); latency not compared",
            )
        )
        return
    b, c = base["samples_ns"], cur["samples_ns"]
    ratio = cur["summary"]["median"] / base["summary"]["median"]
    p_slower = mann_whitney_u(c, b, "greater").pvalue
    p_faster = mann_whitney_u(c, b, "less").pvalue
    ci = (
        bootstrap_ratio_ci(c, b, n_resamples=resamples, confidence=1 - alpha) if resamples else None
    )
    verdict.latency = LatencyDelta(
        baseline_median_ns=base["summary"]["median"],
        current_median_ns=cur["summary"]["median"],
        ratio=ratio,
        p_slower=p_slower,
        p_faster=p_faster,
        ci_low=ci.low if ci else None,
        ci_high=ci.high if ci else None,
    )
    detail = f"median x{ratio:.3f} (threshold {threshold:.1%})"
    if ratio > 1 + threshold and p_slower < alpha:
        verdict.findings.append(
            Finding("latency", "regression", f"slower: {detail}, p={p_slower:.2g}")
        )
    elif ratio < 1 / (1 + threshold) and p_faster < alpha:
        verdict.findings.append(
            Finding("latency", "improvement", f"faster: {detail}, p={p_faster:.2g}")
        )
    for side, lat in (("baseline", base), ("current", cur)):
        if lat["unstable"]:
            cov = lat["summary"]["cov"]
            verdict.findings.append(
                Finding(
                    "unstable",
                    "info",
                    f"{side} run unstable: CoV {cov:.1%} > {lat['cov_threshold']:.1%}",
                )
            )


def _accuracy(
    base: Mapping[str, Any], cur: Mapping[str, Any], tol: AccuracyTolerances, verdict: CaseVerdict
) -> None:
    def worse(
        what: str, b: float | None, c: float | None, limit: float, higher_is_worse: bool
    ) -> None:
        if b is None or c is None:
            return
        change = (c - b) if higher_is_worse else (b - c)
        if change > limit:
            verdict.findings.append(
                Finding(
                    "accuracy", "regression", f"{what} {b:.6g} -> {c:.6g} (tolerance {limit:g})"
                )
            )

    ba, ca = base.get("accuracy"), cur.get("accuracy")
    if ba is not None and ca is not None:
        worse(
            "max abs error",
            ba["max_abs_error"],
            ca["max_abs_error"],
            tol.max_abs_error_increase,
            True,
        )
        worse("cosine", ba["cosine"], ca["cosine"], tol.cosine_drop, False)
        worse(
            "top-1 agreement",
            ba.get("top1_agreement"),
            ca.get("top1_agreement"),
            tol.top1_drop,
            False,
        )
        for count in ("nan_count", "inf_count"):
            if ca[count] > ba[count]:
                verdict.findings.append(
                    Finding("accuracy", "regression", f"{count} {ba[count]} -> {ca[count]}")
                )
    bt, ct = base.get("task_accuracy"), cur.get("task_accuracy")
    if bt is not None and ct is not None and bt["name"] == ct["name"]:
        worse(f"task {bt['name']}", bt["value"], ct["value"], tol.task_accuracy_drop, False)


def _determinism(
    base: Mapping[str, Any], cur: Mapping[str, Any], run_pinned: bool, verdict: CaseVerdict
) -> None:
    bf, cf = base.get("engine_fingerprint"), cur.get("engine_fingerprint")
    bc, cc = base.get("timing_cache_digest"), cur.get("timing_cache_digest")
    pinned = run_pinned or bool(cur.get("pinned")) or (bc is not None and bc == cc)
    if pinned and bf is not None and cf is not None and bf != cf:
        verdict.findings.append(
            Finding(
                "determinism",
                "regression",
                f"engine fingerprint changed ({bf} -> {cf}) although the timing cache is pinned",
            )
        )
    bo, co = base.get("output_digest"), cur.get("output_digest")
    if bf is not None and bf == cf and bo is not None and co is not None and bo != co:
        verdict.findings.append(
            Finding("determinism", "regression", "same engine fingerprint but the outputs changed")
        )


def _check_case(
    base: Mapping[str, Any],
    cur: Mapping[str, Any],
    *,
    threshold: float,
    alpha: float,
    tol: AccuracyTolerances,
    resamples: int,
    fail_on_unstable: bool,
    run_pinned: bool,
) -> CaseVerdict:
    verdict = CaseVerdict(case_key(cur))
    if cur["status"] == "failed":
        severity: Severity = "regression" if base["status"] == "ok" else "info"
        verdict.findings.append(Finding("failure", severity, f"failed: {cur['error']}"))
        return verdict
    if base["status"] == "failed":
        verdict.findings.append(
            Finding("failure", "info", f"baseline failed ({base['error']}); now ok")
        )
        return verdict
    if base.get("latency") is not None and cur.get("latency") is not None:
        _latency(base["latency"], cur["latency"], threshold, alpha, resamples, verdict)
    _accuracy(base, cur, tol, verdict)
    _determinism(base, cur, run_pinned, verdict)
    if fail_on_unstable:
        verdict.findings = [
            Finding(f.kind, "regression", f.message) if f.kind == "unstable" else f
            for f in verdict.findings
        ]
    return verdict


def gate(
    baseline_doc: Mapping[str, Any],
    current_doc: Mapping[str, Any],
    *,
    latency_threshold: float = 0.05,
    alpha: float = 0.01,
    accuracy_tolerances: AccuracyTolerances | None = None,
    fail_on_unstable: bool = False,
    bootstrap_resamples: int = 1000,
) -> GateReport:
    """Compare a run with its baseline, case by case (documents as loaded by ``load_results``).

    Runs from different machine classes are refused: their latencies are
    not comparable (use :func:`harness.bench.compare.compare` instead).
    """
    if latency_threshold < 0 or not 0 < alpha < 1:
        raise HarnessError("latency threshold must be >= 0 and alpha strictly between 0 and 1")
    base_id, cur_id = baseline_doc["machine"]["id"], current_doc["machine"]["id"]
    if base_id != cur_id:
        raise HarnessError(
            f"baseline is from machine {base_id!r} but the run is from {cur_id!r}; "
            "gate a run against the baseline of its own machine"
        )
    tol = accuracy_tolerances or AccuracyTolerances()
    notes: list[str] = []
    for name, doc in (("baseline", baseline_doc), ("current run", current_doc)):
        if not doc["complete"]:
            notes.append(f"{name} is incomplete (interrupted run)")
    changed = sorted(
        k
        for k in set(baseline_doc["settings"]) | set(current_doc["settings"])
        if baseline_doc["settings"].get(k) != current_doc["settings"].get(k)
    )
    if changed:
        notes.append("settings differ: " + ", ".join(changed))

    base_cases = {case_key(c): c for c in baseline_doc["cases"]}
    cur_cases = {case_key(c): c for c in current_doc["cases"]}
    verdicts: list[CaseVerdict] = []
    for key, cur in cur_cases.items():
        if key not in base_cases:
            verdicts.append(
                CaseVerdict(key, [Finding("missing", "info", "not in the baseline (new case)")])
            )
            continue
        verdicts.append(
            _check_case(
                base_cases[key],
                cur,
                threshold=latency_threshold,
                alpha=alpha,
                tol=tol,
                resamples=bootstrap_resamples,
                fail_on_unstable=fail_on_unstable,
                run_pinned=current_doc["settings"].get("pinned") is True,
            )
        )
    for key in base_cases.keys() - cur_cases.keys():
        verdicts.append(
            CaseVerdict(key, [Finding("missing", "info", "in the baseline but not in this run")])
        )
    verdicts.sort(key=lambda v: v.key)
    return GateReport(
        cases=verdicts,
        notes=notes,
        settings={
            "latency_threshold": latency_threshold,
            "alpha": alpha,
            "accuracy_tolerances": asdict(tol),
            "fail_on_unstable": fail_on_unstable,
            "bootstrap_resamples": bootstrap_resamples,
        },
    )
