"""Tables for the terminal (``tablefmt="simple"``) and Markdown (``"github"``).

The same rows serve both: a CI job pastes the Markdown into its summary, a
developer reads the terminal form. Empty cells mean "not measured" (e.g. no
task accuracy for a model without labelled data).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from tabulate import tabulate

from harness.bench.compare import Comparison
from harness.bench.gate import GateReport
from harness.bench.results import BUSY_PREFIX, format_key
from harness.bench.results_doc import Case, Latency, Run, read_run
from harness.bench.scenario_tables import scenario_rows
from harness.documents import document_json
from harness.precision import PRECISION_MODES, ExecutedPrecision, precision_of

_TIME_UNITS = ((1e9, "s"), (1e6, "ms"), (1e3, "µs"), (1.0, "ns"))
_BYTE_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
REFERENCE_MODE = "fp32"


def format_ns(ns: float | None) -> str:
    if ns is None:
        return ""
    for scale, unit in _TIME_UNITS:
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def format_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for scale, unit in _BYTE_UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _speedup(reference_ns: float | None, median_ns: float | None) -> str:
    """fp32 median over this mode's; a large slowdown keeps 2 significant digits, not "x0.00"."""
    if not reference_ns or not median_ns:
        return ""
    ratio = reference_ns / median_ns
    return f"x{ratio:.2f}" if ratio >= 0.1 else f"x{ratio:.2g}"


def _status(case: Case, width: int = 60) -> str:
    """``ok`` or ``non-finite (NaN n, Inf m)``, what did not run at the mode's precision
    ("fp16 asked, 41 of 52 layers ran fp32"), the case's stored warnings (but the busy-machine
    one, which the table's footnote says once: :func:`busy_note`); or the whole failure reason.

    Long text is wrapped to ``width`` (never cut): each line is a line of the
    terminal table's cell, or a ``<br>`` in Markdown (see :func:`_table`).
    """
    if case.status == "failed":
        return textwrap.fill(f"failed: {case.error or ''}", width)
    text = "ok" if not _busy(case) else "ok (busy)"
    if case.status == "non-finite" and case.accuracy is not None:
        text = f"non-finite (NaN {case.accuracy.nan_count}, Inf {case.accuracy.inf_count})"
    executed = case.executed_precision
    ran = None if executed is None else ExecutedPrecision.from_json(document_json(executed)).describe()
    warnings = [w for w in case.warnings if not w.startswith(BUSY_PREFIX)]
    return "\n".join([
        text, *([textwrap.fill(ran, width)] if ran else []),
        *(textwrap.fill(f"warning: {w}", width) for w in warnings),
    ])  # fmt: skip


def _busy(case: Case) -> bool:
    return any(w.startswith(BUSY_PREFIX) for w in case.warnings)


def busy_note(cases: Sequence[Case]) -> str | None:
    """One footnote for every case that ran while the machine was busier than its cores (None: none did)."""
    busy = [c for c in cases if _busy(c)]
    if not busy:
        return None
    loads = [max(c.load_average.start[0], c.load_average.end[0]) for c in busy if c.load_average]
    cpus = next((c.load_average.cpus for c in busy if c.load_average), None)
    names = ", ".join(format_key(c.key) for c in busy)
    load = f" (load average up to {max(loads):.1f} on {cpus} cores)" if loads and cpus else ""
    return (
        f"busy: {len(busy)} of {len(cases)} cases ran while the machine was busier than its cores{load}, so "
        f"their latency may be inflated (marked 'ok (busy)'): {names}"
    )


