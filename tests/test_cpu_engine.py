"""The CPU reference engine: tactics, autotuning, typing, save/load."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.autocast import compile
from harness.build import build_engine
from harness.cache.timing_cache import TimingCache
from harness.dtypes import dtype_name
from harness.engines import capability
from harness.engines.cpu import CpuBackend, CpuEngine, builder, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.plan import WeightRef
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
from harness.models import ModelSpec
from tests.helpers import bits_equal

FAST = {"timing_runs": 3, "warmup_runs": 1}


class Net(nn.Module):
    """conv+BN (folded by the builder), GEMMs with K large enough to split, softmax, layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.fc1 = nn.Linear(16 * 8 * 8, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = self.norm(self.fc1(torch.flatten(x, 1)))
        return torch.softmax(self.fc2(x), dim=-1)


def make_net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
        # Non-trivial statistics, so folding them into the conv is visible.
        net.bn.running_mean = torch.rand(16, generator=gen) * 0.4 - 0.2
        net.bn.running_var = torch.rand(16, generator=gen) + 0.5
    return net.eval(), (torch.randn(4, 3, 8, 8, generator=gen),)


@pytest.fixture(scope="module")
def net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return make_net()


@pytest.fixture(scope="module")
def fp32_build(net):
    module, inputs = net
    compiled = compile(module, inputs, policy="fp32")
    engine, log = CpuBackend().build(compiled, BuildConfig(mode="fp32", options=FAST), None)
    return compiled, engine, log


def test_tactics_of_a_layer_differ_in_bits_but_each_is_close_to_the_exact_result():
    # A bf16 GEMM: direct accumulates all of K in fp32 and rounds once; split-K
    # rounds each partial sum to bf16, so the bits differ but both are right.
    gen = torch.Generator().manual_seed(1)
    module = nn.Linear(256, 64).eval()
    x = torch.randn(32, 256, generator=gen)
    compiled = compile(module, (x,), policy="full", low_precision_type=torch.bfloat16)
    plan, _ = lower(compiled.graph_module, "bf16")
    (layer,) = [n for n in plan.nodes if tactics.layer_type(n) == "matmul"]
    metas = plan.value_metas()
    found = tactics.offer(layer, metas, plan.weights)
    impls = list(found.impls)
    if capability.current().aten_native("bf16"):
        assert impls[:3] == ["gemm_direct", "gemm_splitk2", "gemm_splitk4"]
        assert impls[3:5] == ["gemm_nn", "gemm_widened"]
        assert set(impls[5:]) <= {"gemm_onednn", "gemm_onednn_graph", "gemm_dnnl"}  # where oneDNN has bf16 kernels
    else:  # ATen's own bf16 GEMMs convert every element in software: widened on fp32 kernels instead
        assert impls[0] == "gemm_widened" and set(impls[1:]) <= {"gemm_onednn_graph_widened", "gemm_dnnl"}
        emulated = {"gemm_direct", "gemm_splitk2", "gemm_splitk4", "gemm_nn", "gemm_onednn", "gemm_onednn_graph"}
        assert emulated <= set(found.left_out)
        assert all("torch has no native bf16" in found.left_out[impl] for impl in emulated)
    xb = x.to(torch.bfloat16)
    results = {impl: tactics.bind(layer, impl, metas, plan.weights)(xb) for impl in impls}
    exact = nn.functional.linear(
        xb.double(),
        module.weight.to(torch.bfloat16).double(),
        module.bias.to(torch.bfloat16).double(),
    )
    for impl, out in results.items():
        assert out.dtype == torch.bfloat16
        # bf16 has 8 bits of mantissa: a few units in the last place of |out| ~ 10.
        torch.testing.assert_close(out.double(), exact, rtol=2**-6, atol=0.1, msg=impl)
    if "gemm_splitk4" in results:
        assert not torch.equal(results["gemm_direct"], results["gemm_splitk4"])


@pytest.mark.parametrize("name", ["transformer", "mobilenet"])
def test_a_nodes_leaves_are_what_pytree_gives_with_none_kept(name: str) -> None:
    """plan.iter_leaves and map_leaves walk plain containers themselves; on every node of real
    plans, and on the containers real plans may hold but these do not (None for an omitted
    optional, torch.Size, named tuples), they give pytree's leaves and rebuilt values."""
    import torch.utils._pytree as pytree

    from harness import models
    from harness.engines.cpu.plan import iter_leaves, map_leaves

    def is_none(x: object) -> bool:
        return x is None

    def tag(x: object) -> object:
        return ("leaf", x)

    spec = models.load(name)
    plan, _ = lower(compile(spec.module, spec.example_inputs, policy="amp", low_precision_type="bf16").graph_module, "bf16")
    odd = ([None, torch.Size([2, 3])], {"b": (None,), "a": [1.5, "x"]}, slice(1, 2), torch.return_types.max((1, None)))
    values = [(node.args, node.kwargs) for node in plan.nodes] + [odd]
    for value in values:
        assert iter_leaves(value) == pytree.tree_leaves(value, is_leaf=is_none)
        mapped, expected = map_leaves(value, tag), pytree.tree_map(tag, value, is_leaf=is_none)
        assert mapped == expected and pytree.tree_structure(mapped, is_leaf=is_none) == pytree.tree_structure(
            expected, is_leaf=is_none
        )
    leaves = [x for value in values[:-1] for x in iter_leaves(value)]
    assert len(leaves) > 100 and any(isinstance(x, torch.dtype) for x in leaves)


def test_conv_tactics_with_folded_batch_norm_and_relu_agree_with_eager(net):
    module, inputs = net
    plan, messages = lower(compile(module, inputs, policy="fp32").graph_module, "fp32")
    assert any("folded batch_norm" in m for m in messages)
    (conv,) = [n for n in plan.nodes if tactics.layer_type(n) == "convolution"]
    assert conv.fused == ("batch_norm", "relu") and conv.epilogue == "relu"
    metas = plan.value_metas()
    impls = tactics.impl_names(conv, metas, plan.weights)
    assert impls[:3] == ["conv_nchw", "conv_channels_last", "conv_no_mkldnn"]
    assert set(impls[3:]) <= {"conv_onednn", "conv_onednn_graph", "conv_dnnl"}
    with torch.inference_mode():
        expected = torch.relu(module.bn(module.conv(inputs[0])))
        for impl in impls:
            out = tactics.bind(conv, impl, metas, plan.weights)(inputs[0])
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=impl)


