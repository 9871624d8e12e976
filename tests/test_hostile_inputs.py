"""The case table of hostile inputs: what an attacker tries on what the harness reads since the bad-input matrix.

Numbers out of range, NaN and infinity, wrong types, values given twice,
names of megabytes and of more than a filesystem takes, typos of flags and
commands; in the project file (``[timing]``, ``[autocast]``, ``[gate]``,
``batch_sizes``, ``models``), the flags (``--threads``, ``--batch-sizes``,
``--option``), explicit precision files, results files and timing caches
(re-signed, so only the checks of their numbers stand in the way), and
ONNX Runtime, OpenVINO and CPU engine directories.

Each case runs the harness's command line in a fresh work directory, in a
worker process of the bad-input matrix (tests/harness_worker.py: one
interpreter per test process, each command with its own stdout, stderr and
working directory, a new worker after one that crashed), and requires: exit code 2, one ``error:`` line (argparse's usage
before it for a flag) naming the culprit as the user wrote it (the file and
its key, or the flag), no echoed value longer than a line (:data:`MAX_LINE`),
no traceback, every file of the work directory byte-identical after and
nothing new in it. What only a process of its own shows (Ctrl-C while a
native module loads, a project file found from the working directory) runs
``python -m harness`` as a real process.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.engines.registry import BACKEND_NAMES
from harness.engines.saved import ENGINE_BACKENDS
from harness.fileio import digest
from tests.harness_worker import Worker
from tests.test_bad_inputs import ENV, _resign_cache, _resign_results, _snapshot, good, worker  # noqa: F401

pytestmark = pytest.mark.slow  # every hostile input is a whole command, some of them a build or a bench

REPO = Path(__file__).resolve().parent.parent
# An error line holding an echoed value in full is longer than this (the longest value
# echoed cut short, a path and a list of valid values fit).
MAX_LINE = 1500
HUGE = "x" * (20 << 20)  # a 20 MB name

Prepare = Callable[[Path, dict[str, Path]], None]


def _text(name: str, text: str) -> Prepare:
    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        (work / name).write_text(text)

    return prepare


def _project(text: str) -> Prepare:
    return _text("h.toml", text)


def _json(name: str, source: str, change: Callable[[Any], Any]) -> Prepare:
    """``inputs[source]`` changed by ``change`` (which re-signs it when it must), written as ``name``."""

    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        (work / name).write_text(json.dumps(change(json.loads(inputs[source].read_text()))))

    return prepare


def _raw(name: str, source: str, change: Callable[[str], str]) -> Prepare:
    """``inputs[source]``'s text changed by ``change`` (keys given twice: no JSON writer does that)."""

    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        (work / name).write_text(change(inputs[source].read_text()))

    return prepare


def _gate_project(text: str) -> Prepare:
    """A project file for ``gate --config``, which refuses it as every command does, in a fraction of the time."""
    return _both(_project(text), _copies("results"), _raw("current.json", "results", str))


def _copies(*names: str) -> Prepare:
    """Good inputs copied into the work directory under their own names."""

    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        for name in names:
            source = inputs[name]
            if source.is_dir():
                shutil.copytree(source, work / source.name)
            else:
                shutil.copy(source, work / source.name)

    return prepare


def _both(*steps: Prepare) -> Prepare:
    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        for step in steps:
            step(work, inputs)

    return prepare


def _case_edit(field: str, value: Any, sub: str | None = None) -> Callable[[Any], Any]:
    """Every case of a results document with ``field`` (of its ``sub`` object) set to ``value``, re-signed."""

    def change(doc: dict[str, Any]) -> dict[str, Any]:
        cases = []
        for case in doc["cases"]:
            if sub is None:
                cases.append({**case, field: value})
            else:
                cases.append({**case, sub: {**case[sub], field: value}})
        return _resign_results({**doc, "cases": cases})

    return change


def _entry_time(value: float) -> Callable[[Any], Any]:
    return lambda d: _resign_cache({**d, "entries": [{**d["entries"][0], "time_ms": value}, *d["entries"][1:]]})


def _forged_engine(kind: str, plan_change: Callable[[dict[str, Any]], dict[str, Any]], model: bytes | None = None) -> Prepare:
    """A copy of the good ``kind`` engine with its plan changed (and its model replaced, its digest recomputed)."""

    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        engine = work / "engine"
        shutil.copytree(inputs[kind], engine)
        plan = json.loads((engine / "plan.json").read_text())
        if model is not None:
            (engine / plan["model_file"]).write_bytes(model)
            plan["model_digest"] = digest(model)
        (engine / "plan.json").write_text(json.dumps(plan_change(plan)))

    return prepare


