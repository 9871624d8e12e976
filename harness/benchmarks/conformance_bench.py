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

The default models are the suite's: the zoo's ``hf-*`` models and, run from
a source checkout, the re-creations in ``tests/conformance/recreations.py``.

``--conformance-table`` instead runs the conformance suite itself
(``pytest tests/conformance``, from a source checkout) and prints its outcome
as a Markdown model x stage table (a conformance benchmark page's); ``--report FILE`` renders a
report an earlier run wrote (``HARNESS_CONFORMANCE_REPORT=FILE pytest
tests/conformance``) without running the suite again.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harness import models
from harness.benchmarks.engine_bench import abs_errors, medians_alternating
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.frontend.export import export_program
from harness.globalstate import preserved_global_state
from harness.models import THIRD_PARTY_PREFIX
from harness.precision import PrecisionMode

ENGINE_MODES = tuple(
    PrecisionMode.parse(m) for m in ("fp32", "bf16", "weak-bf16", "autocast-bf16", "amp-bf16")
)
CONFORMANCE_DIR = Path("tests") / "conformance"
RECREATIONS_FILE = CONFORMANCE_DIR / "recreations.py"
REPORT_ENV = "HARNESS_CONFORMANCE_REPORT"  # read by tests/conformance/conftest.py
MARKS = {"passed": "✓", "failed": "✗", "skipped": "skipped"}


def suite_models() -> list[str]:
    """The conformance suite's models: the zoo's hf-* ones, then the re-creations (source checkout only).

    The re-creations' names are read from the file's ``RECREATIONS`` tuple
    without importing it (importing builds nothing, but a listing need not run
    user code).
    """
    names = [m for m in models.available() if m.startswith(THIRD_PARTY_PREFIX)]
    if RECREATIONS_FILE.is_file():
        tree = ast.parse(RECREATIONS_FILE.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "RECREATIONS" for t in node.targets
            ):
                names += [f"{RECREATIONS_FILE}:{name}" for name in ast.literal_eval(node.value)]
    return names


def display_name(model: str) -> str:
    """``tests/conformance/recreations.py:engine_ops`` -> ``engine_ops``."""
    return model.rpartition(":")[2]


def bench_model(name: str, seconds: float) -> dict[str, Any]:
    spec = models.load(name)
    module, inputs = spec.module, spec.example_inputs
    batches = [tuple(inputs), *(tuple(b) for b in spec.calibration_data)]
    backend = CpuBackend()
    program = export_program(module, inputs)
    engines = {
        mode: build_engine(spec, BuildConfig(mode=mode), backend, program=program).engine for mode in ENGINE_MODES
    }

    def eager_fp32(*batch: torch.Tensor) -> object:
        return module(*batch)

    def eager_bf16(*batch: torch.Tensor) -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(*batch)

    candidates: dict[str, Callable[..., Any]] = {
        "eager fp32": eager_fp32, "eager autocast-bf16": eager_bf16, **{str(m): e for m, e in engines.items()}
    }

    def bound(fn: Callable[..., Any]) -> Callable[[], object]:
        return lambda: fn(*inputs)

    with torch.inference_mode():
        times = medians_alternating([bound(fn) for fn in candidates.values()], seconds)
        errors = {label: abs_errors(fn, module, batches) for label, fn in candidates.items()}
    latency = dict(zip(candidates, times, strict=True))
    best = min(ENGINE_MODES, key=latency.__getitem__)
    return {"model": display_name(name), "latency_ms": latency, "errors": errors, "best": best}


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


def conformance_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of (model, stage, outcome) records: ✓ when every test of the cell passed.

    Rows and columns come in the order the suite ran them; a cell with no
    test (a model that claims no pattern) is ``-``; several tests in one cell
    (rule mode in bf16 and fp16) show the worst outcome.
    """
    rows = list(dict.fromkeys(r["model"] for r in results))
    stages = list(dict.fromkeys(r["stage"] for r in results))
    cells: dict[tuple[str, str], set[str]] = {}
    for r in results:
        cells.setdefault((r["model"], r["stage"]), set()).add(r["outcome"])

    def mark(outcomes: set[str] | None) -> str:
        if not outcomes:
            return "-"
        worst = next((o for o in ("failed", "skipped") if o in outcomes), "passed")
        return MARKS.get(worst, worst)

    lines = [
        "| model | " + " | ".join(stages) + " |",
        "|---|" + "|".join(":-:" for _ in stages) + "|",
        *(f"| {model} | " + " | ".join(mark(cells.get((model, s))) for s in stages) + " |" for model in rows),
    ]
    passed = sum(1 for r in results if r["outcome"] == "passed")
    lines += ["", f"{passed} of {len(results)} tests passed ({len(rows)} models, {len(stages)} stages)"]
    return "\n".join(lines)


def run_conformance_suite(report: Path) -> int:
    """Run ``pytest tests/conformance`` here, recording outcomes into ``report``; pytest's exit code."""
    if not CONFORMANCE_DIR.is_dir():
        raise HarnessError(
            f"no {CONFORMANCE_DIR} here: run --conformance-table from the root of a source checkout"
        )
    env = {**os.environ, REPORT_ENV: str(report)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CONFORMANCE_DIR)]
    return subprocess.run(command, env=env, stdout=sys.stderr, check=False).returncode


def print_conformance_table(report: Path | None) -> int:
    """Print the suite's table (running the suite unless ``report`` holds a run); 1 if a test failed."""
    if report is None:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "conformance.json"
            code = run_conformance_suite(report)
            if not report.is_file():
                raise HarnessError(f"the conformance suite wrote no report (pytest exit code {code})")
            results = json.loads(report.read_text())
    else:
        try:
            results = json.loads(report.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise HarnessError(f"cannot read conformance report {report}: {exc}") from None
    print(conformance_table(results))
    return 0 if all(r["outcome"] == "passed" for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.benchmarks.conformance_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated zoo names or path.py:factory (default: the conformance suite's models, "
        "the hf-* zoo models and tests/conformance/recreations.py's)",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, pinned")
    parser.add_argument(
        "--conformance-table",
        action="store_true",
        help="run the conformance suite (pytest tests/conformance) and print its model x stage table in Markdown",
    )
    parser.add_argument(
        "--report", type=Path, default=None, help="with --conformance-table: render this report instead of running"
    )
    args = parser.parse_args(argv)
    try:
        if args.conformance_table:
            return print_conformance_table(args.report)
        names = args.models.split(",") if args.models else suite_models()
        with preserved_global_state():
            torch.set_num_threads(args.threads)
            rows = [bench_model(name, args.seconds) for name in names]
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(rows, args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
