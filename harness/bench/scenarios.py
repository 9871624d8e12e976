"""Serving scenarios, in MLPerf LoadGen's terms: the load generators and their statistics.

Single-query latency says little about what a precision mode buys a server:
under load, queries wait for each other, and the question is how much
throughput a mode sustains within a latency bound. The four scenarios:

* ``single-stream`` (the default): one query at a time; latency percentiles.
  This is the measurement of :mod:`harness.bench.latency`, unchanged.
* ``offline``: every sample available at once; the workers take calls as fast
  as they finish them, and the figure is throughput (samples per second).
  Across a batch sweep, the best batch size is the one with the highest
  offline throughput (:func:`harness.bench.scenario_tables.best_offline`).
* ``multi-stream``: a query of ``samples_per_query`` samples every
  ``interval_s``; a query's latency is from its scheduled start to the end of
  its last sample.
* ``server``: queries arriving as a Poisson process at ``target_rate`` per
  second (:func:`poisson_arrivals`: exponential inter-arrival times drawn
  from a generator seeded with ``seed``, so a schedule is the same in every
  run); each query's latency is from its scheduled arrival to its end,
  queueing included. The run reports the achieved rate and the p99 against
  ``latency_bound_s``; with ``find_rate`` the highest rate whose p99 meets the
  bound is found by search (:func:`find_rate`).

Concurrency: ``concurrency`` workers, each with an engine of its own (a
replica: on CPU backends a thread whose engine runs with the run's pinned
intra-op thread count, and the workers' threads together never exceed the
cores; on the GPU an execution context on a CUDA stream of its own, as
``trtexec --streams``). Workers take the next call off one shared schedule,
wait for its arrival time if it lies ahead, and run it: ``concurrency``
servers on one queue. Timing is the host clock (``perf_counter_ns``), which
sees what a client sees.

Only the schedules are random, and they are seeded; latencies are measured.
The statistics of a run (:class:`LoadRun`) keep every query's latency, so the
gate tests scenario runs on their raw samples as it tests single-stream ones.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.bench.stats import Summary
from harness.errors import HarnessError

SINGLE_STREAM = "single-stream"
SCENARIOS = (SINGLE_STREAM, "offline", "multi-stream", "server")
# MLPerf LoadGen's multi-stream query size, and the interval its earlier rounds used.
DEFAULT_SAMPLES_PER_QUERY = 8
DEFAULT_INTERVAL_S = 0.05
# A search probes at most this many rates; it stops earlier once the bracket is this narrow.
SEARCH_STEPS = 10
SEARCH_TOLERANCE = 0.05
MAX_RATE = 1e6
MAX_CONCURRENCY = 256


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:g}ms"


@dataclass(frozen=True)
class Scenario:
    """One scenario and its parameters (see the module docstring)."""

    name: str = SINGLE_STREAM
    concurrency: int = 1
    samples_per_query: int = DEFAULT_SAMPLES_PER_QUERY
    interval_s: float = DEFAULT_INTERVAL_S
    target_rate: float | None = None
    latency_bound_s: float | None = None
    find_rate: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in SCENARIOS:
            raise HarnessError(f"--scenario {self.name!r}: valid: {', '.join(SCENARIOS)}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise HarnessError(f"--concurrency {self.concurrency}: valid: 1..{MAX_CONCURRENCY}")
        if self.name == SINGLE_STREAM and self.concurrency != 1:
            raise HarnessError("--concurrency: single-stream runs one query at a time; use offline, multi-stream or server")
        if self.name == "server":
            if self.find_rate == (self.target_rate is not None):
                raise HarnessError("--scenario server needs --target-rate QPS or --find-rate (one of them)")
            if self.find_rate and self.latency_bound_s is None:
                raise HarnessError("--find-rate needs --latency-bound (the p99 the found rate must meet)")
            if self.target_rate is not None and not 0 < self.target_rate <= MAX_RATE:
                raise HarnessError(f"--target-rate {self.target_rate:g}: valid: above 0, at most {MAX_RATE:g} queries/s")
        elif self.find_rate or self.target_rate is not None:
            raise HarnessError(f"--target-rate and --find-rate are server-scenario flags; not for {self.name}")
        if self.latency_bound_s is not None and not 0 < self.latency_bound_s <= 3600:
            raise HarnessError(f"--latency-bound {self.latency_bound_s:g}s: valid: above 0, at most an hour")
        if self.name != "multi-stream" and (
            self.samples_per_query != DEFAULT_SAMPLES_PER_QUERY or self.interval_s != DEFAULT_INTERVAL_S
        ):
            raise HarnessError("--samples-per-query and --query-interval are multi-stream flags")
        if not 1 <= self.samples_per_query <= 1 << 16:
            raise HarnessError(f"--samples-per-query {self.samples_per_query}: valid: 1..65536")
        if not 0 < self.interval_s <= 3600:
            raise HarnessError(f"--query-interval {self.interval_s:g}s: valid: above 0, at most an hour")

    @property
    def single_stream(self) -> bool:
        return self.name == SINGLE_STREAM

    def label(self) -> str:
        """The scenario and every parameter its numbers depend on: what case keys compare."""
        if self.name == SINGLE_STREAM:
            return SINGLE_STREAM
        parts: list[str] = []
        if self.name == "multi-stream":
            parts += [f"n={self.samples_per_query}", f"interval={_ms(self.interval_s)}"]
        if self.name == "server":
            parts.append("find-rate" if self.find_rate else f"rate={self.target_rate:g}/s")
        if self.latency_bound_s is not None:
            parts.append(f"bound={_ms(self.latency_bound_s)}")
        if self.concurrency != 1:
            parts.append(f"c={self.concurrency}")
        return self.name + (f"[{','.join(parts)}]" if parts else "")

    def params(self) -> dict[str, Any]:
        """The parameters as the results record them."""
        return {
            "concurrency": self.concurrency,
            "samples_per_query": self.samples_per_query if self.name == "multi-stream" else None,
            "interval_s": self.interval_s if self.name == "multi-stream" else None,
            "target_rate": self.target_rate,
            "latency_bound_s": self.latency_bound_s,
            "find_rate": self.find_rate,
            "seed": self.seed,
        }


def label_of(case: Mapping[str, Any]) -> str:
    """A results case's scenario label; a case without one (every file before scenarios) is single-stream."""
    scenario = case.get("scenario")
    return str(scenario["label"]) if isinstance(scenario, Mapping) else SINGLE_STREAM


