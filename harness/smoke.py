"""The GPU smoke check (``nox -s gpu``): every step a GPU runner's CI relies on, once, on a small model.

``python -m harness.smoke [--backend tensorrt] [--workdir DIR] [--no-pytest]``
runs, on the zoo's ``lenet`` and with each step's own command:

1. ``build`` in fp32, fp16, bf16 and, where the backend has weak typing
   (TensorRT 10.x), weak-fp16, each with an editable timing cache;
2. a rebuild of each from its cache with ``--error-on-cache-miss``: the
   engine's fingerprint must be the first build's;
3. ``cache pin`` of another measured candidate for one layer of the fp16
   cache and a build from it: that layer's kernel must be the pinned one (a
   kernel no candidate can be tied to is reported unverifiable, never passed);
4. ``bench`` of fp32 and fp16 with telemetry (every case's GPU samples name
   the GPU by UUID), ``baseline promote`` of that run, a second ``bench``,
   and ``gate`` of the second against the first: it must judge every case;
5. ``pytest -m gpu`` with ``HARNESS_REQUIRE_GPU=1`` (a GPU test that cannot run fails);

then prints one row per check and exits 0 only if every check passed. On a
machine without a GPU (or without TensorRT) it says so and exits 2 before
any step: it never reports a check it did not run as passed. ``--backend
cpu`` runs steps 1-4 on the CPU engine, which checks the steps themselves
anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MODEL = "lenet"
# Short windows, and a case flagged unstable only past 99% spread: the smoke checks
# that every step works, so a busy runner's noise must not leave the gate with nothing to judge.
TIMING = {"warmup_s": 0.2, "min_iters": 30, "min_duration_s": 0.5, "spread_threshold": 0.99}
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    """One step's verdict: passed, failed or unverifiable, with what was seen."""

    name: str
    verdict: str  # "pass" | "FAIL" | "unverifiable"
    detail: str
    seconds: float


class SmokeError(Exception):
    """A step failed; the message says what was expected and what happened."""


def harness(*argv: str) -> str:
    """Run one ``harness`` command in this process; its stdout, or SmokeError with its stderr."""
    from harness.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    if code != 0:
        raise SmokeError(f"`harness {' '.join(argv)}` exited {code}: {err.getvalue().strip()[-600:]}")
    return out.getvalue()


def no_gpu_reason(backend: str) -> str | None:
    """Why the GPU steps cannot run here (None: they can)."""
    if backend == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU: torch.cuda.is_available() is False (a CPU build of PyTorch, or no GPU or driver)"
    from harness.engines.registry import get_backend
    from harness.errors import HarnessError

    try:
        get_backend(backend).check_available()
    except (HarnessError, OSError) as exc:
        return f"backend {backend} cannot run here: {exc}"
    return None


