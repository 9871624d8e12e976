"""``harness inspect DIR --profile``: where a saved engine's run time goes, layer by layer.

The engine runs on its inputs (the model's example inputs with ``--model``,
else inputs of the declared shapes) and reports each layer's op, tactic,
precision and median time, slowest first, with the total and the share of
dispatch overhead (the run's time outside its layers). Only engines that can
time their own layers (the CPU engine) have a profile; the others say so.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from harness.cli import argtypes
from harness.errors import HarnessError

if TYPE_CHECKING:
    from harness.engines.protocol import Engine

# Options that only mean something with --profile.
_PROFILE_ONLY = ("model", "threads", "iters", "warmup", "top", "per_layer")


def add_arguments(inspect: argparse.ArgumentParser) -> None:
    from harness.engines.cpu.profile import DEFAULT_ITERATIONS, DEFAULT_WARMUP

    inspect.add_argument(
        "--profile", action="store_true", help="run the engine and time every layer (cpu engines)"
    )
    inspect.add_argument(
        "--model",
        metavar="REF",
        help="with --profile: run on this model's example inputs (zoo name or path/to/file.py:factory); "
        "default: inputs of the engine's declared shapes",
    )
    inspect.add_argument(
        "--threads", type=argtypes.threads, metavar="N", help="with --profile: intra-op threads (default: torch's)"
    )
    inspect.add_argument(
        "--iters", type=argtypes.iterations, metavar="N", help=f"with --profile: timed runs (default {DEFAULT_ITERATIONS})"
    )
    inspect.add_argument(
        "--warmup", type=argtypes.warmup_runs, metavar="N", help=f"with --profile: untimed runs first (default {DEFAULT_WARMUP})"
    )
    inspect.add_argument(
        "--top", type=argtypes.positive_int, metavar="N", help="with --profile: list the N slowest layers, sum the rest"
    )
    inspect.add_argument(
        "--per-layer",
        action="store_true",
        default=None,
        help="with --profile: call every layer on its own, so each layer of a oneDNN Graph region gets a "
        "time (the engine's run calls a region once, and the profile times what the run calls)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse profile options given without ``--profile`` (they would be silently ignored)."""
    if not args.profile:
        given = [f"--{name.replace('_', '-')}" for name in _PROFILE_ONLY if getattr(args, name) is not None]
        if given:
            raise HarnessError(f"{', '.join(given)}: {'applies' if len(given) == 1 else 'apply'} only with --profile")


def run_profile(args: argparse.Namespace, engine: Engine) -> int:
    from harness.engines.cpu import CpuEngine
    from harness.engines.cpu.profile import DEFAULT_ITERATIONS, DEFAULT_WARMUP

    if not isinstance(engine, CpuEngine):
        raise HarnessError(
            f"--profile needs a cpu engine; {engine.backend} engines do not time their layers one by one"
        )
    from harness.engines.protocol import engine_inputs

    if args.per_layer:
        engine = CpuEngine(engine.plan, regions=False)
    inputs, source = _inputs(args.model)
    if inputs is not None:  # the model's fp32 batch, as the engine takes it (keep_io_types=False)
        inputs = engine_inputs(engine, inputs)
    profile = engine.profile(
        inputs,
        iterations=DEFAULT_ITERATIONS if args.iters is None else args.iters,
        warmup=DEFAULT_WARMUP if args.warmup is None else args.warmup,
        threads=args.threads,
    )
    if args.json:
        print(json.dumps({**profile.to_json(), "engine": str(args.engine), "inputs": source}, indent=2))
        return 0
    print(
        f"profile of {args.engine}: backend cpu, mode {profile.mode}, {profile.layer_count} layers in "
        f"{len(profile.layers)} calls, "
        f"{profile.threads} thread(s), {profile.iterations} runs after {profile.warmup} warm-up, "
        f"inputs: {source}"
    )
    for line in profile.lines(top=args.top):
        print("  " + line)
    return 0


def _inputs(model: str | None) -> tuple[Any, str]:
    """The model's example inputs and a description of them, or (None, "synthetic ...")."""
    if model is None:
        return None, "synthetic (declared shapes; floats N(0,1), integers 0)"
    from harness import models

    spec = models.load(model)
    return tuple(spec.example_inputs), f"model {spec.name}"