def parse_duration(text: str, flag: str) -> float:
    """``10ms``, ``250us``, ``0.5s`` (a bare number is milliseconds) as seconds."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|µs|ms|s)?\s*", text)
    if not match:
        raise HarnessError(f"{flag} {text!r}: expected a duration such as 10ms, 250us or 0.5s")
    value = float(match.group(1))
    scale = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[match.group(2)]
    seconds = value * scale
    if not math.isfinite(seconds) or seconds <= 0:
        raise HarnessError(f"{flag} {text!r}: must be above zero")
    return seconds


# --- schedules --------------------------------------------------------------------------


def poisson_arrivals(rate: float, count: int, seed: int) -> np.ndarray:
    """Arrival times (seconds from 0) of ``count`` queries of a Poisson process at ``rate`` per second.

    The inter-arrival times are exponential with mean ``1/rate``, drawn from a
    NumPy generator seeded with ``seed`` (the same schedule in every run; no
    global random state is used). The first query arrives after the first gap.
    """
    if not rate > 0 or count < 1:
        raise HarnessError(f"a Poisson schedule needs a rate above 0 and at least one query (rate {rate}, count {count})")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.cumsum(gaps)


def fixed_arrivals(interval_s: float, count: int) -> np.ndarray:
    """Arrival times of ``count`` queries every ``interval_s`` seconds, the first at 0."""
    return np.arange(count, dtype=np.float64) * interval_s


# --- the load generator ---------------------------------------------------------------------


Call = Callable[[], object]


@dataclass(frozen=True)
class LoadRun:
    """One run of a load generator: every query's latency and when it all happened."""

    latencies_ns: tuple[int, ...]  # per query, from its arrival to its last call's end
    service_ns: tuple[int, ...]  # per call, its own duration
    span_ns: int  # from the first arrival to the last end
    samples_per_query: int
    concurrency: int

    @property
    def queries(self) -> int:
        return len(self.latencies_ns)

    @property
    def achieved_rate(self) -> float:
        """Queries completed per second over the run's span."""
        return self.queries / (self.span_ns / 1e9) if self.span_ns > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Samples completed per second over the run's span."""
        return self.achieved_rate * self.samples_per_query

    def summary(self) -> Summary:
        return Summary.from_samples(self.latencies_ns, unit="ns")


