"""Every decision that differs by CPU, for every kind of CPU the project knows, on any machine.

The CPU engine's tactic offers and the OpenVINO backend's modes are checked
with the capability forced to each known kind (:data:`harness.engines.capability.KINDS`),
against expectations written out per kind below, so that a change breaking
one kind fails everywhere. Each kind's tables are in turn checked against
the real libraries wherever this CPU can be reduced to that kind
(``ONEDNN_MAX_CPU_ISA``, in a subprocess), so the forced answers stay the
real ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import models
from harness.autocast import compile
from harness.build import build_engine
from harness.engines import capability
from harness.engines.capability import KINDS, CpuKind
from harness.engines.cpu import CpuBackend, kernels, onednn_primitive, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.protocol import PRECISION_MODES, BuildConfig
from harness.errors import HarnessError
from harness.opnames import plan_packet

KIND_IDS = [k.name for k in KINDS]


class Mixed(nn.Module):
    """One layer of each kind whose tactics differ by CPU: a convolution (with its relu), a
    global pooling, a per-channel product, a linear layer, a layer norm and an attention."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.conv(image))
        y = y * F.adaptive_avg_pool2d(y, 1)
        q = self.norm(self.fc(tokens)).view(1, 8, 2, 32).transpose(1, 2)
        return y, F.scaled_dot_product_attention(q, q, q)


LAYERS = {
    "conv2d": "conv",
    "adaptive_avg_pool2d": "pool",
    "mul": "mul",
    "linear": "linear",
    "layer_norm": "norm",
    "scaled_dot_product_attention": "attention",
}
NATIVE = {  # every tactic of each layer, where the CPU has native kernels for the type
    "conv": {"conv_nchw", "conv_channels_last", "conv_onednn", "conv_onednn_graph", "conv_dnnl"},
    "pool": {"direct", "pool_window", "pool_dnnl"},
    "mul": {"direct", "binary_dnnl"},
    "linear": {
        "gemm_direct", "gemm_splitk2", "gemm_splitk4", "gemm_nn", "gemm_widened", "gemm_onednn",
        "gemm_onednn_graph", "gemm_dnnl",
    },  # fmt: skip
    "norm": {"layernorm_fused", "layernorm_decomposed", "layernorm_dnnl"},
    "attention": {"sdpa_fused", "sdpa_math", "sdpa_dnnl"},
}
# fp16 has no kernels in PyTorch's oneDNN Graph bridge on any CPU: its graph tactics are widened.
NATIVE_FP16 = {
    **NATIVE,
    "conv": NATIVE["conv"] - {"conv_onednn_graph"} | {"conv_onednn_graph_widened"},
    "linear": NATIVE["linear"] - {"gemm_onednn_graph"} | {"gemm_onednn_graph_widened"},
}
EMULATED = {  # where it has none: widened on fp32 kernels, ATen's fused calls, no primitive
    "conv": ({"conv_onednn_graph_widened", "conv_widened"}, {"conv_nchw", "conv_channels_last", "conv_onednn", "conv_dnnl"}),
    "pool": ({"direct", "pool_window"}, {"pool_dnnl"}),
    "mul": ({"direct"}, {"binary_dnnl"}),
    "linear": (
        {"gemm_widened", "gemm_onednn_graph_widened"},
        {"gemm_direct", "gemm_splitk2", "gemm_splitk4", "gemm_nn", "gemm_onednn", "gemm_dnnl"},
    ),
    "norm": ({"layernorm_fused", "layernorm_decomposed"}, {"layernorm_dnnl"}),
    "attention": ({"sdpa_fused"}, {"sdpa_math", "sdpa_dnnl"}),
}


def _emulated(precision: str) -> dict[str, tuple[set[str], set[str]]]:
    if precision == "fp16":
        return EMULATED
    # bf16 has bridge kernels where it is native: left out, with the others, where it is not.
    return {
        **EMULATED,
        "conv": (EMULATED["conv"][0], EMULATED["conv"][1] | {"conv_onednn_graph"}),
        "linear": (EMULATED["linear"][0], EMULATED["linear"][1] | {"gemm_onednn_graph"}),
    }


def _expected(kind: str, precision: str) -> dict[str, tuple[set[str], set[str]]]:
    """layer -> (offered, left out) for ``kind`` and ``precision``, written out per kind."""
    native = {layer: (impls, set()) for layer, impls in (NATIVE_FP16 if precision == "fp16" else NATIVE).items()}
    return {
        ("avx2", "bf16"): _emulated("bf16"),
        ("avx2", "fp16"): _emulated("fp16"),
        ("avx512-bf16", "bf16"): native,
        ("avx512-bf16", "fp16"): _emulated("fp16"),
        ("avx512-fp16-amx", "bf16"): native,
        ("avx512-fp16-amx", "fp16"): native,
    }[(kind, precision)]