class Smoke:
    """The steps, in order, on one backend in one work directory."""

    def __init__(self, backend: str, workdir: Path) -> None:
        from harness.engines.registry import get_backend

        self.backend_name = backend
        self.backend = get_backend(backend)
        self.work = workdir
        self.checks: list[Check] = []

    def run(self, check: str, step: Callable[[], tuple[str, str]]) -> None:
        """Run ``step`` (returning its verdict and detail) as the check ``check``; a failure is recorded."""
        start = time.perf_counter()
        try:
            verdict, detail = step()
        except SmokeError as exc:
            verdict, detail = "FAIL", str(exc)
        self.checks.append(Check(check, verdict, detail, time.perf_counter() - start))
        print(f"[{self.checks[-1].seconds:6.1f} s] {check}: {verdict}", file=sys.stderr, flush=True)

    def modes(self) -> list[str]:
        supported = self.backend.supported_modes()
        return [m for m in ("fp32", "fp16", "bf16", "weak-fp16") if m in supported]

    def build(self, mode: str, cache: Path, out: Path, *flags: str) -> None:
        harness("build", "--model", MODEL, "--mode", mode, "--backend", self.backend_name, "--cache", str(cache),
                "-o", str(out), *flags)  # fmt: skip

    def fingerprint(self, engine_dir: Path) -> str:
        return str(self.backend.load(engine_dir).fingerprint())

    def built(self, mode: str) -> tuple[str, str]:
        cache = self.work / f"cache-{mode}.json"
        self.build(mode, cache, self.work / f"engine-{mode}")
        entries = len(json.loads(cache.read_text())["entries"]) if cache.exists() else 0
        return "pass", f"{entries} timing-cache entries"

    def rebuilt(self, mode: str) -> tuple[str, str]:
        first = self.fingerprint(self.work / f"engine-{mode}")
        self.build(mode, self.work / f"cache-{mode}.json", self.work / f"rebuilt-{mode}", "--error-on-cache-miss")
        second = self.fingerprint(self.work / f"rebuilt-{mode}")
        if second != first:
            raise SmokeError(f"the pinned rebuild's fingerprint {second} is not the first build's {first}")
        return "pass", f"fingerprint {first} both times"

    def repinned(self) -> tuple[str, str]:
        from harness.cache.timing_cache import TimingCache

        mode = "fp16"
        cache = TimingCache.load(self.work / f"cache-{mode}.json")
        entry = next((e for e in cache.entries() if len({c.tactic for c in e.candidates}) > 1), None)
        if entry is None:
            return "unverifiable", "no layer of the fp16 build measured two candidates with distinct kernels"
        other = next(c for c in sorted(entry.candidates, key=lambda c: c.time_ms) if c.tactic != entry.tactic)
        pinned = self.work / "cache-pinned.json"
        harness("cache", "pin", str(self.work / f"cache-{mode}.json"), "--layer", f"{entry.key}={other.tactic_hash}",
                "-o", str(pinned))  # fmt: skip
        self.build(mode, pinned, self.work / "engine-pinned", "--error-on-cache-miss")
        engine = self.backend.load(self.work / "engine-pinned")
        layers = [layer for layer in engine.layers() if layer.key == entry.key]
        if not layers:
            return "unverifiable", f"no engine layer carries the key of {entry.layer!r}: its kernel cannot be tied"
        kernels = {layer.tactic for layer in layers}
        if kernels != {other.tactic}:
            raise SmokeError(f"{entry.layer!r} pinned to {other.tactic} runs {', '.join(sorted(kernels))}")
        return "pass", f"{entry.layer!r}: {entry.tactic} -> {other.tactic}"

    def benched(self) -> tuple[str, str]:
        config = self.work / "harness.toml"
        config.write_text("[timing]\n" + "".join(f"{k} = {v}\n" for k, v in TIMING.items()))
        common = ("bench", "--backend", self.backend_name, "--models", MODEL, "--modes", "fp32,fp16", "--config",
                  str(config), "--no-plots", "--no-progress", "--cache-dir", str(self.work / "bench-caches"))  # fmt: skip
        root = self.work / "results"
        harness(*common, "-o", str(self.work / "run-1.json"))
        doc = json.loads((self.work / "run-1.json").read_text())
        gpu = self.backend_name != "cpu"
        for case in doc["cases"]:
            telemetry = case.get("telemetry") or {}
            if gpu and not (telemetry.get("gpu") or {}).get("uuid"):
                raise SmokeError(f"case {case['model']}/{case['mode']} has no GPU telemetry naming its GPU")
            if not gpu and not telemetry.get("cpu"):
                raise SmokeError(f"case {case['model']}/{case['mode']} has no CPU telemetry")
        # forced: a busy machine's run is one promote refuses, and the smoke's numbers are not a baseline
        harness("baseline", "promote", str(self.work / "run-1.json"), "--root", str(root), "--force")
        (baseline,) = root.glob("*/baseline.json")
        harness(*common, "-o", str(self.work / "run-2.json"))
        from harness.cli.main import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(["gate", "--baseline", str(baseline), "--current", str(self.work / "run-2.json")])
        verdict = next((line for line in out.getvalue().splitlines() if line.startswith("gate ")), "")
        if code not in (0, 1) or not verdict:
            raise SmokeError(f"the gate judged nothing (exit {code}): {out.getvalue().strip()[-400:]}")
        return "pass", f"{len(doc['cases'])} cases with telemetry; {verdict}"

    def gpu_tests(self) -> tuple[str, str]:
        env = {**os.environ, "HARNESS_REQUIRE_GPU": "1"}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
            cwd=REPO, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        summary = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode != 0:
            raise SmokeError(f"pytest -m gpu exited {done.returncode}: {summary}")
        return "pass", summary


def table(checks: Sequence[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.name, c.verdict, f"{c.seconds:.1f}", c.detail) for c in checks]
    return str(tabulate(rows, headers=("check", "verdict", "s", "detail"), tablefmt="simple"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.smoke", description=__doc__)
    parser.add_argument("--backend", default="tensorrt", choices=("tensorrt", "cpu"), help="default: tensorrt")
    parser.add_argument("--workdir", default=None, help="where builds and runs go (default: a new temporary folder)")
    parser.add_argument("--no-pytest", action="store_true", help="skip step 5, pytest -m gpu (never run with --backend cpu)")
    args = parser.parse_args(argv)
    reason = no_gpu_reason(args.backend)
    if reason is not None:
        print(f"gpu smoke: not run: {reason}; nothing was checked", file=sys.stderr)
        return 2
    import tempfile

    with contextlib.ExitStack() as stack:
        work = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        smoke = Smoke(args.backend, work)
        for mode in smoke.modes():
            smoke.run(f"build {mode}", functools.partial(smoke.built, mode))
        for mode in smoke.modes():
            smoke.run(f"rebuild {mode} pinned: same fingerprint", functools.partial(smoke.rebuilt, mode))
        smoke.run("pin another candidate: its kernel runs", smoke.repinned)
        smoke.run("bench, promote, bench, gate", smoke.benched)
        if not args.no_pytest and args.backend != "cpu":  # the GPU tests need the GPU --backend cpu does without
            smoke.run("pytest -m gpu", smoke.gpu_tests)
    print(table(smoke.checks))
    failed = [c for c in smoke.checks if c.verdict == "FAIL"]
    print(f"gpu smoke: {len(smoke.checks) - len(failed)} of {len(smoke.checks)} checks ran without failing"
          + ("" if not failed else f"; FAILED: {', '.join(c.name for c in failed)}"))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
