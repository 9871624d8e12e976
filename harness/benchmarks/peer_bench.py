"""The harness's CPU engines next to the plain runtimes a user could deploy instead (the peers).

Per model and precision, every candidate is timed in the same alternating
rounds (:func:`harness.benchmarks.engine_bench.medians_alternating`, under
the caller's pinned threads): the CPU engine in each mode of that precision,
the ``onnxruntime`` backend (fp32), and every peer of
:mod:`harness.bench.peers` that runs that precision here. A burst of load
from another process hits every candidate of a round, not one of them.

The report answers two questions of issue 14: is the CPU engine's best mode
(and its slowest) within 1.1x of the fastest peer at the same precision, and
does the ``onnxruntime`` backend run at plain ONNX Runtime's speed (within
1.05x) on the same model. Errors are the max absolute error against eager
fp32 on the example inputs. Nothing here asserts a threshold.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from harness import models
from harness.bench.accuracy import compare_outputs
from harness.bench.peers import OnnxExports, Peer, PeerModel
from harness.build import compile_graph
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import Backend, BuildConfig, Engine
from harness.errors import HarnessError
from harness.outputs import OutputSpec
from harness.precision import PrecisionMode

Timer = Callable[[Sequence[Callable[[], object]], float], list[float]]
ORT_BACKEND = "onnxruntime fp32 (backend)"
PLAIN_ORT = "peer:onnxruntime"


@dataclass
class Candidate:
    label: str  # "cpu <mode>", ORT_BACKEND or "peer:<name>"
    call: Callable[[], object]
    error: float | None
    ms: float = float("nan")

    @property
    def peer(self) -> bool:
        return self.label.startswith("peer:")


@dataclass
class Group:
    """One model at one precision: every candidate that ran, and why others did not."""

    model: str
    precision: str
    candidates: list[Candidate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fastest_peer(self) -> Candidate | None:
        return min((c for c in self.candidates if c.peer), key=lambda c: c.ms, default=None)

    def cpu_modes(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.label.startswith("cpu ")), key=lambda c: c.ms)

    def find(self, label: str) -> Candidate | None:
        return next((c for c in self.candidates if c.label == label), None)


def modes_at(backend: Backend, precision: str) -> list[PrecisionMode]:
    """The backend's modes that compute in ``precision`` (``explicit`` is mixed: never)."""
    return [m for m in backend.supported_modes() if m.precision == precision]


def _build(backend: Backend, spec: Any, mode: PrecisionMode, threads: int) -> Engine:
    config = BuildConfig(mode=mode, threads=threads)
    engine, _ = backend.build(compile_graph(spec, config, backend), config, None)
    return engine


def _error(outputs: Any, reference: Any) -> float | None:
    return compare_outputs(outputs, reference).max_abs_error


def side_by_side(
    name: str,
    peers: Sequence[Peer],
    precisions: Sequence[str],
    threads: int,
    seconds: float,
    timer: Timer,
    engines: Mapping[str, Engine] | None = None,
    progress: Callable[[str], None] = lambda step: None,
) -> list[Group]:
    """One :class:`Group` per precision for model ``name``; ``engines`` are CPU engines already built, by mode.

    ``progress`` hears each precision as it starts: a group takes a minute or more.
    """
    spec = models.load(name)
    inputs = tuple(spec.example_inputs)
    with torch.inference_mode():
        reference = spec.module(*inputs)
    exports = OnnxExports()
    model = PeerModel(spec, OutputSpec(pytree.tree_flatten(reference)[1]), lambda: exports.path((name, None), spec))
    cpu, built = CpuBackend(), dict(engines or {})
    groups = []
    for precision in precisions:
        progress(f"{name}: {precision} side by side (builds, peers' setup, timing)")
        group = Group(name, precision)
        for mode in modes_at(cpu, precision):
            try:
                engine = built[mode] if mode in built else _build(cpu, spec, mode, threads)
            except HarnessError as exc:
                group.notes.append(f"cpu {mode} not built: {exc}")
                continue
            group.candidates.append(_engine_candidate(f"cpu {mode}", engine, inputs, reference))
        if precision == "fp32":
            from harness.engines.onnxruntime import OnnxRuntimeBackend

            engine = _build(OnnxRuntimeBackend(), spec, PrecisionMode.FP32, threads)
            group.candidates.append(_engine_candidate(ORT_BACKEND, engine, inputs, reference))
        for peer in peers:
            reason = peer.refusal(precision)
            if reason is not None:
                group.notes.append(f"peer:{peer.name} left out: {reason}")
                continue
            start = time.perf_counter()
            try:
                run = peer.prepare(model, precision, threads)
            except HarnessError as exc:
                group.notes.append(f"peer:{peer.name} failed: {exc}")
                continue
            setup = time.perf_counter() - start
            if setup > 1:
                group.notes.append(f"peer:{peer.name} setup {setup:.1f} s (export/compile, not in its latency)")
            group.candidates.append(Candidate(f"peer:{peer.name}", run.call, _error(run.outputs(), reference)))
        # Every candidate gets the time one side of a two-way ratio would.
        with torch.inference_mode():
            medians = timer([c.call for c in group.candidates], seconds * len(group.candidates) / 2)
        for candidate, ms in zip(group.candidates, medians, strict=True):
            candidate.ms = ms
        groups.append(group)
    return groups


