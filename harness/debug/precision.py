"""The fastest precision plan that meets an accuracy target, found by running candidates.

A plan keeps a set of layers in fp32 and runs every other layer in the low
precision (:class:`~harness.debug.plan.PrecisionPlan`). The search:

1. **bounds**: everything low, then everything fp32. If even everything in
   fp32 misses the target, no plan can meet it: a clear error, naming the
   best value reached.
2. **sensitivity**: per layer, the outputs' error when only that layer runs
   low (``impact`` of :mod:`harness.debug.layers`, in the target's metric).
   Layers that change nothing are never candidates.
3. **grow**: keep the most sensitive layers in fp32, doubling their number
   until the target is met, then bisect to the shortest such prefix.
4. **prune**: try lowering each kept layer again, least sensitive first,
   and keep it low whenever the target is still met: what remains is a plan
   with no fp32 layer the target does not need.
5. **choose**: the pruned plan, the grown plan and all-fp32 all meet the
   target; they are timed side by side and the pruned plan is replaced only
   by one clearly faster (:mod:`harness.debug.select`).

Every candidate is verified on the backend (:mod:`harness.debug.evaluate`);
nothing is estimated. Every step (layers kept, error, latency) is recorded.
Given the same inputs (and timing cache, on backends that pick kernels by
timing) the search makes the same decisions and writes the same file.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

from harness.autocast import compile
from harness.cache.timing_cache import TimingCache
from harness.debug.evaluate import (
    Evaluation,
    Evaluator,
    LatencyMeter,
    eager_autocast_error,
    measured_latency,
    require_labelled_data,
)
from harness.debug.inputs import Batch
from harness.debug.layers import attribute_errors, reference_graph
from harness.debug.metrics import Target, format_error
from harness.debug.plan import PrecisionPlan
from harness.debug.select import DEFAULT_MIN_SPEEDUP, Finalist, choose
from harness.dtypes import LOW_DTYPES
from harness.engines.protocol import Backend
from harness.errors import HarnessError
from harness.frontend.export import export_program
from harness.globalstate import preserves_global_state
from harness.models import ModelSpec


@dataclass(frozen=True)
class Step:
    """One verified candidate of the search."""

    index: int
    phase: str  # bound | grow | narrow | prune
    kept: tuple[str, ...]
    change: str
    error: float
    met: bool
    latency_ms: float

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "kept": list(self.kept),
            "change": self.change,
            "error": None if math.isinf(self.error) else self.error,
            "nonfinite": math.isinf(self.error),
            "met": self.met,
            "latency_ms": self.latency_ms,
        }


@dataclass
class SearchResult:
    """What the search did and what it chose."""

    model: str
    backend: str
    low: str
    target: Target
    batches: int
    threads: int
    layers: tuple[str, ...]
    sensitivity: list[tuple[str, float]]  # candidate layers, most sensitive first
    steps: list[Step]
    minimal: PrecisionPlan  # the pruned plan: no fp32 layer the target does not need
    chosen: Evaluation
    finalists: list[Finalist]
    min_speedup: float
    cache_entries_added: int = 0

    @property
    def plan(self) -> PrecisionPlan:
        return self.chosen.plan

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "backend": self.backend,
            "low": self.low,
            "target": self.target.to_json(),
            "batches": self.batches,
            "threads": self.threads,
            "layers": list(self.layers),
            "sensitivity": [
                {"layer": name, "impact": None if math.isinf(v) else v, "nonfinite": math.isinf(v)}
                for name, v in self.sensitivity
            ],
            "steps": [step.to_json() for step in self.steps],
            "minimal": list(self.minimal.kept),
            "finalists": [f.to_json() for f in self.finalists],
            "min_speedup": None if math.isinf(self.min_speedup) else self.min_speedup,
            "chosen": {
                "kept": list(self.plan.kept),
                "error": self.chosen.error,
                "latency_ms": self.chosen.latency_ms,
                "explicit": self.plan.explicit(),
            },
        }

    def report(self, top: int = 10) -> str:
        metric = self.target.metric
        lines = [
            f"precision search: model {self.model}, backend {self.backend}, low {self.low}, "
            f"target {self.target.describe()}, {self.batches} batch(es), {self.threads} thread(s); "
            f"{len(self.layers)} layers, {len(self.sensitivity)} sensitive",
            "",
            f"most sensitive layers (outputs' {self.target.ranking_metric} when only this layer runs {self.low}):",
            "  " + ", ".join(f"{name} {format_error(v)}" for name, v in self.sensitivity[:top]),
            "",
        ]
        rows = [
            (s.index, s.phase, len(s.kept), _clip(s.change), format_error(s.error), "yes" if s.met else "no",
             f"{s.latency_ms:.3f}")
            for s in self.steps
        ]  # fmt: skip
        lines.append(tabulate(rows, headers=("step", "phase", "fp32 layers", "change", metric, "met", "latency ms"),
                              disable_numparse=True))  # fmt: skip
        rule = (
            "the pruned plan is kept whatever the timings (--choose pruned)"
            if math.isinf(self.min_speedup)
            else f"the pruned plan unless another is >= {self.min_speedup:.0%} faster with its whole 95% interval"
        )
        lines += ["", f"finalists, timed side by side ({rule}):"]
        for f in self.finalists:
            plan = f.evaluation.plan
            speed = "" if f.speedup is None else f"  x{f.speedup.ratio:.2f} [{f.speedup.low:.2f}, {f.speedup.high:.2f}]"
            mark = "  <- chosen" if f.evaluation is self.chosen else ""
            name = f.role if f.role == _label(plan) else f"{f.role} ({_label(plan)})"
            lines.append(f"  {name:<34} {metric} {format_error(f.evaluation.error)}  "
                         f"{f.latency.median / 1e6:.3f} ms{speed}{mark}")  # fmt: skip
        lines += [
            "",
            f"chosen: {self.plan.describe()}",
            f"  {metric} {format_error(self.chosen.error)} (target {self.target.describe()}), "
            f"latency {_finalist_ms(self):.3f} ms",
        ]
        return "\n".join(lines)


def _finalist_ms(result: SearchResult) -> float:
    return next(f.latency.median / 1e6 for f in result.finalists if f.evaluation is result.chosen)


def _label(plan: PrecisionPlan) -> str:
    if plan.all_fp32:
        return "all fp32"
    if not plan.kept:
        return f"all {plan.low}"
    return f"{len(plan.kept)} layer(s) fp32"


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _changes(sign: str, names: Sequence[str]) -> str:
    return ", ".join(f"{sign}{name}" for name in names)


@preserves_global_state
def search_precision(
    spec: ModelSpec,
    low: str,
    target: Target,
    batches: Sequence[Batch],
    *,
    backend: Backend,
    threads: int = 1,
    cache: TimingCache | None = None,
    meter: LatencyMeter = measured_latency,
    seconds: float = 0.3,
    final_seconds: float = 3.0,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    progress: bool = False,
) -> SearchResult:
    """``harness debug precision``: the plan that meets ``target`` on every batch, fastest on ``backend``.

    ``low`` is "bf16" or "fp16" and must be a mode ``backend`` builds (ONNX
    Runtime refuses bf16 with its reason). ``meter`` times one engine for
    about ``seconds`` (the search's steps) and the finalists for
    ``final_seconds`` in all; ``cache`` is the timing cache builds read and
    extend (a fresh one if None). ``threads`` is pinned for the whole search.
    """
    if low not in LOW_DTYPES:
        raise HarnessError(f"--low {low!r}: valid: {', '.join(LOW_DTYPES)}")
    backend.check_mode(low)  # a backend without kernels for ``low`` says why, before any work
    backend.check_mode("explicit")
    require_labelled_data(spec, target)
    if not min_speedup >= 0:
        raise HarnessError(f"--min-speedup {min_speedup}: must be >= 0")
    torch.set_num_threads(threads)  # restored on return
    if target.limit is None:
        target = target.resolved(eager_autocast_error(spec, batches, target.metric, low))
    program = export_program(spec.module, spec.example_inputs)
    all_low = compile(program, spec.example_inputs, policy="explicit", explicit={".*": low})
    layers = tuple(row.name for row in all_low.report.rows if row.rule == "explicit")
    reference = reference_graph(program, spec.example_inputs, all_low.policy)
    measured, _, _ = attribute_errors(all_low, reference, batches, kept=False)
    decidable = set(layers)
    ranking = target.ranking_metric
    sensitive = sorted(
        (layer for layer in measured if layer.name in decidable and layer.impact.value(ranking) > 0),
        key=lambda layer: (-layer.impact.value(ranking), layer.index),
    )
    order = [layer.name for layer in sensitive]
    # A layer kept in fp32 keeps the views and copies folded into it: lowered alone they would round its result.
    group = {layer.name: layer.nodes for layer in measured}
    evaluator = Evaluator(spec, program, backend, batches, target, threads=threads, cache=cache, meter=meter, seconds=seconds)
    steps: list[Step] = []

    from tqdm import tqdm

    bar = tqdm(desc="precision search", unit="plan", file=sys.stderr, disable=not progress)

    def run(phase: str, kept: Sequence[str], change: str) -> Evaluation:
        plan = PrecisionPlan.keeping(low, layers, [n for name in kept for n in group.get(name, (name,)) if n in decidable])
        if evaluator.verified(plan):
            change += " (verified before)"
        evaluation = evaluator(plan)
        met = target.met(evaluation.error)
        steps.append(Step(len(steps) + 1, phase, evaluation.plan.kept, change, evaluation.error, met, evaluation.latency_ms))
        bar.update()
        bar.set_postfix_str(f"{phase} {len(kept)} fp32, {target.metric} {format_error(evaluation.error)}")
        return evaluation

    try:
        nothing = run("bound", (), f"all {low}")
        everything = run("bound", layers, "all fp32")
        if not target.met(everything.error):
            best = min((nothing, everything), key=lambda e: e.error)
            raise HarnessError(
                f"target {target.describe()} cannot be met on backend {backend.name}, not even with every "
                f"layer in fp32: the best {target.metric} reached is {format_error(best.error)} "
                f"({_label(best.plan)}). Relax the target to at least that"
            )
        if target.met(nothing.error):
            grown = minimal = nothing
        else:
            grown = _grow(run, order, everything, target)
            minimal = _prune(run, grown, order, layers, target)
    finally:
        bar.close()

    unique: dict[frozenset[str], tuple[str, Evaluation]] = {}
    for role, evaluation in (("pruned", minimal), ("grown", grown), ("all fp32", everything)):
        unique.setdefault(frozenset(evaluation.plan.kept), (role, evaluation))
    finalists = list(unique.values())
    index, timed = choose(finalists, meter, tuple(spec.example_inputs), final_seconds, min_speedup)
    return SearchResult(
        model=spec.name,
        backend=backend.name,
        low=low,
        target=target,
        batches=len(batches),
        threads=threads,
        layers=layers,
        sensitivity=[(layer.name, layer.impact.value(ranking)) for layer in sensitive],
        steps=steps,
        minimal=minimal.plan,
        chosen=finalists[index][1],
        finalists=timed,
        min_speedup=min_speedup,
        cache_entries_added=evaluator.added,
    )


Run = Callable[[str, Sequence[str], str], Evaluation]


def _grow(run: Run, order: Sequence[str], everything: Evaluation, target: Target) -> Evaluation:
    """The shortest prefix of ``order`` (most sensitive first) kept fp32 that meets the target.

    Prefixes double until one passes, then the last interval is bisected.
    If no prefix does (the sensitive layers alone are not enough), all fp32.
    """
    tried: dict[int, Evaluation] = {}
    failing, passing, k = 0, None, 1
    while k <= len(order):
        tried[k] = run("grow", order[:k], _changes("+", order[failing:k]))
        if target.met(tried[k].error):
            passing = k
            break
        failing = k
        if k == len(order):
            break
        k = min(2 * k, len(order))
    if passing is None:
        return everything
    while passing - failing > 1:
        middle = (failing + passing) // 2
        tried[middle] = run("narrow", order[:middle], f"first {middle} most sensitive")
        if target.met(tried[middle].error):
            passing = middle
        else:
            failing = middle
    return tried[passing]


def _prune(run: Run, grown: Evaluation, order: Sequence[str], layers: Sequence[str], target: Target) -> Evaluation:
    """Lower each kept layer again, least sensitive first, wherever the target still holds."""
    rank = {name: i for i, name in enumerate(order)}
    position = {name: i for i, name in enumerate(layers)}
    kept = list(grown.plan.kept)
    # Layers never measured as sensitive go first (back to front), then the ranked ones, least first.
    trial_order = sorted(kept, key=lambda name: (name in rank, -rank.get(name, 0), -position[name]))
    current = grown
    for name in trial_order:
        trial = [k for k in kept if k != name]
        evaluation = run("prune", trial, f"-{name}")
        if target.met(evaluation.error):
            kept, current = trial, evaluation
    return current
