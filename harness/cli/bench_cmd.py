"""``harness bench``, ``merge``, ``baseline promote``, ``compare``, ``gate`` and ``report``.

Exit codes: 0 success (gate: every case passes), 1 a case failed (bench) or
the gate failed, 2 bad input (flags, files, models, modes; refused before
any work), 130 interrupted (the finished cases are kept in a file marked
incomplete).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from harness.autocast import options
from harness.errors import HarnessError

DEFAULT_ROOT = "results"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from harness.bench.gate import AccuracyTolerances, GateSettings
    from harness.bench.peers import PEER_NAMES
    from harness.bench.runner import DEFAULT_MODELS, DEFAULT_THREADS
    from harness.engines.registry import BACKEND_NAMES

    p = sub.add_parser(
        "bench",
        help="benchmark models x precision modes on one backend",
        description="Build, check accuracy of, and time every (model, mode) case; write one results JSON.",
    )
    p.add_argument("--models", default=None,
                   help="comma-separated zoo names or path/to/file.py:factory "
                   f"(default: the project file's, else {','.join(DEFAULT_MODELS)})")
    p.add_argument("--modes", default=None, help="comma-separated precision modes "
                   "(default: every mode the backend supports; 'explicit' only with --explicit)")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=None,
                   help="auto: TensorRT when it imports and a GPU is visible, else cpu (default: the project "
                   "file's, else auto)")
    p.add_argument("--explicit", default=None, metavar="FILE", help="explicit precision file for mode 'explicit'")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="timing caches, one per (model, mode) (default: caches/ next to the results file)")
    p.add_argument("--shard", default=None, metavar="I/N", help="run every N-th case of the matrix, starting at the I-th")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads of every candidate, pinned for each case (1 gives stable "
                   f"numbers on a shared machine; more measures multi-core speed) (default: the project "
                   f"file's, else {DEFAULT_THREADS})")
    p.add_argument("--batch-sizes", metavar="N,N,...",
                   help="sweep the batch dimension (models that declare ModelSpec.batch_dim or whose factory "
                   "takes batch_size) (default: the project file's, else each model's own)")
    p.add_argument("--peers", default=None, metavar="NAME,...",
                   help="also time plain runtimes on the same inputs and threads, as reference rows at the "
                   f"precisions of the modes: {', '.join(PEER_NAMES)} (default: the project file's, else none)")
    p.add_argument("--ignore-mismatch", action="store_true",
                   help="use timing caches recorded for another configuration (read-only)")
    p.add_argument("--config", metavar="FILE",
                   help="project file (default: ./harness.toml, else [tool.harness] in ./pyproject.toml)")
    p.add_argument("--spread-threshold", default=None, metavar="PCT",
                   help="flag a case unstable above this IQR/median spread, e.g. 5%% or 0.05 "
                   "(default: 5%% on CPU, 2.5%% on GPU)")
    p.add_argument("--quick", action="store_true", help="tiny warm-up and timing windows: checks the pipeline, not the numbers")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help=f"results file, or a directory to write run-<timestamp>.json into "
                   f"(default: {DEFAULT_ROOT}/<machine>/run-<timestamp>.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in -o FILE (same flags), skipping its finished cases")
    p.add_argument("--summary-md", default=None, metavar="FILE", help="also write the table as Markdown (CI job summary)")
    p.add_argument("--no-plots", action="store_true", help="skip the latency-vs-error PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    options.add_flags(p)
    p.set_defaults(func=run_bench)

    m = sub.add_parser("merge", help="join the shards of a run into one results file")
    m.add_argument("shards", nargs="+", metavar="RESULTS")
    m.add_argument("-o", "--output", required=True, metavar="FILE", help="the merged results file to write")
    m.set_defaults(func=run_merge)

    r = sub.add_parser("report", help="print the table and write the plots of a stored, merged or old run")
    r.add_argument("run", metavar="RUN.json")
    r.add_argument("--summary-md", default=None, metavar="FILE", help="also write the table as Markdown")
    r.add_argument("--no-plots", action="store_true", help="skip the latency-vs-error PNGs")
    r.set_defaults(func=run_report)

    b = sub.add_parser("baseline", help="manage per-machine baselines")
    bsub = b.add_subparsers(dest="baseline_command", required=True, metavar="ACTION")
    promote = bsub.add_parser("promote", help="make a finished run the baseline of its machine")
    promote.add_argument("run", metavar="RUN")
    promote.add_argument("--root", default=DEFAULT_ROOT, help="results root")
    promote.add_argument("--force", action="store_true", help="accept a --quick run as the baseline")
    promote.set_defaults(func=run_promote)

    c = sub.add_parser("compare", help="per-case fingerprints, tactics, output digests, latency and accuracy of two runs")
    c.add_argument("a", metavar="A.json")
    c.add_argument("b", metavar="B.json")
    c.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(func=run_compare)

    defaults, tol = GateSettings(), AccuracyTolerances()
    g = sub.add_parser("gate", help="fail on latency, accuracy or determinism regressions against a baseline")
    g.add_argument("--baseline", default=None, metavar="B", help="default: <root>/<machine>/baseline.json")
    g.add_argument("--current", default=None, metavar="C", help="default: the newest run-*.json in <root>/<machine>/")
    g.add_argument("--root", default=DEFAULT_ROOT, help="results root for the defaults")
    g.add_argument("--latency-threshold", default=None, metavar="PCT",
                   help=f"smallest slowdown of the median that counts, 5%% or 0.05 (default: {defaults.latency_threshold * 100:g}%%)")
    g.add_argument("--alpha", type=float, default=None,
                   help=f"significance level of the Mann-Whitney U test (default: {defaults.alpha})")
    g.add_argument("--max-abs-error-increase", type=float, default=None, metavar="X",
                   help=f"largest accepted growth of the max absolute error (default: {tol.max_abs_error_increase})")
    g.add_argument("--cosine-drop", type=float, default=None, metavar="X",
                   help=f"largest accepted drop of the cosine similarity (default: {tol.cosine_drop})")
    g.add_argument("--top1-drop", type=float, default=None, metavar="X",
                   help=f"largest accepted drop of top-1 agreement, a fraction (default: {tol.top1_drop})")
    g.add_argument("--task-accuracy-drop", type=float, default=None, metavar="X",
                   help=f"largest accepted drop of the task accuracy, a fraction (default: {tol.task_accuracy_drop})")
    # --no-X turns off a project file's `X = true` (flags win over the file).
    g.add_argument("--fail-on-unstable", action=argparse.BooleanOptionalAction, default=None,
                   help="an unstable current case fails the gate (default: the project file's, else off)")
    g.add_argument("--allow-missing", action=argparse.BooleanOptionalAction, default=None,
                   help="a baseline case this run lacks does not fail the gate (a subset run) "
                   "(default: the project file's, else off)")
    g.add_argument("--ignore-isa", action=argparse.BooleanOptionalAction, default=None,
                   help="gate a CPU run against a baseline whose CPU has other ISA extensions "
                   "(default: the project file's, else off)")
    g.add_argument("--config", metavar="FILE",
                   help="project file whose [gate] table sets these (flags win)")
    g.add_argument("--summary-md", default=None, metavar="FILE", help="also write the gate table as Markdown")
    g.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    g.set_defaults(func=run_gate)


# --- bench ---------------------------------------------------------------------------


def _split(text: str, flag: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise HarnessError(f"{flag} {text!r}: give at least one name (comma-separated)")
    if len(set(items)) != len(items):
        raise HarnessError(f"{flag} {text!r}: a name appears twice")
    return items


def _modes(text: str | None, backend: Any, with_explicit: list[str]) -> list[str]:
    """The modes to run, each one the backend can build (refused here, not as failed cases)."""
    from harness.bench.runner import EXPLICIT_MODE, default_modes

    if text is None:
        modes = list(default_modes(backend))
        return modes + [EXPLICIT_MODE] if with_explicit else modes
    modes = _split(text, "--modes")
    for mode in modes:
        backend.check_mode(mode)
    if EXPLICIT_MODE in modes and not with_explicit:
        raise HarnessError("mode 'explicit' needs --explicit FILE (or an explicit file per model in the project file)")
    return modes


def _backend(name: str) -> Any:
    from harness.engines.registry import get_backend

    return get_backend(name)


def _write_text(path: str, text: str) -> None:
    from harness.fileio import atomic_write_bytes

    atomic_write_bytes(path, text.encode())


def _overhead_line(doc: dict[str, Any]) -> str:
    """The timing loop's own cost per iteration, as measured next to the cases of this run."""
    from harness.bench.tables import format_ns

    overheads = [
        c["latency"]["overhead"]
        for c in doc["cases"]
        if c.get("latency") is not None and c["latency"].get("overhead") is not None
    ]
    if not overheads:
        timed = any(c.get("latency") is not None for c in doc["cases"])
        why = "not recorded in this file" if timed else "not measured (no case was timed)"
        return f"measurement overhead per iteration: {why}"
    worst = max(overheads, key=lambda o: o["median"])
    return (
        "measurement overhead per iteration (timing loop around an empty call, "
        f"not subtracted from the latencies): median {format_ns(worst['median'])}, "
        f"p99 {format_ns(worst['p99'])}"
    )


