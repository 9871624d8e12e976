"""A lean install: the CPU engine path without any extra, the gate without torch.

Each test runs ``harness`` in a subprocess whose ``site-packages`` lacks the
packages an install without extras (or the gate session) lacks: a directory
of links to this environment's packages minus those, so they are absent as
they are from a fresh install (``importlib.util.find_spec`` says None,
``importlib.metadata`` knows nothing of them), not merely made to fail on import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from test_bench_gate import case, make_doc

from harness.bench.results import write_results

pytestmark = pytest.mark.slow  # each test installs the package into a virtual environment of its own

ROOT = Path(__file__).resolve().parents[1]
# the import names and distribution names of every extra's packages
EXTRAS = {"onnx", "onnxruntime", "onnxscript", "onnx_ir", "openvino", "matplotlib", "sklearn", "scikit_learn"}
TORCH = {"torch"}


def names_the_extra(text: str, extra: str, cwd: Path) -> bool:
    """Whether ``text`` says ``pip install '<this checkout, from cwd>[extra]'``: the command that works here."""
    found = re.findall(rf"pip install '([^']+)\[{re.escape(extra)}\]'", text)
    return any((cwd / where).resolve() == ROOT for where in found)


def _lean_site(dest: Path, blocked: set[str]) -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True)
    for entry in site.iterdir():
        if re.split(r"[-.]", entry.name, maxsplit=1)[0].lower() not in blocked:
            (dest / entry.name).symlink_to(entry)
    return dest


_BOOT = (
    "import site, sys\n"
    "site.addsitedir(sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
    "from harness.cli.main import main\n"
    "code = main(sys.argv[4:])\n"
    "loaded = sorted({m.partition('.')[0] for m in sys.modules} & set(sys.argv[3].split(',')))\n"
    "print('loaded:', ','.join(loaded), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _harness(site: Path, blocked: set[str], cwd: Path, *argv: object) -> tuple[int, str, str]:
    """``harness ARGV`` with ``site`` as the only site-packages (-S: not this environment's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _BOOT, str(site), str(ROOT), ",".join(sorted(blocked)), *map(str, argv)],
        cwd=cwd, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def no_extras(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _lean_site(tmp_path_factory.mktemp("lean") / "site-packages", EXTRAS)


@pytest.fixture(scope="module")
def gate_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _lean_site(tmp_path_factory.mktemp("gate") / "site-packages", EXTRAS | TORCH)


def _runs(tmp_path: Path, slower: bool) -> tuple[Path, Path]:
    """A baseline and a current run as the results writer writes them; ``slower``: 30% slower."""
    base = make_doc([case([1000 + i % 7 for i in range(200)])])
    cur = make_doc([case([(1300 if slower else 1000) + i % 7 for i in range(200)])])
    paths = tmp_path / "baseline.json", tmp_path / "run-current.json"
    for path, doc in zip(paths, (base, cur), strict=True):
        write_results(path, doc)
    return paths


@pytest.mark.parametrize(("slower", "code", "verdict"), [(False, 0, "gate PASS"), (True, 1, "gate FAIL")])
def test_gate_runs_without_torch(gate_only, tmp_path, slower, code, verdict):
    baseline, current = _runs(tmp_path, slower)
    rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "gate", "--baseline", baseline, "--current", current)
    assert rc == code, err
    assert f"gate: {current} against baseline {baseline}" in out
    assert "mlp/fp16/cpu" in out and verdict in out
    assert "loaded: \n" in err  # neither torch nor an extra was imported (nor could be)
    # and as JSON, with a Markdown summary
    rc, out, _ = _harness(gate_only, EXTRAS | TORCH, tmp_path, "gate", "--baseline", baseline, "--current",
                          current, "--json", "--summary-md", tmp_path / "gate.md")  # fmt: skip
    assert rc == code and json.loads(out)["exit_code"] == code
    assert "### Regression gate" in (tmp_path / "gate.md").read_text()


def test_gate_finds_the_machines_baseline_without_torch(gate_only, tmp_path, monkeypatch):
    baseline, current = _runs(tmp_path, slower=False)
    machine = tmp_path / "results" / "box"
    machine.mkdir(parents=True)
    baseline.rename(machine / "baseline.json")
    current.rename(machine / "run-20250101T000000Z.json")
    monkeypatch.setenv("HARNESS_MACHINE_ID", "box")
    rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "gate", "--root", tmp_path / "results")
    assert rc == 0, err
    assert "run-20250101T000000Z.json against baseline" in out and "loaded: \n" in err


