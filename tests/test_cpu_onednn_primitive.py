"""``gemm_dnnl``, ``conv_dnnl``, ``pool_dnnl``, ``binary_dnnl``, ``cast_dnnl`` and
``layernorm_dnnl``: linear layers, convolutions, poolings, elementwise products, casts and
layer norms on oneDNN's primitives, called through libdnnl's C API.

References: PyTorch's fp32 ``linear``, ``conv2d``, ``avg_pool2d``, ``mul`` and
``to`` (and activations) and fp64 ``layer_norm`` on the same values, the
engine's other tactics, and the engine's own saved files.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import threading
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import models
from harness.autocast import compile
from harness.build import build_engine, compile_graph
from harness.cache.timing_cache import TimingCache
from harness.dtypes import dtype_from_name, dtype_name
from harness.engines import capability
from harness.engines.cpu import (
    CpuBackend,
    CpuEngine,
    builder,
    kernels,
    onednn_primitive,
    program,
    tactics,
)
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.onednn_attention import Attention
from harness.engines.cpu.onednn_primitive import Convolution, Eltwise, Matmul
from harness.engines.cpu.plan import Plan
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.models import ModelSpec
from harness.opnames import plan_packet

# The test extra installs the onednn extra wherever its wheel exists (Linux x86-64).
INSTALLED = any(d.metadata["Name"] == "onednn-cpu-gomp" for d in importlib.metadata.distributions())
pytestmark = pytest.mark.skipif(not INSTALLED, reason="the onednn extra has no wheel for this platform")

ACTIVATIONS = {
    "": (None, lambda y: y),
    "relu": (Eltwise("relu"), F.relu),
    "gelu": (Eltwise("gelu_erf"), F.gelu),
    "gelu_tanh": (Eltwise("gelu_tanh"), lambda y: F.gelu(y, approximate="tanh")),
    "hardswish": (Eltwise("hardswish", 1 / 6, 0.5), F.hardswish),
    "hardsigmoid": (Eltwise("hardsigmoid", 1 / 6, 0.5), F.hardsigmoid),
}
# Every type this CPU has oneDNN matmul kernels for, as the engine's own probe answers.
DTYPES = [torch.float32] + [dtype_from_name(p) for p in ("bf16", "fp16") if kernels.available("matmul", p)]


def _one_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` is ``want`` (exact, fp32) rounded once to ``got``'s type: within half an ulp."""
    return bool(((got.float() - want).abs() <= want.abs() * torch.finfo(got.dtype).eps / 2 + 1e-6).all())


class Mlp(nn.Module):
    """digits' shape of network: a linear layer with a fused relu, then a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(3)
    return Mlp().eval(), (torch.randn(16, 64),)


def _dnnl_plan(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Plan:
    """The fp32 plan with every linear layer on ``gemm_dnnl``, every other layer on its ATen call."""
    plan, _ = lower(compile(module, inputs, policy="fp32").graph_module, "test")
    metas = plan.value_metas()
    for i, node in enumerate(plan.nodes):
        if node.is_layer:
            impl = "gemm_dnnl" if plan_packet(node.op) == "linear" else tactics.impl_names(node, metas, plan.weights)[0]
            plan.nodes[i] = replace(node, tactic=f"{impl}[fp32]")
    return plan


def test_the_installed_library_is_onednn_3_on_torchs_openmp_with_fast_kernels():
    lib = onednn_primitive.library()
    assert lib is not None and lib.version.startswith("3.")
    assert kernels.available("matmul", "fp32")
    impl = Matmul(torch.randn(32, 16), None, (8, 16), None, None).impl()
    assert impl and not impl.startswith("ref"), impl
    # One OpenMP runtime in the process, torch's: torch.set_num_threads governs oneDNN too.
    # (Other packages may map OpenMP runtimes of their own: scikit-learn vendors one.)
    assert lib.openmp_added == set()
    assert str(Path(torch.__file__).parent / "lib" / "libgomp.so.1") in onednn_primitive.openmp_runtimes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=lambda a: a or "none")
def test_the_primitive_computes_the_layer(activation, residual, dtype):
    gen = torch.Generator().manual_seed(7)
    x, w, b, r = (torch.randn(shape, generator=gen).to(dtype) for shape in ((2, 5, 64), (48, 64), (48,), (2, 5, 48)))
    eltwise, reference = ACTIVATIONS[activation]
    matmul = Matmul(w, b, x.shape, eltwise, dtype if residual else None)
    got = matmul(x, r) if residual else matmul(x)
    # The exact function on the same (rounded) values, in fp32; oneDNN rounds once, at the end.
    want = reference(F.linear(x.float(), w.float(), b.float()) + (r.float() if residual else 0))
    assert got.dtype == dtype and got.shape == (2, 5, 48)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert _one_rounding(got, want)


@pytest.mark.parametrize(
    ("primitive", "precision"),
    [(p, q) for p in kernels.STANDARD for q in capability.PRECISIONS] + [("reorder", r) for r in capability.REORDERS],
)
def test_a_primitive_is_available_exactly_where_the_one_it_creates_runs_a_native_kernel(primitive, precision):
    """The probe asks the descriptor alone; the primitive created for real (JIT and all) must
    run the kernel it named: a native one where available() says so, else a reference loop, a
    generic loop or none at all."""
    make, args = kernels._probe(primitive, precision)
    try:
        created = make(*args).impl()
    except HarnessError:
        created = None  # no kernel at all
    assert onednn_primitive.kernel_of(make, *args) == created
    assert kernels.available(primitive, precision) == (capability.reference_kernel(primitive, precision, created) is None)
    assert kernels.standard_kernels()[f"{primitive} {precision}"] == created


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bias_of_the_layer_s_type_leaves_onednn_s_kernel_as_it_is_without_one(dtype):
    """oneDNN 3.2 picks kernels by the bias's type too: its fp16 matmul took a reference loop
    (19 ms for a 1x576 by 576x1024 layer, against 68 us) for an fp16 bias, and its fp16
    depthwise convolution a generic one (1 ms against 52 us) for an fp32 bias."""
    layers = [(Matmul, (torch.randn(1024, 576).to(dtype), (1, 576)))]
    for in_shape, w_shape, stride, padding, dilation, groups in CONVS.values():
        geometry = ([stride] * 2, [padding] * 2, [dilation] * 2, groups)
        layers.append((Convolution, (torch.randn(w_shape).to(dtype), in_shape, *geometry)))
    for kind, (weight, *rest) in layers:
        plain, biased = (
            kind(weight, bias, *rest, Eltwise("hardswish", 1 / 6, 0.5), None)
            for bias in (None, torch.randn(weight.shape[0]).to(dtype))
        )
        assert biased.impl() == plain.impl() and not plain.impl().startswith("ref"), (kind, rest)


def _threaded_linear(gen: torch.Generator) -> tuple[Matmul, list[torch.Tensor], list[torch.Tensor]]:
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    inputs = [torch.randn(8, 64, generator=gen) for _ in range(4)]
    return Matmul(w, b, (8, 64), Eltwise("relu"), None), inputs, [F.relu(F.linear(x, w, b)) for x in inputs]


def _threaded_stem(gen: torch.Generator) -> tuple[Convolution, list[torch.Tensor], list[torch.Tensor]]:
    """A first layer: plain inputs, reordered by each thread's own reorder."""
    w, b = torch.randn(8, 3, 3, 3, generator=gen), torch.randn(8, generator=gen)
    inputs = [torch.randn(1, 3, 10, 10, generator=gen) for _ in range(4)]
    conv = Convolution(w, b, (1, 3, 10, 10), [2, 2], [1, 1], [1, 1], 1, Eltwise("relu"), None)
    return conv, inputs, [F.relu(F.conv2d(x, w, b, 2, 1)) for x in inputs]


