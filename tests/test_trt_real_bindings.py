"""The backend against the real TensorRT Python bindings of 10.8, 10.13, 11.0 and 11.4.

Each version's ``tensorrt-cu12-bindings`` wheel is imported in a subprocess
over a tiny stand-in for TensorRT's native libraries (tests/trt_bindings.py).

What this exercises, for real, on every version: the ``BuilderFlag`` and
``NetworkDefinitionCreationFlag`` members and their integer values (which differ
between 10.x and 11.x), the version gates for weak typing and the editable
cache, turning the harness's flag names into the real enum members,
``TimingCacheKey.parse`` and ``str(key)``, ``TimingCacheValue`` (float32
times, the UINT64_MAX invalid hash), subclassing the real ``ILogger`` with its
real ``Severity`` names, that two builds hand TensorRT one and the same logger,
and that every class and method the backend calls exists.

What it does not exercise: the stand-in creates no builder, runtime or parser
(each returns NULL), so nothing is built, timed, serialized, deserialized,
inspected or run, no timing cache exists (a recording double stands in for
``ITimingCache``, fed real keys and values: the probe's, and :data:`PIN_CHECK`'s
for the check of a build's selections), and TensorRT itself logs nothing.
Those need a GPU: the ``gpu`` tests in test_tensorrt_backend.py.

No skipping: if the wheels cannot be downloaded or the stand-in cannot be
compiled, these tests fail and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trt_bindings

from harness.engines.protocol import PRECISION_MODES

pytestmark = pytest.mark.slow  # each TensorRT version's bindings load in a process of their own

KEY = "0x1814870c44ff0f8574df6e3dda04cbd7"
CACHE_FLAGS = ["EDITABLE_TIMING_CACHE", "DISABLE_COMPILATION_CACHE", "ERROR_ON_TIMING_CACHE_MISS"]
WEAK = ("weak-fp16", "weak-bf16")


def _wheels(tmp_path_factory):
    """The bindings' cache directory and each version's wheel, fetched once."""
    # Beside pytest's numbered temporary directories, so that later runs reuse the download.
    cache = trt_bindings.cache_dir(tmp_path_factory.getbasetemp().parent / "trt-bindings")
    try:
        return cache, trt_bindings.fetch_wheels(cache)
    except trt_bindings.Unavailable as exc:
        pytest.fail(f"the real-bindings tests need the {trt_bindings.PACKAGE} wheels and a C compiler: {exc}")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    cache, wheels = _wheels(tmp_path_factory)
    return {version: trt_bindings.run_probe(cache, version, wheel) for version, wheel in wheels.items()}


# Run under each version's real bindings: TensorRT's cache after a build, as
# harness.engines.tensorrt.cache_bridge.moved_selections reads it (a ``query`` per selected
# key), holding real TimingCacheKey/TimingCacheValue objects and answering a key it lacks with a
# real TimingCacheValue of the invalid hash, as NvInfer.h documents.
PIN_CHECK = r"""
import json, sys
import tensorrt_bindings
sys.modules["tensorrt"] = tensorrt_bindings
import tensorrt as trt
from harness.cache.operations import pin
from harness.cache.timing_cache import Provenance
from harness.engines.tensorrt.cache_bridge import INVALID_TACTIC_HASH, export_trt_cache, moved_selections, selected_hash
from harness.engines.tensorrt.log_parser import parse_log_file

KEY = "0x1814870c44ff0f8574df6e3dda04cbd7"
OTHER = "0xb222b0832016f1115ff61116c094875a"


class BuiltCache:
    def __init__(self, values):
        self.values = {str(trt.TimingCacheKey.parse(k)): v for k, v in values.items()}
        self.queried = []

    def queryKeys(self):
        return [trt.TimingCacheKey.parse(k) for k in self.values]

    def query(self, key):
        self.queried.append(type(key).__name__)
        return self.values.get(str(key), trt.TimingCacheValue(INVALID_TACTIC_HASH, 0.0))


