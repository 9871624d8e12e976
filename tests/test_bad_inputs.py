"""Every reader and every command, fed damaged, crafted and wrong inputs.

Each case runs the real ``harness`` entry point and requires what the
harness promises for bad input: exit code 2, one ``error:`` line naming the
file or flag, no traceback, the inputs left byte for byte as they were, and
nothing written (no output, no temporary file, no staging directory, no
directory created at a dangling link's target).

The commands run in a worker process (tests/harness_worker.py) with their own
file descriptors 1 and 2, so what is checked is what a terminal would show
(torch's own log included) and a native crash ends one case, not the test run.
The module counts every case and prints the figures at the end (inputs tried,
clean one-line errors with exit 2, tracebacks, native crashes, hangs, inputs
modified); ``python -m tests.bad_input_figures`` runs the file and prints them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.bench.results import content_digest
from harness.cli.main import main
from harness.fileio import canonical_json, digest
from tests.harness_worker import Outcome, Worker

MACHINE = "bad-input-machine"
ENV = {"HARNESS_MACHINE_ID": MACHINE}
DATA = Path(__file__).parent / "data"
TRT_LOG = DATA / "trt" / "trtexec_10.4_alexnet_fp16_verbose_excerpt.log"
TRT_LAYERS = DATA / "trt" / "trtexec_10.4_alexnet_fp16_layers.json"

Damage = Callable[[Path], None]


# --- damages ---------------------------------------------------------------------------------


def _rewrite(change: Callable[[Any], Any]) -> Damage:
    def damage(path: Path) -> None:
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return damage


def _text(text: str) -> Damage:
    return lambda p: p.write_text(text)


def _resign_cache(doc: dict[str, Any]) -> dict[str, Any]:
    """The digest a forger would compute: the cache's content with its entries sorted by key."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    body["entries"] = sorted(body["entries"], key=lambda e: e["key"])
    return {**doc, "digest": digest(canonical_json(body))}


def _resign_results(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "digest": content_digest(doc)}


def _resign_plan(doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k not in ("fingerprint", "weights_digest")}
    return {**doc, "fingerprint": digest(canonical_json(body))}


def _nan(path: Path) -> None:
    doc = json.loads(path.read_text())
    doc["schema_version" if "schema_version" in doc else next(iter(doc))] = "__NAN__"
    path.write_text(json.dumps(doc).replace('"__NAN__"', "NaN"))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _dev_zero(path: Path) -> None:
    """A symlink to an endless device: a reader without a size bound never returns."""
    path.unlink()
    path.symlink_to("/dev/zero")


def _sparse(size: int) -> Damage:
    """A file of ``size`` bytes that takes no disk space (a reader must refuse it by its size)."""

    def damage(path: Path) -> None:
        path.write_bytes(b"")
        os.truncate(path, size)

    return damage


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


GENERIC: dict[str, Damage] = {
    "truncated": _truncated,
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"\x00\x01\xff not json at all"),
    "wrong-type": _text("[1, 2, 3]"),
    "wrong-schema": _text('{"schema_version": 2, "hello": "world"}'),
    "nan": _nan,
    "huge-int": _text('{"schema_version": ' + "9" * 400 + "}"),
    "deep": _text("[" * 50_000 + "]" * 50_000),
    "directory": _directory,
    "fifo": _fifo,
}

# Damage every payload reader must refuse (weights, ONNX models): by its digest, its type or its size.
PAYLOAD: dict[str, Damage] = {
    "truncated": _truncated,
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"\x00\x01\xff not a payload"),
    "directory": _directory,
    "fifo": _fifo,
    "dev-zero-link": _dev_zero,
    "sparse-17GiB": _sparse(17 << 30),
}


def _conv(doc: dict[str, Any], name: str, index: int, value: Any) -> dict[str, Any]:
    """A CPU plan whose node ``name`` has argument ``index`` replaced (appended past the end)."""
    nodes = []
    for node in doc["nodes"]:
        if node["name"] == name:
            args = list(node["args"])
            while len(args) <= index:
                args.append([1, 1] if len(args) < 7 else 1)  # conv2d: stride, padding, dilation, then groups
            args[index] = value
            node = {**node, "args": args}
        nodes.append(node)
    return _resign_plan({**doc, "nodes": nodes})


