"""TensorRT bridge, engine inspector and version rules, without a GPU.

Inputs are real TensorRT output (tests/data/trt/README.md). The bridge is exercised against a thin
double of ``ITimingCache`` that has only ``queryKeys``/``query``/``update`` with
the documented semantics (``update`` returns False for an absent key, a NaN
time deletes, ``query`` answers an absent key with the invalid hash), and a
tiny namespace standing in for the ``tensorrt`` module.
"""

from __future__ import annotations

import json
import math
import re
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.cache.operations import pin
from harness.cache.timing_cache import UNKNOWN_HASH, CacheEntry, Provenance, TimingCache
from harness.engines.tensorrt import versions
from harness.engines.tensorrt.cache_bridge import (
    INVALID_TACTIC_HASH,
    UNKNOWN_LAYER,
    apply_selections,
    check_pinned_layers,
    export_trt_cache,
    moved_selections,
    selected_hash,
)
from harness.engines.tensorrt.inspector import (
    InspectedLayer,
    TensorInfo,
    engine_information_json,
    oneline_document,
    parse_engine_information,
    read_engine_information,
    trt_fingerprint,
)
from harness.engines.tensorrt.join import base_name
from harness.engines.tensorrt.log_parser import parse_log, parse_log_file
from harness.engines.tensorrt.versions import TrtVersion
from harness.errors import HarnessError

DATA = Path(__file__).parent / "data" / "trt"
EDITABLE = DATA / "editable_10.8_sample_readme.log"
# TensorRT 11.0.0 (sm_100): a verbose build of the cookbook's MNIST model and its own ONELINE layers.
REAL_11 = "cookbook_11.0_detailed_build.log"
# TensorRT 10.16.1 (H100): `trtexec --dumpLayerInfo` of the same model at batch 1.
REAL_TRTEXEC_10_16 = "trtexec_10.16.1_dumpLayerInfo.log"


# Real keys of NVIDIA's sampleEditableTimingCache (README): matMul1 is in the log block,
# matMul2's only in the README's summary, so the log does not name it.
KEY_MATMUL1 = "0x1814870c44ff0f8574df6e3dda04cbd7"
KEY_MATMUL2 = "0xb222b0832016f1115ff61116c094875a"
PROV = Provenance("tensorrt", "10.8.0.43", "NVIDIA A100-SXM4-40GB (sm_80)", {}, {"tf32": True})


class Key:
    def __init__(self, text: str) -> None:
        self.text = text

    @staticmethod
    def parse(text: str) -> Key:
        return Key(text.lower())

    def __str__(self) -> str:
        return self.text


class Value:
    def __init__(self, tactic_hash: int, time_ms: float) -> None:
        self.tacticHash = tactic_hash
        self.timingMSec = time_ms


class TimingCacheDouble:
    """``queryKeys``/``query``/``update`` with ITimingCache's documented semantics: ``update``
    returns False for an absent key, a NaN time deletes, ``query`` answers an absent key with
    the invalid hash (NvInfer.h). (The real ``TimingCacheKey`` and ``TimingCacheValue`` of
    every TensorRT version are exercised in test_trt_real_bindings.)"""

    def __init__(self, values: dict[str, tuple[int, float]]) -> None:
        self.values = dict(values)

    def queryKeys(self) -> list[Key]:  # noqa: N802 - TensorRT's spelling
        return [Key(k) for k in self.values]

    def query(self, key: Key) -> Value:
        return Value(*self.values.get(str(key), (INVALID_TACTIC_HASH, 0.0)))

    def update(self, key: Key, value: Value) -> bool:
        if str(key) not in self.values:
            return False
        if math.isnan(value.timingMSec):
            del self.values[str(key)]
        else:
            self.values[str(key)] = (value.tacticHash, value.timingMSec)
        return True


FAKE_TRT = SimpleNamespace(TimingCacheKey=Key, TimingCacheValue=Value)


def trt_cache_after_build() -> TimingCacheDouble:
    # What TensorRT stored after the sample's build (times as float32, as TensorRT keeps them).
    return TimingCacheDouble({KEY_MATMUL1: (0x665DED9ABBF88, 0.011264), KEY_MATMUL2: (0x665DED9ABBF88, 0.0113)})


def exported() -> TimingCache:
    return export_trt_cache(trt_cache_after_build(), parse_log_file(EDITABLE), PROV)


# --- cache bridge ---------------------------------------------------------------------------


def test_export_joins_binary_cache_values_with_log_names():
    cache = exported()
    assert cache.provenance == PROV
    assert cache.query_keys() == [KEY_MATMUL1, KEY_MATMUL2]
    matmul = cache.query(KEY_MATMUL1)
    assert (matmul.layer, matmul.tactic, matmul.tactic_hash, matmul.time_ms) == (
        "matMul1",
        "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8",
        "0x665ded9abbf88",
        0.011264,
    )
    assert len(matmul.candidates) == 3
    other = cache.query(KEY_MATMUL2)
    assert (other.layer, other.tactic, other.candidates) == (UNKNOWN_LAYER, "0x665ded9abbf88", ())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((1, math.nan), "has an invalid time nan"),
        ((1, -1.0), "has an invalid time -1.0"),
        ((INVALID_TACTIC_HASH, 0.5), "has the invalid tactic hash 0xffffffffffffffff"),
    ],
)
def test_export_refuses_invalid_values(value, message):
    double = TimingCacheDouble({KEY_MATMUL1: value})
    with pytest.raises(HarnessError, match=f"key {KEY_MATMUL1} {message}"):
        export_trt_cache(double, parse_log_file(EDITABLE), PROV)


