"""Verify one precision plan by running it: compile, build on the backend, measure.

Nothing about a candidate is estimated: each plan is compiled from the
exported program exactly as ``build --mode explicit`` compiles its file
(explicit mode, default compiler settings), built into an engine on the
chosen backend, run on every batch against eager fp32, and timed. Builds
share one timing cache, so a layer typed the same way in two candidates is
timed once and keeps its tactic (and its rounding) from candidate to
candidate. Results are memoized by the set of layers kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram

from harness.autocast import CompiledGraph, compile
from harness.bench.accuracy import compare_outputs
from harness.bench.latency import measure_device_latency, measure_latency, measure_overhead
from harness.bench.runner import GPU_BACKENDS
from harness.bench.stats import Summary
from harness.cache.timing_cache import TimingCache
from harness.debug.inputs import Batch
from harness.debug.metrics import TASK_METRIC, ErrorStats, Target
from harness.debug.plan import FP32, PrecisionPlan
from harness.dtypes import LOW_DTYPES
from harness.engines.device import DeviceEngine
from harness.engines.protocol import Backend, BuildConfig, Engine
from harness.errors import HarnessError
from harness.models import ModelSpec
from harness.precision import PrecisionMode

# meter(engine, inputs, seconds) -> latency samples (ns). Tests inject a deterministic one.
LatencyMeter = Callable[[Engine, tuple[torch.Tensor, ...], float], Summary]



def measured_latency(engine: Engine, inputs: tuple[torch.Tensor, ...], seconds: float) -> Summary:
    """The bench's latency loop on ``engine`` for about ``seconds`` (samples in ns).

    An engine of a GPU backend is timed as ``harness bench`` times it: its
    GPU compute time, its inputs staged on the device once
    (:func:`~harness.bench.latency.measure_device_latency`); any other on the host clock.
    """
    warmup_s = min(0.1, seconds / 4)
    with torch.inference_mode():
        if engine.backend in GPU_BACKENDS and torch.cuda.is_available() and isinstance(engine, DeviceEngine):
            query = engine.stage(*inputs)
            return measure_device_latency(query, warmup_s=warmup_s, min_iters=5, min_duration_s=seconds).summary
        return measure_latency(
            lambda: engine(*inputs), warmup_s=warmup_s, min_iters=5, min_duration_s=seconds, overhead=_overhead()
        ).summary


@functools.cache
def _overhead() -> Summary:
    """The host timing loop's own cost, measured once per process (stored, not subtracted)."""
    return measure_overhead()


def require_labelled_data(spec: ModelSpec, target: Target) -> None:
    """A task-accuracy target needs the model's labelled data; refused before any work otherwise."""
    if target.metric == TASK_METRIC and spec.evaluate is None:
        raise HarnessError(
            f"--target {target.describe()}: model {spec.name!r} has no labelled data "
            "(ModelSpec.evaluate); use max-abs-err, max-rel-err or 1-cosine"
        )


@dataclass
class Evaluation:
    """One verified plan: its error on every batch, and its latency."""

    plan: PrecisionPlan
    errors: list[float]  # per batch, under the target's metric (one value for task accuracy)
    latency: Summary
    engine: Engine | None = field(default=None, repr=False)  # kept while it may still be a finalist

    @property
    def error(self) -> float:
        """The worst over batches: a plan meets a target only if every batch does."""
        return max(self.errors)

    @property
    def latency_ms(self) -> float:
        return self.latency.median / 1e6


class Evaluator:
    """Builds and measures plans of one model on one backend, with a shared timing cache."""

    def __init__(
        self,
        spec: ModelSpec,
        program: ExportedProgram,
        backend: Backend,
        batches: Sequence[Batch],
        target: Target,
        *,
        threads: int,
        cache: TimingCache | None = None,
        meter: LatencyMeter = measured_latency,
        seconds: float = 0.3,
    ) -> None:
        self.spec = spec
        self.program = program
        self.backend = backend
        self.batches = list(batches)
        self.target = target
        self.meter = meter
        self.seconds = seconds
        self.config = BuildConfig(mode=PrecisionMode.EXPLICIT, threads=threads)
        self.cache = cache if cache is not None else TimingCache(backend.provenance(self.config))
        self.added = 0  # entries this search put in the cache
        self.memo: dict[frozenset[str], Evaluation] = {}
        with torch.inference_mode():
            self.references = [spec.module(*batch) for batch in self.batches]
        self.task_reference: float | None = None
        require_labelled_data(spec, target)
        if spec.evaluate is not None and target.metric == TASK_METRIC:
            with torch.inference_mode():
                self.task_reference = float(spec.evaluate(spec.module))

    def compile(self, plan: PrecisionPlan) -> CompiledGraph:
        """The typed graph of ``plan``, refused if the compiler did not apply it as written."""
        compiled = compile(self.program, self.spec.example_inputs, policy="explicit", explicit=plan.explicit())
        kept = set(plan.kept)
        wrong = [
            row.name
            for row in compiled.report.rows
            if row.rule == "explicit" and row.precision in (FP32, plan.low) and (row.precision == FP32) != (row.name in kept)
        ]
        if wrong:
            raise HarnessError(
                f"the explicit plan does not type {', '.join(wrong)} as intended: a pattern also matches "
                "another node's module path; rename the module or pass the plan by hand"
            )
        return compiled

    def verified(self, plan: PrecisionPlan) -> bool:
        return frozenset(plan.kept) in self.memo

    def __call__(self, plan: PrecisionPlan) -> Evaluation:
        key = frozenset(plan.kept)
        if key in self.memo:
            return self.memo[key]
        compiled = self.compile(plan)
        engine, log = self.backend.build(compiled, self.config, self.cache)
        for entry in log.new_entries:
            if self.cache.query(entry.key) is None:
                self.cache.update(entry)
                self.added += 1
        errors = self._errors(engine)
        latency = self.meter(engine, tuple(self.spec.example_inputs), self.seconds)
        evaluation = Evaluation(plan, errors, latency, engine)
        self.memo[key] = evaluation
        return evaluation

    def _errors(self, engine: Engine) -> list[float]:
        if self.target.metric == TASK_METRIC:
            assert self.spec.evaluate is not None and self.task_reference is not None
            with torch.inference_mode():
                value = float(self.spec.evaluate(engine))
            return [self.task_reference - value if math.isfinite(value) else math.inf]
        out = []
        with torch.inference_mode():
            for batch, reference in zip(self.batches, self.references, strict=True):
                stats = ErrorStats.of(compare_outputs(engine(*batch), reference))
                out.append(stats.value(self.target.metric))
        return out


def eager_autocast_error(spec: ModelSpec, batches: Sequence[Batch], metric: str, low: str) -> float:
    """Eager ``torch.autocast("cpu", low)``'s error against eager fp32, worst over ``batches``."""
    dtype = LOW_DTYPES[low]
    worst = 0.0
    with torch.inference_mode():
        for batch in batches:
            reference = spec.module(*batch)
            with torch.autocast("cpu", dtype=dtype):
                out = spec.module(*batch)
            worst = max(worst, ErrorStats.of(compare_outputs(out, reference)).value(metric))
    return worst