@pytest.mark.parametrize("make", [_threaded_linear, _threaded_stem], ids=["matmul", "convolution"])
def test_threads_share_the_primitive_with_memory_objects_of_their_own_freed_when_they_end(make):
    matmul, inputs, wants = make(torch.Generator().manual_seed(1))
    wrong: list[int] = []
    runs: list[weakref.ref] = []
    counts = {torch.get_num_threads()}

    def work(i: int) -> None:
        torch.set_num_threads(next(iter(counts)))  # a new thread may start at another count
        # With oneDNN's default scratchpad, one for every thread, the linear layer's 4 of 4 runs failed.
        for _ in range(3000):
            if not torch.allclose(matmul(inputs[i]), wants[i], rtol=1e-5, atol=1e-5):
                wrong.append(i)
        runs.append(weakref.ref(matmul._local.runs))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not wrong
    assert set(matmul._shared) == counts  # one primitive, whatever the number of threads
    assert len(runs) == 4 and all(ref() is None for ref in runs)


@pytest.mark.parametrize(
    ("x", "residual", "match"),
    [
        (torch.randn(4, 32, dtype=torch.bfloat16), None, r"expected fp32 \(4, 32\), got torch.bfloat16 \(4, 32\)"),
        (torch.randn(3, 32), None, r"expected fp32 \(4, 32\), got torch.float32 \(3, 32\)"),
        (torch.randn(4, 32), torch.randn(4, 16), r"got torch.float32 \(4, 32\) and a torch.float32 \(4, 16\) residual"),
    ],
)
def test_operands_the_primitive_was_not_made_for_are_refused_before_it_reads_them(x, residual, match):
    matmul = Matmul(torch.randn(16, 32), None, (4, 32), None, None)
    with pytest.raises(HarnessError, match=match):
        matmul(x, residual)


def test_a_residual_layer_refuses_a_missing_or_mis_sized_residual():
    matmul = Matmul(torch.randn(16, 32), None, (4, 32), None, torch.float32)
    x = torch.randn(4, 32)
    for residual in (None, torch.randn(4, 15), torch.randn(4, 16, dtype=torch.bfloat16)):
        with pytest.raises(HarnessError, match=r"and a fp32 \(4, 16\) residual, got"):
            matmul(x, residual)
    torch.testing.assert_close(matmul(x, torch.ones(4, 16)), F.linear(x, matmul._weight) + 1, rtol=1e-5, atol=1e-5)


def test_a_primitive_per_thread_count_with_torch_s_count_restored():
    matmul = Matmul(torch.randn(16, 32), None, (4, 32), None, None)
    x = torch.randn(4, 32)
    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            torch.testing.assert_close(matmul(x), F.linear(x, matmul._weight), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
    assert set(matmul._shared) == {before, 1, 2}


def test_an_activation_the_library_does_not_know_is_refused_by_name():
    with pytest.raises(HarnessError, match=r"oneDNN 3\.\S+ has no post-op algorithm 'gelu_fast'"):
        Matmul(torch.randn(16, 32), None, (4, 32), Eltwise("gelu_fast"), None).impl()


def test_shapes_that_do_not_fit_the_weight_are_refused():
    with pytest.raises(HarnessError, match=r"input \(4, 31\) does not end in the weight's K=32"):
        Matmul(torch.randn(16, 32), None, (4, 31), None, None)


def test_the_builder_times_it_for_every_linear_layer():
    module, inputs = _mlp()
    spec = ModelSpec("mlp", "two linear layers", module, inputs, [])
    config = BuildConfig(mode="fp32", options={"timing_runs": 2, "warmup_runs": 1})
    _, log = CpuBackend().build(compile_graph(spec, config, CpuBackend()), config, None)
    linear = [layer for layer in log.layers if layer.candidates and "gemm" in layer.chosen]
    assert len(linear) == 2  # fc1 (relu fused) and fc2 (no activation)
    for layer in linear:
        assert "gemm_dnnl[fp32]" in [c.tactic for c in layer.candidates]


@pytest.mark.parametrize("primitive_faster", [True, False])
def test_the_builder_moves_linear_layers_onto_it_only_if_the_whole_run_is_faster(primitive_faster, monkeypatch, tmp_path):
    """Timing is doubled (each layer's own timing prefers its first candidate, the whole-run
    timing says which plan wins); what the builder does with the answers is asserted: the
    faster plan is kept, the cache records it, and a rebuild from the cache is the same engine."""
    module, inputs = _mlp()
    spec = ModelSpec("mlp", "two linear layers", module, inputs, [])
    config = BuildConfig(mode="fp32", options={"timing_runs": 2, "warmup_runs": 0})
    decisions: list[tuple[dict[str, str], dict[str, str]]] = []

    def whole_runs(plans, run_inputs, timing):
        current, alternative = ({n.name: n.tactic for n in p.nodes if n.is_layer} for p in plans)
        if not any(t.startswith("gemm_dnnl") for t in alternative.values()):
            return [1.0, 2.0]  # the regions decision: keep the plan as timed
        decisions.append((current, alternative))
        return [2.0, 1.0] if primitive_faster else [1.0, 2.0]

    monkeypatch.setattr(builder, "median_ms", lambda fns, run_inputs, options: [1.0 + i for i in range(len(fns))])
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    cache = tmp_path / "cache.json"
    built = build_engine(spec, config, CpuBackend(), cache)
    ((current, alternative),) = decisions
    assert [current[n] for n in sorted(current) if current[n] != alternative[n]] == ["gemm_direct[fp32]"] * 2
    assert sorted(t for t in alternative.values() if t.startswith("gemm")) == ["gemm_dnnl[fp32]"] * 2
    kept = alternative if primitive_faster else current
    assert {layer.name: layer.tactic for layer in built.engine.layers()} == kept
    note = next(m for m in built.log.messages if "gemm_dnnl" in m)
    assert note.startswith(f"moved 2 layer(s) onto {builder.PRIMITIVES}" if primitive_faster else "kept the timed tactics: with 2")
    recorded = {e.layer: e.tactic for e in TimingCache.load(cache).entries()}
    assert recorded and all(recorded[name] == kept[name] for name in recorded)
    decisions.clear()
    again = build_engine(spec, replace(config, error_on_cache_miss=True), CpuBackend(), cache)
    assert decisions == [] and {layer.name: layer.tactic for layer in again.engine.layers()} == kept
    with torch.inference_mode():
        torch.testing.assert_close(built.engine.run(*inputs)[0], module(*inputs), rtol=1e-5, atol=1e-5)


def test_a_layer_far_slower_on_its_primitive_stays_off_the_whole_run_plan_on_primitives(monkeypatch):
    """A kernel oneDNN has only as a reference loop for one layer's operands (fp16 matmul with
    an fp16 bias, oneDNN 3.2: 300x) must not sink the plan for the other layers: that layer
    stays on its own fastest tactic in the plan the whole run times, and the build says so.
    Timing is doubled: the first layer's primitive times 1000x its fastest candidate."""
    module, inputs = _mlp()
    spec = ModelSpec("mlp", "two linear layers", module, inputs, [])
    config = BuildConfig(mode="fp32", options={"timing_runs": 2, "warmup_runs": 0})
    layer_timings: list[int] = []
    alternatives: list[dict[str, str]] = []

    def layer_times(fns, run_inputs, options):
        layer_timings.append(len(fns))
        times = [1.0 + i for i in range(len(fns))]
        if len(layer_timings) == 1:  # the first layer: its primitive (the last candidate) is pathological
            times[-1] = 1000.0
        return times

    def whole_runs(plans, run_inputs, timing):
        alternative = {n.name: n.tactic for n in plans[1].nodes if n.is_layer}
        if any(t.startswith("gemm_dnnl") for t in alternative.values()):
            alternatives.append(alternative)
        return [1.0, 2.0]

    monkeypatch.setattr(builder, "median_ms", layer_times)
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    built = build_engine(spec, config, CpuBackend(), None)
    assert len(layer_timings) == 2 and alternatives
    for alternative in alternatives:
        assert alternative == {"linear": "gemm_direct[fp32]", "linear_1": "gemm_dnnl[fp32]"}
    note = next(m for m in built.log.messages if m.startswith("left 1 layer(s) off"))
    assert "'linear': 1000 ms on gemm_dnnl[fp32], against 1 ms" in note


def test_an_engine_on_it_matches_eager_and_survives_save_and_load(tmp_path):
    module, inputs = _mlp()
    engine = CpuEngine(_dnnl_plan(module, inputs))
    assert [layer.tactic for layer in engine.layers() if layer.tactic.startswith("gemm")] == ["gemm_dnnl[fp32]"] * 2
    with torch.inference_mode():
        out = engine.run(*inputs)[0]
        torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)
        engine.save(tmp_path / "e")
        assert torch.equal(CpuEngine.load(tmp_path / "e").run(*inputs)[0], out)