def run_load(
    workers: Sequence[Call],
    arrivals_s: Sequence[float] | np.ndarray,
    calls_per_query: int = 1,
    samples_per_query: int = 1,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> LoadRun:
    """Serve ``len(arrivals_s)`` queries, each ``calls_per_query`` calls, on ``len(workers)`` workers.

    Query ``q``'s calls become available at ``arrivals_s[q]`` seconds after the
    start; each worker repeatedly takes the next available call (waiting for
    its arrival if it lies ahead) and runs it with its own callable. A
    worker's exception stops the run and is raised. Offline runs pass
    arrivals of zero: every call is available at once.
    """
    arrivals = np.asarray(arrivals_s, dtype=np.float64)
    total = len(arrivals) * calls_per_query
    ends = [0] * total
    starts = [0] * total
    next_call = [0]
    lock = threading.Lock()
    failure: list[BaseException] = []
    begin = clock() + 1_000_000  # the workers are all waiting when the first query arrives
    due = [begin + int(a * 1e9) for a in arrivals]

    def serve(call: Call) -> None:
        while True:
            with lock:
                index = next_call[0]
                if index >= total or failure:
                    return
                next_call[0] = index + 1
            arrival = due[index // calls_per_query]
            wait = arrival - clock()
            if wait > 0:
                time.sleep(wait / 1e9)
            start = clock()
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                with lock:
                    failure.append(exc)
                return
            starts[index], ends[index] = start, clock()

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers[1:]]
    for thread in threads:
        thread.start()
    serve(workers[0])
    for thread in threads:
        thread.join()
    if failure:
        raise failure[0]
    latencies = tuple(
        max(1, max(ends[q * calls_per_query : (q + 1) * calls_per_query]) - due[q]) for q in range(len(arrivals))
    )
    service = tuple(max(1, e - s) for s, e in zip(starts, ends, strict=True))
    return LoadRun(latencies, service, max(1, max(ends) - due[0]), samples_per_query, len(workers))


# --- the rate search ------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One server run at ``rate`` queries per second: its achieved rate, p50 and p99 latency."""

    rate: float
    achieved: float
    p50_ns: float
    p99_ns: float
    met: bool  # p99 within the bound

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "achieved": self.achieved, "p50_ns": self.p50_ns, "p99_ns": self.p99_ns, "met": self.met}


@dataclass(frozen=True)
class RateSearch:
    """The highest probed rate whose p99 met the bound (None: none did), the lowest probed rate
    above it (which did not meet it; None when the search stopped at its ceiling), every probe."""

    found: Probe | None
    above: Probe | None
    ceiling: float
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "found": None if self.found is None else self.found.to_dict(),
            "above": None if self.above is None else self.above.to_dict(),
            "ceiling": self.ceiling,
            "probes": [p.to_dict() for p in self.probes],
        }


def find_rate(
    probe: Callable[[float], Probe],
    start: float,
    ceiling: float,
    *,
    floor: float | None = None,
    steps: int = SEARCH_STEPS,
    tolerance: float = SEARCH_TOLERANCE,
) -> RateSearch:
    """The highest rate (queries/s) at which ``probe`` meets its bound, by search.

    From ``start``, the rate doubles while it meets the bound (up to
    ``ceiling``) or halves while it does not (down to ``floor``, default
    ``start / 1024``); then the bracket between the highest rate that met the
    bound and the lowest above it that did not is bisected (geometrically)
    until it is narrower than ``tolerance`` or the search has made ``steps``
    probes (the bracketing itself always ends: at ``ceiling`` or ``floor``).
    Every probe is kept, so a reader can check the answer: the found rate's
    own p99 met the bound, and the next probed rate above it did not (or the
    found rate is the ceiling).
    """
    if not 0 < start <= ceiling:
        raise HarnessError(f"rate search: need 0 < start ({start:g}) <= ceiling ({ceiling:g})")
    floor = start / 1024 if floor is None else floor
    probes: list[Probe] = []

    def at(rate: float) -> Probe:
        result = probe(rate)
        probes.append(result)
        return result

    low: Probe | None = None
    high: Probe | None = None
    first = at(start)
    if first.met:
        low = first
        while low.rate < ceiling:
            step = at(min(ceiling, low.rate * 2))
            if not step.met:
                high = step
                break
            low = step
    else:
        high = first
        while high.rate > floor:
            step = at(max(floor, high.rate / 2))
            if step.met:
                low = step
                break
            high = step
    if low is not None and high is not None:
        while len(probes) < steps and high.rate / low.rate > 1 + tolerance:
            mid = at(math.sqrt(low.rate * high.rate))
            if mid.met:
                low = mid
            else:
                high = mid
    return RateSearch(low, high, ceiling, probes)
