"""``harness bench``: build, check and time every (model, mode) case; write one results JSON.

The commands on results files (``merge``, ``report``, ``baseline``,
``compare``, ``gate``) are in :mod:`.results_cmd`, which imports no torch.

Exit codes: 0 success, 1 a case failed, 2 bad input (flags, files, models,
modes; refused before any work), 130 interrupted (the finished cases are
kept in a file marked incomplete), by Ctrl-C, or by SIGTERM while
``--lock-clocks`` holds a lock (:mod:`harness.bench.clocks`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from harness.autocast import options
from harness.cli import argtypes, bench_load
from harness.cli.results_cmd import DEFAULT_ROOT, parse_threshold, plots_missing, report_run
from harness.errors import HarnessError
from harness.precision import PrecisionMode


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from harness.bench.peer_names import PEER_NAMES
    from harness.bench.runner import DEFAULT_MODELS, DEFAULT_THREADS
    from harness.engines.registry import BACKEND_NAMES

    p = sub.add_parser(
        "bench",
        help="benchmark models x precision modes on one backend",
        description="Build, check accuracy of, and time every (model, mode) case; write one results JSON.",
    )
    p.add_argument("--models", "--model", default=None,
                   help="comma-separated zoo names, path/to/file.py:factory, or model files: path/model.onnx, "
                   "path/model.pt2 (torch.export.save), hf:path/to/dir (config.json and safetensors) "
                   f"(default: the project file's, else {','.join(DEFAULT_MODELS)}; digits only with the "
                   "'digits' extra installed)")
    p.add_argument("--modes", default=None, help="comma-separated precision modes "
                   "(default: every mode the backend supports; 'explicit' only with --explicit)")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=None,
                   help="auto: TensorRT when it imports and a GPU is visible, else cpu (default: the project "
                   "file's, else auto)")
    p.add_argument("--explicit", default=None, metavar="FILE", help="explicit precision file for mode 'explicit'")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="timing caches, one per (model, mode) (default: caches/ next to the results file)")
    p.add_argument("--shard", type=argtypes.shard, default=None, metavar="I/N", help="run every N-th case of the matrix, starting at the I-th")
    p.add_argument("--threads", type=argtypes.threads, default=None,
                   help="intra-op threads of every candidate, pinned for each case (1 gives stable "
                   f"numbers on a shared machine; more measures multi-core speed) (default: the project "
                   f"file's, else {DEFAULT_THREADS})")
    p.add_argument("--batch-sizes", type=argtypes.batch_sizes, metavar="N,N,...",
                   help="sweep the batch dimension (models that declare ModelSpec.batch_dim or whose factory "
                   "takes batch_size) (default: the project file's, else each model's own)")
    p.add_argument("--peers", default=None, metavar="NAME,...",
                   help="also time plain runtimes on the same inputs and threads, as reference rows at the "
                   f"precisions of the modes: {', '.join(PEER_NAMES)} (default: the project file's, else none)")
    p.add_argument("--ignore-mismatch", action="store_true",
                   help="use timing caches recorded for another configuration (read-only)")
    p.add_argument("--disable-cache", action="store_true",
                   help="every case times every layer; read and write no timing cache")
    p.add_argument("--config", metavar="FILE",
                   help="project file (default: ./harness.toml, else [tool.harness] in ./pyproject.toml)")
    p.add_argument("--spread-threshold", type=argtypes.threshold, default=None, metavar="PCT",
                   help="flag a case unstable above this IQR/median spread, e.g. 5%% or 0.05 "
                   "(default: 5%% on CPU, 2.5%% on GPU)")
    p.add_argument("--quick", action="store_true", help="tiny warm-up and timing windows: checks the pipeline, not the numbers")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU backends: capture each engine's enqueue once in a CUDA graph and time its replays, "
                   "as trtexec --useCudaGraph does (default: the enqueue itself)")
    p.add_argument("--lock-clocks", type=argtypes.lock_clocks, default=None, metavar="base|max|MHZ",
                   help="lock the GPU's graphics (SM) clock for the run, and unlock it when the run ends, fails or "
                   "is interrupted (Ctrl-C, SIGTERM): base (its default applications clock), max, or a clock in "
                   "MHz the GPU supports; needs root and a GPU backend (default: clocks as the driver sets them)")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help=f"results file, or a directory to write run-<timestamp>.json into "
                   f"(default: {DEFAULT_ROOT}/<machine>/run-<timestamp>.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in -o FILE (same flags), skipping its finished cases")
    p.add_argument("--summary-md", default=None, metavar="FILE", help="also write the table as Markdown (CI job summary)")
    p.add_argument("--no-plots", action="store_true", help="skip the latency-vs-error PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--executor", default="local", metavar="local|ray",
                   help="local: every case in this process, one after the other; ray: each case a task on a "
                   "Ray cluster (the 'ray' extra), every machine kind of the cluster running the matrix into "
                   "a results file of its own, <machine id>/ beside -o (default: local)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --executor ray: the cluster to connect to, as ray.init takes it (e.g. "
                   "ray://head:10001, or auto) (default: a cluster this process has, else a local one started "
                   "for the run)")
    options.add_flags(p)
    bench_load.add_flags(p)
    p.set_defaults(func=run_bench)


# --- bench ---------------------------------------------------------------------------


def _split(text: str, flag: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise HarnessError(f"{flag} {text!r}: give at least one name (comma-separated)")
    if len(set(items)) != len(items):
        raise HarnessError(f"{flag} {text!r}: a name appears twice")
    return items


def _modes(text: str | None, backend: Any, with_explicit: list[str]) -> list[PrecisionMode]:
    """The modes to run, each one the backend can build (refused here, not as failed cases)."""
    from harness.bench.runner import EXPLICIT_MODE, default_modes

    if text is None:
        modes = list(default_modes(backend))
        return modes + [EXPLICIT_MODE] if with_explicit else modes
    modes = [backend.check_mode(PrecisionMode.parse(m, "--modes")) for m in _split(text, "--modes")]
    if EXPLICIT_MODE in modes and not with_explicit:
        raise HarnessError("mode 'explicit' needs --explicit FILE (or an explicit file per model in the project file)")
    return modes


def _backend(name: str) -> Any:
    from harness.engines.registry import get_backend

    return get_backend(name)


def _output_path(args: argparse.Namespace, machine_id: str, shard: tuple[int, int] | None) -> Path:
    """Where the run goes: ``-o FILE``, a new run file in ``-o DIR``, or the default place."""
    from harness.bench.store import FileStore, ResultsStore, run_name
    from harness.fileio import check_writable

    if args.output is not None and not Path(args.output).is_dir():
        return check_writable(args.output, "-o")
    if args.resume:
        raise HarnessError(
            f"--resume needs -o FILE, the results file of the interrupted run (got {args.output or 'no -o'})"
        )
    if args.output is not None:  # a directory: a new run file in it
        output = Path(args.output) / run_name(shard=shard)
    else:
        store: ResultsStore = FileStore(Path(DEFAULT_ROOT))
        output = store.new_run(machine_id, shard=shard)
    return check_writable(output, "-o")


def _check_caches(cache_dir: Path, matrix: list[Any], runner: Any) -> None:
    """Every cache the run would read must load and fit this backend, before any case runs."""
    from harness.build import load_cache
    from harness.fileio import check_writable_dir

    # A file in its place or on its parent chain, a dangling link, a read-only parent:
    # refused now, not as every case failing after the run started.
    check_writable_dir(cache_dir, "--cache-dir")
    for model, mode, batch in matrix:
        config = runner.config(model, mode)
        path = runner.cache_path(model, config, batch)
        if path is not None and path.exists():
            load_cache(path, runner.backend, config)


def _plans(refs: list[str], project: Any, args: argparse.Namespace, load: Any) -> dict[str, Any]:
    """Per model: its autocast settings (defaults < project file < flags) and explicit file
    (``load``: the run's model loader, which gives model files their input options)."""
    from harness.autocast import options
    from harness.bench.runner import ModelPlan
    from harness.engines.modes import load_explicit

    plans: dict[str, Any] = {}
    names: dict[str, str] = {}
    examples: dict[str, Any] = {}
    cli = options.given(args)
    for ref in refs:
        spec = load(ref, None)
        name, examples[ref] = spec.name, spec.example_inputs
        if name in names:
            raise HarnessError(
                f"models {names[name]!r} and {ref!r} are both named {name!r}; results name a model by "
                "its ModelSpec.name (or factory name), so give them different names"
            )
        names[name] = ref
    project.check_model_tables({ref: name for name, ref in names.items()}, lambda ref: load(ref, None).name)
    for name, ref in names.items():
        explicit = args.explicit or project.explicit_for(ref, name)
        if explicit is not None:
            load_explicit(explicit)
        # a calibration file that does not fit a model fails here, naming the file, before any case runs
        settings = project.autocast_settings(ref, cli, name, example_inputs=examples[ref])
        plans[ref] = ModelPlan(settings, explicit)
    return plans


def _model_settings(ref: str, plan: Any, modes: list[PrecisionMode], runner: Any) -> dict[str, Any]:
    """How a model is built, as the results record it.

    ``autocast`` is what the user set (file and flags), without the low
    precision type, which each mode decides; ``modes`` holds, per mode, the
    settings the engine was really compiled under and their digest (None
    where the mode's graph does not depend on them): the digest in the cache
    file's name and in the engine fingerprint.
    """
    from harness.project import portable_path, portable_reference

    given = plan.autocast.to_json()
    del given["low_precision_type"]
    configs = {mode: runner.config(ref, mode) for mode in modes}
    return {
        "reference": portable_reference(ref),
        "explicit": None if plan.explicit is None else portable_path(plan.explicit),
        "autocast": given,
        "modes": {
            mode: {"compiler_settings": config.compiler_settings(), "autocast_digest": config.autocast_digest()}
            for mode, config in configs.items()
        },
    }


def _clock_lock(request: str | int | None, backend: Any) -> contextlib.AbstractContextManager[object]:
    """What ``--lock-clocks`` holds around the run (:mod:`harness.bench.clocks`): nothing without it.

    Refused, before any work, for a backend that runs on the CPU.
    """
    if request is None:
        return contextlib.nullcontext()
    _require_gpu_backend(f"--lock-clocks {request}", "locks the clock of the GPU a GPU backend runs on", backend)
    from harness.bench.clocks import locked_clocks

    return locked_clocks(request)


def _require_gpu_backend(flag: str, what: str, backend: Any) -> None:
    """Refuse ``flag`` (which ``what``) for a backend that runs on the CPU."""
    from harness.bench.runner import GPU_BACKENDS

    if backend.name not in GPU_BACKENDS:
        raise HarnessError(
            f"{flag}: the {backend.name} backend runs on the CPU, and the flag {what} (--backend tensorrt, "
            "which 'auto' picks where TensorRT imports and a GPU is visible); drop the flag"
        )


@dataclasses.dataclass
class _Run:
    """One ``harness bench``, every setting resolved and checked, before a file is written."""

    output: Path
    machine: dict[str, Any]
    settings: dict[str, Any]  # the results file's ``settings``
    runner: Any  # harness.bench.runner.BenchRunner
    matrix: list[Any]
    peer_matrix: list[Any]
    notes: list[str]
    clock_lock: contextlib.AbstractContextManager[object]
    engine_cases: int = 0  # the matrix's cases times the scenarios
    cache_dir_given: bool = False  # by --cache-dir or the project file (else the default beside the output)

    def total(self) -> int:
        return (self.engine_cases or len(self.matrix)) + len(self.peer_matrix)


def run_bench(args: argparse.Namespace) -> int:
    """Resolve every setting (defaults < project file < flags, all refusals first), run the
    matrix into the results file under the clock lock, then report: 0, 1 a case failed, 130
    interrupted."""
    from harness.bench.ray_executor import check_executor

    executor = check_executor(args.executor, args.ray_address, args.lock_clocks)
    run = _resolve(args)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    if executor == "ray":
        return _bench_on_ray(run, args)
    # both taken before the results file is written; released on every way out
    with run.clock_lock, _cache_lock(run.runner.cache_dir):
        doc = _measure(run, args)
    if doc is None:
        return 130
    report_run(doc, run.output, args.no_plots, args.summary_md)
    return _failures(doc, run.total())


def _bench_on_ray(run: _Run, args: argparse.Namespace) -> int:
    """The matrix on a Ray cluster (:mod:`harness.bench.ray_executor`): one results file per machine
    kind, in a directory named by its machine id where a local run's file would be (its timing caches
    beside it, or in ``<--cache-dir>/<machine id>``); each reported as a local run is."""
    from harness.bench import ray_executor
    from harness.fileio import check_writable
    from harness.project import portable_path

    root = run.output.parent.parent if args.output is None else run.output.parent

    def files(machine_id: str) -> ray_executor.KindFiles:
        output = check_writable(root / machine_id / run.output.name, "-o")
        given = run.runner.cache_dir
        cache_dir = None if given is None else (given / machine_id if run.cache_dir_given else output.parent / "caches")
        settings = {**run.settings, "cache_dir": None if cache_dir is None else portable_path(cache_dir)}
        return ray_executor.KindFiles(output, cache_dir, settings)

    done = ray_executor.run_on_ray(
        run.runner, run.matrix, run.peer_matrix, address=args.ray_address, files=files, resume=args.resume,
        progress=not args.no_progress,
    )  # fmt: skip
    codes = []
    for kind in done.kinds:
        summary = args.summary_md
        if summary is not None and len(done.kinds) > 1:  # one table per machine kind, never one across them
            summary = os.fspath(Path(summary).with_name(f"{Path(summary).stem}-{kind.id}{Path(summary).suffix}"))
        report_run(kind.doc, kind.files.output, args.no_plots, summary)
        codes.append(_failures(kind.doc, len(kind.doc["cases"])))
        if done.interrupted:
            print(
                f"interrupted: {len(kind.doc['cases'])} cases kept in {kind.files.output} (marked incomplete; finish "
                f"it by repeating the command with --resume -o {root / run.output.name})",
                file=sys.stderr,
            )  # fmt: skip
    return 130 if done.interrupted else max(codes, default=0)


def _cache_lock(directory: Path | None) -> contextlib.AbstractContextManager[object]:
    """The cache directory, held for the whole run: a second bench on the same directory
    waits (saying so) rather than mix its tactics into this run's caches."""
    if directory is None:
        return contextlib.nullcontext()
    from harness.fileio import locked_directory

    def waiting() -> None:
        print(
            f"waiting: another process holds the cache directory {directory} "
            "(a bench holds it for its whole run); this run starts when it is released",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    return locked_directory(directory, "--cache-dir", waiting)


def _resolve(args: argparse.Namespace) -> _Run:
    """Every setting of the run, refused here if it cannot work."""
    from harness.bench.machine import machine_info
    from harness.bench.peers import peer_cases, resolve_peers
    from harness.bench.runner import (
        DEFAULT_THREADS,
        EXPLICIT_MODE,
        BenchRunner,
        build_matrix,
        default_models,
    )
    from harness.bench.scenario_run import check_cores
    from harness.fileio import check_writable
    from harness.precision import run_precisions
    from harness.project import load_project, portable_path

    for flag, given in (("--cache-dir", args.cache_dir is not None), ("--ignore-mismatch", args.ignore_mismatch)):
        if args.disable_cache and given:
            raise HarnessError(f"--disable-cache and {flag} contradict each other; give one")
    project = load_project(args.config)
    shard = args.shard  # (i, n), checked by argtypes.shard
    notes: list[str] = []
    peer_names = _split(args.peers, "--peers") if args.peers is not None else list(project.get("peers") or [])
    # a peer whose runtime is not installed here is left out with a note naming its extra
    peers = resolve_peers(peer_names, "--peers" if args.peers is not None else f"{project.where}: peers", notes)
    threads = project.threads(args.threads, default=DEFAULT_THREADS)
    if args.models is not None:
        refs = _split(args.models, "--models")
    elif project.models():
        refs = project.models() or []
    else:  # the default zoo: a model whose extra is missing is left out, with a note naming it
        refs, left_out = default_models()
        notes += left_out
    backend = _backend(project.setting("backend", args.backend, "auto"))
    clock_lock = _clock_lock(args.lock_clocks, backend)
    if args.cuda_graph:
        _require_gpu_backend("--cuda-graph", "captures a GPU engine's enqueue in a CUDA graph", backend)
    scenarios = bench_load.scenarios_from(args, project)
    input_options = bench_load.input_options_for(refs, args, project)
    load = bench_load.loader(input_options)
    plans = _plans(refs, project, args, load)
    with_explicit = [ref for ref, plan in plans.items() if plan.explicit is not None]
    modes_text = args.modes if args.modes is not None else (",".join(project.get("modes") or []) or None)
    modes = _modes(modes_text, backend, with_explicit)
    if EXPLICIT_MODE in modes and len(with_explicit) != len(refs):
        lacking = ", ".join(r for r in refs if r not in with_explicit)
        raise HarnessError(f"mode 'explicit' needs an explicit precision file for every model; none for {lacking}")
    measure = _measure_settings(args, project, threads)
    from harness.bench.runner import GPU_BACKENDS

    for scenario in scenarios if backend.name not in GPU_BACKENDS else ():  # GPU workers are streams
        check_cores(scenario, measure.threads)
    if args.summary_md is not None:
        check_writable(args.summary_md, "--summary-md")
    machine = machine_info()
    output = _output_path(args, machine["id"], shard)
    cache_dir = Path(project.setting("cache_dir", args.cache_dir, output.parent / "caches"))
    batch_sizes = project.setting("batch_sizes", args.batch_sizes)
    for ref in refs if batch_sizes else ():
        for size in batch_sizes:
            load(ref, size)  # a model that cannot sweep is refused now
    matrix = build_matrix(refs, modes, shard, batch_sizes or (None,))
    peer_matrix, peer_notes = peer_cases(refs, peers, run_precisions(modes), batch_sizes or (None,), shard)
    if peers and not run_precisions(modes):
        peer_notes.append("no peer runs: the modes have no single precision to compare with (explicit only)")
    runner = BenchRunner(
        backend,
        cache_dir=None if args.disable_cache else cache_dir,
        settings=measure,
        plans=plans,
        ignore_cache_mismatch=args.ignore_mismatch,
        batch_sizes=batch_sizes or (),
        load_model=load,
        scenarios=scenarios,
    )
    if not args.disable_cache:
        _check_caches(cache_dir, matrix, runner)
    if not args.no_plots and plots_missing() is None:  # missing: said after the run, with the table
        from harness.bench.plots import check_plot_paths

        check_plot_paths(
            output, [runner.name_of(r) for r in refs], sweep=len(batch_sizes or ()) > 1,
            scenarios=any(not s.single_stream for s in scenarios),
        )  # fmt: skip
    # Shards of one run must carry equal settings (merge checks them), so the
    # shard is in the file name and the measured overhead in each case, not here;
    # paths are relative to the current directory (portable_path), so shards run
    # from the roots of two checkouts merge.
    settings = {
        "backend": backend.name,
        "models": [runner.name_of(r) for r in refs],
        "modes": modes,
        "quick": bool(args.quick),
        "threads": measure.threads,
        "batch_sizes": batch_sizes,
        "measure": measure.to_dict(),
        "cache_dir": None if args.disable_cache else portable_path(cache_dir),
        "project": None if project.path is None else project.to_json(),
        "model_settings": {runner.name_of(ref): _model_settings(ref, plan, modes, runner) for ref, plan in plans.items()},
        "ignore_cache_mismatch": args.ignore_mismatch,
        "peers": peer_names,
        **({} if args.lock_clocks is None else {"lock_clocks": args.lock_clocks}),
        # only where they differ from today's one single-stream measurement of factory models
        **({} if [s.label() for s in scenarios] == ["single-stream"] else {
            "scenarios": [{"name": s.name, "label": s.label(), **s.params()} for s in scenarios]
        }),
        **({} if not input_options else {
            "inputs": {runner.name_of(ref): o.to_json() for ref, o in input_options.items()}
        }),
    }  # fmt: skip
    notes += _source_notes(refs, load, backend, modes)
    if peer_matrix and not any(s.single_stream for s in scenarios):
        notes.append("no peer runs: peers are timed single-stream, and --scenario leaves it out")
        peer_matrix = []
    total = len(matrix) * len(scenarios)
    given = args.cache_dir is not None or project.setting("cache_dir", None, None) is not None
    return _Run(output, machine, settings, runner, matrix, peer_matrix, notes + peer_notes, clock_lock, total, given)


def _source_notes(refs: list[str], load: Any, backend: Any, modes: list[PrecisionMode]) -> list[str]:
    """What a reader should know about model files before the run: an ONNX file that did not
    convert (its cases in the modes that need the conversion will fail, saying so)."""
    from harness.sources import route, source_of

    notes = []
    for ref in refs:
        source = source_of(load(ref, None))
        if source is None or source.conversion_error is None:
            continue
        blocked = [m for m in modes if route(load(ref, None), backend.name, m) == "graph"]
        if blocked:
            notes.append(f"{source.conversion_error} (cases {', '.join(blocked)} on {backend.name} will fail)")
    return notes


def _measure_settings(args: argparse.Namespace, project: Any, threads: int) -> Any:
    """How long each case is measured: ``--quick`` or the file's ``[timing]``, then the flags."""
    from harness.bench.runner import QUICK, MeasureSettings

    timing = project.section("timing")
    spread = args.spread_threshold if args.spread_threshold is not None else timing.pop("spread_threshold", None)
    timing.pop("spread_threshold", None)
    try:
        measure = dataclasses.replace(
            QUICK if args.quick else MeasureSettings(**timing), threads=threads, cuda_graph=args.cuda_graph
        )
    except HarnessError as exc:  # the bounds of harness.limits; NaN passes the file's schema
        raise HarnessError(f"{project.where}: {exc}" if timing else str(exc)) from None
    if args.spread_threshold is not None:  # parsed with the command line
        return dataclasses.replace(measure, spread_threshold=args.spread_threshold)
    if spread is not None:
        source = f"{project.where}: [timing] spread_threshold"
        return dataclasses.replace(measure, spread_threshold=parse_threshold(str(spread), source))
    return measure


def _measure(run: _Run, args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the matrix into a new (or the resumed) results file; None when interrupted, the
    finished cases kept in a file marked incomplete and reported."""
    from harness.bench.results import ResultsWriter

    if args.resume:
        writer = ResultsWriter.resume(run.output, settings=run.settings, machine=run.machine)
    else:
        writer = ResultsWriter.create(run.output, settings=run.settings, machine=run.machine)
    try:
        doc: dict[str, Any] = run.runner.run(run.matrix, writer, progress=not args.no_progress, extra=run.peer_matrix)
        return doc
    except KeyboardInterrupt:
        report_run(writer.doc, run.output, args.no_plots, args.summary_md)
        print(
            f"interrupted: {len(writer.doc['cases'])} of {run.total()} cases kept in "
            f"{run.output} (marked incomplete; finish it by repeating the command with --resume -o {run.output})",
            file=sys.stderr,
        )
        return None


def _failures(doc: dict[str, Any], total: int) -> int:
    """1 (naming them) when cases failed, else 0."""
    from harness.bench.results import is_peer

    failed = [
        f"{c['model']}/{c['mode']}" + (f" ({c['backend']})" if is_peer(c) else "")
        for c in doc["cases"] if c["status"] == "failed"
    ]  # fmt: skip
    if failed:
        print(f"{len(failed)} of {total} cases failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
