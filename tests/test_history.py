"""``harness history``: step detection, the history of planted runs, its JSON, Markdown and HTML.

The history under test is written by the project's own code: cases are
``CaseResult``s with ``LatencyResult``s of seeded samples and accuracy from
``compare_outputs``, each run sealed by ``write_results`` at the path
the results store gives (``FileStore.new_run``), and the baseline it promotes.
What is planted, and where (a user model's bf16 regression at a known
commit, another GPU, locked clocks, rebuilt engines, a ``--quick`` run, an
interrupted run, a shard file), is in the constants below; the tests check
that the history finds exactly that. No timing is measured anywhere.

The dashboard is opened in the system's headless Chromium
(tests/headless_chromium.py): skipped, saying so, only where
``/usr/bin/chromium`` is not installed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import math
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import harness.cli.main as cli_main
from harness.bench import step_detect
from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.dashboard import render_html
from harness.bench.gate import gate
from harness.bench.history import VOLATILE_MACHINE_FIELDS, collect
from harness.bench.latency import LatencyResult
from harness.bench.machine import machine_info
from harness.bench.results import (
    SCHEMA_VERSION,
    CaseResult,
    load_results,
    write_results,
)
from harness.bench.results_doc import Machine
from harness.bench.stats import Summary, slow_phase
from harness.bench.store import FileStore
from harness.cli import history_cmd
from harness.extras import install_command
from tests.headless_chromium import CHROMIUM, open_page

pytestmark = pytest.mark.slow  # the dashboard opens in a real browser

# --- the planted history ----------------------------------------------------------------

MACHINE_ID = "nvidia-a100-sxm4-40gb-trt10"
MODEL = "classifier"  # examples/team_project/my_model.py:classifier, a user model
MODES = ("fp32", "bf16", "autocast-bf16")
BACKEND = "tensorrt"
RUNS = 12  # full runs, one per commit, a day apart; index = commit number
STEP_RUN = 7  # bf16 is STEP_RATIO slower from this commit on (its engine rebuilt with other tactics)
STEP_RATIO = 1.30
BASELINE_RUN = 3  # promoted as the machine's baseline
GPU_CHANGE_RUN = 5  # another physical GPU of the model from here on
CLOCK_RUN = 10  # --lock-clocks base from here on
INTERRUPTED_RUN = RUNS - 1  # the newest run was interrupted (complete: false, no finish time)
FINGERPRINT_RUN = {"fp32": 9, "bf16": STEP_RUN, "autocast-bf16": 4}  # a new engine from here on
MEDIAN_NS = {"fp32": 2_000_000, "bf16": 1_000_000, "autocast-bf16": 1_100_000}
RUN_NOISE = 0.01  # run-to-run noise of a median (log sd), seeded
SAMPLE_SPREAD = 0.02  # within a run (lognormal sd): IQR/median about 2.7%, under the 5% threshold
QUICK_AFTER = 2  # a --quick run, 2x slower, the evening after this run: shown, never fitted
WEIGHTS = "sha256:" + "b" * 64
GPUS = ("GPU-5f1c0c5e-aaaa-4c6a-9d0b-000000000001", "GPU-5f1c0c5e-bbbb-4c6a-9d0b-000000000002")


def commit(i: int) -> str:
    return hashlib.sha1(f"commit {i}".encode()).hexdigest()


def _latency(median_ns: float, seed: int) -> LatencyResult:
    samples = np.random.default_rng(seed).lognormal(math.log(median_ns), SAMPLE_SPREAD, 300)
    summary = Summary.from_samples([int(s) for s in samples])
    return LatencyResult(
        summary=summary, iterations=summary.count, duration_s=sum(summary.samples) / 1e9, warmup_iterations=10,
        warmup_s=0.1, timer="cuda", batch_size=1, spread_threshold=0.05, slow_phase=slow_phase(summary.samples),
        remeasured=False, overhead=None,
    )  # fmt: skip


def _case(mode: str, i: int, *, gpu: str, locked: int | None, slower: float, seed: int) -> dict[str, Any]:
    ref = torch.tensor([[0.5, 1.5, -2.0, 3.0], [1.0, -0.25, 0.75, 2.0]])
    shift = 0.008 if mode == "autocast-bf16" and i >= FINGERPRINT_RUN[mode] else 0.004 * (mode != "fp32")
    out = ref + shift
    engine = int(i >= FINGERPRINT_RUN[mode])
    retimed = mode == "bf16" and engine == 1  # the regression's rebuild re-timed its cache
    entry = CaseResult(
        model=MODEL,
        mode=mode,
        backend=BACKEND,
        latency=_latency(MEDIAN_NS[mode] * slower, seed),
        accuracy=compare_outputs(out, ref, logits=True),
        engine_fingerprint="sha256:" + hashlib.sha256(f"{mode} engine {engine}".encode()).hexdigest(),
        timing_cache_digest="sha256:" + hashlib.sha256(f"{mode} cache {int(retimed)}".encode()).hexdigest(),
        output_digest=output_digest(out),
        model_weights_digest=WEIGHTS,
        threads=1,
        telemetry={
            "samples": 20, "cpu": {}, "throttled": False, "error": None,
            "gpu": {"uuid": gpu, "clocks": {"locked_graphics_mhz": locked, "max_graphics_mhz": 1410}},
        },
    ).to_dict()  # fmt: skip
    return entry


def _machine(gpu: str, host: int, machine_id: str) -> dict[str, Any]:
    """This machine's record (machine_info) as a GPU runner's: a hostname per runner, which is no change."""
    record = machine_info()
    record.update(
        id=machine_id,
        hostname=f"gpu-runner-{host}",
        tensorrt="10.13.0",
        gpu={"status": "ok", "driver": "550.54.15",
             "devices": [{"name": "NVIDIA A100-SXM4-40GB", "uuid": gpu, "capability": "8.0", "memory_bytes": 42949672960}]},
    )  # fmt: skip
    return record


def _later(stamp: str, minutes: int) -> str:
    when = dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ") + dt.timedelta(minutes=minutes)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def write_run(
    root: Path, i: int, *, quick: bool = False, created: str | None = None, machine_id: str = MACHINE_ID
) -> Path:
    """Run ``i`` (commit ``i``) as ``harness bench`` leaves it: planted medians, sealed by write_results."""
    rng = np.random.default_rng(1000 + i + 500 * quick)
    gpu = GPUS[int(i >= GPU_CHANGE_RUN)]
    locked = 1410 if i >= CLOCK_RUN else None
    created = created or f"2026-01-{i + 1:02d}T10:00:00Z"
    cases = []
    for m, mode in enumerate(MODES):
        slower = math.exp(rng.normal(0.0, RUN_NOISE)) * (2.0 if quick else 1.0)
        if mode == "bf16" and i >= STEP_RUN:
            slower *= STEP_RATIO
        cases.append(_case(mode, i, gpu=gpu, locked=locked, slower=slower, seed=10 * i + m + 5000 * quick))
    settings: dict[str, Any] = {"backend": BACKEND, "models": ["my_model.py:classifier"], "modes": list(MODES),
                                "quick": quick, "threads": 1, "batch_sizes": None}  # fmt: skip
    if i >= CLOCK_RUN:
        settings["lock_clocks"] = "base"
    complete = i != INTERRUPTED_RUN or quick
    doc = {
        "schema_version": SCHEMA_VERSION,
        "created": created,
        **({"finished": _later(created, minutes=40)} if complete else {}),
        "complete": complete,
        "machine": _machine(gpu, host=i % 3, machine_id=machine_id),
        "git": {"commit": commit(i), "dirty": False},
        "settings": settings,
        "cases": cases,
    }
    path = FileStore(root).new_run(machine_id, created=created)
    write_results(path, doc)
    return path


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """results/ with the planted machine directory: 12 runs, a --quick run, a shard copy, the baseline."""
    root = tmp_path_factory.mktemp("history") / "results"
    paths = [write_run(root, i) for i in range(RUNS)]
    write_run(root, QUICK_AFTER, quick=True, created=f"2026-01-{QUICK_AFTER + 1:02d}T18:00:00Z")
    FileStore(root).promote(paths[BASELINE_RUN])
    shutil.copy(paths[0], paths[0].with_name(paths[0].stem + "-shard1of2.json"))
    return root


@pytest.fixture(scope="module")
def history(planted: Path) -> Any:
    return collect([planted / MACHINE_ID])


def series_of(history: Any, mode: str) -> Any:
    (machine,) = history.machines
    return next(s for s in machine.series if s.key == (MODEL, mode, BACKEND, None, "single-stream"))


def run_index(history: Any, i: int) -> int:
    """The history's index of full run ``i`` (the --quick run sits among them)."""
    (machine,) = history.machines
    return next(r.index for r in machine.runs if r.commit == commit(i) and not r.quick)


