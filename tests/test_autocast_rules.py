"""Rule-mode classifier against the seed's documented example and each rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import models
from harness.autocast import AutocastSettings, compile
from harness.autocast.rules import reduction_depth
from harness.errors import HarnessError


def _precisions(cg):
    return {r.name: r.precision for r in cg.report.rows if r.rule != "inserted_cast"}


def test_seed_example_lenet_fp16_exclude_conv2d():
    spec = models.load("lenet")
    cg = compile(spec.module, spec.example_inputs, policy="rule",
                 settings=AutocastSettings(low_precision_type=torch.float16, nodes_to_exclude={"^conv2d$"}))
    prec = _precisions(cg)
    low = ["relu", "max_pool2d", "conv2d_1", "relu_1", "max_pool2d_1", "flatten"]
    assert all(prec[n] == "fp16" for n in low), prec
    assert prec["conv2d"] == "fp32"
    region_rows = [r for r in cg.report.rows if r.rule == "autocast_region"]
    assert {r.op for r in region_rows} == {"aten.linear.default", "aten.add.Tensor"}
    assert all(r.precision == "fp32" for r in region_rows)
    reasons = {r.name: r.reason for r in cg.report.rows}
    assert "nodes_to_exclude '^conv2d$'" in reasons["conv2d"]
    # the graph is explicitly typed: exactly the two edges of the seed's fragment carry casts
    casts = [(r.input_dtypes[0], r.output_dtypes[0]) for r in cg.report.rows if r.rule == "inserted_cast"]
    assert sorted(casts) == [("fp16", "fp32"), ("fp32", "fp16")]
    # no autocast region survives
    assert not any("wrap_with_autocast" in str(n.target) for n in cg.graph_module.graph.nodes)
    out = cg(*spec.example_inputs)
    ref = spec.module(*spec.example_inputs)
    assert out.dtype == torch.float32  # keep_io_types
    assert torch.allclose(out, ref, atol=5e-2, rtol=5e-2)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        h = F.relu(self.a(x))
        return torch.softmax(self.b(h), -1), h.sum(-1)


X = (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)


def test_exclude_by_module_path_and_target():
    cg = compile(Small(), X, settings=AutocastSettings(nodes_to_exclude=["^b$"], targets_to_exclude=["aten.relu"]))
    prec = _precisions(cg)
    assert prec["linear"] == "fp16" and prec["linear_1"] == "fp32" and prec["relu"] == "fp32"
    rules = {r.name: r.rule for r in cg.report.rows}
    assert rules["linear_1"] == "nodes_to_exclude" and rules["relu"] == "targets_to_exclude"


def test_include_overrides_exclude():
    s = AutocastSettings(nodes_to_exclude=["linear"], nodes_to_include=["^linear_1$"], targets_to_include=["aten.sum.dim_IntList"])
    cg = compile(Small(), X, settings=s)
    prec = _precisions(cg)
    assert prec["linear"] == "fp32" and prec["linear_1"] == "fp16" and prec["sum_1"] == "fp16"


def test_data_max_uses_the_nodes_own_values():
    # x * 1000 makes `mul` exceed 512 on its output and `add` on its input; relu's values stay small
    class M(nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            z = y * 1000.0
            return z + 1.0, y - 1.0

    cg = compile(M(), (torch.rand(8, 8),), settings=AutocastSettings(low_precision_type="bf16", fp32_output_tail=False))
    prec = _precisions(cg)
    assert prec["relu"] == "bf16" and prec["sub"] == "bf16"
    assert prec["mul"] == "fp32" and prec["add"] == "fp32"
    reasons = {r.name: r.reason for r in cg.report.rows}
    assert "output absmax" in reasons["mul"] and "> data_max 512" in reasons["mul"]
    assert "absmax" in reasons["add"]


def test_calibration_data_is_used_and_validated():
    class M(nn.Module):
        def forward(self, x):
            return x * 2.0

    big = [(torch.full((2, 3), 400.0),)]
    cg = compile(M(), (torch.zeros(2, 3),), settings=AutocastSettings(calibration_data=big))
    assert _precisions(cg)["mul"] == "fp32"  # output 800 > 512 only on the user's data
    with pytest.raises(HarnessError, match=r"calibration batch 0, input 0: got float32\[3, 3\], expected float32\[2, 3\]"):
        compile(M(), (torch.zeros(2, 3),), settings=AutocastSettings(calibration_data=[(torch.zeros(3, 3),)]))
    with pytest.raises(HarnessError, match="calibration batch 0 has 2 inputs; the model takes 1"):
        compile(M(), (torch.zeros(2, 3),), settings=AutocastSettings(calibration_data=[(torch.zeros(2, 3), torch.zeros(1))]))


def test_init_max_keeps_consumers_of_big_weights_fp32_and_clips():
    m = Small()
    with torch.no_grad():
        m.b.weight[0, 0] = 1e5
    cg = compile(m, X, settings=AutocastSettings(data_max=None))
    assert _precisions(cg)["linear_1"] == "fp32"
    assert "weight b.weight absmax 1e+05 > init_max 65504" in {r.name: r.reason for r in cg.report.rows}["linear_1"]
    # without the rule the weight is converted and clipped, and the report counts it
    cg2 = compile(m, X, settings=AutocastSettings(data_max=None, init_max=None))
    assert cg2.report.clipped_values == 1 and cg2.report.clipped_weights == ["b.weight"]
    assert float(cg2.graph_module.b_weight_fp16.abs().max()) == 65504.0


def test_max_depth_of_reduction_from_shapes():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3)
            self.fc = nn.Linear(8 * 4 * 4, 300)

        def forward(self, x):
            y = self.conv(x).flatten(1)
            z = self.fc(y)
            return z.sum(-1), torch.cumsum(z, 1), z.mean(), torch.softmax(z, -1)

    cg = compile(M(), (torch.randn(2, 4, 6, 6),), settings=AutocastSettings(data_max=None, max_depth_of_reduction=100))
    g = cg.graph_module.graph
    depths = {n.name: reduction_depth(n) for n in g.nodes if n.op == "call_function"}
    assert depths["conv2d"] == 4 * 3 * 3 and depths["linear"] == 128
    assert depths["sum_1"] == 300 and depths["cumsum"] == 300 and depths["mean"] == 600 and depths["softmax"] == 300
    prec = _precisions(cg)
    assert prec["conv2d"] == "fp16" and prec["linear"] == "fp32" and prec["sum_1"] == "fp32"


def test_custom_rule_reason_is_reported():
    def no_softmax(node, ctx):
        return "softmax is sensitive" if "softmax" in node.name else None

    cg = compile(Small(), X, settings=AutocastSettings(custom_rules=[no_softmax]))
    row = next(r for r in cg.report.rows if r.name == "softmax")
    assert row.precision == "fp32" and row.reason == "softmax is sensitive" and row.rule == "custom:no_softmax"


def test_integer_and_float64_tensors_are_never_cast():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, d):
            e = self.emb(ids)
            return e.sum(-1), (d * 2.0).sum(), ids + 1

    ids = torch.randint(0, 10, (2, 5))
    d = torch.randn(3, dtype=torch.float64)
    cg = compile(M(), (ids, d))
    out = cg(ids, d)
    assert out[1].dtype == torch.float64 and out[2].dtype == torch.int64
    for n in cg.graph_module.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default:
            assert n.args[0].meta["val"].dtype not in (torch.int64, torch.float64)
    prec = {r.name: r for r in cg.report.rows}
    assert prec["mul"].rule == "float64" and prec["add"].rule == "not_floating_point"


def test_nested_regions_nest():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(8, 8)
            self.l2 = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a = self.l1(x)
                with torch.autocast("cpu", enabled=False):
                    b = self.l2(a.float())
            return a.float() + b

    m = M()
    cg = compile(m, (torch.randn(2, 8),), settings=AutocastSettings(low_precision_type="fp16"))
    by_module = {r.module: r for r in cg.report.rows if r.op == "aten.linear.default"}
    assert by_module["l1"].precision == "bf16" and "dtype=bfloat16)" in by_module["l1"].reason
    assert by_module["l2"].precision == "fp32" and "disabled" in by_module["l2"].reason
    assert next(r for r in cg.report.rows if r.op == "aten.add.Tensor").precision == "fp16"
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.float16):  # eager: regions inside, fp16 outside
        eager = m(x)
    assert torch.allclose(cg(x), eager.float(), atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes_to_exclude": ["("]}, "nodes_to_exclude: invalid regular expression '\\('"),
        ({"targets_to_exclude": ["aten.not_an_op"]}, "no operator 'not_an_op'"),
        ({"targets_to_exclude": ["aten.conv2d.nope"]}, "unknown overload"),
        ({"low_precision_type": "int8"}, "unknown dtype 'int8'; valid: bf16"),
        ({"data_max": -1}, "data_max must be a positive finite number"),
        ({"data_max": float("nan")}, "data_max must be a positive finite number"),
        ({"init_max": float("inf")}, "init_max must be a positive finite number"),
        ({"data_max": 0}, r"data_max must be a positive finite number, or None \(off\)"),
        ({"max_depth_of_reduction": 0}, "max_depth_of_reduction must be a positive integer"),
        ({"nodes_to_exclude": "conv"}, "collection of strings"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(HarnessError, match=match):
        AutocastSettings(**kwargs)


def test_model_that_fails_to_export_is_named():
    class Dynamic(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(HarnessError, match="model Dynamic failed to export with torch.export"):
        compile(Dynamic(), (torch.randn(3),))


def test_overflow_model_full_fp16_nonfinite_rule_mode_accurate():
    spec = models.load("overflow")
    x = spec.example_inputs
    ref = spec.module(*x)
    full = compile(spec.module, x, policy="full", low_precision_type=torch.float16)(*x)
    assert not torch.isfinite(full).all()
    rule = compile(spec.module, x, policy="rule", low_precision_type=torch.float16,
                   calibration_data=spec.calibration_data)(*x)
    assert torch.isfinite(rule).all()
    cos = F.cosine_similarity(rule.double().flatten(), ref.double().flatten(), dim=0)
    assert cos >= 0.999


class _BigTable(nn.Module):
    """A ``@torch.no_grad()`` method reading a buffer beyond fp16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.full((3,), 1e6))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


