"""Which layers put the error there: per-layer effect of a typed graph's precision on its outputs.

The typed graph and an fp32 reference graph of the *same* structure run on
the same batches (the reference is compiled through the same lowering, so
every node of the typed graph that is not an inserted cast has an fp32 twin
of the same name). Per layer four errors are measured, the first two on the
model's outputs, which is what a precision decision changes:

- **fp32 removes**: the outputs' error of the typed graph, less their error
  when only this layer is kept in fp32 (it runs its fp32 twin on the typed
  graph's values at its inputs, converted to fp32; consumers that run low
  take its result rounded to their dtype, casts and the graph's outputs take
  it in fp32, as in a graph recompiled with that layer in fp32). What
  keeping this one layer in fp32 buys: the ranking's default, the answer to
  "which layers should I keep in fp32";
- **impact**: the outputs' error when only this layer runs in its precision
  (the fp32 reference with this layer's low-precision result swapped in):
  how sensitive the model is to this layer alone;
- **introduced**: the layer run alone on the fp32 reference's inputs, cast
  to the dtypes the layer receives in the typed graph, with the weights the
  typed graph gives it, against its fp32 twin. Casts belong to the layer
  that consumes them: rounding an input to bf16 is part of running that
  layer in bf16;
- **accumulated**: the layer's output in the typed graph against its fp32
  twin's: everything upstream plus the layer itself.

All are worst over batches. Nodes that only move data (views, reshapes,
transposes, contiguous copies) are no layers of their own: each is folded
into the layer that produced its input (:mod:`harness.debug.grouping`).
Non-finite values rank first.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from tabulate import tabulate

from harness.autocast import CompiledGraph, compile
from harness.autocast.casts import is_cast
from harness.autocast.settings import AutocastSettings
from harness.bench.accuracy import compare_outputs
from harness.build import compile_graph
from harness.debug.capture import node_values, outputs_kept_wide, outputs_with
from harness.debug.grouping import fold_data_movement
from harness.debug.inputs import Batch
from harness.debug.metrics import ERROR_METRICS, ErrorStats, check_metric, format_error
from harness.debug.taps import engine_values
from harness.engines.modes import compile_for_mode
from harness.engines.protocol import BuildConfig, Engine, engine_inputs
from harness.errors import HarnessError
from harness.globalstate import preserves_global_state
from harness.models import ModelSpec
from harness.precision import PrecisionMode

# Report rows that are not layers of their own: their error belongs to their producer or consumer.
_NOT_LAYERS = frozenset({"inserted_cast", "getitem", "not_floating_point"})
# Which of a layer's errors ranks it: the outputs' error keeping it alone in fp32 removes
# (the default), the outputs' error when it alone runs low, what it introduces alone, or
# what has accumulated at its output.
RANK_ON = ("removed", "impact", "introduced", "accumulated")
DEFAULT_RANK_ON = "removed"
_OUTPUT_EFFECTS = ("removed", "impact")


def default_rank_by(rank_on: str) -> str:
    """The metric that ranks by default: absolute for effects on the outputs, scale-free for a layer's own error.

    Effects on the outputs are all measured on the same tensors, so their
    absolute error compares like with like and is not dominated by one
    output element near zero; a layer's own error is compared across layers
    of very different magnitudes.
    """
    return "max-abs-err" if rank_on in _OUTPUT_EFFECTS else "max-rel-err"


DEFAULT_RANK_BY = default_rank_by(DEFAULT_RANK_ON)


@dataclass(frozen=True)
class LayerError:
    """One layer: where it sits, the precision it runs in, and its two errors."""

    name: str
    op: str
    module: str
    precision: str
    index: int  # position in the typed graph's execution order
    depth: int  # longest chain of layers from the inputs to this one
    introduced: ErrorStats
    accumulated: ErrorStats
    impact: ErrorStats  # the outputs' error when only this layer runs in its precision
    kept: ErrorStats  # the outputs' error when only this layer is kept in fp32
    folded: tuple[str, ...] = ()  # data-movement nodes after it, counted as part of it
    engine: ErrorStats | None = None  # accumulated, read off the engine's own intermediates (cpu)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The graph nodes this layer stands for: itself and the data movement folded into it."""
        return (self.name, *self.folded)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "module": self.module,
            "precision": self.precision,
            "index": self.index,
            "depth": self.depth,
            "introduced": self.introduced.to_json(),
            "accumulated": self.accumulated.to_json(),
            "impact": self.impact.to_json(),
            "kept_fp32": self.kept.to_json(),
            "folded": list(self.folded),
            "engine_accumulated": None if self.engine is None else self.engine.to_json(),
        }


