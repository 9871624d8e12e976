"""What the debug commands draw: error along the graph's depth, and the search's candidates.

Both follow the bench's plotting conventions (:mod:`harness.bench.plots`):
figures on an explicit Agg canvas (no display, no pyplot state changed;
matplotlib is the ``plots`` extra, imported when a figure is drawn),
log error axes with exact zeros one decade below the smallest error,
non-finite values drawn as red crosses above everything, labels moved apart
so they stay readable, and PNGs written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from harness.bench.plots import label_points, new_figure, pareto_front, save_figure
from harness.debug.layers import LayerReport, short_module
from harness.debug.precision import SearchResult

NAMED_LAYERS = 5


def _placed(values: Sequence[float]) -> tuple[list[float], float, float]:
    """Values for a log axis: zeros at the floor, non-finite at the ceiling (returned too)."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    floor = min(finite) / 10 if finite else 1e-12
    ceiling = max(finite) * 10 if finite else 1.0
    return [ceiling if not math.isfinite(v) else (v if v > 0 else floor) for v in values], floor, ceiling


def plot_layers(report: LayerReport, path: str | os.PathLike[str], named: int = NAMED_LAYERS) -> Path:
    """Accumulated, introduced and impact error of every layer against its depth; the worst named."""
    metric = report.rank_by
    fig = new_figure((10, 5))
    ax = fig.add_subplot()
    layers = sorted(report.layers, key=lambda layer: layer.index)
    depth = [layer.depth for layer in layers]
    series = {
        "accumulated": ("accumulated (layer in the typed graph)", ".", "tab:blue"),
        "introduced": ("introduced (layer alone)", "o", "tab:orange"),
        "impact": ("impact (outputs, only this layer low)", "^", "tab:green"),
    }
    raw = {kind: [getattr(layer, kind).value(metric) for layer in layers] for kind in series}
    placed, _, ceiling = _placed([v for values in raw.values() for v in values])
    ys = {kind: placed[i * len(layers) : (i + 1) * len(layers)] for i, kind in enumerate(series)}
    for kind, (label, marker, color) in series.items():
        filled = marker == "."
        ax.plot(depth, ys[kind], marker, color=color, mfc=color if filled else "none", alpha=0.7, label=label)
    broken = [i for i, v in enumerate(raw["introduced"]) if not math.isfinite(v)]
    if broken:
        ax.scatter([depth[i] for i in broken], [ceiling] * len(broken), marker="X", s=90, color="tab:red",
                   label="non-finite (NaN/Inf)", zorder=3)  # fmt: skip
    worst = report.ranked()[:named]
    position = {layer.name: i for i, layer in enumerate(layers)}
    shown = report.rank_on if report.rank_on in series else "impact"  # "removed" is drawn by its impact
    marked = [(depth[position[w.name]], ys[shown][position[w.name]]) for w in worst]
    ax.scatter([x for x, _ in marked], [y for _, y in marked], s=160, facecolors="none", edgecolors="tab:red",
               label=f"worst {len(worst)} by {report.rank_on}", zorder=3)  # fmt: skip
    label_points(ax, marked, [f"#{rank}" for rank in range(1, len(worst) + 1)])
    names = "\n".join(f"#{rank} {w.name} ({w.precision})\n    {short_module(w.module)}" for rank, w in enumerate(worst, start=1))
    ax.text(1.02, 1.0, f"worst by {report.rank_on} {metric}:\n{names}", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("depth (longest chain of layers from the inputs)")
    ax.set_ylabel(f"{metric} against the fp32 reference")
    ax.set_title(f"{report.model} ({report.mode}): error along the graph")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.77, 1))  # the list of named layers sits right of the axes
    save_figure(fig, Path(path))
    return Path(path)


def plot_search(result: SearchResult, path: str | os.PathLike[str]) -> Path:
    """Every verified candidate: latency against error, the target, the front and the chosen plan."""
    fig = new_figure((8, 5))
    ax = fig.add_subplot()
    steps = result.steps
    xs = [s.latency_ms for s in steps]
    limit = result.target.limit if result.target.limit is not None else 0.0
    ys, floor, ceiling = _placed([s.error for s in steps] + [limit])
    ys = ys[:-1]
    met = [i for i, s in enumerate(steps) if s.met]
    missed = [i for i, s in enumerate(steps) if not s.met]
    ax.scatter([xs[i] for i in missed], [ys[i] for i in missed], color="tab:gray", label="misses the target")
    ax.scatter([xs[i] for i in met], [ys[i] for i in met], color="tab:blue", label="meets the target")
    front = [met[i] for i in pareto_front([(xs[i], ys[i]) for i in met])]
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "-", color="tab:blue", alpha=0.4,
            drawstyle="steps-post", label="front of the verified plans")  # fmt: skip
    ax.axhline(limit if limit > 0 else floor, color="tab:red", linestyle="--", label=f"target {result.target.describe()}")
    chosen = result.chosen
    role = next(f.role for f in result.finalists if f.evaluation is chosen)
    ax.scatter([chosen.latency_ms], [chosen.error if chosen.error > 0 else floor], marker="*", s=300,
               color="tab:green", zorder=3, label=f"chosen: {role} ({len(chosen.plan.kept)} layers fp32)")  # fmt: skip
    labels = {}
    for i, s in enumerate(steps):
        if s.phase == "bound":
            labels[i] = s.change + (" (exact)" if s.error == 0 else "")
    minimal = next((i for i, s in reversed(list(enumerate(steps))) if s.kept == result.minimal.kept), None)
    if minimal is not None:
        labels[minimal] = f"pruned: {len(result.minimal.kept)} fp32"
    label_points(ax, [(xs[i], ys[i]) for i in labels], list(labels.values()))
    ax.set_yscale("log")
    ax.set_ylim(top=ceiling * 3)
    ax.set_xlabel(f"latency, median (ms) on {result.backend}, {result.threads} thread(s)")
    ax.set_ylabel(f"{result.target.metric}, worst over {result.batches} batch(es)")
    ax.set_title(f"{result.model}: precision search ({result.low}), {len(steps)} verified plans")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    save_figure(fig, Path(path))
    return Path(path)
