"""Dtypes that follow a tensor at run time, and low-precision weight copies, against eager autocast.

Eager under ``torch.autocast`` reads ``y.dtype`` when the line runs; the trace
records the dtype it saw (float32). Each family member below is checked bit for
bit against PyTorch's own eager autocast, in bf16 and fp16, for ``compile``
(amp policy) and ``jit``; the conformance suite runs the same members
(``dtype_followers``) and the token mixer over ten weight draws.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from harness.autocast import compile, jit
from harness.autocast.follow import DtypeLinks
from harness.frontend.export import export_program, standalone_graph
from harness.frontend.provenance import DTYPE_FOLLOWS
from tests.conformance.recreations import TokenMixer
from tests.helpers import assert_same_outputs
from tests.seeds import redrawn, reseeded

LOW = (torch.bfloat16, torch.float16)


def _steps(dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=dtype) * 0.1  # the dtype was read by the caller


class Follower(nn.Module):
    """``h = linear(x)`` is low under autocast; ``member`` builds something whose dtype follows it."""

    def __init__(self, member: str) -> None:
        super().__init__()
        self.member = member
        self.proj = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.randn(8))
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.proj(x)
        m = self.member
        if m == "to(y.device)":
            out: tuple[torch.Tensor, ...] = (self.side(h).to(h.device) + x,)
        elif m == "to(y)":
            out = (self.gain.to(h), self.gain.to(h) + h)
        elif m == "type_as(y)":
            out = (self.offset.type_as(h) * h, x.type_as(h))
        elif m == "to(y.dtype)":
            out = (self.gain.to(h.dtype) + h, x.to(dtype=h.dtype))
        elif m == "zeros(dtype=y.dtype)":
            out = (torch.zeros(2, 8, dtype=h.dtype, device=h.device) + 1,)
        elif m == "full(dtype=y.dtype)":
            out = (torch.full((2, 8), 0.3, dtype=h.dtype),)
        elif m == "new_zeros":
            out = (h.new_zeros(2, 8), x.new_zeros(3, dtype=h.dtype))
        elif m == "full_like":
            out = (torch.full_like(h, 0.3), torch.full_like(x, 0.3, dtype=h.dtype), torch.ones_like(h))
        elif m == "dtype read earlier":
            dtype = h.dtype
            side = self.side(x).relu()  # other calls in between
            out = (torch.full((2, 8), 0.1, dtype=dtype), side)
        elif m == "dtype passed to a callee":
            out = (_steps(h.dtype, 8),)
        elif m == "literal next to a read":
            dtype = h.dtype
            wide = h.to(torch.float32)  # RMSNorm: the literal must stay fp32
            normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
            out = (self.gain * normed.to(dtype), wide)
        else:
            raise ValueError(m)
        return (*out, h)


MEMBERS = (
    "to(y.device)",
    "to(y)",
    "type_as(y)",
    "to(y.dtype)",
    "zeros(dtype=y.dtype)",
    "full(dtype=y.dtype)",
    "new_zeros",
    "full_like",
    "dtype read earlier",
    "dtype passed to a callee",
    "literal next to a read",
)


def _eager(module: nn.Module, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype, inference: bool = False) -> object:
    with torch.autocast("cpu", dtype=dtype), (torch.inference_mode() if inference else torch.no_grad()):
        return module(*inputs)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("member", MEMBERS)
def test_every_member_follows_the_tensor_as_eager_does(member, dtype):
    x = (torch.randn(2, 8, generator=torch.Generator().manual_seed(0)),)
    module = Follower(member).eval()
    expected = _eager(module, x, dtype)
    assert_same_outputs(compile(module, x, policy="amp", low_precision_type=dtype)(*x), expected)
    wrapped = jit(module, x)
    with torch.autocast("cpu", dtype=dtype):
        assert_same_outputs(wrapped(*x), expected)


def test_a_member_is_seen_in_eager_at_all():
    # Each member's output dtype under autocast differs from the trace's float32: a
    # graph that kept the traced constants would fail the test above.
    x = (torch.randn(2, 8),)
    for member in MEMBERS:
        module = Follower(member).eval()
        with torch.no_grad():
            plain = [t.dtype for t in module(*x)]
        low = [t.dtype for t in _eager(module, x, torch.bfloat16)]  # type: ignore[attr-defined]
        assert plain != low or member == "literal next to a read", member


def _links(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, str]:
    """``{node: source node}`` for every dtype link of the standalone graph."""
    gm = standalone_graph(export_program(module, inputs))
    links = DtypeLinks(gm)
    found = {}
    for node in gm.graph.nodes:
        source = links.source(node)
        if source is not None:
            found[node.name] = source.name
    return found


def test_links_name_the_tensor_and_leave_literals_alone():
    x = (torch.randn(2, 8),)
    assert _links(Follower("to(y.device)").eval(), x) == {"to": "linear_1"}  # side(h) follows itself
    assert _links(Follower("zeros(dtype=y.dtype)").eval(), x) == {"zeros": "linear"}
    assert _links(Follower("dtype read earlier").eval(), x) == {"full": "linear"}
    # the literal h.to(torch.float32) is no link; normed.to(dtype) follows h
    literal = _links(Follower("literal next to a read").eval(), x)
    assert list(literal.values()) == ["linear"] and "to" not in literal, literal


class RefusesFloat64(nn.Module):
    """Code that only runs in float32: the probe trace fails, and the bare-dtype links are dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(x.dtype == torch.float32, lambda: "float32 only")
        h = self.proj(x)
        return torch.full((2, 8), 0.3, dtype=h.dtype), h