def test_without_the_library_the_tactic_is_not_offered_and_an_engine_naming_it_is_refused(monkeypatch, tmp_path):
    module, inputs = _mlp()
    plan = _dnnl_plan(module, inputs)
    monkeypatch.setattr(onednn_primitive, "LIBRARY", tmp_path / "libdnnl.so.3")
    onednn_primitive.library.cache_clear()
    try:
        layer = next(n for n in plan.nodes if n.tactic.startswith("gemm_dnnl"))
        found = tactics.offer(layer, plan.value_metas(), plan.weights)
        assert "gemm_dnnl" not in found.impls and "no oneDNN library" in found.left_out["gemm_dnnl"]
        with pytest.raises(
            HarnessError, match=f"layer {layer.name!r} .* has no implementation 'gemm_dnnl' here \\(no oneDNN library"
        ):
            CpuEngine(plan)
    finally:
        monkeypatch.undo()
        onednn_primitive.library.cache_clear()
    assert kernels.available("matmul", "fp32")


def test_non_contiguous_inputs_and_residuals_are_read_as_their_values():
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(16, 6, generator=gen).t()  # (6, 16), transposed strides
    r = torch.randn(6, 48, generator=gen)[:, ::2]  # (6, 24), every other column
    matmul = Matmul(w, b, (6, 16), Eltwise("relu"), torch.float32)
    for _ in range(3):  # also once the pointers are cached
        torch.testing.assert_close(matmul(x, r), F.relu(F.linear(x, w, b) + r), rtol=1e-5, atol=1e-5)


# --- conv_dnnl -------------------------------------------------------------------------------

