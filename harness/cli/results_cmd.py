"""``harness merge``, ``report``, ``baseline promote``, ``compare`` and ``gate``: commands on results files.

None of them runs a model, so none imports torch, ONNX or a backend: ``nox
-s gate`` installs the harness without its dependencies and only what these
import (jsonschema, numpy, scipy, tabulate, psutil, nvidia-ml-py), and
plotting (``report``) needs the ``plots`` extra. ``harness bench``
(:mod:`.bench_cmd`) shares the report printed after a run.

Exit codes: 0 success (gate: every case passes), 1 the gate failed, 2 bad
input (flags, files; refused before any work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.cli import argtypes
from harness.errors import HarnessError

DEFAULT_ROOT = "results"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from harness.bench.gate import AccuracyTolerances, GateSettings

    m = sub.add_parser("merge", help="join the shards of a run into one results file")
    m.add_argument("shards", nargs="+", metavar="RESULTS")
    m.add_argument("-o", "--output", required=True, metavar="FILE", help="the merged results file to write")
    m.set_defaults(func=run_merge)

    r = sub.add_parser(
        "report",
        help="print the table and write the plots of a stored, merged or old run (or of pytest-benchmark's JSON)",
    )
    r.add_argument("run", metavar="RUN.json")
    r.add_argument("--format", choices=REPORT_FORMATS, default="table",
                   help="table: the table and plots; pytest-benchmark: the run as pytest-benchmark's JSON "
                   "(for pytest-benchmark compare), to -o FILE or stdout")  # fmt: skip
    r.add_argument("-o", "--output", default=None, metavar="FILE", help="where --format pytest-benchmark writes")
    r.add_argument("--summary-md", default=None, metavar="FILE", help="also write the table as Markdown")
    r.add_argument("--no-plots", action="store_true", help="skip the latency-vs-error PNGs")
    r.set_defaults(func=run_report)

    b = sub.add_parser("baseline", help="manage per-machine baselines")
    bsub = b.add_subparsers(dest="baseline_command", required=True, metavar="ACTION")
    promote = bsub.add_parser("promote", help="make a finished run the baseline of its machine")
    promote.add_argument("run", metavar="RUN")
    promote.add_argument("--root", default=DEFAULT_ROOT, help="results root")
    promote.add_argument("--force", action="store_true", help="accept a --quick, unstable or busy run as the baseline (the baseline records what was overridden)")
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
    g.add_argument("--latency-threshold", type=argtypes.threshold, default=None, metavar="PCT",
                   help=f"smallest slowdown of the median that counts, 5%% or 0.05 (default: {defaults.latency_threshold * 100:g}%%)")
    g.add_argument("--alpha", type=argtypes.probability, default=None,
                   help=f"significance level of the Mann-Whitney U test (default: {defaults.alpha})")
    g.add_argument("--max-abs-error-increase", type=argtypes.non_negative, default=None, metavar="X",
                   help=f"largest accepted growth of the max absolute error (default: {tol.max_abs_error_increase})")
    g.add_argument("--cosine-drop", type=argtypes.non_negative, default=None, metavar="X",
                   help=f"largest accepted drop of the cosine similarity (default: {tol.cosine_drop})")
    g.add_argument("--top1-drop", type=argtypes.non_negative, default=None, metavar="X",
                   help=f"largest accepted drop of top-1 agreement, a fraction (default: {tol.top1_drop})")
    g.add_argument("--task-accuracy-drop", type=argtypes.non_negative, default=None, metavar="X",
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
    g.add_argument("--min-judged", type=argtypes.non_negative_int, default=None, metavar="N",
                   help="cases that must be judged (in both runs, latency compared, neither run unstable) for a "
                   "PASS; fewer, with none failing, is INCONCLUSIVE, exit 3 (default: the project file's, else "
                   "every baseline case, or every shared case with --allow-missing)")
    g.add_argument("--config", metavar="FILE",
                   help="project file whose [gate] table sets these (flags win)")
    g.add_argument("--summary-md", default=None, metavar="FILE", help="also write the gate table as Markdown")
    g.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    g.set_defaults(func=run_gate)


# --- report ----------------------------------------------------------------------------


def plots_missing() -> str | None:
    """Why the PNGs cannot be written here (the ``plots`` extra is missing), or None."""
    from harness.extras import PLOT_MODULES, missing

    problem = missing(PLOT_MODULES, "plots", "plotting")
    return None if problem is None else str(problem)


def write_text(path: str, text: str) -> None:
    from harness.fileio import atomic_write_bytes

    atomic_write_bytes(path, text.encode())


def overhead_line(doc: dict[str, Any]) -> str:
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


def report_run(doc: dict[str, Any], output: Path, no_plots: bool, summary_md: str | None) -> None:
    from harness.bench.tables import results_table

    print(results_table(doc))
    print()
    print(overhead_line(doc))
    if not no_plots and doc["cases"]:
        not_written = plots_missing()
        if not_written is not None:
            print(f"note: plots not written: {not_written} (or pass --no-plots)", file=sys.stderr)
        else:
            from harness.bench.plots import plot_results

            for path in plot_results(doc, output):
                print(f"plot: {path}")
    print(f"results: {output}")
    if summary_md is not None:
        write_text(summary_md, f"{results_table(doc, 'github')}\n\n{overhead_line(doc)}\n")
        print(f"markdown summary: {summary_md}")


REPORT_FORMATS = ("table", "pytest-benchmark")


def write_pytest_benchmark(doc: dict[str, Any], output: str | None) -> int:
    """The run as pytest-benchmark's JSON, to ``output`` (atomically) or stdout; the cases left out on stderr."""
    from harness.bench.pytest_benchmark import to_pytest_benchmark

    converted, left_out = to_pytest_benchmark(doc)
    for why in left_out:
        print(f"note: not written (pytest-benchmark records timed runs only): {why}", file=sys.stderr)
    text = json.dumps(converted, indent=2, allow_nan=False) + "\n"
    if output is None:
        sys.stdout.write(text)
    else:
        write_text(output, text)
        print(f"pytest-benchmark JSON: {output} ({len(converted['benchmarks'])} benchmarks)", file=sys.stderr)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from harness.bench.runs import load_run
    from harness.fileio import check_writable

    if args.format != "pytest-benchmark" and args.output is not None:
        raise HarnessError("-o/--output is where --format pytest-benchmark writes; the table goes to stdout")
    if args.format == "pytest-benchmark" and args.summary_md is not None:
        raise HarnessError("--summary-md writes the table, which --format pytest-benchmark does not print")
    for path, flag in ((args.summary_md, "--summary-md"), (args.output, "-o")):
        if path is not None:
            check_writable(path, flag)
    doc = load_run(args.run, upgrade=True)
    if args.format == "pytest-benchmark":
        return write_pytest_benchmark(doc, args.output)
    if not args.no_plots and plots_missing() is None:
        from harness.bench.plots import check_plot_paths

        models = dict.fromkeys(c["model"] for c in doc["cases"])
        check_plot_paths(args.run, models, sweep=any(c.get("batch") is not None for c in doc["cases"]))
    report_run(doc, Path(args.run), args.no_plots, args.summary_md)
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
    from harness.bench.store import FileStore, ResultsStore
    from harness.fileio import check_writable_dir

    check_writable_dir(args.root, "--root")  # a file, or a file on its parent chain: refused before any work
    store: ResultsStore = FileStore(Path(args.root))
    dest = store.promote(args.run, force=args.force)
    print(f"baseline for its machine: {dest} (from {args.run})")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from harness.bench.compare import compare
    from harness.bench.runs import load_run
    from harness.bench.tables import compare_table

    docs = [load_run(path, upgrade=True) for path in (args.a, args.b)]
    for path, doc in zip((args.a, args.b), docs, strict=True):
        for mark in ("upgraded_from", "imported_from"):
            if doc.get(mark):
                print(f"note: {path}: {doc[mark]['note']}", file=sys.stderr)
    comparison = compare(*docs)
    if args.json:
        print(json.dumps(comparison.to_dict(), indent=2))
    else:
        print(compare_table(comparison, "github" if args.markdown else "simple"))
    return 0


