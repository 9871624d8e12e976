"""The build-time benchmark: real cold and warm builds of a zoo model, and its report's verdicts."""

from __future__ import annotations

import json

import pytest
import torch

from harness.benchmarks import build_bench
from harness.benchmarks.build_bench import BuildTimes, report, time_builds

pytestmark = pytest.mark.slow  # cold and warm builds of real models


def test_cold_builds_time_every_layer_and_warm_ones_take_each_from_the_cache_into_the_same_engine():
    steps: list[str] = []
    threads = torch.get_num_threads()
    rows = time_builds("lenet", ["fp32", "weak-bf16"], 1, 2, steps.append)
    assert torch.get_num_threads() == threads
    assert steps == [f"lenet {m} (round {r} of 2)" for r in (1, 2) for m in ("fp32", "weak-bf16")]
    assert [(r.model, r.mode) for r in rows] == [("lenet", "fp32"), ("lenet", "weak-bf16")]
    for row in rows:
        assert row.layers_timed > 0 and row.warm_timed == 0 and row.same_engine
        assert row.cold_s > 0 and row.warm_s > 0 and row.compile_s > 0


def _row(mode: str, cold: float, warm: float, model: str = "m") -> BuildTimes:
    return BuildTimes(model, mode, 0.5, cold, warm, 10, 0, True)


def test_the_report_judges_both_targets_by_their_worst_case():
    rows = [_row("fp32", 2.0, 0.1), _row("bf16", 9.0, 0.3), _row("fp16", 11.0, 2.0), _row("fp32", 1.0, 0.01, "n")]
    text = report(rows, 1, "a CPU")
    assert "CPU engine build times, a CPU, 1 thread(s) pinned; seconds" in text
    assert "  m            fp16               0.50    11.00    2.000      5.50x       5.5x     10  same" in text
    assert (
        "target: every cold build within 5x of its model's fp32 cold build: MISSED (worst m fp16: 5.50x)" in text
    )
    assert "target: every warm build at least 10x faster than its cold build: MISSED (worst m fp16: 5.5x)" in text
    kept = report(rows[:2] + rows[3:], 1, "a CPU")
    assert "fp32 cold build: holds (worst m bf16: 4.50x)" in kept
    assert "faster than its cold build: holds (worst m fp32: 20.0x)" in kept


def test_a_warm_build_that_timed_or_built_another_engine_is_shown_as_such():
    timed = BuildTimes("m", "fp32", 0.1, 1.0, 0.5, 4, 2, False)
    other = BuildTimes("m", "bf16", 0.1, 1.0, 0.05, 4, 0, False)
    text = report([timed, other], 1, "a CPU")
    assert text.splitlines()[2].endswith("TIMED 2 layer(s)") and text.splitlines()[3].endswith("DIFFERS")


def test_without_fp32_the_cold_target_is_not_judged():
    assert "cold builds against fp32: not judged (fp32 was not among the modes)" in report([_row("bf16", 1, 0.01)], 1, "c")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--models", "nope"], "--models: nope; valid: "),
        (["--modes", "fp32,explicit"], "--modes: explicit; valid: fp32,"),
        (["--repeat", "0"], "--repeat 0: valid: 1 to 20"),
        (["--threads", "0"], "threads 0: expected an integer from 1 to 1024"),
    ],
)
def test_bad_flags_are_one_usage_error_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_bench.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_the_json_holds_every_row(tmp_path, capsys):
    out = tmp_path / "builds.json"
    assert build_bench.main(["--models", "lenet", "--modes", "fp32", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "lenet        fp32" in printed.out and "[" in printed.err and "done" in printed.err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "lenet" and row["mode"] == "fp32" and row["warm_timed"] == 0
