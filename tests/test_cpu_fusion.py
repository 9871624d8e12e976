"""The CPU engine's fusions and layout tactics: residual adds and more activations folded into
convolutions and GEMMs, 1x1 convolutions as GEMMs, widened low-precision GEMMs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import models
from harness.autocast import compile
from harness.build import build_engine, compile_graph
from harness.cache.operations import pin
from harness.cache.timing_cache import TimingCache
from harness.dtypes import dtype_name
from harness.engines import capability
from harness.engines.cpu import CpuBackend, CpuEngine, onednn_graph, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.plan import Ref
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
from harness.models import ModelSpec
from harness.opnames import plan_packet
from tests.helpers import bits_equal

FAST = {"timing_runs": 3, "warmup_runs": 1}
ONEDNN = torch.backends.mkldnn.is_available()


class Blocks(nn.Module):
    """conv + BN + hardswish; depthwise conv + relu; squeeze-excite (pool, 1x1 convs on a 1x1
    map with relu and hardsigmoid, rescale); 1x1 projection + residual; a ResNet block whose
    strided 1x1 shortcut is added (then relu) to its 3x3 conv; linear + hardswish; linear +
    residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.se1 = nn.Conv2d(16, 8, 1)
        self.se2 = nn.Conv2d(8, 16, 1)
        self.project = nn.Conv2d(16, 16, 1)
        self.conv1 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.shortcut = nn.Conv2d(16, 32, 1, stride=2)
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.hardswish(self.bn(self.stem(x)))
        y = F.relu(self.dw(x))
        s = F.hardsigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(y, 1)))))
        x = x + self.project(y * s)
        x = F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))
        h = F.hardswish(self.fc1(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))
        return self.fc2(h) + h


def make_blocks() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(3)
    net = Blocks()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.8)
        net.bn.running_mean = torch.rand(16, generator=gen) * 0.4 - 0.2
        net.bn.running_var = torch.rand(16, generator=gen) + 0.5
    return net.eval(), (torch.randn(2, 3, 12, 12, generator=gen),)


@pytest.fixture(scope="module")
def blocks() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return make_blocks()


@pytest.fixture(scope="module")
def spec(blocks) -> ModelSpec:
    module, inputs = blocks
    return ModelSpec("blocks", "fusion workload", module, inputs, [inputs])


def _plan(blocks, mode: str = "fp32", low: torch.dtype | None = None):
    module, inputs = blocks
    compiled = compile(module, inputs, policy=mode, low_precision_type=low)
    plan, messages = lower(compiled.graph_module, "test")
    return compiled, plan, messages


