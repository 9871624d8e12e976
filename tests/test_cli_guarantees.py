"""Guarantees a user meets through the command line, each checked where they meet it.

One test per promise: a build told to fail on a cache miss fails; a pinned
tactic is what a rebuild and a build from ``cache pin``'s output run; a write
interrupted by Ctrl-C or refused half-way by the system leaves the file as it
was and no temporary file; NaN outputs are never "ok"; AMP keeps a dtype the
source gave an op.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.autocast import compile
from harness.bench.results import load_results
from harness.cache.timing_cache import TimingCache
from harness.cli.main import main
from tests.helpers import assert_same_outputs

MODEL_FILE = """
import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    return module, (torch.randn(8, 128),)


class Cancels(nn.Module):
    # y*y - y*y: 0 in fp32; inf - inf = NaN once y*y overflows a 16-bit float
    def forward(self, x):
        y = x * 300.0
        return y * y - y * y


def cancels():
    return Cancels().eval(), (torch.full((4, 8), 1000.0),)
"""
FAST = ("--option", "timing_runs=2", "--option", "warmup_runs=1")
MODE = "weak-bf16"  # every linear layer races fp32 and bf16 tactics: candidates to pin


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "models.py"
    path.write_text(MODEL_FILE)
    return path


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def cache(model_file, tmp_path_factory) -> Path:
    """A timing cache a build of ``tiny`` in :data:`MODE` wrote (every candidate timed)."""
    root = tmp_path_factory.mktemp("built")
    code = main(["build", "--model", f"{model_file}:tiny", "--mode", MODE, "--cache", str(root / "c.json"),
                 "-o", str(root / "e"), *FAST])  # fmt: skip
    assert code == 0
    return root / "c.json"


def engine_tactics(capsys, engine: Path) -> dict[str, str]:
    code, out, err = run(capsys, "inspect", engine, "--json")
    assert code == 0, err
    return {layer["name"]: layer["tactic"] for layer in json.loads(out)["layers"]}


def test_a_build_told_to_fail_on_a_cache_miss_fails_and_writes_nothing(capsys, model_file, tmp_path, cache):
    partial = TimingCache.load(cache)
    missing = partial.entries()[-1]
    partial.remove(missing.key)
    partial.save(tmp_path / "partial.json")
    before = (tmp_path / "partial.json").read_bytes()
    for command, path in (("build", tmp_path / "absent.json"), ("build", tmp_path / "partial.json"),
                          ("rebuild", tmp_path / "partial.json")):  # fmt: skip
        out_flags = ("-o", tmp_path / "e") if command == "build" else ("--times", "2")
        code, _, err = run(capsys, command, "--model", f"{model_file}:tiny", "--mode", MODE,
                           "--cache", path, "--error-on-cache-miss", *out_flags, *FAST)  # fmt: skip
        assert code == 2, (command, err)
        assert "is not in the timing cache" in err and "fail on a cache miss" in err, command
        assert not (tmp_path / "e").exists() and not (tmp_path / "absent.json").exists()
        assert (tmp_path / "partial.json").read_bytes() == before
    assert f"layer {missing.layer!r}" in err
    # the full cache misses nothing: the same flags build
    code, _, err = run(capsys, "build", "--model", f"{model_file}:tiny", "--mode", MODE, "--cache", cache,
                       "--error-on-cache-miss", "-o", tmp_path / "e", *FAST)  # fmt: skip
    assert code == 0, err


def slowest_candidate(cache: Path) -> tuple[str, str]:
    """The layer with the most to lose and its slowest recorded tactic (never the one chosen)."""
    entries = [e for e in TimingCache.load(cache).entries() if len(e.candidates) > 1]
    entry = max(entries, key=lambda e: max(c.time_ms for c in e.candidates) - e.time_ms)
    slowest = max(entry.candidates, key=lambda c: c.time_ms)
    assert slowest.tactic != entry.tactic
    return entry.layer, slowest.tactic


def test_a_pinned_tactic_is_what_a_rebuild_and_a_build_from_cache_pin_run(capsys, model_file, tmp_path, cache):
    layer, tactic = slowest_candidate(cache)
    pinned = tmp_path / "pinned.json"
    code, _, err = run(capsys, "cache", "pin", cache, "--layer", f"{layer}={tactic}", "-o", pinned)
    assert code == 0, err
    assert TimingCache.load(pinned).by_layer(layer)[0].tactic == tactic
    model = ("--model", f"{model_file}:tiny", "--mode", MODE, "--cache", pinned, "--error-on-cache-miss", *FAST)
    code, _, err = run(capsys, "build", *model, "-o", tmp_path / "e")
    assert code == 0, err
    assert engine_tactics(capsys, tmp_path / "e")[layer] == tactic
    code, out, err = run(capsys, "rebuild", *model, "--times", "2", "--json")
    assert code == 0, err
    code, built, _ = run(capsys, "inspect", tmp_path / "e", "--json")
    assert json.loads(out)["distinct_fingerprints"] == [json.loads(built)["fingerprint"]]


@pytest.fixture
def pin_args(cache, tmp_path) -> tuple[Path, list[str]]:
    """A copy of the cache and the ``cache pin`` that replaces it in place."""
    copy = tmp_path / "c.json"
    copy.write_bytes(cache.read_bytes())
    layer, tactic = slowest_candidate(copy)
    return copy, ["cache", "pin", str(copy), "--layer", f"{layer}={tactic}"]


def litter(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_ctrl_c_during_a_write_leaves_the_file_and_no_temporary(capsys, monkeypatch, pin_args):
    path, argv = pin_args
    before = path.read_bytes()

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    code, _, _ = run(capsys, *argv)
    assert code == 130
    assert path.read_bytes() == before and litter(path.parent) == []


def test_a_write_the_system_stops_half_way_leaves_the_file_as_it_was(pin_args):
    """A file-size limit below the new cache's size: the system refuses the write part-way (EFBIG),
    as a full disk does. The old cache stays whole, and nothing else is left."""
    path, argv = pin_args
    before = path.read_bytes()
    limit = len(before) // 2

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True,
                          preexec_fn=limited, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write {path}" in proc.stderr
    assert path.read_bytes() == before and litter(path.parent) == []


def test_nan_outputs_are_never_ok(capsys, model_file, tmp_path):
    out = tmp_path / "run.json"
    code, table, _ = run(capsys, "bench", "--quick", "--no-progress", "--no-plots", "--models", f"{model_file}:cancels",
                         "--modes", "fp32,fp16", "--cache-dir", tmp_path / "caches", "-o", out)  # fmt: skip
    cases = {c["mode"]: c for c in load_results(out)["cases"]}
    assert cases["fp32"]["status"] == "ok"
    low = cases["fp16"]
    assert low["accuracy"]["nan_count"] > 0 and low["accuracy"]["inf_count"] == 0  # NaN alone, no Inf
    assert low["status"] == "non-finite"
    assert "non-finite" in table


class GivenDtype(torch.nn.Module):
    """Ops whose ``dtype=`` argument CUDA autocast honours (``fp32_set_opt_dtype``): given, the op runs
    in it; not given, the op runs in fp32. ``dtype`` None gives none."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 16)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)  # low under autocast
        given = {} if self.dtype is None else {"dtype": self.dtype}
        return (
            torch.softmax(h, -1, **given),
            torch.log_softmax(h, -1, **given),
            torch.cumsum(h, -1, **given),
            torch.sum(h, -1, **given),
        )


