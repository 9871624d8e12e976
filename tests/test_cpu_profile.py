"""The CPU engine's per-layer profile and ``harness inspect --profile``.

Only structure and invariants are asserted, never a time: a profile on a
loaded machine must pass as on an idle one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.build import compile_graph
from harness.cli.main import main
from harness.engines.cpu import CpuBackend, CpuEngine
from harness.engines.cpu.profile import PROFILE_SCHEMA, Profile
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.fileio import validate
from harness.models import ModelSpec
from tests.helpers import exit_code

FAST = {"timing_runs": 3, "warmup_runs": 1}


class Small(nn.Module):
    """A conv with a fused activation, a tuple-returning op (getitems are not layers), a GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        a, b = torch.chunk(y, 2, dim=1)
        return self.fc(torch.flatten(torch.cat([b, a], dim=1), 1))


@pytest.fixture(scope="module")
def engine() -> CpuEngine:
    torch.manual_seed(0)
    spec = ModelSpec("small", "profile workload", Small().eval(), (torch.randn(2, 3, 4, 4),), [])
    config = BuildConfig(mode="fp32", options=FAST)
    built, _ = CpuBackend().build(compile_graph(spec, config, CpuBackend()), config, None)
    # Without regions, whatever tactics the (uncached, timed) build chose: when timing picks
    # oneDNN Graph for the linear, flatten..linear would be one call and one profile entry
    # (tests/test_cpu_regions.py covers region entries).
    return CpuEngine(built.plan, regions=False)


@pytest.fixture(scope="module")
def profile(engine) -> Profile:
    return engine.profile(iterations=5, warmup=1, threads=1)


def test_every_layer_appears_once_with_its_tactic_and_precision(engine, profile):
    layers = engine.layers()
    assert [p.name for p in profile.layers] == [layer.name for layer in layers]
    assert [p.index for p in profile.layers] == list(range(len(layers)))
    for timed, layer in zip(profile.layers, layers, strict=True):
        assert timed.tactic == layer.tactic and timed.layer_type == layer.layer_type
        assert timed.precision == layer.tactic.rsplit("[", 1)[1].rstrip("]")
    conv = next(p for p in profile.layers if p.op.startswith("conv2d"))
    assert conv.op == "conv2d+relu" and conv.fused == ("relu",)


def test_times_are_positive_and_finite_and_the_layers_never_exceed_the_total(profile):
    assert all(p.time_ms > 0 and math.isfinite(p.time_ms) for p in profile.layers)
    assert profile.overhead_ms >= 0 and math.isfinite(profile.overhead_ms)
    assert 0 < profile.layers_ms <= profile.total_ms
    assert profile.run_ms > 0
    ranked = profile.ranked()
    assert [p.time_ms for p in ranked] == sorted((p.time_ms for p in profile.layers), reverse=True)


def test_json_follows_the_schema_slowest_first_with_shares(profile):
    obj = profile.to_json()
    validate(obj, PROFILE_SCHEMA, "profile")
    assert [layer["time_ms"] for layer in obj["layers"]] == sorted(
        (layer["time_ms"] for layer in obj["layers"]), reverse=True
    )
    assert sorted(layer["index"] for layer in obj["layers"]) == list(range(len(profile.layers)))
    assert sum(layer["share"] for layer in obj["layers"]) + obj["overhead_share"] == pytest.approx(1.0)
    assert obj["threads"] == 1 and obj["iterations"] == 5 and obj["warmup"] == 1


def test_profile_restores_the_thread_count_and_checks_its_arguments(engine):
    before = torch.get_num_threads()
    engine.profile(iterations=1, warmup=0, threads=1)
    assert torch.get_num_threads() == before
    with pytest.raises(HarnessError, match="profile iterations 0"):
        engine.profile(iterations=0)
    with pytest.raises(HarnessError, match="expected torch.float32 \\(2, 3, 4, 4\\)"):
        engine.profile([torch.zeros(1, 3, 4, 4)], iterations=1)


def test_profile_on_given_inputs_times_the_same_run(engine):
    x = torch.randn(2, 3, 4, 4)
    timed = engine.profile([x], iterations=2, warmup=0)
    assert len(timed.layers) == timed.layer_count == len(engine.layers())
    # Profiling computes nothing else: the engine's output is unchanged by it.
    with torch.inference_mode():
        assert torch.equal(engine(x), engine(x))


def test_synthetic_inputs_have_the_declared_shapes_and_valid_indices():
    module = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 2)).eval()
    ids = torch.randint(0, 7, (2, 3))
    spec = ModelSpec("ids", "integer inputs", module, (ids,), [])
    config = BuildConfig(mode="fp32", options=FAST)
    built, _ = CpuBackend().build(compile_graph(spec, config, CpuBackend()), config, None)
    (synthetic,) = built.synthetic_inputs()
    assert synthetic.shape == ids.shape and synthetic.dtype == ids.dtype
    # Region or not (the build's timing decides), the profile's calls run every layer once.
    assert built.profile(iterations=1, warmup=0).layer_count == len(built.layers())


# --- harness inspect --profile ----------------------------------------------------------------


@pytest.fixture(scope="module")
def lenet_engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "lenet"
    code = main(
        ["build", "--model", "lenet", "--mode", "fp32", "--disable-cache", "--threads", "1",
         "--option", "timing_runs=2", "--option", "warmup_runs=0", "-o", str(out)]
    )  # fmt: skip
    assert code == 0
    return out


def test_inspect_profile_prints_every_layer_and_the_totals(lenet_engine, capsys):
    capsys.readouterr()
    # --per-layer: a row per layer even where consecutive layers chose oneDNN Graph tactics.
    args = ["inspect", str(lenet_engine), "--profile", "--per-layer", "--iters", "3", "--warmup", "1", "--threads", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    names = [layer.name for layer in CpuEngine.load(lenet_engine).layers()]
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.startswith("  ") and line.split()[0] in names]
    assert sorted(rows) == sorted(names)
    for label in ("dispatch overhead", "total", "inputs: synthetic", "1 thread(s)"):
        assert label in out


def test_inspect_profile_json_on_the_models_inputs(lenet_engine, capsys):
    capsys.readouterr()
    args = ["inspect", str(lenet_engine), "--profile", "--json", "--model", "lenet", "--iters", "2", "--top", "1"]
    assert main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    validate(obj, PROFILE_SCHEMA, "inspect --profile --json")
    assert obj["inputs"] == "model lenet" and obj["engine"] == str(lenet_engine)
    # --top shortens text only; a region's entry stands for its layers.
    assert sum(len(e.get("region", [e])) for e in obj["layers"]) == len(CpuEngine.load(lenet_engine).layers())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top", "3"], "--top: applies only with --profile"),
        (["--iters", "3", "--threads", "1"], "--threads, --iters: apply only with --profile"),
        (["--profile", "--top", "0"], "argument --top: 0 is out of range"),
        (["--profile", "--iters", "0"], "argument --iters: 0 is out of range"),
        (["--profile", "--model", "resnet"], "expected torch.float32 \\(8, 1, 28, 28\\)"),
    ],
)
def test_inspect_profile_refuses_what_it_cannot_do(lenet_engine, capsys, extra, message):
    code = exit_code(["inspect", str(lenet_engine), *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_inspect_profile_refuses_engines_that_cannot_time_their_layers(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "ort"
    assert main(["build", "--model", "lenet", "--mode", "fp32", "--backend", "onnxruntime", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--profile"]) != 0
    assert "--profile needs a cpu engine; onnxruntime engines" in capsys.readouterr().err
