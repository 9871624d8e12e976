"""The VERBOSE builder log parser against real TensorRT output (tests/data/trt/README.md).

Edge cases (a block cut off, a key timed twice, a bad header) are made from
the real editable-cache block by cutting or repeating its lines, never by
writing log text of our own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cache.timing_cache import Candidate
from harness.engines.tensorrt.log_parser import onnx_layers, parse_log, parse_log_file
from harness.errors import HarnessError
from tests.test_trt_bridge import REAL_11

DATA = Path(__file__).parent / "data" / "trt"
EDITABLE = DATA / "editable_10.8_sample_readme.log"
COOKBOOK = DATA / "cookbook_10.16.2_detailed_build.log"
TRTEXEC = DATA / "trtexec_10.4_alexnet_fp16_verbose_excerpt.log"
MATMUL_KEY = "0x1814870c44ff0f8574df6e3dda04cbd7"
MATMUL_KERNEL = "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"


def editable_block() -> list[str]:
    """The real block's lines up to and including its selection line."""
    lines = EDITABLE.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("The selected tactic"))
    return lines[: end + 1]


# --- editable timing cache (keys and selections) ---------------------------------------------


def test_editable_block_key_candidates_and_selection():
    log = parse_log_file(EDITABLE)
    assert log.problems == []
    (op,) = log.layers
    assert (op.layer, op.key, op.onnx_layers) == ("matMul1", MATMUL_KEY, ())
    # The author's "..." line ends the table: three rows, read by the header's column names.
    assert op.candidates == (
        Candidate(MATMUL_KERNEL, "0x665ded9abbf88", 0.011264),
        Candidate(
            "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x32x64_stage4_warpsize2x1x2_tensor16x8x8",
            "0x393e4ef8ad243",
            0.0118784,
        ),
        Candidate(
            "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x32x64_stage5_warpsize2x2x1_tensor16x8x8",
            "0x2ad3a182fb05c",
            0.0123904,
        ),
    )
    assert (op.selected_hash, op.selected_time_ms, op.selected_name) == ("0x665ded9abbf88", 0.011264, MATMUL_KERNEL)
    (entry,) = log.entries()
    assert (entry.key, entry.layer, entry.tactic, entry.tactic_hash) == (
        MATMUL_KEY,
        "matMul1",
        MATMUL_KERNEL,
        "0x665ded9abbf88",
    )
    assert len(entry.candidates) == 3 and not entry.pinned


def test_a_block_cut_before_its_selection_is_reported_not_fatal():
    block = editable_block()
    log = parse_log("\n".join(block[:-1]))
    (op,) = log.layers
    assert op.selected_hash is None and len(op.candidates) == 3
    assert log.problems == [
        f"line 1: op 'matMul1' (key {MATMUL_KEY}) has no selection before the end of the log (truncated?)"
    ]
    assert log.entries() == []
    with pytest.raises(HarnessError, match="line 1: op 'matMul1' has no selected tactic"):
        op.to_entry()


def test_a_key_autotuned_twice_keeps_the_last_selection_and_says_so():
    block = editable_block()
    second = [line.replace("matMul1", "matMul1_again") for line in block[:-1]]
    second.append("The selected tactic is (tactic hash, cost(in ms)):0x393e4ef8ad243,  0.0118784")
    log = parse_log("\n".join(block + second))
    assert [(e.layer, e.tactic_hash) for e in log.entries()] == [("matMul1_again", "0x393e4ef8ad243")]
    assert log.problems == [
        f"line 9: key {MATMUL_KEY} was autotuned again (op 'matMul1_again', first for op 'matMul1'); "
        "the later selection is used"
    ]


def test_selection_outside_a_block_and_unreadable_costs_are_reported():
    block = editable_block()
    stray = parse_log(block[-1])
    assert stray.layers == [] and stray.problems == [
        "line 1: tactic selection outside an 'Autotuning op' block; ignored"
    ]
    nan = parse_log("\n".join([*block[:-1], block[-1].replace("0.011264", "nan")]))
    assert nan.entries() == []
    assert nan.problems == ["line 8: op 'matMul1': unreadable selected cost 'nan'"]


def test_a_header_without_the_needed_columns_is_reported():
    block = editable_block()
    block[2] = block[2].replace("kernel_name", "kernel")
    log = parse_log("\n".join(block))
    assert log.layers[0].candidates == ()
    assert "lacks one of tactic_id, cost(in ms), kernel_name, tactic_hash" in log.problems[0]
    # The selection still stands; its kernel name is unknown, so the hash names it.
    assert log.entries()[0].tactic == "0x665ded9abbf88"


# --- no editable cache (real 10.16.2 build) ---------------------------------------------------


def test_a_build_without_editable_cache_yields_keyless_ops_and_says_so():
    log = parse_log_file(COOKBOOK)
    assert [(p.layer, p.key, p.onnx_layers) for p in log.layers] == [
        ("node_conv2d + node_relu", None, ()),
        ("node_max_pool2d", None, ()),
        ("node_conv2d_1 + node_relu_1", None, ()),
        ("node_max_pool2d_1", None, ()),
        ("node_linear", None, ("node_linear", "node_relu_2")),
        ("node_linear_1_2", None, ("node_linear_1",)),
        ("node_conv2d + node_relu [profile 1]", None, ()),
        ("node_max_pool2d [profile 1]", None, ()),
        ("node_conv2d_1 + node_relu_1 [profile 1]", None, ()),
        ("node_max_pool2d_1 [profile 1]", None, ()),
    ]
    assert log.entries() == [] and len(log.keyless()) == 10
    (problem,) = log.problems
    assert problem.startswith("none of the log's 10 autotuned op(s) carries a timing-cache key")
    assert "EDITABLE_TIMING_CACHE" in problem and "--editableTimingCache" in problem