# --- step detection on its own ------------------------------------------------------------


def _l1_cost(y: np.ndarray) -> float:
    return float(min(np.abs(y - y[k]).sum() for k in range(y.size)))


def test_the_fit_is_the_exact_optimum_of_the_penalized_cost() -> None:
    """Against every segmentation (segments of 2 or more) of 9 points: no other one costs less."""
    rng = np.random.default_rng(7)
    for trial in range(20):
        y = rng.normal(0, 0.03, 9) + np.where(np.arange(9) >= rng.integers(2, 8), rng.choice([0.0, 0.1]), 0.0)
        fit = step_detect.fit_steps(np.exp(y), [0.0] * 9, min_change=0.0)
        bounds = [0, *(s.start for s in fit.segments[1:]), 9]

        def objective(b: list[int], y: np.ndarray = y, penalty: float = fit.penalty) -> float:
            return sum(_l1_cost(y[a:c]) for a, c in zip(b, b[1:])) + penalty * (len(b) - 2)

        best = min(
            objective([0, *cut, 9])
            for k in range(0, 4)
            for cut in itertools.combinations(range(2, 8), k)
            if all(b - a >= 2 for a, b in zip([0, *cut], [*cut, 9]))
        )
        assert objective(bounds) == pytest.approx(best, abs=1e-12), trial


