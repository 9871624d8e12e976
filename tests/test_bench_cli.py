"""``harness bench | merge | baseline promote | compare | gate`` as users run them."""

from __future__ import annotations

import json
import sys

import numpy as np
import pynvml
import pytest
import torch

from harness.bench import runner as runner_mod
from harness.bench.results import content_digest, load_results
from harness.bench.results_doc import read_run
from harness.bench.runner import cache_file
from harness.cache.operations import pin
from harness.cache.timing_cache import TimingCache
from harness.cli import main as cli_main
from harness.documents import document_json
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from tests.test_documents import same_record
from tests.test_telemetry_gpus import B, NvmlDouble, cuda_double, gpus

MACHINE = "test-machine"
CPU = CpuBackend()
DIGITS_FP32_CACHE = cache_file("", "digits", BuildConfig("fp32", threads=1), CPU).name


@pytest.fixture(autouse=True)
def fixed_machine(monkeypatch):
    monkeypatch.setenv("HARNESS_MACHINE_ID", MACHINE)


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = cli_main.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bench(capsys, tmp_path, output, *extra: object) -> tuple[int, str, str]:
    return run(
        capsys, "bench", "--quick", "--no-progress", "--no-plots",
        "--cache-dir", tmp_path / "caches", "-o", output, *extra,
    )  # fmt: skip


def keys(path) -> list[tuple[str, str, str]]:
    return sorted((c["model"], c["mode"], c["backend"]) for c in load_results(path)["cases"])


def test_bench_prints_table_overhead_and_markdown(capsys, tmp_path):
    out_file, md = tmp_path / "run.json", tmp_path / "summary.md"
    code, out, _ = run(
        capsys, "bench", "--quick", "--no-progress", "--backend", "cpu", "--models", "digits",
        "--modes", "fp32,bf16", "-o", out_file, "--summary-md", md,
    )  # fmt: skip
    assert code == 0
    doc = load_results(out_file)
    assert doc["complete"] and doc["machine"]["id"] == MACHINE
    assert [c["mode"] for c in doc["cases"]] == ["fp32", "bf16"]
    assert doc["settings"]["quick"] is True and doc["settings"]["backend"] == "cpu"
    assert "measurement overhead per iteration" in out and "x1.00" in out
    # caches default to caches/ next to the results file; plots too
    assert cache_file(tmp_path / "caches", "digits", BuildConfig("bf16", threads=1), CPU).is_file()
    assert (tmp_path / "run-digits.png").is_file()
    text = md.read_text()
    assert text.startswith("machine test-machine") and "| model " in text and "| digits " in text


def test_a_run_without_caches_times_every_layer_and_writes_no_cache(capsys, tmp_path):
    for name in ("a.json", "b.json"):  # the second run finds nothing from the first: it times again
        out_file = tmp_path / name
        code, _, err = run(capsys, "bench", "--quick", "--no-progress", "--no-plots", "--models", "digits",
                           "--modes", "fp32", "--disable-cache", "-o", out_file)  # fmt: skip
        assert code == 0, err
        doc = load_results(out_file)
        (case,) = doc["cases"]
        assert case["status"] == "ok" and doc["settings"]["cache_dir"] is None
        build = case["build"]
        assert build["cache_file"] is None and build["cache_hits"] == 0 and build["cache_misses"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]  # no caches/ beside them


def test_shards_merge_to_the_unsharded_case_set(capsys, tmp_path):
    modes = ("--models", "digits,lenet", "--modes", "fp32,bf16")
    assert bench(capsys, tmp_path, tmp_path / "all.json", *modes)[0] == 0
    for i in (1, 2):
        assert bench(capsys, tmp_path, tmp_path / f"s{i}.json", *modes, "--shard", f"{i}/2")[0] == 0
    assert keys(tmp_path / "s1.json") != keys(tmp_path / "s2.json")
    code, out, _ = run(capsys, "merge", tmp_path / "s1.json", tmp_path / "s2.json", "-o", tmp_path / "m.json")
    assert code == 0 and "4 cases, complete" in out
    assert keys(tmp_path / "m.json") == keys(tmp_path / "all.json")
    assert len(keys(tmp_path / "all.json")) == 4
    # the same shard twice is a duplicate case, not a merge
    code, _, err = run(capsys, "merge", tmp_path / "s1.json", tmp_path / "s1.json", "-o", tmp_path / "x.json")
    assert code == 2 and "in both" in err
    assert not (tmp_path / "x.json").exists()


