"""The CPU engine's oneDNN Graph tactics: a layer compiled into one partition through
TorchScript's bridge, which must fuse, take inputs of any producer's layout on the fused
path, compute what the plain ATen call computes, and leave the process-wide switch alone."""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.autocast import compile
from harness.build import build_engine
from harness.cache.timing_cache import TimingCache
from harness.dtypes import dtype_name
from harness.engines.cpu import CpuBackend, onednn_graph, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.protocol import BuildConfig
from harness.globalstate import onednn_fusion_enabled
from harness.models import ModelSpec
from harness.opnames import plan_packet

pytestmark = pytest.mark.skipif(
    not onednn_graph.available("fp32"), reason="this PyTorch has no oneDNN Graph bridge"
)


class SqueezeExcite(nn.Module):
    """A depthwise conv + hardswish, then 1x1 convolutions on a 1x1 map (inputs whose size-1
    dimensions leave their strides ambiguous), a 1x1 projection with a residual add, and
    linear layers with gelu (erf) and gelu (tanh) epilogues."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.fc1 = nn.Conv2d(24, 8, 1)
        self.fc2 = nn.Conv2d(8, 24, 1)
        self.project = nn.Conv2d(24, 24, 1)
        self.erf = nn.Linear(24, 32)
        self.tanh = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.dw(x))
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1)))))
        y = self.project(y * s) + x
        h = F.gelu(self.erf(y.mean((2, 3))))
        return F.gelu(self.tanh(h), approximate="tanh")


def _module_and_inputs() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(11)
    module = SqueezeExcite().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.8)
    return module, (torch.randn(1, 24, 10, 10, generator=gen),)


def _plan(dtype: torch.dtype):
    module, inputs = _module_and_inputs()
    policy, low = ("fp32", None) if dtype == torch.float32 else ("full", dtype)
    plan, _ = lower(compile(module, inputs, policy=policy, low_precision_type=low).graph_module, "test")
    return plan, inputs


def _partitions(fn, *args) -> int:
    """How many oneDNN Graph partitions a call executed (the fused path, not the fallback)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(event.name.startswith("LlgaPartition") for event in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_graph_tactics_fuse_and_match_the_plain_call_whatever_the_input_layout(dtype, caplog):
    # Where the CPU has no bf16 oneDNN kernels, no bf16 layer may be offered the native tactic
    # (it gets the widened one); fp16 layers always get the widened one.
    native = onednn_graph.available({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    offered = native or onednn_graph.available("fp32")
    plan, inputs = _plan(dtype)
    metas = plan.value_metas()
    values = {name: t for (name, _), t in zip(plan.inputs, inputs, strict=True)}
    graph_layers = []
    tol = 1e-5 if dtype == torch.float32 else 0.02
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        for node in plan.nodes:
            args = [values[r.name] for r in node.refs()]
            impls = tactics.impl_names(node, metas, plan.weights)
            values[node.name] = reference = tactics.bind(node, impls[0], metas, plan.weights)(*args)
            graph = [i for i in impls if i in tactics.GRAPH_IMPLS]
            if not graph:
                continue
            assert graph[0].endswith("_onednn_graph" if native else "_onednn_graph_widened"), graph
            fn = tactics.bind(node, graph[0], metas, plan.weights)
            graph_layers.append((plan_packet(node.op), node.epilogue, node.residual is not None))
            # NCHW-contiguous and channels-last-contiguous copies: the same values in
            # other layouts (for 1x1 maps, other strides of the same memory order).
            for layout in (torch.contiguous_format, torch.channels_last):
                moved = [a.contiguous(memory_format=layout) if a.dim() == 4 else a for a in args]
                out = fn(*moved)
                assert out.dtype == reference.dtype and out.shape == reference.shape
                torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol, msg=node.name)
                assert _partitions(fn, *moved) == 1, (node.name, layout)
    assert not [r for r in caplog.records if "unfused" in r.getMessage()]
    if not offered:
        assert graph_layers == []
        return
    kinds = set(graph_layers)
    assert {("conv2d", "hardswish", False), ("conv2d", "relu", False), ("conv2d", "hardsigmoid", False)} <= kinds
    assert ("conv2d", "", True) in kinds  # the projection with its residual add
    assert ("linear", "gelu", False) in kinds


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_widened_partition_rounds_its_fp32_result_once(dtype):
    """The widened form computes what a reduced-precision oneDNN kernel computes: products of
    the stored values exact, fp32 sums, bias, residual and activation in fp32, one rounding.
    Against the exact (fp64) result of the same stored values, nearly every element is the
    exact result rounded, none is further than one step of the dtype; a result rounded before
    the residual add or summed in the low precision misses on many elements."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 32, 12, 12, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, 32, 12, 12, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(32, 32, 3, 3, generator=gen) / 12).to(dtype)
    bias = torch.randn(32, generator=gen).to(dtype)
    attrs = [[1, 1], [1, 1], [1, 1], 1]
    metas = [onednn_graph.input_meta(t.shape, dtype_name(dtype), torch.channels_last) for t in (x, r)]
    layer = onednn_graph.compile_layer(
        "wide", torch.conv2d, weight, bias, attrs, F.hardswish, metas, torch.channels_last, widened=True
    )
    with torch.inference_mode():
        out = layer(x, r)
        exact = F.hardswish(F.conv2d(x.double(), weight.double(), bias.double(), *attrs) + r.double())
        assert _partitions(layer, x, r) == 1
    assert out.dtype == dtype and out.shape == exact.shape
    rounded = exact.to(dtype)
    step = (rounded.double().abs() * torch.finfo(dtype).eps).clamp_min(torch.finfo(dtype).tiny)
    assert ((out.double() - rounded.double()).abs() <= step).all()
    assert (out != rounded).float().mean() < 0.01
    # The same arithmetic in the low precision, rounded at each step, is visibly further off.
    rounded_twice = F.hardswish(F.conv2d(x, weight, bias, *attrs) + r)
    assert (rounded_twice != rounded).float().mean() > 0.05


def test_the_tanh_gelu_linear_has_no_graph_tactic_because_the_bridge_computes_the_erf_gelu():
    plan, _ = _plan(torch.float32)
    metas = plan.value_metas()
    (tanh,) = [n for n in plan.nodes if n.epilogue == "gelu_tanh"]
    assert "gemm_onednn_graph" not in tactics.impl_names(tanh, metas, plan.weights)


@pytest.mark.parametrize("before", [False, True])
def test_compiling_a_layer_leaves_the_process_wide_fusion_switch_as_it_was(before):
    plan, _ = _plan(torch.float32)
    metas = plan.value_metas()
    conv = next(n for n in plan.nodes if plan_packet(n.op) == "conv2d")
    torch.jit.enable_onednn_fusion(before)
    try:
        with torch.inference_mode():
            tactics.bind(conv, "conv_onednn_graph", metas, plan.weights)(*_plan(torch.float32)[1])
        assert onednn_fusion_enabled() is before
        bad = onednn_graph.compile_layer(
            "bad", F.conv2d, torch.ones(4, 3, 3, 3), None, [], None, [((1, 5, 8, 8), (320, 64, 8, 1), "fp32")]
        )
        with pytest.raises(RuntimeError):  # a failed compile restores it too
            bad(torch.ones(1, 5, 8, 8))
        assert onednn_fusion_enabled() is before
    finally:
        torch.jit.enable_onednn_fusion(False)


def _module_classes() -> int:
    """How many classes derive from nn.Module, at any depth."""
    seen, todo = set(), [nn.Module]
    while todo:
        for cls in type.__subclasses__(todo.pop()):
            if cls not in seen:
                seen.add(cls)
                todo.append(cls)
    return len(seen)


def test_compiled_partitions_leave_nothing_behind_once_they_are_gone():
    """Nothing of a build's partitions outlives its engine: no function in TorchScript's
    process-wide compilation unit (each would keep its layer's weights for the life of the
    process) and no class deriving from nn.Module (each stays on its base's subclass list,
    which every assignment to an nn.Module class attribute walks: torch.fx patches and
    restores nn.Module's attributes throughout every trace, so every later export would be
    slower). Two builds, so that what the first creates once per process (imports,
    registries) is not counted."""
    spec = ModelSpec("se", "squeeze-excite", *_module_and_inputs(), calibration_data=[])
    config = BuildConfig(mode="fp32", options={"timing_runs": 1, "warmup_runs": 0})

    def build_and_run() -> None:
        built = build_engine(spec, config, CpuBackend())
        timed = {c.tactic for layer in built.log.layers for c in layer.candidates}
        assert any("onednn_graph" in tactic for tactic in timed)  # partitions were compiled
        built.engine.run(*spec.example_inputs)

    shared_functions = torch.jit._state._python_cu.get_functions
    build_and_run()
    gc.collect()
    before = _module_classes(), len(shared_functions())
    build_and_run()
    gc.collect()
    assert (_module_classes(), len(shared_functions())) == before


def test_a_layer_the_bridge_cannot_fuse_is_reported_and_still_computes_its_function(caplog):
    # fp16 has no kernels in the bridge: available() refuses it, and compiling anyway runs
    # TorchScript's unfused fallback, which gives the plain call's result, and says so.
    assert not onednn_graph.available("fp16")
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).half()
    fn = onednn_graph.compile_layer("half", F.linear, weight, None, [], F.relu, [((2, 4), (4, 1), "fp16")])
    x = torch.randn(2, 4).half()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        torch.testing.assert_close(fn(x), F.relu(F.linear(x, weight)))
    assert any("'half'" in r.getMessage() and "unfused" in r.getMessage() for r in caplog.records)


def test_a_partition_runs_on_the_thread_count_of_the_call_not_of_its_compile(caplog):
    """oneDNN primitives fix their thread count at creation: a partition compiled at 2 threads
    would keep running on 2 after the caller pins 1, so each count gets its own partition."""
    plan, inputs = _plan(torch.float32)
    metas = plan.value_metas()
    conv = next(n for n in plan.nodes if plan_packet(n.op) == "conv2d")
    original = torch.get_num_threads()

    def compiles() -> list[str]:
        return [r.getMessage() for r in caplog.records if "compiled a oneDNN Graph partition" in r.getMessage()]

    try:
        with caplog.at_level(logging.DEBUG, logger="harness.engines.cpu.onednn_graph"), torch.inference_mode():
            torch.set_num_threads(2)
            fn = tactics.bind(conv, "conv_onednn_graph", metas, plan.weights)
            assert compiles() == []  # nothing until the first call
            at_two = fn(*inputs)
            assert compiles() == [f"layer {conv.name!r}: compiled a oneDNN Graph partition for 2 thread(s)"]
            torch.set_num_threads(1)
            at_one = fn(*inputs)
            fn(*inputs)
            torch.set_num_threads(2)
            fn(*inputs)
            assert compiles()[1:] == [f"layer {conv.name!r}: compiled a oneDNN Graph partition for 1 thread(s)"]
            torch.testing.assert_close(at_one, at_two, rtol=1e-6, atol=1e-6)
            assert _partitions(fn, *inputs) == 1
    finally:
        torch.set_num_threads(original)


def test_two_threads_compiling_at_once_both_fuse_and_leave_the_switch_off(monkeypatch, caplog):
    """The switch is process-wide, so compiles are serialized. The race is forced: the first
    compile is held inside the switched-on region until the second has got there too (or 2 s
    have passed), and the second then until the first call has returned (or 2 s). Without
    the lock, the first turns fusion off under the second (whose layer stays unfused), and
    the second, which found it on, leaves it on; with it, the first waits out the 2 s alone."""
    arrived = threading.Barrier(2, timeout=2)
    first_done = threading.Event()
    order: list[int] = []
    trace = torch.jit.trace

    def held_trace(*args, **kwargs):
        order.append(threading.get_ident())
        try:
            arrived.wait()
        except threading.BrokenBarrierError:
            pass  # serialized: the other thread cannot get here while this one holds the lock
        if order[0] != threading.get_ident():
            first_done.wait(timeout=2)
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "trace", held_trace)
    torch.jit.enable_onednn_fusion(False)
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(8, 16, generator=gen), torch.randn(4, 16, generator=gen)
    layers = [
        onednn_graph.compile_layer(f"t{i}", F.linear, weight, None, [], F.relu, [((4, 16), (16, 1), "fp32")])
        for i in range(2)
    ]
    results: list[torch.Tensor] = []

    def first_call(fn) -> None:
        with torch.inference_mode():
            results.append(fn(x))
        if order and order[0] == threading.get_ident():
            first_done.set()

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=first_call, args=(fn,)) for fn in layers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert onednn_fusion_enabled() is False
    assert not [r for r in caplog.records if "unfused" in r.getMessage()]
    assert len(results) == 2
    for out in results:
        torch.testing.assert_close(out, F.relu(F.linear(x, weight)))
    with torch.inference_mode():
        assert all(_partitions(fn, x) == 1 for fn in layers)


def test_a_cache_timed_before_these_tactics_keeps_its_choices_and_says_what_never_competed(tmp_path):
    """A cache from a harness without the oneDNN Graph tactics: its entries list the
    candidates they beat, without them. The build keeps every cached choice (rebuilds stay
    pinned) and notes which layers never raced the new tactics and how to let them."""
    spec = ModelSpec("se", "squeeze-excite", *_module_and_inputs(), calibration_data=[])
    config = BuildConfig(mode="fp32", options={"timing_runs": 3, "warmup_runs": 1})
    cache_path = tmp_path / "cache.json"
    build_engine(spec, config, CpuBackend(), cache_path)
    cache = TimingCache.load(cache_path)
    old = [e for e in cache.entries() if any("onednn_graph" in c.tactic for c in e.candidates)]
    assert old
    for entry in old:
        kept = tuple(c for c in entry.candidates if "onednn_graph" not in c.tactic)
        best = min(kept, key=lambda c: c.time_ms)
        cache.update(replace(entry, candidates=kept, tactic=best.tactic, tactic_hash=best.tactic_hash, time_ms=best.time_ms))
    cache.save(cache_path)
    strict = replace(config, error_on_cache_miss=True)
    built = build_engine(spec, strict, CpuBackend(), cache_path)
    chosen = {layer.name: layer.tactic for layer in built.engine.layers()}
    assert all(chosen[e.layer] == cache.query(e.key).tactic for e in old)
    (note,) = [m for m in built.log.messages if "timed before" in m]
    assert f"{len(old)} layer(s) use cached tactics timed before this harness had conv_onednn_graph" in note
    assert "delete the cache file" in note
    assert built.log.warnings == [note]
    # A pinned entry is a decision, not an old timing: no note for it.
    for entry in old:
        cache.update(replace(cache.query(entry.key), pinned=True))
    cache.save(cache_path)
    again = build_engine(spec, strict, CpuBackend(), cache_path)
    assert not [m for m in again.log.messages if "timed before" in m]


def test_a_layer_makes_its_module_and_example_inputs_only_when_a_compile_needs_them(monkeypatch):
    """Binding a layer, or a region holding it, makes neither the layer's module (its weights,
    widened where it is) nor example inputs: a warm build of an engine never run, or of a layer
    that only runs inside a region, needs neither. The first compile makes them, the module
    once: the region and the layer's own partition trace the same one."""
    made: list[torch.nn.Module] = []
    init = onednn_graph._Layer.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    examples: list[tuple] = []
    example = onednn_graph._example
    monkeypatch.setattr(onednn_graph._Layer, "__init__", counted)
    monkeypatch.setattr(onednn_graph, "_example", lambda *meta: examples.append(meta) or example(*meta))
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    layer = onednn_graph.compile_layer("fc", F.linear, weight, None, [], None, [((2, 4), (4, 1), "fp32")])
    region = onednn_graph.compile_region(
        "fc..relu", [layer, F.relu], [(layer.fixers[0], layer.inputs[0])], [(0,), (1,)], [2]
    )
    assert (made, examples) == ([], [])
    x = torch.randn(2, 4)
    with torch.inference_mode():
        (y,) = region(x)
        assert (len(made), examples) == (1, [((2, 4), (4, 1), "fp32")])
        torch.testing.assert_close(y, F.relu(F.linear(x, weight)))
        torch.testing.assert_close(layer(x), F.linear(x, weight))
    assert len(made) == 1 and layer.module is made[0]
