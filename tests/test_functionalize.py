"""In-place writes through views reach their base: the compiled graph computes what eager does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.autocast import compile
from harness.errors import HarnessError
from harness.frontend.export import load_graph
from harness.lowering.functionalize import functionalize_inplace
from tests.helpers import assert_same_outputs


def _check_fp32_and_amp(module: nn.Module, *inputs: torch.Tensor) -> None:
    """fp32 equals eager; AMP bf16 equals eager autocast; no in-place op is left in the graph."""
    with torch.inference_mode():
        eager = module(*(x.clone() for x in inputs))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager_amp = module(*(x.clone() for x in inputs))
    fp32 = compile(module, inputs, policy="fp32")
    assert_same_outputs(fp32(*(x.clone() for x in inputs)), eager)
    amp = compile(module, inputs, policy="amp", low_precision_type=torch.bfloat16)
    assert_same_outputs(amp(*(x.clone() for x in inputs)), eager_amp)
    for graph in (fp32, amp):
        for node in graph.graph_module.graph.nodes:
            schema = getattr(node.target, "_schema", None)
            assert schema is None or not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


class SliceAssignedMask(nn.Module):
    """The defect as reported: a mask filled by slice assignment, read only through its base."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_zeros(1, 4, 4)
        count = 0
        for rows in (slice(0, 2), slice(2, 4)):
            for cols in (slice(0, 1), slice(1, 4)):
                mask[:, rows, cols] = count
                count += 1
        return x + mask


def test_a_slice_assigned_buffer_is_updated_in_its_base():
    _check_fp32_and_amp(SliceAssignedMask(), torch.randn(1, 4, 4))


class Aliasing(nn.Module):
    """Views of views, views taken before a write and read after it, pieces of a split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_zeros(1, 4, 4)
        v = mask[0].t()  # a view taken before the writes below
        mask[0, 1] += 10  # through select(select(...)): v must see it
        w = v * 2
        v[0].mul_(3)  # through select(t(select(mask))): mask must see it
        h = x.clone()
        h.relu_()
        _, right = h.split(2, dim=-1)
        right.fill_(7.0)  # a piece of a split writes into h
        return x + mask + w.sum() + h


def test_writes_through_chains_of_views_reach_the_base_and_every_other_view():
    _check_fp32_and_amp(Aliasing(), torch.randn(1, 4, 4))


class CopyNotView(nn.Module):
    """``reshape`` of a transposed tensor and ``.to`` with copy are copies: writes must not leak."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copied = x[0].t().reshape(-1)
        copied[0] = 100.0
        cast = x.to(torch.float32, copy=True)
        cast[0, 0, 0] = -5.0
        viewed = x.reshape(-1)  # a real view, read only
        return x * 2 + copied.sum() + cast.sum() + viewed.sum()


def test_a_write_to_a_copy_does_not_reach_the_original():
    _check_fp32_and_amp(CopyNotView(), torch.randn(1, 4, 4))


class WriteThroughExpand(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = x.new_zeros(4, 1)
        wide = base.expand(4, 4).unfold(1, 2, 2)
        wide.add_(1.0)
        return x + base


def test_a_write_through_a_view_without_inverse_is_refused_naming_the_node():
    with pytest.raises(HarnessError, match=r"in-place write goes through the view aten\.unfold"):
        compile(WriteThroughExpand(), (torch.randn(4, 4),), policy="fp32")


def test_the_pass_leaves_a_pure_graph_alone():
    class Pure(nn.Module):
        def forward(self, x):
            return (x[:, :2].t() * 2).sum()

    gm = load_graph(Pure(), (torch.randn(3, 4),))
    before = [(n.op, n.target) for n in gm.graph.nodes]
    assert not functionalize_inplace(gm).modified
    assert [(n.op, n.target) for n in gm.graph.nodes] == before


class WritesIntoItsBuffer(nn.Module):
    """``self.buf[1:3] += x``: eager changes the model's buffer on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[1:3] += x
        return self.buf * 2


class WritesIntoItsBufferDirectly(WritesIntoItsBuffer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf.add_(x.sum())
        return self.buf * 2


class WritesIntoAConstantAttribute(nn.Module):
    """A plain tensor attribute (exported as a constant) written through a view: model state too."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.table[1:3] = x
        return self.table * 2


@pytest.mark.parametrize(
    ("module", "node", "weight"),
    [
        (WritesIntoItsBuffer, "add_", "buf"),
        (WritesIntoItsBufferDirectly, "add_", "buf"),
        (WritesIntoAConstantAttribute, "copy_", "table"),
    ],
)
def test_a_write_into_a_weight_or_buffer_is_refused_whether_direct_or_through_a_view(module, node, weight):
    x = torch.ones(2, 4) if module is not WritesIntoAConstantAttribute else torch.ones(2)
    message = rf"node {node} \(aten\.\w+_\.\w+\) updates {weight} in place"
    with pytest.raises(HarnessError, match=message):
        compile(module().eval(), (x,), policy="fp32")
    with pytest.raises(HarnessError, match=message):
        functionalize_inplace(load_graph(module().eval(), (x,)))


class WritesIntoAFreshTensor(nn.Module):
    """``torch.tensor`` in forward is a fresh copy of a constant: writing into it is allowed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        t[0] = x
        t[1] += x.detach()
        return t * 2


def test_a_write_into_a_copy_of_a_constant_is_not_a_write_into_the_constant():
    _check_fp32_and_amp(WritesIntoAFreshTensor(), torch.randn(2))
