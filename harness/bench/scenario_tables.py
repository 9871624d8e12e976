"""The scenario table: latency against throughput per precision mode, for scenario runs.

One row per scenario case (:mod:`harness.bench.scenarios`): the throughput it
achieved (samples per second), its query latency (p50, p99) and, for a
bound, whether the p99 met it; a ``--find-rate`` row gives the rate found and
the next probed rate above it. Offline rows of a batch sweep mark the best
batch size. Single-stream cases stay in the per-case table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.bench.scenarios import SINGLE_STREAM, best_offline, label_of


def scenario_cases(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for c in doc["cases"] if label_of(c) != SINGLE_STREAM]


def _ms(ns: float | None) -> str:
    return "" if ns is None else f"{ns / 1e6:.3g} ms"


def scenario_rows(doc: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "model", "batch", "mode", "backend", "scenario", "queries", "queries/s", "items/s",
        "p50", "p99", "bound", "met", "rate found (next above)", "status",
    ]  # fmt: skip
    cases = scenario_cases(doc)
    best = best_offline(cases)
    rows = []
    for c in sorted(cases, key=lambda c: (c["model"], label_of(c), c["mode"], c["backend"], c.get("batch") or 0)):
        record = c.get("scenario") or {}
        if c["status"] == "failed":
            rows.append([c["model"], str(c.get("batch") or ""), c["mode"], c["backend"], label_of(c),
                         *[""] * 8, f"failed: {c.get('error') or ''}"])  # fmt: skip
            continue
        batch = c["latency"]["batch_size"]
        is_best = record.get("name") == "offline" and best.get((c["model"], c["mode"], c["backend"])) == batch
        search = record.get("search")
        found = ""
        if search:
            hit, above = search.get("found"), search.get("above")
            found = "none met" if hit is None else f"{hit['rate']:.4g}/s (p99 {_ms(hit['p99_ns'])})"
            found += f" ({above['rate']:.4g}/s: p99 {_ms(above['p99_ns'])})" if above else " (ceiling)"
        met = record.get("met_bound")
        rows.append(
            [
                c["model"],
                str(c.get("batch") or batch) + (" best" if is_best and len(best) and _swept(cases, c) else ""),
                c["mode"],
                c["backend"],
                label_of(c),
                str(record.get("queries", "")),
                f"{record.get('achieved_rate', 0):.4g}",
                f"{record.get('throughput_per_s', 0):.4g}",
                _ms(record.get("p50_ns")),
                _ms(record.get("p99_ns")),
                _ms(record.get("latency_bound_ns")),
                "" if met is None else ("yes" if met else "NO"),
                found,
                "ok" if c["status"] == "ok" else str(c["status"]),
            ]
        )
    return header, rows


def _swept(cases: list[Mapping[str, Any]], case: Mapping[str, Any]) -> bool:
    """Whether the case's (model, mode, backend) has offline rows at several batch sizes."""
    sizes = {
        c["latency"]["batch_size"]
        for c in cases
        if c["status"] != "failed" and (c["model"], c["mode"], c["backend"]) == (case["model"], case["mode"], case["backend"])
        and (c.get("scenario") or {}).get("name") == "offline"
    }
    return len(sizes) > 1
