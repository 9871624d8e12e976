"""Concurrent use loses nothing; an interrupted engine save leaves the previous engine whole.

Every race here is forced, never left to timing: each side is held right
after its read (or right before its final rename) until the other side has
got there too, or 2 s have passed. Without the protection under test both
sides read the old file before either writes, so an update is lost (or two
writers collide) every time; with it, the second side cannot read before the
first has written, the first waits out the 2 s alone, and the outcome never
depends on the timeout. Threads calling the real ``harness`` entry point
share the ``flock`` of separate processes (a lock belongs to an open file
description, not to a process); one test also races real processes. Tests
repeat ``ROUNDS`` times, and assert what the files hold, never how fast
anything ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness import models
from harness.bench import results as results_module
from harness.bench.results import ResultsWriter, load_results
from harness.build import build_engine, save_build
from harness.cache.timing_cache import CacheEntry, TimingCache
from harness.cli.main import main
from harness.engines.cpu import CpuBackend, CpuEngine
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from tests.test_bench_results import GIT, MACHINE, SETTINGS, real_case, steady_case
from tests.test_timing_cache import KEY_CONV, KEY_GEMM, PROV, make_cache

ROUNDS = 3
REPO = Path(__file__).resolve().parent.parent


class BothRead:
    """Hold each caller after the real call until a second caller has made it too (or 2 s have passed).

    Without a lock both callers read the old file, then both write: one
    update is lost, every time. With the lock the second reader cannot read
    before the first has written; the first waits out the 2 s alone, and the
    second reads the first's result. The outcome never depends on the timeout.
    """

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real, self.count, self.cond = real, 0, threading.Condition()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = self.real(*args, **kwargs)
        with self.cond:
            self.count += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.count >= 2, timeout=2.0)
        return value


def _in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once; every result, and no exception."""
    errors: list[BaseException] = []
    returned: list[Any] = [None] * len(calls)

    def guarded(i: int, fn: Callable[[], Any]) -> None:
        try:
            returned[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return returned


def _harness(argv: list[str]) -> Callable[[], int]:
    return lambda: main([str(a) for a in argv])


# --- timing caches ---------------------------------------------------------------------------


# Runs `harness` with one function held after its call until two processes have made it
# (a barrier of files in a directory), so two processes are forced into the same race.
_PAUSED = r"""
import importlib, os, sys, time
from pathlib import Path
barrier, target, *argv = sys.argv[1:]
module_name, _, qualname = target.partition(":")
owner = importlib.import_module(module_name)
*parents, name = qualname.split(".")
for part in parents:
    owner = getattr(owner, part)
real = getattr(owner, name)
def paused(*args, **kwargs):
    value = real(*args, **kwargs)
    Path(barrier, str(os.getpid())).touch()
    deadline = time.monotonic() + 2.0
    while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    return value
setattr(owner, name, paused)
from harness.cli.main import main
sys.exit(main(argv))
"""


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(2))
def test_two_processes_pinning_one_cache_keep_both_pins(tmp_path: Path, round_: int) -> None:
    """Two `harness cache pin` processes of one file, both held after reading it: both pins stay."""
    path, barrier = tmp_path / "cache.json", tmp_path / "barrier"
    barrier.mkdir()
    make_cache().save(path)
    target = "harness.cache.timing_cache:TimingCache.load"
    procs = [
        subprocess.Popen([sys.executable, "-c", _PAUSED, barrier, target, "cache", "pin", path, "--layer", layer],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for layer in ("conv1=sm80_conv_128x64", "fc=0x813e02ea68ef")
    ]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (out, err)
    cache = TimingCache.load(path)
    assert cache.query(KEY_CONV).tactic == "sm80_conv_128x64" and cache.query(KEY_CONV).pinned
    assert cache.query(KEY_GEMM).tactic_hash == "0x813e02ea68ef" and cache.query(KEY_GEMM).pinned


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_pins_that_read_before_either_writes_both_stay(tmp_path: Path, monkeypatch, round_: int) -> None:
    path = tmp_path / "cache.json"
    make_cache().save(path)
    monkeypatch.setattr(TimingCache, "load", BothRead(TimingCache.load))
    codes = _in_threads(
        _harness(["cache", "pin", path, "--layer", "conv1=sm80_conv_128x64"]),
        _harness(["cache", "pin", path, "--layer", "fc=0x813e02ea68ef"]),
    )
    monkeypatch.undo()
    assert codes == [0, 0]
    cache = TimingCache.load(path)
    assert cache.query(KEY_CONV).pinned and cache.query(KEY_GEMM).pinned


def _extra_cache(path: Path, key: str, layer: str) -> CacheEntry:
    """A cache of the same configuration holding one entry ``make_cache`` lacks."""
    entry = CacheEntry(key, layer, "t", "0x1", 1.0)
    TimingCache(PROV, [entry]).save(path)
    return entry


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_merge_into_its_input_and_a_pin_of_that_input_both_stay(tmp_path: Path, monkeypatch, round_: int) -> None:
    """`cache merge A B -o A` next to `cache pin A`: merge once read its inputs outside any lock, losing the pin."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_cache().save(a)
    extra = _extra_cache(b, "0x" + "7" * 32, "extra")
    monkeypatch.setattr(TimingCache, "load", BothRead(TimingCache.load))
    codes = _in_threads(
        _harness(["cache", "merge", a, b, "-o", a]),
        _harness(["cache", "pin", a, "--layer", "conv1=sm80_conv_128x64"]),
    )
    monkeypatch.undo()
    assert codes == [0, 0]
    cache = TimingCache.load(a)
    assert cache.query(KEY_CONV).pinned, "the pin was lost"
    assert cache.query(extra.key) is not None, "the merged entry was lost"


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_merges_into_one_shared_cache_keep_every_input(tmp_path: Path, monkeypatch, round_: int) -> None:
    """Two jobs folding their caches into one shared cache (`merge SHARED X -o SHARED`): both entries stay."""
    shared, x, y = tmp_path / "shared.json", tmp_path / "x.json", tmp_path / "y.json"
    make_cache().save(shared)
    from_x = _extra_cache(x, "0x" + "7" * 32, "from_x")
    from_y = _extra_cache(y, "0x" + "8" * 32, "from_y")
    monkeypatch.setattr(TimingCache, "load", BothRead(TimingCache.load))
    codes = _in_threads(
        _harness(["cache", "merge", shared, x, "-o", shared]),
        _harness(["cache", "merge", shared, y, "-o", shared]),
    )
    monkeypatch.undo()
    assert codes == [0, 0]
    merged = TimingCache.load(shared)
    assert merged.query(from_x.key) is not None and merged.query(from_y.key) is not None
    assert set(make_cache().query_keys()) <= set(merged.query_keys())


def test_a_merge_with_o_equal_to_an_input_merges_into_it(tmp_path: Path, capsys) -> None:
    """`cache merge A B -o A` is allowed (under the lock): A gains B's keys and keeps its own."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_cache().save(a)
    extra = _extra_cache(b, "0x" + "7" * 32, "extra")
    assert main(["cache", "merge", str(a), str(b), "-o", str(a)]) == 0
    merged = TimingCache.load(a)
    assert merged.query(extra.key) is not None and set(make_cache().query_keys()) <= set(merged.query_keys())
    # Results shards are never merged into one of themselves: the shard would be gone.
    shard = tmp_path / "run.json"
    writer = ResultsWriter.create(shard, settings=SETTINGS, machine=MACHINE, git=GIT)
    writer.finish()
    before = shard.read_bytes()
    capsys.readouterr()
    assert main(["merge", str(shard), "-o", str(shard)]) == 2
    assert f"-o {shard}: the merged file must not replace one of its shards" in capsys.readouterr().err
    assert shard.read_bytes() == before


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(2))
def test_two_builds_that_finish_before_either_writes_keep_every_entry(tmp_path: Path, monkeypatch, round_: int) -> None:
    import harness.build

    shared, backend = tmp_path / "shared.json", CpuBackend()
    monkeypatch.setattr(backend, "build", BothRead(backend.build))
    exporting = threading.Lock()  # torch.export is not thread-safe; only the writes race here
    real_compile = harness.build.compile_graph

    def compile_one_at_a_time(*args: Any) -> Any:
        with exporting:
            return real_compile(*args)

    monkeypatch.setattr(harness.build, "compile_graph", compile_one_at_a_time)
    specs = [models.load("digits"), models.load("lenet")]
    results: dict[str, Any] = {}

    def build(spec: Any) -> Callable[[], None]:
        config = BuildConfig("fp32", options={"timing_runs": 1})
        return lambda: results.__setitem__(spec.name, build_engine(spec, config, backend, shared))

    _in_threads(*(build(spec) for spec in specs))
    keys = set(TimingCache.load(shared).query_keys())
    for name, result in results.items():
        tuned = {layer.key for layer in result.engine.layers() if layer.key}
        assert tuned and tuned <= keys, f"{name}: {len(tuned - keys)} timed keys lost"


