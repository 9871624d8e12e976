"""Every command that writes, on a full filesystem: one clear error naming the file, and nothing left.

The filesystem is a small tmpfs filled to the last page where this machine
lets the tests mount one (root, CAP_SYS_ADMIN); elsewhere each command runs
under a file-size limit (``RLIMIT_FSIZE``, ``ulimit -f``), so that its writes
fail as a full disk's do (EFBIG instead of ENOSPC: the same path through
the harness). Each command is a process of its own (``harness``, started
from a fork server that imported torch once: tests/forkserver.py), and must exit 2 with one ``error:`` line naming the file it could not write, no
traceback, no new file or directory on the full filesystem or beside its
inputs, and every input byte for byte as it was: a results file started
before the disk filled, and the cache directory made for it, are removed.

``harness inspect`` of saved engines under ``ulimit -v 4194304``
(``RLIMIT_AS``) is here too: a read reserves what the file holds, no more.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.bench.runner import cache_file
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.fileio import WriteFailed, atomic_write_bytes, locked
from tests.forkserver import ForkServer
from tests.test_bad_inputs import ENV, MACHINE, TRT_LAYERS, TRT_LOG, _snapshot, good  # noqa: F401
from tests.test_hostile_inputs import REPO, error_line

pytestmark = pytest.mark.slow  # each writer runs as a real process on a filled filesystem

PAGE = 4096
TMPFS_BYTES = 64 << 10
# Without tmpfs the limit holds for every file the process writes: the few bytes of
# tempfile's and joblib's probes pass, every output of the harness (from the 300 bytes
# of a Markdown summary up) fails.
SMALL_WRITES = 128


Limits = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class Harness:
    """``harness`` as a user runs it, on the bad-input machine id."""

    env: dict[str, str]
    program: Path

    def run(self, argv: list[str], cwd: Path, limits: Limits | None = None) -> subprocess.CompletedProcess[str]:
        """``harness argv`` in ``cwd`` under ``limits`` (resource -> soft and hard limit)."""

        def limited() -> None:
            for which, limit in (limits or {}).items():
                resource.setrlimit(which, limit)

        return subprocess.run(
            [str(self.program), *argv],
            cwd=cwd, env=self.env, capture_output=True, text=True, timeout=300, preexec_fn=limited if limits else None,
        )  # fmt: skip


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    directory = tmp_path_factory.mktemp("forkserver")
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    server = ForkServer(directory, env)
    try:
        yield Harness(env, server.client("harness", "harness"))
    finally:
        server.close()


@dataclass(frozen=True)
class FullDisk:
    """A directory on a full filesystem: a tmpfs (``file_limit`` None), or, where none can be
    mounted, a plain directory whose writers run under ``RLIMIT_FSIZE`` ``file_limit``."""

    directory: Path
    file_limit: int | None

    def run(self, harness: Harness, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        limit = self.file_limit
        return harness.run(argv, cwd, None if limit is None else {resource.RLIMIT_FSIZE: (limit, limit)})


def _mount_tmpfs(directory: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(directory)], capture_output=True)
    return done.returncode == 0


def _fill(directory: Path, free: int) -> None:
    """Fill ``directory``'s filesystem to its last byte, then give ``free`` bytes back."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - free))


@contextmanager
def full_disk(
    directory: Path, contents: Sequence[Path] = (), free: int = 0, file_limit: int = SMALL_WRITES
) -> Iterator[FullDisk]:
    """``directory`` on a tmpfs holding copies of ``contents`` with ``free`` bytes left, or (no
    mount allowed) a plain one holding them, written to under ``file_limit``."""
    directory.mkdir()
    mounted = _mount_tmpfs(directory)
    try:
        for source in contents:
            shutil.copy(source, directory / source.name)
        if not mounted:
            yield FullDisk(directory, file_limit)
            return
        _fill(directory, free)
        yield FullDisk(directory, None)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


@dataclass(frozen=True)
class Write:
    """A command that writes: its arguments and the file (or engine) its error must name."""

    name: str
    argv: tuple[str, ...]
    names: str
    plots: bool = False  # needs the `plots` extra
    on_full: tuple[str, ...] = ()  # inputs copied onto the full filesystem (before it fills)
    marks: tuple[pytest.MarkDecorator, ...] = ()


