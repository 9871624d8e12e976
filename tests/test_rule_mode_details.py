"""Rule mode's smaller promises, each checked against eager PyTorch.

- Normalization parameters stay fp32 when the norm is lowered: the CPU kernels
  take a low-precision activation with fp32 weight, bias and statistics, which
  is what eager ``torch.autocast`` runs (layer_norm, group_norm and batch_norm
  fall through its CPU lists), so the typed graph must match it bit for bit.
- A cast written in the model (``.float()``, ``.to(dtype)``) decides its own
  output type: the report says ``explicit_cast`` and the value is the one the
  user's cast computes, not one rounded through the low type first.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from harness.autocast import AutocastSettings, compile

aten = torch.ops.aten
NORMS = {aten.layer_norm.default: (2, 3), aten.group_norm.default: (2, 3), aten.batch_norm.default: (1, 2, 3, 4)}


def _rule_settings(low: str) -> AutocastSettings:
    """Rule mode with every threshold off, no fp32 output tail and no bias correction: the default
    rule lowers every node, with the weights eager autocast would use."""
    return AutocastSettings(
        low_precision_type=low, data_max=None, init_max=None, max_depth_of_reduction=None, fp32_output_tail=False,
        bias_correction=False,
    )


class LinearNorms(nn.Module):
    """Linear, then LayerNorm, GroupNorm and (unfoldable, after a norm) BatchNorm1d."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(4, 16)
        self.bn = nn.BatchNorm1d(16)
        # Random parameters: the default ones and zeros are exact in bf16, so
        # lowering them would change nothing and prove nothing.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.bn.running_mean.copy_(torch.randn(16, generator=g))
            self.bn.running_var.copy_(torch.rand(16, generator=g) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.gn(self.ln(self.lin(x))))


def test_norm_parameters_stay_fp32_and_match_eager_autocast():
    module = LinearNorms().eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    cg = compile(module, (x,), policy="rule", settings=_rule_settings("bf16"))

    norms = [n for n in cg.graph_module.graph.nodes if n.target in NORMS]
    assert sorted(str(n.target) for n in norms) == sorted(str(t) for t in NORMS)
    for node in norms:
        assert node.args[0].meta["val"].dtype == torch.bfloat16, node.name  # the norm itself is lowered
        for i in NORMS[node.target]:
            param = node.args[i]
            assert param.op == "get_attr" and param.meta["val"].dtype == torch.float32, (node.name, i)
            assert getattr(cg.graph_module, param.target).dtype == torch.float32
    assert not [name for name, _ in cg.graph_module.named_buffers() if name.split("_")[0] in ("ln", "gn", "bn") and name.endswith("bf16")]

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        ref = module(x)
    out = cg(x)
    assert ref.dtype == torch.bfloat16 and out.dtype == torch.float32  # keep_io_types casts the output back
    assert torch.equal(out, ref.float())


class Casts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wide = self.lin(x).float()  # the user widens the lowered linear
        half = x.to(torch.float16)  # and narrows the fp32 input to fp16 themselves
        return wide, half


def test_explicit_casts_keep_what_the_user_asked():
    module = Casts().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)) * 3
    cg = compile(module, (x,), policy="rule", settings=_rule_settings("bf16"))

    rows = {r.name: r for r in cg.report.rows}
    user_casts = [r for r in cg.report.rows if r.rule != "inserted_cast" and r.op.startswith(("aten.to.", "aten._to_copy"))]
    assert sorted(r.precision for r in user_casts) == ["fp16", "fp32"], cg.report.table()
    assert all(r.rule == "explicit_cast" for r in user_casts), cg.report.table()
    assert cg.report.counts()["explicit_cast"] == 2

    nodes = {n.name: n for n in cg.graph_module.graph.nodes}
    half = next(r for r in user_casts if r.precision == "fp16")
    assert rows[half.name].input_dtypes == ("fp32",)  # straight from the fp32 input, no bf16 on the way
    assert nodes[half.name].meta["val"].dtype == torch.float16

    wide_out, half_out = cg(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        ref_wide, ref_half = module(x)
    assert wide_out.dtype == torch.float32 and torch.equal(wide_out, ref_wide)
    assert half_out.dtype == torch.float16 and torch.equal(half_out, x.to(torch.float16))
    assert torch.equal(half_out, ref_half)