def by_hand(module: GivenDtype, x: torch.Tensor, low: torch.dtype) -> tuple[torch.Tensor, ...]:
    """What CUDA autocast computes: the linear in ``low``, then each op in its given dtype, else fp32."""
    h = torch.nn.functional.linear(x.to(low), module.lin.weight.to(low), module.lin.bias.to(low))
    run = h if module.dtype is not None else h.float()
    kwargs = {} if module.dtype is None else {"dtype": module.dtype}
    return (torch.softmax(run, -1, **kwargs), torch.log_softmax(run, -1, **kwargs),
            torch.cumsum(run, -1, **kwargs), torch.sum(run, -1, **kwargs))  # fmt: skip


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_keeps_a_dtype_the_source_gave(dtype, given):
    """The CUDA policy (what a TensorRT build of an ``amp-*`` mode compiles), on this machine's CPU."""
    module, x = GivenDtype(dtype if given else None).eval(), torch.randn(4, 16)
    cg = compile(module, (x,), policy="amp", low_precision_type=dtype, device="cuda")
    with torch.inference_mode():
        out, ref = cg(x), by_hand(module, x, dtype)
    assert all(r.dtype == (dtype if given else torch.float32) for r in ref)
    assert_same_outputs(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_keeps_a_dtype_the_source_gave_as_eager_cuda_autocast_does(dtype, given):
    if not torch.cuda.is_available():
        if os.environ.get("HARNESS_REQUIRE_GPU"):  # GPU runners (gpu.yml): a missing GPU fails
            pytest.fail("HARNESS_REQUIRE_GPU is set, but torch sees no CUDA GPU")
        pytest.skip("needs a CUDA GPU: eager CUDA autocast is the reference")
    module, x = GivenDtype(dtype if given else None).eval().cuda(), torch.randn(4, 16, device="cuda")
    cg = compile(module, (x,), policy="amp", low_precision_type=dtype, device="cuda")
    with torch.autocast("cuda", dtype=dtype), torch.inference_mode():
        ref = module(x)
    assert_same_outputs(cg(x), ref)
