"""The engine benchmark's repeated runs: each a process of its own, then each peer ratio's range.

One process can sit wholly inside a slow phase of a shared machine (this VM moved
ONNX Runtime's own mobilenet between 1.58 and 2.49 ms within half an hour), so the
ratios the README quotes come from several processes, with their spread.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from harness.benchmarks import engine_bench
from harness.benchmarks.peer_bench import (
    ORT_BACKEND,
    PLAIN_ORT,
    RATIOS_SCHEMA,
    Candidate,
    Group,
    ranges_report,
    ratios,
)
from harness.fileio import validate

pytestmark = pytest.mark.slow  # the benchmark runs in processes of its own


def _group(model: str, precision: str, times: dict[str, float]) -> Group:
    group = Group(model, precision)
    group.candidates = [Candidate(label, lambda: None, 0.0, ms) for label, ms in times.items()]
    return group


def test_ratios_compare_the_best_and_slowest_modes_with_the_fastest_peer_and_the_backend_with_plain_ort():
    fp32 = _group("m", "fp32", {"cpu fp32": 1.2, ORT_BACKEND: 1.05, PLAIN_ORT: 1.0, "peer:openvino": 1.1})
    bf16 = _group("m", "bf16", {"cpu bf16": 0.9, "cpu weak-bf16": 0.8, "peer:openvino": float("nan")})
    alone = _group("m", "fp16", {"cpu fp16": 1.0})
    got = ratios([fp32, bf16, alone])
    validate(got, RATIOS_SCHEMA, "ratios")
    first = got["modes"][0]
    assert (first["best_mode"], first["peer"], first["best_ratio"]) == ("fp32", PLAIN_ORT, pytest.approx(1.2))
    # A peer time that is not finite gives no number: never a ratio that looks fine.
    assert got["modes"][1]["best_ratio"] is None and got["modes"][1]["best_mode"] == "weak-bf16"
    assert got["modes"][2] == {"model": "m", "precision": "fp16", "not_compared": "no peer ran"}
    assert got["onnxruntime_backend"] == [
        {"model": "m", "backend_ms": 1.05, "plain_ms": 1.0, "ratio": pytest.approx(1.05)}
    ]


def test_the_ranges_give_min_max_and_median_of_each_ratio_and_say_what_was_not_compared():
    runs = [
        ratios([_group("m", "fp32", {"cpu fp32": ms, "cpu x": 2 * ms, ORT_BACKEND: b, PLAIN_ORT: 1.0})])
        for ms, b in ((1.0, 1.0), (1.3, 1.1), (1.1, 0.9))
    ]
    runs.append(ratios([_group("m", "fp32", {"cpu fp32": 1.0})]))  # no peer ran in this one
    text = ranges_report(runs)
    assert "each ratio over 4 runs, each a process of its own" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("m ") and "fp32" in line)
    assert "1.00-1.30x (1.10x)" in row and "2.00-2.60x (2.20x)" in row
    assert "fp32 vs peer:onnxruntime" in row and "compared in 3 of 4 runs" in row
    assert "0.90-1.10x (1.00x) (compared in 3 of 4 runs)" in text
    nan = [ratios([_group("m", "fp32", {"cpu fp32": float("nan"), PLAIN_ORT: 1.0})])]
    assert "1 not finite" in ranges_report(nan)


def test_repeated_runs_each_run_in_a_process_of_their_own_and_keep_every_runs_ratios(tmp_path, capsys):
    out = tmp_path / "ratios.json"
    args = ["--models", "digits", "--peers", "onnxruntime", "--precisions", "fp32", "--seconds", "0.05"]
    assert engine_bench.main([*args, "--repeat", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== run 1 of 2, a process of its own ==" in text and "== run 2 of 2" in text
    assert "each ratio over 2 runs" in text
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        validate(run, RATIOS_SCHEMA, "a run")
        (row,) = run["modes"]
        assert (row["model"], row["best_mode"], row["peer"]) == ("digits", "fp32", PLAIN_ORT)
        assert row["best_ratio"] > 0 and run["onnxruntime_backend"][0]["ratio"] > 0
    # two measurements, not one copied: every figure of a run (of ms to the ns) equal by chance is not plausible
    assert len({json.dumps(run, sort_keys=True) for run in runs}) == 2


def test_a_failed_run_is_reported_left_out_and_fails_the_series(monkeypatch, tmp_path, capsys):
    real = subprocess.run
    calls: list[list[str]] = []

    def run(command, check):
        calls.append(command)
        if len(calls) == 1:  # the first process dies (as one killed by the machine would)
            return subprocess.CompletedProcess(command, -9)
        return real(command, check=check)

    monkeypatch.setattr(engine_bench.subprocess, "run", run)
    out = tmp_path / "ratios.json"
    args = ["--models", "digits", "--peers", "onnxruntime", "--precisions", "fp32", "--seconds", "0.05"]
    assert engine_bench.main([*args, "--repeat", "2", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "note: run 1 exited with -9; left out of the ranges" in text
    assert "each ratio over 1 runs" in text
    assert len(json.loads(out.read_text())["runs"]) == 1


@pytest.mark.parametrize("repeat", ["0", "101"])
def test_a_repeat_count_out_of_range_is_refused(repeat, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main(["--models", "digits", "--repeat", repeat])
    assert exit_info.value.code == 2
    assert f"--repeat {repeat}: valid: 1 to 100" in capsys.readouterr().err


def test_side_by_side_candidates_take_turns_in_many_short_rounds():
    """A slow phase of a few seconds must hit every candidate a little, not one candidate most of
    its time: each candidate runs in ``ROUNDS`` separate turns, in the same order each round."""
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    medians = engine_bench.medians_alternating(fns, seconds=0.03)
    turns = [who for i, who in enumerate(calls) if i == 0 or calls[i - 1] != who]
    assert turns == [0, 1, 2] * engine_bench.ROUNDS
    assert engine_bench.ROUNDS >= 5 and all(ms >= 0 for ms in medians)


def test_a_run_says_on_stderr_which_model_and_precision_it_is_on(capsys):
    args = ["--models", "digits", "--peers", "onnxruntime", "--precisions", "fp32,bf16", "--seconds", "0.05"]
    assert engine_bench.main(args) == 0
    captured = capsys.readouterr()
    steps = [line.split("] ", 1)[1] for line in captured.err.splitlines() if line.startswith("[")]
    assert steps == [
        "digits (1 of 1): engines, builds and eager",
        "digits: fp32 side by side (builds, peers' setup, timing)",
        "digits: bf16 side by side (builds, peers' setup, timing)",
        "done",
    ]
    assert "digits (1 of 1)" not in captured.out  # the report stays clean for a pipe