def _external_weights(kind: str) -> Prepare:
    """A copy of the good ``kind`` engine whose model keeps its first weight in a file outside the engine
    (``/etc/passwd``), its digest recomputed: the model's loader refuses it before a runtime would read it."""

    def prepare(work: Path, inputs: dict[str, Path]) -> None:
        import onnx

        model = onnx.load_from_string((inputs[kind] / "model.onnx").read_bytes())
        weight = model.graph.initializer[0]
        weight.ClearField("raw_data")
        weight.data_location = onnx.TensorProto.EXTERNAL
        weight.external_data.add(key="location", value="../../../../../../etc/passwd")
        _forged_engine(kind, dict, model.SerializeToString())(work, inputs)

    return prepare


def _garbage_weights(work: Path, inputs: dict[str, Path]) -> None:
    """A copy of the good CPU engine whose safetensors file is not one."""
    shutil.copytree(inputs["engine"], work / "engine")
    (work / "engine" / "weights.safetensors").write_bytes(b"\xff" * 64)


def _session_threads(plan: dict[str, Any]) -> dict[str, Any]:
    return {**plan, "session": {**plan["session"], "intra_op_num_threads": 10**9}}


BENCH = ("bench", "--no-progress", "--no-plots", "-o", "{work}/out/run.json")
DIGITS = ("--models", "digits", "--modes", "fp32")
BUILD = ("build", "--model", "digits", "--mode", "fp32", "-o", "{work}/engine-out")
GATE = ("gate", "--baseline", "{work}/run.json", "--current", "{work}/current.json")
LONG = "n" * 300  # a file name longer than any filesystem takes (255)


@dataclass(frozen=True)
class Case:
    """One hostile input: what to put in the work directory, the command, what its error must name."""

    name: str
    argv: tuple[str, ...]
    names: tuple[str, ...]  # each in the error line ({work}: the work directory)
    prepare: Prepare | None = None
    not_named: tuple[str, ...] = ()  # none of these in the error (a flag the user never gave)


