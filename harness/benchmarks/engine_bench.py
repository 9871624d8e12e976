"""CPU engine vs eager PyTorch, measured side by side in one run.

``python -m harness.benchmarks.engine_bench [--models a,b] [--seconds S] [--threads N]
[--repeat R] [--json FILE]`` prints, per zoo model:
- fp32: eager module vs the CPU engine built in mode ``fp32`` (speedup =
  eager median / engine median);
- bf16: eager under ``torch.autocast("cpu", torch.bfloat16)`` vs the engine
  built in mode ``autocast-bf16`` (rule-based typing) and, for reference, in
  mode ``amp-bf16`` (the same typing eager autocast applies), with max and
  mean absolute errors against eager fp32;
- build: a cold build (every layer timed, empty cache) vs a warm build (every
  layer from the cache the cold build filled);
- peers: per precision, every CPU-engine mode and the ``onnxruntime`` backend
  next to the plain runtimes of :mod:`harness.bench.peers` (eager, inductor,
  ONNX Runtime, OpenVINO; ``--peers``, default every one installed), with our
  best mode against the fastest peer and the onnxruntime backend against plain
  ONNX Runtime (:mod:`harness.benchmarks.peer_bench`).

The two sides of each ratio are measured in alternating rounds and each side
keeps the median of its round medians, so a burst of load from another
process hits both sides instead of deciding the ratio. A slow phase of a shared
machine can still cover a whole process, so ``--repeat R`` runs everything R
times, each in a process of its own, and ends with each peer ratio's range
(min-max and median) over the runs. Every candidate (eager,
engines, their builds) runs at one pinned intra-op thread count, 1 unless
``--threads`` says otherwise, as ``harness bench`` does. This is a benchmark
report, not a test: nothing here asserts a threshold.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from harness import models
from harness.bench.latency import measure_latency
from harness.bench.peer_names import PEER_NAMES
from harness.bench.peers import Peer, resolve_peers
from harness.bench.runner import DEFAULT_THREADS
from harness.benchmarks.peer_bench import RATIOS_SCHEMA, ranges_report, ratios, side_by_side
from harness.benchmarks.peer_bench import report as peer_report
from harness.build import compile_graph
from harness.cache.timing_cache import TimingCache
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig, Engine
from harness.errors import HarnessError
from harness.fileio import atomic_write_json, check_writable, read_json
from harness.globalstate import pinned_threads
from harness.outputs import flat_tensors
from harness.precision import PRECISIONS, PrecisionMode

# The four models of issue 14's table (mobilenet: MobileNetV3-small-like, depthwise, hardswish, SE).
DEFAULT_MODELS = ("resnet", "transformer", "digits", "mobilenet")

# Many short rounds rather than a few long ones: a slow phase of the shared machine lasting a
# few seconds then covers a few rounds of every candidate instead of most of one candidate's.
ROUNDS = 9
# Each round warms a candidate up again (the candidates before it evicted its weights from the
# caches); the engines compiled and ran before the first round, so a short warm-up does.
ROUND_WARMUP_S = 0.05
MAX_REPEAT = 100


def medians_alternating(fns: Sequence[Callable[[], object]], seconds: float) -> list[float]:
    """Median latency (ms) of each callable: the median of its medians over alternating rounds."""
    per_run = seconds / (len(fns) * ROUNDS)
    medians: list[list[float]] = [[] for _ in fns]
    for _ in range(ROUNDS):
        for fn, own in zip(fns, medians, strict=True):
            result = measure_latency(
                fn, warmup_s=min(ROUND_WARMUP_S, per_run), min_iters=10, min_duration_s=per_run
            )
            own.append(result.summary.median / 1e6)
    return [statistics.median(own) for own in medians]


def abs_errors(run: Callable[..., Any], module: torch.nn.Module, batches: Sequence[Sequence[torch.Tensor]]) -> str:
    """ "max/mean" absolute error against fp32 eager over several batches.

    One batch's max is one element and noisy; the worst over the example and
    calibration batches, with the mean over all of them, compares modes fairly.
    """
    diffs = torch.cat(
        [
            (o.double() - r.double()).abs().flatten()
            for batch in batches
            for o, r in zip(flat_tensors(run(*batch)), flat_tensors(module(*batch)), strict=True)
        ]
    )
    return f"{float(diffs.max()):.2e}/{float(diffs.mean()):.1e}"


def bench_model(name: str, seconds: float, threads: int, engines: dict[str, Engine] | None = None) -> dict[str, Any]:
    """One model's rows; ``threads`` goes into every build configuration (its provenance and timings).

    The engines it builds go into ``engines`` (by mode), for the peers' side by side to reuse.
    """
    engines = {} if engines is None else engines
    spec = models.load(name)
    backend = CpuBackend()
    inputs = spec.example_inputs
    module = spec.module
    row: dict[str, Any] = {"model": name}
    batches = [tuple(inputs), *(tuple(b) for b in spec.calibration_data)]
    with torch.inference_mode():

        def eager() -> object:
            with torch.inference_mode():
                return module(*inputs)

        # fp32, with cold vs warm build on the same compiled graph.
        fp32 = BuildConfig(mode=PrecisionMode.FP32, threads=threads)
        compiled = compile_graph(spec, fp32, backend)
        cache = TimingCache(backend.provenance(fp32))
        start = time.perf_counter()
        engine, cold_log = backend.build(compiled, fp32, cache)
        row["cold_build_s"] = time.perf_counter() - start
        for entry in cold_log.new_entries:
            cache.update(entry)
        start = time.perf_counter()
        warm_engine, _ = backend.build(
            compiled, BuildConfig(mode=PrecisionMode.FP32, error_on_cache_miss=True, threads=threads), cache
        )
        row["warm_build_s"] = time.perf_counter() - start
        row["warm_same_engine"] = warm_engine.fingerprint() == engine.fingerprint()
        engines["fp32"] = engine
        row["eager_fp32_ms"], row["engine_fp32_ms"] = medians_alternating(
            [eager, lambda: engine(*inputs)], seconds
        )
        row["fp32_err"] = abs_errors(engine, module, batches)

        # bf16: the rule-based autocast engine (and the AMP-typed one) vs eager autocast.
        bf16_engines = {}
        for mode in (PrecisionMode.AUTOCAST_BF16, PrecisionMode.AMP_BF16):
            config = BuildConfig(mode=mode, threads=threads)
            try:
                bf16_engines[mode], _ = backend.build(
                    compile_graph(spec, config, backend), config, None
                )
            except HarnessError as exc:
                row[f"{mode}_failure"] = str(exc)
                continue
            row[f"{mode}_err"] = abs_errors(bf16_engines[mode], module, batches)
            engines[mode] = bf16_engines[mode]

        def autocast_run(*batch: torch.Tensor) -> object:
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                return module(*batch)

        def eager_autocast() -> object:
            return autocast_run(*inputs)

        try:
            row["eager_bf16_err"] = abs_errors(autocast_run, module, batches)
        except RuntimeError as exc:
            row["eager_bf16_failure"] = str(exc).splitlines()[0]
        if "eager_bf16_err" in row and len(bf16_engines) == 2:
            rule, amp = bf16_engines[PrecisionMode.AUTOCAST_BF16], bf16_engines[PrecisionMode.AMP_BF16]
            row["eager_bf16_ms"], row["autocast-bf16_ms"], row["amp-bf16_ms"] = medians_alternating(
                [eager_autocast, lambda: rule(*inputs), lambda: amp(*inputs)], seconds
            )
    return row


def report(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"CPU engine benchmark: torch {torch.__version__}, {threads} intra-op thread(s) pinned for every candidate, "
        f"{torch.backends.cpu.get_cpu_capability()}",
        "",
        "fp32: eager PyTorch vs CPU engine (speedup = eager / engine; aim >= 1.2x resnet, >= 0.95x all)",
        f"  {'model':<12} {'eager ms':>9} {'engine ms':>10} {'speedup':>8} {'engine err max/mean':>20}",
    ]
    for r in rows:
        lines.append(
            f"  {r['model']:<12} {r['eager_fp32_ms']:>9.3f} {r['engine_fp32_ms']:>10.3f} "
            f"{r['eager_fp32_ms'] / r['engine_fp32_ms']:>7.2f}x {r['fp32_err']:>20}"
        )
    lines += [
        "",
        "bf16: eager torch.autocast('cpu', bfloat16) vs CPU engine autocast-bf16 (aim >= 1.3x, error no worse);",
        "      amp-bf16 engine (eager autocast's own typing) for reference; errors = max/mean abs vs eager fp32 over the example and calibration batches",
        f"  {'model':<12} {'eager ms':>9} {'err':>17} | {'autocast ms':>11} {'speedup':>8} {'err':>17} | "
        f"{'amp ms':>8} {'speedup':>8} {'err':>17}",
    ]
    for r in rows:
        if "eager_bf16_ms" not in r:
            lines.append(f"  {r['model']:<12} not compared: " + "; ".join(_bf16_outcomes(r)))
            continue
        eager_ms = r["eager_bf16_ms"]
        lines.append(
            f"  {r['model']:<12} {eager_ms:>9.3f} {r['eager_bf16_err']:>17} | "
            f"{r['autocast-bf16_ms']:>11.3f} {eager_ms / r['autocast-bf16_ms']:>7.2f}x {r['autocast-bf16_err']:>17} | "
            f"{r['amp-bf16_ms']:>8.3f} {eager_ms / r['amp-bf16_ms']:>7.2f}x {r['amp-bf16_err']:>17}"
        )
    lines += [
        "",
        "build: cold (every layer timed) vs warm (every layer from the cache) (aim >= 10x)",
        f"  {'model':<12} {'cold s':>8} {'warm s':>8} {'speedup':>8}  same engine",
    ]
    for r in rows:
        lines.append(
            f"  {r['model']:<12} {r['cold_build_s']:>8.3f} {r['warm_build_s']:>8.3f} "
            f"{r['cold_build_s'] / r['warm_build_s']:>7.1f}x  {'yes' if r['warm_same_engine'] else 'NO'}"
        )
    return "\n".join(lines)


def _bf16_outcomes(row: dict[str, Any]) -> list[str]:
    """Why a bf16 comparison could not be made: each side's failure or error."""
    outcomes = []
    for side, label in (
        ("eager_bf16", "eager autocast"),
        ("autocast-bf16", "engine autocast-bf16"),
        ("amp-bf16", "engine amp-bf16"),
    ):
        if f"{side}_failure" in row:
            outcomes.append(f"{label} fails ({row[f'{side}_failure']})")
        else:
            outcomes.append(f"{label} err {row[f'{side}_err']}")
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.benchmarks.engine_bench", description=__doc__
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma-separated zoo names; one not registered is skipped with a note (default: "
        f"{','.join(DEFAULT_MODELS)}; the hf-* models: python -m harness.benchmarks.conformance_bench)",
    )
    parser.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated peers to time side by side, or 'none' (default: every one installed of "
        f"{','.join(PEER_NAMES)})",
    )
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help=f"precisions of the side by side (default: {','.join(PRECISIONS)})"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per ratio")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help=f"whole runs, each in a process of its own, then each ratio's range over them (1 to {MAX_REPEAT}; "
        "default 1): a slow phase of a shared machine can cover a whole process and every ratio measured in it",
    )
    parser.add_argument(
        "--json", default=None, help="also write the peers' ratios to this JSON file (with --repeat, every run's)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"torch intra-op threads, pinned for every candidate: eager, engines and builds (default: "
        f"{DEFAULT_THREADS}, as harness bench: far less sensitive to other processes on a shared machine)",
    )
    args = parser.parse_args(argv)
    try:
        peers, notes = _peers(args.peers)
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        if not precisions or set(precisions) - set(PRECISIONS):
            raise HarnessError(f"--precisions {args.precisions!r}: valid: {', '.join(PRECISIONS)}")
        if not 1 <= args.repeat <= MAX_REPEAT:
            raise HarnessError(f"--repeat {args.repeat}: valid: 1 to {MAX_REPEAT}")
        if args.json is not None:
            check_writable(args.json, "--json")
    except HarnessError as exc:
        parser.error(str(exc))
    if args.repeat > 1:
        return _repeated(args)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    notes += [f"model {m!r} is not in the zoo here: skipped" for m in names if m not in models.available()]
    names = [m for m in names if m in models.available()]
    with ExitStack() as stack:
        try:
            stack.enter_context(pinned_threads(args.threads))
        except HarnessError as exc:
            parser.error(f"--threads: {exc}")
        print(f"threads: {args.threads} (pinned for eager, engines and builds)", flush=True)
        for note in notes:
            print(f"note: {note}", flush=True)
        rows, groups = [], []
        started = time.perf_counter()

        def progress(step: str) -> None:
            print(f"[{time.perf_counter() - started:6.0f} s] {step}", file=sys.stderr, flush=True)

        for number, name in enumerate(names, 1):
            engines: dict[str, Engine] = {}
            progress(f"{name} ({number} of {len(names)}): engines, builds and eager")
            rows.append(bench_model(name, args.seconds, args.threads, engines))
            if peers:
                groups += side_by_side(
                    name, peers, precisions, args.threads, args.seconds, medians_alternating, engines, progress
                )
        progress("done")
    print(report(rows, args.threads))
    if groups:
        print()
        print(peer_report(groups, args.threads))
    if args.json is not None:
        atomic_write_json(args.json, ratios(groups))
    return 0


def _repeated(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.repeat`` times, each in a new process, then print each ratio's
    range. Each run's ratios are kept as it ends (in ``--json``, rewritten whole), so an
    interrupted series keeps the runs it finished; a failed run is reported and left out."""
    child = [sys.executable, "-m", "harness.benchmarks.engine_bench", "--models", args.models]
    child += ["--precisions", args.precisions, "--seconds", str(args.seconds), "--threads", str(args.threads)]
    child += [] if args.peers is None else ["--peers", args.peers]
    runs: list[dict[str, Any]] = []
    failed = []
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as scratch:
        for k in range(1, args.repeat + 1):
            print(f"== run {k} of {args.repeat}, a process of its own ==", flush=True)
            path = Path(scratch) / f"run{k}.json"
            code = subprocess.run([*child, "--json", str(path)], check=False).returncode
            if code != 0 or not path.is_file():
                failed.append(f"run {k} exited with {code}")
                print(f"note: {failed[-1]}; left out of the ranges", flush=True)
                continue
            runs.append(read_json(path, RATIOS_SCHEMA, f"run {k}'s ratios"))
            if args.json is not None:
                atomic_write_json(args.json, {"runs": runs})
    print()
    if runs:
        print(ranges_report(runs))
    for note in failed:
        print(f"note: {note}")
    return 1 if failed else 0


def _peers(text: str | None) -> tuple[list[Peer], list[str]]:
    """The peers asked for (all of them must be installed), or every installed one with notes on the rest."""
    if text is not None:
        names = [n.strip() for n in text.split(",") if n.strip()]
        return ([] if names == ["none"] else resolve_peers(names)), []
    peers, notes = [], []
    for name in PEER_NAMES:
        try:
            peers += resolve_peers([name])
        except HarnessError as exc:
            notes.append(f"left out: {exc}")
    return peers, notes


if __name__ == "__main__":
    raise SystemExit(main())