class _WithBigTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = _BigTable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) + 1


def test_init_max_looks_past_a_get_attr_that_is_not_a_tensor():
    """Before inlining, a higher-order op takes its body as a get_attr of a submodule.

    InitMax must skip it (no float values to bound) and still judge the
    tensors beside it, instead of failing on ``.abs()`` of a module.
    """
    from harness.autocast.rules import Context, InitMax
    from harness.frontend.export import load_graph

    with torch.random.fork_rng():
        module = _WithBigTable().eval()
    gm = load_graph(module, (torch.ones(2, 3),))  # not inlined: the op is still there
    (hop,) = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    body, table = [a for a in hop.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    assert isinstance(getattr(gm, body.target), torch.nn.Module)
    ctx = Context(gm, "cpu", torch.float16, AutocastSettings())
    assert ctx.weight_absmax(body) == 0.0
    decision = InitMax()(hop, ctx)
    assert decision is not None and decision.dtype == torch.float32
    assert decision.reason == "weight big.table absmax 1e+06 > init_max 65504"


def test_an_exclusion_or_inclusion_that_selects_nothing_is_a_warning_of_the_compile_and_the_build():
    """A typo in --exclude/--exclude-op/--include would change nothing without a word: the report
    and the build's warnings name it; selectors that match stay quiet."""
    from harness import models
    from harness.build import build_engine
    from harness.engines.cpu import CpuBackend
    from harness.engines.protocol import BuildConfig

    spec = models.load("lenet")
    settings = AutocastSettings(
        nodes_to_exclude=("conv", "no_such_node"), targets_to_exclude=("aten.linear", "aten.cumsum"),
        nodes_to_include=("also_missing",),
    )  # fmt: skip
    compiled = compile(spec.module, spec.example_inputs, policy="rule", low_precision_type=torch.float16, settings=settings)
    assert compiled.report.warnings == [
        "nodes_to_exclude 'no_such_node' matches no node (by name or module path)",
        "nodes_to_include 'also_missing' matches no node (by name or module path)",
        "targets_to_exclude aten.cumsum is the op of no node",
    ]
    assert "warning: targets_to_exclude aten.cumsum is the op of no node" in compiled.report.table()
    built = build_engine(spec, BuildConfig("autocast-fp16", autocast=settings, options={"timing_runs": 1}), CpuBackend())
    assert built.log.warnings[-3:] == compiled.report.warnings