def _crafted(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Damage:
    return _rewrite(change)


HUGE = 10**19
# A loaded CPU plan is untrusted: every layer's arguments are checked before any kernel runs.
CPU_PLAN_VARIANTS: dict[str, Damage] = {
    "stride-zero": _crafted(lambda d: _conv(d, "conv2d", 3, [0, 0])),
    "stride-zero-channels-last": _crafted(lambda d: _conv(d, "conv2d_1", 3, [0, 0])),
    "stride-wrong-length": _crafted(lambda d: _conv(d, "conv2d", 3, [1, 1, 1])),
    "stride-huge": _crafted(lambda d: _conv(d, "conv2d", 3, [HUGE, HUGE])),
    "padding-float": _crafted(lambda d: _conv(d, "conv2d", 4, [1.5, 1.5])),
    "padding-string": _crafted(lambda d: _conv(d, "conv2d", 4, ["a", "b"])),
    "padding-negative": _crafted(lambda d: _conv(d, "conv2d", 4, [-5, -5])),
    "dilation-zero": _crafted(lambda d: _conv(d, "conv2d", 5, [0, 0])),
    "groups-zero": _crafted(lambda d: _conv(d, "conv2d", 6, 0)),
    "groups-huge": _crafted(lambda d: _conv(d, "conv2d", 6, HUGE)),
    "pool-kernel-zero": _crafted(lambda d: _conv(d, "max_pool2d", 1, [0, 0])),
    "pool-kernel-huge": _crafted(lambda d: _conv(d, "max_pool2d", 1, [HUGE, HUGE])),
    "flatten-dim-huge": _crafted(lambda d: _conv(d, "flatten", 1, HUGE)),
    "argument-object": _crafted(lambda d: _conv(d, "conv2d", 3, {"ref": "x"})),
    "input-shape-huge": _crafted(lambda d: _resign_plan({**d, "inputs": [{**d["inputs"][0], "shape": [HUGE, 1, 28, 28]}]})),
    "unknown-op": _crafted(lambda d: _resign_plan({**d, "nodes": [{**d["nodes"][0], "op": "aten::nope.default"}, *d["nodes"][1:]]})),
}  # fmt: skip


def _ort_layers_edited(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "layers": [{**doc["layers"][0], "tactic": "edited"}, *doc["layers"][1:]]}


SPECIFIC: dict[str, dict[str, Damage]] = {
    "cache": {
        "wrong-version": _rewrite(lambda d: {**d, "schema_version": 99}),
        "tampered": _rewrite(lambda d: {**d, "entries": d["entries"][:-1]}),
        "tampered-resigned": _rewrite(lambda d: _resign_cache({**d, "entries": d["entries"] + d["entries"][:1]})),
        "negative-time": _rewrite(lambda d: _resign_cache({**d, "entries": [{**d["entries"][0], "time_ms": -1.0}, *d["entries"][1:]]})),
    },
    "results": {
        "wrong-version": _rewrite(lambda d: {**d, "schema_version": 99}),
        "tampered": _rewrite(lambda d: {**d, "complete": not d["complete"]}),
        "summary-resigned": _rewrite(lambda d: _resign_results({**d, "cases": [
            {**c, "latency": {**c["latency"], "samples_ns": [s * 10 for s in c["latency"]["samples_ns"]]}}
            for c in d["cases"]]})),  # fmt: skip
        "zero-median-resigned": _rewrite(lambda d: _resign_results({**d, "cases": [
            {**c, "latency": {**c["latency"], "summary": {**c["latency"]["summary"], "median": 0}}}
            for c in d["cases"]]})),  # fmt: skip
        "machine-newline-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {**d["machine"], "id": "x\n"}})),
        "no-isa-flags-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {**d["machine"], "cpu": {}}})),
        "isa-flags-int-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {**d["machine"], "cpu": {"isa_flags": 5}}})),
        "gpu-string-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {**d["machine"], "gpu": "x"}})),
        "no-gpu-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {k: v for k, v in d["machine"].items() if k != "gpu"}})),
    },
    "plan": {
        "wrong-version": _rewrite(lambda d: {**d, "version": 99}),
        "tampered": _rewrite(lambda d: {**d, "mode": "bf16"}),
        **CPU_PLAN_VARIANTS,
    },
    "ort-plan": {
        "wrong-version": _rewrite(lambda d: {**d, "version": 99}),
        "mode-tampered": _rewrite(lambda d: {**d, "mode": "fp32"}),
        "layers-edited": _rewrite(_ort_layers_edited),
        "runtime-version-edited": _rewrite(lambda d: {**d, "onnxruntime_version": "0.0.1"}),
    },
    "ov-plan": {
        "wrong-version": _rewrite(lambda d: {**d, "version": 99}),
        "mode-tampered": _rewrite(lambda d: {**d, "mode": "bf16"}),
    },
    "explicit": {"bad-regex": _text('{"(": "fp16"}'), "bad-dtype": _text('{"x": "int8"}')},
}  # fmt: skip


# --- the matrix --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    """Where a kind of input comes from: a good file (or engine directory) and the file in it that is damaged."""

    good: str  # key of the ``good`` fixture
    inner: str | None = None  # the damaged file inside an engine directory


INPUTS: dict[str, Input] = {
    "cache": Input("cache"),
    "results": Input("results"),
    "explicit": Input("explicit"),
    "plan": Input("engine", "plan.json"),
    "weights": Input("engine", "weights.safetensors"),
    "ort-plan": Input("ort", "plan.json"),
    "ort-model": Input("ort", "model.onnx"),
    "ov-plan": Input("ov", "plan.json"),
    "ov-model": Input("ov", "model.onnx"),
    "trt-plan": Input("trt", "plan.json"),
    "project": Input("project"),
    "trt-log": Input("trt_log"),
    "trt-layers": Input("trt_layers"),
    "calibration": Input("calibration"),
    "model": Input("model"),
}

ENGINE = ["inspect", "{bad_dir}"], ["cache", "verify", "{good.cache}", "--engine", "{bad_dir}"]

# kind -> commands reading that kind of input ({bad} is the damaged input, {bad_dir} its engine
# directory, {good.x} valid inputs, {out} a fresh path in the work directory)
COMMANDS: dict[str, list[list[str]]] = {
    "cache": [
        ["cache", "show", "{bad}"],
        ["cache", "diff", "{bad}", "{good.cache}"],
        ["cache", "pin", "{bad}", "--layer", "conv2d=conv_nchw[fp32]"],
        ["cache", "pin", "{good_copy.cache}", "--from", "{bad}", "-o", "{out}"],
        ["cache", "merge", "{bad}", "{good.cache}", "-o", "{out}"],
        ["cache", "verify", "{bad}", "--engine", "{good.engine}"],
        ["build", "--model", "lenet", "--mode", "fp32", "--cache", "{bad}", "-o", "{out}"],
        ["rebuild", "--model", "lenet", "--mode", "fp32", "--cache", "{bad}", "--times", "2"],
    ],
    "results": [
        ["report", "{bad}", "--no-plots"],
        ["compare", "{bad}", "{good.results}"],
        ["compare", "{good.results}", "{bad}"],
        ["gate", "--baseline", "{bad}", "--current", "{good.results}"],
        ["gate", "--baseline", "{good.results}", "--current", "{bad}"],
        ["merge", "{bad}", "-o", "{out}"],
        ["baseline", "promote", "{bad}", "--root", "{out}", "--force"],
    ],
    "explicit": [["build", "--model", "lenet", "--mode", "explicit", "--explicit", "{bad}", "-o", "{out}"]],
    **{kind: list(ENGINE) for kind in ("plan", "weights", "ort-plan", "ort-model", "ov-plan", "ov-model", "trt-plan")},
}

DAMAGES: dict[str, dict[str, Damage]] = {
    **{kind: {**SPECIFIC.get(kind, {}), **GENERIC} for kind in ("cache", "results", "explicit", "plan", "ort-plan", "ov-plan")},
    # Without TensorRT only the plan's generic reader runs (the loader is fuzzed with a stand-in).
    "trt-plan": GENERIC,
    **{kind: PAYLOAD for kind in ("weights", "ort-model", "ov-model")},
}  # fmt: skip

# The project file: TOML, through the standard reader, then the schema and the bounds.
PROJECT: dict[str, tuple[Damage, tuple[str, ...]]] = {
    # damage -> (damage, the commands it is refused by: b(ench), B(uild), c(ompile), g(ate))
    "binary": (lambda p: p.write_bytes(b"\xff\xfe\x00 garbage"), ("b", "B", "c", "g")),
    "not-toml": (_text("= = =\n"), ("b", "B", "c", "g")),
    "deep": (_text("threads = " + "[" * 5000 + "]" * 5000 + "\n"), ("b", "B", "c", "g")),
    "huge-int": (_text("threads = " + "9" * 5000 + "\n"), ("b", "B", "c", "g")),
    "nan-threads": (_text("threads = nan\n"), ("b", "B", "c", "g")),
    "unknown-key": (_text("thread = 1\n"), ("b", "B", "c", "g")),
    "wrong-type": (_text('threads = "two"\n'), ("b", "B", "c", "g")),
    "huge-max-iters": (_text("[timing]\nmax_iters = 10000000000000000000\n"), ("b", "B", "c", "g")),
    "huge-duration": (_text("[timing]\nmin_duration_s = 1e9\n"), ("b", "B", "c", "g")),
    "inf-duration": (_text("[timing]\nmin_duration_s = inf\n"), ("b", "B", "c", "g")),
    "huge-warmup": (_text("[timing]\nwarmup_s = 1e300\n"), ("b", "B", "c", "g")),
    "huge-batch": (_text("batch_sizes = [100000]\n"), ("b", "B", "c", "g")),
    "nan-warmup": (_text("[timing]\nwarmup_s = nan\n"), ("b",)),
    "min-iters-above-max": (_text("[timing]\nmin_iters = 50\nmax_iters = 10\n"), ("b",)),
    "nan-threshold": (_text("[gate]\nlatency_threshold = nan\n"), ("g",)),
    "alpha-above-one": (_text("[gate]\nalpha = 2.0\n"), ("b", "B", "c", "g")),
    "directory": (_directory, ("b", "B", "c", "g")),
    "fifo": (_fifo, ("b", "B", "c", "g")),
}
PROJECT_COMMANDS: dict[str, list[str]] = {
    "b": ["bench", "--config", "{bad}", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}"],
    "B": ["build", "--config", "{bad}", "--model", "digits", "--mode", "fp32", "-o", "{out}"],
    "c": ["compile", "--config", "{bad}", "--model", "digits"],
    "g": ["gate", "--config", "{bad}", "--baseline", "{good.results}", "--current", "{good_copy.results}"],
}

_LAYERS_JSON = json.loads(TRT_LAYERS.read_text())
TRT_LAYER_DAMAGES: dict[str, Damage] = {
    "directory": _directory,
    "fifo": _fifo,
    "sparse-300MiB": _sparse(300 << 20),
    "garbage": lambda p: p.write_bytes(b"\x00\x01\xff neither JSON nor layer lines"),
    "deep": _text("{" + '"a":{' * 5000 + "}" * 5001),
    "huge-int": _text('{"Layers": [], "Bindings": [' + "9" * 5000 + "]}"),
    "nan-bindings": _text('{"Layers": [], "Bindings": NaN}'),
    "bindings-not-a-list": _text(json.dumps({**_LAYERS_JSON, "Bindings": "abc"})),
    "layers-not-a-list": _text('{"Layers": 5}'),
    "inputs-not-a-list": _text(json.dumps({**_LAYERS_JSON, "Layers": [{**_LAYERS_JSON["Layers"][0], "Inputs": 5}]})),
    "dimension-not-a-number": _text(json.dumps({**_LAYERS_JSON, "Layers": [{
        **_LAYERS_JSON["Layers"][0], "Inputs": [{**_LAYERS_JSON["Layers"][0]["Inputs"][0], "Dimensions": ["abc"]}]}]})),
    "oneline-dimension-not-a-number": _text(
        "[V] [TRT] Name: conv1, LayerType: Convolution, Inputs: [ { Name: x, Dimensions: [1,abc], "
        "Format/Datatype: Half }], Outputs: [ { Name: y, Dimensions: [1,2], Format/Datatype: Half }], TacticName: k\n"),
    "truncated": _truncated,
}  # fmt: skip
TRT_LOG_DAMAGES: dict[str, Damage] = {"directory": _directory, "fifo": _fifo, "sparse-300MiB": _sparse(300 << 20)}


def _safetensors(tensors: dict[str, Any]) -> Damage:
    def damage(path: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(path))

    return damage


def _calibration_damages() -> dict[str, Damage]:
    import torch

    return {
        "truncated": _truncated,
        "garbage": lambda p: p.write_bytes(b"\x00\x01\xff not safetensors"),
        "empty": lambda p: p.write_bytes(b""),
        "directory": _directory,
        "fifo": _fifo,
        "wrong-names": _safetensors({"x": torch.zeros(2, 8, 1, 28, 28)}),
        "wrong-shape": _safetensors({"input0": torch.zeros(2, 3, 3)}),
        "no-batches": _safetensors({"input0": torch.zeros(0, 8, 1, 28, 28)}),
        "huge-batch-count": _safetensors({"input0": torch.zeros(10**8, 0)}),
    }


MODEL_DAMAGES: dict[str, Damage] = {
    "syntax-error": _text("def make(:\n"),
    "raises-on-import": _text("raise RuntimeError('broken at import')\n"),
    "exits-on-import": _text("import sys\nsys.exit(3)\n"),
    "factory-raises": _text("def make():\n    raise ValueError('no model today')\n"),
    "factory-exits": _text("import sys\ndef make():\n    sys.exit(0)\n"),
    "no-factory": _text("def other():\n    pass\n"),
    "factory-returns-junk": _text("def make():\n    return 42\n"),
    # exports, then has no shape an engine can hold: named once, without torch's 60-line guard error
    "data-dependent-shape": _text(
        "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return x[x > 0]\n\n"
        "def make():\n    return M(), (torch.randn(2, 8),)\n"),
    "directory": _directory,
    "fifo": _fifo,
}
MODEL_NAMES = {"data-dependent-shape": "node index (aten.index.Tensor)"}  # the culprit is a node, not the file
MODEL_COMMANDS = [
    ["compile", "--model", "{bad}:make"],
    ["build", "--model", "{bad}:make", "--mode", "fp32", "-o", "{out}"],
]

# Flags whose values are refused before any work: (argv, what the error must name).
FLAGS: dict[str, tuple[list[str], str]] = {
    "option-deep": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=" + "[" * 5000 + "]" * 5000], "--option timing_runs"),
    "option-huge-int": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=" + "9" * 5000], "--option timing_runs"),
    "option-nan": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=NaN"], "--option timing_runs"),
    "option-expression": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=10**12"], "timing_runs"),
    "option-huge": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=1000000000000"], "timing_runs"),
    "option-float": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs=1e30"], "timing_runs"),
    "option-negative": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "warmup_runs=-1"], "warmup_runs"),
    "option-unknown": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "speed=11"], "speed"),
    "option-no-value": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--option", "timing_runs"], "--option"),
    "batch-sizes-huge": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--batch-sizes", "1,100000"], "--batch-sizes"),
    "batch-sizes-overflow": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--batch-sizes", "9" * 30], "--batch-sizes"),
    "batch-sizes-zero": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--batch-sizes", "0"], "--batch-sizes"),
    "threads-zero": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--threads", "0"], "--threads"),
    "spread-nan": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--spread-threshold", "nan"], "--spread-threshold"),
    "rebuild-times-huge": (["rebuild", "--model", "digits", "--mode", "fp32", "--times", "1000000"], "--times"),
    "rebuild-times-one": (["rebuild", "--model", "digits", "--mode", "fp32", "--times", "1"], "--times"),
    "compile-bad-regex": (["compile", "--model", "digits", "--exclude", "("], "("),
    "compile-data-max-nan": (["compile", "--model", "digits", "--data-max", "nan"], "--data-max"),
    "compile-unknown-op": (["compile", "--model", "digits", "--include-op", "aten.nope"], "aten.nope"),
    "compile-low-int8": (["compile", "--model", "digits", "--low", "int8"], "int8"),
    "gate-alpha": (["gate", "--baseline", "{good.results}", "--current", "{good_copy.results}", "--alpha", "2"], "--alpha"),
    "gate-threshold-nan": (["gate", "--baseline", "{good.results}", "--current", "{good_copy.results}", "--latency-threshold", "nan"], "--latency-threshold"),
    "gate-cosine-nan": (["gate", "--baseline", "{good.results}", "--current", "{good_copy.results}", "--cosine-drop", "nan"], "--cosine-drop"),
}  # fmt: skip