class _SeesOneDnn(TorchDispatchMode):
    """Records, for every ATen op dispatched, its name and whether oneDNN was on for the process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func.__name__, bool(torch.backends.mkldnn.enabled)))
        return func(*args, **(kwargs or {}))


# torch.backends.mkldnn.flags() sets oneDNN's TF32 switch on the way out, which warns on CPU builds.
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning")
@pytest.mark.parametrize(
    ("groups", "stride", "dilation", "bias"),
    [(1, 1, 1, True), (1, 2, 1, False), (4, 1, 1, True), (8, 1, 1, True), (2, 1, 2, True)],
)
def test_conv_without_onednn_computes_atens_own_bits_and_leaves_onednn_on_for_the_process(
    groups, stride, dilation, bias
):
    """conv_no_mkldnn is ATen's convolution with oneDNN off, bit for bit, grouped and dilated
    too (at batch 1: from 16 ATen may take NNPACK, which this tactic is not), without
    turning oneDNN off process-wide: that switch would move every other thread's matmuls
    to other kernels (other bits) mid-call."""
    gen = torch.Generator().manual_seed(8)
    module = nn.Conv2d(8, 8, 3, stride, dilation, dilation, groups, bias).eval()
    x = torch.randn(1, 8, 12, 12, generator=gen)
    plan, _ = lower(compile(module, (x,), policy="fp32").graph_module, "fp32")
    (conv,) = [n for n in plan.nodes if tactics.layer_type(n) == "convolution"]
    metas = plan.value_metas()
    assert "conv_no_mkldnn" in tactics.impl_names(conv, metas, plan.weights)
    run = tactics.bind(conv, "conv_no_mkldnn", metas, plan.weights)
    with torch.inference_mode():
        with _SeesOneDnn() as mode:
            out = run(x)
        with torch.backends.mkldnn.flags(enabled=False):
            expected = module(x)
    assert all(on for _, on in mode.seen)
    assert {name for name, _ in mode.seen} & {"thnn_conv2d.default", "slow_conv_dilated2d.default"}
    assert bits_equal(out, expected)


def test_builder_keeps_the_fastest_measured_candidate(fp32_build):
    _, engine, log = fp32_build
    timed = [t for t in log.layers if t.candidates]
    assert {t.layer for t in timed} >= {"conv2d", "linear", "linear_1", "layer_norm", "softmax"}
    by_name = {layer.name: layer for layer in engine.layers()}
    moved = any(m.startswith("moved") and "onto oneDNN Graph tactics" in m for m in log.messages)
    primitive = any(m.startswith("moved") and f"onto {builder.PRIMITIVES}" in m for m in log.messages)
    for record in timed:
        fastest = min(record.candidates, key=lambda c: c.time_ms)
        chosen = next(c for c in record.candidates if c.tactic == record.chosen)
        assert record.chosen_hash == chosen.tactic_hash
        # The fastest, unless the whole run was faster with the layer on its graph tactic (or its
        # ATen call in a region) or on its oneDNN primitive.
        impl = tactics.parse_tactic(record.chosen)[0]
        aten = tactics.parse_tactic(record.candidates[0].tactic)[0]
        assert record.chosen == fastest.tactic or (
            (moved and impl in (*tactics.GRAPH_IMPLS, aten)) or (primitive and impl in tactics.PRIMITIVE_IMPLS)
        )
        assert by_name[record.layer].tactic == record.chosen
        assert all(c.time_ms > 0 for c in record.candidates)
        assert len({c.tactic for c in record.candidates}) == len(record.candidates) >= 2


def test_engine_output_matches_eager_and_keys_are_tensorrt_style(net, fp32_build):
    module, inputs = net
    _, engine, log = fp32_build
    with torch.inference_mode():
        expected = module(*inputs)
    out = engine(*inputs)  # the model returns one tensor, and so does the engine
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    keys = [t.key for t in log.layers]
    assert len(set(keys)) == len(keys)
    assert all(k.startswith("0x") and len(k) == 34 and int(k, 16) >= 0 for k in keys)
    assert "batch_norm" not in {layer.name for layer in engine.layers()}


def test_strong_mode_obeys_the_graph_dtypes(net):
    module, inputs = net
    compiled = compile(module, inputs, policy="full", low_precision_type=torch.bfloat16)
    engine, _ = CpuBackend().build(compiled, BuildConfig(mode="bf16", options=FAST), None)
    graph = {n.name: n for n in compiled.graph_module.graph.nodes}
    layers = engine.layers()
    assert len(layers) >= 8
    for layer in layers:
        node = graph[layer.name]
        assert layer.output_dtypes == (dtype_name(node.meta["val"].dtype),), layer.name
        activations = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op != "get_attr"]
        assert layer.input_dtypes[: len(activations)] == tuple(
            dtype_name(a.meta["val"].dtype) for a in activations
        )
        assert layer.tactic.endswith(f"[{layer.output_dtypes[0]}]") or layer.layer_type == "cast"
    assert {"bf16"} <= {d for layer in layers for d in layer.output_dtypes}
    out = engine(*inputs)  # the model returns one tensor, and so does the engine
    assert out.dtype == compiled(*inputs).dtype


def test_weak_mode_chooses_precision_per_layer_by_timing(net):
    module, inputs = net
    compiled = compile(module, inputs, policy="fp32")
    engine, log = CpuBackend().build(compiled, BuildConfig(mode="weak-bf16", options=FAST), None)
    layers = {layer.name: layer for layer in engine.layers()}
    choices = [
        t
        for t in log.layers
        if {tactics.parse_tactic(c.tactic)[1] for c in t.candidates} == {"fp32", "bf16"}
    ]
    assert {t.layer for t in choices} >= {"conv2d", "linear", "linear_1", "softmax", "layer_norm"}
    moved = any(m.startswith("moved") and "onto oneDNN Graph tactics" in m for m in log.messages)
    lowered = any(m.startswith("ran ") and "more layer(s) in bf16" in m for m in log.messages)
    primitive = any(m.startswith("moved") and f"onto {builder.PRIMITIVES}" in m for m in log.messages)
    for record in choices:
        # The fastest (of bf16's candidates, when the whole run was faster with every timed layer
        # in bf16), or (when the whole run was faster with regions) that precision's graph tactic,
        # or (when it was faster with the convolutions and linear layers on oneDNN's primitives) that.
        fastest = min(
            (c for c in record.candidates if not lowered or c.tactic.endswith("[bf16]")), key=lambda c: c.time_ms
        ).tactic
        impl, precision = tactics.parse_tactic(record.chosen)
        aten = tactics.parse_tactic(record.candidates[0].tactic)[0]
        assert record.chosen == fastest or (
            moved and impl in (*tactics.GRAPH_IMPLS, aten) and precision == tactics.parse_tactic(fastest)[1]
        ) or (primitive and impl in tactics.PRIMITIVE_IMPLS and precision == tactics.parse_tactic(fastest)[1])
        layer = layers[record.layer]
        assert layer.output_dtypes == (precision,)
        # Casts (reformat layers) make the activation inputs arrive in that precision.
        assert layer.input_dtypes[0] == precision
    out = engine(*inputs)  # the model returns one tensor, and so does the engine
    assert out.dtype == torch.float32
    with torch.inference_mode():
        torch.testing.assert_close(out, module(*inputs), rtol=0.05, atol=0.02)


@pytest.mark.parametrize(
    ("whole_run_ms", "low_faster"),
    [((2.0, 1.0), True), ((1.0, 2.0), False), ((1.0, 0.98), False)],  # the last within the margin
)
def test_weak_build_runs_its_timed_layers_in_bf16_only_if_the_whole_run_is_faster(
    net, whole_run_ms, low_faster, monkeypatch, tmp_path
):
    """Doubles for timing only: every layer's first candidate (its fp32 variant) times fastest,
    so the per-layer choice is all fp32; the whole-run timing then says which plan wins. What the
    builder does with the answers is asserted: the plans it compares, the one it keeps, the
    note, the cache's record, and a rebuild from that cache being the same engine untimed."""
    module, inputs = net
    spec = ModelSpec("net", "weak precision", module, inputs, calibration_data=[])
    config = BuildConfig(mode="weak-bf16", options=FAST)
    compared: list[list[dict[str, str]]] = []

    def whole_runs(plans, run_inputs, timing):
        compared.append([{n.name: n.tactic for n in p.nodes if n.is_layer and n.key} for p in plans])
        if len(compared) == 1:  # the precision decision: each side in two forms
            mixed, low = whole_run_ms
            # On graph tactics the answer is the other one, but each side is slower there.
            return [low + 3, mixed, mixed + 3, low]
        return [1.0, 2.0]

    monkeypatch.setattr(builder, "median_ms", lambda fns, run_inputs, timing: [float(i + 1) for i in range(len(fns))])
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    cache = tmp_path / "cache.json"
    built = build_engine(spec, config, CpuBackend(), cache)
    # The two plans compared, each with its layers on graph tactics where that forms regions,
    # and on oneDNN's primitives where they have one; each side counts at its faster form.
    as_timed, as_timed_on_primitives, in_bf16, in_bf16_on_primitives = compared[0]
    choosable = {"conv2d", "linear", "linear_1", "layer_norm", "softmax"}
    records = {t.layer: t for t in built.log.layers if t.layer in choosable}
    first = {name: t.candidates[0].tactic for name, t in records.items()}
    first_bf16 = {name: next(c.tactic for c in t.candidates if c.tactic.endswith("[bf16]")) for name, t in records.items()}
    for plan, own, precision, forms in (
        (as_timed, first, "fp32", tactics.GRAPH_IMPLS),
        (as_timed_on_primitives, first, "fp32", tactics.PRIMITIVE_IMPLS),
        (in_bf16, first_bf16, "bf16", tactics.GRAPH_IMPLS),
        (in_bf16_on_primitives, first_bf16, "bf16", tactics.PRIMITIVE_IMPLS),
    ):
        for name in choosable:
            impl, dtype = tactics.parse_tactic(plan[name])
            assert dtype == precision and (plan[name] == own[name] or impl in forms)
    assert {tactics.parse_tactic(as_timed_on_primitives[n])[0] for n in ("conv2d", "linear", "linear_1")} <= set(
        tactics.PRIMITIVE_IMPLS
    )
    kept = first_bf16 if low_faster else first
    layers = {layer.name: layer for layer in built.engine.layers()}
    assert {n: layers[n].tactic for n in choosable} == {n: kept[n] for n in choosable}
    assert all(layers[n].output_dtypes == (("bf16",) if low_faster else ("fp32",)) for n in choosable)
    # A layer norm in bf16 keeps fp32 parameters, as the compiler keeps them (mixed layer norm);
    # the linear layers' weights are converted.
    weights = built.engine.plan.weights
    by_name = {n.name: n for n in built.engine.plan.nodes}
    norm_params = [a.name for a in by_name["layer_norm"].args if isinstance(a, WeightRef)]
    linear_weights = [a.name for a in by_name["linear"].args if isinstance(a, WeightRef)]
    assert len(norm_params) == 2 and {weights[w].dtype for w in norm_params} == {torch.float32}
    assert {weights[w].dtype for w in linear_weights} == {torch.bfloat16 if low_faster else torch.float32}
    assert {t.layer: t.chosen for t in built.log.layers if t.layer in choosable} == {n: kept[n] for n in choosable}
    note = next(m for m in built.log.messages if "more layer(s) in bf16" in m)
    assert note.startswith("ran 5 more layer(s) in bf16" if low_faster else "kept the timed precisions: with 5 more layer(s)")
    recorded = {e.layer: e.tactic for e in TimingCache.load(cache).entries()}
    assert {n: recorded[n] for n in choosable} == {n: kept[n] for n in choosable}
    compared.clear()
    again = build_engine(spec, replace(config, error_on_cache_miss=True), CpuBackend(), cache)
    assert compared == [] and again.engine.fingerprint() == built.engine.fingerprint()
    with torch.inference_mode():
        torch.testing.assert_close(built.engine(*inputs), module(*inputs), rtol=0.05, atol=0.02)


