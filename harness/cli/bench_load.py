"""``harness bench``'s flags for model files' inputs and for serving scenarios.

Inputs (model files only: ``.onnx``, ``.pt2``, ``hf:DIR``): ``--input-shapes``
(trtexec's ``--shapes``), ``--input-range``, ``--load-inputs``; the project
file's ``[model."<ref>"]`` table holds the same keys (``input_shapes``,
``input_range``, ``load_inputs``) where a team wants them kept; the flags win.

Scenarios (:mod:`harness.bench.scenarios`): ``--scenario`` (one or several,
comma-separated), ``--concurrency`` (alias ``--streams``), ``--latency-bound``,
``--target-rate``, ``--find-rate``, ``--samples-per-query``,
``--query-interval``; the project file's ``[scenario]`` table holds them too
(``names``, ``concurrency``, ``latency_bound``, ``target_rate``, ``find_rate``,
``samples_per_query``, ``query_interval``). A parameter applies to the
scenarios it concerns (``--concurrency`` to all but single-stream,
``--latency-bound`` to server and multi-stream); one that concerns none of
the chosen scenarios is refused, naming the flag.

Every value is parsed where it enters (argparse types), so a bad one is one
error naming the flag and what is valid (exit 2) before anything loads.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harness.errors import HarnessError
from harness.fileio import shown

SCENARIO_NAMES = ("single-stream", "offline", "multi-stream", "server")


def _argtype(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except HarnessError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    wrapped.__name__ = name
    return wrapped


def scenario_names(text: str) -> list[str]:
    """``single-stream,offline,...``: distinct scenario names."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in SCENARIO_NAMES]
    if not names or bad:
        raise HarnessError(f"--scenario {shown(text)}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'empty'}; valid: {', '.join(SCENARIO_NAMES)}")
    if len(set(names)) != len(names):
        raise HarnessError(f"--scenario {shown(text)}: a scenario appears twice")
    return names


def duration(text: str) -> float:
    from harness.bench.scenarios import parse_duration

    return parse_duration(text, "duration")


def rate(text: str) -> float:
    """Queries per second: a number above 0."""
    try:
        value = float(text.strip().removesuffix("/s").removesuffix("qps"))
    except ValueError:
        raise HarnessError(f"rate {shown(text)}: expected queries per second, e.g. 200") from None
    if not (math.isfinite(value) and value > 0):
        raise HarnessError(f"rate {shown(text)}: expected a number of queries per second above 0")
    return value


def count(text: str) -> int:
    raw = text.strip()
    if not raw.isdigit() or len(raw) > 6 or int(raw) < 1:
        raise HarnessError(f"{shown(text)}: expected a positive integer")
    return int(raw)


def add_flags(p: argparse.ArgumentParser) -> None:
    inputs = p.add_argument_group("model files' inputs (.onnx, .pt2, hf:DIR models)")
    inputs.add_argument("--input-shapes", metavar="NAME:DxD...,...",
                        help="the shape of each named input, as trtexec --shapes: pixel_values:1x3x224x224,... "
                        "(default: the file's own, an open batch dimension at 1)")
    inputs.add_argument("--input-range", metavar="[NAME=]DIST(A,B);...",
                        help="what generated inputs are drawn from: uniform(LOW,HIGH) or normal(MEAN,STD), per input "
                        "or for all (default: uniform(-1,1) for floats; ids below the model's vocabulary; masks of ones)")
    inputs.add_argument("--load-inputs", metavar="FILE",
                        help="real inputs by name from an .npz (no pickles) or .safetensors file")
    load = p.add_argument_group("serving scenarios (MLPerf LoadGen's names)")
    load.add_argument("--scenario", type=_argtype(scenario_names, "scenario"), default=None, metavar="NAME[,NAME]",
                      help=f"{', '.join(SCENARIO_NAMES)} (default: the project file's, else single-stream)")
    load.add_argument("--concurrency", "--streams", type=_argtype(count, "concurrency"), default=None, metavar="N",
                      help="workers serving the load: threads on CPU backends (each with --threads intra-op threads; "
                      "N x threads <= cores), CUDA streams on the GPU (default 1)")
    load.add_argument("--latency-bound", type=_argtype(duration, "duration"), default=None, metavar="DURATION",
                      help="the p99 a server (or multi-stream) query must meet, e.g. 10ms")
    load.add_argument("--target-rate", type=_argtype(rate, "rate"), default=None, metavar="QPS",
                      help="server: Poisson arrivals at this many queries per second")
    load.add_argument("--find-rate", action="store_true", default=None,
                      help="server: search the highest rate whose p99 meets --latency-bound")
    load.add_argument("--samples-per-query", type=_argtype(count, "count"), default=None, metavar="N",
                      help="multi-stream: samples per query (default 8, as MLPerf)")
    load.add_argument("--query-interval", type=_argtype(duration, "duration"), default=None, metavar="DURATION",
                      help="multi-stream: a query every DURATION (default 50ms)")