# --- gate ------------------------------------------------------------------------------


def parse_threshold(text: str, flag: str = "--latency-threshold") -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05 (a project file's value; flags are parsed by :mod:`.argtypes`)."""
    try:
        return argtypes.threshold_value(text)
    except ValueError as exc:
        raise HarnessError(f"{flag} {exc}") from None


def _gate_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.baseline is not None and args.current is not None:
        return Path(args.baseline), Path(args.current)
    from harness.bench.store import FileStore, ResultsStore
    from harness.docs_links import doc_ref
    from harness.machine import current_machine_id

    if Path(args.root).exists() and not Path(args.root).is_dir():
        raise HarnessError(f"--root {args.root}: is a file, not a directory")
    machine = current_machine_id()
    store: ResultsStore = FileStore(Path(args.root))
    baseline = Path(args.baseline) if args.baseline is not None else store.baseline(machine)
    if args.baseline is None and not baseline.is_file():
        raise HarnessError(
            f"no baseline for machine {machine!r} at {baseline}. A first run has nothing to gate "
            "against: run `harness bench`, then `harness baseline promote RUN` and commit the "
            f"baseline ({doc_ref('guide/gate.md', 'Start gating: the first baseline')}); or pass --baseline FILE"
        )
    current = Path(args.current) if args.current is not None else store.current_run(machine)
    return baseline, current


def run_gate(args: argparse.Namespace) -> int:
    from harness.bench.gate import AccuracyTolerances, GateSettings, gate
    from harness.bench.runs import load_run
    from harness.bench.tables import gate_table
    from harness.fileio import check_writable
    from harness.project import load_project

    # defaults < the project file's [gate] table < flags; the gate reads no autocast settings,
    # so their tables are not checked here (that would need torch, which the gate does without)
    project = load_project(args.config, autocast=False)
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
    if threshold is None:
        threshold = defaults.latency_threshold
    elif "latency_threshold" not in given:  # the flag's value was parsed with the command line
        threshold = parse_threshold(str(threshold), source("latency_threshold"))
    settings = GateSettings(
        latency_threshold=threshold,
        alpha=alpha,
        tolerances=AccuracyTolerances(**values),
        fail_on_unstable=bool(chosen.get("fail_on_unstable", False)),
        allow_missing=bool(chosen.get("allow_missing", False)),
        ignore_isa=bool(chosen.get("ignore_isa", False)),
        min_judged=chosen.get("min_judged"),
    )
    if args.summary_md is not None:
        check_writable(args.summary_md, "--summary-md")
    baseline, current = _gate_inputs(args)
    if baseline.resolve() == current.resolve():
        raise HarnessError(f"baseline and current run are the same file ({current})")
    report = gate(load_run(baseline), load_run(current), settings)
    if args.json:
        print(json.dumps({"baseline": str(baseline), "current": str(current), **report.to_dict()}, indent=2))
    else:
        print(f"gate: {current} against baseline {baseline}")
        print(gate_table(report))
    if args.summary_md is not None:
        write_text(args.summary_md, f"### Regression gate\n\n{gate_table(report, 'github')}\n")
    return report.exit_code
