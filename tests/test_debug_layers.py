"""``harness debug layers``: per-layer error attribution against real references.

The subject is a small MLP with one planted layer (``head``): in fp16 its
outputs overflow (weights x3e5, outputs ~1e5 > 65504), in bf16 they carry a
large offset (bias +1000) that bf16 rounds in steps of 4. Every other layer
is harmless. References are eager fp32, eager ``torch.autocast`` and layers
recomputed by hand from eager fp32 intermediates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from harness import models
from harness.autocast import compile
from harness.cli.main import main
from harness.debug.inputs import model_batches
from harness.debug.layers import debug_layers
from harness.engines.cpu import CpuBackend
from harness.engines.onnxruntime.backend import OnnxRuntimeBackend
from harness.errors import HarnessError
from tests.helpers import exit_code

MODEL_FILE = '''
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(self.fc2(h) + h)
        return self.head(h)


def _spec(name, module):
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=generator),) for _ in range(4)]
    return ModelSpec(name, "planted-layer MLP", module.eval(), batches[0], batches[1:], batch_dim=0)


def harmless():
    return _spec("harmless", Planted())


def planted_fp16():
    """head's outputs reach ~1e5: past fp16's 65504, while its weights (<= 3.75e4) still fit."""
    module = Planted()
    with torch.no_grad():
        module.head.weight.mul_(3.0e5)
    return _spec("planted_fp16", module)


def planted_bf16():
    """head's outputs sit near 1000, where bf16 steps by 4: an absolute error of up to 2."""
    module = Planted()
    with torch.no_grad():
        module.head.bias.add_(1000.0)
    return _spec("planted_bf16", module)


def planted_fp16_labelled():
    """planted_fp16 with labelled data: fp32's own predictions on 64 held-out rows."""
    spec = planted_fp16()
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = spec.module(data).argmax(-1)

    def evaluate(run):
        hits = sum(int((run(rows).argmax(-1) == want).sum()) for rows, want in zip(data.split(16), labels.split(16)))
        return hits / len(labels)

    return dataclasses.replace(spec, evaluate=evaluate)


class ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)).mean(dim=(2, 3))


def folded():
    """conv + batch norm: compiled graphs fold the pair, which moves the last bits of fp32 itself."""
    module = ConvBn()
    with torch.no_grad():
        module.bn.running_mean.uniform_(-1, 1)
        module.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    return ModelSpec("folded", "conv + bn", module.eval(), (x,), [(x * 0.5,)])