def _markdown_cell(text: str) -> str:
    """A cell GitHub renders as one cell: line breaks as ``<br>``, pipes escaped."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _table(rows: list[list[str]], header: list[str], fmt: str) -> str:
    """tabulate, except that a wrapped cell stays one row in Markdown.

    tabulate turns a multi-line cell into extra table rows in ``github``
    format, which reads as rows of empty cases; the terminal format lines them
    up within one row, so only Markdown changes.
    """
    if fmt == "github":
        rows = [[_markdown_cell(cell) for cell in row] for row in rows]
    table: str = tabulate(rows, headers=header, tablefmt=fmt, disable_numparse=True)  # tabulate is unannotated
    return table


def _spread(lat: Latency | None) -> str:
    if lat is None:
        return ""
    text = f"{lat.summary.spread:.1%} ({lat.summary.outliers:.0%} out)"
    if lat.slow_phase is not None:
        return text + " slow phase"
    return text + (" unstable" if lat.unstable else "")


PEER_NOTE = (
    "peer:* rows are reference runtimes measured in the same run, not the harness's engines (not gated); "
    "vs best peer = the fastest peer's median at the row's precision / the row's median (above 1: faster than every peer)"
)


def _fastest_peers(run: Run) -> dict[tuple[str, int | None, str], float]:
    """(model, batch, precision) -> the smallest median of a peer's case there."""
    fastest: dict[tuple[str, int | None, str], float] = {}
    for c in run.cases:
        if c.is_peer and c.status != "failed" and c.latency is not None:
            key = (c.model, c.batch, c.mode)  # a peer's mode is its precision
            fastest[key] = min(fastest.get(key, float("inf")), c.latency.summary.median)
    return fastest


def results_rows(run: Run) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-case table (model x mode x backend), peers' reference rows
    after the engines'.

    Single-stream cases only: scenario cases have a table of their own (:func:`scenario_table`).
    """
    single = [c for c in run.cases if c.scenario is None]
    reference_median = {
        (c.model, c.backend, c.batch): c.latency.summary.median
        for c in single
        if c.mode == REFERENCE_MODE and c.status != "failed" and c.latency is not None
    }
    fastest_peer = _fastest_peers(run)
    header = [
        "model", "batch", "mode", "backend", "median", "p95", "items/s (median)", "speed-up",
        *(["vs best peer"] if fastest_peer else []),
        "IQR/median", "max abs err", "cosine", "top-1", "task acc", "weights", "engine", "peak RSS", "status",
    ]  # fmt: skip
    rows = []
    for c in sorted(single, key=lambda c: (c.model, c.is_peer, c.backend, c.batch or 0)):
        lat, acc, mem, task = c.latency, c.accuracy, c.memory, c.task_accuracy
        median = lat.summary.median if lat else None
        ref = reference_median.get((c.model, c.backend, c.batch))
        precision = _precision(c)
        best_peer = fastest_peer.get((c.model, c.batch, precision or ""))
        rows.append(
            [
                c.model,
                str(c.batch or (lat.batch_size if lat else "")),
                c.mode,
                c.backend,
                format_ns(median),
                format_ns(lat.summary.p95 if lat else None),
                f"{lat.batch_size * 1e9 / median:.4g}" if lat and median else "",
                _speedup(ref, median),
                *([_speedup(best_peer, median)] if fastest_peer else []),
                _spread(lat),
                _num(acc.max_abs_error if acc else None, ".2e"),
                _num(acc.cosine if acc else None, ".6f"),
                _num(acc.top1_agreement if acc else None, ".2%"),
                f"{task.name} {task.value:.2%}" if task else "",
                format_bytes(mem.weight_bytes_total if mem else None),
                format_bytes(mem.engine_bytes if mem else None),
                format_bytes(mem.peak_rss_bytes if mem else None),
                _status(c),
            ]
        )
    return header, rows


def _precision(case: Case) -> str | None:
    """The precision a case ran at: a peer's mode is one; another tool's case (a pytest-benchmark
    parameter as its mode) has none the harness knows."""
    if case.is_peer:
        return case.mode
    return precision_of(case.mode) if case.mode in PRECISION_MODES else None


def results_table(doc: Mapping[str, Any], fmt: str = "simple") -> str:
    """A title line (machine, commit, completeness) and the per-case table of a loaded results document."""
    run = read_run(doc)
    commit = f"commit {run.git.commit[:12]}" if run.git.commit else "no git commit"
    commit += " (dirty)" if run.git.dirty else ""
    title = f"machine {run.machine.id}, {commit}, {len(run.cases)} cases"
    if not run.complete:
        title += ", INCOMPLETE (interrupted run)"
    for mark in (run.upgraded_from, run.imported_from):
        if mark is not None:
            title += f"\nnote: {mark.note}"
    if any(c.is_peer for c in run.cases):
        title += f"\nnote: {PEER_NOTE}"
    header, rows = results_rows(run)
    busy = busy_note(run.cases)
    table = _table(rows, header, fmt) if rows else "(no single-stream cases)"
    return title + "\n\n" + table + scenario_table(run, fmt) + (f"\n{busy}" if busy else "")


def scenario_table(run: Run, fmt: str = "simple") -> str:
    """The scenario cases' table (latency against throughput per mode), or "" when there are none."""
    header, rows = scenario_rows(run)
    if not rows:
        return ""
    return "\n\nscenarios (latency from each query's arrival; items/s achieved under the load):\n\n" + _table(rows, header, fmt)


