"""The results store: each machine's runs and its baseline, kept together.

:class:`ResultsStore` is what the commands ask of a store (where a new run goes, which run the
gate takes, where the baseline is, promoting one); :class:`FileStore` is the store there is, a
directory tree that a repository commits::

    <root>/<machine id>/run-<UTC time>.json                  one run
    <root>/<machine id>/run-<UTC time>-shard<i>of<n>.json    one shard of a run (``harness merge`` joins them)
    <root>/<machine id>/baseline.json                        the run ``harness gate`` compares against
    <root>/<machine id>/caches/                              the timing caches its runs build from

Errors are HarnessErrors naming the file or directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.bench.results import doubts, load_results, peek_results, utc_now, write_results
from harness.bench.results_doc import read_run
from harness.errors import HarnessError
from harness.fileio import check_writable
from harness.machine import check_machine_id

BASELINE = "baseline.json"
_SHARD_NAME = re.compile(r"-shard\d+of\d+\.json$")


class ResultsStore(Protocol):
    """Where each machine's runs and baseline are kept."""

    def new_run(self, machine_id: str, *, created: str | None = None, shard: tuple[int, int] | None = None) -> Path:
        """Where a new run of ``machine_id`` (or shard ``i`` of ``n`` of one) is written."""
        ...

    def baseline(self, machine_id: str) -> Path:
        """Where the baseline of ``machine_id`` is, whether or not there is one yet."""
        ...

    def current_run(self, machine_id: str) -> Path:
        """The run the gate takes when none is named: :func:`newest_finished_run` of the machine's runs."""
        ...

    def promote(self, run: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Make ``run`` the baseline of its machine; its path (refusals: :meth:`FileStore.promote`)."""
        ...


def run_name(created: str | None = None, shard: tuple[int, int] | None = None) -> str:
    """``run-<UTC time>.json`` (colons and dashes removed: valid on every filesystem), or a shard's name."""
    stamp = (created or utc_now()).replace(":", "").replace("-", "")
    return f"run-{stamp}.json" if shard is None else f"run-{stamp}-shard{shard[0]}of{shard[1]}.json"


@dataclass(frozen=True)
class MachineFiles:
    """A machine directory's results files."""

    runs: list[Path]  # whole runs, by name (the time each started)
    baseline: Path | None
    shards: list[Path]


def machine_files(directory: Path) -> MachineFiles:
    """The runs, the baseline and the shard files in ``directory`` (a machine's directory)."""
    files = sorted(p for p in directory.glob("run-*.json") if p.is_file())
    baseline = directory / BASELINE
    return MachineFiles(
        [p for p in files if not _SHARD_NAME.search(p.name)],
        baseline if baseline.is_file() else None,
        [p for p in files if _SHARD_NAME.search(p.name)],
    )


def newest_finished_run(directory: Path) -> Path:
    """The newest *finished*, full run in ``directory``, by the time it finished (not its name,
    which is when it started: a run started during another can finish first).

    Shards are passed over (gating one would report the other shards' cases as missing; merge
    them first), and so are interrupted and ``--quick`` runs, as ``baseline promote`` refuses
    them: each is named when nothing else is left. A run without a finish time (written before
    runs recorded one) counts as finished when it started.
    """
    finished: list[tuple[str, Path]] = []
    passed_over = []
    for path in machine_files(directory).runs:
        head = peek_results(path)
        if not head.get("complete"):
            passed_over.append(f"{path.name} (interrupted)")
        elif (head.get("settings") or {}).get("quick"):
            passed_over.append(f"{path.name} (--quick)")
        else:
            finished.append((str(head.get("finished") or head.get("created") or ""), path))
    if not finished:
        skipped = f" ({', '.join(passed_over)} not gated)" if passed_over else ""
        raise HarnessError(
            f"no finished, full run-*.json (other than shards) in {directory}{skipped}; run `harness bench` "
            "(or `harness merge` the shards) first, or pass --current FILE"
        )
    return max(finished)[1]


@dataclass(frozen=True)
class FileStore:
    """The results store in a directory tree (the module's layout) under ``root``."""

    root: Path

    def directory(self, machine_id: str) -> Path:
        """``<root>/<machine id>``; an id that is not a valid directory name is refused."""
        return self.root / check_machine_id(machine_id)

    def new_run(self, machine_id: str, *, created: str | None = None, shard: tuple[int, int] | None = None) -> Path:
        return self.directory(machine_id) / run_name(created, shard)

    def baseline(self, machine_id: str) -> Path:
        return self.directory(machine_id) / BASELINE

    def current_run(self, machine_id: str) -> Path:
        return newest_finished_run(self.directory(machine_id))

    def promote(self, run: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Make a finished run the baseline of its machine; returns the baseline's path.

        The run is validated first, so a corrupt or partial file never replaces a good baseline.
        Refused unless ``force`` (and then recorded in the baseline's ``promoted`` record, with
        why): a ``--quick`` run, whose tiny timing windows give samples too few and too noisy to
        gate later runs on; a run with unstable cases; and a run measured while the machine was
        busier than its cores (:func:`harness.bench.results.doubts`).
        """
        doc = load_results(run)
        if not doc["complete"]:
            raise HarnessError(
                f"results file {os.fspath(run)} is incomplete (the run was interrupted); "
                "finish or rerun it before promoting it to a baseline"
            )
        reasons = doubts(read_run(doc, os.fspath(run)))
        if reasons and not force:
            raise HarnessError(
                f"results file {os.fspath(run)} would be a poor baseline: {'; '.join(reasons)}. Re-run the "
                "benchmark on a quiet machine (without --quick), or pass --force to promote it anyway"
            )
        dest = check_writable(self.baseline(doc["machine"]["id"]), "baseline")  # <root>/<machine> may be a file
        write_results(dest, {**doc, "promoted": {"from": os.fspath(run), "at": utc_now(), "forced_over": reasons}})
        return dest
