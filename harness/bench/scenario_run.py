"""A scenario case of ``harness bench``: an engine's replicas under a load generator.

:func:`measure_scenario` is what the bench runner calls for a case whose
scenario is not single-stream (:mod:`harness.bench.scenarios` defines them):
it makes ``concurrency`` replicas of the built engine, warms each up, and
runs the scenario's load on them, sampling telemetry around it. Its result
is the case's ``latency`` (every query's latency as raw samples, so the gate
tests scenario cases on them as it tests single-stream ones) and the
``scenario`` record: parameters, achieved rate, throughput, p50/p99 against
the bound, and for ``--find-rate`` every probe of the search.

How long: a load run issues enough queries for ``min_duration_s`` at its
rate, and at least :data:`MIN_P99_QUERIES` (a p99 of fewer is little more
than the slowest query: one stall of a shared machine would decide it),
within ``min_iters``..``max_iters``; each probe of a rate search is one such run. Offline runs as many calls as the workers finish in
``min_duration_s`` by the warm-up's estimate of one call's time.

Replicas: an engine that makes its own (``replica()``: a TensorRT engine's
extra execution context on a CUDA stream of its own) makes them; any other
is saved once and loaded again by its backend, which checks the copy's
fingerprint, so every worker runs the same plan.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from harness.bench.latency import DEFAULT_SPREAD_THRESHOLD, LatencyResult
from harness.bench.scenarios import (
    MAX_RATE,
    LoadRun,
    Probe,
    RateSearch,
    Scenario,
    find_rate,
    fixed_arrivals,
    poisson_arrivals,
    run_load,
)
from harness.bench.stats import Summary
from harness.bench.telemetry import TelemetrySampler
from harness.errors import HarnessError

if TYPE_CHECKING:
    from harness.engines.protocol import Engine


class _Timing(Protocol):
    """The timing settings a scenario reads (:class:`harness.bench.runner.MeasureSettings`)."""

    @property
    def threads(self) -> int: ...
    @property
    def warmup_s(self) -> float: ...
    @property
    def min_duration_s(self) -> float: ...
    @property
    def min_iters(self) -> int: ...
    @property
    def max_iters(self) -> int: ...
    @property
    def spread_threshold(self) -> float | None: ...
    @property
    def telemetry_interval_s(self) -> float: ...


class CaseRunner(Protocol):
    """What a scenario needs of the bench runner that calls it (:class:`harness.bench.runner.BenchRunner`)."""

    @property
    def backend(self) -> Any: ...
    @property
    def settings(self) -> _Timing: ...
    def gpu_index(self) -> int | None: ...
    def overhead(self) -> Summary: ...

# Queueing spreads a loaded run's latencies by design: the stability flag of server and
# multi-stream cases uses this IQR/median bound (the schema's largest), not single-stream's.
LOADED_SPREAD_THRESHOLD = 10.0
# The search's first rate, and its ceiling, as fractions of what the workers could serve
# back to back by the warm-up's estimate (concurrency / one call's time).
SEARCH_START = 0.5
SEARCH_CEILING = 4.0
# Queries of a server or multi-stream run at least, so its p99 is not just its slowest query.
MIN_P99_QUERIES = 200


def scenario_stub(scenario: Scenario) -> dict[str, Any]:
    """The scenario record of a case that failed before it was measured (its key needs the label)."""
    return {"name": scenario.name, "label": scenario.label(), "params": scenario.params()}


def check_cores(scenario: Scenario, threads: int, cpus: int | None = None) -> None:
    """Refuse workers whose intra-op threads together exceed the machine's cores."""
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    if scenario.concurrency * threads > cores:
        raise HarnessError(
            f"--concurrency {scenario.concurrency} with --threads {threads}: {scenario.concurrency * threads} "
            f"intra-op threads on {cores} cores; each worker runs with --threads of them, so keep "
            f"concurrency x threads <= {cores}"
        )


def replicas(engine: Engine, backend: Any, count: int) -> list[Engine]:
    """``engine`` and ``count - 1`` more of it (see the module docstring)."""
    made = [engine]
    maker = getattr(engine, "replica", None)
    if count > 1 and callable(maker):
        return made + [maker() for _ in range(count - 1)]
    if count > 1:
        with tempfile.TemporaryDirectory(prefix="harness-replica-") as tmp:
            path = Path(tmp) / "engine"
            engine.save(path)
            made += [backend.load(path) for _ in range(count - 1)]
    return made


def _calls(engines: list[Engine], inputs: tuple[torch.Tensor, ...]) -> list[Callable[[], object]]:
    """One call per worker; each enters inference mode itself (it is per thread: the runner's
    covers only its own)."""

    def call_of(engine: Engine) -> Callable[[], object]:
        def call() -> object:
            with torch.inference_mode():
                return engine(*inputs)

        return call

    return [call_of(e) for e in engines]