@dataclass
class LayerReport:
    """Every layer of one typed graph, in graph order, with the outputs' error."""

    model: str
    mode: str
    backend: str
    batches: int
    rank_by: str
    rank_on: str  # which error ranks: removed (default), impact, introduced or accumulated
    layers: list[LayerError]
    outputs: ErrorStats  # the typed graph's outputs against the fp32 reference graph's
    engine_outputs: ErrorStats | None = None  # the backend's engine against eager fp32, when built
    unmatched: list[str] = field(default_factory=list)  # layers without an fp32 twin (not measured)

    def ranked(self) -> list[LayerError]:
        """Layers by their ``rank_on`` error under ``rank_by``, worst first.

        Ranked on ``removed``, layers that remove the same (often nothing: a
        layer between two low ones hands its result on rounded) are ordered by
        their impact; graph order breaks the remaining ties.
        """

        def key(layer: LayerError) -> tuple[float, float, int]:
            second = layer.impact.value(self.rank_by) if self.rank_on == "removed" else 0.0
            return (-self.rank_value(layer), -second, layer.index)

        return sorted(self.layers, key=key)

    def rank_value(self, layer: LayerError) -> float:
        if self.rank_on == "removed":
            return self.removed(layer, self.rank_by)
        stats: ErrorStats = getattr(layer, self.rank_on)
        return stats.value(self.rank_by)

    def removed(self, layer: LayerError, metric: str) -> float:
        """How much of the outputs' error keeping only ``layer`` in fp32 removes (negative: it adds)."""
        return removed_error(self.outputs, layer.kept, metric)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "backend": self.backend,
            "batches": self.batches,
            "rank_by": self.rank_by,
            "rank_on": self.rank_on,
            "outputs": self.outputs.to_json(),
            "engine_outputs": None if self.engine_outputs is None else self.engine_outputs.to_json(),
            "ranked": [layer.name for layer in self.ranked()],
            "removed": {layer.name: _finite_or_none(self.removed(layer, self.rank_by)) for layer in self.layers},
            "layers": [layer.to_json() for layer in self.layers],
            "unmatched": list(self.unmatched),
        }

    def table(self, top: int | None = None) -> str:
        tapped = any(layer.engine is not None for layer in self.layers)
        metric = self.rank_by
        rows = []
        for rank, layer in enumerate(self.ranked()[:top], start=1):
            errors = [
                format_error(self.removed(layer, metric)),
                format_error(layer.impact.value(metric)),
                format_error(layer.introduced.value("max-rel-err")),
                format_error(layer.accumulated.value("max-rel-err")),
            ]
            if tapped:
                errors.append("-" if layer.engine is None else format_error(layer.engine.value("max-abs-err")))
            op = layer.op.removeprefix("aten.").removesuffix(".default")
            more = f" +{len(layer.folded)}" if layer.folded else ""
            rows.append((rank, layer.name + more, op, short_module(layer.module), layer.precision, *errors))
        head = (
            "rank", "layer", "op", "module", "prec", "fp32 removes", "alone low", "intro rel", "accum rel",
            *(("engine abs",) if tapped else ()),
        )  # fmt: skip
        shown = len(rows)
        lines = [
            f"model {self.model}, mode {self.mode}, backend {self.backend}: {len(self.layers)} layers, "
            f"{self.batches} batch(es); ranked by {self.rank_on} {metric} (worst over batches)",
            "",
            tabulate(rows, headers=head, disable_numparse=True),
            "",
            f"fp32 removes: the outputs' {metric} that keeping only this layer in fp32 removes (keep the top "
            f"layers in fp32 first); alone low: the outputs' {metric} when only this layer runs in its precision; "
            "intro: the layer alone on the fp32 reference's inputs; accum: the layer in the typed graph; "
            "+N: views and copies after the layer, folded into it"
            + ("; engine: accumulated, in the engine's own intermediates" if tapped else ""),
        ]
        if shown < len(self.layers):
            lines.append(f"... {len(self.layers) - shown} more layers (--top, or --json for all)")
        lines += ["", f"outputs, typed graph vs fp32 graph: {_describe(self.outputs)}"]
        if self.engine_outputs is not None:
            lines.append(f"outputs, {self.backend} engine vs eager fp32: {_describe(self.engine_outputs)}")
        if self.unmatched:
            lines.append(f"not measured (no fp32 twin): {', '.join(self.unmatched)}")
        return "\n".join(lines)


