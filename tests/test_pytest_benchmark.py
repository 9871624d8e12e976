"""pytest-benchmark interoperates: its ``compare`` reads harness runs, and the harness reads its saved runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_benchmark.stats import Stats
from pytest_benchmark.utils import parse_compare_fail

from harness.bench.pytest_benchmark import WRITTEN_NOTE, stats_of, to_pytest_benchmark
from harness.bench.results import load_results, write_results
from harness.bench.runs import load_run
from tests.test_bench_cli import fixed_machine, real_run, run, synthetic_timings

__all__ = ["fixed_machine", "real_run"]  # fixtures shared with test_bench_cli

PYTEST_BENCHMARK = Path(sys.executable).with_name("pytest-benchmark")


def stored(tmp_path: Path, real_run: dict, name: str, scale: float, seed: int) -> Path:
    path = tmp_path / name
    write_results(path, synthetic_timings(real_run, scale, seed))
    return path


def exported(capsys, run_path: Path) -> Path:
    out_path = run_path.with_suffix(".pytest-benchmark.json")
    code, _, err = run(capsys, "report", run_path, "--format", "pytest-benchmark", "-o", out_path)
    assert code == 0, err
    return out_path


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 41, 300])
def test_stats_are_pytest_benchmarks_own(n):
    data = [1e-4 * (1 + ((i * 7919) % 13) / 10) for i in range(n)]
    theirs = Stats()
    for v in data:
        theirs.update(v)
    ours = stats_of(data)
    for field, value in theirs.as_dict().items():
        assert ours[field] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-12)), field
    assert ours["data"] == data


def test_pytest_benchmark_compare_reads_a_harness_run(capsys, tmp_path, real_run):
    a = exported(capsys, stored(tmp_path, real_run, "a.json", 1.0, seed=1))
    b = exported(capsys, stored(tmp_path, real_run, "b.json", 1.3, seed=2))
    proc = subprocess.run(
        [str(PYTEST_BENCHMARK), "compare", str(a), str(b), "--columns", "median,rounds", "--group-by", "name"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stdout + proc.stderr
    for case in real_run["cases"]:
        assert f"digits[{case['mode']}-cpu]" in proc.stdout
    # every benchmark row of both files, each median as the run's own (in us: 100 and 130 us)
    doc = json.loads(a.read_text())
    assert {b["name"] for b in doc["benchmarks"]} == {f"digits[{c['mode']}-cpu]" for c in real_run["cases"]}
    medians = {b["name"]: b["stats"]["median"] for b in doc["benchmarks"]}
    for case in synthetic_timings(real_run, 1.0, seed=1)["cases"]:
        assert medians[f"digits[{case['mode']}-cpu]"] == pytest.approx(case["latency"]["summary"]["median"] / 1e9)


def test_its_compare_fail_checks_judge_harness_runs(capsys, tmp_path, real_run):
    base = json.loads(exported(capsys, stored(tmp_path, real_run, "a.json", 1.0, seed=1)).read_text())
    slow = json.loads(exported(capsys, stored(tmp_path, real_run, "b.json", 1.3, seed=2)).read_text())
    again = json.loads(exported(capsys, stored(tmp_path, real_run, "c.json", 1.0, seed=3)).read_text())
    check = parse_compare_fail("median:5%")
    for b, s, r in zip(base["benchmarks"], slow["benchmarks"], again["benchmarks"], strict=True):
        assert check.fails(s["stats"], b["stats"]), b["name"]  # 30% slower
        assert not check.fails(r["stats"], b["stats"]), b["name"]  # the same timings, reseeded


def test_a_harness_run_reads_back_from_its_pytest_benchmark_json_and_gates_as_itself(capsys, tmp_path, real_run):
    original = stored(tmp_path, real_run, "a.json", 1.0, seed=1)
    back = load_run(exported(capsys, original))
    doc = load_results(original)
    assert back["cases"] == doc["cases"]
    assert back["machine"] == doc["machine"] and back["settings"] == doc["settings"] and back["git"] == doc["git"]
    assert back["imported_from"]["note"] == WRITTEN_NOTE
    code, out, _ = run(capsys, "gate", "--baseline", original, "--current", original.with_suffix(".pytest-benchmark.json"))
    assert code == 0, out
    assert f"gate PASS: 0 of {len(doc['cases'])} cases fail" in out


def test_failed_cases_are_named_not_written(capsys, tmp_path, real_run):
    doc = synthetic_timings(real_run, 1.0, seed=1)
    doc["cases"][0] = {"model": "digits", "mode": "fp16", "backend": "cpu", "batch": None, "status": "failed",
                       "error": "boom", "latency": None, "accuracy": None}  # fmt: skip
    path = tmp_path / "run.json"
    write_results(path, doc)
    code, out, err = run(capsys, "report", path, "--format", "pytest-benchmark")
    assert code == 0
    assert "not written" in err and "digits/fp16/cpu" in err and "failed" in err
    assert [b["name"] for b in json.loads(out)["benchmarks"]] == ["digits[bf16-cpu]"]
    converted, left_out = to_pytest_benchmark(load_results(path))
    assert len(converted["benchmarks"]) == 1 and len(left_out) == 1


BENCH_TESTS = """
import pytest

