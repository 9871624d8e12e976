"""``harness build``, ``harness rebuild`` and ``harness inspect``: engines from the command line.

``build`` writes an engine directory (plan, weights, ``build_log.json``) and
keeps a timing cache file up to date; ``rebuild`` builds N times and reports
what moved; ``inspect`` loads a saved engine (verifying it) and lists its
layers like TensorRT's engine inspector, or with ``--profile`` runs it and
times every layer (:mod:`harness.cli.profile_report`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any, TextIO

from harness.autocast import options
from harness.cache.timing_cache import TimingCache
from harness.cli import argtypes, profile_report
from harness.engines.protocol import Backend, BuildConfig, BuildLog, Engine
from harness.engines.registry import BACKEND_NAMES, get_backend
from harness.engines.saved import engine_directory, plan_backend
from harness.errors import HarnessError
from harness.fileio import JsonSyntaxError, check_writable, parse_json
from harness.limits import MAX_REBUILDS
from harness.precision import PrecisionMode, mode_argtype

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec


DEFAULT_BACKEND = "cpu"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    build = sub.add_parser("build", help="build an engine for a model in a precision mode")
    _common(build)
    build.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="engine directory to write"
    )
    build.add_argument(
        "--disable-cache", action="store_true", help="time every layer; read and write no cache"
    )
    build.add_argument(
        "--no-editable-cache",
        action="store_true",
        help="use the cache's selections but add no entries to it",
    )
    build.set_defaults(func=run_build)

    rebuild = sub.add_parser(
        "rebuild", help="build N times and report fingerprints, tactic flips, output bits"
    )
    _common(rebuild)
    rebuild.add_argument(
        "--times", type=argtypes.rebuild_times, required=True, metavar="N",
        help=f"number of builds (2..{MAX_REBUILDS})"
    )
    rebuild.add_argument("--json", action="store_true", help="print the report as JSON")
    rebuild.set_defaults(func=run_rebuild)

    inspect = sub.add_parser(
        "inspect",
        help="list the layers and tactics of a saved engine, or of a trtexec build (--trt-log, --trt-layers)",
    )
    inspect.add_argument("engine", metavar="DIR", nargs="?", help="engine directory")
    inspect.add_argument(
        "--backend", choices=BACKEND_NAMES, help="default: the backend named in the engine's plan.json"
    )
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    inspect.add_argument("--trt-log", metavar="LOG", help="verbose log of a trtexec build (trtexec --verbose)")
    inspect.add_argument(
        "--trt-layers",
        metavar="FILE",
        help="the same build's layer information: --exportLayerInfo JSON, or a log with --dumpLayerInfo lines",
    )
    inspect.add_argument(
        "--save-cache", metavar="FILE", help="with --trt-log: write the build as a timing cache (for cache diff)"
    )
    profile_report.add_arguments(inspect)
    inspect.set_defaults(func=run_inspect)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:factory")
    p.add_argument("--mode", required=True, type=mode_argtype, choices=list(PrecisionMode), help="precision mode")
    p.add_argument("--backend", default=None, choices=BACKEND_NAMES,
                   help=f"engine backend (default: the project file's, else {DEFAULT_BACKEND})")
    p.add_argument("--cache", metavar="FILE", help="timing cache JSON (read if it exists)")
    p.add_argument(
        "--error-on-cache-miss", action="store_true", help="fail if a layer would need timing"
    )
    p.add_argument(
        "--ignore-mismatch",
        action="store_true",
        help="use a cache recorded for another configuration",
    )
    p.add_argument(
        "--explicit",
        metavar="FILE",
        help="JSON of node-name regex -> fp32|fp16|bf16 (mode explicit)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend builder option (cpu: timing_runs, warmup_runs); VALUE is JSON or a string",
    )
    p.add_argument("--threads", type=argtypes.threads, default=None,
                   help="intra-op threads to build and run with (default: the project file's, else torch's)")
    p.add_argument("--config", metavar="FILE",
                   help="project file (default: ./harness.toml, else [tool.harness] in ./pyproject.toml)")
    options.add_flags(p)


def _config(args: argparse.Namespace) -> tuple[ModelSpec, BuildConfig, Backend]:
    """The model, the build configuration and the backend: defaults < project file < flags.

    The model is loaded first: its ``[model."<key>"]`` table in the project
    file may name it by reference or by its ModelSpec name, as for ``bench``.
    A model given on the command line is relative to the current directory.
    """
    from harness.project import load_project

    project = load_project(args.config)
    threads = project.threads(args.threads, default=None)
    backend = get_backend(project.setting("backend", args.backend, DEFAULT_BACKEND))
    settings_given = options.given(args)
    project.autocast_settings(args.model, settings_given)  # bad settings fail before the model loads
    spec = project.load_model(args.model)
    config = BuildConfig(
        mode=args.mode,
        # the model table's explicit file is for mode explicit; --explicit with another mode is refused
        explicit_path=args.explicit or (project.explicit_for(args.model, spec.name) if args.mode == "explicit" else None),
        error_on_cache_miss=args.error_on_cache_miss,
        editable_cache=not getattr(args, "no_editable_cache", False),
        disable_cache=getattr(args, "disable_cache", False),
        ignore_cache_mismatch=args.ignore_mismatch,
        options=_options(args.option),
        threads=threads,
        autocast=project.autocast_settings(args.model, settings_given, spec.name, example_inputs=spec.example_inputs),
    )
    return spec, config, backend


def _options(items: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs; VALUE is JSON, else taken as a plain string.

    JSON goes through the harness's one reader: a value nested too deep, an
    integer literal of thousands of digits or NaN is an error naming the
    option, not a traceback (the backend then bounds each option's value).
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise HarnessError(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = parse_json(text, f"--option {key}")
        except JsonSyntaxError:
            options[key] = text
    return options


def run_build(args: argparse.Namespace) -> int:
    from harness.build import build_engine, save_build

    if args.disable_cache and args.cache:
        raise HarnessError("--disable-cache and --cache contradict each other; give one")
    engine_directory(args.output)  # refused now, not after the build
    if args.cache is not None:
        check_writable(args.cache, "--cache")
    spec, config, backend = _config(args)
    result = build_engine(spec, config, backend, args.cache)
    out = save_build(result, args.output)
    layers = result.engine.layers()
    tactics = Counter(layer.tactic for layer in layers)
    print(
        f"built {spec.name} ({config.mode}) on {backend.name} in {result.log.build_seconds:.2f} s"
    )
    tuned = result.cache_hits + result.cache_misses
    print(
        f"layers: {len(layers)} ({tuned} with a tactic choice); "
        f"cache hits: {result.cache_hits}, misses (timed): {result.cache_misses}"
    )
    print("tactics: " + ", ".join(f"{name} x{count}" for name, count in sorted(tactics.items())))
    print(f"fingerprint: {result.engine.fingerprint()}")
    print(f"weights: {result.engine.weights_digest()}")
    if result.cache_path is not None:
        if result.cache_entries_added:
            state = f"+{result.cache_entries_added} entries written"
        elif not config.editable_cache:
            state = "not updated: --no-editable-cache"
        elif result.cache_path.exists():
            state = "unchanged"
        else:
            state = "not written: no layer was timed"
        print(f"cache: {result.cache_path} ({state})")
    print(f"engine: {out}")
    _print_notes(result.log.messages)
    return 0


def _print_notes(messages: list[str], file: TextIO | None = None) -> None:
    """What a build reports but does not fail on (an op joined to no layer, a log without
    timing-cache keys, ...): ``build_log.json`` keeps it, and the user must see it too."""
    for message in dict.fromkeys(messages):
        print(f"note: {message}", file=file)


class _NotingBackend:
    """``backend``, keeping every build's messages: ``rebuild`` reports fingerprints and
    tactics, not build logs, yet what a build could not join or record must be shown."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.name = backend.name
        self.messages: list[str] = []

    def __getattr__(self, attr: str) -> Any:  # all but build(): the backend's own
        return getattr(self._backend, attr)

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[Engine, BuildLog]:
        engine, log = self._backend.build(graph, config, cache)
        self.messages += log.messages
        return engine, log


