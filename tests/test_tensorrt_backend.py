"""TensorRT backend: version gating, flag names, log capture; real builds on GPU runners.

Without a GPU only the decisions made *before* TensorRT runs are tested,
against a thin stand-in for the ``tensorrt`` module (version string, flag
enums whose integer values differ between the fake 10.x and 11.x, a base
``ILogger``). Every real call into TensorRT is type-checked by mypy against
the tensorrt-stubs instead (``nox -s lint``). The ``gpu`` tests build real
engines and skip, here only, when there is no CUDA device or no TensorRT.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import models
from harness.cache.timing_cache import CacheEntry, Candidate, Provenance, TimingCache
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import BuildConfig
from harness.engines.tensorrt.backend import TensorRTBackend, changed_decisions, name_entries
from harness.engines.tensorrt.builder import (
    LogCapture,
    layer_timings,
    make_logger,
    set_builder_flags,
)
from harness.engines.tensorrt.cache_bridge import UNKNOWN_LAYER
from harness.engines.tensorrt.log_parser import parse_log
from harness.engines.tensorrt.versions import load_tensorrt
from harness.errors import HarnessError

DATA = Path(__file__).parent / "data" / "trt"
KEY_CONV = "0xa4c123b1612dd272d1371c17149d4395"
KEY_GEMM = "0x36b3216fdaeeb975729fae923d5a4fd1"
KEY_SOFTMAX = "0x2aabfe228f219e9cb0eb53f16947ccf2"
KEY_OLD = "0xcc3fc1626e53a13043b026c48bbf33fe"
KEY_UNLOGGED = "0x0123456789abcdef0123456789abcdef"


class Member:
    """An enum member: TensorRT code may use its name and int(), nothing else."""

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    def __int__(self) -> int:
        return self.value


def enum(names: tuple[str, ...], first: int) -> SimpleNamespace:
    members = {name: Member(name, first + i) for i, name in enumerate(names)}
    return SimpleNamespace(__members__=members, **members)


class BaseLogger:
    def __init__(self) -> None:
        self.base_initialised = True


FLAGS_10 = (
    "FP16", "BF16", "TF32", "OBEY_PRECISION_CONSTRAINTS", "DISABLE_TIMING_CACHE",
    "EDITABLE_TIMING_CACHE", "ERROR_ON_TIMING_CACHE_MISS",
)  # fmt: skip
FLAGS_11 = ("TF32", "DISABLE_TIMING_CACHE", "EDITABLE_TIMING_CACHE", "ERROR_ON_TIMING_CACHE_MISS")


def fake_trt(version: str) -> SimpleNamespace:
    """Enough of ``tensorrt`` for the decisions made before a builder exists."""
    major = int(version.split(".")[0])
    return SimpleNamespace(
        __version__=version,
        BuilderFlag=enum(FLAGS_10 if major <= 10 else FLAGS_11, first=0 if major <= 10 else 40),
        NetworkDefinitionCreationFlag=enum(("STRONGLY_TYPED",), first=0 if major <= 10 else 3),
        ProfilingVerbosity=SimpleNamespace(DETAILED="detailed"),
        ILogger=BaseLogger,
    )


class ConfigDouble:
    """Records what the backend sets on an ``IBuilderConfig``."""

    def __init__(self) -> None:
        self.set: list[Member] = []
        self.cleared: list[Member] = []

    def set_flag(self, flag: Member) -> None:
        self.set.append(flag)

    def clear_flag(self, flag: Member) -> None:
        self.cleared.append(flag)


# --- version gating --------------------------------------------------------------------------


def test_weak_modes_on_tensorrt_11_are_refused_naming_the_replacements():
    backend = TensorRTBackend(fake_trt("11.0.0"))
    with pytest.raises(HarnessError, match="removed in TensorRT 11; use autocast-fp16 .* or fp16"):
        backend.check_mode("weak-fp16")
    with pytest.raises(HarnessError, match="removed in TensorRT 11; use autocast-bf16"):
        backend.settings(BuildConfig("weak-bf16"))
    assert "weak-fp16" not in backend.supported_modes()
    assert "autocast-bf16" in backend.supported_modes()


@pytest.mark.parametrize(("mode", "flag"), [("weak-fp16", "FP16"), ("weak-bf16", "BF16")])
def test_weak_modes_on_tensorrt_10_build_weakly_typed_with_the_precision_flag(mode, flag):
    trt = fake_trt("10.11.0")
    backend = TensorRTBackend(trt)
    backend.check_mode(mode)
    settings = backend.settings(BuildConfig(mode))
    assert settings.network_flags == ()  # not strongly typed: the builder picks precisions
    assert settings.builder_flags == ("TF32", flag, "OBEY_PRECISION_CONSTRAINTS", "EDITABLE_TIMING_CACHE")
    config = ConfigDouble()
    set_builder_flags(trt, config, settings)
    assert config.set == [trt.BuilderFlag.__members__[n] for n in settings.builder_flags]
    assert config.cleared == []
    assert config.profiling_verbosity == "detailed"


def test_weak_modes_warn_about_the_deprecation_from_10_12():
    backend = TensorRTBackend(fake_trt("10.13.0.35"))
    with pytest.warns(DeprecationWarning, match="deprecated since TensorRT 10.12"):
        backend.check_mode("weak-fp16")


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "autocast-fp16", "amp-bf16", "explicit"])
@pytest.mark.parametrize("version", ["10.11.0", "11.0.0"])
def test_other_modes_build_strongly_typed_without_precision_flags(mode, version):
    settings = TensorRTBackend(fake_trt(version)).settings(BuildConfig(mode))
    assert settings.network_flags == ("STRONGLY_TYPED",)
    assert settings.builder_flags == ("TF32", "EDITABLE_TIMING_CACHE")


def test_editable_cache_needs_tensorrt_10_8():
    with pytest.raises(HarnessError, match=r"need TensorRT 10\.8 or newer \(found 10\.7"):
        TensorRTBackend(fake_trt("10.7.0")).settings(BuildConfig("fp16"))


# --- flag names ------------------------------------------------------------------------------


def test_flags_are_recorded_by_name_identically_across_versions_with_different_enum_ints():
    config = BuildConfig("autocast-fp16", error_on_cache_miss=True)
    old, new = (TensorRTBackend(fake_trt(v)).settings(config) for v in ("10.11.0", "11.0.0"))
    assert int(fake_trt("10.11.0").BuilderFlag.TF32) != int(fake_trt("11.0.0").BuilderFlag.TF32)
    assert {**old.to_json(), "tensorrt_version": ""} == {**new.to_json(), "tensorrt_version": ""}
    record = old.to_json()
    assert record["builder_flags"] == ["TF32", "EDITABLE_TIMING_CACHE", "ERROR_ON_TIMING_CACHE_MISS"]
    assert record["network_flags"] == ["STRONGLY_TYPED"]
    # Cache-handling flags do not change kernels, so a cache stays valid with or without them.
    assert old.kernel_options() == TensorRTBackend(fake_trt("10.11.0")).settings(BuildConfig("autocast-fp16")).kernel_options()
    assert old.kernel_options() == {
        "mode": "autocast-fp16",
        "network_flags": ["STRONGLY_TYPED"],
        "builder_flags": ["TF32"],
        "tf32": True,
        "builder_optimization_level": 3,
        "avg_timing_iterations": 1,
    }


def test_builder_options_are_applied_and_recorded():
    trt = fake_trt("11.0.0")
    options = {"tf32": False, "builder_optimization_level": 5, "avg_timing_iterations": 4}
    settings = TensorRTBackend(trt).settings(BuildConfig("fp16", options=options))
    config = ConfigDouble()
    set_builder_flags(trt, config, settings)
    assert [m.name for m in config.set] == ["EDITABLE_TIMING_CACHE"]
    assert [m.name for m in config.cleared] == ["TF32"]
    assert (config.builder_optimization_level, config.avg_timing_iterations) == (5, 4)
    assert settings.kernel_options()["tf32"] is False
    assert settings.kernel_options()["builder_optimization_level"] == 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workspace": 1}, "unknown tensorrt builder option"),
        ({"builder_optimization_level": 7}, "expected 0..5"),
        ({"avg_timing_iterations": 0}, "expected an integer from 1 to 1000"),
        ({"tf32": "yes"}, "expected true or false"),
    ],
)
def test_invalid_builder_options_are_refused(options, message):
    with pytest.raises(HarnessError, match=message):
        TensorRTBackend(fake_trt("10.11.0")).settings(BuildConfig("fp16", options=options))


def test_a_disabled_cache_sets_disable_and_cannot_error_on_misses():
    backend = TensorRTBackend(fake_trt("10.11.0"))
    settings = backend.settings(BuildConfig("fp16", disable_cache=True))
    assert settings.builder_flags == ("TF32", "DISABLE_TIMING_CACHE")
    with pytest.raises(HarnessError, match="error-on-cache-miss needs a timing cache"):
        backend.settings(BuildConfig("fp16", disable_cache=True, error_on_cache_miss=True))


def test_a_flag_the_installed_tensorrt_lacks_is_refused_by_name():
    settings = TensorRTBackend(fake_trt("10.11.0")).settings(BuildConfig("weak-fp16"))
    eleven = fake_trt("11.0.0")  # no FP16 member
    with pytest.raises(HarnessError, match=r"BuilderFlag\.FP16 does not exist .*valid names: DISABLE"):
        set_builder_flags(eleven, ConfigDouble(), settings)


# --- VERBOSE log capture -> BuildLog ---------------------------------------------------------

_PREFIX = re.compile(r"^\[[^\]]*\] \[(?P<tag>[VIWE])\] \[TRT\] ")
_SEVERITIES = {"V": "VERBOSE", "I": "INFO", "W": "WARNING", "E": "ERROR"}


def replay(logger, path: Path) -> None:
    """Feed a recorded trtexec log to a logger as TensorRT would: severity + bare message."""
    for line in path.read_text().splitlines():
        match = _PREFIX.match(line)
        assert match is not None, line
        logger.log(SimpleNamespace(name=_SEVERITIES[match["tag"]]), line[match.end() :])


def test_verbose_logger_output_becomes_layer_timings():
    capture = LogCapture()
    logger = make_logger(fake_trt("10.13.0"), capture)
    assert isinstance(logger, BaseLogger) and logger.base_initialised
    replay(logger, DATA / "builder_10x_verbose.log")
    logger.log(SimpleNamespace(name="ERROR"), "Error Code 10: Could not find any implementation")
    assert capture.problems == ["Error Code 10: Could not find any implementation"]

    parsed = parse_log(capture.text)
    older = CacheEntry(KEY_OLD, "/older/layer", "kernel_a", "0x584d8c4fa281", 0.0123, (), pinned=True)
    unlogged = CacheEntry(KEY_UNLOGGED, UNKNOWN_LAYER, "0x77", "0x77", 0.001)
    final = [
        CacheEntry(KEY_CONV, UNKNOWN_LAYER, "0x8f86bebb2737", "0x8f86bebb2737", 0.019),
        older,
        unlogged,
    ]
    timings = {t.key: t for t in layer_timings(parsed, final, known_keys={KEY_OLD, KEY_CONV})}
    # Everything but the cut-off block.
    assert set(timings) == {KEY_CONV, KEY_GEMM, KEY_SOFTMAX, KEY_OLD, KEY_UNLOGGED}
    conv = timings[KEY_CONV]
    assert conv.layer == "/features/features.0/Conv + /features/features.1/Relu"
    assert conv.chosen_hash == "0x8f86bebb2737" and not conv.from_cache
    assert conv.chosen.startswith("sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64")
    assert [c.time_ms for c in conv.candidates] == [0.019328, 0.020192, 0.0216, 0.026208]
    assert timings[KEY_GEMM].layer == "(Unnamed Layer* 7) [MatrixMultiply]"
    assert (timings[KEY_SOFTMAX].chosen, len(timings[KEY_SOFTMAX].candidates)) == (
        "__myl_Exp_SumReduce_Div_0x786e4d3cea27d2",
        2,
    )
    # A key the JSON cache held and the builder did not autotune was served by the cache;
    # one it did not hold was created by this build.
    old = timings[KEY_OLD]
    assert (old.layer, old.chosen, old.from_cache) == ("/older/layer", "kernel_a", True)
    assert not timings[KEY_UNLOGGED].from_cache
    assert any("features.3/Conv" in p for p in parsed.problems)


# --- JSON cache bookkeeping ------------------------------------------------------------------

PROV = Provenance("tensorrt", "10.13.0.35", "NVIDIA A100 (sm_80)", {}, {"tf32": True})
CANDIDATES = (Candidate("kernel_a", "0xa", 0.5), Candidate("kernel_b", "0xb", 0.6))


def test_entries_the_log_does_not_name_take_names_from_the_json_cache():
    given = TimingCache(PROV, [CacheEntry(KEY_CONV, "conv + relu", "kernel_a", "0xa", 0.5, CANDIDATES, pinned=True)])
    exported = TimingCache(
        PROV,
        [
            CacheEntry(KEY_CONV, UNKNOWN_LAYER, "0xa", "0xa", 0.5),
            CacheEntry(KEY_GEMM, UNKNOWN_LAYER, "0xc", "0xc", 0.1),
        ],
    )
    conv, gemm = name_entries(exported, given)
    assert (conv.layer, conv.tactic, conv.candidates) == ("conv + relu", "kernel_a", CANDIDATES)
    assert gemm.layer == UNKNOWN_LAYER


def test_a_pinned_rebuild_adds_nothing_and_a_change_is_reported():
    pinned = CacheEntry(KEY_CONV, "conv + relu", "kernel_a", "0xa", 0.5, CANDIDATES, pinned=True)
    cache = TimingCache(PROV, [pinned])
    before = cache.digest()
    assert changed_decisions(cache, [CacheEntry(KEY_CONV, "conv + relu", "0x0A", "0x0A", 0.5)]) == []
    changed = CacheEntry(KEY_CONV, "conv + relu", "kernel_b", "0xb", 0.6)
    assert changed_decisions(cache, [changed]) == [changed]
    assert cache.digest() == before  # reported, never written into the caller's cache


# --- real builds (GPU runners) ---------------------------------------------------------------


def _no_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        load_tensorrt()
    except HarnessError as exc:
        return f"needs TensorRT: {exc}"
    except OSError as exc:  # the wheel is there, its native libraries are not
        return f"TensorRT's native library cannot be loaded: {exc}"
    return None


NO_GPU = _no_gpu_reason()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")


@pytest.mark.gpu
@needs_gpu
def test_pinned_rebuild_reproduces_the_engine_exactly(tmp_path):
    spec = models.load("lenet")
    mode = "autocast-fp16"
    compiled = compile_for_mode(spec, mode, None)
    backend = TensorRTBackend()
    config = BuildConfig(mode)
    cache = TimingCache(backend.provenance(config))
    first, first_log = backend.build(compiled, config, cache)
    assert first_log.new_entries and len(cache) == 0  # the given cache is never changed
    for entry in first_log.new_entries:
        cache.update(entry)
    assert first_log.layers and not any(t.from_cache for t in first_log.layers)
    cache.save(tmp_path / "cache.json")

    # A fresh backend has no binary cache of this network: it must discover the keys first.
    pinned = TimingCache.load(tmp_path / "cache.json")
    before = pinned.digest()
    second, second_log = TensorRTBackend().build(compiled, BuildConfig(mode, error_on_cache_miss=True), pinned)
    assert second.fingerprint() == first.fingerprint()
    assert all(t.from_cache for t in second_log.layers)
    assert pinned.digest() == before
    a = first.run(*spec.example_inputs)
    b = second.run(*spec.example_inputs)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))
    reference = compiled(*spec.example_inputs)
    assert (a[0].cpu() - reference).abs().max() <= 8 * 2.0**-10 * reference.abs().max()

    first.save(tmp_path / "engine")
    loaded = backend.load(tmp_path / "engine")
    assert loaded.fingerprint() == first.fingerprint()
    c = loaded.run(*spec.example_inputs)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, c, strict=True))


@pytest.mark.gpu
@needs_gpu
def test_error_on_cache_miss_with_an_empty_cache_fails_naming_the_problem():
    spec = models.load("lenet")
    compiled = compile_for_mode(spec, "fp16", None)
    backend = TensorRTBackend()
    config = BuildConfig("fp16", error_on_cache_miss=True)
    with pytest.raises(HarnessError, match="failed to build"):
        backend.build(compiled, config, TimingCache(backend.provenance(config)))
