"""``sdpa_dnnl``: attention as oneDNN's batched matmul, softmax and matmul, called through
libdnnl's C API.

References: PyTorch's ``scaled_dot_product_attention`` on the same values in
fp32, the error of ATen's own fused call in bf16, eager models (the zoo's
transformer, `transformers`' BERT from a small config), and the engine's own
saved files.
"""

from __future__ import annotations

import importlib.metadata
import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import models
from harness.autocast import compile
from harness.build import build_engine
from harness.cache.timing_cache import TimingCache
from harness.dtypes import dtype_from_name
from harness.engines.cpu import CpuBackend, CpuEngine, builder, kernels, onednn_attention, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.onednn_attention import Attention, split_heads_strides
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.opnames import plan_packet
from harness.outputs import tensor_paths

INSTALLED = any(d.metadata["Name"] == "onednn-cpu-gomp" for d in importlib.metadata.distributions())
pytestmark = pytest.mark.skipif(not INSTALLED, reason="the onednn extra has no wheel for this platform")

DTYPES = [torch.float32] + [dtype_from_name(p) for p in ("bf16", "fp16") if kernels.available("attention", p)]
# (query, key, value) shapes: heads of a transformer, keys longer than queries with wider
# values, and 3-D operands (batch and heads in one dimension).
SHAPES = {
    "heads": ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)),
    "longer-keys": ((2, 3, 5, 8), (2, 3, 12, 8), (2, 3, 12, 16)),
    "3d": ((6, 16, 8), (6, 16, 8), (6, 16, 8)),
}