log = parse_log_file(sys.argv[1])
pins = export_trt_cache(BuiltCache({KEY: trt.TimingCacheValue(0x665DED9ABBF88, 0.011264)}), log, Provenance("tensorrt", trt.__version__, "p"))
kept = BuiltCache({KEY: trt.TimingCacheValue(0x665DED9ABBF88, 0.011264)})
moved = BuiltCache({KEY: trt.TimingCacheValue(0x393E4EF8AD243, 0.0118784), OTHER: trt.TimingCacheValue(0x1, 0.5)})
report = {
    "invalid_value_hash": trt.TimingCacheValue(INVALID_TACTIC_HASH, 0.0).tacticHash == INVALID_TACTIC_HASH,
    "upper_case_key": selected_hash(kept, KEY.upper().replace("0X", "0x"), trt),
    "absent_key": selected_hash(kept, OTHER, trt),
    "kept": moved_selections(kept, pins, trt, error_on_miss=True),
    "moved": moved_selections(moved, pins, trt, error_on_miss=True),
    "query_key_types": sorted(set(kept.queried + moved.queried)),
}
pin(pins, "matMul1", "0x393e4ef8ad243")
report["never_applied"] = moved_selections(BuiltCache({}), pins, trt, error_on_miss=False)
print(json.dumps(report))
"""


def run_under_bindings(cache, version: str, wheel, code: str, *args: str) -> dict:
    """Run ``code`` in a subprocess under the real bindings of ``version`` (as the probe runs);
    the JSON object it prints last."""
    major = int(version.split(".")[0])
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(
            p for p in (str(trt_bindings.standin(cache, major)), os.environ.get("LD_LIBRARY_PATH")) if p
        ),
        "PYTHONPATH": os.pathsep.join((str(trt_bindings.extracted(wheel)), str(trt_bindings.REPO))),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=trt_bindings.REPO, timeout=300
    )
    if done.returncode != 0:
        raise AssertionError(f"under {wheel.name}:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pin_checks(tmp_path_factory) -> dict[str, dict]:
    cache, wheels = _wheels(tmp_path_factory)
    log = trt_bindings.REPO / "tests" / "data" / "trt" / "editable_10.8_sample_readme.log"
    return {version: run_under_bindings(cache, version, wheel, PIN_CHECK, str(log)) for version, wheel in wheels.items()}


@pytest.fixture(params=trt_bindings.VERSIONS)
def report(request, reports) -> dict:
    found = reports[request.param]
    assert found["version"].startswith(request.param + "."), found["version"]
    return found


def major(report: dict) -> int:
    return int(report["version"].split(".")[0])


def test_every_class_and_method_the_backend_calls_exists(report):
    assert report["module_attributes_missing"] == []
    assert report["called_missing"] == []
    signatures = report["signatures"]
    assert "key: tensorrt_bindings.tensorrt.TimingCacheKey, value: tensorrt_bindings.tensorrt.TimingCacheValue) -> bool" in signatures["ITimingCache.update"]
    assert "ignore_mismatch: bool) -> bool" in signatures["IBuilderConfig.set_timing_cache"]
    assert "serialized_timing_cache" in signatures["IBuilderConfig.create_timing_cache"]
    assert "format: tensorrt_bindings.tensorrt.LayerInformationFormat) -> str" in signatures["EngineInspector.get_engine_information"]
    assert "(self: tensorrt_bindings.tensorrt.IExecutionContext, name: str, memory:" in signatures["IExecutionContext.set_tensor_address"]


def test_version_parsing_and_gates(report):
    assert report["parsed_version"] == ".".join(report["version"].split(".")[:4]).removesuffix(".post1")
    modes = report["modes"]
    for mode in PRECISION_MODES:
        if mode in WEAK and major(report) >= 11:
            assert modes[mode]["error"].startswith(f"weak typing (mode {mode}) was removed in TensorRT 11")
        else:
            assert "error" not in modes[mode], modes[mode]
    deprecated = [w for mode in WEAK if "warnings" in modes[mode] for w in modes[mode]["warnings"]]
    # Weak typing warns from 10.12 (deprecated) to the last 10.x; 11 removed it (an error above).
    if (10, 12) <= tuple(int(p) for p in report["version"].split(".")[:2]) < (11, 0):
        assert len(deprecated) == 2 and "deprecated since TensorRT 10.12" in deprecated[0]
    else:
        assert deprecated == []


def test_flag_names_become_the_real_enum_members(report):
    members = report["builder_flag_members"]
    for mode, seen in report["modes"].items():
        if "error" in seen:
            continue
        weak = {"weak-fp16": ["FP16", "OBEY_PRECISION_CONSTRAINTS"], "weak-bf16": ["BF16", "OBEY_PRECISION_CONSTRAINTS"]}
        assert seen["builder_flags"] == ["TF32", *weak.get(mode, []), *CACHE_FLAGS]
        assert seen["all_builder_flag_members"] and seen["detailed"] and seen["cleared"] == []
        # STRONGLY_TYPED is member 1 on 10.x and member 0 on 11.x: the bit follows the loaded enum.
        strongly_typed = 0 if mode in WEAK else (1 << (1 if major(report) == 10 else 0))
        assert seen["network_bits"] == strongly_typed
    # Enum integers differ between versions; the harness only ever stores names.
    assert members["EDITABLE_TIMING_CACHE"] == (27 if major(report) == 10 else 26)
    assert members["ERROR_ON_TIMING_CACHE_MISS"] == (16 if major(report) == 10 else 15)
    assert ("FP16" in members) == (major(report) == 10)


def test_settings_for_10x_applied_to_11x_name_the_missing_flag(report):
    if major(report) == 10:
        assert report["weak_10_13_here"] is None
    else:
        message = report["weak_10_13_here"]
        assert message.startswith(f"BuilderFlag.FP16 does not exist in the installed TensorRT {report['parsed_version']}")
        assert "valid names: DEBUG" in message and "EDITABLE_TIMING_CACHE" in message


def test_keys_and_values_round_trip_through_the_real_types(report):
    keys = report["keys"]
    assert keys["upper_case_round_trip"] == KEY  # TimingCacheKey.parse lower-cases
    # The exported time is what TimingCacheValue keeps: a float32.
    assert keys["exported"] == [KEY, "matMul1", "0x665ded9abbf88", 0.011264000087976456]
    assert keys["updates"] == [["TimingCacheKey", KEY, "TimingCacheValue", 0x393E4EF8AD243, 0.01187840010970831]]
    assert keys["refused"] == []
    # A malformed key never reaches TimingCacheKey.parse, which would raise a bare ValueError.
    assert keys["parse_error"] == "The text should have exactly 34 characters."
    assert keys["odd"] == ["layer 'conv' (key 0x1234): not a TensorRT cache key (expected 0x and 32 hex digits)"]
    assert "has the invalid tactic hash 0xffffffffffffffff" in keys["invalid_hash"]


def test_one_logger_for_every_builder_and_runtime(report):
    seen = report["logging"]
    assert seen["is_ilogger"] and seen["same_logger"]
    assert seen["captured"] == [
        "[F] [TRT] message INTERNAL_ERROR",
        "[E] [TRT] message ERROR",
        "[W] [TRT] message WARNING",
        "[I] [TRT] message INFO",
        "[V] [TRT] message VERBOSE",
    ]
    # Two builds and a runtime reached TensorRT's entry points (the stand-in refused them)...
    assert seen["failures"] == ["pybind11::init(): factory function returned nullptr"] * 3
    # ...each handing it the same logger, and the version the bindings were compiled for.
    assert len(seen["loggers_seen"]) == 3 and len(set(seen["loggers_seen"])) == 1 and seen["loggers_seen"][0]
    major_, minor = (int(p) for p in report["version"].split(".")[:2])
    patch = int(report["version"].split(".")[2])
    assert seen["versions_seen"] == [major_ * 10000 + minor * 100 + patch] * 3


def test_a_batch_sweeps_optimization_profile_is_made_of_the_real_dims(report):
    """One profile over the batch axis: min/max the sweep's extremes, opt its first size."""
    assert "min: tensorrt_bindings.tensorrt.Dims, opt: tensorrt_bindings.tensorrt.Dims, max: tensorrt_bindings.tensorrt.Dims" in (
        report["signatures"]["IOptimizationProfile.set_shape"]
    )
    assert "-> tensorrt_bindings.tensorrt.IOptimizationProfile" in report["signatures"]["Builder.create_optimization_profile"]
    assert "profile: tensorrt_bindings.tensorrt.IOptimizationProfile) -> int" in (
        report["signatures"]["IBuilderConfig.add_optimization_profile"]
    )
    seen = report["profiles"]
    # only the input with a dynamic batch axis gets a range, in TensorRT's own Dims
    assert seen["set"] == [[["x", ["Dims", [1, 3, 32, 32]], ["Dims", [8, 3, 32, 32]], ["Dims", [32, 3, 32, 32]]]]]
    assert seen["returned"] == {"x": [[1, 3, 32, 32], [8, 3, 32, 32], [32, 3, 32, 32]]} and seen["added"]
    # the profile is part of what decides kernels: the cache provenance and the engine record
    assert seen["kernel_options"]["batch_profile"] == {"dim": 0, "min": 1, "opt": 8, "max": 32}
    assert seen["builder_record"]["batch_profile"] == {"dim": 0, "min": 1, "opt": 8, "max": 32}
    assert seen["refused"].startswith("TensorRT refused the optimization profile {'x': [[1, 3, 32, 32]")
    assert seen["other_dim"].startswith("input 'x' of shape [2, -1] has dynamic dimension(s) [1]")
    assert "no input has a dynamic batch dimension" in seen["static"]


@pytest.mark.parametrize("version", trt_bindings.VERSIONS)
def test_a_builds_selections_are_checked_key_by_key_with_the_real_types(pin_checks, version):
    """Each selected key is parsed into a real TimingCacheKey and queried; the real
    TimingCacheValue keeps the invalid hash (UINT64_MAX) that answers a key the cache lacks."""
    seen = pin_checks[version]
    assert seen["invalid_value_hash"] and seen["query_key_types"] == ["TimingCacheKey"]
    assert (seen["upper_case_key"], seen["absent_key"]) == ("0x665ded9abbf88", None)
    assert seen["kept"] == []
    kernel = "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    assert seen["moved"] == [
        f"layer 'matMul1' (key {KEY}): the cache selects {kernel} (0x665ded9abbf88), built 0x393e4ef8ad243",
        "key 0xb222b0832016f1115ff61116c094875a: not in the timing cache, yet the build timed and kept tactic 0x1",
    ]
    assert seen["never_applied"] == [
        f"layer 'matMul1' (key {KEY}): the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x32x64_stage4"
        "_warpsize2x1x2_tensor16x8x8 (0x393e4ef8ad243), but the built cache has no such key, so the selection was never applied"
    ]