def test_a_symlinked_cache_keeps_its_link_and_a_dangling_one_is_refused(tmp_path: Path, capsys) -> None:
    real = tmp_path / "store" / "cache.json"
    real.parent.mkdir()
    make_cache().save(real)
    link = tmp_path / "cache.json"
    link.symlink_to(real)
    assert main(["cache", "pin", str(link), "--layer", "conv1=sm80_conv_128x64"]) == 0
    assert link.is_symlink() and TimingCache.load(real).query(KEY_CONV).pinned
    # A link to nowhere: following it would create its target's directories (anywhere on the machine).
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "deeper" / "cache.json")
    capsys.readouterr()
    assert main(["cache", "merge", str(real), str(real), "-o", str(dangling)]) == 2
    err = capsys.readouterr().err
    assert f"-o {dangling}: is a symbolic link to" in err and "which does not exist" in err
    assert not (tmp_path / "nowhere").exists() and dangling.is_symlink()


# --- results files and baselines -------------------------------------------------------------


def _run(path: Path, *cases: Any, finish: bool = True) -> Path:
    writer = ResultsWriter.create(path, settings=SETTINGS, machine=MACHINE, git=GIT)
    for case in cases:
        writer.add(case)
    if finish:
        writer.finish()
    return path


def test_two_resumed_writers_of_one_run_keep_each_others_cases(tmp_path: Path) -> None:
    """Two `bench --resume` of one file: each writer re-reads the file under its lock before writing."""
    path = _run(tmp_path / "run.json", real_case("mlp", "fp32"), finish=False)
    first = ResultsWriter.resume(path, settings=SETTINGS, machine=MACHINE, git=GIT)
    second = ResultsWriter.resume(path, settings=SETTINGS, machine=MACHINE, git=GIT)  # both read before either writes
    assert first.add(_failed("fp16")) is True
    assert second.add(_failed("bf16")) is True
    # The same case finished by both: the first one recorded is kept, the second is not added twice.
    assert second.add(_failed("int8")) is True
    assert first.add(_failed("int8", "a later error")) is False
    first.finish()
    doc = load_results(path)
    assert [c["mode"] for c in doc["cases"]] == ["fp32", "fp16", "bf16", "int8"]
    assert doc["cases"][3]["error"] == "error" and doc["complete"]
    with pytest.raises(HarnessError, match="was already recorded"):
        first.add(_failed("fp16"))  # a writer adding its own case twice is a bug


