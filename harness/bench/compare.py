"""Side-by-side comparison of two runs, e.g. rebuilds on two machines.

Unlike the gate this passes no verdict and accepts runs from different
machines: it answers "did the rebuild pick the same kernels and produce the
same bits, and how do speed and accuracy differ". Tactics are compared per
layer name (a case's ``layers``), never by engine bytes,
which differ between two GPUs of one model even when every choice matches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.bench.results import CaseKey, case_order, format_key
from harness.bench.results_doc import Case, Layer, read_run


@dataclass(frozen=True)
class TacticDiff:
    """A layer whose tactic differs; None means the layer is absent on that side."""

    layer: str
    tactic_a: str | None
    tactic_b: str | None


@dataclass
class CaseComparison:
    """``None`` in a field means it could not be compared (missing on a side)."""

    key: CaseKey
    status_a: str
    status_b: str
    weights_equal: bool | None = None
    fingerprints_equal: bool | None = None
    outputs_equal: bool | None = None
    tactic_diffs: list[TacticDiff] | None = None
    latency_ratio: float | None = None
    max_abs_error_delta: float | None = None
    cosine_delta: float | None = None
    task_accuracy_delta: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["key"] = format_key(self.key)
        return out


@dataclass
class Comparison:
    machine_a: str
    machine_b: str
    cases: list[CaseComparison]
    only_in_a: list[CaseKey] = field(default_factory=list)
    only_in_b: list[CaseKey] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine_a": self.machine_a,
            "machine_b": self.machine_b,
            "cases": [c.to_dict() for c in self.cases],
            "only_in_a": [format_key(k) for k in self.only_in_a],
            "only_in_b": [format_key(k) for k in self.only_in_b],
        }


def _equal(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a == b


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def tactic_diffs(layers_a: Sequence[Layer] | None, layers_b: Sequence[Layer] | None) -> list[TacticDiff] | None:
    """Layers whose tactic differs, in the order of ``a`` then layers only in ``b``."""
    if layers_a is None or layers_b is None:
        return None
    a = {layer.name: layer.tactic for layer in layers_a}
    b = {layer.name: layer.tactic for layer in layers_b}
    names = list(a) + [n for n in b if n not in a]
    return [TacticDiff(n, a.get(n), b.get(n)) for n in names if a.get(n) != b.get(n)]


def compare_case(a: Case, b: Case) -> CaseComparison:
    out = CaseComparison(key=a.key, status_a=a.status, status_b=b.status)
    out.weights_equal = _equal(a.model_weights_digest, b.model_weights_digest)
    out.fingerprints_equal = _equal(a.engine_fingerprint, b.engine_fingerprint)
    out.outputs_equal = _equal(a.output_digest, b.output_digest)
    out.tactic_diffs = tactic_diffs(a.layers, b.layers)
    if a.latency is not None and b.latency is not None:
        out.latency_ratio = b.latency.summary.median / a.latency.summary.median
    if a.accuracy is not None and b.accuracy is not None:
        out.max_abs_error_delta = _delta(a.accuracy.max_abs_error, b.accuracy.max_abs_error)
        out.cosine_delta = _delta(a.accuracy.cosine, b.accuracy.cosine)
    ta, tb = a.task_accuracy, b.task_accuracy
    if ta is not None and tb is not None and ta.name == tb.name:
        out.task_accuracy_delta = tb.value - ta.value
    return out


def compare(a_doc: Mapping[str, Any], b_doc: Mapping[str, Any]) -> Comparison:
    """Every case present in both runs (loaded results documents); ratios and deltas are ``b``
    relative to ``a``."""
    a_run, b_run = read_run(a_doc, "run a"), read_run(b_doc, "run b")
    a_cases = {c.key: c for c in a_run.cases}
    b_cases = {c.key: c for c in b_run.cases}
    return Comparison(
        machine_a=a_run.machine.id,
        machine_b=b_run.machine.id,
        cases=[
            compare_case(a_cases[k], b_cases[k]) for k in sorted(a_cases.keys() & b_cases.keys(), key=case_order)
        ],
        only_in_a=sorted(a_cases.keys() - b_cases.keys(), key=case_order),
        only_in_b=sorted(b_cases.keys() - a_cases.keys(), key=case_order),
    )