def removed_error(outputs: ErrorStats, kept: ErrorStats, metric: str) -> float:
    """``outputs``' error under ``metric`` less ``kept``'s: inf when keeping makes non-finite outputs finite."""
    before, after = outputs.value(metric), kept.value(metric)
    if math.isinf(before):
        return 0.0 if math.isinf(after) else math.inf
    return -math.inf if math.isinf(after) else before - after


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def short_module(module: str, width: int = 32) -> str:
    """A module path cut to its last ``width`` characters, for tables and plots ("-" for none)."""
    if not module:
        return "-"
    return module if len(module) <= width else "..." + module[-(width - 3) :]


def _describe(stats: ErrorStats) -> str:
    return ", ".join(f"{m} {format_error(stats.value(m))}" for m in ERROR_METRICS)


def reference_graph(model: Any, example_inputs: Sequence[torch.Tensor], policy: str) -> CompiledGraph:
    """The fp32 graph whose nodes are named like those of a graph compiled with compiler ``policy``.

    The exact policies (amp, fp32) lower without the last-bit-changing passes,
    the others with them (batch norm folded): the reference takes the same
    lowering, all fp32 (for amp: eager fp32, the model's own autocast regions
    as written).
    """
    if policy in ("amp", "fp32"):
        return compile(model, example_inputs, policy="fp32")
    return compile(model, example_inputs, policy="explicit", explicit={".*": "fp32"})


def _tensors_only(value: Any) -> bool:
    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


class _NoTwin(Exception):
    """An input of the layer has no fp32 twin to start from."""


def _source(node: torch.fx.Node, reference: dict[str, Any]) -> torch.fx.Node:
    """The node whose fp32 twin feeds ``node``'s edge: through inserted casts to their producer."""
    while node.name not in reference:
        source = node.args[0] if is_cast(node) else None
        if not isinstance(source, torch.fx.Node):
            raise _NoTwin(node.name)
        node = source
    return node


def _as_typed(value: Any, like: torch.fx.Node) -> Any:
    """``value`` converted to the dtype the typed graph has on that edge."""
    want = like.meta.get("val")
    if isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor) and value.dtype != want.dtype:
        return value.to(want.dtype)
    return value


def _introduced(node: torch.fx.Node, gm: torch.fx.GraphModule, reference: dict[str, Any]) -> Any:
    """``node`` run on the reference's inputs cast to its own input dtypes, with its own weights."""

    def resolve(arg: torch.fx.Node) -> Any:
        if arg.op == "get_attr":
            return getattr(gm, str(arg.target))
        return _as_typed(reference[_source(arg, reference).name], arg)

    args, kwargs = pytree.tree_map_only(torch.fx.Node, resolve, (node.args, node.kwargs))
    op = node.target
    assert callable(op), f"call_function node {node.name} has no callable target"
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        return op(*args, **kwargs)


