"""Regression gate and run comparison, on synthetic sample sets (no timing, no load dependence)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import pytest
import torch

from harness.autocast.settings import AutocastSettings
from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.clocks import locked_clocks
from harness.bench.compare import compare, tactic_diffs
from harness.bench.gate import INCONCLUSIVE_EXIT, AccuracyTolerances, GateSettings, gate
from harness.bench.latency import LatencyResult, Timer
from harness.bench.results import SCHEMA_VERSION, CaseResult, sealed, write_results
from harness.bench.results_doc import Layer
from harness.bench.runner import MeasureSettings
from harness.bench.scenarios import Scenario
from harness.bench.stats import Summary, slow_phase
from harness.bench.tables import compare_table, gate_table
from harness.bench.telemetry import TelemetrySampler
from harness.cli.main import main
from harness.errors import HarnessError
from tests.test_telemetry_gpus import A, B, cuda_double, gpus

WEIGHTS = "sha256:" + "a" * 64


def make_doc(
    cases: list[dict[str, Any]],
    machine_id: str = "box",
    complete: bool = True,
    isa: tuple[str, ...] = ("avx2", "avx512f"),
    **settings: Any,
) -> dict[str, Any]:
    return sealed(
        {
            "schema_version": SCHEMA_VERSION,
            "created": "2025-01-01T00:00:00Z",
            "complete": complete,
            "machine": {"id": machine_id, "cpu": {"isa_flags": list(isa)}, "gpu": {"devices": []}},
            "git": {"commit": None, "dirty": None},
            "settings": settings,
            "cases": cases,
        },
        "test document",
    )


def latency_from(
    samples: np.ndarray | list[int], spread_threshold: float = 0.05, timer: Timer = "cpu"
) -> LatencyResult:
    summary = Summary.from_samples([int(s) for s in samples])
    return LatencyResult(
        summary=summary,
        iterations=summary.count,
        duration_s=sum(summary.samples) / 1e9,
        warmup_iterations=1,
        warmup_s=0.0,
        timer=timer,
        batch_size=1,
        spread_threshold=spread_threshold,
        slow_phase=slow_phase(summary.samples),
        remeasured=False,
        overhead=None,
    )


def case(
    samples: np.ndarray | list[int],
    *,
    mode: str = "fp16",
    model: str = "mlp",
    out_shift: float = 0.01,
    timer: Timer = "cpu",
    **fields: Any,
) -> dict[str, Any]:
    ref = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 0.5]])
    out = ref + out_shift
    entry = CaseResult(
        model=model,
        mode=mode,
        backend="cpu",
        latency=latency_from(samples, timer=timer),
        accuracy=compare_outputs(out, ref, logits=True),
        engine_fingerprint="sha256:engine-1",
        output_digest=output_digest(out),
        model_weights_digest=WEIGHTS,
        threads=1,
    ).to_dict()
    entry.update(fields)
    return entry


def lognormal(n: int, scale: float, seed: int, sigma: float = 0.03) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(np.log(100_000 * scale), sigma, n)


def test_a_real_slowdown_is_a_regression_a_speedup_an_improvement_a_rerun_passes() -> None:
    fast = make_doc([case(lognormal(400, 1.0, seed=1))])
    slow = make_doc([case(lognormal(400, 1.2, seed=2))])
    report = gate(fast, slow)
    (verdict,) = report.cases
    assert verdict.verdict == "regression" and verdict.fails and report.exit_code == 1
    assert verdict.latency is not None and verdict.latency.ratio > 1.15 and verdict.latency.p_slower < 1e-10
    assert 1.15 < verdict.latency.ci_low < verdict.latency.ratio < verdict.latency.ci_high
    rerun = gate(fast, copy.deepcopy(fast))
    assert rerun.exit_code == 0 and rerun.cases[0].verdict == "ok" and rerun.cases[0].latency.ratio == 1.0
    reverse = gate(slow, fast)
    assert reverse.cases[0].verdict == "improvement" and reverse.exit_code == 0


def test_needs_both_threshold_and_significance() -> None:
    base = make_doc([case(lognormal(400, 1.0, seed=1))])
    tiny = make_doc([case(lognormal(400, 1.01, seed=3))])
    report = gate(base, tiny)
    assert report.cases[0].latency.p_slower < 0.01  # real, but below the 5% threshold
    assert report.exit_code == 0 and report.cases[0].verdict == "ok"
    assert gate(base, tiny, GateSettings(latency_threshold=0.0)).exit_code == 1
    # 4 against 4 samples: the smallest one-sided exact p is 1/C(8,4) = 1/70 > 0.01
    few_base, few_cur = make_doc([case([100, 101, 102, 103])]), make_doc([case([150, 151, 152, 153])])
    few = gate(few_base, few_cur)
    assert few.cases[0].latency.p_slower == pytest.approx(1 / 70) and few.exit_code == 0
    assert gate(few_base, few_cur, GateSettings(alpha=0.05)).exit_code == 1


def test_missing_cases_fail_unless_allowed_and_new_cases_say_new() -> None:
    modes = ["fp32", "fp16", "bf16", "weak-fp16", "weak-bf16", "amp-fp16", "amp-bf16"]
    base = make_doc([case(lognormal(100, 1.0, seed=i), mode=m) for i, m in enumerate(modes)])
    subset = make_doc([case(lognormal(100, 1.0, seed=0), mode="fp32"), case([100_000] * 5, mode="explicit")])
    report = gate(base, subset)
    verdicts = {v.key[1]: v.verdict for v in report.cases}
    assert verdicts["explicit"] == "new" and verdicts["fp32"] == "ok"
    assert [m for m, v in verdicts.items() if v == "missing"] == sorted(modes[1:])
    # counts are counts of cases: 6 missing rows, 6 failing
    assert report.exit_code == 1 and len(report.failing) == 6
    assert report.summary().startswith("gate FAIL: 6 of 8 cases fail (6 missing, 1 new, 1 ok)")
    allowed = gate(base, subset, GateSettings(allow_missing=True))
    assert allowed.exit_code == 0 and allowed.summary().startswith("gate PASS: 0 of 8 cases fail")
    assert {v.key[1]: v.verdict for v in allowed.cases}["fp16"] == "missing"


def test_runs_that_share_no_case_are_refused() -> None:
    base = make_doc([case([100] * 5, model="resnet")])
    with pytest.raises(HarnessError, match="share no case"):
        gate(base, make_doc([case([100] * 5, model="/abs/path/model.py:make")]))
    with pytest.raises(HarnessError, match="share no case"):
        gate(base, make_doc([]))


def test_counts_equal_rows_and_a_faster_case_is_never_a_regression() -> None:
    noisy = lognormal(300, 1.0, seed=10, sigma=0.3)  # IQR/median about 40%: unstable
    shuffled = np.random.default_rng(11).permutation(noisy)  # the same distribution again
    base = make_doc([case(noisy, mode=m) for m in ("fp32", "fp16", "bf16")])
    cur = make_doc([case(shuffled, mode="fp32"), case(noisy * 0.6, mode="fp16"), case(shuffled, mode="bf16")])
    strict = gate(base, cur, GateSettings(fail_on_unstable=True))
    verdicts = {v.key[1]: v.verdict for v in strict.cases}
    # x0.6 and unstable: it fails (the flag), labelled unstable, never "regression"
    assert verdicts == {"fp32": "unstable", "fp16": "unstable", "bf16": "unstable"}
    assert any(f.severity == "improvement" for f in strict.cases[1].findings)
    assert len(strict.failing) == 3 and strict.summary().startswith("gate FAIL: 3 of 3 cases fail (3 unstable)")
    lenient = gate(base, cur)
    assert lenient.exit_code == INCONCLUSIVE_EXIT  # unstable alone fails nothing, and judges nothing
    assert {v.key[1]: v.verdict for v in lenient.cases}["fp16"] == "improvement"


def test_accuracy_regressions_are_absolute_with_flags_for_every_tolerance() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=4), task_accuracy={"name": "top1", "value": 0.80, "samples": 100})])
    tol = GateSettings(tolerances=AccuracyTolerances(max_abs_error_increase=0.01, cosine_drop=1e-4, top1_drop=0.0, task_accuracy_drop=0.01))

    def failing(**changes: Any) -> list[str]:
        cur = copy.deepcopy(base["cases"][0])
        for dotted, value in changes.items():
            target = cur
            *path, last = dotted.split("__")
            for key in path:
                target = target[key]
            target[last] = value
        report = gate(base, make_doc([cur]), tol)
        return [f.message.split(" ")[0] for c in report.failing for f in c.findings if f.severity == "fail"]

    acc = base["cases"][0]["accuracy"]
    assert failing(accuracy__max_abs_error=acc["max_abs_error"] + 0.009) == []
    assert failing(accuracy__max_abs_error=acc["max_abs_error"] + 0.02) == ["max"]
    assert failing(accuracy__cosine=acc["cosine"] - 5e-5) == []
    assert failing(accuracy__cosine=acc["cosine"] - 2e-4) == ["cosine"]
    assert failing(accuracy__top1_agreement=0.5) == ["top-1"]
    assert failing(task_accuracy={"name": "top1", "value": 0.795, "samples": 100}) == []
    assert failing(task_accuracy={"name": "top1", "value": 0.78, "samples": 100}) == ["task"]


def test_outputs_that_become_non_finite_fail_the_gate() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=5))])
    nan_case = case(lognormal(50, 1.0, seed=5), out_shift=float("nan"))
    assert nan_case["status"] == "non-finite" and nan_case["accuracy"]["nan_count"] == 6
    report = gate(base, make_doc([nan_case]))
    (verdict,) = report.cases
    assert verdict.verdict == "non-finite" and report.exit_code == 1
    assert "outputs became non-finite (6 NaN, 0 Inf)" in verdict.findings[0].message
    both = gate(make_doc([nan_case]), make_doc([copy.deepcopy(nan_case)]))
    assert both.exit_code == 0 and both.cases[0].verdict == "non-finite"


def test_runs_of_different_model_weights_are_named_and_fail() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=6))])
    other = make_doc([case(lognormal(50, 1.0, seed=6), model_weights_digest="sha256:" + "b" * 64)])
    report = gate(base, other)
    assert report.cases[0].verdict == "weights-changed" and report.exit_code == 1
    assert "weights differ" in report.cases[0].findings[0].message
    comparison = compare(base, other)
    assert comparison.cases[0].weights_equal is False
    assert "model weights differ in: mlp/fp16/cpu" in compare_table(comparison)


def test_determinism_regressions() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=5), timing_cache_digest="sha256:cache-a")])

    def det(**fields: Any) -> list[str]:
        cur = {**copy.deepcopy(base["cases"][0]), **fields}
        return [f.message for c in gate(base, make_doc([cur])).failing for f in c.findings if f.kind == "determinism"]

    assert det(engine_fingerprint="sha256:engine-2") == [
        "engine fingerprint changed (sha256:engine-1 -> sha256:engine-2) although both runs built "
        "from the same timing cache"
    ]
    # a cache edited on purpose (cache pin) has another digest: another engine is its point
    assert det(engine_fingerprint="sha256:engine-2", timing_cache_digest="sha256:cache-b") == []
    assert det(engine_fingerprint="sha256:engine-2", timing_cache_digest="sha256:cache-b", from_cache=True) == []
    assert det(output_digest="sha256:" + "f" * 64) == ["same engine fingerprint but the outputs changed"]
    assert det(output_digest="sha256:" + "f" * 64, engine_fingerprint="sha256:e3", timing_cache_digest=None) == []
    # Between two commits the finding still fails, and names them: the runtime may have changed.
    other_commit = make_doc([{**copy.deepcopy(base["cases"][0]), "output_digest": "sha256:" + "f" * 64}])
    other_commit["git"] = {"commit": "b" * 40, "dirty": False}
    (finding,) = [f for c in gate(base, other_commit).failing for f in c.findings if f.kind == "determinism"]
    assert finding.message.startswith("same engine fingerprint but the outputs changed (the runs are of commits ")
    assert f"unknown and {'b' * 40}" in finding.message and "promote a baseline of this commit" in finding.message


def test_failed_cases_and_an_incomplete_run_fail_the_gate() -> None:
    base = make_doc([case(lognormal(50, 1.0, seed=7), mode="bf16"), case(lognormal(50, 1.0, seed=8))])
    cur = make_doc([CaseResult.failed("mlp", "bf16", "cpu", "out of memory").to_dict(), case(lognormal(50, 1.0, seed=8))])
    report = gate(base, cur)
    verdicts = {v.key[1]: v for v in report.cases}
    assert verdicts["bf16"].verdict == "failed" and "out of memory" in verdicts["bf16"].findings[0].message
    assert report.exit_code == 1 and len(report.failing) == 1
    partial = gate(base, make_doc(base["cases"], complete=False))
    assert partial.exit_code == 1 and not partial.failing
    assert partial.problems == ["the current run is incomplete (interrupted); finish it with --resume"]
    assert partial.summary().endswith("; the current run is incomplete (interrupted); finish it with --resume")


def test_gate_refuses_other_machines_and_notes_settings() -> None:
    a = make_doc([case([1, 2, 3])], measure=MeasureSettings(warmup_s=1.0).to_dict())
    with pytest.raises(HarnessError, match="baseline is from machine 'box' but the run is from 'other'"):
        gate(a, make_doc([case([1, 2, 3])], machine_id="other"))
    report = gate(a, make_doc([case([1, 2, 3])], measure=MeasureSettings(warmup_s=2.0).to_dict()))
    assert report.notes == ["settings differ: measure"] and report.to_dict()["exit_code"] == report.exit_code != 1


_SCENARIOS = [{"name": "offline", "label": "offline", **Scenario("offline").params()}]
_AUTOCAST = AutocastSettings().to_json()


@pytest.mark.parametrize(
    ("baseline", "current", "differ"),
    [
        # a nested setting is named by its top-level field, as the notes always did
        ({"measure": MeasureSettings().to_dict()}, {"measure": MeasureSettings(min_iters=31).to_dict()}, ["measure"]),
        (
            {"model_settings": {"m": {"reference": "m", "explicit": None, "autocast": {**_AUTOCAST, "data_max": 512.0}}}},
            {"model_settings": {"m": {"reference": "m", "explicit": None, "autocast": {**_AUTOCAST, "data_max": 256.0}}}},
            ["model_settings"],
        ),
        # settings the document did not declare before, and one only the current run recorded
        ({"peers": []}, {"peers": ["eager"]}, ["peers"]),
        ({}, {"scenarios": _SCENARIOS}, ["scenarios"]),
        ({"quick": False, "threads": 1}, {"quick": True, "threads": 2, "lock_clocks": "base"}, ["lock_clocks", "quick", "threads"]),
        # left out and null are one value; equal records are no difference
        ({"cache_dir": None, "threads": 1}, {"threads": 1}, []),
        ({"measure": MeasureSettings().to_dict()}, {"measure": MeasureSettings().to_dict()}, []),
    ],
)
def test_the_settings_that_differ_are_named_by_field(baseline: dict[str, Any], current: dict[str, Any], differ: list[str]) -> None:
    report = gate(make_doc([case([1, 2, 3])], **baseline), make_doc([case([1, 2, 3])], **current))
    assert [n for n in report.notes if n.startswith("settings differ")] == (
        [f"settings differ: {', '.join(differ)}"] if differ else []
    )


def test_a_misspelt_setting_is_refused_naming_it() -> None:
    with pytest.raises(HarnessError, match=r"invalid at settings: .*'treads' was unexpected\); valid keys: backend"):
        make_doc([case([1, 2, 3])], treads=1)
    with pytest.raises(HarnessError, match=r"invalid at settings/measure: .*'warmup' was unexpected\)"):
        make_doc([case([1, 2, 3])], measure={**MeasureSettings().to_dict(), "warmup": 1.0})


def test_gate_refuses_a_cpu_baseline_with_other_isa_under_one_machine_id() -> None:
    # One VM model name covered CPUs with and without AMX (bf16 9x apart):
    # an id set by HARNESS_MACHINE_ID, or an old baseline, must not hide that.
    amx = make_doc([case([1, 2, 3])], isa=("amx_bf16", "avx512f"))
    plain = make_doc([case([1, 2, 3])], isa=("avx512f",))
    with pytest.raises(HarnessError, match="only in the baseline: amx_bf16; only in the run: -.*--ignore-isa"):
        gate(amx, plain)
    assert gate(amx, plain, GateSettings(ignore_isa=True)).exit_code != 1


def test_other_thread_counts_are_not_compared_for_latency() -> None:
    base = make_doc([case(lognormal(200, 1.0, seed=8))])
    cur = make_doc([case(lognormal(200, 2.0, seed=9), threads=2)])
    report = gate(base, cur)
    assert report.exit_code == INCONCLUSIVE_EXIT and report.cases[0].latency is None  # compared nothing
    assert "threads differ (1 vs 2)" in report.cases[0].findings[0].message


def test_gate_table() -> None:
    base = make_doc([case(lognormal(200, 1.0, seed=8))])
    text = gate_table(gate(base, make_doc([case(lognormal(200, 1.2, seed=9))])))
    assert "mlp/fp16/cpu" in text and "regression" in text and "slower: median x1.2" in text
    assert text.rstrip().endswith("gate FAIL: 1 of 1 cases fail (1 regression); 1 judged, 1 needed")
    assert gate_table(gate(base, base), fmt="github").splitlines()[-1] == "gate PASS: 0 of 1 cases fail (1 ok); 1 judged, 1 needed"


def test_compare_runs_across_machines() -> None:
    layers_a = [{"name": "conv1", "tactic": "implicit_gemm"}, {"name": "fc", "tactic": "gemm"}]
    layers_b = [{"name": "conv1", "tactic": "winograd"}, {"name": "fc", "tactic": "gemm"}, {"name": "extra", "tactic": "x"}]
    a = make_doc([case([100] * 5, layers=layers_a, task_accuracy={"name": "top1", "value": 0.9, "samples": 10}),
                  case([100] * 5, mode="fp32")])  # fmt: skip
    b_case = case([150] * 5, layers=layers_b, engine_fingerprint="sha256:engine-9",
                  task_accuracy={"name": "top1", "value": 0.8, "samples": 10})  # fmt: skip
    b_case["accuracy"]["cosine"] -= 0.001
    b = make_doc([b_case, case([100] * 5, mode="bf16")], machine_id="gpu-b")
    result = compare(a, b)
    (c,) = result.cases
    assert c.fingerprints_equal is False and c.outputs_equal is True and c.weights_equal is True
    assert c.latency_ratio == pytest.approx(1.5)
    assert c.cosine_delta == pytest.approx(-0.001) and c.max_abs_error_delta == 0.0
    assert c.task_accuracy_delta == pytest.approx(-0.1)
    assert [(d.layer, d.tactic_a, d.tactic_b) for d in c.tactic_diffs or []] == [
        ("conv1", "implicit_gemm", "winograd"),
        ("extra", None, "x"),
    ]
    assert result.only_in_a == [("mlp", "fp32", "cpu", None, "single-stream")]
    assert result.only_in_b == [("mlp", "bf16", "cpu", None, "single-stream")]
    typed_a = [Layer(**entry) for entry in layers_a]
    assert tactic_diffs(typed_a, None) is None and tactic_diffs(typed_a, typed_a) == []
    text = compare_table(result)
    assert text.startswith("box (a) vs gpu-b (b)")
    assert "DIFFERENT" in text and "2 differ" in text and "winograd" in text and "(absent)" in text
    assert "only in a: mlp/fp32/cpu" in text and "only in b: mlp/bf16/cpu" in text
    assert result.to_dict()["cases"][0]["key"] == "mlp/fp16/cpu"


def test_a_slowdown_within_the_runs_own_spread_is_reported_not_judged() -> None:
    """Two runs of one commit on a shared VM: the current run spread 10% and its median moved 8%
    (the gate failed it with p=1e-248). Such a shift is not judged; one beyond the spread is, and stable runs keep the threshold alone."""
    base = make_doc([case(lognormal(2000, 1.0, seed=20))])  # IQR/median about 4%: stable
    drifted = make_doc([case(lognormal(2000, 1.08, seed=21, sigma=0.075))])  # about 10%: unstable
    report = gate(base, drifted)
    (verdict,) = report.cases
    assert verdict.latency is not None and 1.06 < verdict.latency.ratio < 1.1 and verdict.latency.p_slower < 1e-10
    assert verdict.verdict == "unstable" and not verdict.fails and report.exit_code == INCONCLUSIVE_EXIT
    (unjudged,) = [f for f in verdict.findings if "not judged" in f.message]
    assert "within the spread of an unstable run" in unjudged.message and "slower: median x1.0" in unjudged.message
    assert gate(base, drifted, GateSettings(fail_on_unstable=True)).exit_code == 1
    slower = make_doc([case(lognormal(2000, 1.3, seed=22, sigma=0.075))])
    (real,) = gate(base, slower).cases
    assert real.verdict == "regression" and real.fails
    # stable runs: the threshold alone decides, as before
    (stable,) = gate(base, make_doc([case(lognormal(2000, 1.08, seed=23))])).cases
    assert stable.verdict == "regression"


def gpu_run(
    monkeypatch: pytest.MonkeyPatch, gpu: str, lock: str | int | None = None, timer: Timer = "cuda"
) -> dict[str, Any]:
    """A run of one case timed on the GPU (CUDA's device 0 is NVML's ``gpu``), its telemetry sampled
    under ``harness bench --lock-clocks lock`` (None: unlocked), as the bench records it.
    ``timer="cpu"``: a CPU case of a GPU machine, whose telemetry samples the GPU all the same."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda_double(monkeypatch, gpu)
    nvml = gpus()
    with locked_clocks(lock, module=nvml) if lock is not None else contextlib.nullcontext():
        with TelemetrySampler(interval_s=0.01, nvml_module=nvml) as sampler:
            pass
    entry = case(lognormal(300, 1.0, seed=5), timer=timer, telemetry=sampler.summary())
    return make_doc([entry], **({} if lock is None else {"lock_clocks": lock}))


