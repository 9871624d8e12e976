"""The CPU engine on third-party architectures, against eager PyTorch, in one run.

``python -m harness.benchmarks.conformance_bench [--models ...] [--seconds S] [--threads N]``
builds, for each model of the conformance suite (``transformers`` models
from small configs), the CPU engine in every fp32 and bf16 mode, then times
side by side, in alternating rounds with the thread count pinned:
- eager fp32 (the module as the user runs it);
- eager ``torch.autocast("cpu", torch.bfloat16)``;
- the engine in each mode; the fastest is the engine's *best mode*.

Per model it prints the latencies, the best mode's speed-up against both
eager references, and max absolute errors against eager fp32 over the
example and calibration batches (the best mode's error beside eager
autocast's). fp16 modes are left out: on CPUs without AVX-512 FP16 they are
slower than fp32 and could never be the best mode. The aim: no model slower
than eager autocast. This prints a report; it asserts nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness import models
from harness.models import THIRD_PARTY_PREFIX
from harness.benchmarks.engine_bench import abs_errors, medians_alternating
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.globalstate import preserved_global_state

ENGINE_MODES = ("fp32", "bf16", "weak-bf16", "autocast-bf16", "amp-bf16")


def bench_model(name: str, seconds: float) -> dict[str, Any]:
    spec = models.load(name)
    module, inputs = spec.module, spec.example_inputs
    batches = [tuple(inputs), *(tuple(b) for b in spec.calibration_data)]
    backend = CpuBackend()
    engines = {mode: build_engine(spec, BuildConfig(mode=mode), backend).engine for mode in ENGINE_MODES}

    def eager_fp32(*batch: torch.Tensor) -> object:
        return module(*batch)

    def eager_bf16(*batch: torch.Tensor) -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(*batch)

    candidates: dict[str, Callable[..., Any]] = {
        "eager fp32": eager_fp32, "eager autocast-bf16": eager_bf16, **engines
    }

    def bound(fn: Callable[..., Any]) -> Callable[[], object]:
        return lambda: fn(*inputs)

    with torch.inference_mode():
        times = medians_alternating([bound(fn) for fn in candidates.values()], seconds)
        errors = {label: abs_errors(fn, module, batches) for label, fn in candidates.items()}
    latency = dict(zip(candidates, times, strict=True))
    best = min(ENGINE_MODES, key=latency.__getitem__)
    return {"model": name, "latency_ms": latency, "errors": errors, "best": best}


def report(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"CPU engine on third-party models: torch {torch.__version__}, {threads} thread(s), "
        f"{torch.backends.cpu.get_cpu_capability()}; latencies are medians of alternating rounds (ms)",
        "errors: max/mean abs vs eager fp32 over the example and calibration batches",
        "",
        f"{'model':<20}{'eager fp32':>11}{'eager ac-bf16':>14}"
        + "".join(f"{m:>14}" for m in ENGINE_MODES)
        + f"  {'best mode':<14}{'vs fp32':>8}{'vs autocast':>12}  best err / eager autocast err",
    ]
    for r in rows:
        t = r["latency_ms"]
        best = r["best"]
        lines.append(
            f"{r['model']:<20}{t['eager fp32']:>11.3f}{t['eager autocast-bf16']:>14.3f}"
            + "".join(f"{t[m]:>14.3f}" for m in ENGINE_MODES)
            + f"  {best:<14}{t['eager fp32'] / t[best]:>7.2f}x{t['eager autocast-bf16'] / t[best]:>11.2f}x"
            + f"  {r['errors'][best]} / {r['errors']['eager autocast-bf16']}"
        )
    slower = [r["model"] for r in rows if r["latency_ms"][r["best"]] > r["latency_ms"]["eager autocast-bf16"]]
    lines += ["", f"slower than eager autocast: {', '.join(slower) or 'none'}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.benchmarks.conformance_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models",
        default=",".join(m for m in models.available() if m.startswith(THIRD_PARTY_PREFIX)),
        help="comma-separated zoo names (default: the third-party hf-* models)",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, pinned")
    args = parser.parse_args(argv)
    with preserved_global_state():
        torch.set_num_threads(args.threads)
        rows = [bench_model(name, args.seconds) for name in args.models.split(",")]
    print(report(rows, args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
