"""TensorRT bridge, engine inspector and version rules, without a GPU.

The bridge is exercised against a thin double of ``ITimingCache`` that has
only ``queryKeys``/``query``/``update`` with the documented semantics
(``update`` returns False for an absent key, a NaN time deletes), and a tiny
namespace standing in for the ``tensorrt`` module.
"""

from __future__ import annotations

import math
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.cache.operations import pin
from harness.cache.timing_cache import CacheEntry, Provenance, TimingCache
from harness.engines.tensorrt import versions
from harness.engines.tensorrt.cache_bridge import UNKNOWN_LAYER, apply_pins, export_trt_cache
from harness.engines.tensorrt.inspector import (
    engine_information_json,
    parse_engine_information,
    trt_fingerprint,
)
from harness.engines.tensorrt.log_parser import parse_log_file
from harness.engines.tensorrt.versions import TrtVersion
from harness.errors import HarnessError

DATA = Path(__file__).parent / "data" / "trt"
KEY_CONV = "0xa4c123b1612dd272d1371c17149d4395"
KEY_GEMM = "0x36b3216fdaeeb975729fae923d5a4fd1"
KEY_SOFTMAX = "0x2aabfe228f219e9cb0eb53f16947ccf2"
KEY_OLD = "0xcc3fc1626e53a13043b026c48bbf33fe"
PROV = Provenance("tensorrt", "10.13.0.35", "NVIDIA A100-SXM4-40GB (sm_80)", {}, {"tf32": True})


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
    def __init__(self, values: dict[str, tuple[int, float]]) -> None:
        self.values = dict(values)

    def queryKeys(self) -> list[Key]:  # noqa: N802 - TensorRT's spelling
        return [Key(k) for k in self.values]

    def query(self, key: Key) -> Value:
        return Value(*self.values[str(key)])

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
    # What TensorRT stored after the 10.x build; KEY_OLD came from an older cache.
    return TimingCacheDouble(
        {
            KEY_CONV: (0x8F86BEBB2737, 0.0191),
            KEY_GEMM: (0x454F31AF317, 0.0083),  # differs from the log's pick: a pinned rebuild
            KEY_SOFTMAX: (0x786E4D3CEA27D2, 0.0041),
            KEY_OLD: (0x584D8C4FA281, 0.0123),
        }
    )


def exported() -> TimingCache:
    log = parse_log_file(DATA / "builder_10x_verbose.log")
    return export_trt_cache(trt_cache_after_build(), log, PROV)


# --- cache bridge ---------------------------------------------------------------------------


def test_export_joins_binary_cache_values_with_log_names():
    cache = exported()
    assert cache.provenance == PROV
    assert cache.query_keys() == [KEY_CONV, KEY_GEMM, KEY_SOFTMAX, KEY_OLD]
    conv = cache.query(KEY_CONV)
    assert conv.layer == "/features/features.0/Conv + /features/features.1/Relu"
    assert conv.tactic.startswith(
        "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64"
    )
    # The time comes from the binary cache (0.0191), not the log (0.019328).
    assert (conv.tactic_hash, conv.time_ms) == ("0x8f86bebb2737", 0.0191)
    assert len(conv.candidates) == 4
    gemm = cache.query(KEY_GEMM)
    assert gemm.tactic_hash == "0x454f31af317"
    assert (
        gemm.tactic
        == "sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize32x32x64_stage6_warpsize2x2x1_tensor16x8x16"
    )
    old = cache.query(KEY_OLD)
    assert (old.layer, old.tactic, old.candidates) == (UNKNOWN_LAYER, "0x584d8c4fa281", ())


def test_export_refuses_invalid_time():
    double = TimingCacheDouble({KEY_CONV: (1, math.nan)})
    with pytest.raises(HarnessError, match=f"key {KEY_CONV} has an invalid time"):
        export_trt_cache(double, parse_log_file(DATA / "builder_10x_verbose.log"), PROV)


def test_round_trip_pin_in_json_then_apply_to_trt(tmp_path):
    path = tmp_path / "cache.json"
    exported().save(path)
    cache = TimingCache.load(path)
    pin(
        cache,
        "/features/features.0/Conv + /features/features.1/Relu",
        "ampere_h16816cudnn_128x64_ldg8_relu_exp_small_nhwc_tn_v1",
    )
    trt_cache = trt_cache_after_build()
    assert apply_pins(trt_cache, cache, FAKE_TRT) == []
    assert trt_cache.values[KEY_CONV] == (0xA2CEC255404E4, 0.0216)
    assert trt_cache.values[KEY_GEMM] == (0x454F31AF317, 0.0083)
    # Exporting again gives back exactly the edited JSON decisions.
    again = export_trt_cache(trt_cache, parse_log_file(DATA / "builder_10x_verbose.log"), PROV)
    assert [(e.key, e.tactic_hash) for e in again.entries()] == [
        (e.key, e.tactic_hash) for e in cache.entries()
    ]


def test_apply_reports_keys_tensorrt_does_not_have():
    trt_cache = TimingCacheDouble({KEY_CONV: (1, 1.0)})
    errors = apply_pins(trt_cache, exported(), FAKE_TRT)
    assert len(errors) == 3
    assert errors[0].startswith(
        f"layer '(Unnamed Layer* 7) [MatrixMultiply]' (key {KEY_GEMM}): TensorRT refused"
    )
    assert "EDITABLE_TIMING_CACHE" in errors[0]
    assert trt_cache.values == {KEY_CONV: (0x8F86BEBB2737, 0.0191)}