# A model whose kernel fails while torch.export traces it: torch logged the kernel's traceback before the error.
SHAPE_MISMATCH = """import torch

class Net(torch.nn.Module):
    def forward(self, x):
        return x @ torch.ones(3, 3)

def make():
    return Net(), (torch.randn(2, 8),)
"""
PROJECT = "project file {work}/h.toml"
PROJECT_GATE = ("gate", "--config", "{work}/h.toml", *GATE[1:])
CASES = [
    # --- the project file: every number finite, in range, of its type, given once ---
    Case("timing-warmup-nan", ("bench", "--config", "{work}/h.toml", *BENCH[1:], *DIGITS), (PROJECT, "[timing] warmup_s"), _project("[timing]\nwarmup_s = nan\n")),
    Case("timing-warmup-nan-quick", ("bench", "--quick", "--config", "{work}/h.toml", *BENCH[1:], *DIGITS), (PROJECT, "[timing] warmup_s"), _project("[timing]\nwarmup_s = nan\n")),
    Case("timing-min-duration-nan-quick", ("bench", "--quick", "--config", "{work}/h.toml", *BENCH[1:], *DIGITS), (PROJECT, "[timing] min_duration_s"), _project("[timing]\nmin_duration_s = nan\n")),
    Case("timing-spread-inf", ("bench", "--config", "{work}/h.toml", *BENCH[1:], *DIGITS), (PROJECT, "[timing] spread_threshold"), _project("[timing]\nspread_threshold = inf\n")),
    Case("timing-spread-long-string", PROJECT_GATE, (PROJECT, "[timing] spread_threshold"), _gate_project(f'[timing]\nspread_threshold = "{"9" * 5000}%"\n')),
    Case("timing-max-iters-float", PROJECT_GATE, (PROJECT, "[timing] max_iters"), _gate_project("[timing]\nmax_iters = 1.5\n")),
    Case("timing-min-iters-bool", PROJECT_GATE, (PROJECT, "[timing] min_iters"), _gate_project("[timing]\nmin_iters = true\n")),
    Case("batch-sizes-twice", ("bench", "--config", "{work}/h.toml", *BENCH[1:], *DIGITS), (PROJECT, "batch_sizes", "2 is given twice"), _project("batch_sizes = [2, 2]\n")),
    Case("batch-sizes-float", PROJECT_GATE, (PROJECT, "batch_sizes[0]"), _gate_project("batch_sizes = [1.5]\n")),
    Case("models-twice", PROJECT_GATE, (PROJECT, "models"), _gate_project('models = ["digits", "digits"]\n')),
    Case("modes-twice", PROJECT_GATE, (PROJECT, "modes"), _gate_project('modes = ["fp32", "fp32"]\n')),
    Case("model-name-20MB", ("bench", "--config", "{work}/h.toml", *BENCH[1:], "--modes", "fp32"), (PROJECT, "models[0]"), _project(f'models = ["{HUGE}"]\n')),
    Case("threads-bool", PROJECT_GATE, (PROJECT, "threads"), _gate_project("threads = true\n")),
    Case("cache-dir-long", PROJECT_GATE, (PROJECT, "cache_dir"), _gate_project(f'cache_dir = "{"d" * 5000}"\n')),
    Case("autocast-data-max-nan", ("compile", "--config", "{work}/h.toml", "--model", "digits"), (PROJECT, "[autocast] data_max"), _project("[autocast]\ndata_max = nan\n"), not_named=("--data-max",)),
    Case("autocast-init-max-inf", ("compile", "--config", "{work}/h.toml", "--model", "digits"), (PROJECT, "[autocast] init_max"), _project("[autocast]\ninit_max = inf\n"), not_named=("--init-max",)),
    Case("model-table-data-max-nan", ("build", "--config", "{work}/h.toml", *BUILD[1:]), (PROJECT, "[model.digits.autocast] data_max"), _project("[model.digits]\nautocast = { data_max = nan }\n"), not_named=("--data-max",)),
    Case("gate-cosine-drop-nan", PROJECT_GATE, (PROJECT, "[gate] cosine_drop"), _gate_project("[gate]\ncosine_drop = nan\n")),
    Case("gate-alpha-inf", PROJECT_GATE, (PROJECT, "[gate] alpha"), _gate_project("[gate]\nalpha = -inf\n")),
    Case("timing-warmup-huge", PROJECT_GATE, (PROJECT, "[timing] warmup_s"), _gate_project("[timing]\nwarmup_s = 1e9\n")),
    Case("backend-path", PROJECT_GATE, (PROJECT, "backend"), _gate_project('backend = "../../etc/passwd"\n')),
    Case("peers-twice", PROJECT_GATE, (PROJECT, "peers"), _gate_project('peers = ["eager", "eager"]\n')),
    Case("gate-key-unknown", PROJECT_GATE, (PROJECT, "invalid at gate", "latency_treshold", "valid keys: latency_threshold"), _gate_project("[gate]\nlatency_treshold = 0.05\n")),
    # --- flags: a typo or a prefix is named, with the flag it comes closest to ---
    Case("flag-prefix-of-another", (*BENCH, *DIGITS, "--spread-thres", "5%"), ("--spread-thres", "did you mean --spread-threshold")),
    Case("flag-typo", ("build", "--modle", "digits", "--mode", "fp32", "-o", "{work}/engine-out"), ("--modle", "did you mean --model")),
    Case("command-typo", ("bnech", "--models", "digits"), ("'bnech'", "did you mean 'bench'")),
    Case("choice-typo", (*BUILD, "--backend", "onnxrutime"), ("--backend", "did you mean 'onnxruntime'")),
    Case("batch-sizes-twice-flag", (*BENCH, *DIGITS, "--batch-sizes", "2,2"), ("--batch-sizes",)),
    Case("threads-zero", (*BENCH, *DIGITS, "--threads", "0"), ("--threads", "valid: 1..")),
    Case("backend-path-flag", (*BUILD, "--backend", "../../etc/passwd"), ("--backend", "invalid choice")),
    Case("threads-20-digits", (*BENCH, *DIGITS, "--threads", "9" * 20), ("--threads",)),
    Case("threads-100k-chars", (*BENCH, *DIGITS, "--threads", "9" * 100_000), ("--threads",)),
    Case("spread-threshold-overflow", (*BENCH, *DIGITS, "--spread-threshold", "1e400"), ("--spread-threshold",)),
    Case("data-max-overflow", ("compile", "--model", "digits", "--data-max", "1e400"), ("--data-max",)),
    Case("option-overflow", (*BUILD, "--option", "timing_runs=1e400"), ("--option timing_runs",)),
    Case("models-100k-name", (*BENCH, "--models", "m" * 100_000, "--modes", "fp32"), ("unknown model",)),
    Case("model-file-name-too-long", ("compile", "--model", f"{LONG}.py:make"), ("model file", "File name too long")),
    Case("model-fails-in-export", ("compile", "--model", "{work}/net.py:make"), ("model Net failed to export", "same reduction dim"), _text("net.py", SHAPE_MISMATCH)),
    # --- explicit precision files: a key given twice is refused, not the last one taken ---
    Case("explicit-key-twice", (*BUILD[:4], "explicit", "--explicit", "{work}/explicit.json", *BUILD[5:]), ("explicit precision file {work}/explicit.json", "'linear' appears twice"), _text("explicit.json", '{"linear": "fp16", "linear": "fp32"}')),
    Case("explicit-regex-100k", (*BUILD[:4], "explicit", "--explicit", "{work}/explicit.json", *BUILD[5:]), ("explicit precision file {work}/explicit.json",), _text("explicit.json", json.dumps({"(" + "a" * 100_000: "fp16"}))),
    # --- results files, re-signed: their numbers are bounded, of their type, and keys unique ---
    Case("results-cosine-2", GATE, ("results file {work}/current.json", "accuracy/cosine"), _both(_copies("results"), _json("current.json", "results", _case_edit("cosine", 2.0, "accuracy")))),
    Case("results-task-accuracy-2", GATE, ("results file {work}/current.json", "task_accuracy/value"), _both(_copies("results"), _json("current.json", "results", _case_edit("value", 2.0, "task_accuracy")))),
    Case("results-top1-1.5", GATE, ("results file {work}/current.json", "top1_agreement"), _both(_copies("results"), _json("current.json", "results", _case_edit("top1_agreement", 1.5, "accuracy")))),
    Case("results-error-negative", GATE, ("results file {work}/current.json", "max_abs_error"), _both(_copies("results"), _json("current.json", "results", _case_edit("max_abs_error", -1.0, "accuracy")))),
    Case("results-settings-threads-string", GATE, ("results file {work}/current.json", "settings/threads"), _both(_copies("results"), _json("current.json", "results", lambda d: _resign_results({**d, "settings": {**d["settings"], "threads": "1"}})))),
    Case("results-case-threads-huge", GATE, ("results file {work}/current.json", "threads"), _both(_copies("results"), _json("current.json", "results", _case_edit("threads", 10**6)))),
    Case("results-batch-huge", ("report", "{work}/current.json", "--no-plots"), ("results file {work}/current.json", "latency/batch_size"), _json("current.json", "results", _case_edit("batch_size", 10**9, "latency"))),
    Case("results-key-twice", ("merge", "{work}/current.json", "-o", "{work}/out/merged.json"), ("results file {work}/current.json", "'complete' appears twice"), _raw("current.json", "results", lambda t: t.replace('"complete":', '"complete": false, "complete":', 1))),
    # --- timing caches, re-signed ---
    Case("cache-time-huge", ("cache", "show", "{work}/c.json"), ("timing cache {work}/c.json", "time_ms"), _json("c.json", "cache", _entry_time(1e308))),
    Case("cache-key-twice", ("cache", "merge", "{work}/c.json", "{work}/c.json", "-o", "{work}/out/m.json"), ("timing cache {work}/c.json", "appears twice"), _raw("c.json", "cache", lambda t: t.replace('"digest":', '"digest": "x", "digest":', 1))),
    # --- engine directories: every file through its one guarded loader ---
    Case("ort-model-garbage-resigned", ("inspect", "{work}/engine"), ("{work}/engine", "not an ONNX model"), _forged_engine("ort", dict, b"\x08\x07garbage")),
    Case("ov-model-garbage-resigned", ("inspect", "{work}/engine"), ("{work}/engine", "not an ONNX model"), _forged_engine("ov", dict, b"\x08\x07garbage")),
    Case("ort-threads-huge", ("inspect", "{work}/engine"), ("{work}/engine/plan.json", "intra_op_num_threads"), _forged_engine("ort", _session_threads)),
    Case("plan-backend-path", ("inspect", "{work}/engine"), ("{work}/engine/plan.json", '"backend"'), _forged_engine("ort", lambda p: {**p, "backend": "../../etc/passwd"})),
    Case("plan-backend-path-verify", ("cache", "verify", "{work}/cache.json", "--engine", "{work}/engine"), ("{work}/engine/plan.json", '"backend"'), _both(_copies("cache"), _forged_engine("engine", lambda p: {**p, "backend": "../../etc/passwd"}))),
    Case("ort-model-external-data-resigned", ("inspect", "{work}/engine"), ("{work}/engine", "external files"), _external_weights("ort")),
    Case("ov-model-external-data-resigned", ("inspect", "{work}/engine"), ("{work}/engine", "external files"), _external_weights("ov")),
    Case("cpu-weights-garbage", ("inspect", "{work}/engine"), ("engine weights {work}/engine/weights.safetensors",), _garbage_weights),
    Case("engine-path-too-long", ("inspect", f"{{work}}/{LONG}"), (LONG[:50],)),
    # --- outputs whose names no filesystem takes ---
    Case("output-name-too-long", ("cache", "merge", "{work}/cache.json", "{work}/cache.json", "-o", f"{{work}}/{LONG}.json"), (LONG[:50],), _copies("cache")),
    Case("engine-output-name-too-long", ("build", "--model", "digits", "--mode", "fp32", "-o", f"{{work}}/{LONG}"), ("engine path", LONG[:50])),
    Case("cache-dir-name-too-long", (*BENCH, *DIGITS, "--cache-dir", f"{{work}}/{LONG}"), ("--cache-dir", LONG[:50])),
    Case("summary-name-too-long", ("report", "{work}/run.json", "--no-plots", "--summary-md", f"{{work}}/{LONG}.md"), ("--summary-md", LONG[:50]), _copies("results")),
    Case("config-name-too-long", ("gate", "--config", f"{{work}}/{LONG}.toml", *GATE[1:]), (LONG[:50],), _both(_copies("results"), _raw("current.json", "results", str))),
]  # fmt: skip