def test_pure_noise_rarely_shows_a_step_and_a_planted_one_is_found_where_it_is() -> None:
    rng = np.random.default_rng(11)
    noise_only = [step_detect.fit_steps(np.exp(rng.normal(0, 0.03, 10)), [0.0] * 10, min_change=0.0) for _ in range(300)]
    assert sum(bool(f.steps) for f in noise_only) <= 0.04 * 300  # penalty alone, no size filter: about 2%
    long_noise = [step_detect.fit_steps(np.exp(rng.normal(0, 0.03, 60)), [0.0] * 60, min_change=0.0) for _ in range(50)]
    assert not any(f.steps for f in long_noise)
    for k in (3, 5, 9):  # a 20% step with 3 or more runs on each side, at 3% noise: found exactly
        y = rng.normal(0, 0.03, 12)
        y[k:] += math.log(1.2)
        (step,) = step_detect.fit_steps(np.exp(y), [0.02] * 12).steps
        assert step.index == k and step.kind == "regression" and 1.1 < step.ratio < 1.3


def test_a_step_within_the_recorded_spread_or_the_minimum_is_not_reported() -> None:
    y = np.r_[np.full(6, 1.0), np.full(6, 1.08)] * np.exp(np.random.default_rng(3).normal(0, 0.002, 12))
    (step,) = step_detect.fit_steps(y, [0.02] * 12).steps  # 8% over a 2% spread: reported
    assert step.index == 6 and step.ratio == pytest.approx(1.08, rel=0.01) and step.threshold == 0.05
    assert not step_detect.fit_steps(y, [0.10] * 12).steps  # within a 10% spread: not
    assert not step_detect.fit_steps(y, [0.02] * 12, min_change=0.10).steps  # below --min-step 10%: not
    improvement = step_detect.fit_steps(y[::-1], [0.02] * 12).steps
    assert [(s.index, s.kind) for s in improvement] == [(6, "improvement")]


def test_one_slow_run_is_not_a_step_and_short_series_have_none() -> None:
    y = np.exp(np.random.default_rng(5).normal(0, 0.01, 12))
    y[6] *= 1.5  # one slow run: an outlier until another run confirms it
    fit = step_detect.fit_steps(y, [0.02] * 12)
    assert not fit.steps and len(fit.segments) == 1
    assert not step_detect.fit_steps([1.0, 1.0, 2.0], [0.0] * 3).steps  # fewer than 2 x 2 points
    with pytest.raises(ValueError, match="positive and finite"):
        step_detect.fit_steps([1.0, 0.0, 1.0, 1.0], [0.0] * 4)