def _project_value(table: Mapping[str, Any], key: str, parse: Callable[[str], Any], where: str) -> Any:
    """A ``[scenario]`` value: a string (a duration, a rate) parsed as its flag is; else as the schema checked it."""
    value = table.get(key)
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except HarnessError as exc:
        raise HarnessError(f"{where}: [scenario] {key}: {exc}") from None


def scenarios_from(args: argparse.Namespace, project: Any) -> list[Any]:
    """The run's scenarios: flags over the project file's ``[scenario]`` table over single-stream."""
    from harness.bench.scenarios import DEFAULT_INTERVAL_S, DEFAULT_SAMPLES_PER_QUERY, Scenario

    table = project.section("scenario") if project is not None else {}
    where = getattr(project, "where", "project file")

    def pick(flag: str, key: str, parse: Callable[[str], Any]) -> Any:
        given = getattr(args, flag)
        return given if given is not None else _project_value(table, key, parse, where)

    names = args.scenario if args.scenario is not None else list(table.get("names") or ["single-stream"])
    if args.scenario is None:
        names = scenario_names(",".join(names))
    concurrency = pick("concurrency", "concurrency", count)
    bound = pick("latency_bound", "latency_bound", duration)
    target = pick("target_rate", "target_rate", rate)
    find = bool(pick("find_rate", "find_rate", lambda text: text))
    per_query = pick("samples_per_query", "samples_per_query", count)
    interval = pick("query_interval", "query_interval", duration)
    concerned = {
        "--concurrency": (concurrency is not None, ("offline", "multi-stream", "server")),
        "--latency-bound": (bound is not None, ("multi-stream", "server")),
        "--target-rate": (target is not None, ("server",)),
        "--find-rate": (find, ("server",)),
        "--samples-per-query": (per_query is not None, ("multi-stream",)),
        "--query-interval": (interval is not None, ("multi-stream",)),
    }
    for flag, (given, wanted) in concerned.items():
        if given and not set(wanted) & set(names):
            raise HarnessError(f"{flag} concerns the {' and '.join(wanted)} scenario(s), and --scenario is {','.join(names)}")
    out = []
    for name in names:
        out.append(
            Scenario(
                name=name,
                concurrency=(concurrency or 1) if name != "single-stream" else 1,
                samples_per_query=per_query or DEFAULT_SAMPLES_PER_QUERY if name == "multi-stream" else DEFAULT_SAMPLES_PER_QUERY,
                interval_s=interval or DEFAULT_INTERVAL_S if name == "multi-stream" else DEFAULT_INTERVAL_S,
                target_rate=target if name == "server" else None,
                latency_bound_s=bound if name in ("server", "multi-stream") else None,
                find_rate=find if name == "server" else False,
            )
        )
    return out


def input_options_for(refs: Sequence[str], args: argparse.Namespace, project: Any) -> dict[str, Any]:
    """Per model file: its input options (flags over its project table); the flags refused for a
    zoo or factory model, whose factory makes its inputs."""
    from harness.sources import is_source_reference
    from harness.sources.inputs import input_options

    flags = {"input_shapes": args.input_shapes, "input_range": args.input_range, "load_inputs": args.load_inputs}
    given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
    files = [r for r in refs if is_source_reference(r)]
    if given and not files:
        raise HarnessError(
            f"{', '.join(given)}: the flag shapes the inputs of model files (.onnx, .pt2, hf:DIR); the models "
            f"given ({', '.join(refs)}) make their own inputs in their factories"
        )
    options = {}
    for ref in files:
        table = project.inputs_table(ref) if project is not None and hasattr(project, "inputs_table") else {}
        values = {k: (v if v is not None else table.get(k)) for k, v in flags.items()}
        where = "" if all(flags[k] is not None or table.get(k) is None for k in flags) else f"{project.where} [model.\"{ref}\"]"
        if values["load_inputs"] is not None and flags["load_inputs"] is None and project is not None:
            values["load_inputs"] = str(project.root / values["load_inputs"])
        options[ref] = input_options(values["input_shapes"], values["input_range"], values["load_inputs"], where=where)
    return options


def loader(options: Mapping[str, Any]) -> Callable[[str, int | None], Any]:
    """The bench's model loader: model files with their input options, the rest as :func:`harness.models.load`."""
    from harness import models
    from harness.sources import is_source_reference, load_source
    from harness.sources.inputs import NO_OPTIONS

    def load(ref: str, batch: int | None = None) -> Any:
        if is_source_reference(ref):
            return load_source(ref, batch, options.get(ref, NO_OPTIONS))
        return models.load(ref, batch)

    return load