def _fill(text: str, work: Path) -> str:
    return text.replace("{work}", str(work))


def error_line(code: int, err: str, allowed: re.Pattern[str] | None = None) -> str:
    """The one error line of a clean failure (exit 2, no traceback), or an AssertionError saying what else it was.

    The error is ``error: ...`` alone on stderr, or argparse's usage followed
    by ``harness <command>: error: ...``; either way one line says ``error:``.
    Lines ``allowed`` matches are let through before it (the warnings of a
    bench whose cases ran: a busy machine's load average is no error).
    """
    assert "Traceback" not in err, err[-3000:]
    assert code == 2, (code, err[-3000:])
    lines = [line for line in err.splitlines() if allowed is None or not allowed.match(line)]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, err[-3000:]
    if err.startswith("usage: harness"):
        assert lines[-1] == errors[0] and errors[0].startswith("harness"), err[-3000:]
    else:
        assert lines == errors and errors[0].startswith("error: "), err[-3000:]
    return errors[0]


def run_harness(
    argv: list[str], cwd: Path, preexec: Callable[[], None] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m harness argv`` as a user runs it, in ``cwd``, on the bad-input machine id
    (``preexec``: run in the child before it starts, to set its limits)."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_hostile_input_is_one_error_naming_it_and_changes_nothing(
    tmp_path, good, worker: Worker, case: Case  # noqa: F811
) -> None:
    """Exit 2, one error line naming the culprit (and not a flag never given), echoes cut short,
    no traceback, the work directory as it was."""
    work = tmp_path / "work"
    work.mkdir()
    if case.prepare is not None:
        case.prepare(work, good)
    before = _snapshot(work)
    outcome = worker.run([_fill(a, work) for a in case.argv], ENV, cwd=work)
    assert outcome.signal is None, f"the command died: {outcome.signal}"
    assert outcome.code is not None
    line = error_line(outcome.code, outcome.err)
    for name in case.names:
        assert _fill(name, work) in line, (name, line[:MAX_LINE])
    for name in case.not_named:
        assert name not in line, line[:MAX_LINE]
    assert len(line) <= MAX_LINE, f"an echoed value was not cut short: {len(line)} characters"
    assert _snapshot(work) == before, "an input changed, or something was written"


