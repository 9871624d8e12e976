"""The rule policy keeps the model's last layers fp32 where that costs no cast (``output_layer``)."""

from __future__ import annotations

import torch
from torch import nn

from harness.autocast import AutocastSettings, compile

CAST = torch.ops.aten._to_copy.default


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.skip = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) + self.skip(x)  # two activations: the tail starts after this add
        return self.out(torch.relu(self.norm(h)).mean(0, keepdim=True))


def _compile(keep_io_types: bool, include: frozenset[str] = frozenset()):
    torch.manual_seed(0)
    module, x = Head().eval(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    settings = AutocastSettings(low_precision_type="fp16", keep_io_types=keep_io_types, nodes_to_include=set(include))
    return module, x, compile(module, (x,), policy="rule", settings=settings)


def test_the_tail_after_the_last_join_runs_fp32_for_the_same_casts():
    module, x, compiled = _compile(keep_io_types=True)
    rules = {r.name: r.rule for r in compiled.report.rows}
    assert [n for n, rule in rules.items() if rule == "output_layer"] == ["layer_norm", "relu", "mean", "linear_2"]
    assert rules["add"] == "default" and rules["linear"] == "default"
    casts = [n for n in compiled.graph_module.graph.nodes if n.target is CAST]
    # in: x to fp16; the add's result up to fp32 for the tail; nothing after the output layer
    assert [(c.args[0].name, c.kwargs["dtype"]) for c in casts] == [("x", torch.float16), ("add", torch.float32)]
    # The same tail forced low (nodes_to_include overrides the rule): as many casts, more error.
    _, _, low_tail = _compile(keep_io_types=True, include=frozenset({"^(layer_norm|relu|mean|linear_2)$"}))
    assert not any(r.rule == "output_layer" for r in low_tail.report.rows)
    assert sum(1 for n in low_tail.graph_module.graph.nodes if n.target is CAST) == len(casts)
    with torch.no_grad():
        want = module(x)
    assert compiled(x).dtype == torch.float32
    assert float((compiled(x) - want).abs().max()) < float((low_tail(x) - want).abs().max())


def test_without_kept_io_types_the_outputs_are_low_and_nothing_is_kept():
    _, _, compiled = _compile(keep_io_types=False)
    assert not any(r.rule == "output_layer" for r in compiled.report.rows)