def test_the_selected_hash_of_a_key_is_queried_and_an_absent_key_is_none():
    """``query`` answers a key the cache lacks with the invalid hash: that is "no such key",
    never a tactic; a present key with an invalid time is refused."""
    built = trt_cache_after_build()
    assert selected_hash(built, KEY_MATMUL1.upper().replace("0X", "0x"), FAKE_TRT) == "0x665ded9abbf88"
    assert selected_hash(built, "0x000102030405060708090a0b0c0d0e0f", FAKE_TRT) is None
    with pytest.raises(HarnessError, match=f"key {KEY_MATMUL1} has an invalid time nan"):
        selected_hash(TimingCacheDouble({KEY_MATMUL1: (1, math.nan)}), KEY_MATMUL1, FAKE_TRT)


def test_round_trip_pin_in_json_then_apply_to_trt(tmp_path):
    path = tmp_path / "cache.json"
    exported().save(path)
    cache = TimingCache.load(path)
    pin(cache, "matMul1", "0x393e4ef8ad243")
    trt_cache = trt_cache_after_build()
    assert apply_selections(trt_cache, cache, FAKE_TRT) == []
    assert trt_cache.values[KEY_MATMUL1] == (0x393E4EF8AD243, 0.0118784)
    # Exporting again gives back exactly the edited JSON decisions.
    again = export_trt_cache(trt_cache, parse_log_file(EDITABLE), PROV)
    assert [(e.key, e.tactic_hash) for e in again.entries()] == [(e.key, e.tactic_hash) for e in cache.entries()]


def test_apply_reports_keys_tensorrt_does_not_have():
    trt_cache = TimingCacheDouble({KEY_MATMUL2: (1, 1.0)})
    errors = apply_selections(trt_cache, exported(), FAKE_TRT)
    assert len(errors) == 1
    assert errors[0].startswith(f"layer 'matMul1' (key {KEY_MATMUL1}): TensorRT refused")
    assert "EDITABLE_TIMING_CACHE" in errors[0]
    assert trt_cache.values == {KEY_MATMUL2: (0x665DED9ABBF88, 0.0113)}


def test_apply_rejects_other_backends_and_malformed_keys():
    cpu = TimingCache(replace(PROV, backend="cpu"), [CacheEntry("conv|nchw|f32", "conv", "direct", "0x1", 1.0)])
    with pytest.raises(HarnessError, match="backend 'cpu', not 'tensorrt'"):
        apply_selections(TimingCacheDouble({}), cpu, FAKE_TRT)
    odd = TimingCache(PROV, [CacheEntry("0x1234", "conv", "t", "0x1", 1.0)])
    assert apply_selections(TimingCacheDouble({"0x1234": (0, 1.0)}), odd, FAKE_TRT) == [
        "layer 'conv' (key 0x1234): not a TensorRT cache key (expected 0x and 32 hex digits)"
    ]


def built_cache(hashes: dict[str, int]) -> TimingCacheDouble:
    """TensorRT's cache after a build that selected ``hashes`` (key -> tactic hash)."""
    return TimingCacheDouble({key: (tactic_hash, 0.0113) for key, tactic_hash in hashes.items()})


def test_a_pinned_tactic_that_moved_fails_naming_the_layer():
    """Each selected key is looked up in TensorRT's cache after the build (``query``)."""
    pins = exported()
    pin(pins, "matMul1", "0x393e4ef8ad243")
    kept = {KEY_MATMUL1: 0x393E4EF8AD243, KEY_MATMUL2: 0x665DED9ABBF88}
    assert moved_selections(built_cache(kept), pins, FAKE_TRT, error_on_miss=True) == []
    moved = {**kept, KEY_MATMUL1: 0x665DED9ABBF88}
    assert moved_selections(built_cache(moved), pins, FAKE_TRT, error_on_miss=False) == [
        f"layer 'matMul1' (key {KEY_MATMUL1}): the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x32x64"
        "_stage4_warpsize2x1x2_tensor16x8x8 (0x393e4ef8ad243), built 0x665ded9abbf88"
    ]
    # A key the pins lack was timed: a miss, which error-on-miss forbids even where TensorRT
    # (11.0) did not stop the build.
    extra = {**kept, "0x000102030405060708090a0b0c0d0e0f": 0x1}
    assert moved_selections(built_cache(extra), pins, FAKE_TRT, error_on_miss=False) == []
    assert moved_selections(built_cache(extra), pins, FAKE_TRT, error_on_miss=True) == [
        "key 0x000102030405060708090a0b0c0d0e0f: not in the timing cache, yet the build timed and kept tactic 0x1"
    ]


def test_a_pinned_key_missing_from_the_built_cache_fails():
    """``update`` refuses a key TensorRT's cache lacks, so such a pin was never applied; an
    ``op:`` entry of a trtexec build is no TensorRT key at all (apply_selections says so)."""
    pins = exported()
    pins.update(CacheEntry("op:node_linear", "node_linear", "kernel", UNKNOWN_HASH, 0.01))
    built = built_cache({KEY_MATMUL1: 0x665DED9ABBF88})
    assert moved_selections(built, pins, FAKE_TRT, error_on_miss=False) == [
        f"layer {UNKNOWN_LAYER!r} (key {KEY_MATMUL2}): the cache selects 0x665ded9abbf88 (0x665ded9abbf88), but the "
        "built cache has no such key, so the selection was never applied"
    ]
    assert apply_selections(trt_cache_after_build(), pins, FAKE_TRT) == [
        "layer 'node_linear' (key op:node_linear): not a TensorRT cache key (expected 0x and 32 hex digits)"
    ]
    keyed = TimingCache(PROV, [CacheEntry(KEY_MATMUL1, "matMul1", "kernel", UNKNOWN_HASH, 0.01)])
    assert apply_selections(trt_cache_after_build(), keyed, FAKE_TRT) == [
        f"layer 'matMul1' (key {KEY_MATMUL1}): its kernel kernel is known by name only, so TensorRT cannot be told to select it"
    ]