def test_failed_case_exits_1_after_the_whole_matrix(capsys, tmp_path):
    model = tmp_path / "bad.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Bad(nn.Module):\n    def forward(self, x):\n        return x.view(-1, 7)\n\n"
        "def build():\n    return Bad(), (torch.ones(2, 3),)\n"
    )
    code, out, err = bench(capsys, tmp_path, tmp_path / "r.json", "--models", f"{model}:build,digits", "--modes", "fp32")
    assert code == 1
    doc = load_results(tmp_path / "r.json")
    assert doc["complete"] and [c["status"] for c in doc["cases"]] == ["failed", "ok"]
    # a user model is named by its factory (or ModelSpec.name), never by its path
    assert "1 of 2 cases failed" in err and "build/fp32" in err and str(model) not in err


def test_ctrl_c_keeps_finished_cases_and_exits_130(capsys, tmp_path, monkeypatch):
    real, calls = runner_mod.measure_latency, []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "measure_latency", interrupt_second)
    code, out, err = bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32,amp-bf16,bf16")
    assert code == 130
    doc = load_results(tmp_path / "r.json")
    assert doc["complete"] is False and [c["mode"] for c in doc["cases"]] == ["fp32"]
    assert "INCOMPLETE" in out and "1 of 3 cases kept" in err and "--resume" in err
    # an incomplete run cannot become a baseline
    code, _, err = run(capsys, "baseline", "promote", tmp_path / "r.json", "--root", tmp_path / "root")
    assert code == 2 and "incomplete" in err
    # --resume finishes it: the kept case is not measured again
    again = ("--models", "digits", "--modes", "fp32,amp-bf16,bf16", "--resume")
    code, _, err = bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32", "--resume")
    assert code == 2 and "settings" in err  # other flags: not the same run
    assert bench(capsys, tmp_path, tmp_path / "r.json", *again)[0] == 0
    doc = load_results(tmp_path / "r.json")
    assert doc["complete"] is True and [c["mode"] for c in doc["cases"]] == ["fp32", "amp-bf16", "bf16"]
    assert len(calls) == 4
    code, _, err = bench(capsys, tmp_path, tmp_path / "r.json", *again)
    assert code == 2 and "nothing to resume" in err


def synthetic_timings(doc: dict, scale: float, seed: int, n: int = 300) -> dict:
    """The run with every case's latency samples replaced by fixed synthetic ones.

    ``n`` lognormal samples around ``100 us * scale`` (2% spread, seeded):
    the same file whatever the machine's load was when ``doc`` was measured, so
    no verdict depends on it. The summary is recomputed by the harness's own
    code, so the file is what a real run with those samples would have written.
    """
    from harness.bench.latency import LatencyResult
    from harness.bench.stats import Summary, slow_phase

    out = json.loads(json.dumps(doc))
    rng = np.random.default_rng(seed)
    for case in out["cases"]:
        lat = case["latency"]
        samples = [int(s) for s in rng.lognormal(np.log(100_000 * scale), 0.02, n)]
        summary = Summary.from_samples(samples)
        again = LatencyResult(summary, len(samples), sum(samples) / 1e9, lat["warmup_iterations"], lat["warmup_s"],
                              lat["timer"], lat["batch_size"], 0.05, slow_phase(samples), False, None)  # fmt: skip
        case["latency"] = {**again.to_dict(), "overhead": lat["overhead"]}
        case["warnings"] = []  # the real run's load is not these samples' load
    out["settings"]["quick"] = False  # full-length samples: what a run without --quick writes
    return out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> dict:
    """One real ``--quick`` bench of digits (fp32, bf16): real accuracy, weights, fingerprints."""
    tmp = tmp_path_factory.mktemp("real-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_MACHINE_ID", MACHINE)
        argv = ["bench", "--quick", "--no-progress", "--no-plots", "--cache-dir", tmp / "caches",
                "-o", tmp / "run.json", "--models", "digits", "--modes", "fp32,bf16"]  # fmt: skip
        assert cli_main.main([str(a) for a in argv]) == 0
    return load_results(tmp / "run.json")


def test_the_settings_a_bench_writes_round_trip_through_their_classes(real_run):
    """Every key ``harness bench`` writes into ``settings`` is a typed field holding its value."""
    settings = read_run(real_run).settings
    assert same_record(document_json(settings), real_run["settings"])
    assert settings.modes == ["fp32", "bf16"] and settings.measure is not None and settings.measure.cuda_graph is False
    assert settings.model_settings is not None and settings.model_settings["digits"].modes is not None
    bf16 = settings.model_settings["digits"].modes["bf16"]
    assert bf16.compiler_settings is not None and bf16.compiler_settings.low_precision_type == "bf16"


