"""Latency-vs-error plots per model, with the Pareto front marked.

The question a precision mode answers is a trade-off: how much error buys
how much speed. Each mode is one point (median latency, whisker to p95;
error on a log scale) and the modes no other mode beats on both axes form
the Pareto front, the only ones worth deploying. A mode whose outputs hold
NaN or Inf has no meaningful error: it is drawn as a red cross above the
others, named with its NaN/Inf counts and never on the front, and failed
modes are listed under the plot, so no mode disappears without a word.
Peers' reference rows (``--peers``, :mod:`harness.bench.peers`) are grey
diamonds labelled with their backend: shown for comparison, never on the
modes' front.

Figures are drawn on an explicit Agg canvas instead of through pyplot, so
plotting neither needs a display nor switches the backend of a program
(e.g. a notebook) that imported the harness. matplotlib is optional (the
``plots`` extra) and imported when a figure is drawn (:func:`new_figure`);
without it drawing raises :class:`harness.extras.MissingExtra`, and the
commands that plot as a by-product say the plots were not written.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from harness.bench.results_doc import Accuracy, Case, Run, Scenario, read_run
from harness.errors import HarnessError
from harness.extras import require
from harness.fileio import atomic_write_bytes, check_writable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ErrorMetric = Literal["1-cosine", "max_abs_error"]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, both coordinates minimised.

    ``p`` dominates ``q`` when it is no worse in both coordinates and better
    in one; equal points do not dominate each other, so both stay. Returned
    in order of increasing first coordinate (then second).
    """
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any(
            (ox <= x and oy <= y) and (ox < x or oy < y)
            for j, (ox, oy) in enumerate(points)
            if j != i
        )
    ]
    return sorted(front, key=lambda i: points[i])


@dataclass(frozen=True)
class _Point:
    label: str
    median_ms: float
    p95_ms: float
    error: float
    peer: bool = False  # a peer's reference point: drawn apart, never on the modes' Pareto front


@dataclass(frozen=True)
class _Absent:
    """A mode with no error to place: non-finite (latency known) or failed."""

    label: str
    median_ms: float | None


def _error(accuracy: Accuracy, metric: ErrorMetric) -> float | None:
    if metric == "1-cosine":
        cos = accuracy.cosine
        return None if cos is None else max(0.0, 1.0 - cos)
    value = accuracy.max_abs_error
    return None if value is None else float(value)


def _points(cases: Sequence[Case], metric: ErrorMetric) -> tuple[list[_Point], list[_Absent]]:
    """Plottable modes, and the modes without an error to plot (non-finite or failed)."""
    multi_backend = len({c.backend for c in cases if not c.is_peer}) > 1
    out, absent = [], []
    for c in cases:
        label = f"{c.mode} ({c.backend})" if multi_backend or c.is_peer else c.mode
        lat, acc = c.latency, c.accuracy
        if c.status == "failed" or lat is None or acc is None:
            absent.append(_Absent(f"{label}: failed", None))
            continue
        median = lat.summary.median / 1e6
        err = _error(acc, metric)
        if c.status == "non-finite":
            counts = f"NaN {acc.nan_count}, Inf {acc.inf_count}"
            absent.append(_Absent(f"{label}: NON-FINITE ({counts})", median))
            continue
        if err is None:
            absent.append(_Absent(f"{label}: no error (nothing compared)", median))
            continue
        out.append(_Point(label, median, lat.summary.p95 / 1e6, err, peer=c.is_peer))
    return out, absent


LOG_LATENCY_SPAN = 10.0


def _log_latency(medians: Sequence[float], p95s: Sequence[float]) -> bool:
    """Log latency axis when the plotted latencies (medians and their p95 whiskers) span more
    than a decade.

    On a linear axis a 25 us mode next to a 12 ms one (or a 0.3 ms median whose
    p95 reaches 21 ms) sits on the y axis, and its whisker and label are unreadable.
    """
    return min(medians) > 0 and max(*medians, *p95s) / min(medians) > LOG_LATENCY_SPAN