def test_a_command_of_the_matrix_runs_in_its_work_directory(tmp_path, good, worker: Worker) -> None:  # noqa: F811
    """The matrix's "changes nothing" watches the work directory: a relative path is read there,
    and what a command writes by default lands there."""
    shutil.copy(good["cache"], tmp_path / "c.json")
    shown = worker.run(["cache", "show", "c.json"], ENV, cwd=tmp_path)
    assert (shown.code, shown.signal) == (0, None), shown.err[-2000:]
    merged = worker.run(["cache", "merge", "c.json", "c.json", "-o", "m.json"], ENV, cwd=tmp_path)
    assert (merged.code, merged.signal) == (0, None), merged.err[-2000:]
    assert (tmp_path / "m.json").is_file()


# A KeyboardInterrupt raised inside PyRun_String, as one reaches a pybind11 module (torch, onnx,
# onnxruntime) that runs code while it is imported: CPython then marks it unhandled, whoever catches it.
CTRL_C_IN_NATIVE_CODE = """import ctypes

run = ctypes.pythonapi.PyRun_String
run.restype = ctypes.py_object
run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
run(b"raise KeyboardInterrupt", 257, {}, {})
"""


def test_a_ctrl_c_while_a_native_module_loads_exits_130_not_by_the_signal(tmp_path) -> None:
    """Ctrl-C during start-up is "interrupted" and exit code 130, like Ctrl-C anywhere else: not the
    death by SIGINT (-2) CPython deals a process whose interrupt passed through native code."""
    (tmp_path / "net.py").write_text(CTRL_C_IN_NATIVE_CODE)
    result = run_harness(["compile", "--model", f"{tmp_path}/net.py:make"], tmp_path)
    assert (result.returncode, result.stderr) == (130, "interrupted\n")


