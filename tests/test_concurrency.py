"""Concurrent use loses nothing; an interrupted engine save leaves the previous engine whole.

Two kinds of concurrency test. The deterministic ones force the dangerous
interleaving (both sides have read the file before either writes it) with a
barrier in two threads, so they fail every time the protection is missing.
The end-to-end ones start real ``harness`` processes at once, as users do.
Both assert what the files hold, never how fast anything ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness import models
from harness.build import build_engine, save_build
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend, CpuEngine
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from tests.test_timing_cache import KEY_CONV, KEY_GEMM, make_cache

ROUNDS = 1


def _harness(*argv: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "harness", *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _all_succeed(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (out, err)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_parallel_pins_of_different_layers_both_stay(tmp_path: Path, round_: int) -> None:
    path = tmp_path / "cache.json"
    make_cache().save(path)
    _all_succeed([
        _harness("cache", "pin", path, "--layer", "conv1=sm80_conv_128x64"),
        _harness("cache", "pin", path, "--layer", "fc=0x813e02ea68ef"),
    ])  # fmt: skip
    cache = TimingCache.load(path)
    assert cache.query(KEY_CONV).tactic == "sm80_conv_128x64" and cache.query(KEY_CONV).pinned
    assert cache.query(KEY_GEMM).tactic_hash == "0x813e02ea68ef" and cache.query(KEY_GEMM).pinned


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_builds_sharing_one_cache_keep_every_entry(tmp_path: Path, round_: int) -> None:
    shared = tmp_path / "shared.json"
    _all_succeed([
        _harness("build", "--model", "digits", "--mode", "fp32", "--cache", shared, "-o", tmp_path / "a",
                 "--option", "timing_runs=1"),
        _harness("build", "--model", "lenet", "--mode", "fp32", "--cache", shared, "-o", tmp_path / "b",
                 "--option", "timing_runs=1"),
    ])  # fmt: skip
    keys = set(TimingCache.load(shared).query_keys())
    for engine in (tmp_path / "a", tmp_path / "b"):
        plan = json.loads((engine / "plan.json").read_text())
        tuned = {layer["key"] for layer in plan["layers"] if layer["key"]}
        assert tuned and tuned <= keys, f"{engine}: {len(tuned - keys)} timed keys lost"


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_parallel_merges_and_promotes_write_whole_files(tmp_path: Path, round_: int) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_cache().save(a)
    other = make_cache()
    for entry in other.entries():
        other.remove(entry.key)
    other.update(next(iter(make_cache().entries())))
    other.save(b)
    out = tmp_path / "merged.json"
    _all_succeed([_harness("cache", "merge", a, b, "-o", out) for _ in range(3)])
    assert TimingCache.load(out) == TimingCache.load(a)  # whole, valid, and a's keys won


class BothRead:
    """Hold each caller after its read until the other has read too (or 2 s have passed).

    Without a lock both threads read the old file, then both write: one update
    is lost, every time. With the lock the second reader cannot read before
    the first has written; the first waits out the 2 s alone, and the second
    reads the first's result. The outcome never depends on the timeout.
    """

    def __init__(self, real):
        self.real, self.count, self.cond = real, 0, threading.Condition()

    def __call__(self, *args, **kwargs):
        value = self.real(*args, **kwargs)
        with self.cond:
            self.count += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.count >= 2, timeout=2.0)
        return value


def _in_threads(*calls) -> None:
    errors: list[BaseException] = []

    def guarded(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_two_pins_that_read_before_either_writes_both_stay(tmp_path: Path, monkeypatch, capsys) -> None:
    from harness.cli.main import main

    path = tmp_path / "cache.json"
    make_cache().save(path)
    monkeypatch.setattr(TimingCache, "load", BothRead(TimingCache.load))
    _in_threads(
        lambda: main(["cache", "pin", str(path), "--layer", "conv1=sm80_conv_128x64"]),
        lambda: main(["cache", "pin", str(path), "--layer", "fc=0x813e02ea68ef"]),
    )
    monkeypatch.undo()
    cache = TimingCache.load(path)
    assert cache.query(KEY_CONV).pinned and cache.query(KEY_GEMM).pinned


def test_two_builds_that_finish_before_either_writes_keep_every_entry(tmp_path: Path, monkeypatch) -> None:
    import harness.build

    shared, backend = tmp_path / "shared.json", CpuBackend()
    monkeypatch.setattr(backend, "build", BothRead(backend.build))
    exporting = threading.Lock()  # torch.export is not thread-safe; only the writes race here
    real_compile = harness.build.compile_graph

    def compile_one_at_a_time(*args):
        with exporting:
            return real_compile(*args)

    monkeypatch.setattr(harness.build, "compile_graph", compile_one_at_a_time)
    specs = [models.load("digits"), models.load("lenet")]
    results = {}

    def build(spec):
        return lambda: results.__setitem__(spec.name, build_engine(spec, BuildConfig("fp32", options={"timing_runs": 1}), backend, shared))

    _in_threads(*(build(spec) for spec in specs))
    keys = set(TimingCache.load(shared).query_keys())
    for name, result in results.items():
        tuned = {layer.key for layer in result.engine.layers() if layer.key}
        assert tuned and tuned <= keys, f"{name}: {len(tuned - keys)} timed keys lost"


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


def test_a_symlinked_cache_keeps_its_link(tmp_path: Path) -> None:
    real = tmp_path / "store" / "cache.json"
    real.parent.mkdir()
    make_cache().save(real)
    link = tmp_path / "cache.json"
    link.symlink_to(real)
    from harness.cli.main import main

    assert main(["cache", "pin", str(link), "--layer", "conv1=sm80_conv_128x64"]) == 0
    assert link.is_symlink() and TimingCache.load(real).query(KEY_CONV).pinned


def test_the_onnxruntime_plan_fingerprint_covers_its_mode(tmp_path: Path) -> None:
    """Once, a tampered ``mode`` in an ONNX Runtime plan was accepted and reported."""
    from harness.engines.onnxruntime.backend import OnnxRuntimeBackend

    spec = models.load("digits")
    result = build_engine(spec, BuildConfig("fp16"), OnnxRuntimeBackend())
    result.engine.save(tmp_path / "e")
    plan_path = tmp_path / "e" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["mode"] = "fp32"
    plan_path.write_text(json.dumps(plan))
    with pytest.raises(HarnessError, match="fingerprint mismatch"):
        OnnxRuntimeBackend().load(tmp_path / "e")