# --- the history of the planted runs -------------------------------------------------------


def test_the_planted_regression_is_found_at_its_commit_and_nowhere_else(history: Any) -> None:
    (machine,) = history.machines
    assert len(machine.runs) == RUNS + 1 and [r.quick for r in machine.runs].count(True) == 1
    (step,) = series_of(history, "bf16").steps
    assert step.kind == "regression" and step.ratio == pytest.approx(STEP_RATIO, rel=0.03)
    assert machine.runs[step.last_before].commit == commit(STEP_RUN - 1)
    assert machine.runs[step.first_after].commit == commit(STEP_RUN)
    assert any(c.startswith("fingerprint change") for c in step.coincides_with)
    assert [(found.kind, s.name) for _, s, found in history.steps()] == [("regression", f"{MODEL}/bf16/{BACKEND}")]
    # the 2x slower --quick run is shown (its point is there) but not fitted: fp32 has no step
    fp32 = series_of(history, "fp32")
    assert len(fp32.points) == RUNS + 1 and not fp32.steps and len(fp32.levels) == 1


def test_baseline_verdicts_and_markers_are_where_they_were_planted(history: Any, planted: Path) -> None:
    (machine,) = history.machines
    base = machine.baseline_run
    assert base is not None and base.commit == commit(BASELINE_RUN) and not base.quick
    assert machine.baseline_file == os.fspath(planted / MACHINE_ID / "baseline.json")
    assert sum(r.baseline for r in machine.runs) == 1  # the baseline is its run, not a point of its own
    assert any("shard file" in n for n in machine.notes)
    for mode in MODES:
        s = series_of(history, mode)
        markers = {(m.kind, machine.runs[m.run].commit) for m in s.markers}
        assert markers == {
            ("fingerprint", commit(FINGERPRINT_RUN[mode])),
            ("machine", commit(GPU_CHANGE_RUN)),  # another GPU; the hostnames changed every run: no marker
            ("clock", commit(CLOCK_RUN)),
        }, mode
        gpu_marker = next(m for m in s.markers if m.kind == "machine")
        assert GPUS[0] in gpu_marker.detail and GPUS[1] in gpu_marker.detail and "hostname" not in gpu_marker.detail
        verdicts = {machine.runs[p.run].commit: p.verdict for p in s.points if not machine.runs[p.run].quick}
        assert verdicts[commit(BASELINE_RUN)] == "baseline"
        slow = {commit(i) for i in range(STEP_RUN, RUNS)} if mode == "bf16" else set()
        assert {c for c, v in verdicts.items() if v == "regression"} == slow, mode
    newest = machine.runs[-1]
    assert newest.commit == commit(INTERRUPTED_RUN) and not newest.complete and newest.gate_outcome == "FAIL"


def test_verdicts_are_the_gates_with_its_default_settings(history: Any, planted: Path) -> None:
    (machine,) = history.machines
    baseline = load_results(planted / MACHINE_ID / "baseline.json")
    for run in machine.runs:
        if run.baseline:
            continue
        report = gate(baseline, load_results(run.file))
        assert run.gate_outcome == report.outcome and run.gate_summary == report.summary()
        want = {v.key: v.verdict for v in report.cases}
        got = {s.key: p.verdict for s in machine.series for p in s.points if p.run == run.index}
        assert got == want, run.file


