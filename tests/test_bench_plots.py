"""Pareto front on hand cases; plots written as decodable PNGs next to the results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest

from harness.bench.latency import LatencyResult
from harness.bench.plots import _plot_model, _Point, _points, pareto_front, plot_results
from harness.bench.results import SCHEMA_VERSION, CaseResult, sealed
from harness.bench.results_doc import read_run
from harness.bench.stats import Summary, slow_phase


def test_pareto_front_hand_cases() -> None:
    # (latency, error): fp32 slow+exact, fp16 fast+some error, bf16 dominated by fp16,
    # autocast between the two, weak slower and worse than autocast
    points = [(10.0, 0.0), (3.0, 1e-3), (3.5, 2e-3), (5.0, 1e-4), (6.0, 2e-4)]
    assert pareto_front(points) == [1, 3, 0]  # ordered by latency
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]
    # equal points do not dominate each other; a tie in one coordinate does
    assert pareto_front([(2.0, 2.0), (2.0, 2.0), (2.0, 3.0), (3.0, 2.0)]) == [0, 1]
    # a chain where each point beats the next on both axes has one winner
    assert pareto_front([(3.0, 3.0), (2.0, 2.0), (1.0, 1.0)]) == [2]


def _latency(median_ms: float, unstable: bool) -> LatencyResult:
    """Samples around ``median_ms`` (IQR/median 2%, p95 1.2x the median), in no order of time;
    unstable: judged against a 1% spread threshold instead of 5%."""
    ns = int(median_ms * 1e6)
    d = ns // 100
    ordered = [ns - d] * 6 + [ns] * 8 + [ns + d] * 4 + [int(ns * 1.2)] * 2
    samples = [int(s) for s in np.random.default_rng(0).permutation(ordered)]
    summary = Summary.from_samples(samples)
    return LatencyResult(
        summary=summary, iterations=summary.count, duration_s=sum(samples) / 1e9, warmup_iterations=1,
        warmup_s=0.0, timer="cpu", batch_size=1, spread_threshold=0.01 if unstable else 0.05,
        slow_phase=slow_phase(summary.samples), remeasured=False, overhead=None,
    )  # fmt: skip


def _case(
    model: str,
    mode: str,
    median_ms: float,
    cosine: float | None,
    backend: str = "cpu",
    status: str = "ok",
    unstable: bool = False,
) -> dict[str, Any]:
    if status == "failed":
        return CaseResult.failed(model, mode, backend, "boom").to_dict()
    latency = _latency(median_ms, unstable)
    entry = CaseResult(model=model, mode=mode, backend=backend, latency=latency).to_dict()
    entry["status"] = status
    entry["accuracy"] = {
        "max_abs_error": None if cosine is None else (1 - cosine) * 10,
        "mean_abs_error": None,
        "max_rel_error": None,
        "cosine": cosine,
        "snr_db": None,
        "top1_agreement": None,
        "nan_count": 12 if status == "non-finite" else 0,
        "inf_count": 0,
        "identical": cosine == 1.0,
        "outputs": [],
    }
    return entry


def _doc(cases: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """A whole results document of ``cases`` (machine ``box``), sealed as a run writes it."""
    return sealed(
        {
            "schema_version": SCHEMA_VERSION,
            "created": "2025-01-01T00:00:00Z",
            "complete": True,
            "machine": {"id": "box", "cpu": {"isa_flags": []}, "gpu": {"devices": []}},
            "git": {"commit": None, "dirty": None},
            "settings": settings,
            "cases": cases,
        },
        "test document",
    )


def test_plot_results_writes_decodable_pngs(tmp_path: Path) -> None:
    doc = _doc(
        [
            _case("resnet/tiny", "fp32", 10.0, 1.0),  # exact: drawn at the floor of the log axis
            _case("resnet/tiny", "fp16", 3.0, 0.9999),
            _case("resnet/tiny", "bf16", 3.5, 0.999),
            _case("resnet/tiny", "fp16", 2.0, 0.99, backend="onnxruntime"),
            _case("mlp", "fp32", 1.0, 1.0 - 1e-9),
            _case("mlp", "fp16", 0.4, 0.9995),
            _case("broken", "fp16", 0.0, None, status="failed"),
            _case("nocos", "fp16", 1.0, None),
        ]
    )
    results = tmp_path / "runs" / "run-20250101T000000Z.json"
    paths = plot_results(doc, results)
    # one plot per model with something to plot; model names made file-safe
    # "broken" only failed: nothing has a latency, so no plot; "nocos" is marked, not dropped
    assert paths == [
        results.parent / "run-20250101T000000Z-mlp.png",
        results.parent / "run-20250101T000000Z-nocos.png",
        results.parent / "run-20250101T000000Z-resnet_tiny.png",
    ]
    for p in paths:
        image = matplotlib.image.imread(p)
        assert image.shape[0] == 500 and image.shape[1] == 700 and image.shape[2] in (3, 4)
        assert image[..., :3].std() > 0  # something was drawn
    more = plot_results(doc, results, error_metric="max_abs_error")
    assert more == paths


def test_close_modes_get_readable_labels_and_wide_spans_a_log_axis() -> None:
    # bf16 and autocast-bf16 nearly on top of each other, fp32 450x faster (as digits on this CPU)
    points = [
        _Point("fp32", 0.027, 0.03, 5e-15),
        _Point("bf16", 12.7, 15.1, 2.2e-6),
        _Point("autocast-bf16", 14.3, 15.9, 2.2e-6),
    ]
    fig = _plot_model("digits", points, [], "1-cosine", "")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    renderer = fig.canvas.get_renderer()
    boxes = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts}
    assert set(boxes) == {"fp32 *", "bf16", "autocast-bf16"}  # fp32 dominates here
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["Pareto front", "Pareto-optimal mode", "mode (median, p95)"]
    narrow = _plot_model(
        "m", [_Point("fp32", 2.0, 2.5, 0.0), _Point("bf16", 1.0, 1.1, 1e-3)], [], "1-cosine", ""
    )
    assert narrow.axes[0].get_xscale() == "linear"
    # medians close together but a p95 whisker 70x out (a user model under load): a log axis too
    whisker = _plot_model(
        "m", [_Point("fp32", 0.3, 21.0, 0.0), _Point("bf16", 0.2, 0.25, 1e-3)], [], "1-cosine", ""
    )
    assert whisker.axes[0].get_xscale() == "log"


def test_plot_titles_mark_a_quick_run_and_unstable_cases(tmp_path: Path) -> None:
    from harness.bench.plots import _title_suffix

    cases = [_case("m", "fp32", 2.0, 1.0), _case("m", "bf16", 1.0, 1e-3, unstable=True)]
    quick = read_run(_doc(cases, quick=True))
    assert quick.cases[1].latency is not None and quick.cases[1].latency.unstable
    flags = " [--quick: a pipeline check, not numbers] [1 unstable]"
    assert _title_suffix(quick, quick.cases) == " on box" + flags
    full = read_run(_doc(cases))
    assert _title_suffix(full, full.cases[:1]) == " on box"


def test_non_finite_and_failed_modes_are_marked_not_dropped() -> None:
    cases = [
        _case("m", "fp32", 2.0, 1.0),
        _case("m", "fp16", 1.0, None, status="non-finite"),  # all NaN: no error to place
        _case("m", "bf16", 0.0, None, status="failed"),
    ]
    points, absent = _points(read_run(_doc(cases)).cases, "1-cosine")
    assert [p.label for p in points] == ["fp32"]
    fig = _plot_model("m", points, absent, "1-cosine", "")
    ax = fig.axes[0]
    texts = {t.get_text() for t in ax.texts} | {t.get_text() for t in fig.texts}
    assert "fp16: NON-FINITE (NaN 12, Inf 0)" in texts
    assert "not plotted: bf16: failed" in texts
    assert "no error to plot (non-finite outputs)" in [t.get_text() for t in ax.get_legend().get_texts()]
    # the cross sits a decade above every real error (fp32 exact: drawn at the floor 1e-12)
    cross = next(c for c in ax.collections if c.get_label() == "no error to plot (non-finite outputs)")
    assert cross.get_offsets()[0][1] == pytest.approx(1e-11)