def test_myelin_tables_without_selection_give_their_fastest_candidate():
    ops = {p.layer: p for p in parse_log_file(COOKBOOK).layers}
    linear = ops["node_linear"]
    assert len(linear.candidates) == 100 and linear.selected_hash is None
    # The real table is sorted by cost; the fastest is its first row.
    assert linear.fastest == linear.candidates[0]
    assert (linear.fastest.tactic_hash, linear.fastest.time_ms) == ("0x2c80ce2f5c4a6", 0.0124896)
    assert linear.fastest.tactic == (
        "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    )


def test_cask_ops_gather_every_format_combination_and_cached_results():
    ops = {p.layer: p for p in parse_log_file(COOKBOOK).layers}
    conv = ops["node_conv2d + node_relu"]
    # Every "Tactic Name:" line of its four format combinations (grep counts 246); the four
    # "Fastest Tactic" summary lines are not candidates of their own.
    assert len(conv.candidates) == 246
    assert conv.fastest == Candidate(
        "sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize32x32x8_stage3_warpsize1x2x1_g1_ffma_t1r5s5_aligna4_alignc4",
        "0x5b8bf1b8028629d9",
        0.00575816,
    )
    # Profile 1 is answered from the cache; kernel names come from profile 0's timed lines.
    cached = ops["node_conv2d + node_relu [profile 1]"]
    assert [c.tactic_hash for c in cached.candidates] == [
        "0x5b8bf1b8028629d9",
        "0xcf8ea142095f02d2",
        "0x2f4d03736e9ddce5",
        "0x10383a0781d24dde",
    ]
    assert cached.candidates[1].tactic.startswith("sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f32f32")


def test_a_real_11x_build_autotunes_every_layer_as_a_myelin_op():
    """TensorRT 11.0 (sm_100), no editable cache: convolutions and poolings are Myelin ops too,
    named after their first ONNX node; convolution tables add the ``conv_w2c_input_fold`` column
    and cutlass rows a ``cga={...} `` tunable parameter, which holds no comma. Profile 1 autotunes
    no op of its own. The recording cuts each table after six rows."""
    log = parse_log_file(DATA / REAL_11)
    assert [(p.layer, p.key, p.onnx_layers, len(p.candidates), p.selected_hash) for p in log.layers] == [
        ("node_conv2d", None, ("node_conv2d", "node_relu"), 6, None),
        ("node_max_pool2d", None, ("node_max_pool2d",), 6, None),
        ("node_conv2d_1", None, ("node_conv2d_1", "node_relu_1"), 6, None),
        ("node_max_pool2d_1", None, ("node_max_pool2d_1",), 6, None),
        ("node_linear", None, ("node_linear", "node_relu_2"), 6, None),
        ("node_linear_1_2", None, ("node_linear_1",), 6, None),
    ]
    ops = {p.layer: p for p in log.layers}
    assert ops["node_conv2d"].fastest == Candidate(
        "sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x16x32_stage1_warpsize4x1x1"
        "_g1_tensor16x8x8_aligna4_alignc8",
        "0x447797f84b244",
        0.0039936,
    )
    cutlass = ops["node_conv2d_1"].candidates
    assert {c.tactic for c in cutlass} == {
        "cutlass3x_sm100_tensorop_s128x128x8tf32implicit_gemm_fprop_f32_f32_f32_f32_f32_f32_128x128x32_dyn_cga_ndhwc_ndhwc"
        "_ndhwc_align4_2sm_relu_valpha_vbeta"
    }
    assert [c.tactic_hash for c in cutlass][:2] == ["0x338b9af98fb76", "0x285cce0d4d43f"]
    (problem,) = log.problems
    assert problem.startswith("none of the log's 6 autotuned op(s) carries a timing-cache key")


def test_trtexec_10_4_log_cask_autotuning():
    log = parse_log_file(TRTEXEC)
    (conv,) = log.layers
    assert conv.layer == "/features/features.0/Conv + /features/features.1/Relu"
    assert len(conv.candidates) == 17 and conv.key is None
    assert conv.candidates[0] == Candidate("ampere_scudnn_128x64_relu_xregs_large_nn_v1", "0x5deb29b7a8e275f7", 0.0521752)


def test_onnx_layer_lists_of_logs_and_inspector_metadata():
    assert onnx_layers("[ONNX Layer: node_linear][ONNX Layer: node_relu_2]") == ("node_linear", "node_relu_2")
    assert onnx_layers("[ONNX Layer: /a/Conv]\x1e[ONNX Layer: /a/Relu]") == ("/a/Conv", "/a/Relu")
    assert onnx_layers("[ONNX Layer: /a/Gemm]\x1f[ONNX Layer: /b]") == ("/a/Gemm", "/b")
    # ONNX node names may contain brackets: only "]" before the next entry or the end closes one.
    assert onnx_layers("[ONNX Layer: (Unnamed Layer* 3) [Convolution]]") == ("(Unnamed Layer* 3) [Convolution]",)
    assert onnx_layers("") == ()


def test_unrelated_text_gives_nothing():
    log = parse_log_file(DATA / "logger_10.16_cookbook_warnings.log")
    assert log.layers == [] and log.problems == []


def test_missing_or_directory_log(tmp_path):
    with pytest.raises(HarnessError, match="no such file"):
        parse_log_file(tmp_path / "build.log")
    with pytest.raises(HarnessError, match="is a directory"):
        parse_log_file(tmp_path)