def gate_table(report: GateReport, fmt: str = "simple") -> str:
    """One row per case, with the latency statistics behind the verdict, then the counts."""
    # p of the one-sided test in the direction the median moved
    header = ["case", "verdict", "fails", "ratio", "p", "ratio CI", "findings"]
    rows = []
    for v in report.cases:
        lat = v.latency
        rows.append(
            [
                format_key(v.key),
                v.verdict,
                "FAIL" if v.fails else "",
                f"x{lat.ratio:.3f}" if lat else "",
                f"{lat.p_slower if lat.ratio >= 1 else lat.p_faster:.2g}" if lat else "",
                f"[{lat.ci_low:.3f}, {lat.ci_high:.3f}]" if lat else "",
                "; ".join(f.message for f in v.findings),  # one line per case, however long
            ]
        )
    notes = "".join(f"\nnote: {n}" for n in report.notes)
    table = _table(rows, header, fmt)
    return f"{table}\n\n{report.summary()}{notes}"


def _flag(value: bool | None) -> str:
    return "" if value is None else ("same" if value else "DIFFERENT")


def compare_table(comparison: Comparison, fmt: str = "simple") -> str:
    """Per-case equality and deltas, then every layer whose tactic changed."""
    header = [
        "case",
        "weights",
        "engine",
        "outputs",
        "tactics",
        "latency b/a",
        "Δ max abs err",
        "Δ cosine",
        "Δ task acc",
    ]
    rows = []
    tactic_rows = []
    for c in comparison.cases:
        diffs = c.tactic_diffs
        rows.append(
            [
                format_key(c.key),
                _flag(c.weights_equal),
                _flag(c.fingerprints_equal),
                _flag(c.outputs_equal),
                "" if diffs is None else (f"{len(diffs)} differ" if diffs else "same"),
                _num(c.latency_ratio, ".3f"),
                _num(c.max_abs_error_delta, "+.2e"),
                _num(c.cosine_delta, "+.2e"),
                _num(c.task_accuracy_delta, "+.2%"),
            ]
        )
        tactic_rows += [
            [format_key(c.key), d.layer, d.tactic_a or "(absent)", d.tactic_b or "(absent)"]
            for d in diffs or []
        ]
    title = f"{comparison.machine_a} (a) vs {comparison.machine_b} (b)"
    out = title + "\n\n" + _table(rows, header, fmt)
    if tactic_rows:
        out += "\n\n" + _table(tactic_rows, ["case", "layer", "tactic a", "tactic b"], fmt)
    for side, keys in (("a", comparison.only_in_a), ("b", comparison.only_in_b)):
        if keys:
            out += f"\n\nonly in {side}: " + ", ".join(format_key(k) for k in keys)
    other_models = [format_key(c.key) for c in comparison.cases if c.weights_equal is False]
    if other_models:
        out += (
            "\n\nmodel weights differ in: " + ", ".join(other_models)
            + " (the two runs measured different models there; their deltas compare different models)"
        )
    return out
