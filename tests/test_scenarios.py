"""Serving scenarios: their schedules, the rate search, their cases in results, tables, plots, the gate.

Timing is never assumed: the schedule tests check the generated arrival times themselves (a KS
test at a fixed seed), the search tests use a probe whose p99 is a known function of the rate,
and the end-to-end tests check what a run recorded against itself (the found rate's own
measured p99 against the bound, the next probe above it), never against wall-clock expectations.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from harness.bench.gate import gate
from harness.bench.results import ResultsWriter, case_key, format_key, load_results
from harness.bench.runner import QUICK, BenchRunner, build_matrix
from harness.bench.scenario_run import check_cores
from harness.bench.scenarios import (
    Probe,
    Scenario,
    find_rate,
    fixed_arrivals,
    label_of,
    parse_duration,
    poisson_arrivals,
    run_load,
)
from harness.bench.tables import results_table
from harness.cli.main import main
from harness.engines.registry import get_backend
from harness.errors import HarnessError
from tests.test_tensorrt_backend import gpu  # noqa: F401 - the fixture: skips without a GPU

MACHINE = {"id": "test-machine", "cpu": {"isa_flags": ["avx2"]}, "gpu": {"devices": []}}
GIT = {"commit": "abc", "dirty": False}


# --- schedules -----------------------------------------------------------------------------


def test_server_arrivals_are_a_poisson_process_at_the_asked_rate():
    rate = 250.0
    arrivals = poisson_arrivals(rate, 4000, seed=7)
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert np.all(gaps > 0)
    # Exponential inter-arrival times with mean 1/rate: a KS test against that very distribution ...
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # ... that tells it from a process at another rate, and the mean within 5% of 1/rate.
    assert stats.kstest(gaps, "expon", args=(0, 1 / (1.3 * rate))).pvalue < 1e-6
    assert abs(gaps.mean() * rate - 1) < 0.05
    assert np.array_equal(arrivals, poisson_arrivals(rate, 4000, seed=7))  # seeded: the same schedule
    assert not np.array_equal(arrivals, poisson_arrivals(rate, 4000, seed=8))


def test_multi_stream_queries_come_at_the_fixed_interval():
    assert np.allclose(fixed_arrivals(0.05, 4), [0.0, 0.05, 0.10, 0.15])


def test_durations_parse_with_their_units():
    assert parse_duration("10ms", "--latency-bound") == pytest.approx(0.01)
    assert parse_duration("250us", "--latency-bound") == pytest.approx(250e-6)
    assert parse_duration("2", "--latency-bound") == pytest.approx(0.002)  # a bare number is ms
    with pytest.raises(HarnessError, match="--latency-bound 'soon'"):
        parse_duration("soon", "--latency-bound")


# --- the load generator --------------------------------------------------------------------


def test_every_call_runs_once_and_a_query_ends_with_its_last_call():
    ran: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(k: int):
        def call() -> None:
            with lock:
                ran.append((k, len(ran)))

        return call

    run = run_load([worker(0), worker(1)], np.zeros(10), calls_per_query=3, samples_per_query=6)
    assert len(ran) == 30 and run.queries == 10 and len(run.service_ns) == 30
    assert run.samples_per_query == 6 and run.concurrency == 2
    assert run.throughput == pytest.approx(run.achieved_rate * 6)
    assert all(latency >= 1 for latency in run.latencies_ns)


def test_a_failing_worker_stops_the_run_with_its_error():
    def broken() -> None:
        raise HarnessError("engine failed")

    with pytest.raises(HarnessError, match="engine failed"):
        run_load([broken, broken], np.zeros(5))


# --- the rate search -----------------------------------------------------------------------


def _queue_probe(capacity: float, bound_ns: float):
    """p99 of an M/M/1 queue at ``rate`` (a known, rising function): met below a rate depending on the bound."""

    def probe(rate: float) -> Probe:
        p99 = math.inf if rate >= capacity else math.log(100) / (capacity - rate) * 1e9
        return Probe(rate, min(rate, capacity), p99 / 4, p99, p99 <= bound_ns)

    return probe


def test_the_search_brackets_the_highest_rate_that_meets_the_bound():
    capacity, bound = 1000.0, 0.02e9
    exact = capacity - math.log(100) / 0.02  # where the M/M/1 p99 equals the bound
    for start in (10.0, 500.0, 900.0):
        search = find_rate(_queue_probe(capacity, bound), start, 4000.0, steps=30)
        assert search.found is not None and search.found.met and search.found.p99_ns <= bound
        assert search.above is not None and not search.above.met and search.above.rate > search.found.rate
        assert search.above.rate / search.found.rate <= 1.05
        assert search.found.rate <= exact < search.above.rate
        higher = [p for p in search.probes if p.rate > search.found.rate]
        assert min(higher, key=lambda p: p.rate) == search.above  # the next probe above it failed


def test_the_search_stops_at_its_ceiling_or_says_nothing_met():
    always = find_rate(lambda r: Probe(r, r, 1.0, 1.0, True), 10.0, 100.0)
    assert always.found is not None and always.found.rate == 100.0 and always.above is None
    never = find_rate(lambda r: Probe(r, r, 1.0, 1.0, False), 10.0, 100.0)
    assert never.found is None and never.above is not None and never.above.rate == pytest.approx(10.0 / 1024)


# --- scenario parameters and their errors ----------------------------------------------------


def test_scenario_parameters_are_checked_where_they_enter():
    assert Scenario().label() == "single-stream"
    assert Scenario("server", concurrency=2, latency_bound_s=0.01, find_rate=True).label() == "server[find-rate,bound=10ms,c=2]"
    assert Scenario("multi-stream", samples_per_query=4, interval_s=0.02).label() == "multi-stream[n=4,interval=20ms]"
    with pytest.raises(HarnessError, match="--find-rate needs --latency-bound"):
        Scenario("server", find_rate=True)
    with pytest.raises(HarnessError, match="needs --target-rate QPS or --find-rate"):
        Scenario("server")
    with pytest.raises(HarnessError, match="single-stream runs one query at a time"):
        Scenario(concurrency=2)
    with pytest.raises(HarnessError, match="--concurrency 2 with --threads 2: 4 intra-op threads on 2 cores"):
        check_cores(Scenario("offline", concurrency=2), threads=2, cpus=2)
    check_cores(Scenario("offline", concurrency=2), threads=1, cpus=2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scenario", "server", "--find-rate"], "--find-rate needs --latency-bound"),
        (["--scenario", "offline", "--target-rate", "100"], "--target-rate concerns the server scenario"),
        (["--scenario", "warp"], "argument --scenario: "),
        (["--scenario", "server", "--latency-bound", "soon", "--find-rate"], "argument --latency-bound: "),
        (["--scenario", "offline", "--concurrency", "0"], "argument --concurrency"),
    ],
)
def test_bad_scenario_flags_exit_2_naming_the_flag(flags, message, tmp_path, capsys):
    argv = ["bench", "--model", "lenet", "--quick", "--no-progress", "-o", str(tmp_path / "r.json"), *flags]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusal of a value, while parsing
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# --- scenario cases end to end ----------------------------------------------------------------


def _run(backend: str, scenarios: list[Scenario], path: Path, modes=("fp32",)) -> dict:
    runner = BenchRunner(get_backend(backend), cache_dir=None, settings=QUICK, scenarios=scenarios)
    writer = ResultsWriter.create(path, settings={"quick": True}, machine=MACHINE, git=GIT)
    return runner.run(build_matrix(["lenet"], list(modes)), writer, progress=False)


@pytest.mark.slow  # real benches of every scenario
@pytest.mark.parametrize("backend", ["cpu", "onnxruntime"])
def test_the_four_scenarios_run_and_record_what_they_measured(backend, tmp_path):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    scenarios = [
        Scenario(),
        Scenario("offline", concurrency=2),
        Scenario("multi-stream", concurrency=2, samples_per_query=4, interval_s=0.005, latency_bound_s=1.0),
        Scenario("server", concurrency=2, target_rate=200.0, latency_bound_s=1.0),
    ]
    doc = _run(backend, scenarios, tmp_path / "run.json")
    cases = {label_of(c): c for c in doc["cases"]}
    assert set(cases) == {s.label() for s in scenarios}
    assert all(c["status"] == "ok" for c in doc["cases"]), [c.get("error") for c in doc["cases"]]
    assert "scenario" not in cases["single-stream"]  # written as before scenarios existed
    for label, case in cases.items():
        if label == "single-stream":
            continue
        record, lat = case["scenario"], case["latency"]
        assert record["concurrency"] == 2 and record["queries"] >= QUICK.min_iters
        assert record["p99_ns"] == pytest.approx(np.percentile(lat["samples_ns"], 99))
        assert record["throughput_per_s"] == pytest.approx(lat["offline_throughput_per_s"])
    assert cases[scenarios[2].label()]["scenario"]["samples_per_query"] == 8  # 4 samples: one batch-8 call
    server = cases[scenarios[3].label()]["scenario"]
    assert server["met_bound"] == (server["p99_ns"] <= 1e9)
    loaded = load_results(tmp_path / "run.json")  # the file validates (schema, digest, summaries)
    keys = [case_key(c) for c in loaded["cases"]]
    assert len(set(keys)) == 4 and {k[:4] for k in keys} == {("lenet", "fp32", backend, None)}
    table = results_table(loaded)
    assert "scenarios (latency from each query's arrival" in table and "server[rate=200/s,bound=1000ms,c=2]" in table


def test_the_found_rate_meets_the_bound_by_its_own_measurement(tmp_path):
    bound = 0.5  # generous for a tiny model: the search's internal consistency is what is checked
    scenario = Scenario("server", concurrency=1, latency_bound_s=bound, find_rate=True)
    doc = _run("cpu", [scenario], tmp_path / "run.json")
    (case,) = doc["cases"]
    assert case["status"] == "ok", case.get("error")
    search = case["scenario"]["search"]
    found, above = search["found"], search["above"]
    assert found is not None and found["met"] and found["p99_ns"] <= bound * 1e9
    if above is None:
        assert found["rate"] == pytest.approx(search["ceiling"])
    else:
        assert not above["met"] and above["p99_ns"] > bound * 1e9 and above["rate"] > found["rate"]
        assert min((p for p in search["probes"] if p["rate"] > found["rate"]), key=lambda p: p["rate"]) == above
    # the case's samples are the found rate's run: its recorded p99 is theirs
    assert case["scenario"]["p99_ns"] == pytest.approx(found["p99_ns"])
    assert case["scenario"]["p99_ns"] == pytest.approx(np.percentile(case["latency"]["samples_ns"], 99))


def test_the_gate_compares_scenario_cases_only_with_their_own_kind(tmp_path):
    base = _run("cpu", [Scenario()], tmp_path / "base.json")
    server = Scenario("server", target_rate=200.0)
    current = _run("cpu", [Scenario(), server], tmp_path / "cur.json")
    report = gate(base, current)
    verdicts = {format_key(v.key): v.verdict for v in report.cases}
    assert verdicts[f"lenet/fp32/cpu/{server.label()}"] == "new"  # never judged against single-stream
    assert "lenet/fp32/cpu" in verdicts and verdicts["lenet/fp32/cpu"] != "new"


def test_a_case_written_before_scenarios_is_single_stream():
    old = {"model": "m", "mode": "fp32", "backend": "cpu", "batch": None, "status": "ok"}
    assert case_key(old) == ("m", "fp32", "cpu", None, "single-stream")
    assert format_key(case_key(old)) == "m/fp32/cpu"
    assert label_of(old) == "single-stream"


def test_scenario_runs_plot_latency_against_throughput(tmp_path):
    pytest.importorskip("matplotlib")
    from harness.bench.plots import plot_path, plot_results

    doc = _run("cpu", [Scenario("server", latency_bound_s=0.5, find_rate=True)], tmp_path / "run.json")
    written = plot_results(doc, tmp_path / "run.json")
    assert plot_path(tmp_path / "run.json", "lenet", "scenarios") in written
    assert plot_path(tmp_path / "run.json", "lenet", "scenarios").stat().st_size > 1000


def test_harness_bench_records_the_scenarios_in_its_settings(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main([
        "bench", "--model", "lenet", "--backend", "cpu", "--modes", "fp32", "--quick", "--no-plots",
        "--no-progress", "--disable-cache", "-o", str(out), "--scenario", "single-stream,offline",
        "--concurrency", "1",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [s["label"] for s in doc["settings"]["scenarios"]] == ["single-stream", "offline"]
    assert sorted(label_of(c) for c in doc["cases"]) == ["offline", "single-stream"]


# --- CUDA streams (GPU runners) ----------------------------------------------------------------


@pytest.mark.gpu
def test_tensorrt_workers_are_execution_contexts_on_streams_of_their_own(gpu, tmp_path):  # noqa: F811
    import torch

    from harness import models
    from harness.bench.scenario_run import replicas
    from harness.build import build_engine
    from harness.engines.protocol import BuildConfig

    spec = models.load("lenet")
    backend = get_backend("tensorrt")
    engine = build_engine(spec, BuildConfig("fp16"), backend, None).engine
    workers = replicas(engine, backend, 3)
    contexts = {id(w._context) for w in workers}  # type: ignore[attr-defined]
    assert len(contexts) == 3
    outputs = [w.run(*spec.example_inputs) for w in workers]
    streams = {w._own_stream().cuda_stream for w in workers}  # type: ignore[attr-defined]
    assert len(streams) == 3 and 0 not in streams
    assert all(torch.equal(o[0], outputs[0][0]) for o in outputs)
    doc = _run("tensorrt", [Scenario("server", concurrency=2, target_rate=100.0)], tmp_path / "run.json")
    assert doc["cases"][0]["status"] == "ok" and doc["cases"][0]["scenario"]["concurrency"] == 2


@pytest.mark.slow  # real benches of every scenario
def test_the_project_files_scenario_table_is_used_and_flags_override_it(tmp_path, capsys):
    config = tmp_path / "harness.toml"
    config.write_text('[scenario]\nnames = ["server"]\ntarget_rate = 40\nlatency_bound = "1s"\n')
    out = tmp_path / "run.json"
    argv = ["bench", "--config", str(config), "--model", "lenet", "--backend", "cpu", "--modes", "fp32", "--quick",
            "--no-plots", "--no-progress", "--disable-cache", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (case,) = json.loads(out.read_text())["cases"]
    assert case["scenario"]["label"] == "server[rate=40/s,bound=1000ms]"
    assert main([*argv[:-2], "-o", str(tmp_path / "two.json"), "--target-rate", "25"]) == 0
    (case,) = json.loads((tmp_path / "two.json").read_text())["cases"]
    assert case["scenario"]["label"] == "server[rate=25/s,bound=1000ms]"
    config.write_text('[scenario]\nnames = ["server"]\nfind_rate = true\nlatency_bound = "soon"\n')
    assert main([*argv[:-2], "-o", str(tmp_path / "three.json")]) == 2
    assert "[scenario] latency_bound" in capsys.readouterr().err
