"""``harness inspect --trt-log --trt-layers``: builds made elsewhere with trtexec, read from real
recorded artifacts (tests/data/trt/README.md), and compared
with ``harness cache diff``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness.cache.operations import diff
from harness.cache.timing_cache import UNKNOWN_HASH, CacheEntry, Candidate, Provenance, TimingCache
from harness.cli.main import main
from harness.errors import HarnessError
from tests.test_trt_bridge import REAL_11, cookbook_11x

DATA = Path(__file__).parent / "data" / "trt"
COOKBOOK = DATA / "cookbook_10.16.2_detailed_build.log"  # the log holds its own ONELINE layer list
COOKBOOK_RUN2 = DATA / "cookbook_10.16.2_detailed_build_run2.log"  # the same build, another real run
TRTEXEC_LOG = DATA / "trtexec_10.4_alexnet_fp16_verbose_excerpt.log"
TRTEXEC_JSON = DATA / "trtexec_10.4_alexnet_fp16_layers.json"


def inspect_json(capsys, log: Path, layers: Path, *extra: str) -> dict:
    assert main(["inspect", "--trt-log", str(log), "--trt-layers", str(layers), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_layer_information_pair_joins_every_autotuned_op(capsys):
    report = inspect_json(capsys, TRTEXEC_LOG, TRTEXEC_JSON)
    assert (report["tensorrt_version"], report["device"], report["inspector_layout"]) == ("10.4.0", "unknown (sm_86)", "10.x")
    assert report["autotuned_ops"] == 1 and report["unjoined_ops"] == []
    assert len(report["layers"]) == 14
    conv = report["layers"][1]
    assert conv["name"] == "/features/features.0/Conv + /features/features.1/Relu"
    assert (conv["layer_type"], conv["input_dtypes"], conv["output_dtypes"]) == ("CaskConvolution", ["fp16"], ["fp16"])
    assert conv["tactic_value"] == "0x280b0ad3c23d8442"
    (op,) = conv["ops"]
    assert (op["op"], op["joined_by"], op["key"], op["measured"], op["selected"]) == (conv["name"], "name", None, 17, None)
    assert op["fastest"] == {
        "tactic": "sm75_xmma_fprop_implicit_gemm_indexed_wo_smem_f16f16_f16f16_f16_nhwckrsc_nhwc_tilesize128x16x32_stage1_warpsize4x1x1_g1_tensor16x8x8_aligna8_alignc4",
        "tactic_hash": "0x886d7923447c7828",
        "time_ms": 0.0225489,
    }
    assert [line[:41] for line in report["problems"]] == ["none of the log's 1 autotuned op(s) carri"]


def test_oneline_pair_of_one_real_build_joins_every_op_to_its_layers(capsys):
    report = inspect_json(capsys, COOKBOOK, COOKBOOK)
    assert (report["tensorrt_version"], report["device"]) == ("10.16.2", "unknown (sm_90)")
    assert report["autotuned_ops"] == 10 and report["unjoined_ops"] == []
    ops = {layer["name"]: [op["op"] for op in layer["ops"]] for layer in report["layers"]}
    assert ops["node_linear_myl7_1"] == ["node_linear"] == ops["node_linear [profile 1]_myl15_1"]
    assert ops["node_conv2d + node_relu"] == ["node_conv2d + node_relu"]
    assert ops["node_conv2d + node_relu [profile 1]"] == ["node_conv2d + node_relu [profile 1]"]
    joined = {op for names in ops.values() for op in names}
    assert len(joined) == 10  # every autotuned op of the log reached a layer
    assert sum(bool(names) for names in ops.values()) == 12
    linear = next(layer for layer in report["layers"] if layer["name"] == "node_linear_myl7_1")
    assert linear["onnx_layers"] == ["node_linear", "node_relu_2"] and linear["tactic_value"] is None
    assert linear["ops"][0]["joined_by"] == "onnx-layers" and linear["ops"][0]["measured"] == 100


def test_text_report_names_layers_ops_and_the_missing_keys(capsys):
    assert main(["inspect", "--trt-log", str(COOKBOOK), "--trt-layers", str(COOKBOOK)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "trtexec build: TensorRT 10.16.2 on unknown (sm_90); 26 layers (10.x inspector layout), "
        "10 autotuned ops, all joined to layers\n"
    )
    assert "  node_linear_myl7_1  [gemm]  fp32 -> fp32  sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n" in out
    assert (
        "      op 'node_linear' (by onnx-layers): fastest of 100: sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_"
        "tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8 (0x2c80ce2f5c4a6, 0.01249 ms)"
    ) in out
    assert "note: none of the log's 10 autotuned op(s) carries a timing-cache key" in out


def test_an_editable_build_shows_key_and_selection(capsys, tmp_path):
    log = DATA / "editable_10.8_sample_readme.log"
    report = inspect_json(capsys, log, log, "--save-cache", str(tmp_path / "cache.json"))
    (layer,) = report["layers"]
    (op,) = layer["ops"]
    assert (layer["name"], op["op"], op["key"]) == ("matMul1_myl0_0", "matMul1", "0x1814870c44ff0f8574df6e3dda04cbd7")
    assert op["selected"]["tactic_hash"] == "0x665ded9abbf88" and report["problems"] == []
    cache = TimingCache.load(tmp_path / "cache.json")
    (entry,) = cache.entries()
    assert (entry.key, entry.layer, entry.tactic_hash, entry.time_ms) == (op["key"], "matMul1", "0x665ded9abbf88", 0.011264)
    assert cache.provenance.backend == "tensorrt" and cache.provenance.device_details["source"] == "trtexec"


def test_cache_diff_compares_two_real_builds_of_one_model(capsys, tmp_path):
    """Two real runs of the same cookbook build (TensorRT 10.16.2, sm_90): the pooling layers
    picked other kernels the second time. Without the editable cache the Myelin gemms' hash
    is unknown (their kernel name is shared by several measured variants): they are entered
    with the kernel name and compared by it, never missing from the diff."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    first = inspect_json(capsys, COOKBOOK, COOKBOOK, "--save-cache", str(a))
    second = inspect_json(capsys, COOKBOOK_RUN2, COOKBOOK_RUN2, "--save-cache", str(b))
    assert first["left_out_of_cache"] == [] == second["left_out_of_cache"]
    linear = TimingCache.load(a).query("op:node_linear")
    assert (linear.tactic, linear.tactic_hash, linear.hash_known) == (
        "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8", UNKNOWN_HASH, False
    )
    assert main(["cache", "diff", str(a), str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["provenance"] == []  # same TensorRT, same GPU class
    rows = {row["key"]: row for row in report["layers"]}
    assert len(rows) == 10
    assert {key for key, row in rows.items() if row["status"] == "changed"} == {
        "op:node_max_pool2d", "op:node_max_pool2d_1", "op:node_max_pool2d [profile 1]", "op:node_max_pool2d_1 [profile 1]",
    }  # fmt: skip
    pool = rows["op:node_max_pool2d"]
    assert (pool["tactic_hash_a"], pool["tactic_hash_b"]) == ("0x8382d5c464539e87", "0xaec8628e8180bced")
    assert rows["op:node_linear"]["status"] == "same" and rows["op:node_linear"]["tactic_hash_a"] == UNKNOWN_HASH
    assert main(["cache", "diff", str(a), str(b)]) == 0
    assert "op:node_linear_1_2" in capsys.readouterr().out


def test_an_unknown_hash_is_compared_by_kernel_name():
    """Where either side's hash is unknown the kernel name decides; an empty hash is never
    read as the hash 0x0."""
    prov = Provenance("tensorrt", "10.16.2", "unknown (sm_90)")
    kernel = "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    unknown = CacheEntry("op:node_linear", "node_linear", kernel, UNKNOWN_HASH, 0.0125)
    same_kernel_known = replace(unknown, tactic_hash="0x2c80ce2f5c4a6")
    other_kernel = replace(unknown, tactic="sm90_other", tactic_hash="0x0")
    rows = [diff(TimingCache(prov, [unknown]), TimingCache(prov, [other]))[0].status for other in (unknown, same_kernel_known, other_kernel)]
    assert rows == ["same", "same", "changed"]


def test_the_cache_schema_takes_an_unknown_hash_only_where_it_means_something(tmp_path):
    """An entry may have an unknown ("") hash; a candidate never (it was measured, so its hash
    was printed). Files written before remain valid: the allowed hashes only grew."""
    prov = Provenance("tensorrt", "10.16.2", "unknown (sm_90)")
    entry = CacheEntry("op:node_linear", "node_linear", "k", UNKNOWN_HASH, 0.01, (Candidate("k", "0x1", 0.01),))
    TimingCache(prov, [entry]).save(tmp_path / "c.json")
    assert TimingCache.load(tmp_path / "c.json").query("op:node_linear") == entry
    for field, value, where in (("tactic_hash", "zz", "entries/0/tactic_hash"), ("candidates", [{"tactic": "k", "tactic_hash": "", "time_ms": 0.01}], "entries/0/candidates/0/tactic_hash")):
        obj = TimingCache(prov, [entry]).to_json()
        obj["entries"][0][field] = value
        with pytest.raises(HarnessError, match=where):
            TimingCache.from_json(obj, "c.json")


def test_an_11x_engine_of_a_real_build_is_read_joined_and_cached(capsys, tmp_path):
    """The real 10.16 log with the same build as a TensorRT 11 engine (tests.test_trt_bridge.
    as_11x): no TacticValue, ``_myl`` names. Every op joins; the Cask-like layers' hashes come
    from the one measured candidate of their kernel name, so the cache says what 10.x's does."""
    layers = tmp_path / "layers_11x.json"
    layers.write_text(json.dumps(cookbook_11x()))
    eleven = inspect_json(capsys, COOKBOOK, layers, "--save-cache", str(tmp_path / "11.json"))
    ten = inspect_json(capsys, COOKBOOK, COOKBOOK, "--save-cache", str(tmp_path / "10.json"))
    assert (eleven["inspector_layout"], eleven["unjoined_ops"], eleven["left_out_of_cache"]) == ("11.x", [], [])
    assert all(layer["tactic_value"] is None for layer in eleven["layers"])
    ops = {layer["name"]: [(op["op"], op["joined_by"]) for op in layer["ops"]] for layer in eleven["layers"]}
    assert ops["node_conv2d + node_relu [profile 1]_myl1_14"] == [
        ("node_conv2d + node_relu", "name"), ("node_conv2d + node_relu [profile 1]", "prefix")
    ]
    assert ops["node_linear_myl7_1"] == [("node_linear", "onnx-layers")]
    a, b = TimingCache.load(tmp_path / "10.json"), TimingCache.load(tmp_path / "11.json")
    assert [(e.key, e.tactic, e.tactic_hash) for e in b.entries()] == [(e.key, e.tactic, e.tactic_hash) for e in a.entries()]
    assert ten["problems"] == eleven["problems"]


def test_a_real_11x_build_joins_every_op_to_its_layers_in_both_profiles(capsys, tmp_path):
    """The real TensorRT 11.0 verbose build and its own ONELINE layers (``Constants`` between
    Inputs and Outputs): every Myelin op joins its ``_myl`` layer of each profile by the ONNX
    nodes both list. A layer whose kernel several measured candidates share is cached under the
    kernel's name with the hash unknown."""
    real = (DATA / REAL_11)
    assert main(["inspect", "--trt-log", str(real), "--trt-layers", str(real)]) == 0
    assert capsys.readouterr().out.startswith(
        "trtexec build: TensorRT 11.0.0 on unknown (sm_100); 24 layers (11.x inspector layout), 6 autotuned ops, "
        "all joined to layers\n"
    )
    report = inspect_json(capsys, real, real, "--save-cache", str(tmp_path / "11.json"))
    assert (report["inspector_layout"], report["autotuned_ops"], report["unjoined_ops"]) == ("11.x", 6, [])
    ops = {layer["name"]: [(op["op"], op["joined_by"]) for op in layer["ops"]] for layer in report["layers"]}
    joined = {name: op for name, found in ops.items() for op in found}
    assert joined == {
        **{f"{op}_myl0_{i}": (op, "onnx-layers") for op, i in OPS_11},
        **{f"{op} [profile 1]_myl1_{i}": (op, "onnx-layers") for op, i in OPS_11},
    }
    assert all(len(found) <= 1 for found in ops.values())
    cache = TimingCache.load(tmp_path / "11.json")
    assert {e.key: e.tactic_hash for e in cache.entries()} == {
        "op:node_conv2d": "0x447797f84b244", "op:node_max_pool2d": "0x66f0f7054b2a5", "op:node_conv2d_1": UNKNOWN_HASH,
        "op:node_max_pool2d_1": "0x3dd9bff0e8c14", "op:node_linear": UNKNOWN_HASH, "op:node_linear_1_2": UNKNOWN_HASH,
    }  # fmt: skip


# The real 11.0 build's autotuned ops and the index of their engine layer in each profile.
OPS_11 = (("node_conv2d", 2), ("node_max_pool2d", 3), ("node_conv2d_1", 4), ("node_max_pool2d_1", 5),
          ("node_linear", 7), ("node_linear_1_2", 8))  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trt-log", str(COOKBOOK)], "needs both --trt-log LOG and --trt-layers FILE"),
        (["engine_dir", "--trt-log", str(COOKBOOK), "--trt-layers", str(COOKBOOK)], "not both"),
        (["--trt-log", "missing.log", "--trt-layers", str(COOKBOOK)], "--trt-log missing.log: no such file"),
        (["--trt-log", str(COOKBOOK), "--trt-layers", str(DATA)], "is a directory"),
        (
            ["--trt-log", str(DATA / "logger_10.16_cookbook_warnings.log"), "--trt-layers", str(COOKBOOK)],
            "no autotuned op in the log",
        ),
        (["--trt-log", str(COOKBOOK), "--trt-layers", str(DATA / "logger_10.16_cookbook_warnings.log")], "neither inspector JSON"),
        ([], "needs an engine directory, or --trt-log and --trt-layers"),
        (["engine_dir", "--save-cache", "x.json"], "--save-cache needs a trtexec build"),
    ],
)
def test_bad_arguments_are_refused_clearly(capsys, argv, message):
    assert main(["inspect", *argv]) == 2
    assert message in capsys.readouterr().err