def test_activations_and_residual_adds_become_epilogues_of_the_larger_kernel(blocks):
    _, plan, messages = _plan(blocks)
    # No activation or add is left as a layer of its own.
    assert not {"relu", "hardswish", "hardsigmoid", "add"} & {plan_packet(n.op) for n in plan.nodes}
    order = [n.name for n in plan.nodes]
    epilogues = {n.name: n.epilogue for n in plan.nodes if n.epilogue}
    assert sorted(epilogues.values()) == sorted(
        ["hardswish", "relu", "relu", "hardsigmoid", "relu", "relu", "hardswish"]
    )
    residual_layers = [n for n in plan.nodes if n.residual is not None]
    assert len(residual_layers) == 3
    # The ResNet block's add goes to the 3x3 convolution (more multiply-adds than its 1x1
    # shortcut), whose input is the shortcut's: the shortcut now runs first.
    block = next(n for n in residual_layers if n.epilogue == "relu" and plan_packet(n.op) == "conv2d")
    shortcut_node = next(n for n in plan.nodes if n.name == block.residual.name)
    assert tuple(plan.weights[shortcut_node.weight_refs()[0].name].shape[2:]) == (1, 1)
    assert order.index(shortcut_node.name) < order.index(block.name)
    # The last linear takes the add whose other summand (fc1's output) has two users.
    linears = [n for n in plan.nodes if plan_packet(n.op) == "linear"]
    assert [n.epilogue for n in linears] == ["hardswish", ""]
    assert linears[1].residual == Ref(linears[0].name)
    assert sum("fused residual" in m for m in messages) == 3
    assert any("fused activation hardswish" in m for m in messages)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_every_tactic_of_every_fused_layer_agrees_with_the_typed_graph(blocks, dtype, tol):
    compiled, plan, _ = _plan(blocks, *(("fp32", None) if dtype == torch.float32 else ("full", dtype)))
    _, inputs = blocks
    metas = plan.value_metas()
    values = {name: t for (name, _), t in zip(plan.inputs, inputs, strict=True)}
    tried: set[str] = set()
    left_out: dict[str, str] = {}
    with torch.inference_mode():
        for node in plan.nodes:
            args = [values[r.name] for r in node.refs()]
            found = tactics.offer(node, metas, plan.weights)
            impls, _ = found.impls, left_out.update(found.left_out)
            outs = {impl: tactics.bind(node, impl, metas, plan.weights)(*args) for impl in impls}
            reference = values[node.name] = outs[impls[0]]
            for impl, out in outs.items():
                assert out.dtype == reference.dtype and out.shape == reference.shape, (node.name, impl)
                torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol, msg=f"{node.name} {impl}")
                tried.add(impl)
        (out,) = [values[o.name] for o in plan.outputs]
        torch.testing.assert_close(out.float(), compiled(*inputs).float(), rtol=tol, atol=tol)
    expected = {"conv1x1_gemm", "gemm_nn"} | ({"conv1x1_onednn", "conv_onednn", "gemm_onednn"} if ONEDNN else set())
    if onednn_graph.available(dtype_name(dtype)):
        expected |= {"conv_onednn_graph", "gemm_onednn_graph"}
    if dtype != torch.float32:
        expected |= {"conv1x1_widened", "gemm_widened"}
    # Each ran and agreed, or this CPU left it out with its reason (never where torch has native kernels).
    assert expected <= tried | set(left_out)
    assert all(left_out[impl] for impl in expected - tried)
    if capability.current().aten_native(dtype_name(dtype)):
        assert expected <= tried


def test_pointwise_convolution_tactics_take_inputs_in_any_layout(blocks):
    """1x1 convolutions as GEMMs view their channels-last input as rows: an NCHW input (and,
    on a 1x1 map, either stride pattern of the same memory) must give the same result."""
    _, plan, _ = _plan(blocks)
    _, inputs = blocks
    metas = plan.value_metas()
    values = {name: t for (name, _), t in zip(plan.inputs, inputs, strict=True)}
    checked = 0
    with torch.inference_mode():
        for node in plan.nodes:
            args = [values[r.name] for r in node.refs()]
            impls = tactics.impl_names(node, metas, plan.weights)
            values[node.name] = reference = tactics.bind(node, impls[0], metas, plan.weights)(*args)
            for impl in (i for i in impls if i.startswith("conv1x1")):
                fn = tactics.bind(node, impl, metas, plan.weights)
                for layout in (torch.contiguous_format, torch.channels_last):
                    out = fn(*(a.contiguous(memory_format=layout) for a in args))
                    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5, msg=f"{node.name} {impl}")
                    checked += 1
    assert checked >= 2 * 2 * 4  # the two squeeze-excite convs (1x1 map), the projection, the shortcut


def test_tactics_leave_their_inputs_and_the_residual_untouched(blocks):
    _, plan, _ = _plan(blocks)
    metas = plan.value_metas()
    (layer,) = [n for n in plan.nodes if n.residual is not None and plan_packet(n.op) == "linear"]
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(2, 32, generator=gen) for _ in range(2))
    kept = (x.clone(), residual.clone())
    with torch.inference_mode():
        for impl in tactics.impl_names(layer, metas, plan.weights):
            tactics.bind(layer, impl, metas, plan.weights)(x, residual)
            assert torch.equal(x, kept[0]) and torch.equal(residual, kept[1]), impl


class _Dense(nn.Module):
    """A linear layer, optionally plus a residual, optionally then relu."""

    def __init__(self, activation: str, residual: bool) -> None:
        super().__init__()
        self.fc, self.activation, self.residual = nn.Linear(64, 64), activation, residual

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) + r if self.residual else self.fc(x)
        return F.relu(y) if self.activation else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [64, 4096])  # the bias expanded once, and too large for that