def _engine_candidate(label: str, engine: Engine, inputs: tuple[torch.Tensor, ...], reference: Any) -> Candidate:
    with torch.inference_mode():
        error = _error(engine(*inputs), reference)
    return Candidate(label, lambda: engine(*inputs), error)


def _ratio(ms: float, peer: Candidate | None) -> str:
    return f"{ms / peer.ms:.2f}x" if peer is not None else "-"


def report(groups: Sequence[Group], threads: int) -> str:
    """Each group's candidates, then the two comparisons the issue's aims are about."""
    lines = [
        f"peers side by side: {threads} intra-op thread(s) for every candidate, alternating rounds; median ms; "
        "err = max abs vs eager fp32 on the example inputs; vs peer = latency / the fastest peer's at that precision",
    ]
    for g in groups:
        fastest = g.fastest_peer()
        lines.append(f"  {g.model} {g.precision}")
        for c in sorted(g.candidates, key=lambda c: (c.peer, c.ms)):
            err = "-" if c.error is None else f"{c.error:.2e}"
            mark = "  <- fastest peer" if c is fastest else ""
            lines.append(f"    {c.label:<28} {c.ms:>9.4f} ms  err {err:>9}  vs peer {_ratio(c.ms, fastest):>6}{mark}")
        lines += [f"    note: {n}" for n in g.notes]
    summary = ratios(groups)
    lines += [
        "",
        "our best CPU-engine mode vs the fastest peer at the same precision (aim: every mode within 1.1x)",
        f"  {'model':<12} {'prec':<5} {'best mode':<18} {'ms':>9} {'fastest peer':<18} {'ms':>9} {'ratio':>6}  slowest mode",
    ]
    for r in summary["modes"]:
        if "not_compared" in r:
            lines.append(f"  {r['model']:<12} {r['precision']:<5} not compared: {r['not_compared']}")
            continue
        lines.append(
            f"  {r['model']:<12} {r['precision']:<5} {r['best_mode']:<18} {r['best_ms']:>9.4f} {r['peer']:<18} "
            f"{r['peer_ms']:>9.4f} {_times(r['best_ratio']):>6}  {r['slowest_mode']} {_times(r['slowest_ratio'])}"
        )
    lines += [
        "",
        "onnxruntime backend vs plain ONNX Runtime on the eager model's own ONNX, fp32 (aim: within 1.05x)",
        f"  {'model':<12} {'backend ms':>11} {'plain ms':>9} {'ratio':>6}",
    ]
    for r in summary["onnxruntime_backend"]:
        lines.append(f"  {r['model']:<12} {r['backend_ms']:>11.4f} {r['plain_ms']:>9.4f} {_times(r['ratio']):>6}")
    return "\n".join(lines)


