"""Per-layer time profile of a CPU engine: where a run's time goes.

The engine's timed function (:mod:`harness.engines.cpu.program`) is the run
function with a clock reading around every layer call, so a profiled
iteration is a real run. Per iteration each layer gets its interval and the
rest of the iteration (input checks aside: the getitems, frees, output copies
and the calls between layers) is the dispatch overhead; every figure is the
median over the iterations. Medians of parts do not add up to a median of
wholes, so the profile's total is defined as the layers' medians plus the
overhead's median: the overhead of each iteration is never negative (the
layer intervals lie inside the iteration), so the layers never add up to more
than the total, whatever the load. The plain run function is timed in the
same loop, interleaved, as ``run_ms``: the engine's own latency without the
clock readings, for comparison with the total.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.engines.cpu import tactics
from harness.engines.cpu.plan import Node
from harness.engines.cpu.program import Program
from harness.errors import HarnessError
from harness.opnames import plan_packet

DEFAULT_ITERATIONS = 50
DEFAULT_WARMUP = 5
MAX_ITERATIONS = 100_000
# The op of a profile entry that times a region (one call: consecutive oneDNN Graph layers
# and the plain layers that read their values).
REGION_OP = "onednn_graph_region"

PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "backend", "mode", "threads", "iterations", "warmup",
        "total_ms", "layers_ms", "overhead_ms", "overhead_share", "run_ms", "layers",
    ],
    "additionalProperties": False,
    "properties": {
        "backend": {"const": "cpu"},
        # What `harness inspect --profile --json` adds: the engine directory and its inputs.
        "engine": {"type": "string"},
        "inputs": {"type": "string"},
        "mode": {"type": "string"},
        "threads": {"type": "integer", "minimum": 1},
        "iterations": {"type": "integer", "minimum": 1},
        "warmup": {"type": "integer", "minimum": 0},
        "total_ms": {"type": "number", "exclusiveMinimum": 0},
        "layers_ms": {"type": "number", "minimum": 0},
        "overhead_ms": {"type": "number", "minimum": 0},
        "overhead_share": {"type": "number", "minimum": 0, "maximum": 1},
        "run_ms": {"type": "number", "exclusiveMinimum": 0},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "name", "op", "layer_type", "fused", "tactic", "precision", "time_ms", "share"],
                "additionalProperties": False,
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "name": {"type": "string"},
                    "op": {"type": "string"},
                    "layer_type": {"type": "string"},
                    "fused": {"type": "array", "items": {"type": "string"}},
                    "tactic": {"type": "string"},
                    "precision": {"type": "string"},
                    "time_ms": {"type": "number", "minimum": 0},
                    "share": {"type": "number", "minimum": 0, "maximum": 1},
                    # A region's entry: the layers its one call runs, in plan order.
                    "region": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                },
            },
        },
    },
}


@dataclass(frozen=True)
class LayerTime:
    index: int  # position among the engine's layers (plan order)
    name: str
    op: str  # the ATen op, with the epilogue it applies: "conv2d+relu"
    layer_type: str
    fused: tuple[str, ...]  # graph nodes folded into the layer
    tactic: str
    precision: str
    time_ms: float
    region: tuple[str, ...] = ()  # the layers of a region's call (plan order); empty for one layer


@dataclass(frozen=True)
class Profile:
    mode: str
    threads: int
    iterations: int
    warmup: int
    layers: tuple[LayerTime, ...]  # plan order
    overhead_ms: float
    run_ms: float

    @property
    def layers_ms(self) -> float:
        return sum(layer.time_ms for layer in self.layers)

    @property
    def layer_count(self) -> int:
        """Engine layers the profiled calls ran (a region's call runs several)."""
        return sum(len(entry.region) or 1 for entry in self.layers)

    @property
    def total_ms(self) -> float:
        return self.layers_ms + self.overhead_ms

    def ranked(self) -> list[LayerTime]:
        """Layers, slowest first (plan order among equals)."""
        return sorted(self.layers, key=lambda layer: (-layer.time_ms, layer.index))

    def share(self, ms: float) -> float:
        return ms / self.total_ms if self.total_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": "cpu",
            "mode": self.mode,
            "threads": self.threads,
            "iterations": self.iterations,
            "warmup": self.warmup,
            "total_ms": self.total_ms,
            "layers_ms": self.layers_ms,
            "overhead_ms": self.overhead_ms,
            "overhead_share": self.share(self.overhead_ms),
            "run_ms": self.run_ms,
            "layers": [
                {
                    "index": layer.index,
                    "name": layer.name,
                    "op": layer.op,
                    "layer_type": layer.layer_type,
                    "fused": list(layer.fused),
                    "tactic": layer.tactic,
                    "precision": layer.precision,
                    "time_ms": layer.time_ms,
                    "share": self.share(layer.time_ms),
                    **({"region": list(layer.region)} if layer.region else {}),
                }
                for layer in self.ranked()
            ],
        }

    def lines(self, top: int | None = None) -> list[str]:
        """A text table, slowest layer first (``top`` layers, the rest summed), then the totals."""
        ranked = self.ranked()
        shown, rest = ranked[:top] if top else ranked, ranked[top:] if top else []
        out = [
            f"{'layer':<28} {'op':<24} {'tactic':<28} {'ms':>9} {'share':>6}",
        ]
        for layer in shown:
            out.append(
                f"{layer.name[:28]:<28} {layer.op[:24]:<24} {layer.tactic[:28]:<28} "
                f"{layer.time_ms:>9.4f} {self.share(layer.time_ms):>6.1%}"
            )
        if rest:
            rest_ms = sum(layer.time_ms for layer in rest)
            more = sum(len(layer.region) or 1 for layer in rest)
            out.append(f"{f'({more} more layers)':<82} {rest_ms:>9.4f} {self.share(rest_ms):>6.1%}")
        out += [
            f"{'layers (sum of medians)':<82} {self.layers_ms:>9.4f} {self.share(self.layers_ms):>6.1%}",
            f"{'dispatch overhead (run minus its layers)':<82} {self.overhead_ms:>9.4f} "
            f"{self.share(self.overhead_ms):>6.1%}",
            f"{'total':<82} {self.total_ms:>9.4f}",
            f"{'engine run without per-layer clocks (median)':<82} {self.run_ms:>9.4f}",
        ]
        return out


