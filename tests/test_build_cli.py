"""``harness build``, ``harness rebuild`` and ``harness inspect`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cache.timing_cache import TimingCache
from harness.cli.main import main
from harness.engines.cpu import CpuEngine

MODEL_FILE = """
import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    return module, (torch.randn(8, 128),)
"""
FAST = ["--option", "timing_runs=2", "--option", "warmup_runs=1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny.py"
    path.write_text(MODEL_FILE)
    return f"{path}:tiny"


@pytest.fixture(scope="module")
def built(model, tmp_path_factory) -> tuple[Path, Path]:
    """An engine and the cache its build wrote."""
    root = tmp_path_factory.mktemp("built")
    code = main(
        [
            "build",
            "--model",
            model,
            "--mode",
            "fp32",
            "--cache",
            str(root / "c.json"),
            "-o",
            str(root / "e"),
            *FAST,
        ]
    )
    assert code == 0
    return root / "e", root / "c.json"


def test_build_prints_summary_and_writes_engine_log_and_cache(model, tmp_path, capsys):
    code = main(
        [
            "build",
            "--model",
            model,
            "--mode",
            "weak-bf16",
            "--cache",
            str(tmp_path / "c.json"),
            "-o",
            str(tmp_path / "e"),
            *FAST,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "layers: " in out and "cache hits: 0" in out
    engine = CpuEngine.load(tmp_path / "e")
    assert f"fingerprint: {engine.fingerprint()}" in out
    assert f"engine: {tmp_path / 'e'}" in out
    assert engine.mode == "weak-bf16"
    log = json.loads((tmp_path / "e" / "build_log.json").read_text())
    assert len(TimingCache.load(tmp_path / "c.json")) == sum(
        1 for layer in log["layers"] if layer["candidates"]
    )


def test_warm_build_with_error_on_miss_hits_every_layer_and_leaves_cache_alone(
    model, built, tmp_path, capsys
):
    engine_dir, cache = built
    before = cache.read_bytes()
    code = main(
        [
            "build",
            "--model",
            model,
            "--mode",
            "fp32",
            "--cache",
            str(cache),
            "--error-on-cache-miss",
            "-o",
            str(tmp_path / "e2"),
            *FAST,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "misses (timed): 0" in out and f"cache: {cache} (unchanged)" in out
    assert cache.read_bytes() == before
    assert CpuEngine.load(tmp_path / "e2").fingerprint() == CpuEngine.load(engine_dir).fingerprint()


def test_rebuild_json_report_with_pinned_cache(model, built, capsys):
    _, cache = built
    code = main(
        [
            "rebuild",
            "--model",
            model,
            "--mode",
            "fp32",
            "--times",
            "3",
            "--cache",
            str(cache),
            "--error-on-cache-miss",
            "--json",
            *FAST,
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["builds"] == 3 and len(report["distinct_fingerprints"]) == 1
    assert report["flipped_layers"] == {} and report["outputs_identical"] is True


def test_rebuild_text_report(model, capsys):
    code = main(["rebuild", "--model", model, "--mode", "fp32", "--times", "2", *FAST])
    out = capsys.readouterr().out
    assert code == 0
    assert "without a cache (every build timed afresh)" in out
    assert "distinct fingerprints:" in out and "layers whose tactic flipped:" in out


def test_inspect_lists_layers(built, capsys):
    engine_dir, _ = built
    assert main(["inspect", str(engine_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    engine = CpuEngine.load(engine_dir)
    assert info["fingerprint"] == engine.fingerprint()
    assert [layer["name"] for layer in info["layers"]] == [layer.name for layer in engine.layers()]
    assert info["weight_bytes_by_dtype"] == {"fp32": 4 * (128 * 64 + 64 + 64 * 8 + 8)}


def _copy(engine_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    target.mkdir()
    for f in engine_dir.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


@pytest.mark.parametrize("damage", ["truncate-plan", "tamper-plan", "version", "truncate-weights"])
def test_damaged_engines_exit_2_and_stay_untouched(built, tmp_path, capsys, damage):
    engine = _copy(built[0], tmp_path)
    plan_path, weights_path = engine / "plan.json", engine / "weights.safetensors"
    if damage == "truncate-plan":
        plan_path.write_bytes(plan_path.read_bytes()[:100])
    elif damage == "truncate-weights":
        weights_path.write_bytes(weights_path.read_bytes()[:-10])
    else:
        plan = json.loads(plan_path.read_text())
        if damage == "version":
            plan["version"] = 99
        else:
            plan["nodes"][0]["outputs"][0]["dtype"] = "fp16"
        plan_path.write_text(json.dumps(plan))
    before = {f.name: f.read_bytes() for f in engine.iterdir()}
    # Both commands that read a saved engine refuse it the same way.
    for argv in (["inspect", str(engine)], ["cache", "verify", str(built[1]), "--engine", str(engine)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: engine {'plan' if 'plan' in damage or damage == 'version' else 'weights'} ")
        assert err.count("\n") == 1
    assert {f.name: f.read_bytes() for f in engine.iterdir()} == before


def test_cache_verify_checks_the_engine_against_its_cache_and_a_repinned_one(built, tmp_path, capsys):
    engine_dir, cache_path = built
    cache = TimingCache.load(cache_path)
    tuned = [layer for layer in CpuEngine.load(engine_dir).layers() if layer.key]
    assert sorted(layer.key for layer in tuned) == sorted(cache.query_keys())
    assert main(["cache", "verify", str(cache_path), "--engine", str(engine_dir)]) == 0
    assert f"agrees with {cache_path} ({len(tuned)} layers checked)" in capsys.readouterr().out

    entry = cache.entries()[0]
    other = next(c for c in entry.candidates if c.tactic != entry.tactic)
    repinned = tmp_path / "repinned.json"
    args = ["cache", "pin", str(cache_path), "--layer", f"{entry.layer}={other.tactic}", "-o", str(repinned)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["cache", "verify", str(repinned), "--engine", str(engine_dir / "plan.json")]) == 1
    out = capsys.readouterr().out
    assert f"disagrees with {repinned} on 1 of {len(tuned)} layers" in out
    assert f"layer {entry.layer!r} (key {entry.key}): engine uses {entry.tactic!r}, cache selects {other.tactic!r}" in out


def test_bad_cache_files_exit_2_and_stay_untouched(model, built, tmp_path, capsys):
    _, cache = built
    obj = json.loads(cache.read_text())
    obj["provenance"]["device"] = "another CPU"
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(obj))  # digest now wrong: tampered
    truncated = tmp_path / "truncated.json"
    truncated.write_text(cache.read_text()[:50])
    for path, message in ((foreign, "digest mismatch"), (truncated, "not valid JSON")):
        before = path.read_bytes()
        code = main(
            [
                "build",
                "--model",
                model,
                "--mode",
                "fp32",
                "--cache",
                str(path),
                "-o",
                str(tmp_path / "e"),
                *FAST,
            ]
        )
        assert code == 2
        assert message in capsys.readouterr().err
        assert path.read_bytes() == before
    assert not (tmp_path / "e").exists()
    refit = TimingCache.load(cache)
    moved = TimingCache(
        type(refit.provenance)(**{**refit.provenance.__dict__, "device": "another CPU"}),
        refit.entries(),
    )
    moved.save(foreign)
    before = foreign.read_bytes()
    code = main(
        [
            "build",
            "--model",
            model,
            "--mode",
            "fp32",
            "--cache",
            str(foreign),
            "-o",
            str(tmp_path / "e"),
            *FAST,
        ]
    )
    assert code == 2 and "device: another CPU" in capsys.readouterr().err
    assert foreign.read_bytes() == before and not (tmp_path / "e").exists()


def test_bad_flags_exit_2(model, tmp_path, capsys):
    assert (
        main(
            [
                "build",
                "--model",
                model,
                "--mode",
                "fp32",
                "-o",
                str(tmp_path / "e"),
                "--option",
                "nonsense",
            ]
        )
        == 2
    )
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert main(["build", "--model", model, "--mode", "explicit", "-o", str(tmp_path / "e")]) == 2
    assert "needs an explicit precision file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["build", "--model", model, "--mode", "int4", "-o", str(tmp_path / "e")])
    assert exc.value.code == 2
    assert not (tmp_path / "e").exists()


def test_engine_from_cli_runs_like_the_model(model, built):
    from harness.models import load

    spec = load(model)
    engine = CpuEngine.load(built[0])
    with torch.inference_mode():
        torch.testing.assert_close(
            engine(*spec.example_inputs), spec.module(*spec.example_inputs), rtol=1e-5, atol=1e-6
        )


def test_inspect_finds_the_backend_and_verify_refuses_another_backends_cache(model, built, tmp_path, capsys):
    engine_dir = tmp_path / "ort"
    assert main(["build", "--model", model, "--mode", "fp32", "--backend", "onnxruntime", "-o", str(engine_dir)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(engine_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "onnxruntime"
    assert main(["inspect", str(engine_dir), "--backend", "cpu"]) == 2
    assert "saved by backend onnxruntime: use --backend onnxruntime" in capsys.readouterr().err
    assert main(["cache", "verify", str(built[1]), "--engine", str(engine_dir)]) == 2
    assert "built by backend onnxruntime, but" in capsys.readouterr().err


def test_verify_of_a_missing_engine_never_checks_the_parent_directory(capsys, tmp_path):
    """Once, ``--engine DIR/does-not-exist`` verified DIR's engine and said it agreed."""
    engine, cache = tmp_path / "engine", tmp_path / "c.json"
    assert main(["build", "--model", "digits", "--mode", "fp32", "--cache", str(cache),
                 "-o", str(engine), "--option", "timing_runs=1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["cache", "verify", str(cache), "--engine", str(engine / "does-not-exist")]) == 2
    out, err = capsys.readouterr()
    assert "agrees" not in out and f"{engine / 'does-not-exist'}: no such engine directory" in err
    assert main(["inspect", str(tmp_path / "nonexistent")]) == 2
    assert f"engine {tmp_path / 'nonexistent'}: no such engine directory" in capsys.readouterr().err
