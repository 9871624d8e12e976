"""``harness bench | merge | baseline promote | compare | gate`` as users run them."""

from __future__ import annotations

import json

import pytest

from harness.bench import runner as runner_mod
from harness.bench.results import load_results
from harness.bench.runner import cache_file
from harness.cache.operations import pin
from harness.cache.timing_cache import TimingCache
from harness.cli import main as cli_main

MACHINE = "test-machine"


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
    assert cache_file(tmp_path / "caches", "digits", "bf16").is_file()
    assert (tmp_path / "run-digits.png").is_file()
    text = md.read_text()
    assert text.startswith("machine test-machine") and "| model " in text and "| digits " in text


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
    assert "1 of 2 cases failed" in err and "bad.py:build/fp32" in err


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


def test_gate_flags_a_pinned_slower_tactic_and_passes_an_unchanged_rerun(capsys, tmp_path):
    """The injected slowdown is real: the slowest recorded candidate of the heaviest layer is pinned.

    In weak-bf16 the CPU builder times fp32 and bf16 GEMMs per layer; on this
    model's small GEMMs the bf16 candidates are orders of magnitude slower,
    so pinning one makes every inference genuinely slower (no sleeping, no
    edited samples). The thresholds are generous so an unchanged rerun on a
    noisy shared machine does not trip the gate.
    """
    root = tmp_path / "root"
    case = ("--models", "digits", "--modes", "weak-bf16")
    first = root / MACHINE / "run-20250101T000000Z.json"
    assert bench(capsys, tmp_path, first, *case)[0] == 0
    code, out, _ = run(capsys, "baseline", "promote", first, "--root", root)
    assert code == 0 and (root / MACHINE / "baseline.json").is_file()

    same = root / MACHINE / "run-20250101T000001Z.json"
    assert bench(capsys, tmp_path, same, *case)[0] == 0
    assert load_results(same)["cases"][0]["pinned"] is True
    # defaults: this machine's baseline and its newest run
    code, out, _ = run(capsys, "gate", "--root", root, "--latency-threshold", "50%")
    assert code == 0, out
    assert "gate PASS" in out and str(same) in out

    path = cache_file(tmp_path / "caches", "digits", "weak-bf16")
    cache = TimingCache.load(path)
    heaviest = max(cache.entries(), key=lambda e: e.time_ms)
    slowest = max(heaviest.candidates, key=lambda c: c.time_ms)
    assert slowest.tactic != heaviest.tactic
    pin(cache, heaviest.layer, slowest.tactic)
    cache.save(path)

    slowed = root / MACHINE / "run-20250101T000002Z.json"
    assert bench(capsys, tmp_path, slowed, *case)[0] == 0
    layers = {la["name"]: la["tactic"] for la in load_results(slowed)["cases"][0]["layers"]}
    assert layers[heaviest.layer] == slowest.tactic
    report = tmp_path / "gate.md"
    code, out, _ = run(
        capsys, "gate", "--root", root, "--latency-threshold", "50%", "--summary-md", report,
    )  # fmt: skip
    assert code == 1
    assert "gate FAIL" in out
    row = next(line for line in out.splitlines() if line.startswith("digits/weak-bf16/cpu"))
    assert "regression" in row and "slower: median" in row
    assert "regression" in report.read_text()


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
        (("bench", "--shard", "3/2"), "--shard '3/2'"),
        (("bench", "--shard", "x"), "expected i/n"),
        (("bench", "--models", "nosuchmodel"), "unknown model 'nosuchmodel'"),
        (("bench", "--modes", "fp8"), "unknown precision mode 'fp8'"),
        (("bench", "--modes", "explicit"), "needs --explicit FILE"),
        (("bench", "--models", "digits,digits"), "appears twice"),
        (("gate", "--latency-threshold", "fast"), "--latency-threshold 'fast'"),
        (("gate", "--alpha", "1.5"), "--alpha 1.5"),
        (("bench", "--cov-threshold", "abc"), "--cov-threshold 'abc'"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, tmp_path, argv, message):
    code, out, err = run(capsys, *argv, *(("--no-progress",) if argv[0] == "bench" else ()))
    assert code == 2
    assert err.startswith("error: ") and message in err


def test_unknown_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["bench", "--backend", "cuda"])
    assert exc.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_gate_without_baseline_or_runs_explains_what_is_missing(capsys, tmp_path):
    code, _, err = run(capsys, "gate", "--root", tmp_path)
    assert code == 2 and f"no baseline for machine '{MACHINE}'" in err and "baseline promote" in err
    code, _, err = run(capsys, "gate", "--root", tmp_path, "--baseline", tmp_path / "b.json")
    assert code == 2 and "no run-*.json (other than shards) in" in err


@pytest.mark.parametrize("command", ["gate", "compare", "merge", "promote"])
def test_corrupt_results_file_is_rejected_and_left_alone(capsys, tmp_path, command):
    good = tmp_path / "good.json"
    assert bench(capsys, tmp_path, good, "--models", "digits", "--modes", "fp32")[0] == 0
    bad = tmp_path / "bad.json"
    doc = json.loads(good.read_text())
    doc["cases"][0]["latency"]["samples_ns"][0] = -5
    bad.write_text(json.dumps(doc))
    original = bad.read_bytes()
    argv = {
        "gate": ("gate", "--baseline", good, "--current", bad),
        "compare": ("compare", good, bad),
        "merge": ("merge", bad, "-o", tmp_path / "merged.json"),
        "promote": ("baseline", "promote", bad, "--root", tmp_path / "root"),
    }[command]
    code, _, err = run(capsys, *argv)
    assert code == 2 and str(bad) in err and "non-negative integers" in err
    assert bad.read_bytes() == original
    assert not (tmp_path / "merged.json").exists() and not (tmp_path / "root").exists()


def test_gate_default_current_is_the_newest_whole_run_not_a_shard(tmp_path):
    from harness.cli.bench_cmd import newest_run

    for name in ("run-20250101T000000Z.json", "run-20250102T000000Z.json", "run-20250103T000000Z-shard1of2.json"):
        (tmp_path / name).write_text("{}")
    assert newest_run(tmp_path) == tmp_path / "run-20250102T000000Z.json"


def test_cov_threshold_decides_the_unstable_flag(capsys, tmp_path):
    strict, loose = tmp_path / "strict.json", tmp_path / "loose.json"
    common = ("--models", "digits", "--modes", "fp32")
    assert bench(capsys, tmp_path, strict, *common, "--cov-threshold", "0%")[0] == 0
    assert bench(capsys, tmp_path, loose, *common, "--cov-threshold", "999%")[0] == 0
    (tight,), (wide,) = load_results(strict)["cases"], load_results(loose)["cases"]
    assert tight["latency"]["unstable"] is True and wide["latency"]["unstable"] is False
    assert load_results(loose)["settings"]["measure"]["cov_threshold"] == pytest.approx(9.99)