def test_gate_from_the_command_line_on_real_runs_with_synthetic_timings(capsys, tmp_path, real_run):
    """Baseline and runs are real bench output with fixed synthetic timings (the real run's were
    taken under whatever load the machine had), so no verdict depends on how loaded the machine is."""
    from harness.bench.results import write_results

    root = tmp_path / "root"
    first = root / MACHINE / "run-20250101T000000Z.json"
    quick = root / MACHINE / "run-20250101T000000Z-quick.json"
    write_results(quick, {**synthetic_timings(real_run, 1.0, seed=0), "settings": real_run["settings"]})
    # a --quick run is no baseline unless forced, and then the baseline says so
    code, _, err = run(capsys, "baseline", "promote", quick, "--root", root)
    assert code == 2 and "--quick run" in err and "--force" in err
    code, out, _ = run(capsys, "baseline", "promote", quick, "--root", root, "--force")
    assert load_results(root / MACHINE / "baseline.json")["promoted"]["forced_over"] == [
        "it is a --quick run (its timing windows are too short)"
    ]
    quick.unlink()
    write_results(first, synthetic_timings(real_run, 1.0, seed=0))
    code, out, _ = run(capsys, "baseline", "promote", first, "--root", root)
    assert code == 0 and load_results(root / MACHINE / "baseline.json")["promoted"]["forced_over"] == []
    base = load_results(first)

    same = root / MACHINE / "run-20250101T000001Z.json"
    write_results(same, synthetic_timings(base, 1.0, seed=1))
    code, out, _ = run(capsys, "gate", "--root", root)  # defaults: this machine's baseline, newest run
    assert code == 0 and "gate PASS: 0 of 2 cases fail (2 ok); 2 judged, 2 needed" in out and str(same) in out

    slowed = root / MACHINE / "run-20250101T000002Z.json"
    write_results(slowed, synthetic_timings(base, 3.0, seed=2))
    report = tmp_path / "gate.md"
    code, out, _ = run(capsys, "gate", "--root", root, "--summary-md", report)
    assert code == 1 and "gate FAIL: 2 of 2 cases fail (2 regression)" in out
    row = next(line for line in out.splitlines() if line.startswith("digits/bf16/cpu"))
    assert "regression" in row and "slower: median x2.99" in row  # fixed by the seeds
    assert "regression" in report.read_text()
    code, out, _ = run(capsys, "gate", "--root", root, "--json")
    verdicts = json.loads(out)
    assert code == 1 and verdicts["exit_code"] == 1 and verdicts["counts"] == {"regression": 2}
    assert [c["verdict"] for c in verdicts["cases"]] == ["regression", "regression"]
    # a subset run fails on the missing case, unless that is what the user asked for
    subset = synthetic_timings(base, 1.0, seed=1)
    subset["cases"] = subset["cases"][:1]
    write_results(slowed, subset)
    code, out, _ = run(capsys, "gate", "--root", root)
    assert code == 1 and "1 missing" in out
    code, out, _ = run(capsys, "gate", "--root", root, "--allow-missing")
    assert code == 0 and "1 missing" in out and "1 judged, 1 needed" in out


def test_promote_refuses_an_unstable_or_busy_run_unless_forced_and_records_why(capsys, tmp_path, real_run):
    from harness.bench.results import write_results

    run_path = tmp_path / "run.json"
    doc = synthetic_timings(real_run, 1.0, seed=0)
    doc["cases"][0]["warnings"] = ["the machine was busier than its 2 cores (load average 5.0 -> 4.0); its latency may be inflated"]
    noisy = synthetic_timings(real_run, 1.0, seed=3)["cases"][1]["latency"]
    doc["cases"][1]["latency"] = {**noisy, "spread_threshold": 0.0, "unstable": True}  # every run is past 0%
    write_results(run_path, doc)
    code, _, err = run(capsys, "baseline", "promote", run_path, "--root", tmp_path / "root")
    assert code == 2 and "1 of 2 cases are unstable (digits/bf16/cpu)" in err
    assert "1 of 2 cases ran while the machine was busier than its cores" in err and "--force" in err
    assert not (tmp_path / "root").exists()
    assert run(capsys, "baseline", "promote", run_path, "--root", tmp_path / "root", "--force")[0] == 0
    (baseline,) = (tmp_path / "root").glob("*/baseline.json")
    assert len(load_results(baseline)["promoted"]["forced_over"]) == 2


def test_the_gate_takes_the_run_that_finished_last_and_passes_over_quick_and_interrupted_ones(capsys, tmp_path, real_run):
    """A --quick run started during a full run (so named after it) and finished before it, then an
    interrupted one: the gate's default current run is the full run, which finished last."""
    from harness.bench.results import sealed, write_results

    machine = tmp_path / "root" / MACHINE
    full = synthetic_timings(real_run, 1.0, seed=0)
    write_results(machine / "run-20250101T000000Z.json", {**full, "finished": "2025-01-01T01:00:00Z"})
    quick = {**synthetic_timings(real_run, 1.0, seed=1), "finished": "2025-01-01T00:10:00Z", "settings": real_run["settings"]}
    write_results(machine / "run-20250101T000500Z.json", quick)
    partial = {k: v for k, v in synthetic_timings(real_run, 1.0, seed=2).items() if k not in ("digest", "finished")}
    write_results(machine / "run-20250101T000900Z.json", sealed({**partial, "complete": False}, "partial"))
    write_results(machine / "baseline.json", synthetic_timings(real_run, 1.0, seed=3))
    code, out, _ = run(capsys, "gate", "--root", tmp_path / "root")
    assert str(machine / "run-20250101T000000Z.json") in out.splitlines()[0] and code == 0
    (machine / "run-20250101T000000Z.json").unlink()
    code, _, err = run(capsys, "gate", "--root", tmp_path / "root")
    assert code == 2 and "run-20250101T000500Z.json (--quick)" in err and "run-20250101T000900Z.json (interrupted)" in err