QUICK_BENCH = ("bench", "--quick", "--no-progress", "--no-plots", "--models", "digits", "--modes", "fp32")
DEBUG_PRECISION = ("debug", "precision", "--model", "digits", "--low", "fp16", "--target", "max-abs-err<=0.5",
                   "--seconds", "0.01", "--final-seconds", "0.01", "--no-progress")  # fmt: skip
WRITES = [
    Write("cache-merge-o", ("cache", "merge", "{work}/cache.json", "{work}/cache.json", "-o", "{full}/sub/m.json"), "{full}/sub/m.json"),
    Write("cache-pin-o", ("cache", "pin", "{work}/cache.json", "--from", "{work}/cache.json", "-o", "{full}/p.json"), "{full}/p.json"),
    Write("cache-pin-in-place", ("cache", "pin", "{full}/cache.json", "--from", "{work}/cache.json"), "{full}/cache.json", on_full=("cache",)),
    Write("build-o", ("build", "--model", "digits", "--mode", "fp32", "--disable-cache", "-o", "{full}/e/engine"), "{full}/e/engine"),
    Write("build-cache", ("build", "--model", "digits", "--mode", "fp32", "--cache", "{full}/c/cache.json", "-o", "{work}/engine"), "{full}/c/cache.json"),
    Write("bench-o", (*QUICK_BENCH, "-o", "{full}/r/run.json"), "{full}/r/run.json"),
    Write("merge-o", ("merge", "{work}/run.json", "-o", "{full}/m/run.json"), "{full}/m/run.json"),
    Write("baseline-promote", ("baseline", "promote", "{work}/run.json", "--root", "{full}/results", "--force"), f"{{full}}/results/{MACHINE}/baseline.json"),
    Write("inspect-save-cache", ("inspect", "--trt-log", str(TRT_LOG), "--trt-layers", str(TRT_LAYERS), "--save-cache", "{full}/s/cache.json"), "{full}/s/cache.json"),
    Write("report-summary-md", ("report", "{work}/run.json", "--no-plots", "--summary-md", "{full}/x/summary.md"), "{full}/x/summary.md"),
    Write("gate-summary-md", ("gate", "--baseline", "{work}/run.json", "--current", "{work}/current.json", "--summary-md", "{full}/x/gate.md"), "{full}/x/gate.md"),
    Write("report-plots", ("report", "{full}/run.json"), "{full}/run-digits.png", plots=True, on_full=("results",)),
    Write("debug-layers-plot", ("debug", "layers", "--model", "digits", "--mode", "fp16", "--no-progress", "--plot", "{full}/d/layers.png"), "{full}/d/layers.png", plots=True),
    # the writers beyond the nine: a Markdown summary after a complete results file takes the file
    # with it (the command failed: nothing of it stays), as a second output takes the first
    Write("bench-summary-md", (*QUICK_BENCH, "-o", "{work}/new-run.json", "--summary-md", "{full}/x/summary.md"), "{full}/x/summary.md"),
    Write("report-pytest-benchmark-o", ("report", "{work}/run.json", "--format", "pytest-benchmark", "-o", "{full}/x/pb.json"), "{full}/x/pb.json"),
    Write("history-html", ("history", "{work}/run.json", "-o", "{full}/x/history.html"), "{full}/x/history.html"),
    Write("history-json-then-summary", ("history", "{work}/run.json", "--no-html", "--json", "{work}/history.json", "--summary-md", "{full}/x/history.md"), "{full}/x/history.md"),
    Write("debug-precision-o", (*DEBUG_PRECISION, "-o", "{full}/x/plan.json"), "{full}/x/plan.json"),
    Write("debug-precision-cache", (*DEBUG_PRECISION, "-o", "{work}/plan.json", "--cache", "{full}/c/cache.json"), "{full}/c/cache.json"),
    Write("debug-precision-plot", (*DEBUG_PRECISION, "-o", "{work}/plan.json", "--plot", "{full}/p/plan.png"), "{full}/p/plan.png", plots=True),
    Write("bench-cache-dir", (*QUICK_BENCH, "-o", "{work}/new-run.json", "--cache-dir", "{full}/caches"), "{full}/caches"),
]  # fmt: skip
HAS_PLOTS = importlib.util.find_spec("matplotlib") is not None
# What a bench whose cases ran may warn of on stderr before its error (a busy machine, a noisy case): no error.
CASE_WARNING = re.compile(r"case [^ ]+: (?!.*error:)")
# What ``harness -v`` logs (``logger: message``), and a case's warnings: no error.
LOG_LINE = re.compile(r"(?!error: )(case )?[\w.]+: (?!.*error:)")