def _warm(calls: list[Callable[[], object]], seconds: float) -> tuple[int, float, float]:
    """Warm every worker for ``seconds`` in turn: (calls made, seconds spent, median call time in s)."""
    times: list[float] = []
    begin = time.perf_counter()
    for call in calls:
        deadline = time.perf_counter() + max(seconds / len(calls), 0.0)
        while True:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
            if time.perf_counter() >= deadline:
                break
    return len(times), time.perf_counter() - begin, statistics.median(times)


def _count(rate_per_s: float, runner: CaseRunner, least: int = 1) -> int:
    """Queries (calls, offline) of a run at ``rate_per_s``: ``min_duration_s`` of them, at least ``least``."""
    s = runner.settings
    return max(s.min_iters, min(s.max_iters, max(least, math.ceil(rate_per_s * s.min_duration_s))))


def measure_scenario(
    runner: CaseRunner, engine: Engine, inputs: tuple[torch.Tensor, ...], batch: int, scenario: Scenario
) -> tuple[LatencyResult, Any, dict[str, Any]]:
    """The case's latency, telemetry and scenario record (see the module docstring); ``batch`` is
    the samples of one engine call."""
    s = runner.settings
    gpu = runner.gpu_index()
    if gpu is None:  # workers on the host share its cores; on the GPU each is a stream
        check_cores(scenario, s.threads)
    calls = _calls(replicas(engine, runner.backend, scenario.concurrency), inputs)
    warm_iters, warm_s, service_s = _warm(calls, s.warmup_s)
    bound_ns = None if scenario.latency_bound_s is None else scenario.latency_bound_s * 1e9
    capacity = scenario.concurrency / max(service_s, 1e-9)  # calls per second, back to back
    search: RateSearch | None = None
    sampler = (
        TelemetrySampler(interval_s=s.telemetry_interval_s)
        if gpu is None
        else TelemetrySampler(interval_s=s.telemetry_interval_s, gpu_index=gpu)
    )
    with sampler:
        if scenario.name == "offline":
            run = run_load(calls, np.zeros(_count(capacity, runner)), samples_per_query=batch)
        elif scenario.name == "multi-stream":
            per_query = math.ceil(scenario.samples_per_query / batch)
            arrivals = fixed_arrivals(scenario.interval_s, _count(1 / scenario.interval_s, runner, MIN_P99_QUERIES))
            run = run_load(calls, arrivals, calls_per_query=per_query, samples_per_query=per_query * batch)
        elif scenario.find_rate:
            assert bound_ns is not None
            runs: dict[float, LoadRun] = {}

            def probe(rate: float) -> Probe:
                count = _count(rate, runner, MIN_P99_QUERIES)
                result = run_load(calls, poisson_arrivals(rate, count, scenario.seed), samples_per_query=batch)
                runs[rate] = result
                summary = result.summary()
                return Probe(rate, result.achieved_rate, summary.median, summary.p99, summary.p99 <= bound_ns)

            ceiling = min(MAX_RATE, SEARCH_CEILING * capacity)
            search = find_rate(probe, min(ceiling, SEARCH_START * capacity), ceiling)
            kept = search.found or min(search.probes, key=lambda p: p.rate)
            run = runs[kept.rate]
        else:
            assert scenario.target_rate is not None
            rate = scenario.target_rate
            count = _count(rate, runner, MIN_P99_QUERIES)
            run = run_load(calls, poisson_arrivals(rate, count, scenario.seed), samples_per_query=batch)
    samples = run.service_ns if scenario.name == "offline" else run.latencies_ns
    if scenario.name in ("server", "multi-stream"):
        threshold = LOADED_SPREAD_THRESHOLD
    else:
        threshold = s.spread_threshold if s.spread_threshold is not None else DEFAULT_SPREAD_THRESHOLD["cpu"]
    latency = LatencyResult(
        summary=Summary.from_samples(samples, unit="ns"),
        iterations=len(samples),
        duration_s=run.span_ns / 1e9,
        warmup_iterations=warm_iters,
        warmup_s=warm_s,
        timer="cpu",
        batch_size=batch if scenario.name == "offline" else run.samples_per_query,
        spread_threshold=threshold,
        slow_phase=None,
        remeasured=False,
        overhead=runner.overhead(),
    )
    queries = latency.summary  # offline: each call's own time (every call "arrived" at the start)
    warnings = []
    met = None if bound_ns is None else queries.p99 <= bound_ns
    if search is not None and search.found is None and bound_ns is not None:
        warnings.append(
            f"no probed rate met the {bound_ns / 1e6:g} ms bound (lowest probed: "
            f"{min(p.rate for p in search.probes):.3g}/s); the latency shown is that lowest rate's"
        )
    record = {
        "name": scenario.name,
        "label": scenario.label(),
        "params": scenario.params(),
        "queries": run.queries,
        "samples_per_query": run.samples_per_query,
        "concurrency": scenario.concurrency,
        "achieved_rate": run.achieved_rate,
        "throughput_per_s": run.throughput,
        "p50_ns": queries.median,
        "p99_ns": queries.p99,
        "latency_bound_ns": bound_ns,
        "met_bound": met,
        "search": None if search is None else search.to_dict(),
        "warnings": warnings,
    }
    return latency, sampler.summary(), record
