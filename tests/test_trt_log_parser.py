"""The VERBOSE builder log parser against recorded-format text (tests/data/trt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cache.timing_cache import Candidate
from harness.engines.tensorrt.log_parser import parse_log, parse_log_file
from harness.errors import HarnessError

DATA = Path(__file__).parent / "data" / "trt"
CONV_KERNEL = "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_stage4_warpsize2x2x1_g1_tensor16x8x16"
GEMM_KERNEL = (
    "sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize32x32x64_stage6_warpsize2x2x1_tensor16x8x16"
)


def test_10x_log_blocks_keys_candidates_and_selections():
    log = parse_log_file(DATA / "builder_10x_verbose.log")
    assert [(p.layer, p.key) for p in log.layers] == [
        (
            "/features/features.0/Conv + /features/features.1/Relu",
            "0xa4c123b1612dd272d1371c17149d4395",
        ),
        ("(Unnamed Layer* 7) [MatrixMultiply]", "0x36b3216fdaeeb975729fae923d5a4fd1"),
        ("/classifier/classifier.2/Softmax", "0x2aabfe228f219e9cb0eb53f16947ccf2"),
        ("/features/features.3/Conv", "0x5ec84d8dbc74254770f58904dba41ecc"),
    ]
    conv = log.layers[0]
    assert conv.candidates[0] == Candidate(CONV_KERNEL, "0x8f86bebb2737", 0.019328)
    assert [c.tactic_hash for c in conv.candidates] == [
        "0x8f86bebb2737",
        "0x6a6f0fb23c6f5",
        "0xa2cec255404e4",
        "0xfb440034d66086",
    ]
    assert [c.time_ms for c in conv.candidates] == [0.019328, 0.020192, 0.0216, 0.026208]
    assert (conv.selected_hash, conv.selected_time_ms, conv.selected_name) == (
        "0x8f86bebb2737",
        0.019328,
        CONV_KERNEL,
    )
    gemm = log.layers[1]
    # Two candidates share the kernel name; the hash tells them apart.
    assert [c.tactic for c in gemm.candidates[:2]] == [GEMM_KERNEL, GEMM_KERNEL]
    assert gemm.selected_hash == "0x7a8d41bed440e"


def test_truncated_block_is_reported_not_fatal():
    log = parse_log_file(DATA / "builder_10x_verbose.log")
    cut = log.layers[-1]
    assert cut.selected_hash is None and len(cut.candidates) == 2
    assert log.problems == [
        "line 33: op '/features/features.3/Conv' (key 0x5ec84d8dbc74254770f58904dba41ecc) has no "
        "selection before the end of the log (truncated?)"
    ]
    assert [p.layer for p in log.complete()] == [p.layer for p in log.layers[:3]]
    with pytest.raises(
        HarnessError, match="line 33: op '/features/features.3/Conv'.*no selected tactic"
    ):
        cut.to_entry()


def test_10x_entries_carry_names_times_and_candidates():
    entries = parse_log_file(DATA / "builder_10x_verbose.log").entries()
    assert [e.layer for e in entries] == [
        "/features/features.0/Conv + /features/features.1/Relu",
        "(Unnamed Layer* 7) [MatrixMultiply]",
        "/classifier/classifier.2/Softmax",
    ]
    softmax = entries[2]
    assert (softmax.tactic, softmax.tactic_hash, softmax.time_ms) == (
        "__myl_Exp_SumReduce_Div_0x786e4d3cea27d2",
        "0x786e4d3cea27d2",
        0.004096,
    )
    assert len(softmax.candidates) == 2 and not softmax.pinned


def test_11x_log_reordered_columns_crlf_and_unprefixed_rows():
    log = parse_log_file(DATA / "builder_11x_verbose.log")
    assert [p.layer for p in log.layers] == [
        "/blocks.0/attn/qkv/MatMul",
        "/blocks.0/attn/softmax_myl0_1",
        "/blocks.0/mlp/fc1/MatMul",
    ]
    qkv = log.layers[0]
    assert qkv.key == "0xcc3fc1626e53a13043b026c48bbf33fe"
    assert [(c.tactic_hash, c.time_ms) for c in qkv.candidates] == [
        ("0x584d8c4fa281", 0.012288),
        ("0x5d2802827283e0", 0.0129024),
        ("0xd841735815699", 0.016384),
    ]
    assert qkv.candidates[2].tactic.startswith(
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64"
    )
    assert (qkv.selected_hash, qkv.selected_time_ms) == ("0x584d8c4fa281", 0.012288)
    assert log.layers[1].selected_hash is None and len(log.layers[1].candidates) == 1
    assert log.layers[2].selected_name.endswith(
        "tilesize128x64x64_cgasize1x1x1_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
    )
    assert log.problems == [
        "line 10: op '/blocks.0/attn/softmax_myl0_1' (key 0xff9243a8f506b40928b5b7a767c76fb0) ended "
        "without 'The selected tactic is' line; no selection recorded",
        "line 21: tactic selection outside an 'Autotuning op' block; ignored",
    ]


def test_selected_hash_missing_from_table_falls_back_to_hash_name():
    text = "\n".join(
        [
            "Autotuning op conv(key: 0x000102030405060708090a0b0c0d0e0f):",
            "tactic_id, cost(in ms), cost/fastest_cost, prediction_correlation, kernel_name, tactic_hash",
            "1, 0.5, 1.0, 1.0, k1, 0x11,",
            "The selected tactic is (tactic hash, cost(in ms)):0x22, 0.4",
        ]
    )
    entry = parse_log(text).entries()[0]
    assert (entry.tactic, entry.tactic_hash, entry.time_ms) == ("0x22", "0x22", 0.4)


def test_key_autotuned_twice_keeps_last_and_says_so():
    block = (
        "Autotuning op {name}(key: 0x000102030405060708090a0b0c0d0e0f):\n"
        "tactic_id, cost(in ms), cost/fastest_cost, prediction_correlation, kernel_name, tactic_hash\n"
        "1, 0.5, 1.0, 1.0, k1, 0x11,\n"
        "2, 0.6, 1.2, 1.0, k2, 0x12,\n"
        "The selected tactic is (tactic hash, cost(in ms)):{pick}, 0.5\n"
    )
    log = parse_log(block.format(name="a", pick="0x11") + block.format(name="b", pick="0x12"))
    assert [(e.layer, e.tactic) for e in log.entries()] == [("b", "k2")]
    assert log.problems == [
        "line 6: key 0x000102030405060708090a0b0c0d0e0f was autotuned again (op 'b', first for op 'a'); "
        "the later selection is used"
    ]


def test_header_without_required_columns_is_reported():
    text = "\n".join(
        [
            "Autotuning op x(key: 0x000102030405060708090a0b0c0d0e0f):",
            "tactic_id, cost(in ms), tactic_hash",
            "1, 0.5, 0x11",
            "The selected tactic is (tactic hash, cost(in ms)):0x11, 0.5",
        ]
    )
    log = parse_log(text)
    assert log.layers[0].candidates == () and log.layers[0].selected_hash == "0x11"
    assert "lacks one of tactic_id, cost(in ms), kernel_name, tactic_hash" in log.problems[0]


def test_unrelated_text_gives_nothing():
    log = parse_log("[I] [TRT] Loaded engine size: 12 MiB\nhello, 1, 2, 3\n")
    assert log.layers == [] and log.problems == []


def test_missing_log_file(tmp_path):
    with pytest.raises(HarnessError, match="no such file"):
        parse_log_file(tmp_path / "build.log")


def test_unreadable_selected_cost_leaves_block_unselected():
    text = "\n".join(
        [
            "Autotuning op x(key: 0x000102030405060708090a0b0c0d0e0f):",
            "tactic_id, cost(in ms), cost/fastest_cost, prediction_correlation, kernel_name, tactic_hash",
            "1, 0.5, 1.0, 1.0, k1, 0x11,",
            "The selected tactic is (tactic hash, cost(in ms)):0x11, nan",
        ]
    )
    log = parse_log(text)
    assert log.layers[0].selected_hash is None and log.entries() == []
    assert log.problems == ["line 4: op 'x': unreadable selected cost 'nan'"]
