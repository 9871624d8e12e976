"""Conformance: every stage, on architectures this project did not write.

Subjects: Hugging Face ``transformers`` models from small configs (the zoo's
``hf-*`` entries) and small re-creations of the patterns that broke the
harness on third-party models (tests/conformance/recreations.py). References
are PyTorch's own: eager fp32 and eager ``torch.autocast``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness.zoo.thirdparty import THIRD_PARTY

from harness import models
from harness.autocast import compile, jit
from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.runner import QUICK, BenchRunner
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import PRECISION_MODES, BuildConfig
from harness.frontend.export import export_program
from harness.globalstate import preserved_global_state
from harness.outputs import tensor_paths
from tests.conformance.recreations import RECREATIONS
from tests.helpers import assert_same_outputs
from tests.seeds import redrawn

RECREATIONS_FILE = Path(__file__).with_name("recreations.py")
SUBJECTS = (*THIRD_PARTY, *(f"{RECREATIONS_FILE}:{name}" for name in RECREATIONS))
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One timing run per candidate: these tests check what engines compute, not how fast.
FAST = {"timing_runs": 1, "warmup_runs": 0}
# Explicit mode: the GEMMs and convolutions in bf16 (node names as export gives them), the rest fp32.
EXPLICIT = {r"^(linear|addmm|mm|bmm|baddbmm|matmul|conv1d|conv2d)(_\d+)?$": "bf16"}
# The fp32 engine against eager fp32, element by element: relative 1e-5. Its tactics
# (oneDNN, split-K, channels-last) sum in other orders, which moves an element by a few
# units in the last place of the *terms* summed into it; those are of the order of the
# output's largest values, so an element that cancels to near zero has no relative bound.
# The absolute floor is 1e-6 of the output's largest magnitude, about 8 float32 ulps at
# that scale (measured worst: 1.5e-7 of it, hf-t5): a wrong element of ordinary size
# still fails.
FP32_RTOL, FP32_ATOL_OF_SCALE = 1e-5, 1e-6


# Weight draws the exact stages are checked on: a kernel choice can depend on the values.
RECREATION_SEEDS, THIRD_PARTY_SEEDS = 10, 3


def _seeds(name: str) -> range:
    return range(RECREATION_SEEDS if name.startswith(str(RECREATIONS_FILE)) else THIRD_PARTY_SEEDS)


def _id(subject: str) -> str:
    return subject.rpartition(":")[2]


@pytest.fixture(scope="module", params=SUBJECTS, ids=_id)
def subject(request):
    spec = models.load(request.param)
    with torch.inference_mode():
        eager = spec.module(*spec.example_inputs)
    return request.param, spec, eager


@pytest.fixture(scope="module")
def program(subject):
    """The subject's export, made once and shared by its engine builds in every mode and its weight
    draws: building from it is building from the module (tests/test_build.py holds the two equal)."""
    _, spec, _ = subject
    return export_program(spec.module, spec.example_inputs)


def _eager_autocast(module, inputs, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return module(*inputs)


@pytest.mark.stage("fp32 graph exact")
def test_fp32_graph_equals_eager(subject):
    _, spec, eager = subject
    compiled = compile(spec.module, spec.example_inputs, policy="fp32")
    assert_same_outputs(compiled(*spec.example_inputs), eager)


# Every weight draw compiles from the subject's one export: ``redrawn`` draws the module's
# parameters in place, which are the export's (tests/test_seeds.py holds a compile after such
# a draw equal to one from a reseeded copy), and puts them back for the other tests.
@pytest.mark.slow  # every weight draw compiles the model again
@pytest.mark.stage("AMP {low} bit-identical")
@pytest.mark.parametrize("low", LOW)
def test_amp_graph_is_bit_identical_to_eager_autocast(subject, program, low):
    name, spec, _ = subject
    for seed in _seeds(name):
        with redrawn(spec.module, seed) as module:
            compiled = compile(program, spec.example_inputs, policy="amp", low_precision_type=LOW[low])
            assert_same_outputs(compiled(*spec.example_inputs), _eager_autocast(module, spec.example_inputs, LOW[low]))


@pytest.mark.slow  # as above, three autocast states per draw
@pytest.mark.stage("jit exact")
def test_jit_follows_every_autocast_state_exactly(subject, program):
    name, spec, _ = subject
    for seed in _seeds(name):
        with redrawn(spec.module, seed) as module:
            wrapped = jit(module, spec.example_inputs, program=program)
            with torch.no_grad():
                assert_same_outputs(wrapped(*spec.example_inputs), module(*spec.example_inputs))
            for dtype in LOW.values():
                with torch.autocast("cpu", dtype=dtype):
                    got = wrapped(*spec.example_inputs)
                assert_same_outputs(got, _eager_autocast(module, spec.example_inputs, dtype))


@pytest.mark.slow  # the rule compile and eager autocast of every subject in both low types
@pytest.mark.stage("rule finite")
@pytest.mark.parametrize("low", LOW)
def test_rule_mode_stays_finite_where_eager_autocast_does(subject, low):
    _, spec, eager = subject
    compiled = compile(
        spec.module,
        spec.example_inputs,
        policy="rule",
        low_precision_type=LOW[low],
        calibration_data=spec.calibration_data,
    )
    out = compiled(*spec.example_inputs)
    assert type(out) is type(eager)
    if all(torch.isfinite(t).all() for _, t in tensor_paths(_eager_autocast(spec.module, spec.example_inputs, LOW[low]))):
        assert all(torch.isfinite(t).all() for _, t in tensor_paths(out))


@pytest.mark.slow  # a build of every subject in every mode: 4-15 s each for the hf-* subjects
@pytest.mark.stage("engine {mode}")
@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_cpu_engine_builds_and_runs(subject, program, mode, tmp_path):
    _, spec, eager = subject
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps(EXPLICIT))
    config = BuildConfig(mode=mode, options=FAST, explicit_path=str(explicit) if mode == "explicit" else None)
    engine = build_engine(spec, config, CpuBackend(), program=program).engine
    out = engine(*spec.example_inputs)
    assert type(out) is type(eager)
    assert [p for p, _ in tensor_paths(out)] == [p for p, _ in tensor_paths(eager)]
    if mode == "explicit":  # the file took effect: the GEMMs run in bf16, and nothing else does
        low = {layer.layer_type for layer in engine.layers() if "bf16" in layer.input_dtypes}
        assert low and low <= {"matmul", "convolution", "cast", "reformat"}, low
    if mode == "fp32":
        for (path, got), (_, want) in zip(tensor_paths(out), tensor_paths(eager), strict=True):
            atol = FP32_ATOL_OF_SCALE * (float(want.abs().max()) if want.is_floating_point() else 0.0)
            torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=atol, msg=lambda m, p=path: f"{p}: {m}")


@pytest.mark.slow  # a bench case and a rebuild from its cache for every subject
@pytest.mark.stage("bench accuracy = direct")
def test_bench_accuracy_is_the_direct_comparison(subject, program, tmp_path):
    name, spec, eager = subject
    backend = CpuBackend()
    runner = BenchRunner(backend, cache_dir=tmp_path / "caches", settings=QUICK)
    entry = runner.run_case(name, "autocast-bf16")
    assert entry["status"] == "ok", entry.get("error")
    # The same engine again, from the cache the bench wrote: the same tactics, the same bits.
    cache = next((tmp_path / "caches").iterdir())
    config = BuildConfig(mode="autocast-bf16", threads=QUICK.threads)
    engine = build_engine(spec, config, backend, cache, program=program).engine
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
