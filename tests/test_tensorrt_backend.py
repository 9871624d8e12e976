"""TensorRT backend: version gating, flag names, log capture, the log-to-engine join; real
builds on GPU runners.

Without a GPU the decisions made around TensorRT are tested against a thin
stand-in for the ``tensorrt`` module (version string, flag enums whose integer
values differ between the fake 10.x and 11.x, a base ``ILogger``, and for
:func:`run_builder` a builder that only logs and edits its timing cache), fed
with real recorded TensorRT output (tests/data/trt). Whole builds
(``TensorRTBackend.build``, ``harness build``) run the real code with doubles
only where a GPU would be: the CUDA device queries, the builder (it replays a
recorded log) and the runtime (its engine answers the inspector with recorded
layers). The real bindings of each
TensorRT version are exercised in test_trt_real_bindings.py; every real call is
type-checked by mypy against the tensorrt-stubs (``nox -s lint``). The ``gpu``
tests build real engines and skip, here only, when there is no CUDA device or
no TensorRT.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
import torch

from harness import models
from harness.cache.operations import pin, verify
from harness.cache.timing_cache import CacheEntry, Candidate, Provenance, TimingCache
from harness.cli import build_cmd
from harness.cli.main import main
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import BatchProfile, BuildConfig
from harness.engines.tensorrt import backend as trt_backend
from harness.engines.tensorrt.backend import (
    AutotunedOp,
    TensorRTBackend,
    autotuned_ops,
    changed_decisions,
    name_entries,
)
from harness.engines.tensorrt.builder import (
    build_settings,
    capture_log,
    layer_timings,
    process_logger,
    run_builder,
    set_builder_flags,
)
from harness.engines.tensorrt.cache_bridge import INVALID_TACTIC_HASH, UNKNOWN_LAYER
from harness.engines.tensorrt.inspector import (
    oneline_document,
    parse_engine_information,
    read_engine_information,
)
from harness.engines.tensorrt.join import join_ops, layer_keys
from harness.engines.tensorrt.log_parser import ParsedLog, parse_log
from harness.engines.tensorrt.versions import TrtVersion, load_tensorrt
from harness.errors import HarnessError
from tests.test_trt_bridge import REAL_11, cookbook_11x

DATA = Path(__file__).parent / "data" / "trt"
EDITABLE = DATA / "editable_10.8_sample_readme.log"
COOKBOOK = DATA / "cookbook_10.16.2_detailed_build.log"
# Real keys of NVIDIA's sampleEditableTimingCache (README): matMul1 is in the log block,
# matMul2's only in the README's summary.
KEY_MATMUL1 = "0x1814870c44ff0f8574df6e3dda04cbd7"
KEY_MATMUL2 = "0xb222b0832016f1115ff61116c094875a"
CACHE_FLAGS = ("EDITABLE_TIMING_CACHE", "DISABLE_COMPILATION_CACHE")


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
    "EDITABLE_TIMING_CACHE", "ERROR_ON_TIMING_CACHE_MISS", "DISABLE_COMPILATION_CACHE",
)  # fmt: skip
FLAGS_11 = (
    "TF32", "DISABLE_TIMING_CACHE", "EDITABLE_TIMING_CACHE", "ERROR_ON_TIMING_CACHE_MISS",
    "DISABLE_COMPILATION_CACHE",
)  # fmt: skip


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
    assert settings.builder_flags == ("TF32", flag, "OBEY_PRECISION_CONSTRAINTS", *CACHE_FLAGS)
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
    assert settings.builder_flags == ("TF32", *CACHE_FLAGS)


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
    assert record["builder_flags"] == ["TF32", *CACHE_FLAGS, "ERROR_ON_TIMING_CACHE_MISS"]
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
    assert [m.name for m in config.set] == list(CACHE_FLAGS)
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


# --- one process-wide logger, its sink switched per build --------------------------------------

VERBOSE = SimpleNamespace(name="VERBOSE")
ERROR = SimpleNamespace(name="ERROR")


def test_one_logger_per_tensorrt_module_and_one_capture_per_build(caplog):
    # TensorRT keeps the first logger it is given and ignores later ones (real 10.16 output):
    warning = (DATA / "logger_10.16_cookbook_warnings.log").read_text()
    assert "differs from one already registered" in warning and "the current new logger is ignored" in warning
    trt = fake_trt("10.13.0")
    logger = process_logger(trt)
    assert process_logger(trt) is logger
    assert isinstance(logger, BaseLogger) and logger.base_initialised
    assert process_logger(fake_trt("11.0.0")) is not logger  # another loaded module, another logger
    with capture_log(trt) as first:
        logger.log(VERBOSE, "first build")
    with capture_log(trt) as second:
        logger.log(VERBOSE, "second build")
        with capture_log(trt) as inner:
            logger.log(ERROR, "inner")
        logger.log(ERROR, "second again")
    assert first.lines == ["[V] [TRT] first build"]
    assert second.lines == ["[V] [TRT] second build", "[E] [TRT] second again"]
    assert (inner.lines, inner.problems) == (["[E] [TRT] inner"], ["inner"])
    with caplog.at_level(logging.WARNING, logger="harness.tensorrt"):
        logger.log(ERROR, "outside any build")
        logger.log(VERBOSE, "chatter")
    assert [r.getMessage() for r in caplog.records] == ["outside any build"]


_PREFIX = re.compile(r"^\[[^\]]*\] (?:\[TRT\] \[(?P<a>[VIWE])\]|\[(?P<b>[VIWE])\] \[TRT\]) ")
_SEVERITIES = {"V": "VERBOSE", "I": "INFO", "W": "WARNING", "E": "ERROR"}


def replay(logger, path: Path) -> None:
    """Feed a recorded log to a logger as TensorRT would: severity + bare message. Lines without
    a prefix continue the previous message (TensorRT logs the layer list as one message); a
    recording without prefixes (the sample's README) is one VERBOSE message."""
    messages: list[list] = []
    for line in path.read_text().split("\n"):
        match = _PREFIX.match(line)
        if match is not None:
            messages.append([_SEVERITIES[match["a"] or match["b"]], line[match.end() :]])
        elif messages:
            messages[-1][1] += "\n" + line
        else:
            messages.append(["VERBOSE", line])
    for severity, message in messages:
        logger.log(SimpleNamespace(name=severity), message)


def test_a_replayed_real_build_is_captured_and_parsed_like_the_recording():
    trt = fake_trt("10.13.0")
    with capture_log(trt) as capture:
        replay(process_logger(trt), COOKBOOK)
    parsed = parse_log(capture.text)
    recorded = parse_log(COOKBOOK.read_text())
    assert [(p.layer, p.candidates) for p in parsed.layers] == [(p.layer, p.candidates) for p in recorded.layers]
    assert len(parsed.layers) == 10 and capture.problems == []
    info = read_engine_information(capture.text, "captured log")
    assert len(info.layers) == 26


# --- the join, and what the build log reports -------------------------------------------------


def cookbook_join():
    parsed = parse_log(COOKBOOK.read_text())
    layers = read_engine_information(COOKBOOK.read_text(), "cookbook").layers
    joined, problems = join_ops(parsed.layers, layers)
    return parsed, layers, joined, problems


def test_every_op_of_a_real_build_joins_its_engine_layers():
    _, _, joined, problems = cookbook_join()
    assert problems == []
    by_op = {item.op.layer: (item.layers, item.how) for item in joined}
    assert by_op["node_linear"] == (("node_linear_myl7_1", "node_linear [profile 1]_myl15_1"), "onnx-layers")
    assert by_op["node_linear_1_2"] == (("node_linear_1_2_myl7_2", "node_linear_1_2 [profile 1]_myl15_2"), "onnx-layers")
    assert by_op["node_conv2d + node_relu"] == (("node_conv2d + node_relu",), "name")
    assert by_op["node_conv2d + node_relu [profile 1]"] == (("node_conv2d + node_relu [profile 1]",), "name")


def test_the_editable_sample_joins_by_name_and_carries_its_key_to_the_layer():
    text = EDITABLE.read_text()
    parsed = parse_log(text)
    layers = read_engine_information(text, "sample").layers
    assert [layer.name for layer in layers] == ["matMul1_myl0_0"]  # the log's op is "matMul1"
    ops = autotuned_ops(parsed, parsed.entries())
    assert ops == (AutotunedOp("matMul1", KEY_MATMUL1, ()),)
    joined, problems = join_ops(ops, layers)
    assert problems == [] and joined[0].how == "name"
    assert layer_keys(joined) == ({"matMul1_myl0_0": KEY_MATMUL1}, [])


def cookbook_layers():
    return read_engine_information(COOKBOOK.read_text(), "cookbook").layers


FUSED_CONV = ("node_conv2d + node_relu", "node_conv2d + node_relu [profile 1]")


@pytest.mark.parametrize("nodes", [(), ("node_conv2d",)], ids=["name-only", "onnx-nodes"])
def test_the_issues_node_conv2d_joins_its_fused_layer(nodes):
    """The issue's example: the log's ``node_conv2d`` is the engine's ``node_conv2d + node_relu``
    (real cookbook layers). With its ONNX node it is part of that layer's nodes; without, its
    name ends at the layer name's " + " boundary. The profile-1 copy is the same base layer."""
    (joined,), problems = join_ops([AutotunedOp("node_conv2d", KEY_MATMUL1, nodes)], cookbook_layers())
    assert problems == []
    assert (joined.layers, joined.how) == (FUSED_CONV, "onnx-subset" if nodes else "prefix")
    keys, _ = layer_keys([joined])
    assert keys == dict.fromkeys(FUSED_CONV, KEY_MATMUL1)  # never node_conv2d_1 + node_relu_1


def test_a_prefix_counts_only_at_a_name_boundary():
    """``matMul1`` is not ``matMul10``, ``node_conv2d`` not ``node_conv2d_1 + node_relu_1``,
    ``node_linear_1`` not ``node_linear_1_2``: the name must be followed by " + ", "_myl",
    " [profile" or nothing. The sample's real layer is ``matMul1_myl0_0``; ``matMul10_myl0_1``
    is that layer renamed (no recording has a tenth matMul)."""
    sample = read_engine_information(EDITABLE.read_text(), "sample").layers[0]
    ten = replace(sample, name="matMul10_myl0_1")
    op = AutotunedOp("matMul1", KEY_MATMUL1, ())
    joined, problems = join_ops([op], [ten])
    assert joined[0].layers == () and problems == [
        "autotuned op 'matMul1' matches no engine layer by its ONNX nodes (none in the log) or its name"
    ]
    joined, problems = join_ops([op], [ten, sample])
    assert (joined[0].layers, joined[0].how, problems) == (("matMul1_myl0_0",), "name", [])
    layers = cookbook_layers()
    second_conv = [layer for layer in layers if layer.name.startswith("node_conv2d_1 + node_relu_1")]
    joined, _ = join_ops([AutotunedOp("node_conv2d", KEY_MATMUL1, ())], second_conv)
    assert joined[0].layers == ()
    joined, problems = join_ops([AutotunedOp("node_linear_1", KEY_MATMUL1, ())], layers)
    assert joined[0].layers == () and "matches no engine layer" in problems[0]


def test_an_op_is_joined_to_one_base_layer_or_reported_by_name():
    layers = cookbook_layers()
    ops = [
        AutotunedOp("node_lin", KEY_MATMUL2, ()),  # no boundary after it in any layer name
        AutotunedOp("matMul9", KEY_MATMUL2, ("matMul9",)),
        AutotunedOp("node_softmax", KEY_MATMUL1, ("node_softmax",)),  # exact: MaxrSubExpSum
        AutotunedOp("node_argmax", KEY_MATMUL1, ("node_argmax",)),  # part of DivMulTopk's nodes
    ]
    joined, problems = join_ops(ops, layers)
    assert [(item.layers, item.how) for item in joined] == [
        ((), ""),
        ((), ""),
        (("__myl_MaxrSubExpSum_myl7_3", "__myl_MaxrSubExpSum_myl15_3"), "onnx-layers"),
        (("__myl_DivMulTopk_myl7_4", "__myl_DivMulTopk_myl15_4"), "onnx-subset"),
    ]
    assert problems == [
        "autotuned op 'node_lin' matches no engine layer by its ONNX nodes (none in the log) or its name",
        "autotuned op 'matMul9' matches no engine layer by its ONNX nodes ([ONNX Layer: matMul9]) or its name",
    ]
    # Real 10.1 AlexNet layers: "/classifier/classifier.1/Gemm" is part of two different layers'
    # nodes (the Gemm and the Flatten + reshape before it). Its name settles it; a name that
    # does not is an ambiguity, reported, never guessed.
    alexnet = parse_engine_information((DATA / "inspector_10.1_alexnet.json").read_text()).layers
    gemm = ("/classifier/classifier.1/Gemm",)
    joined, problems = join_ops([AutotunedOp(gemm[0], KEY_MATMUL1, gemm), AutotunedOp("gemm_1", KEY_MATMUL2, gemm)], alexnet)
    assert (joined[0].layers, joined[0].how) == (
        ("/classifier/classifier.1/Gemm + (Unnamed Layer* 25) [ElementWise] + /classifier/classifier.2/Relu",),
        "prefix",
    )
    assert joined[1].layers == () and problems == [
        "autotuned op 'gemm_1' cannot be joined to one engine layer: its ONNX nodes are part of several "
        "layers ('/Flatten + reshape_before_/classifier/classifier.1/Gemm', '/classifier/classifier.1/Gemm + "
        "(Unnamed Layer* 25) [ElementWise] + /classifier/classifier.2/Relu')"
    ]
    twice = [AutotunedOp("node_linear", KEY_MATMUL1, ("node_linear", "node_relu_2")), AutotunedOp("node_linear_myl7_1", KEY_MATMUL2, ())]
    keys, claimed = layer_keys(join_ops(twice, layers)[0])
    assert keys["node_linear_myl7_1"] == KEY_MATMUL1
    assert claimed == [
        f"engine layer 'node_linear_myl7_1' joins several keyed ops; its key is {KEY_MATMUL1}, not "
        f"{KEY_MATMUL2} (op 'node_linear_myl7_1')"
    ]


def test_of_several_layers_listing_exactly_the_ops_nodes_the_key_goes_to_the_one_it_names():
    # Real 10.1 ResNet-18 layers: TensorRT lists "/fc/Gemm" on the Gemm's own layer and on the
    # "reshape_after_/fc/Gemm" shuffle it adds. The op's key (its tactic) is the Gemm's only;
    # an op whose name picks neither is reported, not given to both.
    resnet = parse_engine_information((DATA / "inspector_10.1_resnet18.json").read_text()).layers
    fc = ("/fc/Gemm",)
    gemm = "/fc/Gemm + (Unnamed Layer* 58) [ElementWise]"
    assert [layer.name for layer in resnet if layer.onnx_layers == fc] == [gemm, "reshape_after_/fc/Gemm"]
    joined, problems = join_ops([AutotunedOp(fc[0], KEY_MATMUL1, fc), AutotunedOp("gemm_7", KEY_MATMUL2, fc)], resnet)
    assert (joined[0].layers, joined[0].how) == ((gemm,), "onnx-layers")
    assert layer_keys(joined) == ({gemm: KEY_MATMUL1}, [])
    assert joined[1].layers == () and problems == [
        "autotuned op 'gemm_7' cannot be joined to one engine layer: its ONNX nodes are part of several "
        f"layers ({gemm!r}, 'reshape_after_/fc/Gemm')"
    ]


def test_on_an_11x_engine_every_op_of_the_real_log_joins_its_myl_layers():
    """The real 10.16 log against the same build as a TensorRT 11 engine would print it
    (tests.test_trt_bridge.as_11x: every layer ``<op>_myl<k>_<n>``, no TacticValue)."""
    layers = parse_engine_information(cookbook_11x()).layers
    parsed = parse_log(COOKBOOK.read_text())
    joined, problems = join_ops(parsed.layers, layers)
    assert problems == [] and all(item.layers for item in joined)
    by_op = {item.op.layer: (item.layers, item.how) for item in joined}
    assert by_op["node_conv2d + node_relu"] == (
        ("node_conv2d + node_relu_myl0_1", "node_conv2d + node_relu [profile 1]_myl1_14"),
        "name",
    )
    assert by_op["node_conv2d + node_relu [profile 1]"] == (("node_conv2d + node_relu [profile 1]_myl1_14",), "prefix")
    assert by_op["node_linear"][1] == "onnx-layers"
    # Myelin-style op names (the first ONNX node) join the renamed fused layer as well.
    (conv,), problems = join_ops([AutotunedOp("node_conv2d", KEY_MATMUL1, ("node_conv2d", "node_relu"))], layers)
    assert conv.layers == ("node_conv2d + node_relu_myl0_1", "node_conv2d + node_relu [profile 1]_myl1_14")
    # No TacticValue: each Cask-like layer's hash is that of the one measured candidate of
    # its kernel name; the Myelin gemms' names are shared, so their hash stays unknown.
    timings = {t.layer: t for t in layer_timings(parsed, [], set(), joined, layers, set())}
    _, ten_layers, ten_joined, _ = cookbook_join()
    ten_x = {t.layer: t for t in layer_timings(parsed, [], set(), ten_joined, ten_layers, set())}
    assert {name: (t.chosen, t.chosen_hash) for name, t in timings.items()} == {
        name: (t.chosen, t.chosen_hash) for name, t in ten_x.items()
    }
    assert timings["node_conv2d + node_relu"].chosen_hash == "0xcf8ea142095f02d2"
    assert timings["node_linear"].chosen_hash == ""


def test_keyless_ops_become_timings_with_the_engines_tactic_never_a_guessed_hash():
    parsed, layers, joined, _ = cookbook_join()
    timings = {t.layer: t for t in layer_timings(parsed, [], set(), joined, layers, set())}
    assert len(timings) == 10 and all(t.key == "" for t in timings.values())
    # Profile 1's Cask ops were answered from the build's cache ("got cached result").
    assert [t.layer for t in timings.values() if t.from_cache] == [
        "node_conv2d + node_relu [profile 1]",
        "node_max_pool2d [profile 1]",
        "node_conv2d_1 + node_relu_1 [profile 1]",
        "node_max_pool2d_1 [profile 1]",
    ]
    # A layer a keyed op claims is reported by that op only.
    claimed = layer_timings(parsed, [], set(), joined, layers, {"node_conv2d + node_relu"})
    assert "node_conv2d + node_relu" not in {t.layer for t in claimed} and len(claimed) == 9
    conv = timings["node_conv2d + node_relu"]
    # A Cask layer: its TacticValue is the hash, one of the 246 candidates the log measured.
    assert conv.chosen_hash == "0xcf8ea142095f02d2" and len(conv.candidates) == 246
    assert conv.chosen.startswith("sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f32f32_tf32f32")
    assert conv.chosen_hash in {c.tactic_hash for c in conv.candidates}
    linear = timings["node_linear"]
    # A Myelin layer has no TacticValue and its kernel name is shared by several candidates.
    assert linear.chosen == "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    assert sum(c.tactic == linear.chosen for c in linear.candidates) > 1 and linear.chosen_hash == ""


def test_keyed_ops_cache_hits_and_unlogged_keys_become_timings():
    text = EDITABLE.read_text()
    parsed = parse_log(text)
    layers = read_engine_information(text, "sample").layers
    older = CacheEntry(KEY_MATMUL2, "matMul2", "kernel_a", "0x665ded9abbf88", 0.0113, (), pinned=True)
    unlogged = CacheEntry("0x000102030405060708090a0b0c0d0e0f", UNKNOWN_LAYER, "0x77", "0x77", 0.001)
    final = [parsed.entries()[0], older, unlogged]
    joined, _ = join_ops(parsed.layers, layers)
    timings = {t.key: t for t in layer_timings(parsed, final, {KEY_MATMUL2}, joined, layers, set())}
    assert set(timings) == {KEY_MATMUL1, KEY_MATMUL2, unlogged.key}
    matmul = timings[KEY_MATMUL1]
    assert (matmul.layer, matmul.chosen_hash, matmul.from_cache, len(matmul.candidates)) == ("matMul1", "0x665ded9abbf88", False, 3)
    assert timings[KEY_MATMUL2].from_cache and not timings[unlogged.key].from_cache


# --- run_builder: pins checked after the build -------------------------------------------------


class TimingCacheDouble:
    """ITimingCache's documented semantics (NvInfer.h): update() refuses an absent key, NaN
    deletes, query() answers an absent key with the invalid hash. ``calls`` records which
    methods were called (``queryKeys`` is unconfirmed on a cache that is not editable)."""

    def __init__(self, values):
        self.values = dict(values)
        self.calls: list[str] = []

    def queryKeys(self):  # noqa: N802 - TensorRT's spelling
        self.calls.append("queryKeys")
        return list(self.values)

    def query(self, key):
        self.calls.append("query")
        tactic_hash, time_ms = self.values.get(key, (INVALID_TACTIC_HASH, 0.0))
        return SimpleNamespace(tacticHash=tactic_hash, timingMSec=time_ms)

    def update(self, key, value):
        self.calls.append("update")
        if key not in self.values:
            return False
        if math.isnan(value.timingMSec):
            del self.values[key]
        else:
            self.values[key] = (value.tacticHash, value.timingMSec)
        return True

    def serialize(self):
        return repr(sorted(self.values.items())).encode()


SAMPLE_CACHE = {KEY_MATMUL1: (0x665DED9ABBF88, 0.011264), KEY_MATMUL2: (0x665DED9ABBF88, 0.0113)}


def builder_trt(
    retime: dict[str, int] | None = None,
    *,
    build_log: Path | None = None,
    cache: dict[str, tuple[int, float]] | None = None,
    layers: str = '{"Layers": [], "Bindings": []}',
):
    """TensorRT 11.0 where a GPU would be: a builder that logs through the logger it was given
    (the recorded ``build_log`` replayed as TensorRT would log it, else one line), starts
    from ``cache`` (default: the sample's two keys; every cache created is kept in
    ``trt.caches``) and re-times ``retime`` as TensorRT 11.0 did despite
    ERROR_ON_TIMING_CACHE_MISS; a runtime whose engine has the parsed ONNX model's I/O
    tensors and answers the inspector with ``layers``. Each member only returns what the
    test gave it; flag enums and the logger base are :func:`fake_trt`'s."""
    trt = fake_trt("11.0.0")
    loggers = []
    parsed: dict[str, bytes] = {}

    class Config(ConfigDouble):
        def add_optimization_profile(self, profile):
            trt.profiles.append(profile.shapes)
            return len(trt.profiles) - 1

        def create_timing_cache(self, data):
            self.cache = TimingCacheDouble(SAMPLE_CACHE if cache is None else cache)
            trt.caches.append(self.cache)
            return self.cache

        def set_timing_cache(self, cache, ignore_mismatch):
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            loggers.append(logger)
            self.logger = logger

        def create_network(self, flags):
            return SimpleNamespace(flags=flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            profile = SimpleNamespace(shapes=[])
            profile.set_shape = lambda name, *dims: profile.shapes.append((name, *dims))
            return profile

        def build_serialized_network(self, network, config):
            if build_log is None:
                self.logger.log(VERBOSE, "building")
            else:
                replay(self.logger, build_log)
            config.cache.values.update({k: (v, 0.01) for k, v in (retime or {}).items()})
            return b"plan"

    class OnnxParser:
        def __init__(self, network, logger):
            loggers.append(logger)

        def parse(self, data):
            parsed["model"] = data
            return True

    class Engine:
        def __init__(self):
            graph = onnx.load_from_string(parsed["model"]).graph  # the model the builder was given
            self.inputs = [t.name for t in graph.input]
            self.names = self.inputs + [t.name for t in graph.output]
            self.num_io_tensors = len(self.names)

        def get_tensor_name(self, index):
            return self.names[index]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name in self.inputs else trt.TensorIOMode.OUTPUT

        def create_engine_inspector(self):
            return SimpleNamespace(get_engine_information=lambda fmt: layers)

        def create_execution_context(self):
            return SimpleNamespace()

    class Runtime:
        def __init__(self, logger):
            loggers.append(logger)

        def deserialize_cuda_engine(self, plan):
            return Engine()

    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, OnnxParser, Runtime
    trt.TimingCacheKey = SimpleNamespace(parse=str)
    trt.TimingCacheValue = lambda tactic_hash, time_ms: SimpleNamespace(tacticHash=tactic_hash, timingMSec=time_ms)
    trt.TensorIOMode = SimpleNamespace(INPUT="input", OUTPUT="output")
    trt.LayerInformationFormat = SimpleNamespace(JSON="json")
    trt.Dims = tuple
    trt.profiles = []  # the shapes of every optimization profile a build added
    trt.caches = []  # every timing cache a build created
    return trt, loggers


def pins() -> TimingCache:
    parsed = parse_log(EDITABLE.read_text())
    cache = TimingCache(PROV, parsed.entries())
    cache.update(CacheEntry(KEY_MATMUL2, "matMul2", "0x665ded9abbf88", "0x665ded9abbf88", 0.0113))
    return cache


def test_a_build_whose_tactics_moved_from_the_caches_selections_fails_naming_the_layer():
    settings = build_settings(TrtVersion(11, 0), "fp16", {}, timing_cache=True, editable=True, error_on_cache_miss=True)
    trt, loggers = builder_trt({})
    run = run_builder(trt, b"onnx", settings, base_cache=b"", enforced=pins(), ignore_mismatch=False)
    assert run.plan == b"plan" and run.capture.lines == ["[V] [TRT] building"]
    second = run_builder(trt, b"onnx", settings, base_cache=b"", enforced=pins(), ignore_mismatch=False)
    assert second.capture.lines == ["[V] [TRT] building"]
    # Both builds, builder and parser alike, got the one process-wide logger.
    assert len(loggers) == 4 and all(logger is loggers[0] for logger in loggers)

    trt, _ = builder_trt({KEY_MATMUL1: 0x393E4EF8AD243})
    with pytest.raises(HarnessError) as exc:
        run_builder(trt, b"onnx", settings, base_cache=b"", enforced=pins(), ignore_mismatch=False)
    assert str(exc.value) == (
        "TensorRT did not keep the timing cache's tactics (fp16); the engine is discarded:\n"
        f"  layer 'matMul1' (key {KEY_MATMUL1}): the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64"
        "_stage3_warpsize2x1x2_tensor16x8x8 (0x665ded9abbf88), built 0x393e4ef8ad243"
    )
    trt, _ = builder_trt({"0x000102030405060708090a0b0c0d0e0f": 1})
    with pytest.raises(HarnessError, match="key 0x000102030405060708090a0b0c0d0e0f: not in the timing cache"):
        run_builder(trt, b"onnx", settings, base_cache=b"", enforced=pins(), ignore_mismatch=False)
    # Without error-on-miss a new key is a layer timed afresh, which is allowed.
    lenient = build_settings(TrtVersion(11, 0), "fp16", {}, timing_cache=True, editable=True, error_on_cache_miss=False)
    assert run_builder(trt, b"onnx", lenient, base_cache=b"", enforced=pins(), ignore_mismatch=False).plan == b"plan"
    # A key of the cache TensorRT's cache lacks: update() refuses it, and nothing says it was used.
    trt, _ = builder_trt(cache={KEY_MATMUL1: SAMPLE_CACHE[KEY_MATMUL1]})
    with pytest.raises(HarnessError, match=f"key {KEY_MATMUL2}\\): the cache selects .*but the built cache has no such key"):
        run_builder(trt, b"onnx", lenient, base_cache=b"", enforced=pins(), ignore_mismatch=False)


# --- whole builds, with doubles only where the GPU would be -----------------------------------


@pytest.fixture
def gpu_double(monkeypatch):
    """The CUDA queries a build makes, answered as on an H100 (with :func:`builder_trt` for
    TensorRT's builder and runtime). The rest of the build is the real code: ONNX export,
    settings, log capture and parsing, pinning, the join, cache export, the plan record."""
    monkeypatch.setattr(trt_backend, "require_cuda", lambda: None)
    monkeypatch.setattr(trt_backend, "device_identity", lambda: ("NVIDIA H100 80GB HBM3 (sm_90)", {"capability": "9.0"}))


def lenet_fp16():
    return compile_for_mode(models.load("lenet"), "fp16", None)


# The real cookbook build's log against an engine whose inspector lists other layers (the
# real 10.4 AlexNet build's): no op of the log can be joined, and the log has no keys.
UNJOINABLE = {"build_log": COOKBOOK, "cache": {}, "layers": (DATA / "trtexec_10.4_alexnet_fp16_layers.json").read_text()}


def test_join_and_keyless_log_problems_reach_the_build_log(gpu_double):
    trt, _ = builder_trt(**UNJOINABLE)
    _, log = TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16"), None)
    assert log.messages[0].startswith("none of the log's 10 autotuned op(s) carries a timing-cache key")
    unjoined = [m for m in log.messages if m.startswith("autotuned op ")]
    assert [m.split("'")[1] for m in unjoined] == [op.layer for op in parse_log(COOKBOOK.read_text()).layers]
    assert unjoined[0] == (
        "autotuned op 'node_conv2d + node_relu' matches no engine layer by its ONNX nodes (none in the log) or its name"
    )
    assert log.to_json()["messages"] == log.messages  # what build_log.json keeps


def sample_engine_layers() -> str:
    """The sample's real engine layer (its ONELINE line, ``matMul1_myl0_0``) as inspector JSON."""
    return json.dumps({**oneline_document(EDITABLE.read_text(), "sample"), "Bindings": []})


def test_a_build_from_a_cache_is_checked_against_the_kernel_the_engine_runs(gpu_double):
    """Whether a layer TensorRT 11.0 re-timed despite the cache shows up in get_timing_cache()
    is unconfirmed; here it does not: the cache keeps the selected hash, while the engine's real
    layer runs the kernel the sample's build selected. The inspector's TacticName tells."""
    sample = {KEY_MATMUL1: SAMPLE_CACHE[KEY_MATMUL1]}
    kept = TimingCache(PROV, parse_log(EDITABLE.read_text()).entries())
    trt, _ = builder_trt(build_log=EDITABLE, cache=sample, layers=sample_engine_layers())
    engine, log = TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16", error_on_cache_miss=True), kept)
    (layer,) = engine.layers()
    assert (layer.name, layer.key, layer.tactic_hash) == ("matMul1_myl0_0", KEY_MATMUL1, "0x665ded9abbf88")
    assert log.messages[0].startswith("key discovery: a first build recorded 1 autotuned layer key(s)")

    moved = TimingCache(PROV, kept.entries())
    pin(moved, "matMul1", "0x393e4ef8ad243")
    trt, _ = builder_trt(build_log=EDITABLE, cache=sample, layers=sample_engine_layers())
    with pytest.raises(HarnessError) as exc:
        TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16", error_on_cache_miss=True), moved)
    assert str(exc.value) == (
        "TensorRT did not keep the timing cache's tactics (fp16); the engine is discarded:\n"
        f"  layer 'matMul1_myl0_0' (key {KEY_MATMUL1}): the cache selects sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_"
        "tilesize64x32x64_stage4_warpsize2x1x2_tensor16x8x8 (0x393e4ef8ad243), the engine runs "
        "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8 (0x665ded9abbf88)"
    )


def real_11x_engine_layers() -> str:
    """The real TensorRT 11.0 build's ONELINE layers (``node_linear_myl0_7``, ...) as inspector JSON."""
    return json.dumps({**oneline_document((DATA / REAL_11).read_text(), "11.0 build"), "I/O Tensors": []})


def real_11x_pins(linear_hash: str, conv_hash: str) -> TimingCache:
    """Selections for the real 11.0 ops node_linear (key KEY_MATMUL1) and node_conv2d (KEY_MATMUL2),
    with the candidates the log measured (the real build had no editable cache, so no keys)."""
    ops = {op.layer: op for op in parse_log((DATA / REAL_11).read_text()).layers}
    entries = []
    for key, name, tactic_hash in ((KEY_MATMUL1, "node_linear", linear_hash), (KEY_MATMUL2, "node_conv2d", conv_hash)):
        (chosen,) = [c for c in ops[name].candidates if c.tactic_hash == tactic_hash]
        entries.append(CacheEntry(key, name, chosen.tactic, chosen.tactic_hash, chosen.time_ms, ops[name].candidates))
    return TimingCache(PROV, entries)


def test_a_pinned_11x_build_reports_layers_it_cannot_tie_to_a_candidate_and_fails_on_a_move(gpu_double):
    """The real 11.0 engine built from pins (its real log replayed): TensorRT's cache after the
    build holds every selection, ``node_conv2d_myl0_2`` runs the one candidate of its kernel name,
    and ``node_linear``'s layers run the pinned kernel's name, which two candidates share. Those
    are reported as unverifiable in the build log, not as kept; when node_conv2d is pinned to another candidate
    that TensorRT's cache holds while the engine runs the first, the build fails naming both
    profiles' layers."""
    pins = real_11x_pins("0x4754af3ee6112", "0x447797f84b244")  # both ops' fastest
    stored = {e.key: (int(e.tactic_hash, 16), e.time_ms) for e in pins.entries()}
    trt, _ = builder_trt(build_log=(DATA / REAL_11), cache=stored, layers=real_11x_engine_layers())
    engine, log = TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16", error_on_cache_miss=True), pins)
    assert {layer.name: layer.key for layer in engine.layers() if layer.key} == {
        "node_conv2d_myl0_2": KEY_MATMUL2, "node_linear_myl0_7": KEY_MATMUL1,
        "node_conv2d [profile 1]_myl1_2": KEY_MATMUL2, "node_linear [profile 1]_myl1_7": KEY_MATMUL1,
    }  # fmt: skip
    unverifiable = [m for m in log.messages if ": unverifiable: " in m]
    kernel = "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8"
    assert unverifiable == [
        f"layer {name!r} (key {KEY_MATMUL1}): unverifiable: 2 candidates its key measured are kernel {kernel} "
        f"(0x4754af3ee6112, 0x2c80ce2f5c4a6), and the engine does not say which one it runs; the cache selects {kernel} "
        "(0x4754af3ee6112)"
        for name in ("node_linear_myl0_7", "node_linear [profile 1]_myl1_7")
    ]
    # Every selected key was queried in TensorRT's cache after the build.
    assert trt.caches[-1].calls.count("query") >= len(pins)

    moved = real_11x_pins("0x4754af3ee6112", "0x61203a5779dda")
    stored = {e.key: (int(e.tactic_hash, 16), e.time_ms) for e in moved.entries()}
    trt, _ = builder_trt(build_log=(DATA / REAL_11), cache=stored, layers=real_11x_engine_layers())
    with pytest.raises(HarnessError) as exc:
        TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16", error_on_cache_miss=True), moved)
    lines = str(exc.value).splitlines()
    assert lines[0] == "TensorRT did not keep the timing cache's tactics (fp16); the engine is discarded:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        f"layer 'node_conv2d_myl0_2' (key {KEY_MATMUL2})", f"layer 'node_conv2d [profile 1]_myl1_2' (key {KEY_MATMUL2})"
    ]
    assert lines[1].endswith("_aligna4_alignc4 (0x61203a5779dda), the engine runs sm80_xmma_fprop_implicit_gemm_indexed_wo_smem"
                             "_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x16x32_stage1_warpsize4x1x1_g1_tensor16x8x8_aligna4"
                             "_alignc8 (0x447797f84b244)")  # fmt: skip


def test_a_build_without_the_editable_cache_never_lists_the_caches_keys(gpu_double):
    """``queryKeys`` is unconfirmed on a timing cache that is not editable: a build with a cache
    but without EDITABLE_TIMING_CACHE touches it not at all and records no keys, where the
    editable build of the same graph lists and exports them."""
    graph = lenet_fp16()
    trt, _ = builder_trt()
    backend = TensorRTBackend(trt)
    config = BuildConfig("fp16", editable_cache=False)
    assert "EDITABLE_TIMING_CACHE" not in backend.settings(config).builder_flags
    engine, log = backend.build(graph, config, TimingCache(PROV))
    assert [cache.calls for cache in trt.caches] == [[]]
    assert engine.plan_json()["cache_entries"] == [] and log.new_entries == []
    editable_trt, _ = builder_trt()
    engine, log = TensorRTBackend(editable_trt).build(graph, BuildConfig("fp16"), TimingCache(PROV))
    assert "queryKeys" in editable_trt.caches[-1].calls
    assert {e["key"] for e in engine.plan_json()["cache_entries"]} == {KEY_MATMUL1, KEY_MATMUL2}


def test_enforcing_selections_without_the_editable_cache_is_refused_before_building():
    settings = build_settings(TrtVersion(11, 0), "fp16", {}, timing_cache=True, editable=False, error_on_cache_miss=False)
    assert not settings.editable_cache
    trt, loggers = builder_trt()
    with pytest.raises(HarnessError, match="enforcing a timing cache's tactic selections needs BuilderFlag.EDITABLE_TIMING_CACHE"):
        run_builder(trt, b"onnx", settings, base_cache=b"", enforced=pins(), ignore_mismatch=False)
    assert trt.caches == [] and loggers == []


def test_harness_build_prints_the_build_messages_as_notes(gpu_double, monkeypatch, tmp_path, capsys):
    trt, _ = builder_trt(**UNJOINABLE)
    monkeypatch.setattr(build_cmd, "get_backend", lambda name: TensorRTBackend(trt))
    assert main(["build", "--model", "lenet", "--mode", "fp16", "--backend", "tensorrt", "-o", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    saved = json.loads((tmp_path / "e" / "build_log.json").read_text())["messages"]
    assert notes == [f"note: {m}" for m in saved] and len(notes) == 11
    assert notes[1].startswith("note: autotuned op 'node_conv2d + node_relu' matches no engine layer")


def test_harness_rebuild_prints_every_builds_messages_once(capsys):
    """Each build of a rebuild reports the same messages; they are shown once. A rebuild runs
    every engine, which TensorRT cannot do without a GPU: the CPU backend's build, whose
    lowering reports its fusions, shows the (backend-neutral) printing."""
    argv = ["rebuild", "--model", "lenet", "--mode", "fp32", "--backend", "cpu", "--times", "2",
            "--option", "timing_runs=1", "--option", "warmup_runs=0"]  # fmt: skip
    assert main(argv) == 0
    fused = ["note: fused activation relu into conv2d", "note: fused activation relu_1 into conv2d_1"]
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    # The builds' whole-run decisions (regions, oneDNN primitives) carry their own run times, so
    # they differ between builds.
    decisions = ("oneDNN Graph tactics", "oneDNN primitives")
    assert [n for n in notes if not any(d in n for d in decisions)] == fused and len(set(notes)) == len(notes)
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["builds"] == 2  # stdout stays one JSON document
    assert [n for n in err.splitlines() if not any(d in n for d in decisions)] == fused


# --- JSON cache bookkeeping ------------------------------------------------------------------

PROV = Provenance("tensorrt", "10.13.0.35", "NVIDIA A100 (sm_80)", {}, {"tf32": True})
CANDIDATES = (Candidate("kernel_a", "0xa", 0.5), Candidate("kernel_b", "0xb", 0.6))


def test_entries_the_log_does_not_name_take_names_from_the_json_cache():
    given = TimingCache(PROV, [CacheEntry(KEY_MATMUL1, "matMul1", "kernel_a", "0xa", 0.5, CANDIDATES, pinned=True)])
    exported = TimingCache(
        PROV,
        [CacheEntry(KEY_MATMUL1, UNKNOWN_LAYER, "0xa", "0xa", 0.5), CacheEntry(KEY_MATMUL2, UNKNOWN_LAYER, "0xc", "0xc", 0.1)],
    )
    matmul, other = name_entries(exported, given)
    assert (matmul.layer, matmul.tactic, matmul.candidates) == ("matMul1", "kernel_a", CANDIDATES)
    assert other.layer == UNKNOWN_LAYER
    # The plan records the op of every key but the unnamed one; a key served by the JSON
    # cache has its name only (no log block, so no ONNX nodes).
    assert autotuned_ops(ParsedLog(), [matmul, other]) == (AutotunedOp("matMul1", KEY_MATMUL1, ()),)


def test_a_pinned_rebuild_adds_nothing_and_a_change_is_reported():
    pinned = CacheEntry(KEY_MATMUL1, "matMul1", "kernel_a", "0xa", 0.5, CANDIDATES, pinned=True)
    cache = TimingCache(PROV, [pinned])
    before = cache.digest()
    assert changed_decisions(cache, [CacheEntry(KEY_MATMUL1, "matMul1", "0x0A", "0x0A", 0.5)]) == []
    changed = CacheEntry(KEY_MATMUL1, "matMul1", "kernel_b", "0xb", 0.6)
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


@pytest.fixture
def gpu() -> None:
    """Skip without a GPU; on GPU runners (HARNESS_REQUIRE_GPU=1, gpu.yml) a missing GPU fails."""
    if NO_GPU is not None:
        if os.environ.get("HARNESS_REQUIRE_GPU"):
            pytest.fail(f"HARNESS_REQUIRE_GPU is set, but the GPU tests cannot run: {NO_GPU}")
        pytest.skip(NO_GPU)


@pytest.mark.gpu
def test_a_rebuild_from_the_cache_reproduces_the_engine_exactly(tmp_path, gpu):
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
    # Every autotuned op of the log joined an engine layer, which carries its key and hash.
    assert not [m for m in first_log.messages if "autotuned op" in m], first_log.messages
    keyed = [layer for layer in first.layers() if layer.key]
    assert keyed and all(layer.tactic_hash for layer in keyed)
    assert {layer.key for layer in keyed} <= set(cache.query_keys())
    cache.save(tmp_path / "cache.json")

    # A fresh backend has no binary cache of this network: it must discover the keys first.
    pinned = TimingCache.load(tmp_path / "cache.json")
    before = pinned.digest()
    second, second_log = TensorRTBackend().build(compiled, BuildConfig(mode, error_on_cache_miss=True), pinned)
    assert second.fingerprint() == first.fingerprint()
    assert all(t.from_cache for t in second_log.layers)
    assert pinned.digest() == before
    assert verify(pinned, [(layer.name, layer.key, layer.tactic) for layer in second.layers() if layer.key]) == []
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
def test_a_second_build_in_one_process_keeps_its_verbose_log(gpu):
    """TensorRT keeps the first logger it is given; each build must still see its own log."""
    spec = models.load("lenet")
    compiled = compile_for_mode(spec, "fp16", None)
    for _ in range(2):
        backend = TensorRTBackend()
        config = BuildConfig("fp16")
        engine, log = backend.build(compiled, config, TimingCache(backend.provenance(config)))
        assert any(t.key for t in log.layers)
        assert any(layer.key for layer in engine.layers())


@pytest.mark.gpu
def test_error_on_cache_miss_with_an_empty_cache_fails_naming_the_problem(gpu):
    spec = models.load("lenet")
    compiled = compile_for_mode(spec, "fp16", None)
    backend = TensorRTBackend()
    config = BuildConfig("fp16", error_on_cache_miss=True)
    with pytest.raises(HarnessError, match="failed to build"):
        backend.build(compiled, config, TimingCache(backend.provenance(config)))


# --- a batch sweep: one engine with an optimization profile ----------------------------------


def test_a_batch_sweep_builds_one_engine_with_an_optimization_profile(gpu_double, tmp_path):
    """The ONNX gets a dynamic batch axis, the build one profile (min/max the sweep's extremes,
    opt its first size), recorded in the cache provenance, the engine record and its fingerprint."""
    profile = BatchProfile.for_sweep(0, [2, 1, 8])
    compiled = compile_for_mode(models.load("lenet", 8), "autocast-fp16", None)
    config = BuildConfig("autocast-fp16", batch_profile=profile)
    trt, _ = builder_trt()
    backend = TensorRTBackend(trt)
    engine, _ = backend.build(compiled, config, None)
    assert trt.profiles == [[("x", (1, 1, 28, 28), (2, 1, 28, 28), (8, 1, 28, 28))]]
    assert backend.provenance(config).builder_options["batch_profile"] == {"dim": 0, "min": 1, "opt": 2, "max": 8}
    plan = engine.plan_json()
    assert plan["builder"]["batch_profile"] == profile.to_json()
    assert plan["inputs"] == [{"name": "x", "dtype": "fp32", "shape": [-1, 1, 28, 28]}]
    assert plan["outputs"][0]["shape"] == [-1, 10]
    # the engine names the settings it was compiled under, in full
    assert plan["compiler_settings"] == config.compiler_settings() == engine.compiler_settings()
    engine.save(tmp_path / "e")
    loaded = backend.load(tmp_path / "e")
    assert loaded.record.batch_profile == profile and loaded.compiler_settings() == engine.compiler_settings()
    assert loaded.fingerprint() == engine.fingerprint()
    # a static engine of the same graph: no profile, its own fingerprint, and a cache of its own
    static_trt, _ = builder_trt()
    static, _ = TensorRTBackend(static_trt).build(compiled, BuildConfig("autocast-fp16"), None)
    assert static_trt.profiles == [] and static.plan_json()["inputs"][0]["shape"] == [8, 1, 28, 28]
    assert static.fingerprint() != engine.fingerprint()
    assert "batch_profile" not in backend.provenance(BuildConfig("autocast-fp16")).builder_options


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["enqueue", "cuda-graph"])
def test_a_staged_engine_times_its_compute_apart_from_its_copies_on_its_own_stream(gpu, cuda_graph):
    """trtexec's figures on a real engine: the query runs on a stream of the engine's own (never
    the legacy default stream, on which TensorRT warns), its compute events bracket the enqueue
    alone, and its outputs are the engine's outputs."""
    from harness.bench.latency import measure_device_latency

    spec = models.load("lenet")
    compiled = compile_for_mode(spec, "fp16", None)
    backend = TensorRTBackend()
    engine, _ = backend.build(compiled, BuildConfig("fp16"), None)
    query = engine.stage(*spec.example_inputs, cuda_graph=cuda_graph)
    assert query.stream.cuda_stream != 0 and query.stream != torch.cuda.default_stream()
    result = measure_device_latency(query, warmup_s=0.05, min_iters=20, min_duration_s=0.1)
    device = result.device
    assert device is not None and device.cuda_graph is cuda_graph
    for compute, h2d, d2h, total in zip(
        result.samples_ns, device.h2d.samples, device.d2h.samples, device.end_to_end.samples, strict=True
    ):
        assert total == compute + h2d + d2h and min(compute, h2d, d2h) > 0
    query.h2d()
    query.enqueue()
    query.d2h()
    query.synchronize()
    (staged,) = query.outputs()
    (direct,) = engine.run(*spec.example_inputs)
    assert torch.equal(staged, direct.cpu())
    assert not [w for w in engine.run_warnings if "default stream" in w], engine.run_warnings
