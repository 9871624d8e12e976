"""``gemm_dnnl``: linear layers on oneDNN's matmul primitive, called through libdnnl's C API.

References: PyTorch's fp32 ``linear`` (and activations) on the same values,
the engine's other tactics, and the engine's own saved files.
"""

from __future__ import annotations

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

from harness.autocast import compile
from harness.build import build_engine, compile_graph
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend, CpuEngine, builder, onednn_primitive, tactics
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.onednn_primitive import Eltwise, Matmul
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
DTYPES = [torch.float32] + ([torch.bfloat16] if onednn_primitive.available("bf16") else [])


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
    assert onednn_primitive.available("fp32")
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
    else:  # one bf16 rounding of the fp32 result: half an ulp, 2**-8 relative
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


def test_reduced_precision_is_offered_only_with_optimized_kernels():
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            impl = Matmul(torch.zeros(16, 16, dtype=dtype), None, (16, 16), None, None).impl()
        except HarnessError:
            impl = "none"  # no kernel at all
        assert onednn_primitive.available(precision) == (impl != "none" and not impl.startswith("ref")), impl


def test_threads_share_the_primitive_with_memory_objects_of_their_own_freed_when_they_end():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    matmul = Matmul(w, b, (8, 64), Eltwise("relu"), None)
    inputs = [torch.randn(8, 64, generator=gen) for _ in range(4)]
    wants = [F.relu(F.linear(x, w, b)) for x in inputs]
    wrong: list[int] = []
    runs: list[weakref.ref] = []
    counts = {torch.get_num_threads()}

    def work(i: int) -> None:
        torch.set_num_threads(next(iter(counts)))  # a new thread may start at another count
        for _ in range(200):
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
    assert note.startswith("moved 2 layer(s) onto gemm_dnnl" if primitive_faster else "kept the timed tactics: with 2")
    recorded = {e.layer: e.tactic for e in TimingCache.load(cache).entries()}
    assert recorded and all(recorded[name] == kept[name] for name in recorded)
    decisions.clear()
    again = build_engine(spec, replace(config, error_on_cache_miss=True), CpuBackend(), cache)
    assert decisions == [] and {layer.name: layer.tactic for layer in again.engine.layers()} == kept
    with torch.inference_mode():
        torch.testing.assert_close(built.engine.run(*inputs)[0], module(*inputs), rtol=1e-5, atol=1e-5)


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
    onednn_primitive.available.cache_clear()
    try:
        layer = next(n for n in plan.nodes if n.tactic.startswith("gemm_dnnl"))
        assert "gemm_dnnl" not in tactics.impl_names(layer, plan.value_metas(), plan.weights)
        with pytest.raises(HarnessError, match=f"layer {layer.name!r} .* has no implementation 'gemm_dnnl'; valid: "):
            CpuEngine(plan)
    finally:
        monkeypatch.undo()
        onednn_primitive.library.cache_clear()
        onednn_primitive.available.cache_clear()
    assert onednn_primitive.available("fp32")


def test_non_contiguous_inputs_and_residuals_are_read_as_their_values():
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(16, 6, generator=gen).t()  # (6, 16), transposed strides
    r = torch.randn(6, 48, generator=gen)[:, ::2]  # (6, 24), every other column
    matmul = Matmul(w, b, (6, 16), Eltwise("relu"), torch.float32)
    for _ in range(3):  # also once the pointers are cached
        torch.testing.assert_close(matmul(x, r), F.relu(F.linear(x, w, b) + r), rtol=1e-5, atol=1e-5)
