"""The scenario table: latency against throughput per precision mode, for scenario runs.

One row per scenario case (:mod:`harness.bench.scenarios`): the throughput it
achieved (samples per second), its query latency (p50, p99) and, for a
bound, whether the p99 met it; a ``--find-rate`` row gives the rate found and
the next probed rate above it. Offline rows of a batch sweep mark the best
batch size. Single-stream cases stay in the per-case table.
"""

from __future__ import annotations

from harness.bench.results_doc import Case, Run


def _ms(ns: float | None) -> str:
    return "" if ns is None else f"{ns / 1e6:.3g} ms"


def _offline_batch(case: Case) -> int | None:
    """The batch size of a measured offline case; None for any other case."""
    if case.status == "failed" or case.latency is None or case.scenario is None or case.scenario.name != "offline":
        return None
    return case.latency.batch_size


def best_offline(cases: list[Case]) -> dict[tuple[str, str, str], int]:
    """(model, mode, backend) -> the batch size with the highest offline throughput among ``cases``."""
    best: dict[tuple[str, str, str], tuple[float, int]] = {}
    for case in cases:
        batch = _offline_batch(case)
        if batch is None or case.scenario is None:
            continue
        key = (case.model, case.mode, case.backend)
        value = float(case.scenario.throughput_per_s or 0)
        if key not in best or value > best[key][0]:
            best[key] = (value, batch)
    return {k: v[1] for k, v in best.items()}


def scenario_rows(run: Run) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the scenario table: the run's scenario cases."""
    header = [
        "model", "batch", "mode", "backend", "scenario", "queries", "queries/s", "items/s",
        "p50", "p99", "bound", "met", "rate found (next above)", "status",
    ]  # fmt: skip
    cases = [c for c in run.cases if c.scenario is not None]
    best = best_offline(cases)
    rows = []
    for c in sorted(cases, key=lambda c: (c.model, c.key[4], c.mode, c.backend, c.batch or 0)):
        record, label = c.scenario, c.key[4]
        if c.status == "failed" or c.latency is None or record is None:
            rows.append([c.model, str(c.batch or ""), c.mode, c.backend, label,
                         *[""] * 8, f"failed: {c.error or ''}"])  # fmt: skip
            continue
        batch = c.latency.batch_size
        is_best = record.name == "offline" and best.get((c.model, c.mode, c.backend)) == batch
        found = ""
        if record.search is not None:
            hit, above = record.search.found, record.search.above
            found = "none met" if hit is None else f"{hit.rate:.4g}/s (p99 {_ms(hit.p99_ns)})"
            found += f" ({above.rate:.4g}/s: p99 {_ms(above.p99_ns)})" if above else " (ceiling)"
        met = record.met_bound
        rows.append(
            [
                c.model,
                str(c.batch or batch) + (" best" if is_best and len(best) and _swept(cases, c) else ""),
                c.mode,
                c.backend,
                label,
                "" if record.queries is None else str(record.queries),
                f"{record.achieved_rate or 0:.4g}",
                f"{record.throughput_per_s or 0:.4g}",
                _ms(record.p50_ns),
                _ms(record.p99_ns),
                _ms(record.latency_bound_ns),
                "" if met is None else ("yes" if met else "NO"),
                found,
                "ok" if c.status == "ok" else c.status,
            ]
        )
    return header, rows


def _swept(cases: list[Case], case: Case) -> bool:
    """Whether the case's (model, mode, backend) has offline rows at several batch sizes."""
    same = (case.model, case.mode, case.backend)
    sizes = {_offline_batch(c) for c in cases if (c.model, c.mode, c.backend) == same} - {None}
    return len(sizes) > 1