@pytest.mark.parametrize("n", [100, 2000])
def test_sum(benchmark, n):
    benchmark(sum, range(n))
"""


@pytest.fixture(scope="module")
def pytest_benchmark_run(tmp_path_factory) -> Path:
    """A run pytest-benchmark itself wrote, raw timings saved (``--benchmark-save-data``)."""
    tmp = tmp_path_factory.mktemp("pb")
    (tmp / "test_sums.py").write_text(BENCH_TESTS)
    out = tmp / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp / "test_sums.py"),
         f"--benchmark-json={out}", "--benchmark-save-data", "--benchmark-min-rounds=30",
         "--benchmark-max-time=0.02", "--benchmark-disable-gc"],
        capture_output=True, text=True, cwd=tmp, check=False,
        # not an xdist worker's: pytest-benchmark turns itself off in one (and writes no file)
        env={k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))},
    )  # fmt: skip
    assert proc.returncode == 0 and out.is_file(), proc.stdout + proc.stderr
    return out


def test_report_reads_pytest_benchmarks_own_file_and_says_what_was_not_compared(capsys, pytest_benchmark_run):
    code, out, err = run(capsys, "report", pytest_benchmark_run, "--no-plots")
    assert code == 0, err
    assert "test_sums.py::test_sum" in out and "100" in out and "2000" in out
    assert "accuracy" in out and "not compared" in out
    doc = load_run(pytest_benchmark_run)
    raw = json.loads(pytest_benchmark_run.read_text())
    for case, bench in zip(doc["cases"], raw["benchmarks"], strict=True):
        assert case["backend"] == "pytest-benchmark" and case["mode"] == bench["param"]
        assert case["latency"]["iterations"] == bench["stats"]["rounds"]
        # samples are whole nanoseconds, as every run stores them
        assert case["latency"]["summary"]["median"] == pytest.approx(bench["stats"]["median"] * 1e9, abs=0.5)


def test_the_gate_judges_pytest_benchmark_runs(capsys, tmp_path, pytest_benchmark_run):
    raw = json.loads(pytest_benchmark_run.read_text())
    slower = json.loads(json.dumps(raw))
    for bench in slower["benchmarks"]:
        if bench["param"] == "2000":
            bench["stats"]["data"] = [v * 1.5 for v in bench["stats"]["data"]]
    current = tmp_path / "slower.json"
    current.write_text(json.dumps(slower))
    code, out, _ = run(capsys, "gate", "--baseline", pytest_benchmark_run, "--current", current)
    assert code == 1, out
    failing = [line for line in out.splitlines() if "slower: median x1.500" in line]
    assert len(failing) == 1 and failing[0].startswith("test_sums.py::test_sum/2000/pytest-benchmark ")
    assert "pytest-benchmark records no outputs" in out
    code, out, _ = run(capsys, "gate", "--baseline", pytest_benchmark_run, "--current", pytest_benchmark_run.with_name("copy.json"))
    assert code == 2  # no such file: a usage error, not a verdict


def test_a_pytest_benchmark_file_without_raw_timings_is_refused_by_name(capsys, tmp_path, pytest_benchmark_run):
    raw = json.loads(pytest_benchmark_run.read_text())
    for bench in raw["benchmarks"]:
        del bench["stats"]["data"]
    path = tmp_path / "summaries.json"
    path.write_text(json.dumps(raw))
    code, _, err = run(capsys, "report", path, "--no-plots")
    assert code == 2
    assert str(path) in err and "test_sum[100]" in err and "--benchmark-save-data" in err


def test_a_pytest_benchmark_file_naming_one_case_twice_is_refused(capsys, tmp_path, pytest_benchmark_run):
    raw = json.loads(pytest_benchmark_run.read_text())
    raw["benchmarks"][1]["fullname"] = raw["benchmarks"][0]["fullname"]
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(raw))
    code, _, err = run(capsys, "report", path, "--no-plots")
    assert code == 2
    assert str(path) in err and "named once" in err


def test_output_is_only_for_the_pytest_benchmark_format(capsys, tmp_path, pytest_benchmark_run):
    code, _, err = run(capsys, "report", pytest_benchmark_run, "-o", tmp_path / "x.json")
    assert code == 2 and "--format pytest-benchmark" in err
