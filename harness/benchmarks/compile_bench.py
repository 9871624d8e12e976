"""How the autocast compiler scales, and whether its typed graphs beat eager autocast.

Two questions a user asks before adopting the compiler, answered in one run:

(a) Does compile time grow linearly with graph size? A ladder of cheap ops and
    small linears is generated at two sizes (~1k and ~10k nodes) and compiled
    with the rule policy without calibration, so only the compiler's own passes are
    timed. ``torch.export`` is timed apart: it is PyTorch's cost, not the
    compiler's, and it dominates a compile from an ``nn.Module``.
(b) Is the typed bf16 graph faster than eager ``torch.autocast`` at no worse
    accuracy? Eager autocast casts each weight on every call; the typed graph
    converted them ahead of time. The two run interleaved in alternating
    blocks, so the noise of a shared CPU lands on both alike.

Run as ``python -m harness.benchmarks.compile_bench [--quick] [--threads N]``; every
candidate runs at one pinned intra-op thread count (1 unless ``--threads`` says
otherwise), as in ``harness bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from harness import models
from harness.autocast import AutocastSettings, compile
from harness.bench.runner import DEFAULT_THREADS
from harness.bench.stats import bootstrap_ratio_ci
from harness.errors import HarnessError
from harness.globalstate import pinned_threads
from harness.outputs import flat_tensors

LOW = torch.bfloat16


class Ladder(nn.Module):
    """``blocks`` repetitions of linear -> tanh -> scale -> residual add -> relu -> shift.

    About eight graph nodes per block (six ops plus the linear's two weights);
    the Python loop over the layer list unrolls under ``torch.export``.
    """

    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.layers:
            x = x + torch.tanh(linear(x)) * 0.5
            x = F.relu(x) - 0.1
        return x


NODES_PER_BLOCK = 8


@dataclass(frozen=True)
class ScalingRow:
    nodes: int
    export_s: float
    compile_s: float
    stages: dict[str, float]

    @property
    def us_per_node(self) -> float:
        return self.compile_s / self.nodes * 1e6


def measure_scaling(target_nodes: int, repeats: int) -> ScalingRow:
    """Best of ``repeats`` compiles of one exported ladder (the minimum is the least disturbed run)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = Ladder(max(1, target_nodes // NODES_PER_BLOCK)).eval()
        inputs = (torch.rand(4, 8) * 2 - 1,)
    t0 = time.perf_counter()
    program = torch.export.export(module, inputs)
    export_s = time.perf_counter() - t0
    nodes = len(program.graph.nodes)
    settings = AutocastSettings(low_precision_type=LOW, data_max=None)
    runs = [compile(program, inputs, policy="rule", settings=settings).timings for _ in range(max(1, repeats))]
    best = min(runs, key=lambda t: t["total"])
    return ScalingRow(nodes, export_s, best["total"], best)


def scaling_table(rows: Sequence[ScalingRow]) -> str:
    # the compiler's own stage names, in its order (they may grow as the compiler does)
    stages = [s for s in dict.fromkeys(k for r in rows for k in r.stages) if s != "total"]
    head = ["graph nodes", "torch.export s", "compile s", "us / node", *(f"{s} s" for s in stages)]
    body = [
        [r.nodes, f"{r.export_s:.2f}", f"{r.compile_s:.2f}", f"{r.us_per_node:.0f}", *(f"{r.stages.get(s, 0.0):.2f}" for s in stages)]
        for r in rows
    ]
    small, large = rows[0], rows[-1]
    growth = large.us_per_node / small.us_per_node
    note = (
        f"per-node cost {large.nodes} vs {small.nodes} nodes: {growth:.2f}x (1.0 = linear growth); "
        f"compile of {large.nodes} nodes: {large.compile_s:.1f} s "
        f"(stage 'export' is the standalone-graph copy of the exported program, not torch.export)"
    )
    return f"{tabulate(body, headers=head)}\n{note}"


@dataclass(frozen=True)
class LatencyRow:
    model: str
    eager_ms: float
    compiled_ms: float
    speedup: float
    speedup_low: float
    speedup_high: float
    eager_err: float
    compiled_err: float
    samples: int


def _max_abs_error(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    return max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref, strict=True))


def interleaved_samples(
    a: Callable[[], object], b: Callable[[], object], rounds: int, block: int, warmup: int
) -> tuple[list[float], list[float]]:
    """Per-call seconds of ``a`` and ``b``, in alternating blocks whose order flips every round."""
    for _ in range(warmup):
        a()
        b()
    times: dict[int, list[float]] = {0: [], 1: []}
    fns = (a, b)
    for r in range(rounds):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn, out = fns[which], times[which]
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return times[0], times[1]


def _autocast_run(module: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    with torch.autocast("cpu", dtype=LOW):
        return flat_tensors(module(*batch))


def measure_latency(name: str, rounds: int, block: int, warmup: int) -> LatencyRow:
    spec = models.load(name)
    module, inputs = spec.module.eval(), spec.example_inputs
    compiled = compile(module, inputs, policy="rule", low_precision_type=LOW)
    with torch.inference_mode():

        def eager() -> tuple[torch.Tensor, ...]:
            return _autocast_run(module, inputs)

        def typed() -> tuple[torch.Tensor, ...]:
            outputs: tuple[torch.Tensor, ...] = compiled(*inputs)  # the typed graph returns a flat tuple
            return outputs

        # The max error of one batch is a noisy statistic (one unlucky rounding
        # decides it): take the worst over the example and the calibration batches.
        batches = [tuple(inputs), *(tuple(b) for b in spec.calibration_data)]
        eager_err = max(_max_abs_error(_autocast_run(module, b), flat_tensors(module(*b))) for b in batches)
        compiled_err = max(_max_abs_error(flat_tensors(compiled(*b)), flat_tensors(module(*b))) for b in batches)
        eager_s, compiled_s = interleaved_samples(eager, typed, rounds, block, warmup)
    ci = bootstrap_ratio_ci(eager_s, compiled_s)
    return LatencyRow(
        name,
        statistics.median(eager_s) * 1e3,
        statistics.median(compiled_s) * 1e3,
        ci.ratio,
        ci.low,
        ci.high,
        eager_err,
        compiled_err,
        len(eager_s),
    )


def latency_table(rows: Sequence[LatencyRow]) -> str:
    head = [
        "model", "eager autocast ms", "compiled ms", "speed-up", "95% CI",
        "eager max abs err*", "compiled max abs err*", "runs each",
    ]  # fmt: skip
    body = [
        [
            r.model, f"{r.eager_ms:.3f}", f"{r.compiled_ms:.3f}", f"{r.speedup:.2f}x",
            f"{r.speedup_low:.2f}-{r.speedup_high:.2f}", f"{r.eager_err:.3g}", f"{r.compiled_err:.3g}", r.samples,
        ]  # fmt: skip
        for r in rows
    ]
    table: str = tabulate(body, headers=head)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.benchmarks.compile_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller graphs (1k and 3k nodes) and fewer timed runs")
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS,
        help=f"torch intra-op threads, pinned for the whole run: compiles, eager and compiled graphs (default: "
        f"{DEFAULT_THREADS}, as harness bench: far steadier on a CPU shared with other jobs)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    sizes, repeats = ((1000, 3000), 1) if args.quick else ((1000, 10000), 2)
    rounds, block, warmup = (6, 5, 3) if args.quick else (20, 10, 10)

    with ExitStack() as stack:
        try:
            stack.enter_context(pinned_threads(args.threads))
        except HarnessError as exc:
            parser.error(f"--threads: {exc}")
        load = os.getloadavg()[0]
        print(f"torch {torch.__version__}, threads: {args.threads} (pinned for every candidate), "
              f"load average {load:.2f} on {os.cpu_count()} CPUs\n")  # fmt: skip
        print(f"(a) rule-mode compile time without calibration, best of {repeats}")
        print(scaling_table([measure_scaling(n, repeats) for n in sizes]))
        print(f"\n(b) rule-mode {str(LOW).removeprefix('torch.')} typed graph vs eager torch.autocast, "
              f"median of {rounds} interleaved blocks of {block} calls each;\n* worst max abs error against fp32 eager over the example and calibration batches")  # fmt: skip
        print(latency_table([measure_latency(name, rounds, block, warmup) for name in ("resnet", "transformer")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