def _failed(mode: str, error: str = "error") -> dict[str, Any]:
    from harness.bench.results import CaseResult

    return CaseResult.failed("mlp", mode, "cpu", error).to_dict()


def test_a_resumed_writer_refuses_a_file_another_run_replaced(tmp_path: Path) -> None:
    path = _run(tmp_path / "run.json", real_case("mlp", "fp32"), finish=False)
    writer = ResultsWriter.resume(path, settings=SETTINGS, machine=MACHINE, git=GIT)
    path.unlink()
    ResultsWriter.create(path, settings={**SETTINGS, "models": ["other"]}, machine=MACHINE, git=GIT)  # another run
    with pytest.raises(HarnessError, match="was replaced by another run"):
        writer.add(_failed("fp16"))


class _AtReplace:
    """Hold each writer of ``name`` just before its final rename until the other is there too."""

    def __init__(self, name: str) -> None:
        self.name, self.barrier, self.real = name, BothRead(os.replace), os.replace

    def __call__(self, src: Any, dst: Any) -> None:
        if Path(dst).name == self.name:
            self.barrier(src, dst)
        else:
            self.real(src, dst)


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_promotes_at_once_leave_one_whole_baseline(tmp_path: Path, monkeypatch, capsys, round_: int) -> None:
    """Two `baseline promote` of different runs, both validated and both about to rename: one whole baseline."""
    runs = [_run(tmp_path / f"run{i}.json", steady_case("mlp", "fp32"), steady_case("mlp", mode)) for i, mode in enumerate(("a", "b"))]
    monkeypatch.setattr(results_module, "load_results", BothRead(results_module.load_results))
    monkeypatch.setattr(os, "replace", _AtReplace("baseline.json"))
    codes = _in_threads(*(_harness(["baseline", "promote", run, "--root", tmp_path / "root"]) for run in runs))
    monkeypatch.undo()
    assert codes == [0, 0], capsys.readouterr().err
    baseline = tmp_path / "root" / MACHINE["id"] / "baseline.json"
    def measured(doc: dict[str, Any]) -> dict[str, Any]:  # what promote copies (it adds where from, and when)
        return {k: v for k, v in doc.items() if k not in ("promoted", "digest")}

    promoted = load_results(baseline)
    assert measured(promoted) in [measured(load_results(run)) for run in runs]
    assert promoted["complete"] and promoted["promoted"]["from"] in {str(run) for run in runs}
    assert sorted(p.name for p in baseline.parent.iterdir()) == ["baseline.json"]  # no temporary file left