def test_save_load_round_trip_is_bit_exact(fp32_build, net, tmp_path):
    _, engine, _ = fp32_build
    _, inputs = net
    engine.save(tmp_path / "e")
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == [
        "plan.json",
        "weights.safetensors",
    ]
    loaded = CpuEngine.load(tmp_path / "e")
    assert loaded.fingerprint() == engine.fingerprint()
    assert loaded.weights_digest() == engine.weights_digest()
    assert loaded.layers() == engine.layers()
    assert torch.equal(loaded(*inputs), engine(*inputs))
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    tuned = [entry for entry in plan["layers"] if entry["key"] is not None]
    assert {entry["name"] for entry in tuned} >= {"conv2d", "linear"}
    assert set(plan["layers"][0]) == {
        "name",
        "key",
        "tactic",
        "tactic_hash",
        "layer_type",
        "input_dtypes",
        "output_dtypes",
    }


def test_fingerprint_covers_tactics_but_not_weight_values(fp32_build):
    _, engine, _ = fp32_build
    plan = engine.plan
    heavier = CpuEngine(
        type(plan)(
            plan.mode,
            plan.inputs,
            plan.nodes,
            plan.outputs,
            {k: v + 1 for k, v in plan.weights.items()},
            plan.structure,
        )
    )
    assert heavier.fingerprint() == engine.fingerprint()
    assert heavier.weights_digest() != engine.weights_digest()
    conv = next(n for n in plan.nodes if n.name == "conv2d")
    other = next(i for i in ("conv_nchw", "conv_channels_last") if f"{i}[fp32]" != conv.tactic)
    swapped = [
        n if n is not conv else type(n)(**{**n.__dict__, "tactic": f"{other}[fp32]"})
        for n in plan.nodes
    ]
    assert (
        CpuEngine(
            type(plan)(plan.mode, plan.inputs, swapped, plan.outputs, plan.weights, plan.structure)
        ).fingerprint()
        != engine.fingerprint()
    )