def sample_layer() -> InspectedLayer:
    """The sample's real engine layer ``matMul1_myl0_0`` (its ONELINE line)."""
    (layer,) = read_engine_information(EDITABLE.read_text(), "sample").layers
    return layer


def verdicts(cache: TimingCache, keyed: list[tuple[InspectedLayer, str]]) -> list[tuple[str, str, str]]:
    return [(check.layer, check.verdict, check.detail) for check in check_pinned_layers(cache, keyed)]


def test_the_kernel_an_engine_layer_runs_is_checked_against_its_pin():
    """Independent of the timing cache: the real layer runs the one candidate of its kernel name,
    the tactic the sample selected."""
    pins = exported()
    assert verdicts(pins, [(sample_layer(), KEY_MATMUL1)]) == [
        ("matMul1_myl0_0", "kept", "the engine runs the selected sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64"
         "_stage3_warpsize2x1x2_tensor16x8x8 (0x665ded9abbf88)"),
    ]  # fmt: skip
    pin(pins, "matMul1", "0x393e4ef8ad243")
    (check,) = check_pinned_layers(pins, [(sample_layer(), KEY_MATMUL1)])
    assert check.line() == (
        f"layer 'matMul1_myl0_0' (key {KEY_MATMUL1}): the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x32x64"
        "_stage4_warpsize2x1x2_tensor16x8x8 (0x393e4ef8ad243), the engine runs sm80_xmma_gemm_f32f32_tf32f32_f32"
        "_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8 (0x665ded9abbf88)"
    )
    assert check.verdict == "moved"
    # A key the cache does not select is not the layer check's business (moved_selections').
    assert check_pinned_layers(TimingCache(PROV), [(sample_layer(), KEY_MATMUL1)]) == []


def real_11x():
    """The real TensorRT 11.0 build: its log's Myelin ops and its engine's layers, by name."""
    text = (DATA / REAL_11).read_text()
    ops = {op.layer: op for op in parse_log(text).layers}
    layers = {layer.name: layer for layer in read_engine_information(text, "11.0 build").layers}
    return ops, layers


def pinned(op, tactic_hash: str, key: str = KEY_MATMUL1) -> TimingCache:
    """A cache selecting ``tactic_hash`` for ``op`` under ``key``, with the op's measured candidates
    (the real log has no keys: it was built without the editable cache)."""
    (chosen,) = [c for c in op.candidates if c.tactic_hash == tactic_hash]
    return TimingCache(PROV, [CacheEntry(key, op.layer, chosen.tactic, chosen.tactic_hash, chosen.time_ms, op.candidates)])


def test_a_real_11x_layer_is_kept_or_moved_only_through_the_one_candidate_it_runs():
    """TensorRT 11.0: no layer has a TacticValue. ``node_conv2d_myl0_2`` runs the one measured
    candidate of its kernel name; ``node_linear_myl0_7`` and ``node_conv2d_1_myl0_4`` run a kernel
    several candidates share (tile shape, cga): which one, the engine does not say, so whatever
    is pinned they are unverifiable, never kept and never moved."""
    ops, layers = real_11x()
    conv = layers["node_conv2d_myl0_2"]
    assert [v[:2] for v in verdicts(pinned(ops["node_conv2d"], "0x447797f84b244"), [(conv, KEY_MATMUL1)])] == [
        ("node_conv2d_myl0_2", "kept")
    ]
    assert verdicts(pinned(ops["node_conv2d"], "0x61203a5779dda"), [(conv, KEY_MATMUL1)]) == [
        ("node_conv2d_myl0_2", "moved",
         "the cache selects sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x16x32"
         "_stage1_warpsize4x1x1_g1_tensor16x8x8_aligna4_alignc4 (0x61203a5779dda), the engine runs sm80_xmma_fprop_implicit"
         "_gemm_indexed_wo_smem_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x16x32_stage1_warpsize4x1x1_g1_tensor16x8x8"
         "_aligna4_alignc8 (0x447797f84b244)"),
    ]  # fmt: skip
    linear = layers["node_linear_myl0_7"]
    shared = (
        "unverifiable: 2 candidates its key measured are kernel sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64"
        "_stage3_warpsize2x1x2_tensor16x8x8 (0x4754af3ee6112, 0x2c80ce2f5c4a6), and the engine does not say which one it runs"
    )
    # Pinned to its kernel's fastest variant, or to another kernel: unverifiable either way.
    for tactic_hash in ("0x4754af3ee6112", "0x601ffa534e573"):
        ((layer, verdict, detail),) = verdicts(pinned(ops["node_linear"], tactic_hash), [(linear, KEY_MATMUL1)])
        assert (layer, verdict) == ("node_linear_myl0_7", "unverifiable")
        assert detail.startswith(shared + "; the cache selects sm80_xmma_gemm") and detail.endswith(f"({tactic_hash})")
    conv_1 = layers["node_conv2d_1 [profile 1]_myl1_4"]
    ((_, verdict, detail),) = verdicts(pinned(ops["node_conv2d_1"], "0x338b9af98fb76"), [(conv_1, KEY_MATMUL1)])
    assert verdict == "unverifiable" and detail.startswith("unverifiable: 6 candidates its key measured are kernel cutlass3x")