@pytest.mark.slow  # each round waits out a 2 s barrier that the lock keeps the other side from reaching
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_merges_into_one_results_file_leave_one_whole_file(tmp_path: Path, monkeypatch, capsys, round_: int) -> None:
    """Two `harness merge ... -o OUT` of different shards, both about to rename: OUT is one whole merge."""
    shards = [_run(tmp_path / f"s{i}.json", real_case("mlp", mode)) for i, mode in enumerate(("a", "b", "c", "d"))]
    out = tmp_path / "merged.json"
    monkeypatch.setattr(os, "replace", _AtReplace("merged.json"))
    codes = _in_threads(
        _harness(["merge", shards[0], shards[1], "-o", out]),
        _harness(["merge", shards[2], shards[3], "-o", out]),
    )
    monkeypatch.undo()
    assert codes == [0, 0], capsys.readouterr().err
    modes = [c["mode"] for c in load_results(out)["cases"]]
    assert modes in (["a", "b"], ["c", "d"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


# --- engines ---------------------------------------------------------------------------------


def test_an_interrupted_save_leaves_the_previous_engine_loadable(tmp_path: Path, monkeypatch) -> None:
    """Hit the window between an engine's two files deterministically: the second write fails."""
    spec = models.load("digits")
    backend = CpuBackend()
    first = build_engine(spec, BuildConfig("fp32", options={"timing_runs": 1}), backend)
    engine_dir = tmp_path / "engine"
    save_build(first, engine_dir)
    before = {p.name: p.read_bytes() for p in engine_dir.iterdir()}
    second = build_engine(spec, BuildConfig("bf16", options={"timing_runs": 1}), backend)

    import harness.engines.saved as saved

    real, written = saved.atomic_write_bytes, []

    def crash_after_first_file(path: Path, data: bytes) -> None:
        if written:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C right here
        written.append(path)
        real(path, data)

    monkeypatch.setattr(saved, "atomic_write_bytes", crash_after_first_file)
    with pytest.raises(KeyboardInterrupt):
        save_build(second, engine_dir)
    assert written, "the interruption must come after a file was written"
    assert {p.name: p.read_bytes() for p in engine_dir.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # no staging directory left
    loaded = CpuEngine.load(engine_dir)
    assert loaded.mode == "fp32" and loaded.fingerprint() == first.engine.fingerprint()
    monkeypatch.undo()
    save_build(second, engine_dir)  # and a whole save replaces it
    assert CpuEngine.load(engine_dir).mode == "bf16"


def test_the_onnxruntime_plan_fingerprint_covers_what_describes_the_engine(tmp_path: Path) -> None:
    """Once, a tampered ``mode`` in an ONNX Runtime plan was accepted and reported; the recorded
    ``layers`` and ``onnxruntime_version`` were outside the fingerprint too."""
    from harness.engines.onnxruntime.backend import OnnxRuntimeBackend

    spec = models.load("digits")
    result = build_engine(spec, BuildConfig("fp16"), OnnxRuntimeBackend())
    result.engine.save(tmp_path / "e")
    plan_path = tmp_path / "e" / "plan.json"
    original = json.loads(plan_path.read_text())
    edits: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
        "mode": (lambda p: p.__setitem__("mode", "fp32"), "fingerprint mismatch"),
        "layers": (lambda p: p["layers"][0].__setitem__("tactic", "edited"), "layer 0 .* of the recorded layers"),
        "version": (lambda p: p.__setitem__("onnxruntime_version", "0.0.1"), "built with onnxruntime 0.0.1"),
    }
    for change, message in edits.values():
        plan = json.loads(json.dumps(original))
        change(plan)
        plan_path.write_text(json.dumps(plan))
        with pytest.raises(HarnessError, match=message):
            OnnxRuntimeBackend().load(tmp_path / "e")
    plan_path.write_text(json.dumps(original))
    assert OnnxRuntimeBackend().load(tmp_path / "e").fingerprint() == original["fingerprint"]


def test_the_tensorrt_fingerprint_covers_mode_io_and_casts(tmp_path: Path) -> None:
    """Edited with its record digest recomputed, a TensorRT plan's mode, I/O or casts no longer match the fingerprint."""
    from harness.engines.tensorrt.backend import PLAN, EngineRecord, TensorRTEngine
    from tests.test_fuzz_readers import _gpu_double, saved_trt_engine

    directory = tmp_path / "engine"
    trt = saved_trt_engine(directory)
    plan_path = directory / "plan.json"
    original = json.loads(plan_path.read_text())
    record = EngineRecord.from_plan(PLAN.typed(original, "plan"), "plan")
    with _gpu_double():
        base = TensorRTEngine.load(directory, trt).fingerprint()
        edits = {
            "mode": {"mode": "fp32"},
            "inputs": {"inputs": [{**original["inputs"][0], "dtype": "fp16" if original["inputs"][0]["dtype"] != "fp16" else "fp32"}]},
            "casts": {"casts": original["casts"][1:]},
        }
        for field, change in edits.items():
            plan = {**original, **change}
            edited = EngineRecord.from_plan(PLAN.typed(plan, "plan"), "plan")
            plan["record_digest"] = edited.digest()  # what a forger recomputes
            plan_path.write_text(json.dumps(plan))
            with pytest.raises(HarnessError, match="fingerprint does not match"):
                TensorRTEngine.load(directory, trt)
            other = replace(record, **{field: getattr(edited, field)})
            assert other.interface() != record.interface()
    assert original["fingerprint"] == base and original["casts"], "the sample engine has casts to edit"


@pytest.mark.slow  # a bench in a process of its own
def test_a_second_bench_on_a_held_cache_directory_waits_and_then_runs(tmp_path: Path) -> None:
    """A bench holds its cache directory for the whole run: another process's bench on
    the same directory says it is waiting and writes nothing until the holder lets go;
    then it runs, and its own cache writes (under the lock it holds) do not deadlock."""
    from harness.fileio import locked_directory

    caches, out = tmp_path / "caches", tmp_path / "run.json"
    argv = [sys.executable, "-m", "harness", "bench", "--models", "lenet", "--modes", "fp32", "--quick",
            "--no-plots", "--no-progress", "--threads", "1", "--cache-dir", str(caches), "-o", str(out)]
    with locked_directory(caches):  # this process is the other bench
        proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:  # blocks until the bench says it waits (or ends)
                seen.append(line)
                if line.startswith("waiting:"):
                    break
            assert seen and seen[-1].startswith("waiting:") and str(caches) in seen[-1], "".join(seen)
            assert proc.poll() is None and not out.exists()
        except BaseException:
            proc.kill()
            raise
    rest = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, rest
    assert load_results(out)["cases"][0]["status"] == "ok"
    assert any(caches.iterdir())