# A Ctrl-C a library swallows (torch imports numpy in C++ and drops what that import raised): numpy is
# left half-loaded, and the next import of it fails far from the Ctrl-C (a RecursionError, a traceback).
CTRL_C_SWALLOWED = """import signal

try:
    signal.raise_signal(signal.SIGINT)
except BaseException:
    pass
raise RecursionError("maximum recursion depth exceeded")
"""


def test_a_ctrl_c_swallowed_by_a_library_is_still_an_interrupt(tmp_path) -> None:
    """The failure a swallowed Ctrl-C leads to is reported as the interrupt: exit 130, no traceback and no
    error blaming the model (which said "model file net.py failed to import: RecursionError")."""
    (tmp_path / "net.py").write_text(CTRL_C_SWALLOWED)
    # As from a terminal: a shell's background job (CI's `cmd &`, nohup) starts with Ctrl-C ignored,
    # and a process that ignores it is not interrupted by it at all.
    terminal = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    result = run_harness(["compile", "--model", f"{tmp_path}/net.py:make"], tmp_path, preexec=terminal)
    assert (result.returncode, result.stderr) == (130, "interrupted\n")


def test_the_backends_that_save_engines_are_the_registrys() -> None:
    """A plan's backend is checked against the names saved.py holds (it cannot import the registry)."""
    assert set(ENGINE_BACKENDS) == set(BACKEND_NAMES) - {"auto"}


@pytest.mark.parametrize("broken", ["[tool.black\nline-length = 100\n", "[tool.harness\nthreads = 2\n"])
def test_a_broken_pyproject_in_the_working_directory_does_not_stop_a_command_given_config(
    tmp_path, good, broken: str  # noqa: F811
) -> None:
    """``--config`` names the project file: a ``pyproject.toml`` beside it that does not parse (another
    tool's, or even a broken ``[tool.harness]``) is not read, and the command runs; without ``--config``
    only one that could configure the harness stops it, named."""
    shutil.copy(good["results"], tmp_path / "run.json")
    shutil.copy(good["results"], tmp_path / "current.json")
    (tmp_path / "pyproject.toml").write_text(broken)
    (tmp_path / "h.toml").write_text("[gate]\nallow_missing = true\n")
    # The run is a real measurement, gated against itself: on a busy machine its cases may be
    # unstable, which the gate refuses to judge; this test is about the project files, not that.
    gate = ["gate", "--baseline", f"{tmp_path}/run.json", "--current", f"{tmp_path}/current.json", "--min-judged", "0"]
    given = run_harness([gate[0], "--config", f"{tmp_path}/h.toml", *gate[1:]], tmp_path)
    assert (given.returncode, given.stderr) == (0, ""), (given.stdout[-2000:], given.stderr[-2000:])
    found = run_harness(gate, tmp_path)
    if "harness" in broken:
        line = error_line(found.returncode, found.stderr)
        assert f"project file {tmp_path}/pyproject.toml: not valid TOML" in line, line
    else:
        assert (found.returncode, found.stderr) == (0, ""), (found.stdout[-2000:], found.stderr[-2000:])
