"""How long the CPU engine takes to build, per zoo model and precision mode, cold and warm.

``python -m harness.benchmarks.build_bench [--models a,b] [--modes m,n] [--threads N]
[--repeat R] [--json FILE]`` compiles each mode's typed graph, then builds it
twice on that graph:

- cold: an empty timing cache, so every layer with a choice is timed and
  every whole-run decision (precisions, regions, primitives) is taken;
- warm: the cache the cold build filled, so every layer takes its tactic
  from it and nothing is timed (the warm engine must be the cold one).

It prints, per model and mode, the compile time (PyTorch's export and the
autocast compiler: the same for a cold and a warm build, so it is shown
apart), the cold and warm build times, the cold build's ratio to the same
model's fp32 cold build and the cold build's ratio to the warm one, then
whether two targets hold on this CPU: every cold build within
:data:`COLD_TARGET` times its model's fp32 cold build, and every warm build
at least :data:`WARM_TARGET` times faster than its cold build. All builds
of a model run in one process, one after the other, at one pinned thread
count (1 unless ``--threads`` says otherwise); with ``--repeat R`` each
model's modes are built R times in turn and each figure is the median. This
is a benchmark report, not a test: nothing here asserts a target.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import torch

from harness import models
from harness.bench.runner import DEFAULT_THREADS
from harness.build import compile_graph
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.fileio import atomic_write_json, check_writable
from harness.globalstate import pinned_threads
from harness.machine import cpu_info
from harness.precision import PrecisionMode

DEFAULT_MODELS = ("resnet", "transformer", "digits", "mobilenet")
# Every mode but explicit, which needs a file of its own.
DEFAULT_MODES = tuple(m for m in PrecisionMode if m is not PrecisionMode.EXPLICIT)
COLD_TARGET = 5.0  # a cold build of any mode within this many times its model's fp32 cold build
WARM_TARGET = 10.0  # a warm build at least this many times faster than the cold one
MAX_REPEAT = 20


@dataclass(frozen=True)
class BuildTimes:
    """One model and mode: seconds (medians over the repeats) and what the warm build did."""

    model: str
    mode: PrecisionMode
    compile_s: float
    cold_s: float
    warm_s: float
    layers_timed: int  # by the cold build
    warm_timed: int  # layers the warm build timed (0 when every one came from the cache)
    same_engine: bool  # the warm engine's fingerprint is the cold one's, in every repeat


def time_builds(
    name: str, modes: Sequence[PrecisionMode], threads: int, repeat: int, progress: Callable[[str], None]
) -> list[BuildTimes]:
    """Compile, then build cold and warm, every mode of the zoo model ``name``, ``repeat`` times in turn."""
    spec = models.load(name)
    backend = CpuBackend()
    samples: dict[PrecisionMode, list[tuple[float, float, float, int, int, bool]]] = {mode: [] for mode in modes}
    for round_ in range(1, repeat + 1):
        for mode in modes:
            progress(f"{name} {mode} (round {round_} of {repeat})")
            config = BuildConfig(mode=mode, threads=threads)
            gc.collect()  # the last build's garbage is not collected inside the next one's time
            start = time.perf_counter()
            compiled = compile_graph(spec, config, backend)
            compile_s = time.perf_counter() - start
            cache = TimingCache(backend.provenance(config))
            gc.collect()
            start = time.perf_counter()
            cold, cold_log = backend.build(compiled, config, cache)
            cold_s = time.perf_counter() - start
            for entry in cold_log.new_entries:
                cache.update(entry)
            gc.collect()
            start = time.perf_counter()
            warm, warm_log = backend.build(compiled, config, cache)
            warm_s = time.perf_counter() - start
            timed = sum(1 for layer in cold_log.layers if layer.candidates and not layer.from_cache)
            warm_timed = sum(1 for layer in warm_log.layers if layer.candidates and not layer.from_cache)
            same = warm.fingerprint() == cold.fingerprint()
            samples[mode].append((compile_s, cold_s, warm_s, timed, warm_timed, same))
    return [
        BuildTimes(
            name,
            mode,
            statistics.median(s[0] for s in runs),
            statistics.median(s[1] for s in runs),
            statistics.median(s[2] for s in runs),
            max(s[3] for s in runs),
            max(s[4] for s in runs),
            all(s[5] for s in runs),
        )
        for mode, runs in samples.items()
    ]


def report(rows: Sequence[BuildTimes], threads: int, cpu: str) -> str:
    """The table, then each target's verdict on this CPU with its worst case."""
    lines = [
        f"CPU engine build times, {cpu}, {threads} thread(s) pinned; seconds",
        f"  {'model':<12} {'mode':<14} {'compile':>8} {'cold':>8} {'warm':>8} {'cold/fp32':>10} "
        f"{'cold/warm':>10} {'timed':>6}  warm engine",
    ]
    fp32 = {r.model: r.cold_s for r in rows if r.mode == "fp32"}
    for r in rows:
        to_fp32 = f"{r.cold_s / fp32[r.model]:>9.2f}x" if r.model in fp32 else f"{'-':>10}"
        warm = "same" if r.same_engine and not r.warm_timed else (
            f"TIMED {r.warm_timed} layer(s)" if r.warm_timed else "DIFFERS"
        )
        lines.append(
            f"  {r.model:<12} {r.mode:<14} {r.compile_s:>8.2f} {r.cold_s:>8.2f} {r.warm_s:>8.3f} {to_fp32} "
            f"{r.cold_s / r.warm_s:>9.1f}x {r.layers_timed:>6}  {warm}"
        )
    lines.append("")
    judged = [r for r in rows if r.model in fp32]
    if judged:
        worst = max(judged, key=lambda r: r.cold_s / fp32[r.model])
        ratio = worst.cold_s / fp32[worst.model]
        verdict = "holds" if ratio <= COLD_TARGET else "MISSED"
        lines.append(
            f"target: every cold build within {COLD_TARGET:g}x of its model's fp32 cold build: {verdict} "
            f"(worst {worst.model} {worst.mode}: {ratio:.2f}x)"
        )
    else:
        lines.append("target: cold builds against fp32: not judged (fp32 was not among the modes)")
    if rows:
        slowest = min(rows, key=lambda r: r.cold_s / r.warm_s)
        speedup = slowest.cold_s / slowest.warm_s
        verdict = "holds" if speedup >= WARM_TARGET else "MISSED"
        lines.append(
            f"target: every warm build at least {WARM_TARGET:g}x faster than its cold build: {verdict} "
            f"(worst {slowest.model} {slowest.mode}: {speedup:.1f}x)"
        )
    return "\n".join(lines)