@pytest.mark.parametrize(("activation", "residual"), [("", False), ("relu", False), ("relu", True)])
def test_row_gemm_computes_addmms_own_bits_with_its_bias_expanded_or_not(dtype, rows, activation, residual):
    """gemm_nn copies a small bias expanded to its rows and fuses relu through
    _addmm_activation: faster calls of the same kernels, so bit-identical to addmm(bias,
    x, w.T), then the residual, then the activation."""
    gen = torch.Generator().manual_seed(6)
    module = _Dense(activation, residual).eval()
    x, r = (torch.randn(rows, 64, generator=gen) for _ in range(2))
    policy = ("fp32", None) if dtype == torch.float32 else ("full", dtype)
    compiled = compile(module, (x, r), policy=policy[0], low_precision_type=policy[1])
    plan, _ = lower(compiled.graph_module, "test")
    (layer,) = [n for n in plan.nodes if tactics.layer_type(n) == "matmul"]
    assert layer.epilogue == activation and (layer.residual is not None) == residual
    weight, bias = (t.to(dtype) for t in (module.fc.weight, module.fc.bias))
    xt, rt = x.to(dtype), r.to(dtype)
    found = tactics.offer(layer, plan.value_metas(), plan.weights)
    if "gemm_nn" not in found.impls:  # ATen's own bf16 GEMM here converts every element in software
        assert not capability.current().aten_native(dtype_name(dtype))
        with pytest.raises(HarnessError, match=f"no implementation 'gemm_nn' here \\(torch has no native {dtype_name(dtype)}"):
            tactics.bind(layer, "gemm_nn", plan.value_metas(), plan.weights)
        return
    with torch.inference_mode():
        out = tactics.bind(layer, "gemm_nn", plan.value_metas(), plan.weights)(xt, *([rt] if residual else []))
        expected = torch.addmm(bias, xt, weight.t())
        expected = expected + rt if residual else expected
    assert bits_equal(out, expected.relu() if activation else expected)


def test_widened_gemm_keeps_bf16_in_and_out_with_one_rounding():
    """bf16 products are exact in fp32: the widened GEMM computes what a bf16 GEMM with fp32
    accumulation computes, to within the accumulation order, and rounds once."""
    gen = torch.Generator().manual_seed(5)
    module = nn.Linear(96, 24).eval()
    x = torch.randn(16, 96, generator=gen)
    compiled = compile(module, (x,), policy="full", low_precision_type=torch.bfloat16)
    plan, _ = lower(compiled.graph_module, "bf16")
    (layer,) = [n for n in plan.nodes if tactics.layer_type(n) == "matmul"]
    metas = plan.value_metas()
    xb = x.to(torch.bfloat16)
    with torch.inference_mode():
        out = tactics.bind(layer, "gemm_widened", metas, plan.weights)(xb)
    weight, bias = (t.to(torch.bfloat16).double() for t in (module.weight, module.bias))
    exact = (xb.double() @ weight.T + bias).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # One rounding of a value accurate to fp32 accumulation: at most one bf16 step off.
    step = exact.double().abs().clamp_min(1e-3) * 2**-7
    assert bool(((out.double() - exact.double()).abs() <= step).all())


@pytest.mark.parametrize("mode", ["fp32", "bf16", "weak-bf16"])
def test_fused_engine_matches_eager_within_the_modes_tolerance(spec, mode):
    engine, log = CpuBackend().build(
        compile_graph(spec, BuildConfig(mode=mode), CpuBackend()), BuildConfig(mode=mode, options=FAST), None
    )
    tol = 1e-4 if mode == "fp32" else 0.1
    with torch.inference_mode():
        torch.testing.assert_close(engine(*spec.example_inputs), spec.module(*spec.example_inputs), rtol=tol, atol=tol)
    assert any(layer.tactic.startswith("conv") for layer in engine.layers())