# (input shape, weight shape, stride, padding, dilation, groups): a 3x3 stem, a stride-2 1x1 on an
# even size (oneDNN's right padding is then -1), depthwise 5x5, grouped and dilated.
CONVS = {
    "stem": ((1, 3, 20, 20), (16, 3, 3, 3), 2, 1, 1, 1),
    "pointwise-s2": ((2, 16, 6, 6), (8, 16, 1, 1), 2, 0, 1, 1),
    "depthwise": ((1, 24, 9, 9), (24, 1, 5, 5), 1, 2, 1, 24),
    "grouped-dilated": ((2, 8, 9, 9), (12, 4, 3, 3), 1, 2, 2, 2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("activation", ["", "relu", "hardswish", "hardsigmoid"], ids=lambda a: a or "none")
@pytest.mark.parametrize("case", list(CONVS))
def test_the_convolution_primitive_computes_the_layer_channels_last(case, activation, residual, dtype):
    in_shape, w_shape, stride, padding, dilation, groups = CONVS[case]
    gen = torch.Generator().manual_seed(11)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in (in_shape, w_shape, w_shape[:1]))
    eltwise, reference = ACTIVATIONS[activation]
    want = F.conv2d(x.float(), w.float(), b.float(), stride, padding, dilation, groups)
    r = torch.randn(want.shape, generator=gen).to(dtype)
    want = reference(want + (r.float() if residual else 0))
    conv_args = (w, b, in_shape, [stride] * 2, [padding] * 2, [dilation] * 2, groups, eltwise, dtype if residual else None)
    conv = Convolution(*conv_args)
    got = conv(x, r) if residual else conv(x)  # plain NCHW operands: given channels-last strides first
    assert got.dtype == dtype and got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    # Right whatever its kernel; offered (conv_dnnl) only where that kernel is native (on AVX2,
    # this grouped dilated convolution with a residual gets oneDNN's reference loop).
    why = kernels.missing("convolution", dtype_name(dtype), Convolution, *conv_args)
    assert (why is None) == (capability.reference_kernel("convolution", dtype_name(dtype), conv.impl()) is None)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert _one_rounding(got, want)


def test_a_convolution_that_does_not_fit_its_input_is_refused():
    with pytest.raises(HarnessError, match=r"conv_dnnl: weight \(8, 3, 3, 3\) with groups=1.* does not fit input \(1, 4, 8, 8\)"):
        Convolution(torch.randn(8, 3, 3, 3), None, (1, 4, 8, 8), [1, 1], [0, 0], [1, 1], 1, None, None)
    with pytest.raises(HarnessError, match=r"does not fit input \(1, 3, 2, 2\)"):  # no output pixel
        Convolution(torch.randn(8, 3, 3, 3), None, (1, 3, 2, 2), [1, 1], [0, 0], [1, 1], 1, None, None)
    conv = Convolution(torch.randn(8, 3, 3, 3), None, (1, 3, 8, 8), [1, 1], [1, 1], [1, 1], 1, None, None)
    with pytest.raises(HarnessError, match=r"expected fp32 \(1, 3, 8, 8\), got torch.float32 \(1, 3, 8, 7\)"):
        conv(torch.randn(1, 3, 8, 7))


class SqueezeExcite(nn.Module):
    """mobilenet's shape of block: a stem, depthwise convolution, squeeze-excite, projection."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1)
        self.dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.squeeze, self.excite = nn.Conv2d(16, 8, 1), nn.Conv2d(8, 16, 1)
        self.project = nn.Conv2d(16, 24, 1)
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = F.hardswish(self.stem(x))
        f = F.relu(self.dw(f)) + f
        scale = F.hardsigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(f, 1)))))
        y = self.project(f * scale)
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


def _se() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(5)
    return SqueezeExcite().eval(), (torch.randn(2, 3, 16, 16),)


def test_the_builder_moves_convolutions_onto_it_out_of_regions_when_the_whole_run_is_faster(monkeypatch):
    """Doubled timing: each layer's own timing prefers its first candidate, the whole runs
    prefer the regions over the plan as timed, then the primitives over the regions. Every
    convolution, linear layer and global pooling ends on its primitive, and the engine
    computes the module."""
    module, inputs = _se()
    spec = ModelSpec("se", "a squeeze-excite block", module, inputs, [])
    config = BuildConfig(mode="fp32", options={"timing_runs": 2, "warmup_runs": 0})
    alternatives: list[dict[str, str]] = []

    def whole_runs(plans, run_inputs, timing):
        alternatives.append({n.name: n.tactic for n in plans[1].nodes if n.is_layer})
        return [2.0, 1.0]  # the alternative is faster: regions, then primitives

    monkeypatch.setattr(builder, "median_ms", lambda fns, run_inputs, options: [1.0 + i for i in range(len(fns))])
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    built = build_engine(spec, config, CpuBackend(), None)
    regions, primitives = alternatives
    convs = sorted(name for name in regions if name.startswith("conv2d"))
    assert len(convs) == 5 and {regions[c] for c in convs} == {"conv_onednn_graph[fp32]"}
    chosen = {layer.name: layer.tactic for layer in built.engine.layers()}
    assert chosen == primitives
    assert {chosen[c] for c in convs} == {"conv_dnnl[fp32]"}
    assert {t for name, t in chosen.items() if name.startswith("linear")} == {"gemm_dnnl[fp32]"}
    assert {t for name, t in chosen.items() if name.startswith("adaptive")} == {"pool_dnnl[fp32]"}
    assert chosen["mul"] == "binary_dnnl[fp32]"
    assert any(m.startswith(f"moved 9 layer(s) onto {builder.PRIMITIVES}") for m in built.log.messages)
    # Its convolutions, the first pooling and the rescale write their results into the arena (the
    # second pooling's result reaches the head through a view, the head's is the output). Those
    # reading only the arena run as bare calls: not the first pooling and the rescale, which read
    # the new tensor of ATen's residual add (after the relu). A second run on other inputs
    # leaves the first run's result alone.
    plan = built.engine.plan
    assert len(program.private_results(plan, program.region_groups(plan.nodes))) == 7
    assert built.engine._program.pinned == {"conv2d_1", "conv2d_2", "conv2d_3", "conv2d_4"}
    other = (torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6)),)
    with torch.inference_mode():
        first = built.engine.run(*inputs)[0]
        kept = first.clone()
        torch.testing.assert_close(built.engine.run(*other)[0], module(*other), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(first, module(*inputs), rtol=1e-5, atol=1e-5)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("fastest", ["sdpa_fused", "sdpa_dnnl"])
def test_a_layer_moved_for_a_region_the_primitives_then_break_returns_to_its_own_fastest(fastest, monkeypatch, tmp_path):
    """Doubled timing: every layer's first candidate is its fastest but attention's, which is
    ``fastest`` (ATen's fused call or oneDNN's primitives), and each whole run says the
    alternative is faster. The regions take attention in its explicit form; the primitives
    then take the linear layers out of the regions, and attention, alone again, returns to
    ``fastest``, in the engine and the cache."""
    spec = models.load("transformer")
    config = BuildConfig(mode="fp32", options={"timing_runs": 1, "warmup_runs": 0})
    alternatives: list[dict[str, str]] = []

    def whole_runs(plans, run_inputs, timing):
        alternatives.append({n.name: n.tactic for n in plans[1].nodes if n.is_layer})
        return [2.0, 1.0]

    def layer_times(fns, run_inputs, timing):
        on_dnnl = fastest == "sdpa_dnnl"
        return [0.5 if on_dnnl and isinstance(fn, Attention) else float(i + 1) for i, fn in enumerate(fns)]

    monkeypatch.setattr(builder, "median_ms", layer_times)
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    cache = tmp_path / "cache.json"
    built = build_engine(spec, config, CpuBackend(), cache)
    regions, primitives = alternatives
    attention = sorted(name for name in regions if name.startswith("scaled_dot_product_attention"))
    assert len(attention) == 2 and {regions[n] for n in attention} == {"sdpa_math[fp32]"}
    linears = [name for name in regions if name.startswith("linear")]
    assert {primitives[n] for n in linears} == {"gemm_dnnl[fp32]"}
    assert {primitives[n] for n in attention} == {f"{fastest}[fp32]"}
    chosen = {layer.name: layer.tactic for layer in built.engine.layers()}
    assert chosen == primitives
    recorded = {e.layer: e.tactic for e in TimingCache.load(cache).entries()}
    assert {recorded[n] for n in attention} == {f"{fastest}[fp32]"}
    assert [call for call in built.engine._program.calls if len(call) > 1] == []


def test_a_result_read_by_a_region_is_not_private():
    """A region's trace may return what it reads."""
    module, inputs = _se()
    plan = _dnnl_plan(module, inputs)
    metas = plan.value_metas()
    convs = [i for i, n in enumerate(plan.nodes) if plan_packet(n.op) == "conv2d"]
    # Every convolution on its primitive: the stem's result is read by the depthwise
    # convolution (a primitive) and the residual add, so it is private.
    for i in convs:
        plan.nodes[i] = replace(plan.nodes[i], tactic="conv_dnnl[fp32]")
    assert convs[0] in program.private_results(plan, program.region_groups(plan.nodes))
    # With the layers after the stem on oneDNN Graph tactics, they form a region reading it.
    for i in convs[1:]:
        if "conv_onednn_graph" in tactics.impl_names(plan.nodes[i], metas, plan.weights):
            plan.nodes[i] = replace(plan.nodes[i], tactic="conv_onednn_graph[fp32]")
    groups = program.region_groups(plan.nodes)
    assert any(len(g) > 1 for g in groups)
    assert convs[0] not in program.private_results(plan, groups)
    engine = CpuEngine(plan)  # binds and compiles as decided
    with torch.inference_mode():
        torch.testing.assert_close(engine.run(*inputs)[0], module(*inputs), rtol=1e-5, atol=1e-5)


def test_a_global_pooling_is_also_offered_as_the_fixed_window_pooling_it_equals():
    module, inputs = _se()
    plan, _ = lower(compile(module, inputs, policy="fp32").graph_module, "test")
    metas = plan.value_metas()
    pools = [n for n in plan.nodes if plan_packet(n.op) == "adaptive_avg_pool2d"]
    assert len(pools) == 2
    for node in pools:
        impls = tactics.impl_names(node, metas, plan.weights)
        assert impls == ["direct", "pool_window", "pool_dnnl"]
        x = torch.randn(metas[node.refs()[0].name].shape).contiguous(memory_format=torch.channels_last)
        direct, *others = (tactics.bind(node, impl, metas, plan.weights)(x) for impl in impls)
        for other in others:
            torch.testing.assert_close(other, direct, rtol=1e-6, atol=1e-7)
    # An output size that does not divide the input has no fixed window.
    uneven = replace(pools[0], outputs=(replace(pools[0].outputs[0], shape=(*pools[0].outputs[0].shape[:2], 3, 3)),))
    assert tactics.avg_pool_window(uneven, metas) is None
    assert tactics.impl_names(uneven, metas, plan.weights) == ["direct"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("shape", "window"), [((1, 16, 56, 56), (56, 56)), ((2, 24, 8, 6), (4, 3)), ((1, 5, 7, 7), (1, 1))])
def test_pool_dnnl_averages_windows_as_avg_pool2d_does_where_offered(dtype, shape, window):
    """Where this CPU's oneDNN has no native kernel for the pooling, the probe says why and the
    tactic is not offered (a pooling it cannot create is refused by name)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(13)).to(dtype)
    why = kernels.missing("pooling", dtype_name(dtype), onednn_primitive.Pooling, dtype, shape, window)
    if why is not None:
        assert f"oneDNN has no {dtype_name(dtype)} pooling kernel here" == why or "reference loop" in why
        if "no " in why:
            with pytest.raises(HarnessError, match=f"failed creating a {dtype_name(dtype)} pooling .*unimplemented"):
                onednn_primitive.Pooling(dtype, shape, window)
        return
    pool = onednn_primitive.Pooling(dtype, shape, window)
    assert capability.reference_kernel("pooling", dtype_name(dtype), pool.impl()) is None, pool.impl()
    want = F.avg_pool2d(x.float(), window, window)
    got = pool(x)  # a plain input is given the channels-last layout first
    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tolerance)
    assert torch.equal(pool(x.contiguous(memory_format=torch.channels_last)), got)


def test_pool_dnnl_refuses_a_window_that_does_not_tile_its_input():
    with pytest.raises(HarnessError, match=r"window \(3, 3\) does not tile input \(1, 4, 8, 8\)"):
        onednn_primitive.Pooling(torch.float32, (1, 4, 8, 8), (3, 3))
    pool = onednn_primitive.Pooling(torch.float32, (1, 4, 8, 8), (2, 2))
    with pytest.raises(HarnessError, match=r"pool_dnnl: expected fp32 \(1, 4, 8, 8\), got torch.bfloat16"):
        pool(torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "second"),
    [((1, 16, 8, 8), (1, 16, 1, 1)), ((2, 24, 5, 7), (2, 24, 1, 1)), ((2, 24, 5, 7), (1, 24, 1, 1)), ((2, 3, 4, 5), (2, 3, 4, 5))],
)
@pytest.mark.parametrize("scale_first", [False, True], ids=["x*s", "s*x"])
def test_binary_dnnl_multiplies_as_aten_does_to_the_bit(dtype, shape, second, scale_first):
    """One rounding of the exact product, as ATen's: the same bits in bf16 too, whatever the
    operands' layouts and order."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(shape, generator=gen).to(dtype)
    s = torch.rand(second, generator=gen).to(dtype)
    binary = onednn_primitive.Binary("binary_mul", dtype, shape, second, scale_first=scale_first)
    assert not binary.impl().startswith("ref"), binary.impl()
    operands = (s, x) if scale_first else (x, s)
    want = torch.mul(*operands)
    for layout in (torch.contiguous_format, torch.channels_last):
        got = binary(*(t.contiguous(memory_format=layout) for t in operands))
        assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, want)