def test_a_layer_running_no_candidate_of_its_key_is_unverifiable():
    """The false moves of a kernel-name comparison. (1) TensorRT 10.16 runs ``node_linear`` on a
    cuBLAS gemv kernel at batch 1 (the real ``trtexec --dumpLayerInfo``), which the op's table of
    the same model's dynamic-shape build (the real 10.16.2 log) does not list. (2) A Myelin-timed
    op joined to the Cask layer it lost to: the real 10.16 Cask layer ``node_conv2d + node_relu``
    runs tactic 0xcf8ea142095f02d2, whose kernel name is that of a candidate the real 11.0 Myelin op
    ``node_conv2d`` measured under another hash. (3) A layer naming no kernel, a pin without
    candidates, a pin known by name only."""
    ops_10 = {op.layer: op for op in parse_log_file(DATA / "cookbook_10.16.2_detailed_build.log").layers}
    trtexec = {layer.name: layer for layer in read_engine_information((DATA / REAL_TRTEXEC_10_16).read_text(), "trtexec").layers}
    gemv = trtexec["node_linear_myl4_0"]
    assert gemv.tactic_name.startswith("sm50_xmma_cublas_gemvx") and gemv.tactic_value is None
    assert verdicts(pinned(ops_10["node_linear"], "0x2c80ce2f5c4a6"), [(gemv, KEY_MATMUL1)]) == [
        ("node_linear_myl4_0", "unverifiable",
         "unverifiable: its kernel sm50_xmma_cublas_gemvx_f32f32_f32_f32_tn_n_int32_unit_n_launch_param4x32x32_strided_unit"
         "_stride is none of the 100 candidates its key measured; the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n"
         "_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8 (0x2c80ce2f5c4a6)"),
    ]  # fmt: skip
    ops_11, _ = real_11x()
    cask = {layer.name: layer for layer in read_engine_information((DATA / "cookbook_10.16.2_detailed_build.log").read_text(), "10.16").layers}["node_conv2d + node_relu"]
    assert any(c.tactic == cask.tactic_name for c in ops_11["node_conv2d"].candidates)  # a name, not the tactic
    ((_, verdict, detail),) = verdicts(pinned(ops_11["node_conv2d"], "0x447797f84b244"), [(cask, KEY_MATMUL1)])
    assert (verdict, detail.split("; ")[0]) == (
        "unverifiable", f"unverifiable: its tactic 0xcf8ea142095f02d2 ({cask.tactic_name}) is none of the 6 candidates its key measured"
    )
    shape_call = read_engine_information((DATA / REAL_11).read_text(), "11.0").layers[0]
    sample = exported()
    bare = TimingCache(PROV, [replace(e, candidates=()) for e in sample.entries()])
    by_name = TimingCache(PROV, [replace(e, tactic_hash=UNKNOWN_HASH) for e in sample.entries()])
    kernel = "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    assert [detail for _, _, detail in verdicts(sample, [(shape_call, KEY_MATMUL1)])
            + verdicts(bare, [(sample_layer(), KEY_MATMUL1)]) + verdicts(by_name, [(sample_layer(), KEY_MATMUL1)])] == [
        f"unverifiable: the engine names no kernel for it; the cache selects {kernel} (0x665ded9abbf88)",
        f"unverifiable: the cache records no measured candidates for its key; the cache selects {kernel} (0x665ded9abbf88)",
        f"unverifiable: the cache knows its tactic by name only; the cache selects {kernel} (hash unknown)",
    ]  # fmt: skip


def test_load_tensorrt_explains_missing_bindings(monkeypatch):
    # tensorrt-stubs alone makes `import tensorrt` succeed as an empty namespace package.
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    with pytest.raises(HarnessError, match="only type stubs"):
        versions.load_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(HarnessError, match="needs the `tensorrt` Python package"):
        versions.load_tensorrt()
    assert versions.load_tensorrt(FAKE_TRT) is FAKE_TRT


# --- engine inspector -----------------------------------------------------------------------


def real_json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


# The data type word of a 10.x string -> TensorRT's DataType name, as NVIDIA's 11.x migration
# page spells it ("DataType": "Float"), and back to the word a format string uses.
_TRT_DTYPES = {"FP32": "Float", "Float": "Float", "FP16": "Half", "Half": "Half", "BF16": "BFloat16",
               "Int8": "Int8", "Int32": "Int32", "Int64": "Int64", "Bool": "Bool"}  # fmt: skip
_FORMAT_WORDS = {"Float": "FP32", "Half": "FP16", "BFloat16": "BF16"}
_MYELIN_NAME = re.compile(r"_myl\d+_\d+$")
_PROFILE = re.compile(r" \[profile (\d+)\]$")


def _datatype(combined: str) -> str:
    """The DataType of a real 10.x ``Format/Datatype`` string, read as NVIDIA's cookbook reads
    it (``get_engine_tensor_info``: the word before "format", else the last word); kept
    independent of the parser under test."""
    words = combined.split(" ")
    word = words[words.index("format") - 1] if "format" in words else words[-1]
    return _TRT_DTYPES[word]


def _tensor_11x(t: dict) -> dict:
    datatype = _datatype(t["Format/Datatype"])
    dims = t.get("Dimensions", [])
    strides, stride = [], 1
    for d in reversed(dims):  # row-major strides; a dynamic (-1) dimension makes the rest -1
        strides.insert(0, stride)
        stride = stride * d if stride > 0 and d > 0 else -1
    channel_major = "Channel major" in t["Format/Datatype"]
    return {
        "Name": t["Name"],
        "Dimensions": dims,
        "Format": "(NHWC) Channel major format" if channel_major
        else f"Row major linear {_FORMAT_WORDS.get(datatype, datatype)} format (kLINEAR)",
        "Datatype": datatype,
        "Strides": strides,
        "StrideOrder": list(range(len(dims) - 1, -1, -1)),
    }  # fmt: skip


