"""``debug layers`` ranks the layers to keep in fp32: checked by keeping them, on third-party transformers.

For BERT, GPT-2 and ViT from small configs (random weights, the zoo's
``hf-*`` entries), the graph with the top-k ranked layers in fp32 (each with
the views folded into it) is compiled and run: its outputs' error against
eager fp32 must be below the mean error of graphs keeping k layers drawn at
random, for k = 1, 3 and 5.
"""

from __future__ import annotations

import random

import pytest
import torch

from harness import models
from harness.autocast import compile
from harness.bench.accuracy import compare_outputs
from harness.debug.grouping import fold_data_movement, moves_data_only
from harness.debug.inputs import model_batches
from harness.debug.layers import LayerError, debug_layers
from harness.debug.plan import PrecisionPlan
from harness.frontend.export import export_program

pytest.importorskip("transformers")
DRAWS = 5


def _error(program, batches, eager, layers: list[LayerError], kept: list[LayerError]) -> float:
    """The worst error over ``batches`` of the bf16 plan that keeps ``kept`` in fp32, compiled from
    the model's export (``program``: one export serves every plan)."""
    plan = PrecisionPlan.keeping("bf16", [n for layer in layers for n in layer.nodes], [n for k in kept for n in k.nodes])
    compiled = compile(program, policy="explicit", explicit=plan.explicit())
    return max(compare_outputs(compiled(*b), e).max_abs_error for b, e in zip(batches, eager, strict=True))


@pytest.mark.slow  # 15-25 s per model: each draw compiles and runs the model
@pytest.mark.parametrize("name", ["hf-bert", "hf-gpt2", "hf-vit"])
def test_keeping_the_top_ranked_layers_beats_keeping_random_ones(name):
    spec = models.load(name)
    batches = model_batches(spec)[:2]
    with torch.no_grad():
        eager = [spec.module(*b) for b in batches]
    report = debug_layers(spec, "bf16", batches)
    ranked = report.ranked()
    assert report.rank_on == "removed" and report.removed(ranked[0], report.rank_by) > 0
    program = export_program(spec.module, spec.example_inputs)
    none = _error(program, batches, eager, report.layers, [])
    draw = random.Random(0)
    for k in (1, 3, 5):
        top = _error(program, batches, eager, report.layers, ranked[:k])
        at_random = [_error(program, batches, eager, report.layers, draw.sample(report.layers, k)) for _ in range(DRAWS)]
        assert top < sum(at_random) / DRAWS, (k, top, at_random)
        assert top < none


def test_the_predicted_removal_is_what_recompiling_removes():
    # "fp32 removes" of the first-ranked layer is measured by running the typed graph with
    # that layer's fp32 value; compiling the plan that keeps it must remove the same.
    spec = models.load("hf-vit")
    batches = model_batches(spec)[:1]
    with torch.no_grad():
        eager = [spec.module(*b) for b in batches]
    report = debug_layers(spec, "bf16", batches)
    first = report.ranked()[0]
    program = export_program(spec.module, spec.example_inputs)
    none = _error(program, batches, eager, report.layers, [])
    kept = _error(program, batches, eager, report.layers, [first])
    assert report.outputs.value("max-abs-err") == pytest.approx(none, rel=1e-6)
    assert none - kept == pytest.approx(report.removed(first, "max-abs-err"), rel=1e-4)


def test_data_movement_is_folded_into_the_layer_it_moves():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.out = torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4).unbind(0)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.out(a.transpose(1, 2).contiguous().view(2, 5, 16))

    module = Block().eval()
    spec = models.ModelSpec("block", "attention block", module, (torch.randn(2, 5, 16),), [(torch.randn(2, 5, 16),)])
    report = debug_layers(spec, "bf16", model_batches(spec))
    assert [(layer.op, layer.folded) for layer in report.layers] == [
        ("aten.linear.default", ("unflatten", "permute", "unbind")),
        ("aten.scaled_dot_product_attention.default", ("transpose", "view")),  # export drops the contiguous
        ("aten.linear.default", ()),
    ]


def test_only_views_and_copies_in_their_own_dtype_move_data():
    cg = compile(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), policy="full", low_precision_type="bf16")
    nodes = [n for n in cg.graph_module.graph.nodes if n.op == "call_function"]
    assert not any(moves_data_only(n) for n in nodes)  # the input cast changes dtype, linear computes
    kept, folded = fold_data_movement(nodes)
    assert kept == nodes and all(not v for v in folded.values())