def test_binary_dnnl_refuses_operands_that_do_not_broadcast():
    with pytest.raises(HarnessError, match=r"a \(1, 8, 1, 1\) operand does not broadcast over a 4-D \(1, 16, 4, 4\)"):
        onednn_primitive.Binary("binary_mul", torch.float32, (1, 16, 4, 4), (1, 8, 1, 1))
    with pytest.raises(HarnessError, match="does not broadcast over a 4-D"):
        onednn_primitive.Binary("binary_mul", torch.float32, (16, 4, 4), (16, 1, 1))
    binary = onednn_primitive.Binary("binary_mul", torch.float32, (1, 16, 4, 4), (1, 16, 1, 1))
    with pytest.raises(HarnessError, match=r"binary_dnnl: expected fp32 \(1, 16, 4, 4\) and a fp32 \(1, 16, 1, 1\) second operand, got .* and a torch.float32 \(1, 8, 1, 1\) second operand"):
        binary(torch.zeros(1, 16, 4, 4), torch.zeros(1, 8, 1, 1))


class Rescale(nn.Module):
    """A squeeze-excite rescale written both ways round, as torchvision's (``scale * input``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.excite, self.project = nn.Conv2d(8, 16, 3, 1, 1), nn.Conv2d(16, 16, 1), nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv(x)
        scale = F.hardsigmoid(self.excite(F.adaptive_avg_pool2d(f, 1)))
        g = self.project(scale * f)
        return g * F.adaptive_avg_pool2d(g, 1) * 0.5


def test_a_product_of_computed_4d_operands_that_broadcast_is_offered_on_binary_dnnl_and_runs_in_the_arena():
    """``scale * f`` and ``g * pooled`` are offered; the product by a constant is not. On an
    engine with every convolution, pooling and product on its primitive, the rescale reads two
    results of the arena and runs as a bare call, its operands in the layer's order."""
    torch.manual_seed(16)
    module, x = Rescale().eval(), torch.randn(2, 8, 6, 6)
    plan, _ = lower(compile(module, (x,), policy="fp32").graph_module, "test")
    metas = plan.value_metas()
    offered = {n.name: tactics.impl_names(n, metas, plan.weights) for n in plan.nodes if plan_packet(n.op) == "mul"}
    assert offered == {"mul": ["direct", "binary_dnnl"], "mul_1": ["direct", "binary_dnnl"], "mul_2": ["direct"]}
    for i, node in enumerate(plan.nodes):
        if node.is_layer:
            impls = tactics.impl_names(node, metas, plan.weights)
            impl = next((p for p in tactics.PRIMITIVE_IMPLS if p in impls), impls[0])
            plan.nodes[i] = replace(node, tactic=f"{impl}[fp32]")
    engine = CpuEngine(plan)
    assert "mul" in engine._program.pinned  # scale * f: both operands from convolutions
    with torch.inference_mode():
        for seed in (17, 18):
            y = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(engine.run(y)[0], module(y), rtol=1e-5, atol=1e-6)
    # A product in another dtype than its operands', or of operands that do not broadcast,
    # stays on ATen.
    node = next(n for n in plan.nodes if n.name == "mul")
    bf16 = {**metas, node.refs()[0].name: replace(metas[node.refs()[0].name], dtype="bf16")}
    assert tactics.impl_names(node, bf16, plan.weights) == ["direct"]
    flat = {**metas, node.refs()[0].name: replace(metas[node.refs()[0].name], shape=(2, 16, 36))}
    assert tactics.impl_names(node, flat, plan.weights) == ["direct"]