def _constants_11x(layer: dict) -> list[dict]:
    """The 10.x ``Weights``/``Bias`` counts of a layer as 11.x ``Constants`` tensors."""
    return [
        _tensor_11x({"Name": f"{layer['Name']} {field.lower()}", "Dimensions": [layer[field]["Count"]],
                     "Format/Datatype": f"Row major linear {layer[field]['Type']}"})
        for field in ("Weights", "Bias")
        if isinstance(layer.get(field), dict)
    ]  # fmt: skip


def as_11x(doc: dict, *, io: tuple[str, ...] = (), layout_only: bool = False) -> dict:
    """A real TensorRT 10.x inspector document rewritten as a TensorRT 11.x engine would print it.

    Real, from the input: every layer, its type, tensors (names, dimensions), ONNX
    ``Metadata``, ``TacticName``, and the names of Myelin layers (``node_linear_myl7_1``,
    ``node_linear [profile 1]_myl15_1``). No real 11.x inspector JSON is public (the real
    11.0 ONELINE layers are in tests/data/trt), so the rest is derived by rule from
    what NVIDIA documents:

    * layout ("Migrating IEngineInspector Usage from TensorRT 10.x to 11.x"): ``Bindings``
      (or ``io``) becomes ``I/O Tensors`` objects shaped like that page's example (``Name``,
      ``IOMode``, ``DataType`` "Float"/"Half", ``Dimensions``, ``Location``,
      ``IsShapeInferenceIO``, ``ProfileInfo``); a layer tensor's ``Format/Datatype`` becomes
      ``Format`` plus ``Datatype`` (TensorRT's DataType names, as that page spells them);
      layer tensors have no ``Location``.
    * the rest of an 11.x engine (``layout_only=False``): ``Format`` strings as 11.x writes
      them, "(NHWC) Channel major format" (the one known real example) for channel-major
      tensors, else that page's "Row major linear FP32 format (kLINEAR)" spelling;
      ``Strides`` and ``StrideOrder`` on every tensor (values derived from the dimensions,
      not real); a ``Constants`` list per layer (the 10.x ``Weights``/``Bias`` counts);
      no ``TacticValue`` anywhere (every 11.x layer is a Myelin layer, and real Myelin
      layers carry none); every layer named ``<op>_myl<k>_<n>``: a real Myelin name is
      kept, any other layer is renamed ``<its 10.x name>_myl<profile>_<index>``, its 10.x
      name being the op's name in the recorded 10.x log (Cask ops are logged under their
      layer's name). Whether 11.x keeps the fused ``node_conv2d + node_relu`` in the name or
      names the op after its first ONNX node, as 10.x Myelin does (``node_linear`` for
      node_linear + node_relu_2), is unknown: the join covers the latter through the ONNX
      nodes (tests/data/trt/README.md lists it).
    """
    names = list(doc.get("Bindings", io))
    by_name = {t["Name"]: t for layer in doc["Layers"] for t in [*layer["Outputs"], *layer["Inputs"]]}
    consumed = {t["Name"] for layer in doc["Layers"] for t in layer["Inputs"]}

    def tensor(t: dict) -> dict:
        new = _tensor_11x(t)
        if layout_only:  # only the split of Format/Datatype: the old text, the DataType name
            return {"Name": t["Name"], "Dimensions": new["Dimensions"], "Format": t["Format/Datatype"],
                    "Datatype": new["Datatype"]}  # fmt: skip
        return new

    def layer_11x(index: int, layer: dict) -> dict:
        new = {key: value for key, value in layer.items() if key not in ("Weights", "Bias")}
        new["Inputs"] = [tensor(t) for t in layer["Inputs"]]
        new["Outputs"] = [tensor(t) for t in layer["Outputs"]]
        if layout_only:
            return {**layer, "Inputs": new["Inputs"], "Outputs": new["Outputs"]}
        new.pop("TacticValue", None)
        new["Constants"] = _constants_11x(layer)
        if not _MYELIN_NAME.search(layer["Name"]):
            profile = _PROFILE.search(layer["Name"])
            new["Name"] = f"{layer['Name']}_myl{profile[1] if profile else 0}_{index}"
        return new

    def io_tensor(name: str) -> dict:
        t = by_name.get(name, {"Name": name, "Dimensions": [], "Format/Datatype": "Float"})
        new = _tensor_11x(t)
        dims = new["Dimensions"]
        return {
            "Name": name, "IOMode": "Input" if name in consumed else "Output", "DataType": new["Datatype"],
            "Dimensions": dims, "Location": "Device", "IsShapeInferenceIO": False,
            "ProfileInfo": [{"MinShape": dims, "OptShape": dims, "MaxShape": dims, "Format": new["Format"]}],
        }  # fmt: skip

    return {
        "Layers": [layer_11x(i, layer) for i, layer in enumerate(doc["Layers"])],
        "I/O Tensors": [io_tensor(name) for name in names],
    }


def cookbook_11x() -> dict:
    """The real 10.16 cookbook build's layers (its ONELINE layer list) as an 11.x engine; its
    I/O tensors are the log's own "Bindings:" list (x, y, z)."""
    text = (DATA / "cookbook_10.16.2_detailed_build.log").read_text()
    return as_11x(oneline_document(text, "cookbook"), io=("x", "y", "z"))