def test_several_machines_each_have_their_runs_series_and_baseline(planted: Path, tmp_path: Path) -> None:
    root = tmp_path / "results"
    shutil.copytree(planted / MACHINE_ID, root / MACHINE_ID)
    other = "nvidia-h100-80gb-hbm3-trt10"
    for i in range(4):
        write_run(root, i, machine_id=other)
    both = collect([root])  # a results root: one machine per subdirectory
    assert [m.id for m in both.machines] == sorted([MACHINE_ID, other])
    first, second = both.machines
    assert len(first.runs) == RUNS + 1 and len(second.runs) == 4
    assert second.baseline_run is None and second.notes == [f"no baseline.json for machine {other}: no gate verdicts"]
    assert all(p.verdict is None for s in second.series for p in s.points) and not any(s.steps for s in second.series)
    assert all(r.gate_note == "no baseline.json for this machine" for r in second.runs)
    assert [(m.id, s.name) for m, s, _ in both.steps()] == [(MACHINE_ID, f"{MODEL}/bf16/{BACKEND}")]
    same = collect([root / other, root / MACHINE_ID, root / other / "run-20260102T100000Z.json"])
    assert [len(m.runs) for m in same.machines] == [RUNS + 1, 4]  # a file named twice is read once


def test_a_machine_marker_names_the_typed_fields_that_changed_but_not_the_volatile_ones(tmp_path: Path) -> None:
    """Two runs of one GPU whose machine records differ in PyTorch's version and the hostname: one
    machine marker, naming the version by its dotted field; the hostname is no change."""
    root = tmp_path / "results"
    for i in range(2):
        write_run(root, i)
    second = sorted((root / MACHINE_ID).glob("run-*.json"))[1]
    doc = load_results(second)
    doc["machine"] = {**doc["machine"], "hostname": "elsewhere", "torch": {**doc["machine"]["torch"], "version": "9.9.9"}}
    write_results(second, doc)
    (machine,) = collect([root]).machines
    assert VOLATILE_MACHINE_FIELDS <= {f.name for f in dataclasses.fields(Machine)}
    for s in machine.series:
        (marker,) = s.markers
        assert marker.kind == "machine" and "hostname" not in marker.detail and marker.detail.endswith("torch.version: " + machine_info()["torch"]["version"] + " -> 9.9.9")
    assert [r.to_dict()["machine"] for r in machine.runs] == [
        {"hostname": host, "cpu": machine_info()["cpu"]["model"], "torch": torch, "tensorrt": "10.13.0"}
        for host, torch in (("gpu-runner-0", machine_info()["torch"]["version"]), ("elsewhere", "9.9.9"))
    ]


# --- the command: JSON, Markdown, HTML, bad input -------------------------------------------


