"""The history as one static, self-contained HTML page (plotly, its JavaScript inlined).

:func:`render_html` turns a :class:`harness.bench.history.History` into a
page that needs no network to view: plotly.js is inlined once in the page's
head, each case's figure is JSON in the page, drawn by ``Plotly.newPlot``; once
every figure is drawn the body's ``data-rendered`` is ``true`` (``failed``,
with a console error, if one could not be).

The page: the steps found (regressions first, with their commit ranges),
then per machine its runs (commit, date, flags, gate outcome) and one
figure per case. A figure's x axis is the machine's runs in time order,
labelled with commit and date; its top panel is the median latency with
its interquartile range as error bars, each point coloured by the case's
gate verdict (open markers: ``--quick`` runs), the fitted levels of the step
detection as a dashed line, and the markers; its bottom panel is the
maximum absolute error against the reference. Markers, each a legend entry
of its own with the details on hover: ``baseline`` (a star, and a dotted
line), ``fingerprint change``, ``machine change``, ``clock change`` (open
symbols around the point, and a dashed line of the same colour),
``regression step`` / ``improvement step`` (the band between the last run
before and the first run after it, labelled with the ratio and the
commits). Each figure's element carries ``data-case`` and ``data-markers``
(the marker kinds it shows), for tests and other tools.

Every text from a results file (model names, commits, error messages) is
HTML-escaped, and the JSON in the page cannot close its script element.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import Any

from harness.bench.history import FoundStep, History, MachineHistory, Point, RunInfo, Series
from harness.bench.tables import format_ns
from harness.extras import require

# Verdict -> colour; the gate's failing verdicts are red, its informative ones muted.
VERDICT_COLOURS = {
    "baseline": "#111111",
    "ok": "#2ca02c",
    "improvement": "#1f77b4",
    "regression": "#d62728",
    "accuracy": "#b2182b",
    "determinism": "#e7298a",
    "non-finite": "#7f0000",
    "failed": "#7f0000",
    "weights-changed": "#e6550d",
    "missing": "#8c564b",
    "unstable": "#ff9f1c",
    "new": "#9e9e9e",
    "warning": "#bcbd22",
    "not gated": "#9e9e9e",
}
MARKER_STYLE = {  # kind -> (legend name, colour, symbol)
    "fingerprint": ("fingerprint change", "#7b3294", "triangle-up-open"),
    "machine": ("machine change", "#a6611a", "square-open"),
    "clock": ("clock change", "#018571", "diamond-open"),
}
STEP_COLOURS = {"regression": "#d62728", "improvement": "#1f77b4"}
_UNITS = ((1e9, "s"), (1e6, "ms"), (1e3, "µs"), (1.0, "ns"))
MAX_TICKS = 24
PLOT_HEIGHT = 480


def _unit(series: Series) -> tuple[float, str]:
    medians = sorted(p.median_ns for p in series.points if p.median_ns is not None)
    typical = medians[len(medians) // 2] if medians else 1.0
    return next((scale, unit) for scale, unit in _UNITS if typical >= scale or scale == 1.0)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def slug(text: str) -> str:
    """An HTML id from a case or machine name (unique per page: callers prefix the machine)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


def _point_text(point: Point, run: RunInfo, scale: float, unit: str) -> str:
    lines = [f"<b>{_e(run.short_commit)}</b> {_e(run.date)} UTC", _e(run.file)]
    if point.median_ns is not None:
        lines.append(
            f"median {point.median_ns / scale:.4g} {unit} (IQR {(point.q1_ns or 0) / scale:.4g}-"
            f"{(point.q3_ns or 0) / scale:.4g}, spread {point.spread or 0:.1%}{', unstable' if point.unstable else ''})"
        )
    if point.max_abs_error is not None:
        lines.append(f"max abs error {point.max_abs_error:.3g}")
    if point.error:
        lines.append(f"failed: {_e(point.error[:200])}")
    flags = [f for f, on in (("--quick", run.quick), ("interrupted", not run.complete), ("schema 1", run.upgraded)) if on]
    if flags:
        lines.append("run: " + ", ".join(flags))
    lines.append(f"verdict: <b>{_e(point.verdict or 'not gated')}</b>")
    lines += [_e(f[:160]) for f in point.findings[:4]]
    if point.verdict is None and run.gate_note:
        lines.append(_e(run.gate_note[:160]))
    return "<br>".join(lines)


def _step_label(step: FoundStep, runs: Sequence[RunInfo]) -> str:
    before, after = runs[step.last_before], runs[step.first_after]
    return f"{step.kind} x{step.ratio:.3f}<br>{_e(before.short_commit)}..{_e(after.short_commit)}"