def _split(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A 4-D operand with its heads split from a [B, S, H, D] tensor, as models make them."""
    if len(shape) != 4:
        return torch.randn(shape, generator=gen).to(dtype)
    b, h, s, d = shape
    return torch.randn(b, s, h * d, generator=gen).to(dtype).view(b, s, h, d).transpose(1, 2)


def _mask(kind: str, scores: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | None:
    """No mask; a boolean one over queries and keys (every query keeps its first key); or a
    padding one, added, per batch and key (the most negative finite value, as `transformers`
    writes it) broadcast over heads and queries."""
    if kind == "bool":
        keep = torch.rand(scores[-2:], generator=gen) > 0.4
        keep[:, 0] = True
        return keep
    if kind == "padding":
        padded = torch.zeros(scores[0], *([1] * (len(scores) - 2)), scores[-1])
        padded[..., -3:] = torch.finfo(dtype).min
        return padded.to(dtype)
    return None


def _close_to_reference(got: torch.Tensor, reference: torch.Tensor, fused: torch.Tensor) -> None:
    """fp32: the exact function's value; bf16: as close as ATen's own fused call, within a
    rounding (the last product rounds once, the softmax's result once before it)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
        return
    error, fused_error = ((t.float() - reference).abs().max().item() for t in (got, fused))
    assert error <= 2 * max(fused_error, 2**-8), (error, fused_error)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["none", "bool", "padding", "causal"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_the_attention_computes_scaled_dot_product_attention(case, mask, dtype):
    gen = torch.Generator().manual_seed(5)
    shapes = SHAPES[case]
    q, k, v = (_split(shape, dtype, gen) for shape in shapes)
    scores = (*shapes[0][:-1], shapes[1][-2])
    causal = mask == "causal"
    attn_mask = _mask(mask, scores, dtype, gen)
    scale = 0.3 if case == "longer-keys" else None
    attention = Attention(dtype, *shapes, scale, mask=attn_mask, causal=causal)
    got = attention(q, k, v)
    kwargs = {"attn_mask": attn_mask, "is_causal": causal, "scale": scale}
    float_mask = None if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    reference = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), **{**kwargs, "attn_mask": float_mask if float_mask is not None else attn_mask}
    )
    fused = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert got.dtype == dtype and got.shape == fused.shape
    _close_to_reference(got, reference, fused)
    # Laid out as ATen's fused call lays it out: merging the heads back is a view.
    assert got.stride() == split_heads_strides(got.shape)
    if got.dim() == 4:
        merged = got.transpose(1, 2).reshape(got.shape[0], got.shape[2], -1)
        assert merged.data_ptr() == got.data_ptr() and merged._base is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_operands_of_any_strides_are_read_as_their_values(dtype):
    """One object, operands of several layouts: each gets primitives of its own strides, or
    runs on contiguous copies where oneDNN has only a reference kernel for them."""
    gen = torch.Generator().manual_seed(6)
    shape = (2, 4, 16, 8)
    base = [_split(shape, dtype, gen) for _ in range(3)]
    wide = torch.randn(2, 4, 16, 16, generator=gen).to(dtype)
    shared_key = torch.randn(2, 1, 16, 8, generator=gen).to(dtype)
    layouts = {
        "split heads": base,
        "contiguous": [t.contiguous() for t in base],
        "query every other column": [wide[..., ::2], base[1], base[2]],
        "key columns first": [base[0], base[1].transpose(-2, -1).contiguous().transpose(-2, -1), base[2]],
        "one key for every head": [base[0], shared_key.expand(shape), base[2]],
    }
    attention = Attention(dtype, shape, shape, shape)
    for name, (q, k, v) in layouts.items():
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        got = attention(q, k, v)
        _close_to_reference(got, reference, F.scaled_dot_product_attention(q, k, v))
        assert torch.equal(attention(q.contiguous(), k.contiguous(), v.contiguous()), got), name
    # Both ways were taken: a strided column and a key shared by heads have only reference kernels.
    assert {shared is None for shared in attention._shared.values()} == {True, False}


def test_operands_it_was_not_made_for_are_refused_before_it_reads_them():
    shape = (1, 2, 8, 4)
    attention = Attention(torch.float32, shape, shape, shape)
    q = torch.zeros(shape)
    with pytest.raises(HarnessError, match=r"sdpa_dnnl: expected query, key and value fp32 \(1, 2, 8, 4\)"):
        attention(q, q, torch.zeros(1, 2, 8, 5))
    with pytest.raises(HarnessError, match="got torch.float32 .*torch.bfloat16"):
        attention(q, q, q.bfloat16())
    attention(q, q, q)  # the call made for these strides checks too
    with pytest.raises(HarnessError, match="expected query, key and value"):
        attention(q, q, q.double())


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 6, 4)), {}, "do not make an attention it runs"),
        (((1, 2, 8, 4), (1, 1, 8, 4), (1, 1, 8, 4)), {}, "no broadcasting"),
        (((8, 4), (8, 4), (8, 4)), {}, "3 to 12 dimensions"),
        (((1, 8, 2048, 4), (1, 8, 1024, 4), (1, 8, 1024, 4)), {}, "scores of at most 32 MiB"),
        (((1, 2, 8, 4),) * 3, {"mask": torch.ones(8, 8, dtype=torch.bool).triu(1)}, "hides every key from some query"),
        (((1, 2, 8, 4),) * 3, {"mask": torch.zeros(8, 8), "causal": True}, "a mask or is causal, not both"),
        (((1, 2, 8, 4),) * 3, {"mask": torch.zeros(3, 8, 8)}, r"a mask \(1, 3, 8, 8\) does not broadcast"),
    ],
)
def test_what_it_cannot_compute_as_aten_does_is_refused_with_the_reason(shapes, kwargs, match):
    with pytest.raises(HarnessError, match=match):
        Attention(torch.float32, *shapes, **kwargs)