def test_apply_rejects_other_backends_and_malformed_keys():
    cpu = TimingCache(
        replace(PROV, backend="cpu"), [CacheEntry("conv|nchw|f32", "conv", "direct", "0x1", 1.0)]
    )
    with pytest.raises(HarnessError, match="backend 'cpu', not 'tensorrt'"):
        apply_pins(TimingCacheDouble({}), cpu, FAKE_TRT)
    odd = TimingCache(PROV, [CacheEntry("0x1234", "conv", "t", "0x1", 1.0)])
    assert apply_pins(TimingCacheDouble({"0x1234": (0, 1.0)}), odd, FAKE_TRT) == [
        "layer 'conv' (key 0x1234): not a TensorRT cache key (expected 0x and 32 hex digits)"
    ]


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


def inspector(layout: str):
    return parse_engine_information(
        (DATA / f"inspector_{layout}.json").read_text(), f"inspector_{layout}"
    )


def test_inspector_10x_layout():
    info = inspector("10x")
    assert info.layout == "10.x"
    assert info.io_tensors == ("input", "logits")
    reformat, conv1, conv2, gemm, softmax = info.layers
    assert (reformat.layer_type, reformat.tactic_name, reformat.tactic_value) == (
        "Reformat",
        None,
        "0x00000000000003e8",
    )
    assert reformat.inputs[0].dtype == "float32" and reformat.outputs[0].dtype == "float16"
    assert reformat.inputs[0].format == "Row major linear FP32 format"
    assert reformat.inputs[0].dimensions == (1, 3, 32, 32)
    assert conv1.tactic_value == "0x00008f86bebb2737"
    assert conv1.outputs[0].format == "Channel major FP16 format where channel % 8 == 0"
    assert gemm.tactic_value is None and gemm.tactic_name.startswith("sm80_xmma_gemm")
    assert [t.dtype for t in gemm.inputs] == ["float16", "float16"]
    assert softmax.outputs[0].dtype == "float32"


def test_inspector_11x_layout_matches_10x_facts():
    old, new = inspector("10x"), inspector("11x")
    assert new.layout == "11.x"
    assert new.io_tensors == ("input", "logits")
    assert new.layers[0].inputs[0].format == "Row major linear format (kLINEAR)"

    def facts(info):
        return [
            (
                layer.name,
                layer.layer_type,
                [t.dtype for t in layer.inputs],
                [t.dtype for t in layer.outputs],
                layer.tactic_name,
                layer.tactic_value,
            )
            for layer in info.layers
        ]

    assert facts(new) == facts(old)


def test_inspector_accepts_datatype_spelling_and_single_layer_output():
    layer = {
        "Name": "gemm",
        "LayerType": "gemm",
        "Inputs": [
            {
                "Name": "a",
                "Dimensions": [2, 2],
                "Format": "Row major linear format",
                "DataType": "BFloat16",
            }
        ],
        "Outputs": [],
        "TacticName": "k",
    }
    info = parse_engine_information({"Layers": [layer]})
    assert info.layout == "11.x" and info.io_tensors == ()
    assert info.layers[0].inputs[0].dtype == "bfloat16"


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


def test_engine_information_json_calls_the_inspector_with_json_format():
    calls = []

    class Inspector:
        def get_engine_information(self, fmt):
            calls.append(fmt)
            return (DATA / "inspector_10x.json").read_text()

    engine = SimpleNamespace(create_engine_inspector=Inspector)
    trt = SimpleNamespace(LayerInformationFormat=SimpleNamespace(JSON="json-format"))
    text = engine_information_json(engine, trt)
    assert calls == ["json-format"]
    assert parse_engine_information(text).layout == "10.x"


def test_fingerprint_depends_on_decisions_only():
    cache = exported()
    base = trt_fingerprint(inspector("10x").layers, cache.entries())
    # Layout, list order and TacticValue (missing for fused layers) do not matter.
    assert trt_fingerprint(inspector("11x").layers, reversed(cache.entries())) == base
    layers = list(inspector("10x").layers)
    layers[1] = replace(layers[1], tactic_value="0x1")
    assert trt_fingerprint(layers, cache.entries()) == base
    spelled = [
        replace(e, tactic_hash=e.tactic_hash.upper().replace("0X", "0x000"))
        for e in cache.entries()
    ]
    assert trt_fingerprint(inspector("10x").layers, spelled) == base
    # A different kernel for one layer, or a different hash for one key, changes it.
    layers[1] = replace(layers[1], tactic_name="sm80_other_kernel")
    assert trt_fingerprint(layers, cache.entries()) != base
    pin(cache, "/features/features.0/Conv + /features/features.1/Relu", "0x6a6f0fb23c6f5")
    assert trt_fingerprint(inspector("10x").layers, cache.entries()) != base


def test_fingerprint_of_fixture_is_stable():
    # Golden value: changing the canonical form silently invalidates every recorded
    # fingerprint, so it must only change on purpose.
    assert trt_fingerprint(inspector("10x").layers, exported().entries()) == (
        "sha256:8532e5d202df66a235669e3c18c485d2da5b8e0382aa033d1220b514081a06c0"
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
        "ERROR_ON_TIMING_CACHE_MISS",
    )
    assert versions.builder_flag_names(
        TrtVersion(11, 0),
        "autocast-bf16",
        tf32=False,
        editable_timing_cache=True,
        error_on_cache_miss=False,
    ) == ("EDITABLE_TIMING_CACHE",)
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