@pytest.mark.parametrize(
    ("flag", "change", "finding"),
    [
        ("--max-abs-error-increase", {"accuracy.max_abs_error": +0.002}, "max abs error"),
        ("--cosine-drop", {"accuracy.cosine": -2e-4}, "cosine"),
        ("--top1-drop", {"accuracy.top1_agreement": -0.02}, "top-1 agreement"),
        ("--task-accuracy-drop", {"task_accuracy.value": -0.01}, "task top1"),
    ],
)
def test_each_tolerance_flag_decides_the_exit_code(capsys, tmp_path, real_run, flag, change, finding):
    """Past the default tolerance a case fails as ``accuracy`` (not a latency regression); the flag loosens it."""
    from harness.bench.results import write_results

    base = synthetic_timings(real_run, 1.0, seed=0)
    worse = json.loads(json.dumps(base))  # the same samples: latency cannot decide anything
    for case in worse["cases"]:
        for dotted, delta in change.items():
            section, key = dotted.split(".")
            case[section][key] += delta
    write_results(tmp_path / "base.json", base)
    write_results(tmp_path / "worse.json", worse)
    gate_args = ("gate", "--baseline", tmp_path / "base.json", "--current", tmp_path / "worse.json")

    code, out, _ = run(capsys, *gate_args, "--json")
    verdicts = json.loads(out)
    assert code == 1 and verdicts["counts"] == {"accuracy": 2}
    assert all(finding in f["message"] for c in verdicts["cases"] for f in c["findings"] if f["severity"] == "fail")
    code, out, _ = run(capsys, *gate_args, flag, "0.05")
    assert code == 0 and "gate PASS: 0 of 2 cases fail (2 ok)" in out
    code, _, _ = run(capsys, *gate_args, flag, "0")  # no tolerance at all: still a failure
    assert code == 1


def test_runs_that_share_no_case_exit_2(capsys, tmp_path, real_run):
    from harness.bench.results import write_results

    base = synthetic_timings(real_run, 1.0, seed=0)
    other = json.loads(json.dumps(base))
    for case in other["cases"]:
        case["model"] = "digits-renamed"  # e.g. a user model given by another path
    write_results(tmp_path / "base.json", base)
    write_results(tmp_path / "other.json", other)
    code, out, err = run(capsys, "gate", "--baseline", tmp_path / "base.json", "--current", tmp_path / "other.json")
    assert code == 2 and out == ""
    assert "share no case (run: 2 cases, baseline: 2); nothing can be compared" in err


def test_a_pinned_slower_tactic_is_what_the_engine_runs(capsys, tmp_path):
    """Pinning the slowest recorded candidate makes the rebuilt engine run it (no timing judged)."""
    case = ("--models", "digits", "--modes", "weak-bf16")
    first = tmp_path / "a.json"
    assert bench(capsys, tmp_path, first, *case)[0] == 0
    path = cache_file(tmp_path / "caches", "digits", BuildConfig("weak-bf16", threads=1), CPU)
    cache = TimingCache.load(path)
    heaviest = max(cache.entries(), key=lambda e: e.time_ms)
    slowest = max(heaviest.candidates, key=lambda c: c.time_ms)
    assert slowest.tactic != heaviest.tactic
    pin(cache, heaviest.layer, slowest.tactic)
    cache.save(path)
    second = tmp_path / "b.json"
    assert bench(capsys, tmp_path, second, *case)[0] == 0
    (case_b,) = load_results(second)["cases"]
    layers = {la["name"]: la["tactic"] for la in case_b["layers"]}
    assert layers[heaviest.layer] == slowest.tactic and case_b["from_cache"] is True
    # the cache was edited on purpose: another engine is not a determinism failure
    code, out, _ = run(capsys, "gate", "--baseline", first, "--current", second, "--json")
    (verdict,) = json.loads(out)["cases"]
    assert not [f for f in verdict["findings"] if f["kind"] == "determinism"]