def _plot_model(
    model: str, points: list[_Point], absent: list[_Absent], metric: ErrorMetric, title_suffix: str
) -> Figure:
    fig = new_figure((7, 5))
    ax = fig.add_subplot()
    positive = [p.error for p in points if p.error > 0]
    # A log axis cannot show 0 (fp32 can match the reference exactly): such
    # points sit one decade below the smallest non-zero error, labelled exact.
    floor = min(positive) / 10 if positive else 1e-12
    xs = [p.median_ms for p in points]
    ys = [p.error if p.error > 0 else floor for p in points]
    modes = [i for i, p in enumerate(points) if not p.peer]
    peers = [i for i, p in enumerate(points) if p.peer]
    placed = [(a.label, a.median_ms) for a in absent if a.median_ms is not None]
    if placed:  # above every real error: there is no error to place them by
        top = max(ys, default=1.0) * 10
        ax.scatter([x for _, x in placed], [top] * len(placed), marker="X", s=90,
                   color="tab:red", label="no error to plot (non-finite outputs)", zorder=3)
        label_points(ax, [(x, top) for _, x in placed], [label for label, _ in placed])
    failed = [a.label for a in absent if a.median_ms is None]
    if failed:
        fig.text(0.01, 0.01, "not plotted: " + "; ".join(failed), fontsize=7, color="tab:red")
    whiskers = [[0.0] * len(modes), [max(0.0, points[i].p95_ms - points[i].median_ms) for i in modes]]
    ax.errorbar(
        [xs[i] for i in modes],
        [ys[i] for i in modes],
        xerr=whiskers,
        fmt="o",
        color="tab:blue",
        ecolor="tab:gray",
        capsize=3,
        label="mode (median, p95)",
    )
    if peers:
        ax.scatter([xs[i] for i in peers], [ys[i] for i in peers], marker="D", s=50, color="tab:gray",
                   label="peer (reference runtime, median)", zorder=3)
    front = [modes[i] for i in pareto_front([(points[i].median_ms, points[i].error) for i in modes])]
    ax.plot(
        [xs[i] for i in front],
        [ys[i] for i in front],
        "-",
        color="tab:red",
        drawstyle="steps-post",
        label="Pareto front",
    )
    ax.scatter(
        [xs[i] for i in front],
        [ys[i] for i in front],
        s=140,
        facecolors="none",
        edgecolors="tab:red",
        label="Pareto-optimal mode",
    )
    ax.set_yscale("log")
    if xs and _log_latency(xs, [p.p95_ms for p in points]):
        ax.set_xscale("log")
    ax.set_xlabel(
        "latency, median with p95 whisker (ms"
        + (", log scale)" if ax.get_xscale() == "log" else ")")
    )
    ax.set_ylabel("1 - cosine similarity" if metric == "1-cosine" else "max abs error")
    ax.set_title(f"{model}: latency vs error{title_suffix}  (* = Pareto front)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.margins(x=0.12, y=0.08)  # room for the labels right of the outermost points
    label_points(
        ax,
        [(xs[i], ys[i]) for i in range(len(points))],
        [
            p.label + (" (exact)" if p.error == 0 else "") + (" *" if i in front else "")
            for i, p in enumerate(points)
        ],
    )
    fig.tight_layout()
    return fig


def label_points(ax: Any, xy: Sequence[tuple[float, float]], texts: Sequence[str]) -> None:
    """Label every point, moving a label down a line while it overlaps one already placed.

    Modes close in latency and error (bf16 and autocast-bf16 often are)
    would otherwise print their names on top of each other.
    """
    renderer = ax.figure.canvas.get_renderer()
    placed: list[Any] = []
    for (x, y), text in sorted(zip(xy, texts, strict=True)):
        dy = 6
        while True:
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(6, dy), fontsize=8)
            box = note.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed) or dy < -60:
                placed.append(box)
                break
            note.remove()
            dy -= 10


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


PlotKind = Literal["latency", "throughput", "scenarios"]


def plot_path(results_path: str | os.PathLike[str], model: str, kind: PlotKind = "latency") -> Path:
    """Where a model's plot goes: ``<stem>-<model>.png`` (``-throughput.png``, ``-scenarios.png``) beside the results."""
    results = Path(results_path)
    suffix = "" if kind == "latency" else f"-{kind}"
    return results.parent / f"{results.stem}-{_file_part(model)}{suffix}.png"


def check_plot_paths(
    results_path: str | os.PathLike[str], models: Iterable[str], sweep: bool, scenarios: bool = False
) -> None:
    """Refuse, before a run or a report, plot paths that cannot be written.

    A directory named like a plot, or a read-only results directory, would
    otherwise end a finished run with a traceback at the last step.
    """
    kinds: tuple[PlotKind, ...] = ("latency", "throughput") if sweep else ("latency",)
    kinds += ("scenarios",) if scenarios else ()
    for model in models:
        for kind in kinds:
            path = plot_path(results_path, model, kind)
            try:
                check_writable(path, "plot")
            except HarnessError as exc:
                raise HarnessError(f"{exc}; pass --no-plots to skip the plots") from None


