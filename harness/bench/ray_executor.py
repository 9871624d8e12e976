"""``harness bench --executor ray``: the matrix's cases as tasks on a Ray cluster.

Each case (model, mode, batch size, scenario; a peer case too) is one Ray
task asking for what the case needs: one GPU on a GPU backend, as many CPUs
as ``--threads`` on a CPU backend, so two cases never share cores. Every
node of the cluster is first asked for its machine identity
(:func:`harness.bench.machine.machine_info`, as a worker there computes it:
its hardware class, or its ``HARNESS_MACHINE_ID``); nodes of one id form a
machine kind, and every kind runs the whole matrix on its own nodes, into a
results file of its own (never one table across kinds), written by a
:class:`~harness.bench.results.ResultsWriter` as a local run writes its
file, so ``--resume`` continues it the same way.

A task carries the bytes of its case's timing cache from its kind's cache
directory; the worker builds and times the case with that cache in a
temporary directory, and the entries its build added come back with the
case and are merged (:func:`harness.cache.operations.merge`, the driver's
entries winning) into the driver's file under its lock.

A case whose worker is lost (the process died, its node left, the task
could not be scheduled) is retried once; lost again, it is recorded failed
with the reason. An exception in the task itself is a failed case at once:
running it again would fail the same way. Retries are the driver's, never
Ray's (``max_retries=0``), so a case is never timed twice unseen.

Ray is imported through :func:`harness.extras.require` (the ``ray`` extra);
its objects are ``Any`` here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from harness.bench.results import BUSY_PREFIX, CaseKey, ResultsWriter, format_key
from harness.bench.runner import (
    GPU_BACKENDS,
    BenchRunner,
    Case,
    ExtraCase,
    MeasureSettings,
    ModelLoader,
    ModelPlan,
    case_messages,
)
from harness.bench.scenarios import Scenario
from harness.errors import HarnessError
from harness.extras import install_command, require

EXECUTORS = ("local", "ray")
EXTRA = "ray"
FLAG = "--executor ray"
# Ray's resource names for the task options this module sets.
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}

def check_executor(name: str, address: str | None, lock_clocks: object = None) -> str:
    """``--executor`` as given, refused (HarnessError, exit 2) unless it can run here: a known name,
    Ray importable for ``ray``, ``--ray-address`` and ``--lock-clocks`` only where they mean something."""
    if name not in EXECUTORS:
        raise HarnessError(
            f"--executor {name!r}: unknown executor; valid: {', '.join(EXECUTORS)} "
            f"(ray comes with the '{EXTRA}' extra: {install_command(EXTRA)})"
        )
    if name != "ray" and address is not None:
        raise HarnessError(f"--ray-address {address}: only with --executor ray (the cluster it connects to)")
    if name == "ray":
        ray_module()
        if lock_clocks is not None:
            raise HarnessError(
                f"--lock-clocks {lock_clocks} with {FLAG}: it would lock this machine's GPU, not the "
                "workers'; lock the clocks on each node, or drop the flag"
            )
    return name


def ray_module() -> Any:
    """The ``ray`` module, or :class:`~harness.extras.MissingExtra` naming the ``ray`` extra."""
    return require("ray", EXTRA, FLAG)


def task_resources(backend: str, threads: int) -> dict[str, float]:
    """What one case asks of a node: one GPU (and a CPU to drive it) on a GPU backend, else
    ``threads`` CPUs, so two cases on one node never share cores."""
    if backend in GPU_BACKENDS:
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": float(threads), "num_gpus": 0}


def node_capacity(resources: Mapping[str, float], need: Mapping[str, float]) -> int:
    """How many cases needing ``need`` a node with ``resources`` (Ray's names: CPU, GPU) runs at once."""
    slots = [int(float(resources.get(_RESOURCE_NAMES[k], 0)) // v) for k, v in need.items() if v > 0]
    return max(0, min(slots)) if slots else 0


@dataclass(frozen=True)
class RunnerRecipe:
    """What a worker needs to build the driver's runner again, by value: the backend by name
    (instantiated there, on that machine), every other setting as the driver resolved it."""

    backend: str
    settings: MeasureSettings
    plans: Mapping[str, ModelPlan]
    load_model: ModelLoader
    ignore_cache_mismatch: bool
    batch_sizes: tuple[int, ...]
    scenarios: tuple[Scenario, ...]

    @classmethod
    def of(cls, runner: BenchRunner) -> RunnerRecipe:
        return cls(
            runner.backend.name,
            runner.settings,
            dict(runner.plans),
            runner.load_model,
            runner.ignore_cache_mismatch,
            tuple(runner.batch_sizes),
            tuple(runner.scenarios),
        )

    def runner(self, cache_dir: Path | None) -> BenchRunner:
        from harness.engines.registry import get_backend

        return BenchRunner(
            get_backend(self.backend),
            cache_dir=cache_dir,
            settings=self.settings,
            plans=self.plans,
            load_model=self.load_model,
            ignore_cache_mismatch=self.ignore_cache_mismatch,
            batch_sizes=self.batch_sizes,
            scenarios=self.scenarios,
        )


# --- what runs on a worker ---------------------------------------------------------------


def probe_machine() -> dict[str, Any]:
    """The ``machine`` record of the node a worker runs on (a Ray task)."""
    from harness.bench.machine import machine_info

    return machine_info()


def run_case_task(
    recipe: RunnerRecipe, item: Any, caches: Mapping[str, bytes], cache_dir: str | None
) -> dict[str, Any]:
    """One case on a worker (a Ray task): its results entry, the timing caches its build changed
    (file name -> bytes), and the worker's machine id.

    ``caches`` are the case's cache files as the driver has them, written to a
    temporary directory the build reads and updates; ``cache_dir`` is the
    driver's directory for them (None: the run keeps no caches), the one the
    entry names.
    """
    from harness.machine import current_machine_id

    with tempfile.TemporaryDirectory(prefix="harness-ray-") as tmp:
        local = None if cache_dir is None else Path(tmp)
        if local is not None:
            for name, data in caches.items():
                (local / _plain_name(name)).write_bytes(data)
        entry = recipe.runner(local).run_item(item)
        changed: dict[str, bytes] = {}
        if local is not None and cache_dir is not None:
            for path in sorted(p for p in local.iterdir() if p.is_file()):
                data = path.read_bytes()
                if caches.get(path.name) != data:
                    changed[path.name] = data
            _relocate(entry, tmp, cache_dir)
    return {"entry": entry, "caches": changed, "machine_id": current_machine_id()}


def _relocate(entry: dict[str, Any], tmp: str, cache_dir: str) -> None:
    """The entry's cache file named where the driver keeps it, not in the worker's temporary directory."""
    build = entry.get("build")
    if isinstance(build, dict) and isinstance(build.get("cache_file"), str):
        path = Path(build["cache_file"])
        if path.is_relative_to(tmp):
            build["cache_file"] = os.fspath(Path(cache_dir) / path.relative_to(tmp))


def _plain_name(name: str) -> str:
    if Path(name).name != name or name in ("", ".", ".."):
        raise HarnessError(f"timing cache name {name!r} is not a plain file name")
    return name


# --- the driver --------------------------------------------------------------------------


@dataclass(frozen=True)
class KindFiles:
    """Where one machine kind's run goes: its results file, its timing caches (None: none), and
    its ``settings`` (the run's, with that cache directory)."""

    output: Path
    cache_dir: Path | None
    settings: dict[str, Any]


@dataclass
class MachineKind:
    """The nodes of the cluster sharing one machine id, each with how many cases it runs at once."""

    machine: dict[str, Any]
    nodes: dict[str, int]

    @property
    def id(self) -> str:
        return str(self.machine["id"])


@dataclass
class _Task:
    kind: KindRun
    item: Any  # ScenarioCase | ExtraCase
    lost: list[str] = field(default_factory=list)  # why each earlier attempt's worker was lost
    node: str | None = None


@dataclass
class KindRun:
    """One machine kind's part of the run: its files, its writer and the cases it has left."""

    kind: MachineKind
    files: KindFiles
    writer: ResultsWriter
    runner: BenchRunner  # the driver's: case keys, failed entries, cache paths
    queue: deque[_Task] = field(default_factory=deque)
    total: int = 0  # the cases this run records for the kind (the resumed file's not counted)
    busy: int = 0

    @property
    def id(self) -> str:
        return self.kind.id

    @property
    def doc(self) -> dict[str, Any]:
        return self.writer.doc


@dataclass
class RayRun:
    """What :func:`run_on_ray` did: each kind's run (in machine-id order), and whether it was interrupted."""

    kinds: list[KindRun]
    interrupted: bool = False


class Progress:
    """Cases done, running and queued, on ``stream``: one line redrawn in place on a terminal,
    else a line per change (a CI log gets no ``\\r`` fragments); messages about cases go above it."""

    def __init__(self, stream: TextIO, enabled: bool, total: int) -> None:
        self.stream = stream
        self.enabled = enabled
        self.total = total
        self.tty = stream.isatty()
        self._state: tuple[int, int, int] | None = None
        self._line = ""

    def show(self, done: int, running: int, queued: int) -> None:
        if not self.enabled or (done, running, queued) == self._state:
            return
        self._state = (done, running, queued)
        self._line = f"bench (ray): {done} of {self.total} cases done, {running} running, {queued} queued"
        self.stream.write(f"\r\x1b[K{self._line}" if self.tty else f"{self._line}\n")
        self.stream.flush()

    def say(self, line: str) -> None:
        drawn = self.enabled and self.tty and self._state is not None
        self.stream.write(("\r\x1b[K" if drawn else "") + line + "\n" + (self._line if drawn else ""))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._state is not None:
            self.stream.write("\n")
            self.stream.flush()


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, connected: the Ray this process has initialised already (a test's, a notebook's), else
    the cluster at ``address`` (as ``ray.init`` takes it), else a local cluster started for the run;
    disconnected after if connected here."""
    ray = ray_module()
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray's own error types vary by version
        where = f"the cluster at {address}" if address else "a local Ray cluster"
        raise HarnessError(f"{FLAG}: cannot connect to {where}: {_first_line(exc)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def discover_kinds(ray: Any, need: Mapping[str, float]) -> list[MachineKind]:
    """The cluster's machine kinds: every alive node that can run a case, grouped by the machine id
    a worker there computes (nodes that cannot run one are left out)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    capacity = {str(n["NodeID"]): node_capacity(n.get("Resources", {}), need) for n in alive}
    usable = sorted(node for node, slots in capacity.items() if slots > 0)
    if not usable:
        wanted = ", ".join(f"{v:g} {_RESOURCE_NAMES[k]}" for k, v in need.items() if v > 0)
        raise HarnessError(
            f"{FLAG}: no node of the cluster ({len(alive)} alive) has what one case needs ({wanted}); "
            "lower --threads or add nodes"
        )
    probe = ray.remote(num_cpus=0, max_retries=1)(probe_machine)
    refs = [probe.options(scheduling_strategy=_on_node(node)).remote() for node in usable]
    machines: list[dict[str, Any]] = ray.get(refs)
    kinds: dict[str, MachineKind] = {}
    for node, machine in zip(usable, machines, strict=True):
        kind = kinds.setdefault(str(machine["id"]), MachineKind(machine, {}))
        kind.nodes[node] = capacity[node]
    return [kinds[k] for k in sorted(kinds)]


def _on_node(node: str) -> Any:
    strategies = require("ray.util.scheduling_strategies", EXTRA, FLAG)
    return strategies.NodeAffinitySchedulingStrategy(node, soft=False)


def run_on_ray(
    runner: BenchRunner,
    matrix: Sequence[Case],
    extra: Sequence[ExtraCase],
    *,
    address: str | None,
    files: Callable[[str], KindFiles],
    resume: bool,
    progress: bool = True,
    stream: TextIO | None = None,
) -> RayRun:
    """Run the matrix (and ``extra`` cases) on every machine kind of the Ray cluster, each kind into
    the results file ``files(machine id)`` names (created, or continued with ``resume``).

    Each kind's file is finished when its cases are all recorded. Ctrl-C
    cancels the running tasks and leaves every file incomplete with the cases
    recorded so far (``RayRun.interrupted``).
    """
    out = stream or sys.stderr
    need = task_resources(runner.backend.name, runner.settings.threads)
    with connected(address) as ray, contextlib.ExitStack() as held:
        kinds = discover_kinds(ray, need)
        where = [files(kind.id) for kind in kinds]
        taken = [os.fspath(w.output) for w in where if w.output.exists()] if not resume else []
        if taken:  # refused before any kind's file is written
            raise HarnessError(
                f"results file {', '.join(taken)} already exists; choose a new path, or continue an "
                "interrupted run with `harness bench --executor ray --resume -o FILE`"
            )
        runs = [_kind_run(runner, matrix, extra, k, w, resume, held) for k, w in zip(kinds, where, strict=True)]
        total = sum(r.total for r in runs)
        for r in runs:
            nodes = ", ".join(f"{node[:8]} ({slots} at once)" for node, slots in r.kind.nodes.items())
            kept = len(r.doc["cases"])
            print(
                f"{FLAG}: machine {r.id}: {r.total} cases on {len(r.kind.nodes)} node(s): {nodes}"
                + (f"; {kept} kept from {r.files.output}" if kept else ""),
                file=out, flush=True,
            )  # fmt: skip
        bar = Progress(out, progress, total)
        result = RayRun(runs)
        try:
            _drive(ray, RunnerRecipe.of(runner), runs, need, bar)
        except KeyboardInterrupt:
            result.interrupted = True
            return result
        finally:
            bar.close()
        for r in runs:
            if r.busy > 1:
                print(
                    f"machine {r.id}: {r.busy} cases ran while the machine was busier than its cores "
                    "(listed under the table)",
                    file=out,
                )  # fmt: skip
            r.writer.finish()
        return result


def _kind_run(
    runner: BenchRunner,
    matrix: Sequence[Case],
    extra: Sequence[ExtraCase],
    kind: MachineKind,
    where: KindFiles,
    resume: bool,
    held: contextlib.ExitStack,
) -> KindRun:
    """One kind's writer (a new file, or the interrupted one continued) and its queue of cases;
    its cache directory held for the run, as a local bench holds its own."""
    from harness.fileio import locked_directory

    if where.cache_dir is not None:
        held.enter_context(locked_directory(where.cache_dir, "--cache-dir", lambda: _waiting(where.cache_dir)))
    if resume and where.output.exists():
        writer = ResultsWriter.resume(where.output, settings=where.settings, machine=kind.machine)
    else:
        writer = ResultsWriter.create(where.output, settings=where.settings, machine=kind.machine)
    replica = runner.replica(where.cache_dir)
    run = KindRun(kind, where, writer, replica)
    run.queue = deque(_Task(run, item) for item in replica.pending(matrix, writer, extra))
    run.total = len(run.queue)
    return run


def _waiting(directory: Path | None) -> None:
    print(
        f"waiting: another process holds the cache directory {directory} "
        "(a bench holds it for its whole run); this run starts when it is released",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _drive(ray: Any, recipe: RunnerRecipe, runs: list[KindRun], need: Mapping[str, float], bar: Progress) -> None:
    """Keep every node of every kind busy with its kind's cases (as many at once as its capacity),
    recording each case as it ends, until every queue is empty."""
    exceptions = ray.exceptions
    remote = ray.remote(max_retries=0)(run_case_task)  # retries are ours: once, for a lost worker
    recipe_ref = ray.put(recipe)  # sent once, not with every task

    def start(node: str, item: Any, caches: dict[str, bytes], cache_dir: str | None) -> Any:
        options = remote.options(**need, scheduling_strategy=_on_node(node))
        return options.remote(recipe_ref, item, caches, cache_dir)

    free = {node: slots for r in runs for node, slots in r.kind.nodes.items()}
    running: dict[Any, _Task] = {}
    done = 0
    try:
        while True:
            for r in runs:
                _submit(r, free, running, start)
                if r.queue and not r.kind.nodes:  # every node of the kind left the cluster
                    while r.queue:
                        task = r.queue.popleft()
                        lost = f" (its worker was lost: {'; '.join(task.lost)})" if task.lost else ""
                        reason = f"ray: no node of machine {r.id} is left in the cluster to run it{lost}"
                        done += _record(r, _failed(task, reason), bar)
            bar.show(done, len(running), sum(len(r.queue) for r in runs))
            if not running:
                return
            ready, _ = ray.wait(list(running), num_returns=1)
            task = running.pop(ready[0])
            if task.node in free:
                free[task.node] += 1
            try:
                result = ray.get(ready[0])
            except exceptions.RayTaskError as exc:  # the task's own code raised: it would again
                cause = getattr(exc, "cause", None) or exc
                entry = _failed(task, f"ray: the case's task failed: {type(cause).__name__}: {_first_line(cause)}")
            except exceptions.RayError as exc:  # the worker (or its node) was lost
                reason = f"{type(exc).__name__}: {_first_line(exc)}"
                _forget_dead_nodes(ray, runs, free)
                task.lost.append(reason)
                if len(task.lost) == 1:
                    bar.say(f"case {_name(task)} on machine {task.kind.id}: its worker was lost ({reason}); retrying once")
                    task.kind.queue.appendleft(task)
                    continue
                entry = _failed(task, f"ray: its worker was lost twice (retried once): {'; '.join(task.lost)}")
            else:
                entry = _received(task, result, bar)
            done += _record(task.kind, entry, bar)
    finally:
        for ref in running:  # interrupted: nothing left running on the cluster for this run
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


def _submit(run: KindRun, free: dict[str, int], running: dict[Any, _Task], start: Callable[..., Any]) -> None:
    """Start the kind's next cases on its nodes with a free slot."""
    for node in run.kind.nodes:
        while free.get(node, 0) > 0 and run.queue:
            task = run.queue.popleft()
            task.node = node
            free[node] -= 1
            caches = _caches_for(run, task.item)
            cache_dir = None if run.files.cache_dir is None else os.fspath(run.files.cache_dir)
            running[start(node, task.item, caches, cache_dir)] = task




def _caches_for(run: KindRun, item: Any) -> dict[str, bytes]:
    """The timing cache an engine case builds with, as the driver holds it (file name -> bytes)."""
    if run.files.cache_dir is None or not isinstance(item, tuple):
        return {}
    model, mode, batch, _ = item
    path = run.runner.cache_path(model, run.runner.config(model, mode), batch)
    if path is None or not path.is_file():
        return {}
    return {path.name: path.read_bytes()}


def _received(task: _Task, result: Mapping[str, Any], bar: Progress) -> dict[str, Any]:
    """A finished task's entry, its new cache entries merged into the driver's files."""
    run = task.kind
    if result["machine_id"] != run.id:
        return _failed(task, f"ray: it ran on machine {result['machine_id']}, not {run.id} (a node changed its identity)")
    if run.files.cache_dir is not None:
        where = f"machine {run.id} node {str(task.node)[:8]}"
        for note in merge_caches(run.files.cache_dir, result["caches"], where):
            bar.say(note)
    return dict(result["entry"])


def merge_caches(cache_dir: Path, returned: Mapping[str, bytes], where: str) -> list[str]:
    """Merge timing caches a worker returned into ``cache_dir``'s files, each under its lock: the
    driver's entries win (:func:`harness.cache.operations.merge`); a file the driver lacks is taken
    whole. A cache that cannot be merged is left out, with a note saying why."""
    from harness.cache.operations import merge
    from harness.cache.timing_cache import TimingCache
    from harness.fileio import locked, parse_json

    notes = []
    for name, data in sorted(returned.items()):
        path = cache_dir / _plain_name(name)
        try:
            theirs = TimingCache.from_json(parse_json(data, f"timing cache {name} from {where}"), f"timing cache {name} from {where}")
            with locked(path):
                if not path.exists():
                    theirs.save(path)
                    continue
                ours = TimingCache.load(path)
                merged = merge(ours, theirs, source=where)
                if len(merged) != len(ours):
                    merged.save(path)
        except HarnessError as exc:
            notes.append(f"note: timing cache {path}: the entries timed on {where} were not merged: {exc}")
    return notes


def _record(run: KindRun, entry: dict[str, Any], bar: Progress) -> int:
    """Record a case in its kind's file and say what makes it doubtful (a busy machine once per kind)."""
    run.writer.add(entry)
    for line in case_messages(entry):
        if BUSY_PREFIX in line:
            run.busy += 1
            if run.busy > 1:
                continue
        bar.say(f"{line} (machine {run.id})")
    return 1


def _failed(task: _Task, reason: str) -> dict[str, Any]:
    """The failed entry of a case that could not run, with ``reason``."""
    runner, item = task.kind.runner, task.item
    if isinstance(item, tuple):
        model, mode, batch, scenario = item
        return runner.failed_entry(model, mode, runner.backend.name, batch, scenario, reason)
    _, mode, backend, batch, _ = item.key(runner)
    return runner.failed_entry(item.model, mode, backend, batch, None, reason)


def _name(task: _Task) -> str:
    key: CaseKey = task.kind.runner.key_of(task.item)
    return format_key(key)


def _forget_dead_nodes(ray: Any, runs: list[KindRun], free: dict[str, int]) -> None:
    """Drop the nodes that left the cluster: no case goes to them again."""
    alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}
    for run in runs:
        for node in [n for n in run.kind.nodes if n not in alive]:
            del run.kind.nodes[node]
            free.pop(node, None)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