def _cpu_name() -> str:
    return f"{cpu_info()['model']}, {torch.backends.cpu.get_cpu_capability()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.benchmarks.build_bench", description=__doc__)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated precision modes")
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help=f"intra-op threads, pinned (default {DEFAULT_THREADS})"
    )
    parser.add_argument("--repeat", type=int, default=1, help=f"builds of each mode, 1 to {MAX_REPEAT} (default 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    mode_names = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        unknown = [m for m in names if m not in models.available()]
        if unknown or not names:
            raise HarnessError(f"--models: {', '.join(unknown) or 'none given'}; valid: {', '.join(models.available())}")
        wrong = [m for m in mode_names if m not in DEFAULT_MODES]
        if wrong or not mode_names:
            raise HarnessError(f"--modes: {', '.join(wrong) or 'none given'}; valid: {', '.join(DEFAULT_MODES)}")
        if not 1 <= args.repeat <= MAX_REPEAT:
            raise HarnessError(f"--repeat {args.repeat}: valid: 1 to {MAX_REPEAT}")
        if args.json is not None:
            check_writable(args.json, "--json")
        stack = ExitStack()
        stack.enter_context(pinned_threads(args.threads))
    except HarnessError as exc:
        parser.error(str(exc))
    started = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {step}", file=sys.stderr, flush=True)

    rows: list[BuildTimes] = []
    with stack:
        for name in names:
            rows += time_builds(name, [PrecisionMode.parse(m) for m in mode_names], args.threads, args.repeat, progress)
    progress("done")
    print(report(rows, args.threads, _cpu_name()))
    if args.json is not None:
        atomic_write_json(args.json, {"threads": args.threads, "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