def _make_file(work: Path) -> None:
    (work / "file").write_text("x")


def _make_dir(work: Path) -> None:
    (work / "dir").mkdir()


def _dangling(work: Path) -> None:
    """A link into a directory that does not exist (following it would create work/nowhere)."""
    (work / "link").symlink_to(work / "nowhere" / "deeper" / "target")


def _plot_dir(work: Path) -> None:
    """A directory where ``report`` or ``bench`` would write the digits plot."""
    (work / "run-digits.png").mkdir()


# Outputs that cannot be written: (argv, what to create in the work directory, what the error must name).
OUTPUTS: dict[str, tuple[list[str], Callable[[Path], None], str]] = {
    "build-o-file": (["build", "--model", "digits", "--mode", "fp32", "-o", "{work}/file"], _make_file, "{work}/file"),
    "build-o-under-file": (["build", "--model", "digits", "--mode", "fp32", "-o", "{work}/file/sub"], _make_file, "{work}/file"),
    "build-o-dangling": (["build", "--model", "digits", "--mode", "fp32", "-o", "{work}/link"], _dangling, "{work}/link"),
    "build-cache-dir": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--cache", "{work}/dir"], _make_dir, "{work}/dir"),
    "build-cache-under-file": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--cache", "{work}/file/c.json"], _make_file, "{work}/file"),
    "build-cache-dangling": (["build", "--model", "digits", "--mode", "fp32", "-o", "{out}", "--cache", "{work}/link"], _dangling, "{work}/link"),
    "pin-o-dir": (["cache", "pin", "{good_copy.cache}", "--layer", "conv2d=conv_nchw[fp32]", "-o", "{work}/dir"], _make_dir, "{work}/dir"),
    "pin-dangling": (["cache", "pin", "{work}/link", "--layer", "conv2d=conv_nchw[fp32]"], _dangling, "{work}/link"),
    "cache-merge-o-under-file": (["cache", "merge", "{good.cache}", "{good.cache}", "-o", "{work}/file/m.json"], _make_file, "{work}/file"),
    "cache-merge-o-dangling": (["cache", "merge", "{good.cache}", "{good.cache}", "-o", "{work}/link"], _dangling, "{work}/link"),
    "merge-o-dir": (["merge", "{good.results}", "-o", "{work}/dir"], _make_dir, "{work}/dir"),
    "merge-o-under-file": (["merge", "{good.results}", "-o", "{work}/file/m.json"], _make_file, "{work}/file"),
    "merge-o-shard": (["merge", "{work}/run.json", "-o", "{work}/run.json"], lambda w: shutil.copy(GOOD_RUN[0], w / "run.json"), "{work}/run.json"),
    "promote-root-file": (["baseline", "promote", "{good.results}", "--root", "{work}/file", "--force"], _make_file, "{work}/file"),
    "promote-root-under-file": (["baseline", "promote", "{good.results}", "--root", "{work}/file/sub", "--force"], _make_file, "{work}/file"),
    "promote-machine-dir-is-file": (["baseline", "promote", "{good.results}", "--root", "{work}", "--force"], lambda w: (w / MACHINE).write_text("x"), f"{{work}}/{MACHINE}"),
    "report-summary-dir": (["report", "{good.results}", "--no-plots", "--summary-md", "{work}/dir"], _make_dir, "{work}/dir"),
    "report-plot-dir": (["report", "{work}/run.json"], lambda w: (shutil.copy(GOOD_RUN[0], w / "run.json"), _plot_dir(w)), "{work}/run-digits.png"),
    "gate-summary-dir": (["gate", "--baseline", "{good.results}", "--current", "{good_copy.results}", "--summary-md", "{work}/dir"], _make_dir, "{work}/dir"),
    "bench-o-under-file": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{work}/file/run.json"], _make_file, "{work}/file"),
    "bench-summary-dir": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--summary-md", "{work}/dir"], _make_dir, "{work}/dir"),
    "bench-cache-dir-file": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--cache-dir", "{work}/file"], _make_file, "{work}/file"),
    "bench-cache-dir-under-file": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--cache-dir", "{work}/file/sub"], _make_file, "{work}/file"),
    "bench-cache-dir-dangling": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{out}", "--cache-dir", "{work}/link"], _dangling, "{work}/link"),
    "bench-plot-dir": (["bench", "--models", "digits", "--modes", "fp32", "--no-progress", "-o", "{work}/run.json"], _plot_dir, "{work}/run-digits.png"),
    "inspect-save-cache-dir": (["inspect", "--trt-log", str(TRT_LOG), "--trt-layers", str(TRT_LAYERS), "--save-cache", "{work}/dir"], _make_dir, "{work}/dir"),
}  # fmt: skip
GOOD_RUN: list[Path] = []  # the good results file, for setups that copy it into the work directory