def _output_path(args: argparse.Namespace, machine_id: str, shard: tuple[int, int] | None) -> Path:
    """Where the run goes: ``-o FILE``, a new run file in ``-o DIR``, or the default place."""
    from harness.bench.results import new_run_path
    from harness.fileio import check_writable

    if args.output is not None and not Path(args.output).is_dir():
        return check_writable(args.output, "-o")
    if args.resume:
        raise HarnessError(
            f"--resume needs -o FILE, the results file of the interrupted run (got {args.output or 'no -o'})"
        )
    if args.output is not None:  # a directory: a new run file in it
        output = Path(args.output) / new_run_path(DEFAULT_ROOT, machine_id).name
    else:
        output = new_run_path(DEFAULT_ROOT, machine_id)
    if shard is not None:
        output = output.with_name(f"{output.stem}-shard{shard[0]}of{shard[1]}.json")
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
        if path.exists():
            load_cache(path, runner.backend, config)


def _batch_sizes(text: str) -> list[int]:
    """``--batch-sizes N,N,...``, each within 1..MAX_BATCH_SIZE (a huge batch is an OOM kill, not a number)."""
    from harness.limits import MAX_BATCH_SIZE, check_int

    sizes = []
    for part in _split(text, "--batch-sizes"):
        if not part.isdigit() or len(part) > 9:
            raise HarnessError(f"--batch-sizes {text!r}: {part[:30]!r} is not an integer; valid: 1..{MAX_BATCH_SIZE}")
        sizes.append(check_int(int(part), "--batch-sizes", 1, MAX_BATCH_SIZE))
    return sizes