def figure(machine: MachineHistory, series: Series) -> tuple[dict[str, Any], list[str]]:
    """The plotly figure (as JSON-ready data and layout) of one case, and the marker kinds it shows."""
    go = require("plotly.graph_objects", "history", "the history dashboard")
    subplots = require("plotly.subplots", "history", "the history dashboard")
    runs = machine.runs
    scale, unit = _unit(series)
    fig = subplots.make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3], vertical_spacing=0.06
    )
    timed = [p for p in series.points if p.median_ns is not None]
    shown: list[str] = []
    fig.add_trace(
        go.Scatter(
            x=[p.run for p in timed],
            y=[p.median_ns / scale for p in timed if p.median_ns is not None],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [((p.q3_ns or 0) - (p.median_ns or 0)) / scale for p in timed],
                "arrayminus": [((p.median_ns or 0) - (p.q1_ns or 0)) / scale for p in timed],
                "color": "#9e9e9e",
                "thickness": 1,
            },
            mode="lines",
            line={"color": "#bdbdbd", "width": 1},
            name="median latency (IQR)",
            hoverinfo="skip",
        ),
        row=1,
        col=1,
    )
    levels_x: list[float | None] = []
    levels_y: list[float | None] = []
    for level in series.levels:
        levels_x += [level.first - 0.3, level.last + 0.3, None]
        levels_y += [level.median_ns / scale, level.median_ns / scale, None]
    if levels_x:
        fig.add_trace(
            go.Scatter(x=levels_x, y=levels_y, mode="lines", name="fitted level",
                       line={"color": "#3f51b5", "width": 2, "dash": "dash"}, hoverinfo="skip"),
            row=1, col=1,
        )  # fmt: skip
    by_verdict: dict[str, list[Point]] = {}
    for p in timed:
        by_verdict.setdefault(p.verdict or "not gated", []).append(p)
    order = list(VERDICT_COLOURS)
    for verdict, points in sorted(by_verdict.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        fig.add_trace(
            go.Scatter(
                x=[p.run for p in points],
                y=[(p.median_ns or 0) / scale for p in points],
                mode="markers",
                name=f"verdict: {verdict}",
                legendgroup="verdict",
                marker={
                    "color": VERDICT_COLOURS.get(verdict, "#9e9e9e"),
                    "size": 9,
                    "symbol": ["circle-open" if runs[p.run].quick else "circle" for p in points],
                    "line": {"width": 1.5, "color": VERDICT_COLOURS.get(verdict, "#9e9e9e")},
                },
                text=[_point_text(p, runs[p.run], scale, unit) for p in points],
                hovertemplate="%{text}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    if by_verdict:
        shown.append("verdict")
    failed = [p for p in series.points if p.median_ns is None]
    if failed:
        floor = min((p.median_ns for p in timed if p.median_ns is not None), default=scale) / scale
        fig.add_trace(
            go.Scatter(
                x=[p.run for p in failed], y=[floor] * len(failed), mode="markers", name="failed",
                marker={"color": VERDICT_COLOURS["failed"], "size": 11, "symbol": "x"},
                text=[_point_text(p, runs[p.run], scale, unit) for p in failed], hovertemplate="%{text}<extra></extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
        shown.append("failed")
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    median_at = {p.run: (p.median_ns or 0) / scale for p in timed}
    base = machine.baseline_run
    if base is not None and base.index in median_at:
        fig.add_trace(
            go.Scatter(
                x=[base.index], y=[median_at[base.index]], mode="markers", name="baseline",
                marker={"color": "#111111", "size": 17, "symbol": "star", "line": {"width": 1, "color": "#ffffff"}},
                text=[f"<b>baseline</b><br>{_e(base.short_commit)} {_e(base.date)} UTC<br>{_e(machine.baseline_file)}"],
                hovertemplate="%{text}<extra></extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
        shapes.append(_vline(base.index, "#111111", "dot"))
        annotations.append(_label(base.index, "baseline", "#111111", 1.0))
        shown.append("baseline")
    for kind, (name, colour, symbol) in MARKER_STYLE.items():
        marks = [m for m in series.markers if m.kind == kind and m.run in median_at]
        if not marks:
            continue
        fig.add_trace(
            go.Scatter(
                x=[m.run for m in marks], y=[median_at[m.run] for m in marks], mode="markers", name=name,
                marker={"color": colour, "size": 19, "symbol": symbol, "line": {"width": 2.5, "color": colour}},
                text=[f"<b>{_e(name)}</b> at {_e(runs[m.run].label)}<br>{_e(m.detail)}" for m in marks],
                hovertemplate="%{text}<extra></extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
        shapes += [_vline(m.run, colour, "dash") for m in marks]
        shown.append(kind)
    for step in series.steps:
        colour = STEP_COLOURS[step.kind]
        shapes.append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": step.last_before, "x1": step.first_after,
            "y0": 0, "y1": 1, "fillcolor": colour, "opacity": 0.14, "line": {"width": 0}, "layer": "below",
        })  # fmt: skip
        annotations.append(_label((step.last_before + step.first_after) / 2, _step_label(step, runs), colour, 0.93))
        fig.add_trace(
            go.Scatter(
                x=[step.first_after], y=[step.after_ns / scale], mode="markers", name=f"{step.kind} step",
                marker={"color": colour, "size": 14, "symbol": "arrow-up" if step.kind == "regression" else "arrow-down",
                        "line": {"width": 1, "color": "#ffffff"}},
                text=[_step_text(step, runs)], hovertemplate="%{text}<extra></extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
        shown.append("step")
    errors = [p for p in series.points if p.max_abs_error is not None]
    fig.add_trace(
        go.Scatter(
            x=[p.run for p in errors], y=[p.max_abs_error for p in errors], mode="lines+markers",
            name="max abs error", line={"color": "#6a3d9a", "width": 1}, marker={"size": 6},
            text=[_point_text(p, runs[p.run], scale, unit) for p in errors], hovertemplate="%{text}<extra></extra>",
        ),
        row=2, col=1,
    )  # fmt: skip
    step_every = max(1, -(-len(runs) // MAX_TICKS))
    ticks = list(range(0, len(runs), step_every))
    fig.update_xaxes(
        tickmode="array", tickvals=ticks, ticktext=[f"{_e(runs[i].short_commit)}<br>{_e(runs[i].date)}" for i in ticks],
        range=[-0.5, len(runs) - 0.5], showgrid=False, zeroline=False,
    )  # fmt: skip
    fig.update_xaxes(showticklabels=False, row=1, col=1)
    fig.update_yaxes(title_text=f"median latency ({unit})", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="max abs error", rangemode="tozero", row=2, col=1)
    steps_text = ", ".join(f"{s.kind} x{s.ratio:.3f}" for s in series.steps) or "no step"
    fig.update_layout(
        title={"text": f"<b>{_e(series.name)}</b>  <span style='font-size:12px'>({_e(steps_text)})</span>", "x": 0.01},
        template="plotly_white", height=PLOT_HEIGHT, margin={"l": 70, "r": 20, "t": 50, "b": 60},
        shapes=shapes, annotations=annotations, hovermode="closest",
        legend={"orientation": "v", "x": 1.01, "y": 1, "font": {"size": 11}},
    )  # fmt: skip
    return fig.to_plotly_json(), shown


def _vline(x: float, colour: str, dash: str) -> dict[str, Any]:
    return {"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
            "line": {"color": colour, "width": 1.2, "dash": dash}, "layer": "below"}  # fmt: skip


def _label(x: float, text: str, colour: str, y: float) -> dict[str, Any]:
    return {"x": x, "xref": "x", "y": y, "yref": "paper", "text": text, "showarrow": False,
            "font": {"size": 10, "color": colour}, "bgcolor": "rgba(255,255,255,0.8)", "yanchor": "bottom"}  # fmt: skip


def _step_text(step: FoundStep, runs: Sequence[RunInfo]) -> str:
    before, after = runs[step.last_before], runs[step.first_after]
    lines = [
        f"<b>{step.kind} x{step.ratio:.3f}</b>: {format_ns(step.before_ns)} -> {format_ns(step.after_ns)}",
        f"last run before: {_e(before.commit or 'no commit')} ({_e(before.date)})",
        f"first run after: {_e(after.commit or 'no commit')} ({_e(after.date)})",
        f"reported beyond {step.threshold:.1%} (the larger of the minimum step and the runs' spread)",
    ]
    lines += [_e(c[:160]) for c in step.coincides_with]
    return "<br>".join(lines)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { margin-bottom: 4px; } h2 { margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } code { font-size: 12px; }
.regression { color: #d62728; font-weight: 600; } .improvement { color: #1f77b4; font-weight: 600; }
.case { margin: 8px 0 18px; border: 1px solid #eee; } .note { color: #555; font-size: 13px; }
nav a { margin-right: 10px; font-size: 13px; }
"""


def _steps_table(history: History) -> str:
    steps = history.steps()
    if not steps:
        return "<p>No step change beyond the run-to-run spread in any case.</p>"
    rows = []
    for m, s, st in steps:
        before, after = m.runs[st.last_before], m.runs[st.first_after]
        anchor = f"case-{slug(m.id)}-{slug(s.name)}"
        rows.append(
            f"<tr><td>{_e(m.id)}</td><td><a href='#{anchor}'>{_e(s.name)}</a></td>"
            f"<td class='{st.kind}'>{st.kind} x{st.ratio:.3f}</td>"
            f"<td>{_e(format_ns(st.before_ns))} &rarr; {_e(format_ns(st.after_ns))}</td>"
            f"<td><code>{_e(before.commit or 'no commit')}</code><br>{_e(before.date)}</td>"
            f"<td><code>{_e(after.commit or 'no commit')}</code><br>{_e(after.date)}</td>"
            f"<td>{'<br>'.join(_e(c) for c in st.coincides_with) or '-'}</td></tr>"
        )
    return (
        "<table id='steps-table'><tr><th>machine</th><th>case</th><th>change</th><th>median</th>"
        "<th>last run before</th><th>first run after</th><th>coincides with</th></tr>" + "".join(rows) + "</table>"
    )


def _runs_table(machine: MachineHistory) -> str:
    rows = []
    for r in machine.runs:
        flags = ", ".join(f for f, on in (("baseline", r.baseline), ("--quick", r.quick),
                                         ("interrupted", not r.complete), ("schema 1", r.upgraded)) if on)  # fmt: skip
        gate = r.gate_summary or r.gate_note or ""
        rows.append(
            f"<tr><td>{r.index}</td><td><code>{_e(r.commit or 'no commit')}</code>{' (dirty)' if r.dirty else ''}</td>"
            f"<td>{_e(r.date)}</td><td>{_e(r.file)}</td><td>{_e(flags)}</td><td>{_e(gate)}</td></tr>"
        )
    return (
        f"<details><summary>{len(machine.runs)} runs</summary><table><tr><th>#</th><th>commit</th>"
        "<th>date (UTC)</th><th>file</th><th>flags</th><th>gate against the baseline</th></tr>"
        + "".join(rows) + "</table></details>"
    )  # fmt: skip


def _script_json(obj: Any) -> str:
    """JSON that is safe inside a <script> element (no ``</``, no ``<!--``)."""
    return json.dumps(obj, allow_nan=False, default=_plotly_default).replace("<", "\\u003c")


def _plotly_default(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)  # numpy arrays in plotly's JSON form
    if callable(tolist):
        return tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def render_html(history: History, title: str = "Benchmark history") -> str:
    """The whole page, plotly.js inlined (about 5 MB): viewable offline, from a file or a CI artifact."""
    offline = require("plotly.offline", "history", "the history dashboard")
    plotly_js = str(offline.get_plotlyjs()).replace("</script", "<\\/script")
    figures: dict[str, Any] = {}
    body = [
        f"<h1>{_e(title)}</h1>",
        f"<p class='note'>{history.run_count} runs on {len(history.machines)} machine(s), generated "
        f"{_e(history.generated)} from {_e(', '.join(history.sources))}. Steps are reported beyond the "
        f"run-to-run spread and {history.min_step:.1%}; verdicts are the gate's against each machine's "
        "baseline.</p>",
        "<h2 id='steps'>Step changes</h2>",
        _steps_table(history),
    ]
    for m in history.machines:
        base = m.baseline_run
        body.append(f"<section class='machine' id='machine-{slug(m.id)}'><h2>{_e(m.id)}</h2>")
        body.append(
            "<p class='note'>"
            + (f"baseline: {_e(m.baseline_file)} ({_e(base.label)})" if base is not None else "no baseline")
            + "".join(f"<br>note: {_e(n)}" for n in m.notes)
            + "</p>"
        )
        body.append(_runs_table(m))
        body.append(
            "<nav>" + "".join(f"<a href='#case-{slug(m.id)}-{slug(s.name)}'>{_e(s.name)}</a>" for s in m.series) + "</nav>"
        )
        for s in m.series:
            div = f"case-{slug(m.id)}-{slug(s.name)}"
            fig, shown = figure(m, s)
            figures[f"plot-{div}"] = fig
            body.append(
                f"<div class='case' id='{div}' data-machine='{_e(m.id)}' data-case='{_e(s.name)}' "
                f"data-markers='{_e(' '.join(shown))}'><div id='plot-{div}' class='plot'></div></div>"
            )
        body.append("</section>")
    script = (
        f"const FIGURES = {_script_json(figures)};\n"
        "const CONFIG = {displaylogo: false, responsive: true};\n"
        "Promise.all(Object.entries(FIGURES).map(([id, fig]) => Plotly.newPlot(id, fig.data, fig.layout, CONFIG)))\n"
        "  .then(() => { document.body.dataset.rendered = 'true'; })\n"
        "  .catch((err) => { document.body.dataset.rendered = 'failed'; console.error(err); });\n"
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style>\n<script>{plotly_js}</script>\n</head>\n"
        f"<body>\n{''.join(body)}\n<script>\n{script}</script>\n</body></html>\n"
    )