BF16 = pytest.mark.skipif(
    not kernels.available("reorder", "fp32>bf16"),
    reason="oneDNN has no JIT-compiled fp32-to-bf16 conversion on this CPU (the cast tactic is not offered: "
    "test_a_primitive_is_available_exactly_where_the_one_it_creates_runs_a_native_kernel checks that)",
)


@BF16
def test_cast_dnnl_rounds_to_bf16_as_aten_does_but_reads_fp32_subnormals_as_zero():
    """Every finite fp32 bit pattern of a random sample (and the edges): ATen's bf16 bits,
    except subnormal inputs, which become a zero of their sign; back to fp32 exactly."""
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(19), dtype=torch.int64)
    edges = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.17e-38, 3.4e38, -3.4e38, 1.00390625, 1.01171875, 65504.0])
    x = torch.cat([bits.to(torch.int32).view(torch.float32), edges, torch.tensor([float("inf"), -float("inf")])])
    x = x[~x.isnan()]
    cast = onednn_primitive.Cast(torch.float32, torch.bfloat16, (x.numel(),))
    assert cast.impl().startswith("jit"), cast.impl()
    got = cast(x)
    subnormal = (x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)
    assert subnormal.sum() > 100  # the sample has them
    want = torch.where(subnormal, torch.zeros_like(x).copysign(x), x).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got.view(torch.int16)[~subnormal], x[~subnormal].to(torch.bfloat16).view(torch.int16))
    assert onednn_primitive.Cast(torch.float32, torch.bfloat16, (4,))(torch.full((4,), float("nan"))).isnan().all()
    back = onednn_primitive.Cast(torch.bfloat16, torch.float32, (x.numel(),))(got)
    assert back.dtype == torch.float32 and torch.equal(back.view(torch.int32), got.float().view(torch.int32))


@BF16
def test_cast_dnnl_is_offered_for_a_float_conversion_only_and_an_engine_on_it_computes_the_model():
    """A strongly typed bf16 network's input cast (fp32 -> bf16) and its result's cast back are
    offered; an integer conversion, or one asking for a memory format, is not. The engine with
    both casts on primitives gives the bits of the one with ATen's casts (no subnormal input
    here), and the model's values within bf16's error."""
    module, inputs = _se()
    plan, _ = lower(compile(module, inputs, policy="full", low_precision_type="bf16").graph_module, "bf16")
    metas = plan.value_metas()
    casts = [n for n in plan.nodes if plan_packet(n.op) == "_to_copy"]
    assert {(metas[n.refs()[0].name].dtype, n.out().dtype) for n in casts} == {("fp32", "bf16"), ("bf16", "fp32")}
    for node in casts:
        assert tactics.impl_names(node, metas, plan.weights) == ["direct", "cast_dnnl"]
    node = casts[0]
    as_long = replace(node, kwargs={"dtype": torch.int64}, outputs=(replace(node.out(), dtype="int64"),))
    assert tactics.impl_names(as_long, metas, plan.weights) == ["direct"]
    formatted = replace(node, kwargs={**node.kwargs, "memory_format": torch.channels_last})
    assert tactics.impl_names(formatted, metas, plan.weights) == ["direct"]

    def casts_on(cast_impl: str) -> CpuEngine:
        """Every layer on its primitive, the casts on ``cast_impl``."""
        nodes = []
        for n in plan.nodes:
            if n.is_layer:
                impls = tactics.impl_names(n, metas, plan.weights)
                impl = next((p for p in tactics.PRIMITIVE_IMPLS if p in impls), impls[0])
                impl = cast_impl if n in casts else impl
                n = replace(n, tactic=tactics.tactic_name(impl, n.out().dtype))
            nodes.append(n)
        return CpuEngine(replace(plan, nodes=nodes))

    engine = casts_on("cast_dnnl")
    assert {layer.tactic for layer in engine.layers() if layer.name in {n.name for n in casts}} == {
        "cast_dnnl[bf16]", "cast_dnnl[fp32]"
    }
    with torch.inference_mode():
        got = engine.run(*inputs)[0]
        assert got.dtype == torch.float32
        assert torch.equal(got, casts_on("direct").run(*inputs)[0])
        torch.testing.assert_close(got, module(*inputs), rtol=0.05, atol=0.05)


class MixedPair(nn.Module):
    """Two linear layers typed apart (bf16, then fp32): a cast before each."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@BF16
def test_a_cast_timed_fastest_on_its_primitive_joins_a_region_on_its_aten_call(monkeypatch):
    """Doubled timing: each layer's own timing prefers its last candidate (the casts'
    ``cast_dnnl``, the linear layers' ``gemm_dnnl``). A region takes in ATen calls only, so the
    regions the whole run is timed with have the casts on theirs; that run is faster, the
    primitives' is not, and the engine runs casts and linear layers as one region."""
    torch.manual_seed(20)
    module, x = MixedPair().eval(), torch.randn(4, 16)
    compiled = compile(module, (x,), policy="explicit", explicit={"linear$": "bf16", "relu": "bf16"})
    alternatives: list[dict[str, str]] = []

    def whole_runs(plans, run_inputs, timing):
        alternatives.append({n.name: n.tactic for n in plans[1].nodes if n.is_layer})
        return [2.0, 1.0] if len(alternatives) == 1 else [1.0, 2.0]  # regions faster, primitives not

    monkeypatch.setattr(builder, "median_ms", lambda fns, run_inputs, options: [float(len(fns) - i) for i in range(len(fns))])
    monkeypatch.setattr(builder, "run_ms", whole_runs)
    engine, log = CpuBackend().build(compiled, BuildConfig(mode="explicit", options={"timing_runs": 2, "warmup_runs": 0}), None)
    own = {t.layer: t.candidates[-1].tactic for t in log.layers if t.candidates}
    assert own == {
        "x_bf16": "cast_dnnl[bf16]", "linear": "gemm_dnnl[bf16]", "relu_fp32": "cast_dnnl[fp32]", "linear_1": "gemm_dnnl[fp32]"
    }
    regions, primitives = alternatives
    assert regions == {
        "x_bf16": "direct[bf16]",
        "linear": "gemm_onednn_graph[bf16]",
        "relu_fp32": "direct[fp32]",
        "linear_1": "gemm_onednn_graph[fp32]",
    }
    chosen = {layer.name: layer.tactic for layer in engine.layers()}
    assert chosen == regions
    assert program.region_groups(engine.plan.nodes) == [[0, 1, 2, 3]]
    with torch.inference_mode():
        torch.testing.assert_close(engine(x), compiled(x), rtol=1e-2, atol=1e-2)


def test_cast_dnnl_refuses_a_tensor_of_no_dimensions():
    with pytest.raises(HarnessError, match="a 0-D tensor; oneDNN takes 1 to 12 dimensions"):
        onednn_primitive.Cast(torch.float32, torch.bfloat16, ())


