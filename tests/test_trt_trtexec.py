"""``harness inspect --trt-log --trt-layers``: builds made elsewhere with trtexec, read from real
recorded artifacts (tests/data/trt/README.md), and compared with ``harness cache diff``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cache.timing_cache import TimingCache
from harness.cli.main import main

DATA = Path(__file__).parent / "data" / "trt"
COOKBOOK = DATA / "cookbook_10.16.2_detailed_build.log"  # the log holds its own ONELINE layer list
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


def test_cache_diff_compares_two_trtexec_builds(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report = inspect_json(capsys, COOKBOOK, COOKBOOK, "--save-cache", str(a))
    # Myelin layers: their kernel name is shared by several measured candidates, so the hash
    # (and so an entry) is unknown without the editable cache; they are named, not guessed.
    assert [line.split(" (layer")[0] for line in report["left_out_of_cache"]] == ["op 'node_linear'", "op 'node_linear_1_2'"]
    assert main(["cache", "diff", str(a), str(a), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in same["layers"]] == ["same"] * 8
    # The same log with the layer information of another (FP16) build of the model: the
    # layers whose kernel differs show up as changed.
    inspect_json(capsys, COOKBOOK, DATA / "inspector_10.16_cookbook_oneline.log", "--save-cache", str(b))
    assert main(["cache", "diff", str(a), str(b), "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["layers"]}
    conv = rows["op:node_conv2d + node_relu"]
    assert (conv["status"], conv["tactic_hash_a"], conv["tactic_hash_b"]) == ("changed", "0xcf8ea142095f02d2", "0x5b8bf1b8028629d9")


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
