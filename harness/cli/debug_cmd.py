"""``harness debug layers`` and ``harness debug precision``: where error enters, and the plan that meets a target.

``layers`` ranks the layers of a precision mode's typed graph by what keeping
each alone in fp32 removes from the outputs' error (with each layer's impact
when it alone runs low, the error it introduces and the accumulated error),
prints a table or JSON and plots error along the graph's depth.
``precision`` searches the fastest set of fp32 layers that meets
``--target METRIC<=X`` on every batch, prints every step, and writes the
explicit precision file ``harness build --mode explicit`` and ``harness
bench --mode explicit`` take. Bad input is refused before any work, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from harness.autocast import options
from harness.cli import argtypes
from harness.errors import HarnessError
from harness.precision import PrecisionMode, mode_argtype

MAX_SEARCH_SECONDS = 600.0  # timing of one candidate or finalist: beyond it, a hang


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from harness.debug.layers import DEFAULT_RANK_ON, RANK_ON
    from harness.debug.metrics import EAGER_AUTOCAST, ERROR_METRICS, METRICS
    from harness.debug.select import DEFAULT_MIN_SPEEDUP
    from harness.engines.registry import BACKEND_NAMES

    d = sub.add_parser("debug", help="precision debugging: per-layer error, and the fastest plan meeting a target")
    dsub = d.add_subparsers(dest="debug_command", required=True, metavar="ACTION")

    layers = dsub.add_parser(
        "layers",
        help="rank a precision mode's layers by the output error keeping each in fp32 removes",
        description="Run the fp32 reference and the typed graph of --mode on the same batches; per layer "
        "report the outputs' error keeping only it in fp32 removes, the outputs' error when only it runs "
        "low, the error it introduces alone and the accumulated error. Views and copies count as part of "
        "the layer that produced their input.",
    )
    _common(layers, BACKEND_NAMES)
    layers.add_argument("--mode", required=True, type=mode_argtype, choices=list(PrecisionMode), help="precision mode to debug")
    layers.add_argument("--explicit", metavar="FILE", help="explicit precision file (mode explicit)")
    layers.add_argument("--rank-by", default=None, choices=ERROR_METRICS,
                        help="metric that ranks the layers (default: max-abs-err for the effects on the "
                        "outputs, removed and impact; max-rel-err for introduced and accumulated)")
    layers.add_argument("--rank-on", default=DEFAULT_RANK_ON, choices=RANK_ON,
                        help="which error ranks the layers: the outputs' error keeping only it in fp32 removes "
                        "(default), the outputs' error when only it runs low (impact), the error it "
                        "introduces alone, or the error accumulated at its output")
    layers.add_argument("--top", type=argtypes.positive_int, default=20, metavar="N",
                        help="layers shown in the table (--json: all)")
    layers.add_argument("--plot", metavar="FILE.png",
                        help="error-along-depth plot (default: <model>-<mode>-layers.png in the current directory)")
    options.add_flags(layers)
    layers.set_defaults(func=run_layers)

    precision = dsub.add_parser(
        "precision",
        help="search the fastest set of fp32 layers that meets an accuracy target; write it as an explicit file",
        description="Greedy from per-layer sensitivity, then pruned; every candidate is built and run on the "
        "backend. Writes the explicit precision file that build and bench --mode explicit accept.",
    )
    _common(precision, BACKEND_NAMES)
    precision.add_argument("--low", required=True, choices=("bf16", "fp16"), help="low precision of the plan")
    precision.add_argument("--target", required=True, metavar="METRIC<=X",
                           help=f"accuracy to meet on every batch; METRIC: {', '.join(METRICS)}; X: a number, or "
                           f"{EAGER_AUTOCAST} (eager torch.autocast --low's value on the same batches)")
    precision.add_argument("-o", "--output", metavar="FILE",
                           help="explicit precision file to write (default: <model>-<low>-plan.json)")
    precision.add_argument("--cache", metavar="FILE",
                           help="timing cache the candidate builds read and extend (pins tactics across runs)")
    precision.add_argument("--seconds", type=argtypes.seconds(MAX_SEARCH_SECONDS), default=0.3, metavar="S",
                           help="timing of each candidate")
    precision.add_argument("--final-seconds", type=argtypes.seconds(MAX_SEARCH_SECONDS), default=3.0, metavar="S",
                           help="timing of the finalists, side by side in alternating rounds")
    precision.add_argument("--choose", default="fastest", choices=("fastest", "pruned"),
                           help="fastest: the pruned plan, unless a verified plan with more fp32 layers is "
                           "clearly faster (--min-speedup); pruned: always the pruned plan, so the file "
                           "depends on accuracy alone")
    precision.add_argument("--min-speedup", type=argtypes.threshold, default=f"{DEFAULT_MIN_SPEEDUP:.0%}", metavar="PCT",
                           help="how much faster (its whole 95%% interval) another plan must be to replace the "
                           "pruned one, so measurement noise never changes the file")
    precision.add_argument("--plot", metavar="FILE.png", help="search plot (default: the output file's name, .png)")
    precision.set_defaults(func=run_precision)


def _common(p: argparse.ArgumentParser, backends: tuple[str, ...]) -> None:
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:factory")
    p.add_argument("--backend", default="cpu", choices=backends, help="backend the mode or plan is built on")
    p.add_argument("--inputs", metavar="FILE",
                   help="safetensors batches: input0, input1, ... with the batches stacked on a new first "
                   "dimension (default: the model's example inputs and calibration batches)")
    p.add_argument("--threads", type=argtypes.threads, default=None,
                   help="intra-op threads, pinned (default: the project file's, else 1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--config", metavar="FILE",
                   help="project file (default: ./harness.toml, else [tool.harness] in ./pyproject.toml)")


def _threads(args: argparse.Namespace, project: Any) -> int:
    from harness.bench.runner import DEFAULT_THREADS

    threads: int = project.threads(args.threads, default=DEFAULT_THREADS)
    return threads


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _plot_path(args: argparse.Namespace, default: Path) -> Path | None:
    """Where the plot goes; None with --no-plot, or (said on stderr) without the ``plots`` extra."""
    from harness.cli.results_cmd import plots_missing
    from harness.fileio import check_writable

    if args.no_plot:
        if args.plot:
            raise HarnessError("--plot and --no-plot contradict each other; give one")
        return None
    problem = plots_missing()
    if problem is not None:
        if args.plot:  # asked for by name: refused before any work
            raise HarnessError(f"--plot {args.plot}: {problem}")
        print(f"note: plot not written: {problem} (or pass --no-plot)", file=sys.stderr)
        return None
    return check_writable(args.plot or default, "--plot")


def run_layers(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from harness.debug.inputs import load_batches
    from harness.debug.layers import debug_layers
    from harness.engines.registry import get_backend
    from harness.project import load_project

    project = load_project(args.config)
    threads = _threads(args, project)
    given = options.given(args)
    project.autocast_settings(args.model, given)  # bad settings fail before the model loads
    if args.explicit is not None and args.mode != "explicit":
        raise HarnessError(f"--explicit was given, but --mode is {args.mode!r}; use --mode explicit")
    backend = get_backend(args.backend)
    backend.check_mode(args.mode)
    # Loaded as build loads it (relative to the current directory); then the model's table,
    # keyed by its reference or its name, applies.
    spec = project.load_model(args.model)
    settings = project.autocast_settings(args.model, given, spec.name, example_inputs=spec.example_inputs)
    explicit = args.explicit or (project.explicit_for(args.model, spec.name) if args.mode == "explicit" else None)
    if args.mode == "explicit" and explicit is None:
        raise HarnessError("--mode explicit needs an explicit precision file (--explicit FILE)")
    if explicit is not None:
        from harness.engines.modes import load_explicit

        load_explicit(explicit)  # refused now, not after the graphs are built
    batches = load_batches(spec, args.inputs)
    plot = _plot_path(args, Path(f"{_file_part(spec.name)}-{args.mode}-layers.png"))
    with tqdm(total=len(batches), desc="debug layers", unit="batch", file=sys.stderr, disable=args.no_progress) as bar:
        report = debug_layers(
            spec, args.mode, batches, backend=backend, settings=settings, explicit_path=explicit,
            rank_by=args.rank_by, rank_on=args.rank_on, threads=threads, progress=lambda done: bar.update(done - bar.n),
        )  # fmt: skip
    if plot is not None:
        from harness.debug.plots import plot_layers

        plot_layers(report, plot)
    if args.json:
        print(json.dumps({**report.to_json(), "plot": None if plot is None else str(plot)}, indent=2))
        return 0
    print(report.table(top=args.top))
    if plot is not None:
        print(f"plot: {plot}")
    return 0


def run_precision(args: argparse.Namespace) -> int:
    from harness.build import load_cache
    from harness.cache.timing_cache import TimingCache
    from harness.debug.inputs import load_batches
    from harness.debug.metrics import parse_target
    from harness.debug.precision import search_precision
    from harness.engines.protocol import BuildConfig
    from harness.engines.registry import get_backend
    from harness.fileio import check_writable, locked
    from harness.project import load_project

    project = load_project(args.config)
    threads = _threads(args, project)
    target = parse_target(args.target)
    min_speedup = args.min_speedup if args.choose == "fastest" else math.inf
    backend = get_backend(args.backend)
    backend.check_mode(args.low)
    spec = project.load_model(args.model)  # as build loads it: relative to the current directory
    output = check_writable(args.output or f"{_file_part(spec.name)}-{args.low}-plan.json", "-o")
    plot = _plot_path(args, output.with_suffix(".png"))
    cache = None
    if args.cache is not None:
        check_writable(args.cache, "--cache")
        config = BuildConfig(mode=PrecisionMode.EXPLICIT, threads=threads)
        cache = load_cache(args.cache, backend, config) if Path(args.cache).exists() else TimingCache(backend.provenance(config))
    batches = load_batches(spec, args.inputs)
    result = search_precision(
        spec, args.low, target, batches, backend=backend, threads=threads, cache=cache,
        seconds=args.seconds, final_seconds=args.final_seconds, min_speedup=min_speedup,
        progress=not args.no_progress,
    )  # fmt: skip
    result.plan.write(output)
    if cache is not None and result.cache_entries_added:
        with locked(args.cache):  # another process may have added entries meanwhile: keep theirs too
            current = load_cache(args.cache, backend, config) if Path(args.cache).exists() else cache
            for entry in cache.entries():
                if current.query(entry.key) is None:
                    current.update(entry)
            current.save(args.cache)
    if plot is not None:
        from harness.debug.plots import plot_search

        plot_search(result, plot)
    if args.json:
        doc = {**result.to_json(), "output": str(output), "plot": None if plot is None else str(plot)}
        print(json.dumps(doc, indent=2))
        return 0
    print(result.report())
    print(f"\nwrote {output}: build it with harness build --model {args.model} --mode explicit --explicit {output}")
    if plot is not None:
        print(f"plot: {plot}")
    return 0