def test_compare_and_merge_run_without_torch(gate_only, tmp_path):
    baseline, current = _runs(tmp_path, slower=True)
    rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "compare", baseline, current)
    assert rc == 0, err
    assert "mlp" in out and "loaded: \n" in err


def test_report_without_the_plots_extra_says_so(gate_only, tmp_path):
    _, current = _runs(tmp_path, slower=False)
    rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "report", current)
    assert rc == 0, err
    assert "mlp" in out and "plot:" not in out
    assert "note: plots not written: plotting needs matplotlib" in err
    assert names_the_extra(err, "plots", tmp_path)


def test_cpu_build_and_bench_need_no_extra(no_extras, tmp_path):
    rc, out, err = _harness(no_extras, EXTRAS, tmp_path, "build", "--model", "lenet", "--mode", "fp32",
                            "--backend", "cpu", "-o", tmp_path / "engine")  # fmt: skip
    assert rc == 0, err
    assert "built lenet (fp32) on cpu" in out and "loaded: \n" in err

    rc, out, err = _harness(no_extras, EXTRAS, tmp_path, "bench", "--quick", "--no-progress", "--backend", "cpu",
                            "--models", "lenet", "--modes", "fp32", "--peers", "eager,onnxruntime",
                            "-o", tmp_path / "run.json")  # fmt: skip
    assert rc == 0, err
    assert "lenet" in out and "peer:eager" in out and "peer:onnxruntime" not in out
    # what was left out, and why, is said: the peer and the plots, each with its extra
    assert "note: peer onnxruntime skipped: peer 'onnxruntime' needs onnx" in err
    assert names_the_extra(err, "onnx", tmp_path)
    assert "note: plots not written: plotting needs matplotlib" in err
    assert names_the_extra(err, "plots", tmp_path)
    assert not list(tmp_path.glob("*.png"))
    assert "loaded: \n" in err
    doc = json.loads((tmp_path / "run.json").read_text())
    assert sorted((c["model"], c["backend"], c["status"]) for c in doc["cases"]) == [
        ("lenet", "cpu", "ok"), ("lenet", "peer:eager", "ok")
    ]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_an_onnx_backend_without_its_extra_names_it(no_extras, tmp_path, backend):
    extra = "onnx" if backend == "onnxruntime" else "openvino"
    for command in (("build", "-o", tmp_path / "engine"), ("bench", "--quick", "--no-progress", "-o", tmp_path / "r.json")):
        model = ("--model", "lenet", "--mode", "fp32") if command[0] == "build" else ("--models", "lenet", "--modes", "fp32")
        rc, out, err = _harness(no_extras, EXTRAS, tmp_path, command[0], *model, "--backend", backend, *command[1:])
        assert rc == 2, err
        assert f"error: backend {backend!r} needs " in err
        assert names_the_extra(err, extra, tmp_path) and "Traceback" not in err
    assert not (tmp_path / "engine").exists() and not (tmp_path / "r.json").exists()


def test_the_digits_model_without_its_extra_names_it(no_extras, tmp_path):
    rc, _, err = _harness(no_extras, EXTRAS, tmp_path, "bench", "--models", "digits", "--backend", "cpu",
                          "--modes", "fp32", "--no-progress", "-o", tmp_path / "r.json")  # fmt: skip
    assert rc == 2, err
    assert "error: the zoo model 'digits'" in err and "needs scikit-learn" in err
    assert names_the_extra(err, "digits", tmp_path)
    assert not (tmp_path / "r.json").exists()


