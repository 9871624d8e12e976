"""The searched precision plan against the CPU engine's bf16 modes, side by side in one run.

``python -m harness.benchmarks.precision_bench [--models ...] [--threads N] [--seconds S]``
runs, per model (the zoo ``transformer`` and ``transformers`` BERT,
DistilBERT and a Whisper encoder from small configs, the conformance
suite's ``hf-*`` entries):

- ``harness debug precision`` at the target "max abs error <= eager
  ``torch.autocast`` bf16's max abs error on the same batches" (the example
  and calibration batches), on the CPU backend;
- the CPU engine in ``amp-bf16`` and ``autocast-bf16``;

then measures every engine's max abs error against eager fp32 (worst over the
same batches) and times them in alternating rounds with the thread count
pinned. Besides the chosen plan it times the pruned plan (fewest fp32
layers) when the search chose another. It prints the ratios; the aim is the
searched plan meeting eager autocast's accuracy with latency no worse than
the ``amp-bf16`` engine's. This prints a report; it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from typing import Any

import torch

from harness import models
from harness.bench.accuracy import compare_outputs
from harness.benchmarks.engine_bench import medians_alternating
from harness.build import build_engine
from harness.debug import parse_target, search_precision
from harness.debug.inputs import Batch, model_batches
from harness.debug.metrics import ErrorStats
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig, Engine
from harness.globalstate import preserved_global_state
from harness.precision import PrecisionMode

MODELS = ("transformer", "hf-bert", "hf-distilbert", "hf-whisper-encoder")
ENGINE_MODES = (PrecisionMode.AMP_BF16, PrecisionMode.AUTOCAST_BF16)
TARGET = "max-abs-err<=eager-autocast"


def max_abs_error(engine: Engine, module: torch.nn.Module, batches: Sequence[Batch]) -> float:
    """Worst max abs error against eager fp32 over ``batches`` (the metric of the search's target)."""
    worst = ErrorStats.exact()
    with torch.inference_mode():
        for batch in batches:
            worst = worst.worst(ErrorStats.of(compare_outputs(engine(*batch), module(*batch))))
    return worst.value("max-abs-err")


def bench_model(name: str, threads: int, seconds: float, search_seconds: float) -> dict[str, Any]:
    spec = models.load(name)
    batches = model_batches(spec)
    backend = CpuBackend()
    start = time.perf_counter()
    result = search_precision(
        spec, "bf16", parse_target(TARGET), batches, backend=backend, threads=threads,
        seconds=search_seconds, progress=True,
    )  # fmt: skip
    search_s = time.perf_counter() - start
    engines: dict[str, Engine] = {}
    assert result.chosen.engine is not None
    engines["searched"] = result.chosen.engine
    pruned = next(f.evaluation for f in result.finalists if f.role == "pruned")
    if pruned is not result.chosen and pruned.engine is not None:
        engines["pruned"] = pruned.engine
    for mode in ENGINE_MODES:
        engines[mode] = build_engine(spec, BuildConfig(mode=mode, threads=threads), backend).engine
    errors = {label: max_abs_error(engine, spec.module, batches) for label, engine in engines.items()}
    inputs = spec.example_inputs
    with torch.inference_mode():
        times = medians_alternating([functools.partial(e, *inputs) for e in engines.values()], seconds)
    return {
        "model": name,
        "target": result.target.limit,
        "plan": result.plan.describe(),
        "pruned": result.minimal.describe(),
        "layers": len(result.layers),
        "steps": len(result.steps),
        "search_s": search_s,
        "errors": errors,
        "latency_ms": dict(zip(engines, times, strict=True)),
    }


def _fp32_layers(description: str, total: int) -> str:
    if description.startswith("all fp32"):
        return str(total)
    if description.startswith("all "):
        return "0"
    return description.split(" ", 1)[0]


def report(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"precision search vs the CPU engine's bf16 modes: torch {torch.__version__}, {threads} thread(s), "
        f"{torch.backends.cpu.get_cpu_capability()}",
        "target per model: max abs error <= eager torch.autocast bf16's, worst over the example and calibration "
        "batches; errors: max abs vs eager fp32 over the same batches; latencies: medians of alternating rounds (ms)",
        "",
        f"{'model':<20}{'eager-ac err':>13}{'searched err':>13}{'ms':>8}{'fp32 layers':>13}"
        f"{'amp-bf16 err':>13}{'ms':>8}{'autocast-bf16 err':>18}{'ms':>8}"
        f"{'vs amp':>8}{'vs autocast':>12}{'err/eager':>10}{'steps':>7}{'search s':>9}",
    ]
    aimed = []
    for r in rows:
        t, e = r["latency_ms"], r["errors"]
        lines.append(
            f"{r['model']:<20}{r['target']:>13.3e}{e['searched']:>13.3e}{t['searched']:>8.3f}"
            f"{_fp32_layers(r['plan'], r['layers']) + '/' + str(r['layers']):>13}"
            f"{e['amp-bf16']:>13.3e}{t['amp-bf16']:>8.3f}{e['autocast-bf16']:>18.3e}{t['autocast-bf16']:>8.3f}"
            f"{t['searched'] / t['amp-bf16']:>7.2f}x{t['searched'] / t['autocast-bf16']:>11.2f}x"
            f"{e['searched'] / r['target'] if r['target'] else 0.0:>10.2f}{r['steps']:>7}{r['search_s']:>9.1f}"
        )
        if e["searched"] <= r["target"] and t["searched"] <= t["amp-bf16"]:
            aimed.append(r["model"])
    lines += ["", "ratios: searched plan's latency / the engine mode's (below 1: faster); error / eager autocast's"]
    lines += ["", "chosen plans, and the pruned plan (fewest fp32 layers meeting the target) where it differs:"]
    for r in rows:
        lines.append(f"  {r['model']}: {r['plan']}")
        if "pruned" in r["latency_ms"]:
            lines.append(
                f"    pruned: {r['pruned']}; err {r['errors']['pruned']:.3e}, {r['latency_ms']['pruned']:.3f} ms "
                f"({r['latency_ms']['pruned'] / r['latency_ms']['amp-bf16']:.2f}x amp-bf16's latency)"
            )
    missed = [r["model"] for r in rows if r["model"] not in aimed]
    lines += [
        "",
        f"aim (error <= eager autocast's, latency <= amp-bf16's) met: {', '.join(aimed) or 'none'}"
        + (f"; missed: {', '.join(missed)}" if missed else ""),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.benchmarks.precision_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, pinned")
    parser.add_argument("--seconds", type=float, default=4.0, help="side-by-side measuring time per model")
    parser.add_argument("--search-seconds", type=float, default=0.3, help="timing of each candidate of the search")
    args = parser.parse_args(argv)
    with preserved_global_state():
        torch.set_num_threads(args.threads)
        rows = [bench_model(name, args.threads, args.seconds, args.search_seconds) for name in args.models.split(",")]
    print(report(rows, args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