def plot_results(
    doc: Mapping[str, Any],
    results_path: str | os.PathLike[str],
    *,
    error_metric: ErrorMetric = "1-cosine",
) -> list[Path]:
    """One PNG per model of a loaded results document, next to the results file: ``<stem>-<model>.png``
    (and ``-throughput.png`` for a batch sweep, ``-scenarios.png`` for scenario cases).

    Models without any case that has a latency get no plot. Returns the
    written paths.
    """
    run = read_run(doc)
    by_model: dict[str, list[Case]] = {}
    for case in run.cases:
        by_model.setdefault(case.model, []).append(case)
    written = []
    for model, every in sorted(by_model.items()):
        loaded = _plot_scenarios(model, every)
        if loaded is not None:
            path = plot_path(results_path, model, "scenarios")
            save_figure(loaded, path)
            written.append(path)
        cases = [c for c in every if c.scenario is None]
        if not cases:
            continue
        sweep = _plot_throughput(model, cases)
        if sweep is not None:
            path = plot_path(results_path, model, "throughput")
            save_figure(sweep, path)
            written.append(path)
        # the latency-vs-error plot compares modes at one batch size: the model's own
        cases = [c for c in cases if c.batch is None] or cases
        points, absent = _points(cases, error_metric)
        if not points and not any(a.median_ms is not None for a in absent):
            continue
        fig = _plot_model(model, points, absent, error_metric, _title_suffix(run, cases))
        path = plot_path(results_path, model)
        save_figure(fig, path)
        written.append(path)
    return written


def _title_suffix(run: Run, cases: Sequence[Case]) -> str:
    """The machine, and what a reader must not miss: a --quick run, unstable cases."""
    text = f" on {run.machine.id}"
    if run.settings.quick:
        text += " [--quick: a pipeline check, not numbers]"
    unstable = sum(1 for c in cases if c.latency is not None and c.latency.unstable)
    return text + (f" [{unstable} unstable]" if unstable else "")


def new_figure(size: tuple[float, float]) -> Figure:
    """A figure on its own Agg canvas (no display, no pyplot state); matplotlib is the ``plots`` extra."""
    require("matplotlib", "plots", "plotting")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: Path) -> None:
    """Write ``fig`` as PNG in one step (atomically): an interrupted run never leaves half a plot."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def _plot_throughput(model: str, cases: Sequence[Case]) -> Figure | None:
    """Throughput against batch size, one line per mode (None unless the run swept batch sizes)."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for c in cases:
        if c.status == "failed" or c.latency is None or c.batch is None:
            continue
        label = f"{c.mode} ({c.backend})"
        lines.setdefault(label, []).append((c.batch, c.latency.throughput_per_s))
    if not any(len(points) > 1 for points in lines.values()):
        return None
    fig = new_figure((7, 5))
    ax = fig.add_subplot()
    for label, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (items/s, from the mean latency)")
    ax.set_title(f"{model}: throughput against batch size")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def _plot_scenarios(model: str, cases: Sequence[Case]) -> Figure | None:
    """p99 latency against throughput per precision mode (None without scenario cases).

    One colour per mode, one marker per scenario: each scenario case is a
    point (items/s achieved, p99: of its queries from their arrival; of each
    call for offline, where every call arrives at the start), and a
    ``--find-rate`` search draws every rate it probed as a line, the mode's
    latency-throughput curve under Poisson load. The bound is drawn where one was set.
    """
    markers = {"server": "o", "multi-stream": "^", "offline": "s"}
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    bounds: set[float] = set()
    for c in cases:
        record = c.scenario
        if c.status == "failed" or record is None:
            continue
        points = _scenario_points(record)
        if points is None:
            continue
        series.setdefault((f"{c.mode} ({c.backend})", record.name), []).extend(points)
        if record.latency_bound_ns:
            bounds.add(record.latency_bound_ns / 1e6)
    if not series:
        return None
    fig = new_figure((7, 5))
    ax = fig.add_subplot()
    modes = sorted({mode for mode, _ in series})
    colours = {mode: f"C{i % 10}" for i, mode in enumerate(modes)}
    for (mode, name), points in sorted(series.items()):
        points.sort()
        style = "-" if len(points) > 1 else ""
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker=markers.get(name, "o"),
                color=colours[mode], label=f"{mode}, {name}")  # fmt: skip
    for bound in sorted(bounds):
        ax.axhline(bound, color="tab:red", linestyle="--", linewidth=1, label=f"latency bound {bound:g} ms")
    ax.set_xlabel("throughput (items/s achieved)")
    ax.set_ylabel("p99 latency (ms; queries from arrival, offline per call)")
    ys = [p[1] for points in series.values() for p in points]
    if ys and min(ys) > 0 and max(ys) / min(ys) > LOG_LATENCY_SPAN:
        ax.set_yscale("log")
    ax.set_title(f"{model}: latency against throughput per precision mode")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def _scenario_points(record: Scenario) -> list[tuple[float, float]] | None:
    """(items/s achieved, p99 ms) of a scenario case: every rate its search probed, else its own load.

    None when the record lacks one they need (the harness writes them all; another tool's file may not).
    """
    if record.search is not None:
        per_query = record.samples_per_query
        if per_query is None:
            return None
        return [(p.achieved * per_query, p.p99_ns / 1e6) for p in record.search.probes]
    if record.throughput_per_s is None or record.p99_ns is None:
        return None
    return [(record.throughput_per_s, record.p99_ns / 1e6)]