'''
HEAD = "linear_2"  # the node of ``head`` (the third linear of the graph)


@pytest.fixture(scope="session")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("debug-model") / "planted.py"
    path.write_text(MODEL_FILE)
    return path


def load(model_file: Path, factory: str):
    return models.load(f"{model_file}:{factory}")


def _head_input(spec, batch):
    """The eager fp32 value entering ``head`` (a forward hook on the module)."""
    seen = []
    hook = spec.module.head.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        with torch.inference_mode():
            spec.module(*batch)
    finally:
        hook.remove()
    return seen[0]


def test_planted_fp16_overflow_ranks_first_and_alone(model_file):
    spec = load(model_file, "planted_fp16")
    report = debug_layers(spec, "fp16", model_batches(spec), backend=CpuBackend())
    ranked = report.ranked()
    assert ranked[0].name == HEAD and ranked[0].module == "head"
    assert ranked[0].introduced.nonfinite > 0 and ranked[0].impact.nonfinite > 0
    assert [layer.introduced.nonfinite for layer in ranked[1:]] == [0] * (len(ranked) - 1)
    assert [layer.impact.nonfinite for layer in ranked[1:]] == [0] * (len(ranked) - 1)
    # The engine built on the backend overflows as the typed graph does.
    assert report.outputs.nonfinite > 0 and report.engine_outputs is not None and report.engine_outputs.nonfinite > 0
    # Every layer but head, in fp16, stays within fp16 rounding.
    assert max(layer.introduced.value("1-cosine") for layer in ranked[1:]) < 1e-6


def test_planted_bf16_accuracy_loss_ranks_first_by_absolute_error(model_file):
    spec = load(model_file, "planted_bf16")
    report = debug_layers(spec, "bf16", model_batches(spec), rank_by="max-abs-err")
    ranked = report.ranked()
    assert ranked[0].name == HEAD
    assert ranked[0].introduced.value("max-abs-err") > 0.5 > 10 * ranked[1].introduced.value("max-abs-err")


def test_rank_on_impact_orders_by_each_layers_effect_on_the_outputs(model_file):
    spec = load(model_file, "planted_bf16")
    report = debug_layers(spec, "bf16", model_batches(spec)[:2], rank_by="max-abs-err", rank_on="impact")
    values = [layer.impact.value("max-abs-err") for layer in report.ranked()]
    assert values == sorted(values, reverse=True) and report.ranked()[0].name == HEAD
    with pytest.raises(HarnessError, match="--rank-on 'output'"):
        debug_layers(spec, "bf16", model_batches(spec)[:1], rank_on="output")


def test_introduced_error_is_the_layer_alone_on_fp32_inputs_cast_to_its_precision(model_file):
    """head's introduced error recomputed by hand: eager fp32 input and weights cast to bf16."""
    spec = load(model_file, "planted_bf16")
    batches = model_batches(spec)
    report = debug_layers(spec, "bf16", batches)
    head = next(layer for layer in report.layers if layer.name == HEAD)
    w, b = spec.module.head.weight, spec.module.head.bias
    worst = 0.0
    with torch.inference_mode():
        for batch in batches:
            h = _head_input(spec, batch)
            alone = F.linear(h.bfloat16(), w.bfloat16(), b.bfloat16())
            worst = max(worst, float((alone.double() - F.linear(h, w, b).double()).abs().max()))
    assert head.introduced.max_abs == pytest.approx(worst, rel=1e-6)
    # head is the output layer: running it alone in bf16 is all its impact on the outputs.
    assert head.impact.max_abs == pytest.approx(worst, rel=1e-6)


def test_accumulated_and_impact_agree_with_the_compiled_graphs(model_file):
    """Accumulated error of the last layer is the model's; impact of fc1 is fc1-alone-in-bf16's."""
    spec = load(model_file, "harmless")
    batches = model_batches(spec)
    report = debug_layers(spec, "bf16", batches)
    by_name = {layer.name: layer for layer in report.layers}
    fc1_only = compile(spec.module, spec.example_inputs, policy="explicit", explicit={"^linear$": "bf16", ".*": "fp32"})
    full = compile(spec.module, spec.example_inputs, policy="full", low_precision_type="bf16")
    with torch.inference_mode():
        eager = [spec.module(*batch) for batch in batches]
        impact = max(float((fc1_only(*x) - e).abs().max()) for x, e in zip(batches, eager))
        accumulated = max(float((full(*x) - e).abs().max()) for x, e in zip(batches, eager))
    assert by_name["linear"].impact.max_abs == pytest.approx(impact, rel=1e-6)
    assert by_name[HEAD].accumulated.max_abs == pytest.approx(accumulated, rel=1e-6)
    assert report.outputs.max_abs == pytest.approx(accumulated, rel=1e-6)
    # Each layer's accumulated error includes everything upstream: never below what it introduced alone at depth 1.
    assert by_name["linear"].accumulated.max_abs == pytest.approx(by_name["linear"].introduced.max_abs)


def test_cpu_engine_exposes_its_own_intermediates(model_file):
    spec = load(model_file, "planted_bf16")
    report = debug_layers(spec, "bf16", model_batches(spec), backend=CpuBackend())
    by_name = {layer.name: layer for layer in report.layers}
    # head is the output layer: its value inside the engine is what the engine returns.
    head = by_name[HEAD].engine
    assert head is not None and report.engine_outputs is not None
    assert head.max_abs == pytest.approx(report.engine_outputs.max_abs, rel=1e-6)
    # The engine fuses fc1's gelu into fc1: the fused layer's value is gelu's, fc1 alone is not exposed.
    assert by_name["gelu"].engine is not None and by_name["linear"].engine is None


def test_amp_mode_output_error_is_eager_autocast_error(model_file):
    """amp-bf16's typed graph is eager torch.autocast: its output error is eager autocast's."""
    spec = load(model_file, "harmless")
    batches = model_batches(spec)
    report = debug_layers(spec, "amp-bf16", batches, backend=CpuBackend())
    with torch.inference_mode():
        worst = 0.0
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = spec.module(*batch)
            worst = max(worst, float((low.double() - spec.module(*batch).double()).abs().max()))
    assert report.outputs.max_abs == pytest.approx(worst, rel=1e-6)
    # AMP keeps layer_norm's output fp32 on CPU only through its inputs' dtype: it is reported with one.
    assert {layer.precision for layer in report.layers} <= {"bf16", "fp32"}


def test_onnxruntime_fp16_attributes_and_refuses_bf16(model_file):
    spec = load(model_file, "planted_fp16")
    report = debug_layers(spec, "fp16", model_batches(spec)[:2], backend=OnnxRuntimeBackend())
    assert report.ranked()[0].name == HEAD and report.backend == "onnxruntime"
    assert report.engine_outputs is not None
    assert all(layer.engine is None for layer in report.layers)  # ONNX Runtime hands out outputs only


def test_cli_json_and_plot(model_file, tmp_path, capsys):
    plot = tmp_path / "depth.png"
    code = main(["debug", "layers", "--model", f"{model_file}:planted_fp16", "--mode", "fp16",
                 "--json", "--plot", str(plot)])  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranked"][0] == HEAD and doc["plot"] == str(plot)
    first = next(layer for layer in doc["layers"] if layer["name"] == HEAD)
    assert first["introduced"]["nonfinite"] > 0 and first["module"] == "head"
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_cli_table_names_the_planted_layer_first(model_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["debug", "layers", "--model", f"{model_file}:planted_bf16", "--mode", "bf16",
                 "--rank-by", "max-abs-err", "--top", "3"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert rows and rows[0][1] == HEAD
    assert "3 more layers" in out
    assert (tmp_path / "planted_bf16-bf16-layers.png").is_file()


def test_cli_inputs_file(model_file, tmp_path, capsys):
    batches = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(5))
    save_file({"input0": batches}, tmp_path / "in.safetensors")
    code = main(["debug", "layers", "--model", f"{model_file}:planted_fp16", "--mode", "fp16", "--json",
                 "--no-plot", "--inputs", str(tmp_path / "in.safetensors")])  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["batches"] == 2 and doc["ranked"][0] == HEAD


def test_explicit_plan_is_debugged_as_written(model_file, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({f"^{HEAD}$": "fp32", ".*": "fp16"}))
    code = main(["debug", "layers", "--model", f"{model_file}:planted_fp16", "--mode", "explicit",
                 "--explicit", str(plan), "--json", "--no-plot"])  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    precisions = {layer["name"]: layer["precision"] for layer in doc["layers"]}
    assert precisions[HEAD] == "fp32" and set(precisions.values()) == {"fp16", "fp32"}
    assert doc["outputs"]["nonfinite"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "weak-bf16"], "weak modes the builder picks"),
        (["--mode", "bf16", "--backend", "onnxruntime"], "no bf16 kernels"),
        (["--mode", "bf16", "--backend", "tensorrt"], "TensorRT backend needs the `tensorrt` Python package"),
        (["--mode", "fp16", "--explicit", "plan.json"], "use --mode explicit"),
        (["--mode", "explicit"], "needs an explicit precision file (--explicit FILE)"),
        (["--mode", "fp16", "--inputs", "missing.safetensors"], "missing.safetensors: no such file"),
        (["--mode", "fp16", "--top", "0"], "argument --top: 0 is out of range"),
        (["--mode", "fp16", "--threads", "0"], "argument --threads: 0 is out of range"),
    ],
)
def test_bad_input_is_one_clear_error(model_file, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({".*": "fp32"}))
    code = exit_code(["debug", "layers", "--model", f"{model_file}:planted_fp16", "--no-plot", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_inputs_of_the_wrong_shape_are_named(model_file, tmp_path, capsys):
    save_file({"input0": torch.zeros(2, 16, 31)}, tmp_path / "bad.safetensors")
    code = main(["debug", "layers", "--model", f"{model_file}:planted_fp16", "--mode", "fp16", "--no-plot",
                 "--inputs", str(tmp_path / "bad.safetensors")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.safetensors: batch 0, input 0: got float32[16, 31], expected float32[16, 32]" in err


DECOY = """
from harness.models import ModelSpec
import torch
from torch import nn


def harmless():
    x = torch.ones(16, 32)
    return ModelSpec("decoy", "the project directory's file", nn.Linear(32, 8).eval(), (x,), [(x,)])
"""


def test_a_model_file_on_the_command_line_is_relative_to_the_current_directory_as_for_build(
    model_file, tmp_path, capsys, monkeypatch
):
    """``--model file.py:f`` names the file in the current directory for every command, debug included;
    only references written in the project file are relative to its directory."""
    here, project = tmp_path / "here", tmp_path / "project"
    here.mkdir()
    project.mkdir()
    (here / "planted.py").write_text(model_file.read_text())
    (project / "planted.py").write_text(DECOY)  # same relative path, seen from the project's directory
    (project / "harness.toml").write_text("threads = 1\n")
    monkeypatch.chdir(here)
    common = ["--model", "planted.py:harmless", "--config", str(project / "harness.toml")]
    assert main(["build", *common, "--mode", "fp32", "-o", "engine", "--option", "timing_runs=1"]) == 0
    assert capsys.readouterr().out.startswith("built harmless (fp32)")
    assert main(["debug", "layers", *common, "--mode", "bf16", "--json", "--no-plot", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "harmless"
    assert main(["debug", "precision", *common, "--low", "bf16", "--target", "max-abs-err<=1", "--json",
                 "--no-plot", "--seconds", "0.02", "--final-seconds", "0.1", "--no-progress"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["model"] == "harmless"
    # the project's [model."<key>"] tables are checked against it, as build checks them
    (project / "harness.toml").write_text('[model."typo.py:harmless"]\nautocast = { data_max = 8 }\n')
    assert main(["debug", "layers", *common, "--mode", "bf16", "--no-plot", "--no-progress"]) == 2
    assert '[model."typo.py:harmless"] matches no model' in capsys.readouterr().err