def _plans(refs: list[str], project: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Per model: its autocast settings (defaults < project file < flags) and explicit file."""
    from harness import models
    from harness.autocast import options
    from harness.bench.runner import ModelPlan
    from harness.engines.modes import load_explicit

    plans: dict[str, Any] = {}
    names: dict[str, str] = {}
    cli = options.given(args)
    for ref in refs:
        name = models.load(ref).name
        if name in names:
            raise HarnessError(
                f"models {names[name]!r} and {ref!r} are both named {name!r}; results name a model by "
                "its ModelSpec.name (or factory name), so give them different names"
            )
        names[name] = ref
    project.check_model_tables({ref: name for name, ref in names.items()}, lambda ref: models.load(ref).name)
    for name, ref in names.items():
        explicit = args.explicit or project.explicit_for(ref, name)
        if explicit is not None:
            load_explicit(explicit)
        plans[ref] = ModelPlan(project.autocast_settings(ref, cli, name), explicit)
    return plans


def _model_settings(ref: str, plan: Any, modes: list[str], runner: Any) -> dict[str, Any]:
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


def run_bench(args: argparse.Namespace) -> int:
    from harness.bench.machine import machine_info
    from harness.bench.peers import peer_cases, resolve_peers, run_precisions
    from harness.bench.results import ResultsWriter, is_peer
    from harness.bench.runner import (
        DEFAULT_MODELS,
        DEFAULT_THREADS,
        EXPLICIT_MODE,
        QUICK,
        BenchRunner,
        MeasureSettings,
        build_matrix,
        parse_shard,
    )
    from harness.fileio import check_writable
    from harness.models import load as models_load
    from harness.project import load_project, portable_path

    # Everything that can be refused is refused here, before a file is written.
    project = load_project(args.config)
    shard = parse_shard(args.shard) if args.shard is not None else None
    peer_names = _split(args.peers, "--peers") if args.peers is not None else list(project.get("peers") or [])
    peers = resolve_peers(peer_names, "--peers" if args.peers is not None else f"{project.where}: peers")
    threads = args.threads if args.threads is not None else project.get("threads") or DEFAULT_THREADS
    if not 1 <= threads <= 1024:
        raise HarnessError(f"--threads {threads}: must be from 1 to 1024")
    refs = (
        _split(args.models, "--models") if args.models is not None
        else project.models() or list(DEFAULT_MODELS)
    )  # fmt: skip
    backend = _backend(args.backend or project.get("backend") or "auto")
    plans = _plans(refs, project, args)
    with_explicit = [ref for ref, plan in plans.items() if plan.explicit is not None]
    modes_text = args.modes if args.modes is not None else (",".join(project.get("modes") or []) or None)
    modes = _modes(modes_text, backend, with_explicit)
    if EXPLICIT_MODE in modes and len(with_explicit) != len(refs):
        lacking = ", ".join(r for r in refs if r not in with_explicit)
        raise HarnessError(f"mode 'explicit' needs an explicit precision file for every model; none for {lacking}")
    timing = project.section("timing")
    spread = args.spread_threshold if args.spread_threshold is not None else timing.pop("spread_threshold", None)
    timing.pop("spread_threshold", None)
    try:
        measure = dataclasses.replace(QUICK if args.quick else MeasureSettings(**timing), threads=threads)
    except HarnessError as exc:  # the bounds of harness.limits; NaN passes the file's schema
        raise HarnessError(f"{project.where}: {exc}" if timing else str(exc)) from None
    if spread is not None:
        source = "--spread-threshold" if args.spread_threshold is not None else f"{project.where}: [timing] spread_threshold"
        measure = dataclasses.replace(measure, spread_threshold=parse_threshold(str(spread), source))
    if args.summary_md is not None:
        check_writable(args.summary_md, "--summary-md")
    machine = machine_info()
    output = _output_path(args, machine["id"], shard)
    cache_dir = Path(args.cache_dir or project.get("cache_dir") or output.parent / "caches")
    batch_sizes = _batch_sizes(args.batch_sizes) if args.batch_sizes is not None else project.get("batch_sizes")
    for ref in refs if batch_sizes else ():
        for size in batch_sizes:
            models_load(ref, size)  # a model that cannot sweep is refused now
    matrix = build_matrix(refs, modes, shard, batch_sizes or (None,))
    peer_matrix, peer_notes = peer_cases(refs, peers, run_precisions(modes), batch_sizes or (None,), shard)
    if peers and not run_precisions(modes):
        peer_notes.append("no peer runs: the modes have no single precision to compare with (explicit only)")
    runner = BenchRunner(
        backend,
        cache_dir=cache_dir,
        settings=measure,
        plans=plans,
        ignore_cache_mismatch=args.ignore_mismatch,
        batch_sizes=batch_sizes or (),
    )
    _check_caches(cache_dir, matrix, runner)
    if not args.no_plots:
        from harness.bench.plots import check_plot_paths

        check_plot_paths(output, [runner.name_of(r) for r in refs], sweep=len(batch_sizes or ()) > 1)

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
        "cache_dir": portable_path(cache_dir),
        "project": None if project.path is None else project.to_json(),
        "model_settings": {runner.name_of(ref): _model_settings(ref, plan, modes, runner) for ref, plan in plans.items()},
        "ignore_cache_mismatch": args.ignore_mismatch,
        "peers": peer_names,
    }
    for note in peer_notes:
        print(f"note: {note}", file=sys.stderr)
    if args.resume:
        writer = ResultsWriter.resume(output, settings=settings, machine=machine)
    else:
        writer = ResultsWriter.create(output, settings=settings, machine=machine)
    try:
        doc = runner.run(matrix, writer, progress=not args.no_progress, extra=peer_matrix)
    except KeyboardInterrupt:
        doc = writer.doc
        _report(doc, output, args.no_plots, args.summary_md)
        print(
            f"interrupted: {len(doc['cases'])} of {len(matrix) + len(peer_matrix)} cases kept in {output} "
            f"(marked incomplete; finish it by repeating the command with --resume -o {output})",
            file=sys.stderr,
        )
        return 130
    _report(doc, output, args.no_plots, args.summary_md)
    failed = [
        f"{c['model']}/{c['mode']}" + (f" ({c['backend']})" if is_peer(c) else "")
        for c in doc["cases"] if c["status"] == "failed"
    ]  # fmt: skip
    if failed:
        print(f"{len(failed)} of {len(matrix) + len(peer_matrix)} cases failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _report(doc: dict[str, Any], output: Path, no_plots: bool, summary_md: str | None) -> None:
    from harness.bench.tables import results_table

    print(results_table(doc))
    print()
    print(_overhead_line(doc))
    if not no_plots and doc["cases"]:
        from harness.bench.plots import plot_results

        for path in plot_results(doc, output):
            print(f"plot: {path}")
    print(f"results: {output}")
    if summary_md is not None:
        _write_text(summary_md, f"{results_table(doc, 'github')}\n\n{_overhead_line(doc)}\n")
        print(f"markdown summary: {summary_md}")


def run_report(args: argparse.Namespace) -> int:
    from harness.bench.results import load_results
    from harness.fileio import check_writable

    if args.summary_md is not None:
        check_writable(args.summary_md, "--summary-md")
    doc = load_results(args.run, upgrade=True)
    if not args.no_plots:
        from harness.bench.plots import check_plot_paths

        models = dict.fromkeys(c["model"] for c in doc["cases"])
        check_plot_paths(args.run, models, sweep=any(c.get("batch") is not None for c in doc["cases"]))
    _report(doc, Path(args.run), args.no_plots, args.summary_md)
    return 0


# --- merge, baseline, compare ----------------------------------------------------------


def run_merge(args: argparse.Namespace) -> int:
    from harness.bench.results import merge_results, write_results
    from harness.fileio import check_writable

    output = check_writable(args.output, "-o")
    if output.resolve() in {Path(p).resolve() for p in args.shards}:
        raise HarnessError(f"-o {output}: the merged file must not replace one of its shards")
    doc = merge_results(args.shards)
    write_results(output, doc)
    state = "complete" if doc["complete"] else "INCOMPLETE (a shard was interrupted)"
    print(f"merged {len(args.shards)} files, {len(doc['cases'])} cases, {state}: {output}")
    return 0


def run_promote(args: argparse.Namespace) -> int:
    from harness.bench.results import promote_baseline
    from harness.fileio import check_writable_dir

    check_writable_dir(args.root, "--root")  # a file, or a file on its parent chain: refused before any work
    dest = promote_baseline(args.run, args.root, force=args.force)
    print(f"baseline for its machine: {dest} (from {args.run})")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from harness.bench.compare import compare
    from harness.bench.results import load_results
    from harness.bench.tables import compare_table

    docs = [load_results(path, upgrade=True) for path in (args.a, args.b)]
    for path, doc in zip((args.a, args.b), docs, strict=True):
        if doc.get("upgraded_from"):
            print(f"note: {path}: {doc['upgraded_from']['note']}", file=sys.stderr)
    comparison = compare(*docs)
    if args.json:
        print(json.dumps(comparison.to_dict(), indent=2))
    else:
        print(compare_table(comparison, "github" if args.markdown else "simple"))
    return 0


# --- gate ------------------------------------------------------------------------------


def parse_threshold(text: str, flag: str = "--latency-threshold") -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; a bare number of 1 or more is refused as ambiguous."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise HarnessError(
            f"{flag} {text!r}: expected a percentage such as 5% or a fraction such as 0.05"
        ) from None
    if not raw.endswith("%") and value >= 1:
        raise HarnessError(
            f"{flag} {text!r}: read as the fraction {value:g}, i.e. {value:.0%}; "
            f"write {raw}% for {raw} percent, or a fraction below 1 such as {value / 100:g}"
        )
    if not 0 <= value < 10:
        raise HarnessError(f"{flag} {text!r}: must be between 0% and 1000%")
    return value


_SHARD_NAME = re.compile(r"-shard\d+of\d+\.json$")


def newest_run(directory: Path) -> Path:
    """The newest whole ``run-<timestamp>.json``, by name.

    Shard files (``-shard<i>of<n>``) are skipped: gating one shard would
    report the other shards' cases as missing instead of gating them; merge
    the shards into a ``run-<timestamp>.json`` first.
    """
    runs = sorted(
        p for p in directory.glob("run-*.json") if p.is_file() and not _SHARD_NAME.search(p.name)
    )
    if not runs:
        raise HarnessError(
            f"no run-*.json (other than shards) in {directory}; run `harness bench` "
            "(or `harness merge` the shards) first, or pass --current FILE"
        )
    return runs[-1]


def _gate_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.baseline is not None and args.current is not None:
        return Path(args.baseline), Path(args.current)
    from harness.bench.machine import machine_info
    from harness.bench.results import baseline_path, results_dir

    if Path(args.root).exists() and not Path(args.root).is_dir():
        raise HarnessError(f"--root {args.root}: is a file, not a directory")
    machine = machine_info()["id"]
    baseline = Path(args.baseline) if args.baseline is not None else baseline_path(args.root, machine)
    if args.baseline is None and not baseline.is_file():
        raise HarnessError(
            f"no baseline for machine {machine!r} at {baseline}. A first run has nothing to gate "
            "against: run `harness bench`, then `harness baseline promote RUN` and commit the "
            "baseline (see the README, 'Gating pull requests'); or pass --baseline FILE"
        )
    current = Path(args.current) if args.current is not None else newest_run(results_dir(args.root, machine))
    return baseline, current


def run_gate(args: argparse.Namespace) -> int:
    from harness.bench.gate import AccuracyTolerances, GateSettings, gate
    from harness.bench.results import load_results
    from harness.bench.tables import gate_table
    from harness.fileio import check_writable
    from harness.project import load_project

    # defaults < the project file's [gate] table < flags
    project = load_project(args.config)
    given = {k: v for k, v in vars(args).items() if v is not None}
    chosen = {**project.section("gate"), **given}

    def source(key: str) -> str:
        """Who set ``key``: its flag, else the project file (NaN passes the file's schema)."""
        return f"--{key.replace('_', '-')}" if key in given else f"{project.where}: [gate] {key}"

    defaults, tol = GateSettings(), AccuracyTolerances()
    values = {k: chosen.get(k, getattr(tol, k)) for k in ("max_abs_error_increase", "cosine_drop", "top1_drop", "task_accuracy_drop")}
    for key, value in values.items():
        if not 0 <= value < float("inf"):
            raise HarnessError(f"{source(key)} {value}: must be a finite number >= 0")
    alpha = chosen.get("alpha", defaults.alpha)
    if not 0 < alpha < 1:
        raise HarnessError(f"{source('alpha')} {alpha}: must be strictly between 0 and 1")
    threshold = chosen.get("latency_threshold")
    settings = GateSettings(
        latency_threshold=(
            defaults.latency_threshold if threshold is None
            else parse_threshold(str(threshold), source("latency_threshold"))
        ),
        alpha=alpha,
        tolerances=AccuracyTolerances(**values),
        fail_on_unstable=bool(chosen.get("fail_on_unstable", False)),
        allow_missing=bool(chosen.get("allow_missing", False)),
        ignore_isa=bool(chosen.get("ignore_isa", False)),
    )
    if args.summary_md is not None:
        check_writable(args.summary_md, "--summary-md")
    baseline, current = _gate_inputs(args)
    if baseline.resolve() == current.resolve():
        raise HarnessError(f"baseline and current run are the same file ({current})")
    report = gate(load_results(baseline), load_results(current), settings)
    if args.json:
        print(json.dumps({"baseline": str(baseline), "current": str(current), **report.to_dict()}, indent=2))
    else:
        print(f"gate: {current} against baseline {baseline}")
        print(gate_table(report))
    if args.summary_md is not None:
        _write_text(args.summary_md, f"### Regression gate\n\n{gate_table(report, 'github')}\n")
    return report.exit_code