def test_compare_reports_same_fingerprints_for_a_rerun(capsys, tmp_path):
    case = ("--models", "digits", "--modes", "fp32")
    assert bench(capsys, tmp_path, tmp_path / "a.json", *case)[0] == 0
    assert bench(capsys, tmp_path, tmp_path / "b.json", *case)[0] == 0
    code, out, _ = run(capsys, "compare", tmp_path / "a.json", tmp_path / "b.json")
    assert code == 0
    row = next(line for line in out.splitlines() if "digits" in line and "fp32" in line)
    assert "DIFFERENT" not in row and "same" in row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("bench", "--models", "nosuchmodel"), "unknown model 'nosuchmodel'"),
        (("bench", "--modes", "fp8"), "unknown precision mode 'fp8'"),
        (("bench", "--modes", "explicit"), "needs --explicit FILE"),
        (("bench", "--models", "digits,digits"), "appears twice"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, tmp_path, argv, message):
    code, out, err = run(capsys, *argv, *(("--no-progress",) if argv[0] == "bench" else ()))
    assert code == 2
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("bench", "--shard", "3/2"), "argument --shard: '3/2'"),
        (("bench", "--shard", "x"), "expected i/n"),
        (("gate", "--latency-threshold", "fast"), "argument --latency-threshold: 'fast'"),
        (("gate", "--alpha", "1.5"), "argument --alpha: '1.5'"),
        (("bench", "--spread-threshold", "abc"), "argument --spread-threshold: 'abc'"),
        (("bench", "--spread-threshold", "25"), "read as the fraction 25, i.e. 2500%; write 25% for 25 percent"),
        (("bench", "--threads", "0"), "argument --threads: 0 is out of range; valid: 1..1024"),
        (("gate", "--cosine-drop", "-1"), "argument --cosine-drop: '-1': expected a finite number >= 0"),
        (("bench", "--lock-clocks", "fast"), "argument --lock-clocks: 'fast': expected base, max or a clock in MHz"),
    ],
)
def test_bad_flag_values_are_usage_errors(capsys, argv, message):
    """Refused while parsing (argparse's usage line, exit 2), before any file or model is read."""
    with pytest.raises(SystemExit) as exc:
        cli_main.main([*argv, *(("--no-progress",) if argv[0] == "bench" else ())])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: harness {argv[0]}") and message in err


def test_a_project_files_values_are_still_checked_where_used(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "harness.toml").write_text('[gate]\nlatency_threshold = "25"\n')
    code, _, err = run(capsys, "gate", "--baseline", "a.json", "--current", "b.json")
    assert code == 2 and "[gate] latency_threshold '25': read as the fraction 25" in err
    (tmp_path / "harness.toml").write_text('[timing]\nspread_threshold = "25"\n')
    code, _, err = run(capsys, "bench", "--no-progress", "--models", "digits", "--modes", "fp32")
    assert code == 2 and "[timing] spread_threshold '25': read as the fraction 25" in err


def test_unknown_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["bench", "--backend", "cuda"])
    assert exc.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_gate_without_baseline_or_runs_explains_what_is_missing(capsys, tmp_path):
    code, _, err = run(capsys, "gate", "--root", tmp_path)
    assert code == 2 and f"no baseline for machine '{MACHINE}'" in err and "baseline promote" in err
    code, _, err = run(capsys, "gate", "--root", tmp_path, "--baseline", tmp_path / "b.json")
    assert code == 2 and "no finished, full run-*.json (other than shards) in" in err


@pytest.mark.parametrize("command", ["gate", "compare", "merge", "promote"])
def test_corrupt_results_file_is_rejected_and_left_alone(capsys, tmp_path, command):
    good = tmp_path / "good.json"
    assert bench(capsys, tmp_path, good, "--models", "digits", "--modes", "fp32")[0] == 0
    bad = tmp_path / "bad.json"
    doc = json.loads(good.read_text())
    doc["cases"][0]["latency"]["samples_ns"][0] = -5
    doc["digest"] = content_digest(doc)  # forged: the contents are still checked
    bad.write_text(json.dumps(doc))
    original = bad.read_bytes()
    argv = {
        "gate": ("gate", "--baseline", good, "--current", bad),
        "compare": ("compare", good, bad),
        "merge": ("merge", bad, "-o", tmp_path / "merged.json"),
        "promote": ("baseline", "promote", bad, "--root", tmp_path / "root"),
    }[command]
    code, _, err = run(capsys, *argv)
    assert code == 2 and str(bad) in err and "latency samples must be positive integers" in err
    assert bad.read_bytes() == original
    assert not (tmp_path / "merged.json").exists() and not (tmp_path / "root").exists()


def test_gate_default_current_is_the_newest_whole_run_not_a_shard(tmp_path):
    from harness.bench.store import newest_finished_run

    for name in ("run-20250101T000000Z.json", "run-20250102T000000Z.json", "run-20250103T000000Z-shard1of2.json"):
        created = name[4:20]
        (tmp_path / name).write_text(json.dumps({"complete": True, "created": created, "settings": {}}))
    assert newest_finished_run(tmp_path) == tmp_path / "run-20250102T000000Z.json"