def test_a_failed_probe_keeps_the_traced_constants(caplog):
    x = (torch.randn(2, 8),)
    with caplog.at_level(logging.DEBUG, logger="harness.frontend.provenance"):
        ep = export_program(RefusesFloat64().eval(), x)
    assert "probe trace failed" in caplog.text
    assert not any(DTYPE_FOLLOWS in n.meta for n in ep.graph.nodes)
    cg = compile(ep, x, policy="amp", low_precision_type=torch.bfloat16)
    assert cg(*x)[0].dtype == torch.float32  # the constant as traced: no guess


def _wav2vec2() -> tuple[nn.Module, tuple[torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).eval()
    return model, (torch.randn(1, 1000, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_wav2vec2_encoder_is_bit_identical(dtype):
    model, x = _wav2vec2()
    program = export_program(model, x)
    for seed in range(2):
        with redrawn(model, seed) as module:
            expected = _eager(module, x, dtype)
            assert expected.last_hidden_state.dtype == dtype  # type: ignore[attr-defined]
            assert_same_outputs(compile(program, x, policy="amp", low_precision_type=dtype)(*x), expected)
            wrapped = jit(module, x, program=program)
            with torch.autocast("cpu", dtype=dtype):
                assert_same_outputs(wrapped(*x), expected)


def test_low_precision_weight_copies_keep_requires_grad():
    x = (torch.randn(2, 3, 28, 28),)
    cg = compile(TokenMixer().eval(), x, policy="amp", low_precision_type=torch.float16)
    copies = {name: p for name, p in cg.graph_module.named_parameters() if p.dtype == torch.float16}
    assert copies and all(p.requires_grad for p in copies.values())
    frozen = TokenMixer().eval().requires_grad_(False)
    cg = compile(frozen, x, policy="amp", low_precision_type=torch.float16)
    assert not any(p.requires_grad for p in cg.graph_module.parameters())


def test_inference_mode_is_its_own_eager_reference():
    # Under torch.inference_mode autocast's casts of parameters do not require grad, and the
    # fp16 token-mixing linear may run another kernel: compile(inference_mode=True) and jit
    # follow that too. The weight draw is one where the two eager runs differ in this process
    # (whether any does depends on the kernels the process picks; each check holds either way).
    x = (torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2)),)
    draws = []
    for seed in range(10):
        module = reseeded(TokenMixer(), seed)
        draws.append((module, _eager(module, x, torch.float16), _eager(module, x, torch.float16, inference=True)))
        if not torch.equal(draws[-1][1], draws[-1][2]):  # type: ignore[arg-type]
            break
    module, under_no_grad, under_inference = draws[-1]
    cg = compile(module, x, policy="amp", low_precision_type=torch.float16, inference_mode=True)
    assert_same_outputs(cg(*x), under_inference)
    wrapped = jit(module, x)
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.inference_mode():
            assert_same_outputs(wrapped(*x), under_inference)
        assert_same_outputs(wrapped(*x), under_no_grad)