def ratios(groups: Sequence[Group]) -> dict[str, list[dict[str, Any]]]:
    """The two comparisons of issue 14's aims: per group, the best and slowest CPU-engine modes
    against the fastest peer, and the ``onnxruntime`` backend against plain ONNX Runtime (what
    :func:`report` ends with, and what a repeated run collects from each process). A time
    that is not finite leaves its ratio None, never a number."""
    modes, backend = [], []
    for g in groups:
        fastest, cpu = g.fastest_peer(), g.cpu_modes()
        row: dict[str, Any] = {"model": g.model, "precision": g.precision}
        if fastest is None or not cpu:
            row["not_compared"] = "no peer ran" if fastest is None else "no CPU mode built"
        else:
            best, slowest = cpu[0], cpu[-1]
            row |= {
                "best_mode": best.label.removeprefix("cpu "),
                "best_ms": _finite(best.ms),
                "peer": fastest.label,
                "peer_ms": _finite(fastest.ms),
                "best_ratio": _finite(best.ms / fastest.ms),
                "slowest_mode": slowest.label.removeprefix("cpu "),
                "slowest_ratio": _finite(slowest.ms / fastest.ms),
            }
        modes.append(row)
        ours, plain = g.find(ORT_BACKEND), g.find(PLAIN_ORT)
        if ours is not None and plain is not None:
            backend.append(
                {
                    "model": g.model,
                    "backend_ms": _finite(ours.ms),
                    "plain_ms": _finite(plain.ms),
                    "ratio": _finite(ours.ms / plain.ms),
                }
            )
    return {"modes": modes, "onnxruntime_backend": backend}


_NUMBER = {"type": ["number", "null"], "exclusiveMinimum": 0}
_NAME = {"type": "string"}
# What ratios() gives: one run's record, as a repeated run reads it back from each process.
RATIOS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["modes", "onnxruntime_backend"],
    "additionalProperties": False,
    "properties": {
        "modes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["model", "precision"],
                "additionalProperties": False,
                "properties": {
                    **dict.fromkeys(["model", "precision", "not_compared", "best_mode", "peer", "slowest_mode"], _NAME),
                    **dict.fromkeys(["best_ms", "peer_ms", "best_ratio", "slowest_ratio"], _NUMBER),
                },
            },
        },
        "onnxruntime_backend": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["model", "backend_ms", "plain_ms", "ratio"],
                "additionalProperties": False,
                "properties": {"model": _NAME, **dict.fromkeys(["backend_ms", "plain_ms", "ratio"], _NUMBER)},
            },
        },
    },
}


def ranges_report(runs: Sequence[Mapping[str, Any]]) -> str:
    """Each ratio of :func:`ratios` over several runs: min-max and median, with the best modes
    seen, and how many runs compared it where not all did."""
    lines = [
        f"each ratio over {len(runs)} runs, each a process of its own: min-max (median)",
        "our best CPU-engine mode vs the fastest peer at the same precision (aim: every mode within 1.1x)",
        f"  {'model':<12} {'prec':<5} {'best mode':<22} {'slowest mode':<22} best modes seen",
    ]
    modes: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        for row in run["modes"]:
            modes.setdefault((row["model"], row["precision"]), []).append(row)
    for (model, precision), rows in modes.items():
        compared = [r for r in rows if "not_compared" not in r]
        if not compared:
            lines.append(f"  {model:<12} {precision:<5} not compared: {rows[0]['not_compared']}")
            continue
        seen = sorted({f"{r['best_mode']} vs {r['peer']}" for r in compared})
        note = "" if len(compared) == len(runs) else f"; compared in {len(compared)} of {len(runs)} runs"
        lines.append(
            f"  {model:<12} {precision:<5} {_spread([r['best_ratio'] for r in compared]):<22} "
            f"{_spread([r['slowest_ratio'] for r in compared]):<22} {', '.join(seen)}{note}"
        )
    lines += ["onnxruntime backend vs plain ONNX Runtime, fp32 (aim: within 1.05x)"]
    backend: dict[str, list[float | None]] = {}
    for run in runs:
        for row in run["onnxruntime_backend"]:
            backend.setdefault(row["model"], []).append(row["ratio"])
    for model, values in backend.items():
        note = "" if len(values) == len(runs) else f" (compared in {len(values)} of {len(runs)} runs)"
        lines.append(f"  {model:<12} {_spread(values)}{note}")
    return "\n".join(lines)


def _spread(values: Sequence[float | None]) -> str:
    finite = [v for v in values if v is not None]
    if len(finite) < len(values):
        return f"{len(values) - len(finite)} not finite"
    return f"{min(finite):.2f}-{max(finite):.2f}x ({statistics.median(finite):.2f}x)"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _times(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.2f}x"
