"""Front end and lowering passes: the graph stays valid and computes the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness.errors import HarnessError
from harness.frontend.export import export_program, load_graph, standalone_graph
from harness.lowering.decompose import DecompositionTable, decompose
from harness.lowering.pass_manager import PassManager, PassResult, default_pass_manager
from harness.opnames import resolve_op


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)
        self.d = nn.Dropout(0.5)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, y):
        h = self.d(self.l(x)).detach()
        return torch.einsum("bi,bj->bij", h, y) * self.scale, h


X = (torch.randn(3, 6), torch.randn(3, 4))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_standalone_graph_has_user_inputs_and_weight_attrs():
    m = Net().eval()
    ep = export_program(m, X)
    gm = standalone_graph(ep)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "y"]
    weights = {n.meta["weight_name"] for n in gm.graph.nodes if n.op == "get_attr"}
    assert weights == {"l.weight", "l.bias", "scale"}
    assert all(torch.equal(a, b) for a, b in zip(gm(*X), m(*X)))
    # the caller's program is not mutated
    assert sum(n.op == "placeholder" for n in ep.graph.nodes) == 5


def test_default_passes_remove_dropout_and_detach_and_keep_values():
    m = Net().eval()
    gm = default_pass_manager()(load_graph(m, X))
    targets = _targets(gm)
    assert torch.ops.aten.dropout.default not in targets and torch.ops.aten.detach.default not in targets
    assert all(torch.equal(a, b) for a, b in zip(gm(*X), m(*X)))


def test_decomposition_table_enable_disable():
    m = Net().eval()
    gm = decompose(load_graph(m, X), DecompositionTable())
    assert torch.ops.aten.einsum.default not in _targets(gm)
    assert any(n.meta.get("decomposed_from") == "einsum" for n in gm.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(gm(*X), m(*X)))  # C++ composite: same bits

    kept = decompose(load_graph(m, X), DecompositionTable().disable(["aten.einsum"]))
    assert torch.ops.aten.einsum.default in _targets(kept)

    lin = decompose(load_graph(m, X), DecompositionTable(frozenset()).enable(["aten.linear.default"]))
    assert torch.ops.aten.linear.default not in _targets(lin)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(lin(*X), m(*X)))


class Softmaxes(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1) * 2, torch.log_softmax(x, dim=0)


def test_a_bare_name_enables_the_functional_overloads_that_have_a_decomposition():
    # aten.softmax also has an out= overload (softmax.int_out), which no table decomposes;
    # softmax.int is a C++ composite of _softmax, which torch's table decomposes further.
    table = DecompositionTable(frozenset()).enable(["aten.softmax", "aten._softmax"])
    assert table.ops == {"aten.softmax.int", "aten._softmax.default"}
    fns = table.functions()
    assert torch.ops.aten.softmax.int in fns and torch.ops.aten._softmax.default in fns
    x = torch.randn(3, 5)
    gm = decompose(load_graph(Softmaxes(), (x,)), table)
    targets = _targets(gm)
    assert torch.ops.aten.softmax.int not in targets and torch.ops.aten._softmax.default not in targets
    assert torch.ops.aten.exp.default in targets and torch.ops.aten.log_softmax.int in targets
    for got, want in zip(gm(x), Softmaxes()(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert table.disable(["aten.softmax"]).ops == {"aten._softmax.default"}


def test_a_bare_name_without_any_decomposition_is_refused_by_name():
    with pytest.raises(HarnessError, match=r"no decomposition is known for any functional overload of aten\.relu_"):
        DecompositionTable(frozenset()).enable(["aten.relu_"])


@pytest.mark.parametrize("name, match", [
    ("conv2d", "not of the form aten.NAME"),
    ("aten.nope", "no operator 'nope'"),
    ("aten.add.nope", "unknown overload"),
])
def test_bad_op_names(name, match):
    with pytest.raises(HarnessError, match=match):
        resolve_op(name)


def test_unknown_pass_is_named():
    with pytest.raises(HarnessError, match="unknown lowering pass 'fold_everything'; valid: channels_last_weights, fold_batch_norm, functionalize_inplace"):
        PassManager.from_names(["fold_everything"])


def test_pass_that_breaks_the_graph_is_caught_where_it_broke():
    def broken(gm):
        gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "placeholder"))  # still used
        return PassResult(gm, True)

    with pytest.raises(RuntimeError, match="still had 1 users"):
        PassManager([("broken", broken)])(load_graph(Net().eval(), X))


def test_buffer_mutation_is_refused():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    with pytest.raises(HarnessError, match="updates calls in place"):
        standalone_graph(torch.export.export(Counter(), (torch.randn(4),)))


def test_inplace_ops_on_activations_become_values():
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            y.relu_()
            return y + 1, x

    x = torch.randn(5)
    gm = default_pass_manager()(load_graph(M(), (x,)))
    assert torch.ops.aten.relu_.default not in _targets(gm)
    out = gm(x)
    assert torch.equal(out[0], (x * 2).relu() + 1) and torch.equal(out[1], x)


def test_fold_batch_norm_matches_unfolded_in_fp32():
    from harness import models
    from harness.lowering.fold_batch_norm import fold_batch_norm

    spec = models.load("resnet")
    gm = load_graph(spec.module, spec.example_inputs)
    n_bn = sum(n.target is torch.ops.aten.batch_norm.default for n in gm.graph.nodes)
    result = fold_batch_norm(load_graph(spec.module, spec.example_inputs))
    folded = result.graph_module
    folded.recompile()
    assert result.modified
    assert n_bn == 9 and not any(n.target is torch.ops.aten.batch_norm.default for n in folded.graph.nodes)
    ref = spec.module(*spec.example_inputs)
    (out,) = folded(*spec.example_inputs)  # a bare graph module returns the flat tuple
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5) and not torch.equal(out, ref)


def test_the_batch_norm_fold_keeps_float64_precision_bit_for_bit_on_resnet():
    """The fold (torch's fuse_conv_bn_weights on float64 copies) against the fold formula written
    out in float64: bit-identical on every conv+bn pair of the zoo resnet, and, as the reason for
    float64, not what torch's fold gives when run in the weights' own fp32."""
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    from harness import models
    from harness.lowering.fold_batch_norm import fold_conv_batch_norm

    modules = [m for m in models.load("resnet").module.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
    pairs = [(c, b) for c, b in zip(modules, modules[1:]) if isinstance(c, nn.Conv2d) and isinstance(b, nn.BatchNorm2d)]
    fp32_differs = 0
    for conv, bn in pairs:
        w, b = conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
        gamma, beta = bn.weight.detach(), bn.bias.detach()
        folded_w, folded_b = fold_conv_batch_norm(w, b, gamma, beta, bn.running_mean, bn.running_var, bn.eps)
        scale = gamma.double() / torch.sqrt(bn.running_var.double() + bn.eps)  # w' = w g / sqrt(var + eps)
        want_w = (w.double() * scale.reshape(-1, 1, 1, 1)).float()
        want_b = (((b.double() if b is not None else 0.0) - bn.running_mean.double()) * scale + beta.double()).float()
        assert torch.equal(folded_w.view(torch.int32), want_w.view(torch.int32))
        assert torch.equal(folded_b.view(torch.int32), want_b.view(torch.int32))
        in_fp32 = fuse_conv_bn_weights(w, b, bn.running_mean, bn.running_var, bn.eps, gamma, beta)
        fp32_differs += int((in_fp32[0].detach() != folded_w).sum())
    assert len(pairs) == 9 and fp32_differs > 0


def test_conv_weights_channels_last_outside_the_exact_modes():
    from harness import models
    from harness.autocast import compile

    spec = models.load("resnet")

    def conv_weights(cg):
        gm = cg.graph_module
        return [getattr(gm, n.args[1].target) for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.default]

    rule = compile(spec.module, spec.example_inputs, policy="rule", low_precision_type=torch.bfloat16)
    amp = compile(spec.module, spec.example_inputs, policy="amp", low_precision_type=torch.bfloat16)
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights(rule))
    assert sum(not w.is_contiguous() for w in conv_weights(rule)) >= 7  # the 3x3 kernels moved
    assert all(w.is_contiguous() for w in conv_weights(amp))
    ref = spec.module(*spec.example_inputs)
    assert torch.allclose(rule(*spec.example_inputs), ref, atol=0.05)


class StridedAfterConv(nn.Module):
    """``as_strided`` of a convolution's output, directly and through a transposed view of it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return h.as_strided((8, 3, 4), (16, 4, 1), 2), h.transpose(2, 3).as_strided((4, 6), (5, 3), 7)


@pytest.mark.parametrize("policy", ["fp32", "rule"])
def test_as_strided_reads_eager_memory_order_even_after_channels_last_weights(policy):
    from harness.autocast import compile

    module, x = StridedAfterConv().eval(), torch.randn(1, 3, 4, 4)
    # rule mode stores the convolution weight channels-last, so the convolution's output is
    # channels-last too: as_strided on it directly would read other elements than eager's.
    compiled = compile(module, (x,), policy=policy, low_precision_type=torch.bfloat16)
    clones = [n for n in compiled.graph_module.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 1  # both read the convolution's memory: one compact copy of it
    tolerance = {"rtol": 0, "atol": 0} if policy == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(compiled(x), module(x), strict=True):
        torch.testing.assert_close(got.float(), want, **tolerance)


def test_composites_are_eager_cpp_kernels_not_python_ones_the_public_query_also_counts():
    """Why decompositions and the AMP expansion ask the C++ dispatcher (fxutil.has_eager_kernel).

    ``native_batch_norm`` has a Python CompositeImplicitAutograd kernel and no C++ one: the public
    ``OpOverload.has_kernel_for_dispatch_key`` says it has one, eager runs no such composite, and its
    decomposition is torch's table entry, not ``op.decompose`` (that Python kernel).
    """
    from torch._decomp import get_decompositions

    from harness.fxutil import has_eager_kernel

    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    op = torch.ops.aten.native_batch_norm.default
    assert op.has_kernel_for_dispatch_key(cia) and not has_eager_kernel(op, "CompositeImplicitAutograd")
    assert DecompositionTable(frozenset({"aten.native_batch_norm.default"})).functions()[op] is get_decompositions([op])[op]
    einsum = torch.ops.aten.einsum.default  # a C++ composite: both agree, and eager's own code decomposes it
    assert einsum.has_kernel_for_dispatch_key(cia) and has_eager_kernel(einsum, "CompositeImplicitAutograd")
    assert DecompositionTable(frozenset({"aten.einsum.default"})).functions()[einsum] == einsum.decompose
