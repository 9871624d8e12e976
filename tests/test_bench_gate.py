"""Regression gate and run comparison, on real measurements and fixed sample sets."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.compare import compare, tactic_diffs
from harness.bench.gate import AccuracyTolerances, gate
from harness.bench.latency import LatencyResult, measure_latency
from harness.bench.results import SCHEMA_VERSION, CaseResult, check_results
from harness.bench.stats import Summary
from harness.bench.tables import compare_table, gate_table
from harness.errors import HarnessError


def make_doc(
    cases: list[dict[str, Any]], machine_id: str = "box", **settings: Any
) -> dict[str, Any]:
    doc = {
        "schema_version": SCHEMA_VERSION,
        "created": "2025-01-01T00:00:00Z",
        "complete": True,
        "machine": {"id": machine_id},
        "git": {"commit": None, "dirty": None},
        "settings": settings,
        "cases": cases,
    }
    check_results(doc, "test document")
    return doc


def latency_from(samples: np.ndarray | list[int], cov_threshold: float = 0.05) -> LatencyResult:
    summary = Summary.from_samples([int(s) for s in samples])
    return LatencyResult(
        summary=summary,
        iterations=summary.count,
        duration_s=sum(summary.samples) / 1e9,
        warmup_iterations=1,
        warmup_s=0.0,
        timer="cpu",
        batch_size=1,
        cov_threshold=cov_threshold,
        unstable=summary.cov > cov_threshold,
        overhead=None,
    )


def case(
    samples: np.ndarray | list[int], *, mode: str = "fp16", model: str = "mlp", **fields: Any
) -> dict[str, Any]:
    ref = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 0.5]])
    out = ref + 0.01
    base = CaseResult(
        model=model,
        mode=mode,
        backend="cpu",
        latency=latency_from(samples),
        accuracy=compare_outputs(out, ref, logits=True),
        engine_fingerprint="sha256:engine-1",
        output_digest=output_digest(out),
    ).to_dict()
    base.update(fields)
    return base


def lognormal(n: int, scale: float, seed: int, sigma: float = 0.03) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(np.log(100_000 * scale), sigma, n)


def test_real_slower_workload_is_a_regression_and_identical_rerun_passes() -> None:
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(48, 48, generator=gen), torch.randn(96, 96, generator=gen)

    def measure(m: torch.Tensor) -> list[int]:
        r = measure_latency(
            lambda: torch.mm(m, m), warmup_s=0.02, min_iters=200, min_duration_s=0.1, max_iters=1000
        )
        return list(map(int, r.samples_ns))

    fast = make_doc([case(measure(small))])
    slow = make_doc([case(measure(large))])  # 8x the arithmetic

    report = gate(fast, slow)
    (verdict,) = report.cases
    assert verdict.verdict == "regression" and report.exit_code == 1
    assert (
        verdict.latency is not None
        and verdict.latency.ratio > 1.05
        and verdict.latency.p_slower < 0.01
    )
    assert [f.kind for f in verdict.findings if f.severity == "regression"] == ["latency"]

    rerun = gate(fast, copy.deepcopy(fast))
    assert rerun.exit_code == 0 and rerun.cases[0].verdict in ("ok", "unstable")
    assert rerun.cases[0].latency is not None and rerun.cases[0].latency.ratio == 1.0

    reverse = gate(slow, fast)
    assert reverse.cases[0].verdict == "improvement" and reverse.exit_code == 0


def test_needs_both_threshold_and_significance() -> None:
    base = make_doc([case(lognormal(400, 1.0, seed=1))])
    clear = gate(base, make_doc([case(lognormal(400, 1.10, seed=2))]))
    assert clear.exit_code == 1 and clear.cases[0].latency is not None
    lat = clear.cases[0].latency
    assert (
        lat.ci_low is not None
        and lat.ci_high is not None
        and 1.05 < lat.ci_low < lat.ratio < lat.ci_high
    )

    tiny_shift = gate(base, make_doc([case(lognormal(400, 1.01, seed=3))]))
    assert tiny_shift.cases[0].latency is not None
    assert tiny_shift.cases[0].latency.p_slower < 0.01  # real, but below the 5% threshold
    assert tiny_shift.exit_code == 0 and tiny_shift.cases[0].verdict == "ok"
    assert (
        gate(base, make_doc([case(lognormal(400, 1.01, seed=3))]), latency_threshold=0.0).exit_code
        == 1
    )

    # 4 against 4 samples: the smallest one-sided exact p is 1/C(8,4) = 1/70 > 0.01,
    # so even a 50% slowdown is not significant at alpha = 0.01
    few = gate(make_doc([case([100, 101, 102, 103])]), make_doc([case([150, 151, 152, 153])]))
    assert few.cases[0].latency is not None
    assert few.cases[0].latency.p_slower == pytest.approx(1 / 70) and few.exit_code == 0
    assert (
        gate(
            make_doc([case([100, 101, 102, 103])]),
            make_doc([case([150, 151, 152, 153])]),
            alpha=0.05,
        ).exit_code
        == 1
    )


def _with(doc: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    for dotted, value in changes.items():
        target = out["cases"][0]
        *path, last = dotted.split("__")
        for key in path:
            target = target[key]
        target[last] = value
    return out


def test_accuracy_regressions_are_absolute() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=4))])
    acc = base["cases"][0]["accuracy"]
    tol = AccuracyTolerances(
        max_abs_error_increase=0.01, cosine_drop=1e-4, top1_drop=0.0, task_accuracy_drop=0.01
    )

    def kinds(cur: dict[str, Any]) -> list[str]:
        report = gate(base, cur, accuracy_tolerances=tol)
        return [f.message.split(" ")[0] for _, f in report.regressions]

    assert kinds(_with(base, accuracy__max_abs_error=acc["max_abs_error"] + 0.009)) == []
    assert kinds(_with(base, accuracy__max_abs_error=acc["max_abs_error"] + 0.02)) == ["max"]
    assert kinds(_with(base, accuracy__cosine=acc["cosine"] - 5e-5)) == []
    assert kinds(_with(base, accuracy__cosine=acc["cosine"] - 2e-4)) == ["cosine"]
    assert kinds(_with(base, accuracy__top1_agreement=0.5)) == ["top-1"]
    assert kinds(_with(base, accuracy__nan_count=1)) == ["nan_count"]
    with_task = _with(base, task_accuracy={"name": "top1", "value": 0.80, "samples": 100})
    assert (
        kinds(_with(with_task, task_accuracy={"name": "top1", "value": 0.795, "samples": 100}))
        == []
    )
    report = gate(
        with_task,
        _with(with_task, task_accuracy={"name": "top1", "value": 0.78, "samples": 100}),
        accuracy_tolerances=tol,
    )
    assert report.exit_code == 1 and "task top1 0.8 -> 0.78" in report.regressions[0][1].message


def test_determinism_regressions() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=5), timing_cache_digest="sha256:cache-a")])

    def det(cur: dict[str, Any]) -> list[str]:
        return [f.message for _, f in gate(base, cur).regressions if f.kind == "determinism"]

    # same cache digest, different engine: the pinned tactics were not honoured
    assert det(_with(base, engine_fingerprint="sha256:engine-2")) == [
        "engine fingerprint changed (sha256:engine-1 -> sha256:engine-2) although the timing cache is pinned"
    ]
    # a new cache and no pin: a different engine is allowed
    assert (
        det(_with(base, engine_fingerprint="sha256:engine-2", timing_cache_digest="sha256:cache-b"))
        == []
    )
    # ... unless the case says its cache is pinned
    pinned = _with(
        base,
        engine_fingerprint="sha256:engine-2",
        timing_cache_digest="sha256:cache-b",
        pinned=True,
    )
    assert len(det(pinned)) == 1
    # ... or the whole run was built with pinned caches
    unpinned_change = _with(
        base, engine_fingerprint="sha256:engine-2", timing_cache_digest="sha256:cache-b"
    )
    unpinned_change["settings"]["pinned"] = True
    assert len(det(unpinned_change)) == 1
    # same engine, different bits out
    assert det(_with(base, output_digest="sha256:" + "f" * 64)) == [
        "same engine fingerprint but the outputs changed"
    ]
    assert (
        det(
            _with(
                base,
                output_digest="sha256:" + "f" * 64,
                engine_fingerprint="sha256:engine-3",
                timing_cache_digest=None,
            )
        )
        == []
    )


def test_unstable_missing_and_failed_cases() -> None:
    noisy = np.random.default_rng(6).lognormal(np.log(1e5), 0.5, 300)
    base = make_doc([case(noisy), case(lognormal(50, 1.0, seed=7), mode="bf16")])
    cur = make_doc(
        [
            case(noisy),
            CaseResult.failed("mlp", "bf16", "cpu", "out of memory").to_dict(),
            case([5, 6], mode="int8"),
        ]
    )
    report = gate(base, cur)
    verdicts = {v.key[1]: v for v in report.cases}
    assert verdicts["fp16"].verdict == "unstable"
    assert (
        verdicts["bf16"].verdict == "regression"
        and "out of memory" in verdicts["bf16"].findings[0].message
    )
    assert verdicts["int8"].verdict == "missing"
    assert report.exit_code == 1 and len(report.regressions) == 1
    strict = gate(base, make_doc([case(noisy)]), fail_on_unstable=True)
    assert strict.exit_code == 1 and {f.kind for _, f in strict.regressions} == {"unstable"}
    lenient = gate(base, make_doc([case(noisy)]))
    assert lenient.exit_code == 0
    assert {v.key[1]: v.verdict for v in lenient.cases} == {"fp16": "unstable", "bf16": "missing"}


def test_gate_refuses_other_machines_and_notes_settings() -> None:
    a = make_doc([case([1, 2, 3])], warmup_s=1.0)
    with pytest.raises(
        HarnessError, match="baseline is from machine 'box' but the run is from 'other'"
    ):
        gate(a, make_doc([case([1, 2, 3])], machine_id="other"))
    b = make_doc([case([1, 2, 3])], warmup_s=2.0)
    b["complete"] = False
    report = gate(a, b)
    assert report.notes == [
        "current run is incomplete (interrupted run)",
        "settings differ: warmup_s",
    ]
    assert report.to_dict()["exit_code"] == 0


def test_gate_table() -> None:
    base = make_doc([case(lognormal(200, 1.0, seed=8))])
    text = gate_table(gate(base, make_doc([case(lognormal(200, 1.2, seed=9))])))
    assert "mlp/fp16/cpu" in text and "regression" in text and "slower: median x1.2" in text
    assert text.rstrip().endswith("gate FAIL: 1 regressions, 0 improvements")
    assert (
        gate_table(gate(base, base), fmt="github").splitlines()[-1]
        == "gate PASS: 0 regressions, 0 improvements"
    )


def test_compare_runs_across_machines() -> None:
    layers_a = [{"name": "conv1", "tactic": "implicit_gemm"}, {"name": "fc", "tactic": "gemm"}]
    layers_b = [
        {"name": "conv1", "tactic": "winograd"},
        {"name": "fc", "tactic": "gemm"},
        {"name": "extra", "tactic": "x"},
    ]
    a = make_doc([case([100] * 5, layers=layers_a, task_accuracy={"name": "top1", "value": 0.9, "samples": 10}),
                  case([100] * 5, mode="fp32")])  # fmt: skip
    b_case = case([150] * 5, layers=layers_b, engine_fingerprint="sha256:engine-9",
                  task_accuracy={"name": "top1", "value": 0.8, "samples": 10})  # fmt: skip
    b_case["accuracy"]["cosine"] -= 0.001
    b = make_doc([b_case, case([100] * 5, mode="bf16")], machine_id="gpu-b")
    result = compare(a, b)
    (c,) = result.cases
    assert c.fingerprints_equal is False and c.outputs_equal is True
    assert c.latency_ratio == pytest.approx(1.5)
    assert c.cosine_delta == pytest.approx(-0.001) and c.max_abs_error_delta == 0.0
    assert c.task_accuracy_delta == pytest.approx(-0.1)
    assert [(d.layer, d.tactic_a, d.tactic_b) for d in c.tactic_diffs or []] == [
        ("conv1", "implicit_gemm", "winograd"),
        ("extra", None, "x"),
    ]
    assert result.only_in_a == [("mlp", "fp32", "cpu")] and result.only_in_b == [
        ("mlp", "bf16", "cpu")
    ]
    assert tactic_diffs(layers_a, None) is None and tactic_diffs(layers_a, layers_a) == []
    text = compare_table(result)
    assert text.startswith("box (a) vs gpu-b (b)")
    assert "DIFFERENT" in text and "2 differ" in text and "winograd" in text and "(absent)" in text
    assert "only in a: mlp/fp32/cpu" in text and "only in b: mlp/bf16/cpu" in text
    assert result.to_dict()["cases"][0]["key"] == "mlp/fp16/cpu"