def test_inspector_10x_json_of_a_trtexec_build():
    info = parse_engine_information(real_json("trtexec_10.4_alexnet_fp16_layers.json"), "alexnet")
    assert info.layout == "10.x" and info.io_tensors == ("input", "output")
    reformat, conv = info.layers[:2]
    assert (reformat.layer_type, reformat.tactic_name, reformat.tactic_value) == ("Reformat", None, "0x00000000000003e8")
    assert reformat.inputs[0].format == "Row major linear FP16 format"
    assert reformat.inputs[0].dimensions == (1, 3, 224, 224)
    assert conv.outputs[0].format == "Channel major FP16 format where channel % 8 == 0"
    assert (conv.input_dtypes, conv.output_dtypes) == (("fp16",), ("fp16",))
    assert conv.tactic_value == "0x280b0ad3c23d8442"
    assert conv.onnx_layers == ("/features/features.0/Conv", "/features/features.1/Relu")
    gemm = info.layers[11]
    # A Myelin layer: "Half" tensors, no TacticValue, Metadata separated by \x1f.
    assert (gemm.name, gemm.tactic_value) == ("/classifier/classifier_1/Gemm_myl9_2", None)
    assert gemm.tactic_name.startswith("sm50_xmma_cublas_gemvx_f16f16")
    assert gemm.input_dtypes == ("fp16", "fp16", "fp32", "fp32", "fp16")
    assert gemm.onnx_layers == ("/classifier/classifier.1/Gemm", "/classifier/classifier.2/Relu")


def test_inspector_python_api_json_and_older_layouts():
    alexnet = parse_engine_information(real_json("inspector_10.1_alexnet.json"))
    assert len(alexnet.layers) == 17 and alexnet.layers[-1].output_dtypes == ("fp16",)
    assert alexnet.layers[1].input_dtypes == ("fp32",)  # "Channel major FP32 format"
    assert alexnet.layers[6].outputs[0].format == "Row major linear FP32"  # no "format" word
    resnet = parse_engine_information(real_json("inspector_10.1_resnet18.json"))
    assert resnet.layout == "10.x" and all(layer.name for layer in resnet.layers)
    trex = parse_engine_information(real_json("inspector_8.x_trex_resnet_a100_fp16.json"))
    assert trex.io_tensors == ("input.1", "191") and all(layer.onnx_layers == () for layer in trex.layers)
    assert trex.layers[-1].output_dtypes == ("fp32",)


def facts(info, *, names: bool = True, tactic_values: bool = True) -> list[tuple]:
    return [
        ((layer.name,) if names else ()) + (layer.layer_type, layer.input_dtypes, layer.output_dtypes,
         layer.tactic_name, layer.onnx_layers) + ((layer.tactic_value,) if tactic_values else ())
        for layer in info.layers
    ]  # fmt: skip


def test_inspector_11x_layout_reads_the_same_facts():
    old = parse_engine_information(real_json("trtexec_10.4_alexnet_fp16_layers.json"))
    new = parse_engine_information(as_11x(real_json("trtexec_10.4_alexnet_fp16_layers.json"), layout_only=True))
    assert new.layout == "11.x" and new.io_tensors == ("input", "output")
    assert facts(new) == facts(old)


@pytest.mark.parametrize("source", ["alexnet", "cookbook"])
def test_an_11x_engine_reads_as_the_same_layers_without_tactic_values(source):
    """The same builds as TensorRT 11 engines (as_11x): ``Format`` + ``Datatype`` tensors with
    ``Strides``/``StrideOrder``, ``Constants``, no ``TacticValue``, every layer ``_myl``-named."""
    if source == "alexnet":
        doc = real_json("trtexec_10.4_alexnet_fp16_layers.json")
        old, eleven = parse_engine_information(doc), as_11x(doc)
    else:
        old, eleven = read_engine_information((DATA / "cookbook_10.16.2_detailed_build.log").read_text(), "c"), cookbook_11x()
    assert "TacticValue" not in json.dumps(eleven) and "Format/Datatype" not in json.dumps(eleven)
    assert all(re.search(r"_myl\d+_\d+$", layer["Name"]) for layer in eleven["Layers"])
    new = parse_engine_information(eleven)
    assert new.layout == "11.x" and all(layer.tactic_value is None for layer in new.layers)
    assert facts(new, names=False, tactic_values=False) == facts(old, names=False, tactic_values=False)
    assert [base_name(layer.name) for layer in new.layers] == [base_name(layer.name) for layer in old.layers]
    if source == "alexnet":
        conv = new.layers[1]
        assert conv.inputs[0].format == "(NHWC) Channel major format" and conv.input_dtypes == ("fp16",)
        assert new.io_tensors == ("input", "output")
    else:
        assert new.io_tensors == ("x", "y", "z")


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [("Half", "fp16"), ("FP16", "fp16"), ("kHALF", "fp16"), ("DataType.HALF", "fp16"), ("Float", "fp32"),
     ("kFLOAT", "fp32"), ("BFloat16", "bf16"), ("kBF16", "bf16"), ("Int64", "int64"), ("kFP8", "fp8"),
     ("nvinfer1::DataType::kINT8", "int8"), ("Mystery", "Mystery")],
)  # fmt: skip
def test_11x_datatype_spellings(spelling, dtype):
    """TensorRT 11.0 writes the DataType names ("Float", the real 11.0 recording); the enum
    names and their C++/Python forms read alike; an unknown one is kept as written."""
    layer = {"Name": "g", "Inputs": [{"Name": "a", "Dimensions": [1], "Format": "", "Datatype": spelling}]}
    assert parse_engine_information({"Layers": [layer]}).layers[0].input_dtypes == (dtype,)


