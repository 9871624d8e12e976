"""Cast insertion and the clean-up passes, checked by running the graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import models
from harness.autocast import AutocastSettings, compile
from harness.autocast.casts import is_cast
from harness.autocast.cleanup import (
    CLEANUP,
    dedupe_casts,
    eliminate_dead_code,
    fold_cast_chains,
    remove_noop_casts,
)
from harness.frontend.export import load_graph
from harness.fxutil import tensor_vals

aten = torch.ops.aten


def _run_and_check_meta(gm: torch.fx.GraphModule, inputs):
    """Every node's real value has the dtype and shape its meta says."""
    seen = {}

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.op in ("call_function", "get_attr", "placeholder") and "val" in n.meta:
                for real, fake in zip(tensor_vals(result), tensor_vals(n.meta["val"])):
                    assert real.dtype == fake.dtype, (n.name, real.dtype, fake.dtype)
                    assert tuple(real.shape) == tuple(fake.shape), n.name
                seen[n.name] = True
            return result

    with torch.autocast("cpu", enabled=False):
        Check(gm).run(*inputs)
    return seen


@pytest.mark.slow  # every zoo model in every mode: about 30 s
def test_meta_dtypes_are_what_runs_for_every_zoo_model_and_mode():
    for name in ("resnet", "transformer", "lenet", "digits"):
        spec = models.load(name)
        for mode, dt in (("rule", torch.float16), ("rule", torch.bfloat16), ("full", torch.bfloat16), ("amp", torch.bfloat16)):
            if name == "lenet" and mode == "amp":
                continue  # eager autocast itself rejects lenet (tests/test_amp_exact.py)
            cg = compile(spec.module, spec.example_inputs, policy=mode, low_precision_type=dt)
            assert _run_and_check_meta(cg.graph_module, spec.example_inputs)


def test_one_cast_per_tensor_per_direction_and_no_same_type_casts():
    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(x)
            return self.a(h) + self.b(h) + self.c(h) + h  # four consumers of h

    cg = compile(Fan(), (torch.randn(2, 8),), policy="rule", settings=AutocastSettings(data_max=None, nodes_to_exclude=["relu"]))
    casts = [n for n in cg.graph_module.graph.nodes if is_cast(n)]
    keys = [(n.args[0].name, n.kwargs["dtype"]) for n in casts]
    assert len(keys) == len(set(keys))
    assert ("relu", torch.float16) in keys
    assert all(n.args[0].meta["val"].dtype != n.kwargs["dtype"] for n in casts)


def test_weights_converted_ahead_of_time_one_copy_per_precision():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return x @ self.w, (x * 3.0) @ self.w

    cg = compile(Shared(), (torch.randn(2, 8),), settings=AutocastSettings(data_max=None, nodes_to_exclude=["^matmul_1$"], fp32_output_tail=False))
    buffers = {**dict(cg.graph_module.named_buffers()), **dict(cg.graph_module.named_parameters())}
    assert set(buffers) == {"w", "w_fp16"}
    assert buffers["w_fp16"].dtype == torch.float16 and buffers["w"].dtype == torch.float32
    assert not any(is_cast(n) and n.args[0].op == "get_attr" for n in cg.graph_module.graph.nodes)


def _graph_with(chain):
    class M(nn.Module):
        def forward(self, x):
            return chain(x)

    return load_graph(M(), (torch.randn(4),))


def _casts_of(gm):
    return [(n.args[0].meta["val"].dtype, n.kwargs["dtype"]) for n in gm.graph.nodes if is_cast(n)]


def test_widening_then_narrowing_collapses():
    gm = _graph_with(lambda x: x.to(torch.bfloat16)._to_copy(dtype=torch.float32)._to_copy(dtype=torch.float16) if False else
                     torch.ops.aten._to_copy.default(torch.ops.aten._to_copy.default(
                         torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16), dtype=torch.float32), dtype=torch.float16))
    x = torch.randn(4) * 3
    before = gm(x)[0]
    gm = fold_cast_chains(gm).graph_module
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert _casts_of(gm) == [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]
    assert torch.equal(gm(x)[0], before)


def test_narrowing_then_widening_is_kept():
    gm = _graph_with(lambda x: torch.ops.aten._to_copy.default(torch.ops.aten._to_copy.default(x, dtype=torch.float16), dtype=torch.float32))
    gm = fold_cast_chains(remove_noop_casts(gm).graph_module).graph_module
    assert _casts_of(gm) == [(torch.float32, torch.float16), (torch.float16, torch.float32)]
    x = torch.tensor([1.0 + 2**-12])
    assert gm(x)[0].item() != x.item()  # the round trip really rounds


def test_widen_narrow_back_to_source_disappears_and_dedupe():
    cast = torch.ops.aten._to_copy.default
    gm = _graph_with(lambda x: (lambda h: cast(cast(h, dtype=torch.float32), dtype=torch.float16) + cast(h, dtype=torch.float32).half() * 0
                                + cast(h, dtype=torch.float16))(cast(x, dtype=torch.float16)))
    for cleanup_pass in (fold_cast_chains, remove_noop_casts, dedupe_casts):
        gm = cleanup_pass(gm).graph_module
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    pairs = _casts_of(gm)
    assert (torch.float16, torch.float16) not in pairs
    assert pairs.count((torch.float16, torch.float32)) <= 1
    x = torch.randn(4)
    assert torch.isfinite(gm(x)[0]).all()