@dataclass(frozen=True)
class Case:
    """One bad input and one command that reads it."""

    family: str
    kind: str | None  # the kind of input damaged (INPUTS), or None: ``prepare`` sets the work directory up
    damage: str
    argv: tuple[str, ...]
    names: str = "{bad}"  # the error must contain this
    prepare: Callable[[Path], Any] | None = None

    @property
    def id(self) -> str:
        words = [a for a in self.argv[:2] if not a.startswith(("{", "-"))]
        reads = next((a for a in self.argv if "{bad" in a), "")
        flag = self.argv[self.argv.index(reads) - 1] if reads and self.argv.index(reads) > 0 else ""
        where = f"{flag}" if flag.startswith("-") else f"arg{self.argv.index(reads)}" if reads else ""
        extra = "save-cache" if "--save-cache" in self.argv else ""
        return "/".join(p for p in (self.family, self.kind, self.damage, " ".join(words), where, extra) if p)


def _damage_of(case: Case) -> Damage:
    if case.family == "project":
        return PROJECT[case.damage][0]
    if case.family == "trt-layers":
        return TRT_LAYER_DAMAGES[case.damage]
    if case.family == "trt-log":
        return TRT_LOG_DAMAGES[case.damage]
    if case.family == "calibration":
        return _calibration_damages()[case.damage]
    if case.family == "model":
        return MODEL_DAMAGES[case.damage]
    return DAMAGES[case.kind][case.damage]  # type: ignore[index]