def test_spread_threshold_decides_the_unstable_flag(capsys, tmp_path):
    strict, loose = tmp_path / "strict.json", tmp_path / "loose.json"
    common = ("--models", "digits", "--modes", "fp32")
    assert bench(capsys, tmp_path, strict, *common, "--spread-threshold", "0%")[0] == 0
    assert bench(capsys, tmp_path, loose, *common, "--spread-threshold", "999%")[0] == 0
    (tight,), (wide,) = load_results(strict)["cases"], load_results(loose)["cases"]
    assert tight["latency"]["summary"]["spread"] > 0 and tight["latency"]["unstable"] is True
    # Under load a slow phase also marks a run unstable; only the spread's part is the threshold's.
    assert wide["latency"]["summary"]["spread"] < 9.99
    assert wide["latency"]["unstable"] is (wide["latency"]["slow_phase"] is not None)
    assert load_results(loose)["settings"]["measure"]["spread_threshold"] == pytest.approx(9.99)


# --- refused before any work: no results file is written ---------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--backend", "tensorrt"), "tensorrt"),
        (("--backend", "onnxruntime", "--modes", "weak-fp16"), "cannot build weak-fp16"),
        (("--backend", "onnxruntime", "--modes", "bf16"), "cannot build bf16"),
        (("--modes", "explicit", "--explicit", "{bad_regex}"), "not a valid regular expression"),
        (("--cache-dir", "{a_file}"), "exists and is not a directory"),
        (("--cache-dir", "{corrupt_caches}"), DIGITS_FP32_CACHE),
        (("--summary-md", "{a_dir}"), "--summary-md"),
        (("--disable-cache", "--cache-dir", "{a_dir}"), "--disable-cache and --cache-dir contradict"),
        (("--disable-cache", "--ignore-mismatch"), "--disable-cache and --ignore-mismatch contradict"),
        (("--lock-clocks", "max"), "--lock-clocks max: the cpu backend runs on the CPU"),
        (("--cuda-graph",), "--cuda-graph: the cpu backend runs on the CPU"),
    ],
)
def test_what_would_fail_is_refused_before_anything_is_written(capsys, tmp_path, extra, message):
    (tmp_path / "bad.json").write_text('{"(": "fp16"}')
    (tmp_path / "file").write_text("x")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / DIGITS_FP32_CACHE).write_text('{"truncated": ')
    (tmp_path / "dir").mkdir()
    values = {"bad_regex": tmp_path / "bad.json", "a_file": tmp_path / "file",
              "corrupt_caches": tmp_path / "corrupt", "a_dir": tmp_path / "dir"}  # fmt: skip
    argv = [str(a).format(**values) for a in extra]
    output = tmp_path / "out" / "run.json"
    code, _, err = run(capsys, "bench", "--no-progress", "--models", "digits", "--modes", "fp32", "-o", output, *argv)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not output.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("where", "message"),
    [("{file}/run.json", "is a file, so nothing can be written below it"), ("{ro}/run.json", "is not writable")],
)
def test_unwritable_outputs_are_refused_before_the_run(capsys, tmp_path, where, message):
    import os

    (tmp_path / "file").write_text("x")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        target = where.format(file=tmp_path / "file", ro=tmp_path / "ro")
        if os.access(tmp_path / "ro", os.W_OK) and "ro" in where:
            target = where.format(ro="/proc/1")  # running as root: a directory nobody can write
        code, _, err = bench(capsys, tmp_path, target, "--models", "digits", "--modes", "fp32")
        assert code == 2 and "-o" in err and message in err
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_o_directory_writes_a_new_run_file_into_it(capsys, tmp_path):
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    code, out, _ = bench(capsys, tmp_path, out_dir, "--models", "digits", "--modes", "fp32")
    assert code == 0
    (written,) = out_dir.glob("run-*.json")
    assert f"results: {written}" in out and load_results(written)["complete"]