def check_counts(iterations: int, warmup: int) -> None:
    """Refuse iteration counts that cannot give a profile (or would never end)."""
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise HarnessError(f"profile iterations {iterations}: expected 1 to {MAX_ITERATIONS}")
    if not 0 <= warmup <= MAX_ITERATIONS:
        raise HarnessError(f"profile warm-up iterations {warmup}: expected 0 to {MAX_ITERATIONS}")


def measure(
    program: Program, mode: str, inputs: Sequence[torch.Tensor], iterations: int, warmup: int
) -> Profile:
    """Run ``program`` ``warmup + iterations`` times, timed per layer and plainly, alternately.

    The caller has checked the inputs and set the thread count; this runs under
    inference mode, as the engine does.
    """
    check_counts(iterations, warmup)
    clock = time.perf_counter_ns
    count = len(program.calls)
    per_layer: list[list[int]] = [[] for _ in range(count)]
    overheads: list[int] = []
    plain: list[int] = []
    stamps = [0] * (2 * count)
    with torch.inference_mode():
        for i in range(warmup + iterations):
            start = clock()
            program.run(*inputs)
            middle = clock()
            program.timed(clock, stamps, *inputs)
            end = clock()
            if i < warmup:
                continue
            plain.append(middle - start)
            inside = 0
            for layer in range(count):
                spent = stamps[2 * layer + 1] - stamps[2 * layer]
                per_layer[layer].append(spent)
                inside += spent
            overheads.append(end - middle - inside)
    layers = []
    index = 0  # of the call's first layer among the engine's layers
    for nodes, samples in zip(program.calls, per_layer, strict=True):
        layers.append(_call_time(index, nodes, statistics.median(samples) / 1e6))
        index += len(nodes)
    return Profile(
        mode=mode,
        threads=torch.get_num_threads(),
        iterations=iterations,
        warmup=warmup,
        layers=tuple(layers),
        overhead_ms=statistics.median(overheads) / 1e6,
        run_ms=statistics.median(plain) / 1e6,
    )


def _call_time(index: int, nodes: Sequence[Node], ms: float) -> LayerTime:
    """One layer's entry, or a region's: named ``first..last``, with every graph node its layers fused."""
    precisions = {tactics.parse_tactic(node.tactic)[1] for node in nodes}
    precision = precisions.pop() if len(precisions) == 1 else "mixed"
    if len(nodes) > 1:
        name = f"{nodes[0].name}..{nodes[-1].name}"
        fused = tuple(f for node in nodes for f in node.fused)
        region = tuple(node.name for node in nodes)
        return LayerTime(index, name, REGION_OP, "region", fused, f"region[{precision}]", precision, ms, region)
    (node,) = nodes
    op = plan_packet(node.op) + (f"+{node.epilogue}" if node.epilogue else "")
    return LayerTime(index, node.name, op, node.layer_type, node.fused, node.tactic, precision, ms)
