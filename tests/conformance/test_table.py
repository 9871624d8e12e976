"""The README's conformance table is rendered from the suite's own report."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.benchmarks.conformance_bench import conformance_table, main, suite_models

REPO = Path(__file__).parents[2]


def test_the_table_has_a_row_per_model_and_a_column_per_stage_in_run_order():
    results = [
        {"model": "hf-bert", "stage": "fp32 graph exact", "outcome": "passed"},
        {"model": "hf-bert", "stage": "rule finite", "outcome": "passed"},
        {"model": "hf-bert", "stage": "rule finite", "outcome": "failed"},  # bf16 fine, fp16 not
        {"model": "engine_ops", "stage": "fp32 graph exact", "outcome": "passed"},
        {"model": "engine_ops", "stage": "claimed pattern present", "outcome": "passed"},
    ]
    assert conformance_table(results).splitlines() == [
        "| model | fp32 graph exact | rule finite | claimed pattern present |",
        "|---|:-:|:-:|:-:|",
        "| hf-bert | ✓ | ✗ | - |",
        "| engine_ops | ✓ | - | ✓ |",
        "",
        "4 of 5 tests passed (2 models, 3 stages)",
    ]


def test_the_bench_covers_the_suite_models_including_the_recreations(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    names = suite_models()
    assert "hf-bart" in names and "hf-trocr" in names
    assert "tests/conformance/recreations.py:shifted_window_mask" in names


def test_a_table_from_a_report_that_is_not_there_is_one_clear_error(tmp_path, capsys):
    assert main(["--conformance-table", "--report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read conformance report" in capsys.readouterr().err