def test_threads_and_load_are_recorded_per_case_and_in_the_cache(capsys, tmp_path):
    code, _, _ = bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32", "--threads", "2")
    assert code == 0
    doc = load_results(tmp_path / "r.json")
    (case,) = doc["cases"]
    assert doc["settings"]["threads"] == 2 and case["threads"] == 2
    assert len(case["load_average"]["start"]) == 3 and case["load_average"]["cpus"] >= 1
    cache = TimingCache.load(cache_file(tmp_path / "caches", "digits", BuildConfig("fp32", threads=2), CPU))
    assert cache.provenance.builder_options["num_threads"] == 2
    # another thread count gets a cache of its own instead of failing against this one
    code, _, _ = bench(capsys, tmp_path, tmp_path / "r2.json", "--models", "digits", "--modes", "fp32", "--threads", "1")
    assert code == 0
    assert TimingCache.load(cache_file(tmp_path / "caches", "digits", BuildConfig("fp32", threads=1), CPU)).provenance.builder_options["num_threads"] == 1
    # a cache of this configuration that another thread count wrote is refused up front, naming the setting
    mine = cache_file(tmp_path / "caches", "digits", BuildConfig("fp32", threads=1), CPU)
    mine.write_bytes(cache_file(tmp_path / "caches", "digits", BuildConfig("fp32", threads=2), CPU).read_bytes())
    code, _, err = bench(capsys, tmp_path, tmp_path / "r3.json", "--models", "digits", "--modes", "fp32", "--threads", "1")
    assert code == 2 and "num_threads: 2 != 1" in err and not (tmp_path / "r3.json").exists()
    code, _, _ = bench(capsys, tmp_path, tmp_path / "r4.json", "--models", "digits", "--modes", "fp32",
                       "--threads", "1", "--ignore-mismatch")  # fmt: skip
    assert code == 0 and load_results(tmp_path / "r4.json")["settings"]["ignore_cache_mismatch"] is True


def test_report_prints_any_stored_run(capsys, tmp_path):
    assert bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32")[0] == 0
    code, out, _ = run(capsys, "report", tmp_path / "r.json", "--summary-md", tmp_path / "r.md")
    assert code == 0 and "machine test-machine" in out and "digits" in out
    assert (tmp_path / "r-digits.png").is_file() and "| digits " in (tmp_path / "r.md").read_text()
    code, _, err = run(capsys, "report", tmp_path / "nothing.json")
    assert code == 2 and "nothing.json: no such file" in err


def test_promote_refuses_a_root_that_is_a_file(capsys, tmp_path):
    assert bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32")[0] == 0
    (tmp_path / "root").write_text("x")
    code, _, err = run(capsys, "baseline", "promote", tmp_path / "r.json", "--root", tmp_path / "root", "--force")
    assert code == 2 and "--root" in err and "not a directory" in err


def test_a_machine_id_with_a_newline_is_refused(capsys, tmp_path):
    assert bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32")[0] == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    doc["machine"]["id"] = "x\n"
    doc["digest"] = content_digest(doc)
    (tmp_path / "r.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "baseline", "promote", tmp_path / "r.json", "--root", tmp_path / "root", "--force")
    assert code == 2 and "machine id 'x\\n' is not a valid directory name" in err
    assert not (tmp_path / "root").exists()


def test_compare_as_json(capsys, tmp_path):
    case = ("--models", "digits", "--modes", "fp32")
    assert bench(capsys, tmp_path, tmp_path / "a.json", *case)[0] == 0
    assert bench(capsys, tmp_path, tmp_path / "b.json", *case)[0] == 0
    code, out, _ = run(capsys, "compare", tmp_path / "a.json", tmp_path / "b.json", "--json")
    (c,) = json.loads(out)["cases"]
    assert code == 0 and c["key"] == "digits/fp32/cpu" and c["weights_equal"] is True


def test_report_and_compare_read_a_schema1_run_and_the_gate_refuses_it(capsys, tmp_path):
    """A real schema-1 run (tests/data/results/README.md): shown upgraded and marked unverified, never gated."""
    import shutil
    from pathlib import Path

    old = Path(__file__).parent / "data" / "results" / "schema1_run.json"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    shutil.copy(old, a)
    shutil.copy(old, b)
    code, out, _ = run(capsys, "report", a, "--no-plots")
    assert code == 0 and "machine intel-xeon-processor-2c, commit 4497e36f25d9, 3 cases" in out
    assert "upgraded on read from schema 1, which has no digest: the contents are unverified" in out
    assert "measurement overhead per iteration: not recorded in this file" in out
    code, out, err = run(capsys, "compare", a, b, "--json")
    assert code == 0 and len(json.loads(out)["cases"]) == 3
    assert err.count("upgraded on read from schema 1") == 2
    code, out, err = run(capsys, "gate", "--baseline", a, "--current", b)
    assert code == 2 and f"results file {a}: schema_version 1 is an old results format" in err
    assert a.read_bytes() == old.read_bytes()  # reading never rewrites the file


def gpu_machine(monkeypatch) -> NvmlDouble:
    """NvmlDouble's GPUs, CUDA's device 0 on the second, and the cpu backend taken for a GPU backend.

    No GPU backend runs here; this exercises what ``--lock-clocks`` adds around
    a run (the lock, its record in every case, the unlock) on a real CPU run.
    """
    monkeypatch.setattr(runner_mod, "GPU_BACKENDS", frozenset({"cpu"}))
    cuda_double(monkeypatch, B)
    nvml = gpus()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what `import pynvml` finds
    return nvml


def test_lock_clocks_holds_the_lock_for_the_run_and_every_case_records_it(capsys, tmp_path, monkeypatch):
    nvml = gpu_machine(monkeypatch)
    code, _, err = bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32,bf16", "--lock-clocks", "base")
    assert code == 0, err
    doc = load_results(tmp_path / "r.json")
    assert doc["settings"]["lock_clocks"] == "base"
    assert [d["uuid"] for d in doc["machine"]["gpu"]["devices"]] == [g.uuid for g in nvml.gpus]
    for case in doc["cases"]:
        gpu = case["telemetry"]["gpu"]
        assert gpu["uuid"] == f"GPU-{B}" and gpu["clocks"]["locked_graphics_mhz"] == 1410
    assert nvml.calls == [("lock", f"GPU-{B}", 1410, 1410), ("reset", f"GPU-{B}")]
    assert [g.locked for g in nvml.gpus] == [None, None, None]


def test_lock_clocks_unlocks_after_ctrl_c(capsys, tmp_path, monkeypatch):
    nvml = gpu_machine(monkeypatch)

    def interrupt(*args, **kwargs):
        assert nvml.gpus[1].locked == 1980
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_mod, "measure_latency", interrupt)
    code, _, err = bench(capsys, tmp_path, tmp_path / "r.json", "--models", "digits", "--modes", "fp32", "--lock-clocks", "max")
    assert code == 130 and "interrupted" in err
    assert nvml.calls[-1] == ("reset", f"GPU-{B}") and nvml.gpus[1].locked is None