def _work(tmp_path: Path, good: dict[str, Path]) -> Path:  # noqa: F811
    """The inputs of the writing commands, copied where their snapshot can be compared."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(good["cache"], work / "cache.json")
    shutil.copy(good["results"], work / "run.json")
    shutil.copy(good["results"], work / "current.json")
    return work


def _fill_in(argv: tuple[str, ...], work: Path, full: Path) -> list[str]:
    return [a.replace("{work}", str(work)).replace("{full}", str(full)) for a in argv]


@pytest.mark.parametrize("write", [pytest.param(w, id=w.name, marks=w.marks) for w in WRITES])
def test_a_write_on_a_full_disk_is_one_error_naming_the_file_and_leaves_nothing(tmp_path, good, harness: Harness, write: Write) -> None:  # noqa: F811
    """Exit 2, one error line naming the file (as given), no traceback; on the full filesystem and
    beside the inputs nothing new, and every input (one on the full filesystem too) as it was."""
    if write.plots and not HAS_PLOTS:
        pytest.skip("the plots extra (matplotlib) is not installed")
    work = _work(tmp_path, good)
    directory = tmp_path / "full"
    with full_disk(directory, [good[name] for name in write.on_full]) as full:
        before = _snapshot(work, directory)
        result = full.run(harness, _fill_in(write.argv, work, directory), work)
        line = error_line(result.returncode, result.stderr, CASE_WARNING)
        assert _fill_in((write.names,), work, directory)[0] in line, line
        assert _snapshot(work, directory) == before, "a file was left, or an input changed"


def test_a_bench_that_fills_the_disk_mid_run_leaves_neither_its_results_nor_its_caches(tmp_path, good, harness: Harness) -> None:  # noqa: F811
    """Room for the started results file and the case's timing cache, not for the results once they
    hold the case's samples: the started file and the cache directory made for it go.

    The run's log (``-v``) shows how far it got: the results file is started
    before any case is built, so a case's timing cache written means the
    file was started, and the error after it is the write of the case.
    """
    work = _work(tmp_path, good)
    directory = tmp_path / "full"
    output = directory / "r" / "run.json"
    # 3 pages hold the started file (2 kB) and the cache (3 kB), not the file with a case (6 kB) beside
    # them; without tmpfs, one page is a file size the first two stay under and the third exceeds.
    with full_disk(directory, free=3 * PAGE, file_limit=PAGE) as full:
        before = _snapshot(work, directory)
        result = full.run(harness, ["-v", *QUICK_BENCH, "-o", str(output)], work)
        line = error_line(result.returncode, result.stderr, LOG_LINE)
        assert str(output) in line, line
        digits_fp32 = cache_file(output.parent / "caches", "digits", BuildConfig("fp32", threads=1), CpuBackend())
        cache = f"timing cache {digits_fp32}: 2 new entries written"
        assert cache in result.stderr, "the disk was full before the run started: " + result.stderr[-3000:]
        assert _snapshot(work, directory) == before, "the started results file or its cache directory was left"


@pytest.mark.parametrize("engine", ["engine", "ort", "ov"])
def test_inspect_of_a_saved_engine_works_under_a_4_gib_address_space(good, harness: Harness, engine: str) -> None:  # noqa: F811
    """``ulimit -v 4194304``: loading an engine reserves what its files hold, not the 16 GiB a
    payload may reach (which failed with MemoryError before anything was read)."""
    limit = 4194304 * 1024
    result = harness.run(["inspect", str(good[engine])], good[engine].parent, {resource.RLIMIT_AS: (limit, limit)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"engine {good[engine]}: backend" in result.stdout


def test_a_failed_write_outside_a_command_takes_its_own_directories_away(tmp_path, monkeypatch) -> None:
    """A library caller (no command around it undoing what it made) gets the same: the write's
    temporary file, and the directories it and its lock created, are gone (a write failing by
    injection: ENOSPC from the fsync)."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "a" / "b" / "cache.json"
    with pytest.raises(WriteFailed, match=f"cannot write {target}: No space left on device"):
        atomic_write_bytes(target, b"{}")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(WriteFailed), locked(target):
        atomic_write_bytes(target, b"{}")
    assert list(tmp_path.iterdir()) == []