def test_an_image_input_is_reordered_by_onednn_and_any_layout_gives_the_same_bits(monkeypatch):
    """A first layer's input (at most 4 channels) arrives plain: oneDNN's reorder gives it the
    primitive's layout (ATen's copy is 3.5x slower there); other layers take ATen's copy."""
    gen = torch.Generator().manual_seed(4)
    made: list[int] = []
    original = onednn_primitive._Library.reorder

    def counted(lib, source, target):
        made.append(1)
        return original(lib, source, target)

    monkeypatch.setattr(onednn_primitive._Library, "reorder", counted)
    for channels, reorders in ((3, True), (16, False)):
        x = torch.randn(2, channels, 12, 12, generator=gen)
        made.clear()
        conv = Convolution(torch.randn(8, channels, 3, 3, generator=gen), None, x.shape, [2, 2], [1, 1], [1, 1], 1, None, None)
        assert conv._takes_plain_input() == reorders
        assert len(made) == 1 + reorders  # the weight's reorder, and this thread's input reorder
        want = conv(x.contiguous(memory_format=torch.channels_last))
        wide = torch.randn(2, channels, 12, 24, generator=gen)
        wide[..., ::2] = x
        for given in (x, wide[..., ::2], x.contiguous(memory_format=torch.channels_last)):
            for _ in range(2):  # also once the pointers are cached
                assert torch.equal(conv(given), want)
        torch.testing.assert_close(want, F.conv2d(x, conv._weight, None, 2, 1), rtol=1e-5, atol=1e-5)


# --- results written into a tensor of the layer's own ----------------------------------------


class Escapes(nn.Module):
    """Linear layers whose results are read by another primitive and an elementwise op (private),
    by a view that the caller gets (not), returned (not), or large and read by a mean (private)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(16, 8)
        self.big = nn.Linear(16, 5000)  # a 4x5000 fp32 result: 80 KB, which the arena takes too

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = F.relu(self.fc1(x))
        b = self.fc2(a) * a
        c = self.fc3(b).view(8, 16)
        return self.fc4(c), c, (self.big(x) * 2).mean(1)


def test_only_results_nothing_keeps_past_the_run_are_written_into_a_tensor_of_their_own():
    torch.manual_seed(8)
    module, x = Escapes().eval(), torch.randn(4, 16)
    plan = _dnnl_plan(module, (x,))
    private = program.private_results(plan, program.region_groups(plan.nodes))
    assert sorted(plan.nodes[i].name for i in private) == ["linear", "linear_1", "linear_4"]
    engine = CpuEngine(plan)
    other = torch.randn(4, 16)
    with torch.inference_mode():
        first = engine.run(x)
        kept = [t.clone() for t in first]
        second = engine.run(other)
        for got, want in zip((first, second), (module(x), module(other)), strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))  # the second run left them alone


class Chain(nn.Module):
    """Linear layers one after the other, and a skip: the arena reuses what the chain frees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4, self.fc5 = (nn.Linear(16, 16) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.fc1(x))
        b = self.fc3(F.relu(self.fc2(a)))
        return self.fc5(self.fc4(b) + a)  # a stays alive until the add


def test_results_alive_at_the_same_time_never_share_arena_memory_and_dead_ones_are_reused():
    torch.manual_seed(10)
    module, x = Chain().eval(), torch.randn(8, 16)
    plan = _dnnl_plan(module, (x,))
    last_use = {ref.name: i for i, node in enumerate(plan.nodes) for ref in node.refs()}
    private = program.private_results(plan, program.region_groups(plan.nodes))
    offsets, size = program.arena_offsets(plan, private, last_use)
    names = {plan.nodes[i].name: i for i in offsets}
    assert sorted(names) == ["linear", "linear_1", "linear_2", "linear_3"]  # fc5's result is the output
    block = 8 * 16 * 4  # a 8x16 fp32 result, a multiple of the alignment
    spans = {i: (offsets[i], offsets[i] + block, i, last_use[plan.nodes[i].name]) for i in offsets}
    for i, (start, end, born, dies) in spans.items():
        for j, (start2, end2, born2, dies2) in spans.items():
            if i < j and born2 <= dies and born <= dies2:  # alive at the same time
                assert end <= start2 or end2 <= start, (plan.nodes[i].name, plan.nodes[j].name)
    # fc1's result lives to the add; fc2's dies at fc3, whose result takes its place after fc3 ran.
    assert offsets[names["linear"]] == 0 and offsets[names["linear_1"]] == block
    assert offsets[names["linear_2"]] == 2 * block and offsets[names["linear_3"]] == block
    assert size == 3 * block < 4 * block
    engine = CpuEngine(plan)
    with torch.inference_mode():
        for seed in (1, 2):  # a second run through the same memory
            y = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(engine.run(y)[0], module(y), rtol=1e-5, atol=1e-5)