@pytest.fixture
def harness_main(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``harness.cli.main.main`` with the history command registered (as main.py lists it)."""
    entry = ("history", "harness.cli.history_cmd", history_cmd.HELP)
    if entry[1] not in cli_main.SUBCOMMAND_MODULES:
        monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, entry))
        monkeypatch.setattr(cli_main, "SUBCOMMAND_MODULES", (*cli_main.SUBCOMMAND_MODULES, entry[1]))
    return cli_main.main


def test_json_and_markdown_outputs(planted: Path, tmp_path: Path, harness_main: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md = tmp_path / "h.json", tmp_path / "h.md"
    code = harness_main(["history", str(planted), "--no-html", "--json", str(out_json), "--summary-md", str(out_md)])
    stdout = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "history.html").exists()
    assert f"regression: {MACHINE_ID} {MODEL}/bf16/{BACKEND} x1.3" in stdout
    doc = json.loads(out_json.read_text())
    assert doc["history_version"] == 1 and doc["settings"] == {"min_step": 0.05}
    (step,) = doc["steps"]
    assert step["case"] == f"{MODEL}/bf16/{BACKEND}" and step["kind"] == "regression" and step["machine"] == MACHINE_ID
    assert step["last_before"]["commit"] == commit(STEP_RUN - 1) and step["first_after"]["commit"] == commit(STEP_RUN)
    (machine,) = doc["machines"]
    assert len(machine["runs"]) == RUNS + 1 and [s["case"] for s in machine["series"]] == [f"{MODEL}/{m}/{BACKEND}" for m in MODES]
    bf16 = machine["series"][1]
    first_after = machine["runs"][bf16["steps"][0]["first_after"]["run"]]
    assert first_after["commit"] == commit(STEP_RUN) and first_after["file"].endswith(".json")
    assert {m["kind"] for m in bf16["markers"]} == {"fingerprint", "machine", "clock"}
    assert all(p["median_ns"] > 0 and p["q1_ns"] <= p["median_ns"] <= p["q3_ns"] for p in bf16["points"])
    md = out_md.read_text()
    assert md.startswith("## Benchmark history\n") and f"{RUNS + 1} runs on 1 machine" in md
    row = next(line for line in md.splitlines() if f"{MODEL}/bf16/{BACKEND}" in line)
    assert "regression x1.3" in row and f"`{commit(STEP_RUN - 1)[:8]}`" in row and f"`{commit(STEP_RUN)[:8]}`" in row
    assert "fingerprint change" in row


@pytest.mark.parametrize("damage", ["truncated", "edited", "foreign"])
def test_a_corrupt_results_file_is_named_and_nothing_is_written(
    planted: Path, tmp_path: Path, damage: str, harness_main: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / MACHINE_ID
    shutil.copytree(planted / MACHINE_ID, directory)
    victim = sorted(directory.glob("run-*.json"))[4]
    text = victim.read_text()
    if damage == "truncated":
        victim.write_text(text[: len(text) // 2])
    elif damage == "edited":  # a planted median changed by hand: the digest no longer matches
        doc = json.loads(text)
        doc["cases"][0]["latency"]["summary"]["median"] *= 0.5
        victim.write_text(json.dumps(doc))
    else:
        victim.write_text(json.dumps({"benchmarks": []}))
    outputs = [tmp_path / "h.html", tmp_path / "h.json"]
    code = harness_main(["history", str(directory), "-o", str(outputs[0]), "--json", str(outputs[1])])
    err = capsys.readouterr().err
    assert code == 2 and f"results file {victim}" in err, err
    assert {"truncated": "JSON", "edited": "digest", "foreign": "schema_version"}[damage] in err
    assert not any(p.exists() for p in outputs)


def test_paths_without_runs_and_unwritable_outputs_are_refused(
    planted: Path, tmp_path: Path, harness_main: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    (empty / "caches").mkdir(parents=True)
    assert harness_main(["history", str(empty), "--no-html", "--json", str(tmp_path / "h.json")]) == 2
    assert f"{empty}: no results files (run-*.json or baseline.json)" in capsys.readouterr().err
    assert harness_main(["history", str(tmp_path / "nowhere"), "--no-html", "--json", str(tmp_path / "h.json")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert harness_main(["history", str(planted), "-o", str(tmp_path)]) == 2  # a directory as the page
    assert f"-o {tmp_path}: is a directory" in capsys.readouterr().err
    assert harness_main(["history", str(planted), "--no-html"]) == 2
    assert "nothing to write" in capsys.readouterr().err
    assert not (tmp_path / "h.json").exists()


def test_without_plotly_the_page_names_the_extra_and_json_still_works(
    planted: Path, tmp_path: Path, harness_main: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly raises ImportError
    assert harness_main(["history", str(planted), "-o", str(tmp_path / "h.html")]) == 2
    err = capsys.readouterr().err
    assert "needs plotly" in err and install_command("history") in err
    assert not (tmp_path / "h.html").exists()
    assert harness_main(["history", str(planted), "--no-html", "--json", str(tmp_path / "h.json")]) == 0
    assert json.loads((tmp_path / "h.json").read_text())["steps"][0]["kind"] == "regression"


def test_the_page_is_self_contained_and_escapes_what_results_files_say(history: Any) -> None:
    page = render_html(history, title="<script>alert(1)</script>")
    assert "<title>&lt;script&gt;alert(1)&lt;/script&gt;</title>" in page
    assert "http://" not in page.split("<script>")[0] and "<script src" not in page  # nothing fetched
    assert page.count("<script>") == 2 and "plotly.js v" in page
    assert page.count("class='case'") == len(MODES)


# --- in a real browser -------------------------------------------------------------------------


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


_CASES_JS = """
Array.from(document.querySelectorAll('.case')).map((div) => {
  const gd = div.querySelector('.plot');
  const traces = gd._fullData.map((t) => ({
    name: t.name,
    points: gd.querySelectorAll('.trace' + t.uid + ' .point').length,
    drawn: gd.querySelectorAll('.trace' + t.uid).length,
  }));
  return {
    case: div.dataset.case,
    markers: div.dataset.markers.split(' '),
    traces: traces,
    svgTraces: gd.querySelectorAll('.scatterlayer .trace').length,
    shapes: gd._fullLayout.shapes.map((s) => s.type),
    drawnShapes: gd.querySelectorAll('.shapelayer path').length,
    annotations: Array.from(gd.querySelectorAll('.annotation-text')).map((a) => a.textContent),
    ticks: Array.from(gd.querySelectorAll('.xtick text, .x2tick text')).map((t) => t.textContent),
  };
})
"""
_RENDERED_JS = (
    "new Promise((done) => { const check = () => document.body.dataset.rendered ? "
    "done(document.body.dataset.rendered) : setTimeout(check, 50); check(); })"
)


NO_CHROMIUM = f"{CHROMIUM} is not installed (Debian: apt-get install chromium): the page is not opened in a browser"


@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_the_browser_checks_see_console_errors_and_network_requests(tmp_path: Path) -> None:
    """The checks below are not vacuous: an exception, console.error and a fetch from the network are seen."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><body><img src='http://history-test.invalid/x.png'>"
        "<script>console.error('planted'); null.boom();</script></body></html>"
    )
    with open_page(bad.as_uri()) as page:
        page.evaluate("new Promise((done) => setTimeout(done, 0))")
        errors = page.console_errors()
        requests = page.requests()
    assert any("planted" in e for e in errors) and any("boom" in e for e in errors), errors
    assert "http://history-test.invalid/x.png" in requests  # sent to the closed proxy port, never out