def run_rebuild(args: argparse.Namespace) -> int:
    from harness.build import rebuild

    spec, config, chosen = _config(args)
    backend = _NotingBackend(chosen)
    report = rebuild(spec, config, backend, args.times, args.cache)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        _print_notes(backend.messages, sys.stderr)  # stdout stays one JSON document
        return 0
    distinct = report.distinct_fingerprints
    print(
        f"rebuilt {report.model} ({report.mode}) on {report.backend} {len(report.fingerprints)} times"
        + (
            f" with cache {report.cache}"
            if report.cache
            else " without a cache (every build timed afresh)"
        )
    )
    print(f"distinct fingerprints: {len(distinct)}")
    for fp in distinct:
        print(
            f"  {fp}  (builds {', '.join(str(i) for i, f in enumerate(report.fingerprints) if f == fp)})"
        )
    flipped = report.flipped
    print(f"layers whose tactic flipped: {len(flipped)}")
    for layer, seen in flipped.items():
        print(f"  {layer}: {' | '.join(seen)}")
    if report.outputs_identical:
        print("outputs on the example inputs: bit-identical across all builds")
    else:
        print(
            f"outputs on the example inputs: differ from build 0 in builds {report.output_mismatches}"
        )
    _print_notes(backend.messages)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    profile_report.check_arguments(args)
    if args.profile and (args.trt_log or args.trt_layers):
        raise HarnessError("--profile runs a saved engine; a trtexec build (--trt-log, --trt-layers) cannot be run here")
    if args.trt_log or args.trt_layers:
        from harness.cli.trtexec_report import run_inspect_trtexec

        return run_inspect_trtexec(args)
    if args.engine is None:
        raise HarnessError("inspect needs an engine directory, or --trt-log and --trt-layers of a trtexec build")
    if args.save_cache:
        raise HarnessError("--save-cache needs a trtexec build (--trt-log and --trt-layers)")
    backend = args.backend or plan_backend(args.engine)[1]
    engine = get_backend(backend).load(args.engine)
    if args.profile:
        return profile_report.run_profile(args, engine)
    layers = engine.layers()
    if args.json:
        print(
            json.dumps(
                {
                    "backend": engine.backend,
                    "mode": engine.mode,
                    "fingerprint": engine.fingerprint(),
                    "compiler_settings": engine.compiler_settings(),
                    "weights_digest": engine.weights_digest(),
                    "size_bytes": engine.size_bytes(),
                    "weight_bytes_by_dtype": engine.weight_bytes_by_dtype(),
                    "layers": [layer.to_json() for layer in layers],
                },
                indent=2,
            )
        )
        return 0
    print(
        f"engine {args.engine}: backend {engine.backend}, mode {engine.mode}, {len(layers)} layers, "
        f"{engine.size_bytes()} bytes"
    )
    print(f"fingerprint: {engine.fingerprint()}\nweights: {engine.weights_digest()}")
    settings = engine.compiler_settings()
    print("autocast settings: " + ("none (the mode's graph does not depend on them)" if settings is None
                                   else json.dumps(settings, sort_keys=True)))  # fmt: skip
    for layer in layers:
        print(
            f"  {layer.name:<32} {layer.layer_type:<14} {','.join(layer.input_dtypes):<18} -> "
            f"{','.join(layer.output_dtypes):<6} {layer.tactic} ({layer.tactic_hash})"
        )
    return 0