def test_runs_at_other_clocks_or_on_other_gpus_get_a_note_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    unlocked, base = gpu_run(monkeypatch, B), gpu_run(monkeypatch, B, "base")
    report = gate(unlocked, base)
    assert report.exit_code == 0 and [c.verdict for c in report.cases] == ["ok"]  # a note, not a failure
    assert report.notes == [
        "settings differ: lock_clocks",
        "clock settings differ: baseline graphics clock not locked, current graphics clock locked at 1410 MHz "
        "(--lock-clocks base); latency differences may come from the clocks, not the code",
    ]
    assert gate(base, gpu_run(monkeypatch, B, 1980)).notes[1:] == [
        "clock settings differ: baseline graphics clock locked at 1410 MHz (--lock-clocks base), current "
        "graphics clock locked at 1980 MHz (--lock-clocks 1980); latency differences may come from the clocks, not the code"
    ]
    assert gate(unlocked, gpu_run(monkeypatch, A)).notes == [
        f"GPUs differ: baseline on GPU-{B}, current on GPU-{A} (one machine id, other physical GPUs); "
        "latency differences may come from the GPU, not the code"
    ]
    assert gate(base, gpu_run(monkeypatch, B, 1410)).notes == ["settings differ: lock_clocks"]  # the same clock
    assert gate(unlocked, gpu_run(monkeypatch, B)).notes == []
    # CPU cases did not run on the GPU their telemetry sampled: nothing to note
    assert gate(gpu_run(monkeypatch, B, timer="cpu"), gpu_run(monkeypatch, A, timer="cpu")).notes == []