def test_default_models_leave_out_digits_without_its_extra(monkeypatch):
    from harness.bench import runner

    assert runner.default_models() == (list(runner.DEFAULT_MODELS), [])
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now fails
    models, notes = runner.default_models()
    assert models == [m for m in runner.DEFAULT_MODELS if m != "digits"]
    assert len(notes) == 1 and notes[0].startswith("default model digits left out: ")
    assert names_the_extra(notes[0], "digits", Path.cwd())


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A timing cache a real build wrote (weak-bf16: every linear layer has candidates to pin)."""
    from harness.cli.main import main

    root = tmp_path_factory.mktemp("cache")
    argv = ["build", "--model", "lenet", "--mode", "weak-bf16", "--backend", "cpu", "--cache", str(root / "c.json"),
            "-o", str(root / "engine"), "--option", "timing_runs=2", "--option", "warmup_runs=1"]  # fmt: skip
    assert main(argv) == 0
    return root / "c.json"


def test_cache_commands_run_without_torch(gate_only, built_cache, tmp_path):
    from harness.cache.timing_cache import TimingCache

    cache = TimingCache.load(built_cache)
    entry = next(e for e in cache.entries() if len(e.candidates) > 1)
    other = next(c for c in entry.candidates if c.tactic != entry.tactic)
    runs = [
        ("show", built_cache),
        ("pin", built_cache, "--layer", f"{entry.layer}={other.tactic}", "-o", tmp_path / "pinned.json"),
        ("diff", built_cache, tmp_path / "pinned.json"),
        ("merge", tmp_path / "pinned.json", built_cache, "-o", tmp_path / "merged.json"),
    ]
    for argv in runs:
        rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "cache", *argv)
        assert rc == 0, (argv, err)
        assert "loaded: \n" in err, argv
    assert TimingCache.load(tmp_path / "merged.json").query(entry.key).tactic == other.tactic


def test_the_ci_merge_job_runs_without_torch(gate_only, built_cache, tmp_path):
    """.github/scripts/merge-shards.sh as the merge job runs it: the shards' artifacts in, one run
    and the merged caches out, then the gate on that run; harness without torch throughout."""
    shards = [make_doc([case([1000 + i % 7 for i in range(200)], mode=mode)]) for mode in ("fp16", "bf16")]
    for i, doc in enumerate(shards, start=1):
        artifact = tmp_path / "shards" / f"shard-{i}"
        (artifact / "caches").mkdir(parents=True)
        write_results(artifact / f"run-2025010{i}T000000Z-shard{i}of2.json", doc)
        (artifact / "caches" / "lenet.json").write_bytes(built_cache.read_bytes())
    wrapper = tmp_path / "harness"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S -c "$BOOT" {gate_only} {ROOT} '
                       f'{",".join(sorted(EXTRAS | TORCH))} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GITHUB_ENV")},
           "HARNESS": str(wrapper), "BOOT": _BOOT, "GITHUB_ENV": str(tmp_path / "github.env")}  # fmt: skip
    script = ROOT / ".github" / "scripts" / "merge-shards.sh"
    proc = subprocess.run(["bash", str(script), "shards", "2", "results"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("loaded: \n") == 2  # merge, and the cache merge of the second shard's copy
    exported = dict(line.split("=", 1) for line in (tmp_path / "github.env").read_text().splitlines())
    assert exported["HARNESS_MACHINE_ID"] == "box"
    merged = tmp_path / exported["HARNESS_MERGED_RUN"]
    assert sorted(c["mode"] for c in json.loads(merged.read_text())["cases"]) == ["bf16", "fp16"]
    assert (tmp_path / "results" / "box" / "caches" / "lenet.json").read_bytes() == built_cache.read_bytes()
    write_results(tmp_path / "results" / "box" / "baseline.json", make_doc([case([1000 + i % 7 for i in range(200)])]))
    rc, out, err = _harness(gate_only, EXTRAS | TORCH, tmp_path, "gate", "--baseline",
                            tmp_path / "results" / "box" / "baseline.json", "--current", merged)  # fmt: skip
    assert rc == 0, err
    assert "gate PASS" in out and "loaded: \n" in err
    # a shard lost: the job fails naming it, before anything is merged
    (tmp_path / "shards" / "shard-2" / "run-20250102T000000Z-shard2of2.json").unlink()
    proc = subprocess.run(["bash", str(script), "shards", "2", "results2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 1 and "1 of 2 shard results found" in proc.stderr
    assert not (tmp_path / "results2").exists()