@pytest.fixture(scope="module")
def mixed_plans():
    gen = torch.Generator().manual_seed(21)
    module = Mixed().eval()
    inputs = (torch.randn(1, 8, 4, 4, generator=gen), torch.randn(1, 8, 64, generator=gen))
    plans = {}
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        compiled = compile(module, inputs, policy="full", low_precision_type=dtype)
        plans[precision] = lower(compiled.graph_module, precision)[0]
    return plans


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_each_kind_is_offered_exactly_the_tactics_it_has_native_kernels_for(mixed_plans, kind, precision):
    plan = mixed_plans[precision]
    metas = plan.value_metas()
    seen = {}
    with capability.forced(kind):
        for node in plan.nodes:
            layer = LAYERS.get(plan_packet(node.op))
            if layer is not None and node.is_layer:
                found = seen[layer] = tactics.offer(node, metas, plan.weights)
                for impl, why in found.left_out.items():  # and bind refuses what it leaves out
                    with pytest.raises(HarnessError, match=f"no implementation {impl!r} here \\({re.escape(why)}\\)"):
                        tactics.bind(node, impl, metas, plan.weights)
    expected = _expected(kind.name, precision)
    assert set(seen) == set(expected)
    for layer, (offered, left_out) in expected.items():
        assert set(seen[layer].impls) == offered, layer
        assert set(seen[layer].left_out) == left_out, layer
        for impl, why in seen[layer].left_out.items():  # each says why, in this kind's terms
            if impl.endswith("dnnl"):
                assert why.startswith(f"oneDNN has no {precision} "), (layer, impl, why)
            else:
                assert why.startswith(f"torch has no native {precision} "), (layer, impl, why)


def test_fp32_layers_get_every_tactic_on_every_kind(mixed_plans):
    gen = torch.Generator().manual_seed(21)
    module = Mixed().eval()
    inputs = (torch.randn(1, 8, 4, 4, generator=gen), torch.randn(1, 8, 64, generator=gen))
    plan = lower(compile(module, inputs, policy="fp32").graph_module, "fp32")[0]
    metas = plan.value_metas()
    for kind in KINDS:
        with capability.forced(kind):
            found = [tactics.offer(n, metas, plan.weights) for n in plan.nodes if n.is_layer]
        assert not any(f.left_out for f in found), kind.name
        assert {"conv_dnnl", "conv_no_mkldnn", "gemm_dnnl", "pool_dnnl", "sdpa_dnnl"} <= {i for f in found for i in f.impls}


EXPECTED_OPENVINO_MODES = {
    "avx2": {"fp32", "explicit"},
    "avx512-bf16": {"fp32", "bf16", "weak-bf16", "autocast-bf16", "amp-bf16", "explicit"},
    "avx512-fp16-amx": {"fp32", "bf16", "weak-bf16", "weak-fp16", "autocast-bf16", "amp-bf16", "explicit"},
}


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_openvino_offers_the_modes_each_kind_runs_and_refuses_the_rest_saying_what_it_ran(kind):
    pytest.importorskip("openvino")
    from harness.engines.openvino.backend import OpenVinoBackend

    backend = OpenVinoBackend()
    with capability.forced(kind):
        supported = set(backend.supported_modes())
        assert supported == EXPECTED_OPENVINO_MODES[kind.name]
        for mode in sorted(set(PRECISION_MODES) - supported):
            with pytest.raises(HarnessError, match=f"cannot build {mode}: .* ran .* in (fp32|bf16)"):
                backend.check_mode(mode)


# --- the tables against the real libraries -----------------------------------------------------

_REAL_ANSWERS = """
import json
from harness.engines import capability
from harness.engines.cpu import kernels, onednn_primitive
machine = capability.current()
print(json.dumps({
    "isa": onednn_primitive.library().isa,
    "kernels": kernels.standard_kernels(),
    "native": sorted(p for p in ("bf16", "fp16") if machine.aten_native(p)),
}))
"""