def test_lock_clocks_without_permission_writes_nothing(capsys, tmp_path, monkeypatch):
    nvml = gpu_machine(monkeypatch)
    nvml.gpus[1].lock_error = nvml.gpus[1].reset_error = pynvml.NVML_ERROR_NO_PERMISSION
    output = tmp_path / "out" / "r.json"
    code, _, err = bench(capsys, tmp_path, output, "--models", "digits", "--modes", "fp32", "--lock-clocks", "1410")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --lock-clocks 1410: NVML refused") and "needs root" in err
    assert not output.exists() and nvml.gpus[1].locked is None


def test_a_case_whose_layers_ran_wider_than_its_mode_says_so_in_results_and_table(capsys, tmp_path):
    """The overflow model in fp16 overflows (its typed graph gives NaN/Inf, as the cpu engine does);
    ONNX Runtime has no CPU fp16 kernel for its Gemm and LayerNormalization and runs them in fp32,
    so its "fp16" output is finite. The case records which layers ran fp32, and the table says so."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    from harness import models
    from harness.engines.modes import compile_for_mode
    from harness.precision import ExecutedPrecision

    spec = models.load("overflow")
    with torch.inference_mode():
        typed = compile_for_mode(spec, "fp16", None)(*spec.example_inputs)
    assert not torch.isfinite(typed).all()  # what fp16 really gives
    ort_out, cpu_out = tmp_path / "ort.json", tmp_path / "cpu.json"
    code, out, _ = bench(capsys, tmp_path, ort_out, "--models", "overflow", "--modes", "fp16", "--backend", "onnxruntime")
    assert code == 0
    [case] = load_results(ort_out)["cases"]
    ran = ExecutedPrecision.from_json(case["executed_precision"])
    assert ran.asked == "fp16" and not ran.chosen and len(ran.wider) <= ran.layers
    # Which kernels ONNX Runtime's CPU provider has depends on its build and the CPU; its output says
    # which happened: finite where fp16 overflows means layers ran wider, and the record must name them.
    if case["status"] == "ok":
        assert ran.wider, "a finite output that fp16 cannot give, but no layer recorded as run wider"
        assert f"fp16 asked, {len(ran.wider)} of {ran.layers} layers ran fp32" in " ".join(out.split())
    else:  # it ran fp16 where it overflows
        assert case["status"] == "non-finite"
    # The cpu engine computes each layer in its graph type: nothing ran wider, and fp16 overflows.
    assert bench(capsys, tmp_path, cpu_out, "--models", "overflow", "--modes", "fp16", "--backend", "cpu")[0] == 0
    [cpu_case] = load_results(cpu_out)["cases"]
    assert cpu_case["status"] == "non-finite"
    cpu_ran = ExecutedPrecision.from_json(cpu_case["executed_precision"])
    assert cpu_ran.wider == () and cpu_ran.layers > 0
    # fp32 asks no low type: nothing to report
    code, _, _ = bench(capsys, tmp_path, tmp_path / "fp32.json", "--models", "overflow", "--modes", "fp32", "--backend", "onnxruntime")
    assert code == 0 and "executed_precision" not in load_results(tmp_path / "fp32.json")["cases"][0]