def test_keep_io_types_false_exposes_low_precision_io():
    spec = models.load("digits")
    cg = compile(spec.module, spec.example_inputs, settings=AutocastSettings(low_precision_type="bf16", keep_io_types=False))
    assert cg.input_dtypes == (torch.bfloat16,)
    x = spec.example_inputs[0]
    out = cg(x.bfloat16())
    assert out.dtype == torch.bfloat16
    # the fp32 output tail off: it only applies with kept I/O types, and would change the computation
    kept = compile(spec.module, spec.example_inputs, settings=AutocastSettings(low_precision_type="bf16", fp32_output_tail=False))
    assert kept.input_dtypes == (torch.float32,) and kept(x).dtype == torch.float32
    assert torch.equal(out.float(), kept(x))  # same computation, only the I/O casts moved out


def test_exported_program_input_equals_module_input():
    spec = models.load("resnet")
    ep = torch.export.export(spec.module, spec.example_inputs)
    from_ep = compile(ep, policy="rule", low_precision_type=torch.bfloat16)
    from_module = compile(spec.module, spec.example_inputs, policy="rule", low_precision_type=torch.bfloat16)
    assert [r.precision for r in from_ep.report.rows] == [r.precision for r in from_module.report.rows]
    assert torch.equal(from_ep(*spec.example_inputs), from_module(*spec.example_inputs))


def _two_casts_of_one_tensor() -> torch.fx.GraphModule:
    """``x`` cast to fp16 twice (as a fold can leave it), both used, summed in fp32."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float16})
    second = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float16})
    scaled = graph.call_function(aten.mul.Tensor, (second, 3.0))
    summed = graph.call_function(aten.add.Tensor, (first, scaled))
    graph.output((graph.call_function(aten._to_copy.default, (summed,), {"dtype": torch.float32}),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_dedupe_casts_keeps_one_cast_per_tensor_and_dtype():
    gm = _two_casts_of_one_tensor()
    x = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 100
    before = gm(x)[0]
    assert sum(is_cast(n) and n.args[0].name == "x" for n in gm.graph.nodes) == 2

    gm = dedupe_casts(gm).graph_module
    gm.graph.lint()
    gm.recompile()

    to_fp16 = [n for n in gm.graph.nodes if is_cast(n) and n.args[0].name == "x"]
    assert len(to_fp16) == 1
    assert {u.target for u in to_fp16[0].users} == {aten.mul.Tensor, aten.add.Tensor}  # both readers share it
    assert torch.equal(gm(x)[0], before)


def test_compile_leaves_one_cast_where_the_model_wrote_two():
    class TwiceCast(nn.Module):
        def forward(self, x):
            # Two identical pure casts of x (what cast folding can leave behind;
            # x.half() would export as aten.to, which clean-up does not touch).
            cast = torch.ops.aten._to_copy.default
            return cast(x, dtype=torch.float16) + cast(x, dtype=torch.float16) * 3

    module, x = TwiceCast(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    cg = compile(module, (x,), policy="fp32")  # exact mode: the casts are the model's, nothing else decides
    casts = [n for n in cg.graph_module.graph.nodes if is_cast(n) and n.args[0].op == "placeholder"]
    assert [n.kwargs["dtype"] for n in casts] == [torch.float16]
    out, ref = cg(x), module(x)
    assert out.dtype == torch.float16 and torch.equal(out, ref)


def test_cleanup_passes_report_modified_only_when_they_change_the_graph():
    gm = _two_casts_of_one_tensor()
    first = dedupe_casts(gm)
    assert first.modified and first.graph_module is gm
    assert not dedupe_casts(gm).modified  # nothing left to merge

    dead = _two_casts_of_one_tensor()
    dead.graph.call_function(aten._to_copy.default, (next(iter(dead.graph.nodes)),), {"dtype": torch.float16})
    assert eliminate_dead_code(dead).modified  # the unused cast
    assert not eliminate_dead_code(dead).modified

    chain = _graph_with(lambda x: aten._to_copy.default(aten._to_copy.default(x, dtype=torch.float64), dtype=torch.float16))
    assert fold_cast_chains(chain).modified
    assert not fold_cast_chains(chain).modified
    assert not remove_noop_casts(chain).modified  # x -> fp64 -> fp16 folded to x -> fp16: no same-type cast

    same_type = _graph_with(lambda x: aten._to_copy.default(x, dtype=torch.float32) * 2)
    assert remove_noop_casts(same_type).modified
    assert not remove_noop_casts(same_type).modified and not _casts_of(same_type)

    narrowing = _graph_with(lambda x: aten._to_copy.default(aten._to_copy.default(x, dtype=torch.float16), dtype=torch.float32))
    assert not fold_cast_chains(narrowing).modified  # narrowing-then-widening is kept
    result = CLEANUP.run(narrowing)
    assert not result.modified and result.graph_module is narrowing