def test_inspector_accepts_datatype_spelling_and_single_layer_output():
    layer = as_11x(real_json("trtexec_10.4_alexnet_fp16_layers.json"))["Layers"][1]
    layer["Inputs"][0]["DataType"] = layer["Inputs"][0].pop("Datatype")
    info = parse_engine_information({"Layers": [layer]})
    assert info.layout == "11.x" and info.io_tensors == ()
    assert info.layers[0].input_dtypes == ("fp16",)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ('{"Layers": ["conv1", "gemm"], "Bindings": []}', "ProfilingVerbosity.DETAILED"),
        ('{"Layers": [{"LayerType": "gemm"}]}', "layer entry without a Name"),
        (
            '{"Layers": [{"Name": "g", "Inputs": [{"Name": "a", "Dimensions": []}]}], "Bindings": []}',
            "neither 'Format/Datatype'",
        ),
        ('{"Layers": [', "not valid JSON"),
        ("[]", "expected an object with a 'Layers' list"),
    ],
)
def test_inspector_errors(document, message):
    with pytest.raises(HarnessError, match=message):
        parse_engine_information(document, "engine.json")


def test_oneline_layer_information_reads_like_the_json():
    """ONELINE (trtexec --dumpLayerInfo) and JSON of one build give the same facts."""
    text = (DATA / "trtexec_10.4_alexnet_fp16_verbose_excerpt.log").read_text()
    oneline = read_engine_information(text, "log")
    as_json = {layer.name: layer for layer in parse_engine_information(real_json("trtexec_10.4_alexnet_fp16_layers.json")).layers}
    # The excerpt keeps three of the layer lines (its author cut the rest).
    assert [layer.name for layer in oneline.layers] == [
        "Reformatting CopyNode for Input Tensor 0 to /features/features.0/Conv + /features/features.1/Relu",
        "/features/features.0/Conv + /features/features.1/Relu",
        "/classifier/classifier_6/Gemm_myl9_4",
    ]
    for layer in oneline.layers:
        same = as_json[layer.name]
        assert (layer.layer_type, layer.tactic_value) == (same.layer_type, same.tactic_value)
    conv = oneline.layers[1]
    assert conv.tactic_value == "0x280b0ad3c23d8442" and conv.input_dtypes == ("fp16",)
    cookbook = read_engine_information((DATA / "inspector_10.16_cookbook_oneline.log").read_text(), "cookbook")
    assert len(cookbook.layers) == 26
    first = cookbook.layers[0]
    assert (first.name, first.tactic_value, first.onnx_layers) == (
        "node_conv2d + node_relu",
        "0x5b8bf1b8028629d9",
        ("node_conv2d", "node_relu"),
    )
    assert first.inputs[0].dimensions == (1, 1, 28, 28) and first.inputs[0].format == "Row major linear FP32"
    with pytest.raises(HarnessError, match="neither inspector JSON nor ONELINE layer lines"):
        read_engine_information((DATA / "logger_10.16_cookbook_warnings.log").read_text(), "warnings")


def test_oneline_layers_of_a_real_11x_build_leave_their_constants_out_of_the_inputs():
    """TensorRT 11.0's ONELINE lines put the layer's weights in ``Constants: [...]`` between
    Inputs and Outputs, and give each tensor Strides, StrideOrder, Datatype and Format (no
    Location); no layer has a TacticValue. The constants are skipped: they are no inputs."""
    info = read_engine_information((DATA / REAL_11).read_text(), "11.0 build")
    assert info.layout == "11.x" and len(info.layers) == 24
    assert all(layer.tactic_value is None for layer in info.layers)
    shape_call, move, conv = info.layers[:3]
    assert (shape_call.name, shape_call.inputs, shape_call.outputs, shape_call.tactic_name) == ("__mye362_0_myl0_0", (), (), None)
    assert move.inputs == (TensorInfo("x", "fp32", "(Linear) Row major linear format", (-1, 1, 28, 28)),)
    assert (conv.name, conv.layer_type, conv.onnx_layers) == ("node_conv2d_myl0_2", "correlation", ("node_conv2d", "node_relu"))
    assert conv.inputs == (TensorInfo("relu.1_10_myl0", "fp32", "(NHWC) Channel major format", (-1, 1, 28, 28)),)
    assert conv.outputs == (TensorInfo("max_pool2d.1_11_myl0", "fp32", "(NHWC) Channel major format", (-1, 32, 28, 28)),)
    linear = {layer.name: layer for layer in info.layers}["node_linear [profile 1]_myl1_7"]
    assert [t.name for t in (*linear.inputs, *linear.outputs)] == ["relu_2 [profile 1].1_15_myl1", "y [profile 1].1_16_myl1"]
    assert linear.tactic_name == "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    assert info.layers[-1].output_dtypes == ("int64",)


def test_engine_information_json_calls_the_inspector_with_json_format():
    calls = []

    class Inspector:
        def get_engine_information(self, fmt):
            calls.append(fmt)
            return (DATA / "inspector_10.1_alexnet.json").read_text()

    engine = SimpleNamespace(create_engine_inspector=Inspector)
    trt = SimpleNamespace(LayerInformationFormat=SimpleNamespace(JSON="json-format"))
    text = engine_information_json(engine, trt)
    assert calls == ["json-format"]
    assert parse_engine_information(text).layout == "10.x"


def layers_10x():
    return parse_engine_information(real_json("trtexec_10.4_alexnet_fp16_layers.json")).layers