def test_threads_and_thread_counts_each_get_their_own_calls():
    gen = torch.Generator().manual_seed(8)
    shape = (2, 4, 16, 8)
    attention = Attention(torch.float32, shape, shape, shape)
    operands = [[_split(shape, torch.float32, gen) for _ in range(3)] for _ in range(4)]
    expected = [F.scaled_dot_product_attention(*qkv) for qkv in operands]
    failures: list[BaseException] = []

    def work(threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            for _ in range(50):
                for qkv, want in zip(operands, expected, strict=True):
                    torch.testing.assert_close(attention(*qkv), want, rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    before = torch.get_num_threads()
    workers = [threading.Thread(target=work, args=(n,)) for n in (1, 2, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == [] and torch.get_num_threads() == before


class Masks(nn.Module):
    """Four attentions: unmasked, a constant boolean mask, causal, and a mask given as an input."""

    def __init__(self) -> None:
        super().__init__()
        keep = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.5
        keep[:, 0] = True
        self.register_buffer("keep", keep)

    def forward(self, x: torch.Tensor, given: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = x.view(2, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=given),
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_it_is_offered_with_a_constant_mask_or_none_and_computes_each_layer(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    inputs = (torch.randn(2, 16, 48, generator=gen), torch.rand(16, 16, generator=gen) > 0.5)
    mode, low = ("fp32", None) if dtype == torch.float32 else ("full", dtype)
    compiled = compile(Masks().eval(), inputs, policy=mode, low_precision_type=low)
    plan, _ = lower(compiled.graph_module, "test")
    metas = plan.value_metas()
    layers = [n for n in plan.nodes if plan_packet(n.op) == "scaled_dot_product_attention"]
    offered = ["sdpa_dnnl" in tactics.impl_names(n, metas, plan.weights) for n in layers]
    assert offered == [True, True, True, False]
    # Scores beyond MAX_SCORES_BYTES are left to ATen's fused call, which holds a block at a time.
    monkeypatch.setattr(onednn_attention, "MAX_SCORES_BYTES", 2 * 16 * 16 * 4 - 1)
    assert not any("sdpa_dnnl" in tactics.impl_names(n, metas, plan.weights) for n in layers)
    monkeypatch.undo()
    for i, node in enumerate(plan.nodes):
        if node.is_layer:
            impl = "sdpa_dnnl" if node in layers[:3] else tactics.impl_names(node, metas, plan.weights)[0]
            plan.nodes[i] = replace(node, tactic=tactics.tactic_name(impl, node.outputs[0].dtype))
    engine = CpuEngine(plan)
    names = [node.name for node in layers]
    chosen = {layer.name: layer.tactic for layer in engine.layers()}
    assert [chosen[name].split("[")[0] for name in names] == ["sdpa_dnnl"] * 3 + ["sdpa_fused"]
    # The typed graph run eagerly: the same bf16 values but for the attentions' last roundings.
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    with torch.inference_mode():
        for got, want in zip(engine.run(*inputs), compiled(*inputs), strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _prefer_attention_on_dnnl(fns, run_inputs, timing):
    """Doubled per-layer timing: ``sdpa_dnnl`` is an attention's fastest, every other layer's
    first candidate is its fastest."""
    return [0.5 if isinstance(fn, Attention) else float(i + 1) for i, fn in enumerate(fns)]


@pytest.mark.parametrize("name", ["transformer", "hf-bert"])
def test_an_engine_with_attention_on_it_matches_eager_and_survives_save_and_load(name, monkeypatch, tmp_path):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    spec = models.load(name)
    monkeypatch.setattr(builder, "median_ms", _prefer_attention_on_dnnl)
    monkeypatch.setattr(builder, "run_ms", lambda plans, run_inputs, timing: [1.0, 2.0])
    config = BuildConfig(mode="fp32", options={"timing_runs": 1, "warmup_runs": 0})
    built = build_engine(spec, config, CpuBackend(), tmp_path / "cache.json")
    layers = {layer.name: layer.tactic for layer in built.engine.layers()}
    attention = {n: t for n, t in layers.items() if n.startswith("scaled_dot_product_attention")}
    assert len(attention) == 2 and set(attention.values()) == {"sdpa_dnnl[fp32]"}
    recorded = {e.layer: e.tactic for e in TimingCache.load(tmp_path / "cache.json").entries()}
    assert {recorded[n] for n in attention} == {"sdpa_dnnl[fp32]"}
    with torch.inference_mode():
        got, want = tensor_paths(built.engine(*spec.example_inputs)), tensor_paths(spec.module(*spec.example_inputs))
        assert [path for path, _ in got] == [path for path, _ in want]
        for (path, a), (_, b) in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=path)
        out = built.engine.run(*spec.example_inputs)
        built.engine.save(tmp_path / "e")
        again = CpuEngine.load(tmp_path / "e").run(*spec.example_inputs)
        assert all(torch.equal(a, b) for a, b in zip(again, out, strict=True))
