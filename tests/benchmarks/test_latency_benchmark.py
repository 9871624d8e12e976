"""Per-(model, mode) latency of the CPU engine as a pytest-benchmark suite.

For users who track performance with pytest-benchmark rather than
``harness gate``: each benchmark times one engine call and puts the case's
accuracy against the fp32 eager model and its memory in ``extra_info``, so
saved runs can be compared and ``--benchmark-compare-fail`` can gate them::

    pytest tests/benchmarks --benchmark-autosave
    pytest tests/benchmarks --benchmark-compare --benchmark-compare-fail=median:10%

Rounds are calibrated the way pytest-benchmark users expect: it chooses the
iterations per round from its timer's precision, after a warm-up of its own,
and runs rounds for its time budget (at least ``MIN_ROUNDS``). The engine
runs on one pinned thread, as ``harness bench`` does by default.

By default the matrix is tiny (digits in fp32 and bf16) so the normal test
run stays fast. ``HARNESS_BENCH_FULL=1`` runs resnet, transformer and digits
in every mode with a longer budget; ``-k`` picks cases as usual
(``-k "resnet and amp"``).
"""

from __future__ import annotations

import os

import pytest
import torch

from harness import models
from harness.bench.accuracy import compare_outputs
from harness.bench.runner import DEFAULT_MODELS, default_modes
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig

FULL = os.environ.get("HARNESS_BENCH_FULL", "") not in ("", "0")
# pytest-benchmark turns itself off in an xdist worker (its rounds would time nothing), so the
# cases skip there, saying how to run them; `nox -s tests` runs them in a pytest of their own.
pytestmark = pytest.mark.skipif(
    "PYTEST_XDIST_WORKER" in os.environ,
    reason="pytest-benchmark does not time under xdist (-n): run `pytest tests/benchmarks` without -n",
)
BACKEND = CpuBackend()
MODELS = DEFAULT_MODELS if FULL else ("digits",)
MODES = default_modes(BACKEND) if FULL else ("fp32", "bf16")
MIN_ROUNDS, MAX_TIME_S = (50, 2.0) if FULL else (20, 0.2)


@pytest.mark.benchmark(min_rounds=MIN_ROUNDS, max_time=MAX_TIME_S, warmup=True, warmup_iterations=50)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODELS)
def test_engine_latency(benchmark, model: str, mode: str) -> None:
    spec = models.load(model)
    with torch.inference_mode():
        reference = spec.module.float()(*spec.example_inputs)
    engine = build_engine(spec, BuildConfig(mode=mode), BACKEND).engine
    inputs = spec.example_inputs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            accuracy = compare_outputs(engine(*inputs), reference, logits=reference.dim() == 2)
            benchmark(engine, *inputs)
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info.update(
        {
            "model": model,
            "mode": mode,
            "backend": BACKEND.name,
            "max_abs_error": accuracy.max_abs_error,
            "cosine": accuracy.cosine,
            "top1_agreement": accuracy.top1_agreement,
            "weight_bytes": engine.weight_bytes_by_dtype(),
            "engine_bytes": engine.size_bytes(),
            "engine_fingerprint": engine.fingerprint(),
            "threads": 1,
        }
    )
    # a benchmark of a broken engine is worthless: the numbers must come with sane outputs
    assert accuracy.cosine is not None and accuracy.cosine > 0.99
    assert benchmark.stats.stats.rounds >= MIN_ROUNDS