def _answers_reduced_to(kind: CpuKind) -> dict:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": kind.onednn_isa}
    done = subprocess.run([sys.executable, "-c", _REAL_ANSWERS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_kind_s_tables_are_the_real_answers_of_this_cpu_reduced_to_it(kind):
    if onednn_primitive.library() is None:
        pytest.skip("the onednn extra is not installed: there is no oneDNN to reduce")
    real = _answers_reduced_to(kind)
    if real["isa"] != kind.onednn_isa_value:
        pytest.skip(
            f"this CPU cannot be reduced to {kind.name}: oneDNN's effective ISA here is at most "
            f"{real['isa']:#x}, below {kind.onednn_isa} ({kind.onednn_isa_value:#x}); its table is {kind.source}"
        )
    assert real["kernels"] == {key: kind.kernels.get(key) for key in real["kernels"]}
    assert set(real["native"]) == set(kind.native)


def test_this_cpu_s_openvino_answers_are_its_kind_s_where_it_is_one():
    pytest.importorskip("openvino")
    from harness.engines.openvino import probe

    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip(
            "oneDNN is reduced here (ONEDNN_MAX_CPU_ISA): OpenVINO's CPU plugin still reads the CPU's own "
            "flags, so its answers are not those of the kind oneDNN is reduced to"
        )
    isa = onednn_primitive.library().isa if onednn_primitive.library() is not None else None
    mine = [k for k in KINDS if k.onednn_isa_value == isa]
    if not mine:
        pytest.skip(f"this CPU (oneDNN ISA {isa}) is none of the known kinds: {', '.join(KIND_IDS)}")
    (kind,) = mine
    for question, ran_in in kind.openvino.items():
        assert probe.probe(*question.split()).ran_in == ran_in, question


# --- per-layer kernels and the build's notes -------------------------------------------------------


class RefForGroupedConvolutions:
    """This machine's answers, except a reference loop for every grouped convolution: what
    oneDNN 3.2 gives a grouped, dilated one with a residual on an AVX2 CPU, on any CPU."""

    name = "grouped convolutions on reference loops"

    def __init__(self) -> None:
        self.real = capability.ThisMachine()

    def aten_native(self, precision: str) -> bool:
        return self.real.aten_native(precision)

    def onednn_kernel(self, primitive, precision, signature, describe):
        _, args, _ = signature
        if primitive == "convolution" and args[6] > 1:  # Convolution(..., groups, ...)
            return "ref:any"
        return self.real.onednn_kernel(primitive, precision, signature, describe)

    def openvino_runs_in(self, dtype: str, hint: str) -> str | None:
        return None


class TwoConvolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain, self.grouped = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(self.plain(x))


def test_a_layer_whose_own_primitive_is_a_reference_loop_is_left_out_and_the_build_says_so(tmp_path):
    if not kernels.available("convolution", "fp32"):
        pytest.skip("no oneDNN convolution here at all (the onednn extra is not installed)")
    spec = models.ModelSpec("two-convs", "two convolutions", TwoConvolutions().eval(), (torch.randn(1, 8, 8, 8),), [])
    with capability.forced(RefForGroupedConvolutions()):
        result = build_engine(spec, BuildConfig("fp32", options={"timing_runs": 1, "warmup_runs": 0}), CpuBackend())
    tactics_of = {layer.name: layer.tactic for layer in result.engine.layers()}
    grouped = next(t for t in result.log.layers if t.layer == "conv2d_1")
    assert not any(c.tactic.startswith("conv_dnnl") for c in grouped.candidates)
    assert any(c.tactic.startswith("conv_dnnl") for c in next(t for t in result.log.layers if t.layer == "conv2d").candidates)
    assert not tactics_of["conv2d_1"].startswith("conv_dnnl")
    (note,) = [m for m in result.log.messages if m.startswith("not offered on this CPU: conv_dnnl")]
    assert note == (
        "not offered on this CPU: conv_dnnl[fp32] for 1 layer(s) (e.g. 'conv2d_1'): oneDNN has only its "
        "reference loop for this fp32 convolution here (ref:any), so not worth timing"
    )


def test_the_kernel_probe_creates_nothing_and_asks_once_per_layer_and_thread_count(monkeypatch):
    if onednn_primitive.library() is None:
        pytest.skip("the onednn extra is not installed")
    asked, created = [], []
    real_kernel_of, real_primitive = onednn_primitive.kernel_of, onednn_primitive._Library.primitive
    monkeypatch.setattr(onednn_primitive, "kernel_of", lambda *a, **k: asked.append(a[0]) or real_kernel_of(*a, **k))
    monkeypatch.setattr(onednn_primitive._Library, "primitive", lambda self, pd: created.append(pd) or real_primitive(self, pd))
    spec = models.load("transformer")
    compiled = compile(spec.module, spec.example_inputs, policy="fp32")
    plan = lower(compiled.graph_module, "fp32")[0]
    metas = plan.value_metas()
    threads = torch.get_num_threads()
    with capability.forced(capability.ThisMachine()):
        offers = [tactics.offer(n, metas, plan.weights) for n in plan.nodes if n.is_layer]
        first = len(asked)
        for _ in range(2):
            for node in plan.nodes:
                if node.is_layer:
                    tactics.offer(node, metas, plan.weights)
        again = len(asked)
        torch.set_num_threads(1 if threads != 1 else 2)
        try:
            for node in plan.nodes:
                if node.is_layer:
                    tactics.offer(node, metas, plan.weights)
        finally:
            torch.set_num_threads(threads)
    assert created == []
    on_primitives = sum(1 for f in offers for i in (*f.impls, *f.left_out) if i in (*tactics.PRIMITIVE_IMPLS, tactics.SDPA_DNNL))
    # Once per distinct layer (the transformer's two blocks share their shapes), again only at
    # another thread count.
    assert 0 < first < on_primitives and again == first and len(asked) == 2 * first


def test_a_bf16_build_on_an_avx2_cpu_times_only_what_it_offers_and_says_what_it_left_out():
    """Forced to the AVX2 kind (whose kernels this CPU has too), a real build: no left-out
    tactic is timed or chosen, and the build's notes name them with the reason."""
    spec = models.load("transformer")
    with capability.forced(capability.AVX2):
        result = build_engine(spec, BuildConfig("bf16", options={"timing_runs": 1, "warmup_runs": 0}), CpuBackend())
    emulated = {"gemm_direct", "gemm_splitk2", "gemm_splitk4", "gemm_nn", "gemm_onednn", "gemm_onednn_graph", "sdpa_math"}
    timed = {tactics.parse_tactic(c.tactic)[0] for layer in result.log.layers for c in layer.candidates}
    chosen = {tactics.parse_tactic(layer.tactic)[0] for layer in result.engine.layers()}
    assert not (timed | chosen) & (emulated | {"gemm_dnnl", "sdpa_dnnl", "layernorm_dnnl"})
    assert "gemm_widened" in timed
    notes = [m for m in result.log.messages if m.startswith("not offered on this CPU")]
    assert any("gemm_direct[bf16]" in m and "torch has no native bf16 matmul" in m for m in notes)
    assert any("gemm_dnnl[bf16]" in m and "oneDNN has no bf16 matmul kernel here" in m for m in notes)
    with torch.inference_mode():
        out = result.engine.run(*spec.example_inputs)[0]
        reference = spec.module(*spec.example_inputs)
    torch.testing.assert_close(out.float(), reference.float(), rtol=0.05, atol=0.05)


class Products(nn.Module):
    """Every matmul form ATen has besides linear, with constant and computed operands."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(23)
        self.register_buffer("w", torch.randn(32, 24, generator=gen))
        self.register_buffer("b", torch.randn(24, generator=gen))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.addmm(self.b, x, self.w), torch.mm(x, self.w), torch.bmm(y, y.transpose(1, 2)), y @ y.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_where_a_type_is_emulated_every_matmul_is_widened_exactly_and_rounded_once(dtype):
    """On a kind without native kernels for ``dtype`` (AVX2), addmm, mm, bmm and matmul run as
    ``gemm_widened``: exact products in fp32, fp32 accumulation, one rounding to ``dtype``."""
    gen = torch.Generator().manual_seed(24)
    inputs = (torch.randn(16, 32, generator=gen), torch.randn(2, 8, 32, generator=gen))
    compiled = compile(Products().eval(), inputs, policy="full", low_precision_type=dtype)
    plan = lower(compiled.graph_module, "low")[0]
    metas = plan.value_metas()
    values = {name: t.to(dtype) for (name, _), t in zip(plan.inputs, inputs, strict=True)}
    widened = 0
    with capability.forced(capability.AVX2), torch.inference_mode():
        for node in plan.nodes:
            args = [values[r.name] for r in node.refs()]
            found = tactics.offer(node, metas, plan.weights)
            if plan_packet(node.op) not in ("addmm", "mm", "bmm", "matmul"):
                values[node.name] = tactics.bind(node, found.impls[0], metas, plan.weights)(*args)
                continue
            assert found.impls == ("gemm_widened",), (node.name, found)
            assert "gemm_direct" in found.left_out
            out = values[node.name] = tactics.bind(node, "gemm_widened", metas, plan.weights)(*args)
            wide = [a.double() for a in args]
            weights = {k: w.double() for k, w in plan.weights.items()}
            packet = plan_packet(node.op)
            if packet == "addmm":
                exact = torch.addmm(weights[node.args[0].name], wide[0], weights[node.args[2].name])
            elif packet == "mm":
                exact = wide[0] @ weights[node.args[1].name]
            else:
                exact = wide[0] @ wide[1]
            assert out.dtype == dtype
            # fp32 accumulation of exact products, then one rounding: within one step of the exact sum.
            step = exact.abs().clamp_min(1e-3) * torch.finfo(dtype).eps
            assert bool(((out.double() - exact).abs() <= step).all()), node.name
            widened += 1
    assert widened == 4