@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_the_dashboard_in_headless_chromium(planted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No console error, no request beyond the file, every case drawn with its markers; a screenshot."""
    monkeypatch.chdir(planted.parent)  # the page names its sources as a user gives them: results/<machine>
    history = collect([f"results/{MACHINE_ID}"])
    page_file = tmp_path / "history.html"
    page_file.write_text(render_html(history))
    (machine,) = history.machines
    with open_page(page_file.as_uri()) as page:
        assert page.evaluate(_RENDERED_JS) == "true"
        cases = page.evaluate(_CASES_JS)
        height = page.evaluate("document.documentElement.scrollHeight")
        shot = tmp_path / "history-dashboard.png"
        page.screenshot(shot, 1400, min(int(height), 4000))
        assert page.console_errors() == []
        assert page.requests() == [page_file.as_uri()]
    assert [c["case"] for c in cases] == [f"{MODEL}/{m}/{BACKEND}" for m in MODES]
    for c in cases:
        mode = c["case"].split("/")[1]
        expected = {"verdict", "baseline", "fingerprint", "machine", "clock"} | ({"step"} if mode == "bf16" else set())
        assert set(c["markers"]) == expected, c["case"]
        names = {t["name"] for t in c["traces"]}
        wanted = {"baseline", "fingerprint change", "machine change", "clock change", "verdict: baseline", "verdict: ok"}
        wanted |= {"regression step", "verdict: regression"} if mode == "bf16" else set()
        assert wanted <= names, (c["case"], names)
        assert c["svgTraces"] == len(c["traces"]) and all(t["drawn"] == 1 for t in c["traces"])
        for t in c["traces"]:  # every marker trace has its points drawn
            if t["name"] not in ("median latency (IQR)", "fitted level"):
                assert t["points"] >= 1, (c["case"], t)
        lines = 4  # baseline, fingerprint, machine and clock changes
        assert c["shapes"].count("line") == lines and c["shapes"].count("rect") == (mode == "bf16")
        assert c["drawnShapes"] == len(c["shapes"])
        assert "baseline" in c["annotations"]
        assert all(commit(i)[:8] in " ".join(c["ticks"]) for i in range(RUNS))  # 13 runs: every one labelled
    bf16 = next(c for c in cases if "/bf16/" in c["case"])
    label = next(a for a in bf16["annotations"] if a.startswith("regression"))
    assert f"{commit(STEP_RUN - 1)[:8]}..{commit(STEP_RUN)[:8]}" in label
    data = shot.read_bytes()
    assert _png_size(data) == (1400, min(int(height), 4000)) and len(data) > 50_000
    keep = os.environ.get("HARNESS_HISTORY_SCREENSHOT")
    if keep:  # how docs/images/history-dashboard.png is made
        shutil.copy(shot, keep)
    assert len(machine.runs) >= 10