def test_fingerprint_depends_on_decisions_only():
    cache = exported()
    base = trt_fingerprint(layers_10x(), cache.entries())
    eleven = parse_engine_information(as_11x(real_json("trtexec_10.4_alexnet_fp16_layers.json"), layout_only=True)).layers
    # Layout, list order and TacticValue (missing on Myelin layers) do not matter.
    assert trt_fingerprint(eleven, reversed(cache.entries())) == base
    layers = list(layers_10x())
    layers[1] = replace(layers[1], tactic_value="0x1")
    assert trt_fingerprint(layers, cache.entries()) == base
    spelled = [replace(e, tactic_hash=e.tactic_hash.upper().replace("0X", "0x000")) for e in cache.entries()]
    assert trt_fingerprint(layers_10x(), spelled) == base
    # A different kernel for one layer, or a different hash for one key, changes it.
    layers[1] = replace(layers[1], tactic_name="sm80_other_kernel")
    assert trt_fingerprint(layers, cache.entries()) != base
    pin(cache, "matMul1", "0x2ad3a182fb05c")
    assert trt_fingerprint(layers_10x(), cache.entries()) != base


def test_fingerprint_of_fixture_is_stable():
    # Golden value: changing the canonical form silently invalidates every recorded
    # fingerprint, so it must only change on purpose.
    assert trt_fingerprint(layers_10x(), exported().entries()) == (
        "sha256:26a3858ab6a9b988b40a23d49d57801c85e3d3267cf8168de1739186a67025a4"
    )


# --- versions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.13.0.35", TrtVersion(10, 13, 0, 35)),
        ("11.0.0", TrtVersion(11, 0, 0, 0)),
        ("10.8.0.43.post1", TrtVersion(10, 8, 0, 43)),
        ("10.3", TrtVersion(10, 3)),
    ],
)
def test_version_parse(text, expected):
    assert TrtVersion.parse(text) == expected


def test_version_parse_error_and_installed_version():
    with pytest.raises(HarnessError, match="cannot parse TensorRT version 'dev'"):
        TrtVersion.parse("dev")
    assert versions.installed_version(SimpleNamespace(__version__="11.0.0")) == TrtVersion(11, 0)
    with pytest.raises(HarnessError, match="no __version__"):
        versions.installed_version(SimpleNamespace())


def test_capabilities_by_version():
    assert TrtVersion.parse("10.13.0.35") < TrtVersion.parse("11.0.0")
    assert versions.supports_weak_typing(TrtVersion(10, 13)) is True
    assert versions.supports_weak_typing(TrtVersion(11, 0)) is False
    assert versions.supports_editable_timing_cache(TrtVersion(10, 7, 0, 23)) is False
    assert versions.supports_editable_timing_cache(TrtVersion(10, 8)) is True
    assert versions.supports_editable_timing_cache(TrtVersion(11, 0)) is True


def test_require_weak_typing():
    with pytest.raises(HarnessError) as exc:
        versions.require_weak_typing(TrtVersion(11, 0), "weak-fp16")
    assert str(exc.value).startswith(
        "weak typing (mode weak-fp16) was removed in TensorRT 11; use autocast-fp16"
    )
    with pytest.warns(DeprecationWarning, match="deprecated since TensorRT 10.12"):
        versions.require_weak_typing(TrtVersion(10, 13), "weak-bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.require_weak_typing(TrtVersion(10, 11), "weak-bf16")


def test_flag_names():
    v10 = TrtVersion(10, 11)
    assert versions.builder_flag_names(
        v10, "weak-fp16", tf32=True, editable_timing_cache=True, error_on_cache_miss=True
    ) == (
        "TF32",
        "FP16",
        "OBEY_PRECISION_CONSTRAINTS",
        "EDITABLE_TIMING_CACHE",
        "DISABLE_COMPILATION_CACHE",
        "ERROR_ON_TIMING_CACHE_MISS",
    )
    assert versions.builder_flag_names(
        TrtVersion(11, 0),
        "autocast-bf16",
        tf32=False,
        editable_timing_cache=True,
        error_on_cache_miss=False,
    ) == ("EDITABLE_TIMING_CACHE", "DISABLE_COMPILATION_CACHE")
    with pytest.raises(HarnessError, match="removed in TensorRT 11"):
        versions.builder_flag_names(
            TrtVersion(11, 0),
            "weak-bf16",
            tf32=False,
            editable_timing_cache=False,
            error_on_cache_miss=False,
        )
    with pytest.raises(HarnessError, match="need TensorRT 10.8 or newer"):
        versions.builder_flag_names(
            TrtVersion(10, 7),
            "fp16",
            tf32=False,
            editable_timing_cache=True,
            error_on_cache_miss=False,
        )
    assert versions.network_flag_names("fp16") == ("STRONGLY_TYPED",)
    assert versions.network_flag_names("weak-fp16") == ()


def test_flag_bits_from_names():
    # Member values as in TensorRT 10.13 (tensorrt-stubs); 11.x may number them differently.
    members = {"FP16": 0, "TF32": 6, "EDITABLE_TIMING_CACHE": 27}
    bits = versions.flag_bits(members, ["TF32", "EDITABLE_TIMING_CACHE"], "BuilderFlag")
    assert bits == (1 << 6) | (1 << 27)
    assert versions.flag_bits(members, [], "BuilderFlag") == 0
    with pytest.raises(
        HarnessError,
        match="BuilderFlag.BF16 does not exist .*valid names: EDITABLE_TIMING_CACHE, FP16, TF32",
    ):
        versions.flag_bits(members, ["BF16"], "BuilderFlag")
