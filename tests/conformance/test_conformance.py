"""Conformance: every stage, on architectures this project did not write.

Subjects: Hugging Face ``transformers`` models from small configs (the zoo's
``hf-*`` entries) and small re-creations of the patterns that broke the
harness on third-party models (tests/conformance/recreations.py). References
are PyTorch's own: eager fp32 and eager ``torch.autocast``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import models
from harness.autocast import compile, jit
from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.runner import QUICK, BenchRunner
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import PRECISION_MODES, BuildConfig
from harness.globalstate import preserved_global_state
from harness.outputs import tensor_paths
from harness.zoo.thirdparty import THIRD_PARTY
from tests.conformance.recreations import RECREATIONS
from tests.helpers import assert_same_outputs

RECREATIONS_FILE = Path(__file__).with_name("recreations.py")
SUBJECTS = (*THIRD_PARTY, *(f"{RECREATIONS_FILE}:{name}" for name in RECREATIONS))
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One timing run per candidate: these tests check what engines compute, not how fast.
FAST = {"timing_runs": 1, "warmup_runs": 0}
CPU_MODES = tuple(m for m in PRECISION_MODES if m != "explicit")


def _id(subject: str) -> str:
    return subject.rpartition(":")[2]


@pytest.fixture(scope="module", params=SUBJECTS, ids=_id)
def subject(request):
    spec = models.load(request.param)
    with torch.inference_mode():
        eager = spec.module(*spec.example_inputs)
    return request.param, spec, eager


def _eager_autocast(spec, dtype):
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype):
        return spec.module(*spec.example_inputs)


def test_fp32_graph_equals_eager(subject):
    _, spec, eager = subject
    compiled = compile(spec.module, spec.example_inputs, mode="fp32")
    assert_same_outputs(compiled(*spec.example_inputs), eager)


@pytest.mark.parametrize("low", LOW)
def test_amp_graph_is_bit_identical_to_eager_autocast(subject, low):
    _, spec, _ = subject
    compiled = compile(spec.module, spec.example_inputs, mode="amp", low_precision_type=LOW[low])
    assert_same_outputs(compiled(*spec.example_inputs), _eager_autocast(spec, LOW[low]))


def test_jit_follows_every_autocast_state_exactly(subject):
    _, spec, eager = subject
    module = jit(spec.module, spec.example_inputs)
    assert_same_outputs(module(*spec.example_inputs), eager)
    for dtype in LOW.values():
        with torch.autocast("cpu", dtype=dtype):
            got = module(*spec.example_inputs)
        assert_same_outputs(got, _eager_autocast(spec, dtype))


@pytest.mark.parametrize("low", LOW)
def test_rule_mode_stays_finite_where_eager_autocast_does(subject, low):
    _, spec, eager = subject
    compiled = compile(
        spec.module,
        spec.example_inputs,
        mode="rule",
        low_precision_type=LOW[low],
        calibration_data=spec.calibration_data,
    )
    out = compiled(*spec.example_inputs)
    assert type(out) is type(eager)
    if all(torch.isfinite(t).all() for _, t in tensor_paths(_eager_autocast(spec, LOW[low]))):
        assert all(torch.isfinite(t).all() for _, t in tensor_paths(out))


def test_cpu_engine_builds_and_runs_in_every_mode(subject):
    _, spec, eager = subject
    backend = CpuBackend()
    for mode in CPU_MODES:
        engine = build_engine(spec, BuildConfig(mode=mode, options=FAST), backend).engine
        out = engine(*spec.example_inputs)
        assert type(out) is type(eager), mode
        assert [p for p, _ in tensor_paths(out)] == [p for p, _ in tensor_paths(eager)], mode
        if mode == "fp32":
            for (path, got), (_, want) in zip(tensor_paths(out), tensor_paths(eager), strict=True):
                scale = float(want.abs().max()) or 1.0
                assert float((got - want).abs().max()) <= 1e-5 * scale, path


def test_bench_accuracy_is_the_direct_comparison(subject, tmp_path):
    name, spec, eager = subject
    backend = CpuBackend()
    runner = BenchRunner(backend, cache_dir=tmp_path / "caches", settings=QUICK)
    entry = runner.run_case(name, "autocast-bf16")
    assert entry["status"] == "ok", entry.get("error")
    # The same engine again, from the cache the bench wrote: the same tactics, the same bits.
    cache = next((tmp_path / "caches").iterdir())
    engine = build_engine(spec, BuildConfig(mode="autocast-bf16", threads=QUICK.threads), backend, cache).engine
    out = engine(*spec.example_inputs)
    assert output_digest(out) == entry["output_digest"]
    # The bench's reference ran on the bench's thread count: eager fp32 bits depend on it.
    with preserved_global_state(), torch.inference_mode():
        torch.set_num_threads(entry["threads"])
        eager = spec.module(*spec.example_inputs)
    direct = compare_outputs(out, eager).to_dict()
    recorded = entry["accuracy"]
    for key in ("max_abs_error", "mean_abs_error", "max_rel_error", "cosine", "nan_count"):
        assert recorded[key] == direct[key], key
    assert [o["path"] for o in recorded["outputs"]] == [p for p, _ in tensor_paths(eager)]