@pytest.fixture()
def saved(fp32_build, tmp_path) -> Path:
    _, engine, _ = fp32_build
    engine.save(tmp_path / "engine")
    return tmp_path / "engine"


def _assert_refused(directory: Path, match: str) -> None:
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(HarnessError, match=match):
        CpuEngine.load(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_truncated_plan_is_refused_and_left_untouched(saved):
    text = (saved / "plan.json").read_bytes()
    (saved / "plan.json").write_bytes(text[: len(text) // 2])
    _assert_refused(saved, "not valid JSON")


def test_tampered_plan_is_refused(saved):
    plan = json.loads((saved / "plan.json").read_text())
    node = next(n for n in plan["nodes"] if n["name"] == "conv2d")
    node["tactic"] = (
        "conv_no_mkldnn[fp32]" if node["tactic"] != "conv_no_mkldnn[fp32]" else "conv_nchw[fp32]"
    )
    (saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(saved, "fingerprint")


def test_wrong_schema_version_is_refused(saved):
    plan = json.loads((saved / "plan.json").read_text())
    plan["version"] = 99
    (saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(saved, "schema version 99 is not supported")


def _forge(node: dict, change: str) -> None:
    if change == "op":
        node["op"] = "aten::_foreach_add.List"
    elif change == "inplace":
        node["op"] = "aten::add_.Tensor"
    elif change == "random":
        node["op"] = "aten::bernoulli.default"
    elif change == "raw memory":
        node["op"] = "aten::_reshape_alias.default"
    elif change == "not aten":
        node["op"] = "os::system.default"
    elif change == "ref":
        node["args"][0] = {"ref": "defined_nowhere"}
    elif change == "tactic":
        node["tactic"] = "conv_nchw[fp32]"
    elif change == "kwarg":
        node["kwargs"]["x=__import__('os').system('true') or None, y"] = 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("op", r"aten::_foreach_add.List\): invalid arguments"),
        ("inplace", "cannot run in the CPU engine: it writes one of its arguments"),
        ("random", "cannot run in the CPU engine: it draws random numbers"),
        ("raw memory", "cannot run in the CPU engine: it addresses memory through raw strides"),
        ("not aten", "is not an ATen op name"),
        ("ref", "refers to 'defined_nowhere', which is not defined before it"),
        ("tactic", "has no implementation 'conv_nchw'"),
        ("kwarg", "invalid arguments: Unknown keyword argument"),
    ],
)
def test_forged_plans_with_a_recomputed_fingerprint_are_still_refused(saved, change, match):
    # The fingerprint detects accidents, not forgery: loading must not trust the content.
    plan = json.loads((saved / "plan.json").read_text())
    _forge(next(n for n in plan["nodes"] if n["name"] == "flatten"), change)
    body = {k: v for k, v in plan.items() if k not in ("fingerprint", "weights_digest")}
    plan["fingerprint"] = digest(canonical_json(body))
    (saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(saved, match)


def test_tampered_and_truncated_weights_are_refused(saved):
    data = (saved / "weights.safetensors").read_bytes()
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    (saved / "weights.safetensors").write_bytes(bytes(flipped))
    _assert_refused(saved, "digest does not match")
    (saved / "weights.safetensors").write_bytes(data[: len(data) - 100])
    _assert_refused(saved, "not a valid safetensors file")


def test_engine_rejects_inputs_of_the_wrong_shape_or_dtype(fp32_build):
    _, engine, _ = fp32_build
    with pytest.raises(HarnessError, match="expected torch.float32 \\(4, 3, 8, 8\\)"):
        engine(torch.zeros(4, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(HarnessError, match="expected torch.float32 \\(4, 3, 8, 8\\), got torch.float32 \\(4, 3, 8, 7\\)"):
        engine(torch.zeros(4, 3, 8, 7))
    with pytest.raises(HarnessError, match="expected torch.float32 \\(4, 3, 8, 8\\), got list"):
        engine([[0.0]])
    with pytest.raises(HarnessError, match="takes 1 input"):
        engine()
    with pytest.raises(HarnessError, match="takes 1 input"):
        engine(torch.zeros(4, 3, 8, 8), torch.zeros(4, 3, 8, 8))


class Attention(nn.Module):
    """Every decomposable op family: sdpa with a mask and causal, softmax, log_softmax,
    matmul, and a linear layer with a fused gelu epilogue."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.qkv = nn.Linear(64, 192)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = nn.functional.gelu(self.proj(x), approximate="tanh")
        q, k, v = self.qkv(self.norm(h)).view(2, 16, 3, 2, 32).permute(2, 0, 3, 1, 4)
        causal = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = torch.matmul(q, k.transpose(-2, -1))
        return causal, masked, torch.softmax(scores, -1), torch.log_softmax(scores, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tactic_of_every_layer_agrees_with_the_plain_aten_call(dtype):
    gen = torch.Generator().manual_seed(2)
    module = Attention().eval()
    inputs = (torch.randn(2, 16, 64, generator=gen), torch.rand(16, 16, generator=gen) > 0.3)
    mode, low = ("fp32", None) if dtype == torch.float32 else ("full", dtype)
    compiled = compile(module, inputs, policy=mode, low_precision_type=low)
    plan, messages = lower(compiled.graph_module, "test")
    assert "fused activation gelu into linear" in messages
    metas = plan.value_metas()
    values: dict[str, torch.Tensor] = {
        name: t for (name, _), t in zip(plan.inputs, inputs, strict=True)
    }
    tol = 1e-5 if dtype == torch.float32 else 0.05
    tried = set()
    left_out: dict[str, str] = {}
    with torch.inference_mode():
        for node in plan.nodes:
            args = [values[r.name] for r in node.refs()]
            if node.op == "builtin::getitem":
                values[node.name] = args[0][node.args[1]]
                continue
            found = tactics.offer(node, metas, plan.weights)
            impls, _ = found.impls, left_out.update(found.left_out)
            outs = {impl: tactics.bind(node, impl, metas, plan.weights)(*args) for impl in impls}
            reference = values[node.name] = outs[impls[0]]
            if node.multi:  # data movement (unbind), single tactic
                continue
            for impl, out in outs.items():
                assert out.dtype == reference.dtype and out.shape == reference.shape
                torch.testing.assert_close(
                    out.float(), reference.float(), rtol=tol, atol=tol, msg=f"{node.name} {impl}"
                )
                tried.add(impl)
        # The plan (with its fused epilogue) computes what the typed graph computes.
        for out, expected in zip(
            [values[o.name] for o in plan.outputs], compiled(*inputs), strict=True
        ):
            torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    expected_impls = {
        "sdpa_math",
        "softmax_decomposed",
        "layernorm_decomposed",
        "gemm_splitk2",
        "gemm_splitk4",
        "reshape",
    }
    if torch.backends.mkldnn.is_available():
        expected_impls.add("gemm_onednn")
    # Each ran and agreed, or this CPU left it out with its reason (never where torch has native kernels).
    assert expected_impls <= tried | set(left_out)
    assert all(left_out[impl] for impl in expected_impls - tried)
    if capability.current().aten_native(dtype_name(dtype)):
        assert expected_impls <= tried


class FullyMasked(nn.Module):
    """Attention where the mask hides every key from some queries."""

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("boolean", [True, False], ids=["bool", "additive"])
def test_a_query_whose_every_key_is_masked_gets_zeros_from_every_tactic_as_from_aten(boolean):
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(4))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[1] = False
    mask = keep if boolean else torch.zeros(4, 4).masked_fill(~keep, float("-inf"))
    expected = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert torch.equal(expected[..., 1, :], torch.zeros(1, 2, 8))
    plan, _ = lower(compile(FullyMasked().eval(), (q, mask), policy="fp32").graph_module, "test")
    metas = plan.value_metas()
    (node,) = [n for n in plan.nodes if n.is_layer and tactics.layer_type(n) == "attention"]
    impls = tactics.impl_names(node, metas, plan.weights)
    assert impls == ["sdpa_fused", "sdpa_math"]
    for impl in impls:
        got = tactics.bind(node, impl, metas, plan.weights)(q, q, q, mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=impl)


def _resign(plan: dict) -> None:
    body = {k: v for k, v in plan.items() if k not in ("fingerprint", "weights_digest")}
    plan["fingerprint"] = digest(canonical_json(body))


@pytest.mark.slow  # each case loads the engine in a process of its own
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"stride": [0, 0]}, "non-positive stride"),
        ({"stride": [1, 1, 1]}, "stride to be a single integer value or a list of 2 values"),
        ({"padding": [1.5, 1]}, "Expected a value of type 'List\\[int\\]' for argument 'padding'"),
        ({"padding": [-1, 1]}, "negative padding"),
        ({"groups": 5}, "groups"),
    ],
)
def test_crafted_convolution_arguments_are_refused_before_any_kernel_runs(saved, args, match):
    """Once, stride 0 reached oneDNN's weight reorder at load and killed the process (SIGFPE)."""
    plan = json.loads((saved / "plan.json").read_text())
    conv = next(n for n in plan["nodes"] if n["name"] == "conv2d")
    positions = {"stride": 3, "padding": 4, "dilation": 5, "groups": 6}
    while len(conv["args"]) < 7:
        conv["args"].append([1, 1] if len(conv["args"]) in (3, 5) else [0, 0] if len(conv["args"]) == 4 else 1)
    for name, value in args.items():
        conv["args"][positions[name]] = value
    conv["tactic"] = "conv_onednn[fp32]"
    _resign(plan)
    (saved / "plan.json").write_text(json.dumps(plan))
    # In a child process, so that a native crash would fail the test instead of killing pytest.
    code = (
        "import sys\n"
        "from harness.engines.cpu import CpuEngine\n"
        "from harness.errors import HarnessError\n"
        "try:\n    CpuEngine.load(sys.argv[1])\n"
        "except HarnessError as e:\n    print(e); sys.exit(2)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(saved)], capture_output=True, text=True)
    assert result.returncode == 2, (result.returncode, result.stderr[-500:])
    assert "layer 'conv2d' (aten::conv2d.default): invalid arguments" in result.stdout
    assert re.search(match, result.stdout), result.stdout


def test_a_declared_output_the_op_does_not_produce_is_refused(saved):
    plan = json.loads((saved / "plan.json").read_text())
    node = next(n for n in plan["nodes"] if n["name"] == "flatten")
    node["outputs"][0]["shape"] = [4, 7]
    _resign(plan)
    (saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(saved, r"layer 'flatten' .* declares outputs fp32\[4, 7\] but its op returns fp32\[4, 1024\]")


def test_a_graph_with_several_unrunnable_ops_names_them_all_at_once():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    noisy = graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5))
    strided = graph.call_function(torch.ops.aten._reshape_alias.default, (noisy, [4], [1]))
    graph.output((graph.call_function(torch.ops.aten.add_.Tensor, (strided, x)),))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm).propagate(torch.ones(4))
    with pytest.raises(HarnessError) as err:
        lower(gm, "fp32")
    message = str(err.value)
    assert message.startswith("the CPU engine cannot run 3 node(s) of this graph")
    for fragment in ("node bernoulli_p: op 'aten::bernoulli.p' cannot run in the CPU engine: it draws random numbers",
                     "node _reshape_alias_default: op 'aten::_reshape_alias.default' cannot run in the CPU engine: it addresses memory",
                     "node add__tensor: op 'aten::add_.Tensor' cannot run in the CPU engine: it writes one of its arguments"):
        assert fragment in message


class Strided(nn.Module):
    """``as_strided`` reads memory: after a convolution whose tactic may be channels-last, through
    a transposed view of it, and as the as_strided_scatter a write through such a view becomes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.conv(x)  # (1, 8, 4, 4)
        windows = h.as_strided((8, 3, 4), (16, 4, 1), 2)  # overlapping rows of eager's NCHW memory
        across = h.transpose(2, 3).as_strided((4, 6), (5, 3), 7)  # the view's base memory, not the view
        scratch = h.new_zeros(8, 16)
        scratch.as_strided((8, 4), (16, 2), 1).add_(h.mean(-1)[0])  # -> as_strided_scatter
        return windows * 2, across + 1, scratch


def _strided_example() -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    module = Strided().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return module, torch.randn(1, 3, 4, 4, generator=gen)


@pytest.mark.parametrize(("mode", "rtol", "atol"), [("fp32", 1e-5, 1e-6), ("bf16", 2e-2, 2e-2), ("weak-bf16", 2e-2, 2e-2)])
def test_as_strided_and_its_scatter_run_in_the_engine_and_read_what_eager_reads(mode, rtol, atol):
    module, x = _strided_example()
    with torch.inference_mode():
        eager = module(x)
    spec = ModelSpec("strided", "as_strided after a convolution", module, (x,), [(x,)])
    # Every convolution tactic is timed, channels-last ones included (FAST times each candidate).
    result = build_engine(spec, BuildConfig(mode=mode, options=FAST), CpuBackend())
    ops = Counter(node.op for node in result.engine.plan.nodes)
    # the scratch's view is of h.new_zeros(...), a constant: folded; the two reading h run
    assert ops["aten::as_strided.default"] == 2 and ops["aten::as_strided_scatter.default"] == 1
    for got, want in zip(result.engine(x), eager, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("conv_tactic", ["conv_channels_last[fp32]", "conv_nchw[fp32]"])
def test_as_strided_reads_the_same_elements_whatever_the_convolution_tactic(conv_tactic, tmp_path):
    module, x = _strided_example()
    with torch.inference_mode():
        eager = module(x)
    spec = ModelSpec("strided", "as_strided after a convolution", module, (x,), [(x,)])
    engine = build_engine(spec, BuildConfig(mode="fp32", options=FAST), CpuBackend()).engine
    engine.save(tmp_path / "e")
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    conv = next(n for n in plan["nodes"] if n["op"] == "aten::conv2d.default")
    conv["tactic"] = conv_tactic
    conv["tactic_hash"] = tactics.tactic_hash(conv_tactic)
    _resign_with_layers(plan, conv)
    (tmp_path / "e" / "plan.json").write_text(json.dumps(plan))
    for got, want in zip(CpuEngine.load(tmp_path / "e")(x), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _resign_with_layers(plan: dict, changed: dict) -> None:
    for layer in plan["layers"]:
        if layer["name"] == changed["name"]:
            layer["tactic"], layer["tactic_hash"] = changed["tactic"], changed["tactic_hash"]
    _resign(plan)


@pytest.fixture()
def strided_saved(tmp_path) -> Path:
    module, x = _strided_example()
    spec = ModelSpec("strided", "as_strided after a convolution", module, (x,), [(x,)])
    engine = build_engine(spec, BuildConfig(mode="fp32", options=FAST), CpuBackend()).engine
    engine.save(tmp_path / "e")
    return tmp_path / "e"


def test_a_crafted_as_strided_reaching_outside_its_input_is_refused_at_load(strided_saved):
    plan = json.loads((strided_saved / "plan.json").read_text())
    node = next(n for n in plan["nodes"] if n["op"] == "aten::as_strided.default")
    node["args"][1] = [8, 3, 400]  # the fake kernel would accept it: the engine's own check must not
    node["outputs"][0]["shape"] = [8, 3, 400]
    _resign(plan)
    (strided_saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(strided_saved, rf"layer '{node['name']}' .* address element \d+ of an input holding 128")


def test_a_crafted_as_strided_reading_a_tactic_chosen_layout_is_refused_at_load(strided_saved):
    plan = json.loads((strided_saved / "plan.json").read_text())
    node = next(n for n in plan["nodes"] if n["op"] == "aten::as_strided.default")
    conv = next(n for n in plan["nodes"] if n["op"] == "aten::conv2d.default")
    node["args"][0] = {"ref": conv["name"]}  # the convolution's output itself, not a contiguous copy
    _resign(plan)
    (strided_saved / "plan.json").write_text(json.dumps(plan))
    _assert_refused(strided_saved, rf"layer '{node['name']}' .* must read a contiguous copy")


class _ShapeBuilt(nn.Module):
    """Every value-free op beside ops that read ``x``'s values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        built = x.new_full((4, 8), 2.0) + torch.zeros_like(x) + x.new_ones(8) - torch.full_like(x, 0.5)
        return x * built + torch.ones_like(x) * x.new_zeros(4, 8).add(1)


@pytest.mark.parametrize("model", ["shape-built", "shifted_window_mask"])
def test_what_is_built_from_shapes_alone_is_folded_and_the_rest_still_reads_the_input(model):
    from tests.conformance.recreations import shifted_window_mask

    if model == "shape-built":
        x = torch.randn(4, 8)
        spec = ModelSpec(model, "value-free ops", _ShapeBuilt(), (x,), [(x,)])
    else:  # Swin's attention mask, filled slice by slice into x.new_zeros(...)
        spec = shifted_window_mask()
    result = build_engine(spec, BuildConfig(mode="fp32", options=FAST), CpuBackend())
    ops = {node.op.split("::")[1].split(".")[0] for node in result.engine.plan.nodes}
    built = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "fill", "slice_scatter", "eq", "ne"}
    assert not ops & built and any("constant-folded" in m for m in result.log.messages)
    (x,) = spec.example_inputs
    for inputs in (x, 3 * torch.randn(x.shape)):  # other values: what reads x was kept
        with torch.inference_mode():
            torch.testing.assert_close(result.engine(inputs), spec.module(inputs), rtol=1e-5, atol=1e-5)


# --- what a build asks once per process ----------------------------------------------------


def test_named_args_give_each_layer_its_own_defaults_and_refuse_an_unknown_op_every_time():
    from harness.engines.cpu.plan import Node, Ref, TensorMeta
    from harness.engines.cpu.tactic import named_args

    def pool(name: str) -> Node:  # max_pool2d's stride, padding and dilation default to lists
        out = (TensorMeta((1, 1, 2, 2), "fp32"),)
        return Node(name, "aten::max_pool2d.default", (Ref("x"), [2, 2]), {}, out)

    first, second = named_args(pool("a")), named_args(pool("b"))
    assert first["padding"] == second["padding"] == [0, 0] and first["dilation"] == [1, 1]
    first["padding"].append(9)  # a layer's own list: no other layer (nor a later ask) sees it
    assert second["padding"] == named_args(pool("c"))["padding"] == [0, 0]
    for name in ("first", "second"):  # a refused op is not remembered: each ask names its layer
        bad = Node(name, "aten::no_such_op.default", (Ref("x"),), {}, (TensorMeta((1,), "fp32"),))
        with pytest.raises(HarnessError, match=rf"layer '{name}'"):
            named_args(bad)


def test_generated_code_is_compiled_once_and_each_callable_keeps_its_own_constants():
    from harness.engines.cpu.tactic import Slot, make_call

    ones, twos = torch.ones(3), torch.full((3,), 2.0)
    add_ones = make_call(torch.ops.aten.add.Tensor, [Slot(0), ones], {})
    add_twos = make_call(torch.ops.aten.add.Tensor, [Slot(0), twos], {})
    assert add_ones.__code__ is add_twos.__code__  # the same text, compiled once
    x = torch.zeros(3)
    assert torch.equal(add_ones(x), ones) and torch.equal(add_twos(x), twos)


def test_two_engines_of_one_plan_share_their_programs_code_but_not_their_layers(fp32_build):
    compiled, engine, _ = fp32_build
    plan, inputs = engine.plan, compiled.example_inputs
    first = CpuEngine(replace(plan, weights=dict(plan.weights)))
    other_weights = {k: (t + 1 if t.is_floating_point() else t) for k, t in plan.weights.items()}
    second = CpuEngine(replace(plan, weights=other_weights))
    run_a, run_b = first._program.run, second._program.run
    if inspect.ismethod(run_a):  # layers on primitives: the code each thread instantiates
        assert run_a.__self__._code is run_b.__self__._code
    else:
        assert run_a.__code__ is run_b.__code__ and run_a.__globals__ is not run_b.__globals__
    (a,), (b,), (expected,) = first.run(*inputs), second.run(*inputs), engine.run(*inputs)
    assert bits_equal(a, expected)
    assert not bits_equal(b, a)  # its own weights, not the first engine's


def test_parse_tactic_remembers_valid_names_only():
    assert tactics.parse_tactic("gemm_splitk2[bf16]") == ("gemm_splitk2", "bf16")
    for _ in range(2):
        with pytest.raises(HarnessError, match="malformed tactic name"):
            tactics.parse_tactic("gemm_splitk2")


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 3, 1, 5), (1, 1, 4, 4)])
def test_the_remembered_input_layouts_are_the_ones_torch_gives(shape, layout):
    from harness.engines.cpu import onednn_graph

    for dtype in ("fp32", "bf16"):
        expected = (shape, torch.empty(shape, device="meta", memory_format=layout).stride(), dtype)
        for _ in range(2):  # asked of torch, then remembered
            assert onednn_graph.input_meta(list(shape), dtype, layout) == expected
