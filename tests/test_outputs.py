"""Output structure: every stage returns what the eager model returns, and saved engines keep it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from harness import models
from harness.autocast import compile
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.onnxruntime import OnnxRuntimeBackend
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.outputs import OutputSpec, tensor_paths
from tests.conformance.recreations import nested_outputs
from tests.helpers import assert_same_outputs


@pytest.fixture(scope="module")
def nested():
    return models._checked(nested_outputs(), "nested")


def test_compile_returns_the_eager_structure_and_run_the_flat_view(nested):
    compiled = compile(nested.module, nested.example_inputs, policy="fp32")
    with torch.inference_mode():
        eager = nested.module(*nested.example_inputs)
    assert_same_outputs(compiled(*nested.example_inputs), eager)
    flat = compiled.run(*nested.example_inputs)
    assert isinstance(flat, tuple) and len(flat) == compiled.outputs.count == 4
    assert compiled.outputs.paths() == ["['logits']", "['hidden'][0]", "['hidden'][1][0]", "['hidden'][1][1]"]


@pytest.mark.parametrize("backend", [CpuBackend(), OnnxRuntimeBackend()], ids=lambda b: b.name)
def test_engines_return_the_structure_before_and_after_saving(nested, backend, tmp_path):
    with torch.inference_mode():
        eager = nested.module(*nested.example_inputs)
    engine = build_engine(nested, BuildConfig(mode="fp32"), backend).engine
    out = engine(*nested.example_inputs)
    assert type(out) is dict
    assert [p for p, _ in tensor_paths(out)] == [p for p, _ in tensor_paths(eager)]
    engine.save(tmp_path / "engine")
    loaded = backend.load(tmp_path / "engine")
    assert_same_outputs(loaded(*nested.example_inputs), out)


def test_a_saved_container_type_this_process_never_registered_loads_as_a_dict():
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=torch.zeros(1))
    spec = OutputSpec(torch.utils._pytree.tree_flatten(out)[1])
    saved = json.loads(spec.to_json())
    saved[1]["type"] = "some_package_never_imported.Output"
    loaded = OutputSpec.from_json(json.dumps(saved), "plan.json")
    value = loaded.unflatten([torch.ones(1)])
    assert type(value) is dict and list(value) == ["last_hidden_state"]
    assert loaded.paths() == spec.paths() == ["['last_hidden_state']"]


@pytest.mark.parametrize("text", ["[1, 2", "[1, {\"type\": 3}]", "{}", "[1, {\"type\": \"x.Y\", \"context\": \"3\", \"children_spec\": []}]"])
def test_a_damaged_output_structure_is_refused_naming_the_file(text):
    with pytest.raises(HarnessError, match=r"^plan\.json: invalid output structure"):
        OutputSpec.from_json(text, "plan.json")


def test_the_plan_of_a_cpu_engine_records_its_structure(nested, tmp_path):
    engine = build_engine(nested, BuildConfig(mode="fp32"), CpuBackend()).engine
    engine.save(tmp_path / "e")
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    assert OutputSpec.from_json(plan["output_structure"], "p").paths() == engine.outputs.paths()


class Single(nn.Module):
    def forward(self, x):
        return x * 2


def test_a_single_tensor_model_gets_a_tensor_back():
    compiled = compile(Single(), (torch.ones(3),), policy="fp32")
    assert isinstance(compiled(torch.ones(3)), torch.Tensor)