def test_an_older_gpu_baseline_without_clock_records_counts_as_unlocked(monkeypatch: pytest.MonkeyPatch) -> None:
    older = make_doc([case(lognormal(300, 1.0, seed=5), timer="cuda", telemetry=None)])
    assert gate(older, gpu_run(monkeypatch, B)).notes == []  # nothing to tell apart, no GPU named in the older run
    (note,) = [n for n in gate(older, gpu_run(monkeypatch, B, "max")).notes if n.startswith("clock")]
    assert note.startswith("clock settings differ: baseline graphics clock not locked, current graphics clock locked at 1980 MHz")


def test_the_gate_command_prints_the_clock_note(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    for name, doc in (("b.json", gpu_run(monkeypatch, B, "max")), ("c.json", gpu_run(monkeypatch, B))):
        write_results(tmp_path / name, doc)
    assert main(["gate", "--baseline", str(tmp_path / "b.json"), "--current", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "gate PASS" in out
    assert "\nnote: clock settings differ: baseline graphics clock locked at 1980 MHz (--lock-clocks max), current graphics clock not locked;" in out


def test_a_gate_that_judged_too_little_is_inconclusive_not_pass():
    """Nothing failed, but the comparable cases were unstable and the rest missing (a subset run
    with --allow-missing): the gate says INCONCLUSIVE, with its own exit code, until enough
    cases are judged; --min-judged lowers the number needed."""
    stable = [100_000 + i for i in range(40)]
    noisy = lognormal(300, 1.0, seed=6, sigma=0.3)  # IQR/median far above 5%: an unstable run
    base = make_doc([case(stable, mode="fp32"), case(stable, mode="bf16"), case(noisy, mode="fp16")])
    cur = make_doc([case(noisy, mode="fp16")])
    report = gate(base, cur, GateSettings(allow_missing=True))
    assert report.failing == [] and (report.judged, report.required) == (0, 1)
    assert report.outcome == "INCONCLUSIVE" and report.exit_code == INCONCLUSIVE_EXIT == 3
    assert report.summary().startswith("gate INCONCLUSIVE: 0 of 3 cases fail (2 missing, 1 unstable); 0 judged, 1 needed")
    assert gate(base, cur, GateSettings(allow_missing=True, min_judged=0)).outcome == "PASS"
    # without --allow-missing the missing cases fail, and the finding says how to gate a subset run
    strict = gate(base, cur)
    assert strict.outcome == "FAIL"
    assert any("--allow-missing" in f.message for v in strict.failing for f in v.findings)
    # an unstable baseline case cannot be judged either; with every case stable in both, PASS
    calm = make_doc([case(stable, mode=m) for m in ("fp32", "bf16", "fp16")])
    assert (gate(base, calm).judged, gate(base, calm).outcome) == (2, "INCONCLUSIVE")
    judged = gate(calm, copy.deepcopy(calm))
    assert (judged.judged, judged.required, judged.outcome) == (3, 3, "PASS")
