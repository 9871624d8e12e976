"""Deterministic rebuilds: unpinned builds can flip, pinned builds cannot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.build import build_engine, rebuild
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend, builder
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.models import ModelSpec


class NearTied(nn.Module):
    """Square fp32 GEMMs where the work is the multiply itself, so direct and split-K
    (same flops, one extra accumulation) cost nearly the same and noise decides."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    torch.manual_seed(0)
    x = torch.randn(32, 256)
    return ModelSpec("near_tied", "three 256x256 GEMMs", NearTied().eval(), (x,), [(x,)])


# One timed run per candidate: real, unfaked measurements, but as noisy as a
# builder on a busy machine.
NOISY = BuildConfig(mode="fp32", options={"timing_runs": 1, "warmup_runs": 1})


def test_unpinned_rebuilds_flip_tactics_on_near_tied_layers(spec, monkeypatch):
    """Near-tied candidates are ordered by noise, differently from build to build. The noise
    is a double here (each timing round ranks the candidates one step rotated): on an AMD
    EPYC real timings made the same choice in 40 builds in a row, since the whole run on
    oneDNN Graph regions won every time. The whole-run check keeps the timed tactics."""
    rounds = iter(range(10**6))

    def rotated(fns, run_inputs, timing):
        shift = next(rounds)
        return [1.0 + 0.001 * ((i + shift) % len(fns)) for i in range(len(fns))]

    monkeypatch.setattr(builder, "median_ms", rotated)
    monkeypatch.setattr(builder, "run_ms", lambda plans, run_inputs, timing: [1.0] + [2.0] * (len(plans) - 1))
    report = rebuild(spec, NOISY, CpuBackend(), times=4)
    assert report.flipped, "no tactic flip in 4 unpinned builds"
    for layer, seen in report.flipped.items():
        assert len(seen) >= 2 and all(t.startswith("gemm_") for t in seen)
        assert {build[layer] for build in report.tactics} == set(seen)
    # Each distinct set of tactics is a distinct engine.
    distinct_choices = {tuple(sorted(build.items())) for build in report.tactics}
    assert len(report.distinct_fingerprints) == len(distinct_choices) >= 2
    assert report.to_json()["flipped_layers"] == report.flipped


def test_pinned_rebuilds_are_identical_in_fingerprint_and_output_bits(spec, tmp_path):
    backend = CpuBackend()
    path = tmp_path / "pinned.json"
    build_engine(spec, NOISY, backend, path)
    pinned = rebuild(
        spec,
        BuildConfig(mode="fp32", error_on_cache_miss=True, options=NOISY.options),
        backend,
        5,
        path,
    )
    assert len(pinned.fingerprints) == 5
    assert len(pinned.distinct_fingerprints) == 1
    assert pinned.flipped == {}
    assert pinned.outputs_identical and pinned.identical


def test_rebuild_never_writes_the_cache_and_needs_two_builds(spec, tmp_path):
    backend = CpuBackend()
    path = tmp_path / "c.json"
    build_engine(spec, NOISY, backend, path)
    cache = TimingCache.load(path)
    assert cache.remove(cache.by_layer("linear")[0].key)  # so each rebuild has a layer to time
    cache.save(path)
    before = path.read_bytes()
    report = rebuild(spec, NOISY, backend, 2, path)
    assert len(report.fingerprints) == 2
    assert path.read_bytes() == before
    with pytest.raises(HarnessError, match=r"--times 1: valid: 2\.\.100"):
        rebuild(spec, NOISY, backend, 1)
