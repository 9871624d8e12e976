"""Build orchestration: cache file round trips, pins, mismatches, flags, modes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.build import build_engine, save_build
from harness.cache.operations import pin
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend, CpuEngine, tactics
from harness.engines.modes import compile_for_mode, load_explicit
from harness.engines.protocol import BuildConfig
from harness.engines.registry import get_backend
from harness.errors import HarnessError
from harness.models import ModelSpec
from harness.outputs import tensor_paths

FAST = {"timing_runs": 3, "warmup_runs": 1}


def mlp_spec() -> ModelSpec:
    gen = torch.Generator().manual_seed(3)
    module = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    x = torch.randn(16, 256, generator=gen)
    return ModelSpec("mlp", "test MLP", module, (x,), [(x,)])


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return mlp_spec()


@pytest.fixture()
def backend() -> CpuBackend:
    return CpuBackend()


def config(**changes) -> BuildConfig:
    return BuildConfig(mode="fp32", options=FAST, **changes)


def test_cache_file_round_trip_makes_the_second_build_identical_without_timing(
    spec, backend, tmp_path
):
    path = tmp_path / "cache.json"
    first = build_engine(spec, config(), backend, path)
    timed = [t for t in first.log.layers if t.candidates]
    assert first.cache_misses == len(timed) >= 2 and first.cache_hits == 0
    cache = TimingCache.load(path)
    assert sorted(cache.query_keys()) == sorted(t.key for t in timed)
    assert all(cache.query(t.key).tactic == t.chosen for t in timed)
    written = path.read_bytes()
    mtime = path.stat().st_mtime_ns

    second = build_engine(spec, config(error_on_cache_miss=True), backend, path)
    assert second.cache_hits == len(timed) and second.cache_misses == 0
    assert second.engine.fingerprint() == first.engine.fingerprint()
    assert torch.equal(
        second.engine(*spec.example_inputs), first.engine(*spec.example_inputs)
    )
    assert second.cache_entries_added == 0
    assert path.read_bytes() == written and path.stat().st_mtime_ns == mtime


def test_build_writes_engine_directory_with_build_log(spec, backend, tmp_path):
    result = build_engine(spec, config(), backend, None)
    out = save_build(result, tmp_path / "engine")
    log = json.loads((out / "build_log.json").read_text())
    assert log["backend"] == "cpu" and log["mode"] == "fp32"
    linear = next(entry for entry in log["layers"] if entry["layer"] == "linear")
    assert linear["key"].startswith("0x") and len(linear["candidates"]) >= 2
    assert linear["chosen"] in {c["tactic"] for c in linear["candidates"]}
    loaded = CpuEngine.load(out)
    assert torch.equal(loaded(*spec.example_inputs), result.engine(*spec.example_inputs))


def test_corrupt_cache_is_an_error_and_never_overwritten(spec, backend, tmp_path):
    path = tmp_path / "cache.json"
    build_engine(spec, config(), backend, path)
    damaged = path.read_bytes()[:-40]
    path.write_bytes(damaged)
    with pytest.raises(HarnessError, match="not valid JSON"):
        build_engine(spec, config(), backend, path)
    assert path.read_bytes() == damaged


def test_cache_from_another_device_is_refused_unless_mismatch_is_ignored(spec, backend, tmp_path):
    path = tmp_path / "cache.json"
    build_engine(spec, config(), backend, path)
    cache = TimingCache.load(path)
    foreign = TimingCache(
        dataclasses.replace(cache.provenance, device="Some Other CPU (aarch64, DEFAULT: asimd)"),
        cache.entries(),
    )
    foreign.save(path)
    saved = path.read_bytes()
    with pytest.raises(HarnessError, match="device: Some Other CPU"):
        build_engine(spec, config(), backend, path)
    assert path.read_bytes() == saved
    result = build_engine(
        spec, config(ignore_cache_mismatch=True, error_on_cache_miss=True), backend, path
    )
    assert result.cache_hits == len(foreign)


def test_builder_options_are_part_of_the_cache_provenance(spec, backend, tmp_path):
    path = tmp_path / "cache.json"
    build_engine(spec, config(), backend, path)
    slower = BuildConfig(mode="fp32", options={"timing_runs": 5, "warmup_runs": 1})
    with pytest.raises(HarnessError, match="builder_options.timing_runs: 3 != 5"):
        build_engine(spec, slower, backend, path)


def test_error_on_cache_miss_names_the_layer_that_would_be_timed(spec, backend, tmp_path):
    with pytest.raises(
        HarnessError, match=r"layer 'linear' \(key 0x[0-9a-f]{32}\) is not in the timing cache"
    ):
        build_engine(spec, config(error_on_cache_miss=True), backend, tmp_path / "absent.json")
    assert not (tmp_path / "absent.json").exists()


def test_pinning_a_slower_tactic_changes_the_engine_and_the_engine_runs_it(backend, tmp_path):
    gen = torch.Generator().manual_seed(5)
    module = nn.Linear(256, 64).eval()
    x = torch.randn(32, 256, generator=gen)
    spec = ModelSpec("gemm", "one bf16 GEMM", module, (x,), [(x,)])
    bf16 = BuildConfig(mode="bf16", options=FAST)
    path = tmp_path / "cache.json"
    base = build_engine(spec, bf16, backend, path)
    record = next(t for t in base.log.layers if t.layer == "linear")
    slowest = max(record.candidates, key=lambda c: c.time_ms)
    assert slowest.tactic != record.chosen
    cache = TimingCache.load(path)
    pin(cache, "linear", slowest.tactic)
    cache.save(path)

    pinned = build_engine(spec, dataclasses.replace(bf16, error_on_cache_miss=True), backend, path)
    layer = next(layer for layer in pinned.engine.layers() if layer.name == "linear")
    assert layer.tactic == slowest.tactic and layer.tactic_hash == slowest.tactic_hash
    assert pinned.engine.fingerprint() != base.engine.fingerprint()
    # The engine's output is exactly what the pinned implementation computes.
    plan = pinned.engine.plan
    node = next(n for n in plan.nodes if n.name == "linear")
    impl, _ = tactics.parse_tactic(slowest.tactic)
    expected = tactics.bind(node, impl, plan.value_metas(), plan.weights)(
        x.to(torch.bfloat16)
    ).float()
    assert torch.equal(pinned.engine(x), expected)


def test_a_cached_tactic_the_layer_does_not_have_is_refused(spec, backend, tmp_path):
    path = tmp_path / "cache.json"
    build_engine(spec, config(), backend, path)
    cache = TimingCache.load(path)
    entry = cache.by_layer("linear")[0]
    cache.update(dataclasses.replace(entry, tactic="conv_nchw[fp32]", pinned=True))
    cache.save(path)
    with pytest.raises(
        HarnessError,
        match="layer 'linear'.*'conv_nchw\\[fp32\\]'.*valid tactics: gemm_direct\\[fp32\\]",
    ):
        build_engine(spec, config(), backend, path)


def test_disabled_and_read_only_caches_are_not_written(spec, backend, tmp_path):
    disabled = build_engine(spec, config(disable_cache=True), backend, tmp_path / "a.json")
    assert disabled.cache_misses >= 2 and not (tmp_path / "a.json").exists()
    read_only = build_engine(spec, config(editable_cache=False), backend, tmp_path / "b.json")
    assert read_only.cache_misses >= 2 and not (tmp_path / "b.json").exists()


def test_unknown_builder_option_is_refused(spec, backend):
    with pytest.raises(
        HarnessError,
        match="unknown cpu builder option.*timing_iterations.*valid: timing_runs, warmup_runs",
    ):
        build_engine(spec, BuildConfig(mode="fp32", options={"timing_iterations": 3}), backend)
    with pytest.raises(HarnessError, match="timing_runs=0"):
        build_engine(spec, BuildConfig(mode="fp32", options={"timing_runs": 0}), backend)


def test_explicit_mode_follows_the_file(spec, backend, tmp_path):
    path = tmp_path / "explicit.json"
    path.write_text(json.dumps({"^linear$": "bf16"}))
    result = build_engine(
        spec, BuildConfig(mode="explicit", explicit_path=str(path), options=FAST), backend
    )
    dtypes = {layer.name: layer.output_dtypes for layer in result.engine.layers()}
    assert dtypes["linear"] == ("bf16",) and dtypes["linear_1"] == ("fp32",)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"linear(": "fp16"}', "entry 'linear\\(' is not a valid regular expression"),
        ('{"linear": "int8"}', "invalid at linear: 'int8' is not one of"),
        ('["linear"]', "invalid at \\(top level\\)"),
        ("{}", "invalid at \\(top level\\)"),
        ('{"linear": ', "not valid JSON"),
    ],
)
def test_explicit_file_validation_names_the_file_and_entry(tmp_path, content, match):
    path = tmp_path / "explicit.json"
    path.write_text(content)
    with pytest.raises(HarnessError, match=match) as info:
        load_explicit(path)
    assert str(path) in str(info.value)


def test_mode_and_explicit_file_must_agree(spec, tmp_path):
    with pytest.raises(HarnessError, match="needs an explicit precision file"):
        compile_for_mode(spec, "explicit", None)
    with pytest.raises(HarnessError, match="but mode is 'fp32'"):
        compile_for_mode(spec, "fp32", str(tmp_path / "x.json"))
    with pytest.raises(HarnessError, match="unknown precision mode 'fp8'.*weak-bf16"):
        compile_for_mode(spec, "fp8", None)


def test_backend_registry(tmp_path):
    assert get_backend("cpu").name == "cpu"
    assert get_backend("auto").name == ("tensorrt" if torch.cuda.is_available() else "cpu")
    with pytest.raises(
        HarnessError,
        match="unknown backend 'gpu'; valid backends: cpu, onnxruntime, openvino, tensorrt, auto",
    ):
        get_backend("gpu")


def test_every_mode_builds_on_cpu(spec, backend, tmp_path: Path):
    explicit = tmp_path / "e.json"
    explicit.write_text('{"linear_1": "fp16"}')
    with torch.inference_mode():
        reference = spec.module(*spec.example_inputs)
    for mode in backend.supported_modes():
        cfg = BuildConfig(
            mode=mode, explicit_path=str(explicit) if mode == "explicit" else None, options=FAST
        )
        result = build_engine(spec, cfg, backend)
        out = result.engine(*spec.example_inputs)
        assert result.engine.mode == mode
        torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.15, msg=mode)


@pytest.mark.slow  # builds the subject twice in every mode
def test_one_export_serves_every_mode_and_is_left_as_it_was(backend, tmp_path: Path):
    """Building from the spec's own export gives, in every mode, the engine a build from the
    module gives (same layers, so every tactic comes from the module build's cache; same
    fingerprint; same bits), and leaves that export unchanged for the next mode. The subject's
    dtypes follow tensors at run time, which only the frontend's export records."""
    from harness.frontend.export import export_program
    from harness.frontend.provenance import DTYPE_FOLLOWS
    from tests.conformance.recreations import dtype_followers

    spec = dtype_followers()
    program = export_program(spec.module, spec.example_inputs)

    def snapshot() -> tuple[str, dict[str, object], dict[str, torch.Tensor]]:
        links = {n.name: n.meta.get(DTYPE_FOLLOWS) for n in program.graph.nodes}
        return program.graph_module.code, links, {k: v.clone() for k, v in program.state_dict.items()}

    before = snapshot()
    assert any(before[1].values()), "the subject exports no dtype link: it tests nothing here"
    explicit = tmp_path / "e.json"
    explicit.write_text(json.dumps({r"^(linear|conv1d)(_\d+)?$": "bf16"}))
    for mode in backend.supported_modes():
        explicit_path = str(explicit) if mode == "explicit" else None
        cache = tmp_path / f"{mode}.json"
        fresh = build_engine(spec, BuildConfig(mode=mode, explicit_path=explicit_path, options=FAST), backend, cache)
        config = BuildConfig(mode=mode, explicit_path=explicit_path, options=FAST, error_on_cache_miss=True)
        shared = build_engine(spec, config, backend, cache, program=program)
        assert shared.engine.fingerprint() == fresh.engine.fingerprint(), mode
        with torch.inference_mode():
            for got, want in zip(
                tensor_paths(shared.engine(*spec.example_inputs)),
                tensor_paths(fresh.engine(*spec.example_inputs)),
                strict=True,
            ):
                assert torch.equal(got[1], want[1]), (mode, got[0])
        after = snapshot()
        assert after[:2] == before[:2], mode
        assert all(torch.equal(after[2][k], v) for k, v in before[2].items()), mode