def _cases() -> list[Case]:
    cases = [
        Case("reader", kind, damage, tuple(argv), "{bad_dir}" if INPUTS[kind].inner else "{bad}")
        for kind, commands in COMMANDS.items()
        for damage in DAMAGES[kind]
        for argv in commands
    ]
    cases += [
        Case("project", "project", damage, tuple(PROJECT_COMMANDS[c]))
        for damage, (_, commands) in PROJECT.items()
        for c in commands
    ]
    inspect = ["inspect", "--trt-log", "{good.trt_log}", "--trt-layers", "{bad}"]
    cases += [Case("trt-layers", "trt-layers", d, tuple(inspect)) for d in TRT_LAYER_DAMAGES]
    cases += [Case("trt-layers", "trt-layers", d, (*inspect, "--save-cache", "{out}")) for d in TRT_LAYER_DAMAGES]
    cases += [
        Case("trt-log", "trt-log", d, ("inspect", "--trt-log", "{bad}", "--trt-layers", "{good.trt_layers}"))
        for d in TRT_LOG_DAMAGES
    ]
    calibration = [
        ["compile", "--model", "lenet", "--calibration-data", "{bad}"],
        ["build", "--model", "lenet", "--mode", "autocast-fp16", "--calibration-data", "{bad}", "-o", "{out}"],
        ["bench", "--quick", "--no-progress", "--no-plots", "--models", "lenet", "--modes", "fp32,autocast-fp16",
         "--calibration-data", "{bad}", "-o", "{out}"],  # fmt: skip
    ]
    cases += [Case("calibration", "calibration", d, tuple(a)) for d in _calibration_damages() for a in calibration]
    cases += [
        Case("model", "model", d, tuple(a), MODEL_NAMES.get(d, "{bad}")) for d in MODEL_DAMAGES for a in MODEL_COMMANDS
    ]
    cases += [Case("flag", None, name, tuple(argv), names) for name, (argv, names) in FLAGS.items()]
    cases += [Case("output", None, name, tuple(argv), names, prep) for name, (argv, prep, names) in OUTPUTS.items()]
    return cases