def test_fused_engine_round_trips_through_save_and_a_pinned_cache(spec, tmp_path):
    backend = CpuBackend()
    config = BuildConfig(mode="fp32", options=FAST)
    cache_path = tmp_path / "cache.json"
    first = build_engine(spec, config, backend, cache_path)
    cache = TimingCache.load(cache_path)
    # The 1x1 convolutions were offered (and timed) as GEMMs.
    assert any(c.tactic.startswith("conv1x1_gemm") for e in cache.entries() for c in e.candidates)
    first.engine.save(tmp_path / "engine")
    loaded = CpuEngine.load(tmp_path / "engine")
    with torch.inference_mode():
        assert bits_equal(loaded(*spec.example_inputs), first.engine(*spec.example_inputs))
    # Pin a 1x1 convolution to the GEMM tactic: the pinned build takes it, and again.
    entry = next(e for e in cache.entries() if any(c.tactic == "conv1x1_gemm[fp32]" for c in e.candidates))
    pin(cache, entry.layer, "conv1x1_gemm[fp32]")
    cache.save(cache_path)
    pinned = BuildConfig(mode="fp32", options=FAST, error_on_cache_miss=True)
    a, b = (build_engine(spec, pinned, backend, cache_path).engine for _ in range(2))
    assert a.fingerprint() == b.fingerprint()
    assert {layer.name: layer.tactic for layer in a.layers()}[entry.layer] == "conv1x1_gemm[fp32]"
    with torch.inference_mode():
        assert bits_equal(a(*spec.example_inputs), b(*spec.example_inputs))


def _resave(directory: Path, edit) -> None:
    path = directory / "plan.json"
    plan = json.loads(path.read_text())
    edit(plan)
    body = {k: v for k, v in plan.items() if k not in ("fingerprint", "weights_digest")}
    plan["fingerprint"] = digest(canonical_json(body))
    path.write_text(json.dumps(plan))


@pytest.fixture()
def saved(spec, tmp_path) -> Path:
    config = BuildConfig(mode="fp32", options=FAST)
    engine, _ = CpuBackend().build(compile_graph(spec, config, CpuBackend()), config, None)
    engine.save(tmp_path / "engine")
    return tmp_path / "engine"


def test_a_residual_of_another_shape_is_refused_at_load(saved):
    def edit(plan: dict) -> None:
        layer = next(n for n in plan["nodes"] if n["residual"] is not None)
        other = next(n for n in plan["nodes"] if n["outputs"][0]["shape"] != layer["outputs"][0]["shape"])
        layer["residual"] = {"ref": other["name"]}

    _resave(saved, edit)
    with pytest.raises(HarnessError, match="a residual must have the result's shape and dtype"):
        CpuEngine.load(saved)


def test_a_residual_on_a_layer_that_cannot_add_one_is_refused_at_load(saved):
    def edit(plan: dict) -> None:
        # The squeeze-excite rescale y * s: y has the result's shape, but mul cannot add it.
        mul = next(n for n in plan["nodes"] if n["op"] == "aten::mul.Tensor")
        mul["residual"] = mul["args"][0]

    _resave(saved, edit)
    with pytest.raises(HarnessError, match="cannot add a residual"):
        CpuEngine.load(saved)


def test_an_engine_saved_before_residuals_existed_is_refused_with_a_rebuild_hint(saved):
    _resave(saved, lambda plan: plan.update(version=3))
    with pytest.raises(HarnessError, match="version 3 is not supported.*rebuild the engine"):
        CpuEngine.load(saved)


@pytest.mark.slow  # builds mobilenet in each mode
@pytest.mark.parametrize(("mode", "tol"), [("fp32", 1e-4), ("autocast-bf16", 0.05)])
def test_mobilenet_engine_matches_eager_within_the_modes_tolerance(mode, tol):
    spec = models.load("mobilenet")
    config = BuildConfig(mode=mode, options=FAST)
    engine, log = CpuBackend().build(compile_graph(spec, config, CpuBackend()), config, None)
    # Some layer's own fastest tactic is a 1x1-as-GEMM one (the builder may then move it onto
    # its oneDNN Graph tactic for the region around it; its candidates keep the timing).
    fastest = {min(t.candidates, key=lambda c: c.time_ms).tactic.split("[")[0] for t in log.layers if t.candidates}
    assert fastest & {"conv1x1_gemm", "conv1x1_widened", "conv1x1_onednn"}
    assert sum("fused residual" in m for m in log.messages) == 6  # every block with a residual
    with torch.inference_mode():
        for batch in (spec.example_inputs, spec.calibration_data[0]):
            torch.testing.assert_close(engine(*batch), spec.module(*batch), rtol=tol, atol=tol)