def test_layers_reading_only_the_arena_run_as_bare_calls_in_every_thread_and_thread_count():
    torch.manual_seed(11)
    module, x = Chain().eval(), torch.randn(8, 16)
    plan = _dnnl_plan(module, (x,))
    engine = CpuEngine(plan)
    offsets, _ = program.arena_offsets(
        plan,
        program.private_results(plan, program.region_groups(plan.nodes)),
        {ref.name: i for i, node in enumerate(plan.nodes) for ref in node.refs()},
    )
    bound = {i: tactics.bind(plan.nodes[i], "gemm_dnnl", plan.value_metas(), plan.weights) for i in offsets}
    # fc2..fc4 read only results in the arena (fc4 also its residual); fc1 reads the caller's
    # input, and fc5's result goes to the caller. Without a result slot nothing is pinned.
    assert engine._program.pinned == {"linear_1", "linear_2", "linear_3"}
    assert program._pinned_layers(plan, bound, offsets) == set()
    gen = torch.Generator().manual_seed(12)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(8)]
    with torch.inference_mode():
        want = [module(b) for b in batches]
    failures: list[str] = []

    def runs(offset: int) -> None:
        with torch.inference_mode():
            for k in range(300):
                i = (k + offset) % len(batches)
                if not torch.allclose(engine.run(batches[i])[0], want[i], rtol=1e-5, atol=1e-5):
                    failures.append(f"thread {offset} run {k}")

    threads = [threading.Thread(target=runs, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    before = torch.get_num_threads()
    try:
        for count in (2, 1):  # a thread count's own primitives, instantiated again
            torch.set_num_threads(count)
            with torch.inference_mode():
                torch.testing.assert_close(engine.run(batches[0])[0], want[0], rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_the_run_calls_each_thread_s_own_primitive_calls_without_looking_them_up(monkeypatch):
    """A layer on a primitive that is not a bare call (fc1 reads the caller's input, fc5's
    result goes to the caller) is called through the thread's own call, bound when the
    thread first runs the program, never through the per-call lookup of ``__call__``; in a
    new thread too."""
    torch.manual_seed(21)
    module, x = Chain().eval(), torch.randn(8, 16)
    engine = CpuEngine(_dnnl_plan(module, (x,)))

    def looked_up(self, *args):
        raise AssertionError("the run looked up the thread's call")

    monkeypatch.setattr(onednn_primitive._Primitive, "__call__", looked_up)
    results: list[torch.Tensor] = []

    def run() -> None:
        with torch.inference_mode():
            results.append(engine.run(x)[0])

    run()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(results) == 2
    with torch.inference_mode():
        for got in results:
            torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


def test_a_bare_call_stays_right_after_normal_calls_on_operands_since_freed():
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(8, 16, generator=gen)
    arena = program.Arena(128)
    matmul = Matmul(w, None, (4, 16), None, None, result=functools.partial(arena.view, 0, 128))
    pinned = torch.randn(4, 16, generator=gen)
    bare = matmul.pinned(pinned.clone())  # its operand held by the primitive, not the caller
    assert bare is not None and bare() == 0
    want = F.linear(pinned, w)
    torch.testing.assert_close(matmul.thread_result(), want, rtol=1e-5, atol=1e-5)
    for _ in range(3):
        other = torch.randn(4, 16, generator=gen)
        torch.testing.assert_close(matmul(other), F.linear(other, w), rtol=1e-5, atol=1e-5)
        del other
        gc.collect()
        torch.randn(4, 16, generator=gen)  # likely where the freed operand was
        assert bare() == 0
        torch.testing.assert_close(matmul.thread_result(), want, rtol=1e-5, atol=1e-5)
    assert matmul.pinned(torch.zeros(4, 16, dtype=torch.bfloat16)) is None  # the wrong dtype


def test_the_arena_refuses_a_result_larger_than_its_planned_memory():
    arena = program.Arena(256)
    assert arena.view(64, 128, (2, 16), (16, 1), torch.float32).shape == (2, 16)
    with pytest.raises(HarnessError, match="does not fit the 64 bytes at 64"):
        arena.view(64, 64, (2, 16), (16, 1), torch.float32)
    with pytest.raises(HarnessError, match="256-byte arena"):
        arena.view(192, 128, (2, 16), (16, 1), torch.float32)


def test_a_private_primitive_writes_each_threads_results_into_one_tensor_of_that_thread():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(8, 16, generator=gen)
    matmul = Matmul(w, None, (4, 16), None, None, result=functools.partial(program.Arena(128).view, 0, 128))
    xs = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    results = [matmul(x) for x in xs[:2]]
    assert results[0] is results[1]
    torch.testing.assert_close(results[1], F.linear(xs[1], w), rtol=1e-5, atol=1e-5)
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: elsewhere.append(matmul(xs[2])))
    thread.start()
    thread.join()
    assert elsewhere[0].data_ptr() != results[0].data_ptr()
    torch.testing.assert_close(elsewhere[0], F.linear(xs[2], w), rtol=1e-5, atol=1e-5)
    fresh = Matmul(w, None, (4, 16), None, None)
    assert fresh(xs[0]) is not fresh(xs[0])


LNORM_DTYPES = [d for d in DTYPES if kernels.available("layernorm", dtype_name(d))]


@pytest.mark.parametrize("dtype", LNORM_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 64, 128), (3, 5, 2, 48), (16, 37)], ids=str)
@pytest.mark.parametrize("affine", ["both", "none", "weight"])
def test_layernorm_dnnl_normalizes_as_aten_does_within_its_precision(dtype, shape, affine):
    """Against fp64 ``layer_norm`` on the same values: no worse than ATen's own kernel in that
    dtype (statistics in fp32, one rounding), scale and shift taken in fp32 from any weight type."""
    gen = torch.Generator().manual_seed(23)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype) if affine != "none" else None
    bias = torch.randn(shape[-1], generator=gen) if affine == "both" else None
    norm = onednn_primitive.LayerNorm(dtype, shape, weight, bias, 1e-3)
    assert not norm.impl().startswith("ref"), norm.impl()
    want = F.layer_norm(
        x.double(), shape[-1:], None if weight is None else weight.double(), None if bias is None else bias.double(), 1e-3
    )
    got = norm(x)
    aten = F.layer_norm(x, shape[-1:], weight, None if bias is None else bias.to(dtype), 1e-3)
    assert got.dtype == dtype and got.shape == x.shape
    aten_error = float((aten.double() - want).abs().max())
    assert float((got.double() - want).abs().max()) <= 1.5 * aten_error + 1e-6


def test_layernorm_dnnl_refuses_what_it_was_not_made_for():
    with pytest.raises(HarnessError, match=r"a weight of shape \(64,\); expected \(128,\)"):
        onednn_primitive.LayerNorm(torch.float32, (4, 128), torch.ones(64), None, 1e-5)
    with pytest.raises(HarnessError, match="a 1-D input"):
        onednn_primitive.LayerNorm(torch.float32, (128,), None, None, 1e-5)
    norm = onednn_primitive.LayerNorm(torch.float32, (4, 128), None, None, 1e-5)
    with pytest.raises(HarnessError, match="layernorm_dnnl"):
        norm(torch.ones(4, 64))


def test_layernorm_dnnl_is_offered_for_a_last_dimension_norm_in_its_own_type_and_the_zoo_transformer_runs_on_it(tmp_path):
    """Every layer norm of the zoo transformer is offered it (where the precision has a fast
    kernel); one over two dimensions, or whose result changes type, is not. The engine with
    the layer norms on it, every other layer on its primitive or ATen call, computes the
    model, writes their results into the arena, and loads back to the same bits."""
    spec = models.load("transformer")
    module, inputs = spec.module, tuple(spec.example_inputs)
    plan, _ = lower(compile(module, inputs, policy="fp32").graph_module, "fp32")
    metas = plan.value_metas()
    norms = [n for n in plan.nodes if plan_packet(n.op) == "layer_norm"]
    assert len(norms) == 5
    for node in norms:
        assert tactics.impl_names(node, metas, plan.weights)[-1] == "layernorm_dnnl"
    node = norms[0]
    two_dims = replace(node, args=(node.args[0], [64, 128], *node.args[2:]))
    assert "layernorm_dnnl" not in tactics.impl_names(two_dims, metas, plan.weights)
    retyped = replace(node, outputs=(replace(node.out(), dtype="bf16"),))
    assert "layernorm_dnnl" not in tactics.impl_names(retyped, metas, plan.weights)

    nodes = []
    for n in plan.nodes:
        if n.is_layer:
            impls = tactics.impl_names(n, metas, plan.weights)
            impl = next((p for p in tactics.PRIMITIVE_IMPLS if p in impls), impls[0])
            n = replace(n, tactic=tactics.tactic_name(impl, n.out().dtype))
        nodes.append(n)
    engine = CpuEngine(replace(plan, nodes=nodes))
    assert [layer.tactic for layer in engine.layers() if layer.name in {n.name for n in norms}] == [
        "layernorm_dnnl[fp32]"
    ] * 5
    private = program.private_results(engine.plan, [[i] for i in range(len(engine.plan.nodes))])
    assert {engine.plan.nodes[i].name for i in private} >= {n.name for n in norms}
    with torch.inference_mode():
        got = engine.run(*inputs)[0]
        torch.testing.assert_close(got, module(*inputs), rtol=1e-4, atol=1e-4)
        engine.save(tmp_path / "e")
        assert torch.equal(CpuEngine.load(tmp_path / "e").run(*inputs)[0], got)