CASES = _cases()


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """One valid input of every kind, made by the harness itself."""
    return good_inputs(tmp_path_factory)


_GOOD: dict[str, dict[str, Path]] = {}


def good_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One valid input of every kind, made by the harness itself once per test process (every
    module that damages them works on copies)."""
    if "made" not in _GOOD:
        _GOOD["made"] = _make_good(tmp_path_factory.mktemp("good"))
    return _GOOD["made"]


def _make_good(base: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from tests.test_fuzz_readers import saved_trt_engine

    os.environ["HARNESS_MACHINE_ID"] = MACHINE
    try:
        assert main(["build", "--model", "lenet", "--mode", "fp32", "--cache", str(base / "cache.json"),
                     "-o", str(base / "engine"), "--option", "timing_runs=1"]) == 0  # fmt: skip
        assert main(["bench", "--quick", "--no-progress", "--no-plots", "--models", "digits", "--modes", "fp32",
                     "--cache-dir", str(base / "caches"), "-o", str(base / "run.json")]) == 0  # fmt: skip
        assert main(["build", "--model", "digits", "--mode", "fp16", "--backend", "onnxruntime",
                     "-o", str(base / "ort")]) == 0  # fmt: skip
        assert main(["build", "--model", "digits", "--mode", "fp32", "--backend", "openvino", "--threads", "1",
                     "-o", str(base / "ov")]) == 0  # fmt: skip
    finally:
        del os.environ["HARNESS_MACHINE_ID"]
    saved_trt_engine(base / "trt")
    (base / "explicit.json").write_text('{"^conv2d$": "fp16"}')
    (base / "harness.toml").write_text('models = ["digits"]\nmodes = ["fp32"]\n')
    save_file({"input0": torch.randn(2, 8, 1, 28, 28)}, str(base / "calibration.safetensors"))
    (base / "model.py").write_text("def make():\n    raise NotImplementedError  # every case damages it\n")
    GOOD_RUN[:] = [base / "run.json"]
    return {"cache": base / "cache.json", "results": base / "run.json", "engine": base / "engine",
            "explicit": base / "explicit.json", "ort": base / "ort", "ov": base / "ov", "trt": base / "trt",
            "project": base / "harness.toml", "trt_log": TRT_LOG, "trt_layers": TRT_LAYERS,
            "calibration": base / "calibration.safetensors", "model": base / "model.py"}  # fmt: skip


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


FIGURES: Counter[str] = Counter()
FAILURES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def figures(request) -> Iterator[None]:
    """Count every case; print the figures (and write them to $HARNESS_BAD_INPUT_FIGURES) at the end."""
    FIGURES.clear()
    FAILURES.clear()
    yield
    line = (
        f"bad-input matrix: {FIGURES['tried']} inputs tried; {FIGURES['clean']} clean one-line errors with "
        f"exit 2; {FIGURES['traceback']} tracebacks; {FIGURES['native crash']} native crashes; "
        f"{FIGURES['hang']} hangs; {FIGURES['other exit']} other exit codes; {FIGURES['modified']} inputs modified; "
        f"{FIGURES['unnamed']} clean errors not naming the file or flag"
    )
    target = os.environ.get("HARNESS_BAD_INPUT_FIGURES")
    if target:
        Path(target).write_text(json.dumps({"figures": dict(FIGURES), "failures": FAILURES, "line": line}, indent=2))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


def _snapshot(*roots: Path) -> dict[str, Any]:
    """Every entry below ``roots``: a file by its digest (huge sparse ones by size), links by target."""
    out: dict[str, Any] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                p = Path(folder) / name
                info = p.lstat()
                if stat.S_ISLNK(info.st_mode):
                    out[str(p)] = ("link", os.readlink(p))
                elif stat.S_ISREG(info.st_mode):
                    small = info.st_size <= 64 << 20
                    out[str(p)] = ("file", info.st_size, hashlib.sha256(p.read_bytes()).hexdigest() if small else None)
                else:
                    out[str(p)] = (stat.S_IFMT(info.st_mode),)
    return out


def _fill(template: str, values: Mapping[str, Path]) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_clear_error_and_changes_nothing(tmp_path, good, worker, case: Case) -> None:
    work = tmp_path / "work"
    work.mkdir()
    bad = bad_dir = work
    if case.kind is not None:
        source = INPUTS[case.kind]
        copy = work / good[source.good].name
        if good[source.good].is_dir():
            shutil.copytree(good[source.good], copy)
        else:
            shutil.copy(good[source.good], copy)
        bad = copy / source.inner if source.inner else copy
        bad_dir = copy if source.inner else work
        _damage_of(case)(bad)
    if case.prepare is not None:
        case.prepare(work)
    copies = tmp_path / "copies"
    copies.mkdir()
    good_copy = {"good_copy.cache": copies / "cache.json", "good_copy.results": copies / "run.json"}
    shutil.copy(good["cache"], good_copy["good_copy.cache"])
    shutil.copy(good["results"], good_copy["good_copy.results"])
    values = {"bad_dir": bad_dir, "bad": bad, "work": work, "out": work / "out", **good_copy,
              **{f"good.{k}": v for k, v in good.items()}}  # fmt: skip
    argv = [_fill(a, values) for a in case.argv]
    roots = (work, copies, good["cache"].parent)  # the damaged input, the copies, every good input
    before = _snapshot(*roots)
    outcome = worker.run(argv, ENV, timeout=float(os.environ.get("HARNESS_BAD_INPUT_TIMEOUT", "300")))
    modified = _snapshot(*roots) != before
    named = _fill(case.names, values)
    _count(case, outcome, modified, named in outcome.err)
    assert outcome.signal is None, f"{argv}: {outcome.signal}"
    assert not outcome.traceback, outcome.err
    assert outcome.clean_error, (argv, outcome.code, outcome.err)
    assert named in outcome.err, (named, outcome.err)
    assert not modified, "an input, or its directory, changed (or an output was written)"


def _count(case: Case, outcome: Outcome, modified: bool, named: bool) -> None:
    FIGURES["tried"] += 1
    if outcome.clean_error and not named:
        FIGURES["unnamed"] += 1
    kind = (
        "hang" if outcome.signal and outcome.signal.startswith("hang")
        else "native crash" if outcome.signal
        else "traceback" if outcome.traceback
        else "clean" if outcome.clean_error
        else "other exit"
    )  # fmt: skip
    FIGURES[kind] += 1
    if modified:
        FIGURES["modified"] += 1
    if kind != "clean" or modified or not named:
        FAILURES.append(f"{case.id}: {kind}{' (modified)' if modified else ''}{'' if named else ' (unnamed)'}")