def _kept_fp32(twin: torch.fx.Node, reference: CompiledGraph, got: dict[str, Any]) -> Any:
    """The fp32 twin run on the typed graph's values at its inputs, converted to fp32 (its weights fp32)."""

    def resolve(arg: torch.fx.Node) -> Any:
        if arg.op == "get_attr":
            return getattr(reference.graph_module, str(arg.target))
        if arg.name not in got:
            raise _NoTwin(arg.name)
        return _as_typed(got[arg.name], arg)

    args, kwargs = pytree.tree_map_only(torch.fx.Node, resolve, (twin.args, twin.kwargs))
    op = twin.target
    assert callable(op), f"call_function node {twin.name} has no callable target"
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        return op(*args, **kwargs)


def _as_reference(value: Any, twin: Any) -> Any:
    """A layer's low-precision result in the dtypes of its fp32 twin, to run on in fp32."""
    return pytree.tree_map(lambda v, t: v.to(t.dtype), value, twin)


def _depths(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Longest chain of layers from an input to each node (inserted casts and getitems add nothing)."""
    depth: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            depth[node.name] = 0
            continue
        upstream = max((depth.get(a.name, 0) for a in node.all_input_nodes), default=0)
        transparent = node.meta.get("inserted_cast") or node.target is operator.getitem
        depth[node.name] = upstream + (0 if transparent else 1)
    return depth


def attribute_errors(
    typed: CompiledGraph,
    reference: CompiledGraph,
    batches: Sequence[Batch],
    *,
    engine: Engine | None = None,
    progress: Callable[[int], None] | None = None,
    kept: bool = True,
) -> tuple[list[LayerError], ErrorStats, list[str]]:
    """Per-layer errors of ``typed`` against ``reference`` over ``batches`` (worst over batches).

    Returns the layers in graph order, the error of the typed graph's
    outputs, and the layers without an fp32 twin (named, not measured).
    With an ``engine`` built from ``typed`` whose backend exposes
    intermediates (:mod:`harness.debug.taps`), each layer's accumulated
    error is also read off the engine. ``progress`` is called after each
    batch with the batch count done. Without ``kept`` the runs that keep each
    layer in fp32 are skipped (each layer's ``kept`` is then the outputs' own
    error: it removes nothing).
    """
    gm = typed.graph_module
    rows = {row.name: row for row in typed.report.rows}
    layers, folded = fold_data_movement(
        [n for n in gm.graph.nodes if n.op == "call_function" and rows[n.name].rule not in _NOT_LAYERS]
    )
    twins = {n.name: n for n in reference.graph_module.graph.nodes}
    errors: dict[str, dict[str, ErrorStats]] = {"introduced": {}, "accumulated": {}, "impact": {}, "kept": {}, "engine": {}}
    unmatched: dict[str, None] = {}
    outputs = ErrorStats.exact()
    for done, batch in enumerate(batches, start=1):
        ref = node_values(reference, batch)
        got = node_values(typed, batch)
        ref_out = tuple(outputs_with(reference, batch, {}))
        taps = engine_values(engine, batch) if engine is not None else None
        for node in layers:
            if node.name not in ref or not _tensors_only(ref[node.name]):
                unmatched[node.name] = None
                continue
            try:
                alone = _introduced(node, gm, ref)
            except _NoTwin:
                unmatched[node.name] = None
                continue
            twin = ref[node.name]
            solo = tuple(outputs_with(reference, batch, {node.name: _as_reference(alone, twin)}))
            measured = [("introduced", alone, twin), ("accumulated", got[node.name], twin), ("impact", solo, ref_out)]
            if taps is not None and node.name in taps:
                measured.append(("engine", taps[node.name], twin))
            for kind, value, against in measured:
                stats = ErrorStats.of(compare_outputs(value, against))
                store = errors[kind]
                store[node.name] = stats if node.name not in store else store[node.name].worst(stats)
        typed_out = tuple(outputs_with(typed, batch, {}))
        outputs = outputs.worst(ErrorStats.of(compare_outputs(typed_out, ref_out)))
        for node in layers if kept else ():
            if node.name not in errors["introduced"]:
                continue
            try:
                fp32 = _kept_fp32(twins[node.name], reference, got)
            except _NoTwin:
                fp32 = ref[node.name]  # an input only the typed graph has: as good as the reference's
            kept_out = tuple(outputs_kept_wide(typed, batch, node.name, fp32))
            stats = ErrorStats.of(compare_outputs(kept_out, ref_out))
            errors["kept"][node.name] = stats if node.name not in errors["kept"] else errors["kept"][node.name].worst(stats)
        if progress is not None:
            progress(done)
    depth = _depths(gm)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    result = [
        LayerError(
            name=n.name,
            op=rows[n.name].op,
            module=rows[n.name].module,
            precision=rows[n.name].precision,
            index=order[n.name],
            depth=depth[n.name],
            introduced=errors["introduced"][n.name],
            accumulated=errors["accumulated"][n.name],
            impact=errors["impact"][n.name],
            kept=errors["kept"].get(n.name, outputs),
            folded=tuple(folded[n.name]),
            engine=errors["engine"].get(n.name),
        )
        for n in layers
        if n.name in errors["introduced"]
    ]
    return result, outputs, list(unmatched)


def engine_output_error(engine: Engine, module: torch.nn.Module, batches: Sequence[Batch]) -> ErrorStats:
    """An engine's outputs against eager fp32, worst over ``batches``."""
    worst = ErrorStats.exact()
    with torch.inference_mode():
        for batch in batches:
            outputs = engine(*engine_inputs(engine, batch))
            worst = worst.worst(ErrorStats.of(compare_outputs(outputs, module(*batch))))
    return worst


@preserves_global_state
def debug_layers(
    spec: ModelSpec,
    mode: PrecisionMode | str,
    batches: Sequence[Batch],
    *,
    backend: Any = None,
    settings: AutocastSettings | None = None,
    explicit_path: str | None = None,
    rank_by: str | None = None,
    rank_on: str = DEFAULT_RANK_ON,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> LayerReport:
    """``harness debug layers``: compile ``spec`` in precision ``mode`` and attribute its error.

    With ``backend`` (a :class:`harness.engines.protocol.Backend`) the mode is
    first checked against it (refused with the backend's reason) and the
    engine is built and compared end to end, so the report says whether the
    engine computes what the typed graph does. ``rank_by`` defaults to
    :func:`default_rank_by` of ``rank_on``.
    """
    if rank_on not in RANK_ON:
        raise HarnessError(f"--rank-on {rank_on!r}: valid: {', '.join(RANK_ON)}")
    rank_by = rank_by or default_rank_by(rank_on)
    check_metric(rank_by, "--rank-by", ERROR_METRICS)
    mode = PrecisionMode.parse(mode)
    if mode.weak:
        strong = mode.low
        raise HarnessError(
            f"debug layers cannot attribute error in {mode}: in weak modes the builder picks each layer's "
            f"precision at build time and the typed graph stays fp32. Use {strong}, autocast-{strong} or "
            "explicit (a plan from harness debug precision)"
        )
    if threads is not None:
        torch.set_num_threads(threads)  # restored on return
    config = BuildConfig(mode=mode, explicit_path=explicit_path, threads=threads, autocast=settings or AutocastSettings())
    if backend is not None:
        typed = compile_graph(spec, config, backend)  # refuses a mode the backend cannot build
    else:
        typed = compile_for_mode(spec, mode, explicit_path, config.autocast)
    reference = reference_graph(spec.module, spec.example_inputs, typed.policy)
    engine = backend.build(typed, config, None)[0] if backend is not None else None
    layers, outputs, unmatched = attribute_errors(typed, reference, batches, engine=engine, progress=progress)
    engine_outputs = engine_output_error(engine, spec.module, batches) if engine is not None else None
    return LayerReport(
        model=spec.name,
        mode=mode,
        backend=backend.name if backend is not None else "none",
        batches=len(batches),
        rank_by=rank_by,
        rank_on=rank_on,
        layers=layers,
        outputs=outputs,
        engine_outputs=engine_outputs,
        unmatched=unmatched,
    )

