"""The CPU engine builder: choose a tactic (and in weak modes a precision) per layer.

Layers are visited in graph order. A layer with a single implementation is
taken as is. Otherwise its key is looked up in the timing cache; on a hit the
cached tactic is used without timing, on a miss every candidate is timed on
the layer's real inputs (the build runs the graph forward on the compiled
graph's example inputs, with the tactics already chosen upstream, so inputs
have the shapes, dtypes and memory layouts the engine will see) and the
fastest is kept and recorded.

Strong modes obey the graph's dtypes exactly. In weak modes the graph is fp32
and each compute layer may also run in the low precision: the candidates are
(precision x implementation), each timed including the cost of casting its
inputs from whatever dtype the producer chose, and the chosen precision is
made explicit in the plan with cast ("reformat") layers and converted weights.

Two decisions no layer's own timing can make are then made by running the
whole plan: in weak modes, whether every timed layer runs in the low precision
(no casts between layers, one dtype through each region); then whether the
timed layers move onto their oneDNN Graph tactics (regions).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.autocast.casts import NORM_PARAMETERS
from harness.cache.timing_cache import CacheEntry, Candidate, TimingCache
from harness.dtypes import FLOAT_DTYPES, dtype_from_name
from harness.engines.cpu import tactics
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.plan import (
    GETITEM,
    Node,
    Plan,
    Ref,
    TensorMeta,
    WeightRef,
    encode_arg,
    iter_leaves,
    map_leaves,
)
from harness.engines.cpu.program import compile_plan, region_groups
from harness.engines.cpu.timing import TimingOptions, median_ms
from harness.engines.protocol import BuildConfig, LayerTiming
from harness.errors import HarnessError
from harness.fileio import canonical_json
from harness.opnames import plan_name

# How the build's messages name the tactics on oneDNN's primitives.
PRIMITIVES = f"oneDNN primitives ({', '.join(tactics.PRIMITIVE_IMPLS)})"
# Layer types whose precision a weak-mode build chooses by timing.
CHOOSABLE = frozenset(
    "convolution matmul softmax normalization attention elementwise pooling reduce concatenation resize".split()
)
# Layer types that only move data: they run in whatever dtype their input arrives in.
PASSTHROUGH = frozenset(("shuffle", "gather"))
# The least share of a whole run that running more layers in the low precision must save:
# it costs accuracy, so a difference within the timing noise (a few percent on a shared
# machine) must not decide it.
LOWERING_MARGIN = 0.03
# A layer whose own timing on its oneDNN primitive is over this many times its fastest
# candidate's stays off the whole-run plan on primitives: a kernel oneDNN has only as a
# reference loop for that layer's operands (an fp16 matmul with an fp16 bias, oneDNN 3.2:
# 19 ms against 68 us) would sink the plan for every other layer, and time it for
# minutes. A primitive's call overhead alone costs a small layer well under this.
PRIMITIVE_OUTLIER = 10.0
# What one decision pass (PlanBuilder._decide_all) builds: a whole-run decision that
# tries another pass keeps these to restore them.
_PASS_STATE = ("plan", "runtime", "cast_names", "values", "executed", "timings")
# Plan op -> argument positions of the parameters a normalization keeps in fp32.
_NORM_POSITIONS = {plan_name(op): positions for op, positions in NORM_PARAMETERS.items()}


@dataclass(frozen=True)
class _Variant:
    """One way to run a layer: the typed node, its input casts and its candidate tactics."""

    precision: str
    node: Node  # refs still name the producers; casts are applied in front
    casts: tuple[str | None, ...]  # per ref: dtype to cast to, None to pass as is
    impls: tuple[str, ...]


def layer_key(
    node: Node,
    graph_metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
    precisions: Sequence[str],
) -> str:
    """TensorRT-style per-layer key: "0x" + 32 hex of (name, op, shapes, dtypes, attributes)."""

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, Ref):
            return {"tensor": graph_metas[leaf.name].to_json()}
        if isinstance(leaf, WeightRef):
            return {"weight": TensorMeta.of(weights[leaf.name]).to_json()}
        return encode_arg(leaf)

    material: dict[str, Any] = {
        "layer": node.name,
        "op": node.op,
        "args": [describe(a) for a in iter_leaves(node.args)],
        "kwargs": {
            k: [describe(a) for a in iter_leaves(v)] for k, v in sorted(node.kwargs.items())
        },
        "outputs": [None if m is None else m.to_json() for m in node.outputs],
        "fused": list(node.fused),
        "epilogue": node.epilogue,
        "precisions": list(precisions),
    }
    if node.residual is not None:  # keys of layers without one stay as they were
        material["residual"] = describe(node.residual)
    return "0x" + hashlib.sha256(canonical_json(material)).hexdigest()[:32]


class PlanBuilder:
    """One build: lowering, then a tactic (and precision) decision per layer."""

    def __init__(
        self, config: BuildConfig, cache: TimingCache | None, timing: TimingOptions
    ) -> None:
        self.config = config
        self.cache = None if config.disable_cache else cache
        self.added: dict[str, CacheEntry] = {}  # timed by this build (the given cache is never changed)
        self.timing = timing
        self.weak_low = (
            config.mode.low if config.mode.weak else None
        )
        self.messages: list[str] = []
        self.warnings: list[str] = []
        self.timings: list[LayerTiming] = []
        # tactic -> layers whose cache entry was timed without it (a cache older than the tactic)
        self.untimed: dict[str, list[str]] = {}
        self.timed: set[str] = set()  # keys of the layers this build timed (not from the cache)
        # key -> the record of a layer this build timed, whose choice a later pass overrides
        self.forced: dict[str, LayerTiming] = {}
        # why a tactic is not offered here -> (those tactics, the layers), each in first-seen order
        self.left_out: dict[str, tuple[dict[str, None], dict[str, None]]] = {}

    def build(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Plan:
        graph, self.messages = lower(gm, self.config.mode)
        self.graph_metas = graph.value_metas()
        self._decide_all(graph, example_inputs)
        if self.weak_low is not None:
            self._choose_precisions(graph, example_inputs)
        self._choose_regions()
        self._choose_primitives()
        self.messages += [_left_out_note(reason, *found) for reason, found in self.left_out.items()]
        if self.untimed:
            self.warnings.append(_untimed_note(self.untimed))
            self.messages.append(self.warnings[-1])
        return self.plan

    def _decide_all(self, graph: Plan, example_inputs: Sequence[torch.Tensor]) -> None:
        """One pass over the lowered graph: a tactic (and precision) per layer, in order."""
        self.plan = Plan(graph.mode, list(graph.inputs), [], [], dict(graph.weights))
        self.runtime = dict(graph.inputs)  # value name -> meta as the engine produces it
        self.cast_names: dict[tuple[str, str], str] = {}
        self.values: dict[str, Any] = {
            name: t for (name, _), t in zip(graph.inputs, example_inputs, strict=True)
        }
        self.executed = 0
        self.timings = []
        for node in graph.nodes:
            if node.op == GETITEM:
                self._emit_getitem(node)
            else:
                self._decide(node)
        for out in graph.outputs:
            self.plan.outputs.append(self._output(out))
        used = {
            leaf.name
            for n in self.plan.nodes
            for leaf in iter_leaves((n.args, n.kwargs))
            if isinstance(leaf, WeightRef)
        }
        used |= {o.name for o in self.plan.outputs if isinstance(o, WeightRef)}
        self.plan.weights = {k: v for k, v in self.plan.weights.items() if k in used}

    # --- decisions ----------------------------------------------------------------------

    def _decide(self, node: Node) -> None:
        variants = self._variants(node)
        candidates = [(v, impl) for v in variants for impl in v.impls]
        names = [tactics.tactic_name(impl, v.precision) for v, impl in candidates]
        key = layer_key(node, self.graph_metas, self.plan.weights, [v.precision for v in variants])
        if len(candidates) == 1:
            chosen, record = (
                0,
                LayerTiming(node.name, key, (), names[0], tactics.tactic_hash(names[0]), False),
            )
        else:
            chosen, record = self._select(node, key, candidates, names)
        self.timings.append(record)
        variant, impl = candidates[chosen]
        self._emit(variant, key, names[chosen], tuned=len(candidates) > 1)

    def _select(
        self, node: Node, key: str, candidates: list[tuple[_Variant, str]], names: list[str]
    ) -> tuple[int, LayerTiming]:
        if (forced := self.forced.get(key)) is not None:
            return names.index(forced.chosen), forced
        entry = self.added.get(key) or (self.cache.query(key) if self.cache is not None else None)
        if entry is not None:
            if entry.tactic not in names:
                why = next((reason for reason, (left, _) in self.left_out.items() if entry.tactic in left), None)
                raise HarnessError(
                    f"timing cache entry for layer {node.name!r} (key {key}) selects tactic {entry.tactic!r}, "
                    + (f"which this CPU does not offer ({why})" if why else "which this layer does not have")
                    + f"; valid tactics: {', '.join(names)}"
                )
            index = names.index(entry.tactic)
            if entry.candidates and not entry.pinned:
                raced = {c.tactic for c in entry.candidates}
                for name in names:
                    if name not in raced:
                        self.untimed.setdefault(name, []).append(node.name)
            return index, LayerTiming(
                node.name, key, entry.candidates, entry.tactic, entry.tactic_hash, True
            )
        if self.config.error_on_cache_miss:
            raise HarnessError(
                f"layer {node.name!r} (key {key}) is not in the timing cache and would have to be timed "
                f"({len(names)} candidates); the build was told to fail on a cache miss"
            )
        self._materialize()
        inputs = [self.values[r.name] for r in node.refs()]
        with tactics.layer_failures(node):
            fns = [self._timed_fn(variant, impl) for variant, impl in candidates]
            times = median_ms(fns, inputs, self.timing)
        timed = tuple(
            Candidate(name, tactics.tactic_hash(name), ms) for name, ms in zip(names, times, strict=True)
        )
        index = min(range(len(timed)), key=lambda i: timed[i].time_ms)
        best = timed[index]
        self.timed.add(key)
        if self.cache is not None and self.config.editable_cache:
            self.added[key] = CacheEntry(key, node.name, best.tactic, best.tactic_hash, best.time_ms, timed)
        return index, LayerTiming(node.name, key, timed, best.tactic, best.tactic_hash, False)

    def _variants(self, node: Node) -> list[_Variant]:
        refs = node.refs()
        in_dtypes = [self.runtime[r.name].dtype for r in refs]
        graph_dtypes = [self.graph_metas[r.name].dtype for r in refs]
        kind = tactics.layer_type(node)
        if self.weak_low is not None and kind in CHOOSABLE and self._all_fp32(node, graph_dtypes):
            return [self._retyped(node, p, in_dtypes) for p in ("fp32", self.weak_low)]
        if self.weak_low is not None and kind in PASSTHROUGH:
            float_in = {d for d in in_dtypes if d in FLOAT_DTYPES}
            if len(float_in) == 1:
                (dtype,) = float_in
                outputs = tuple(
                    None if m is None else self._float_as(m, dtype) for m in node.outputs
                )
                return [self._variant(replace(node, outputs=outputs), (None,) * len(refs), refs)]
        # Strong typing (and fixed layers in weak mode): the graph's dtypes exactly.
        casts = tuple(g if g != d else None for g, d in zip(graph_dtypes, in_dtypes, strict=True))
        return [self._variant(node, casts, refs)]

    def _all_fp32(self, node: Node, graph_dtypes: list[str]) -> bool:
        float_weights = [
            self.plan.weights[w.name]
            for w in node.weight_refs()
            if self.plan.weights[w.name].is_floating_point()
        ]
        return (
            all(d == "fp32" for d in graph_dtypes if d in FLOAT_DTYPES)
            and all(w.dtype == torch.float32 for w in float_weights)
            and all(m is not None and m.dtype == "fp32" for m in node.outputs)
            and not any(
                isinstance(leaf, torch.dtype) for leaf in iter_leaves((node.args, node.kwargs))
            )
        )

    def _retyped(self, node: Node, precision: str, in_dtypes: list[str]) -> _Variant:
        """``node`` run in ``precision``: float inputs cast, float weights converted once.

        A normalization's parameters stay fp32, as the compiler keeps them
        (:data:`harness.autocast.casts.NORM_PARAMETERS`): its kernels take a
        low-precision input with fp32 parameters and compute in fp32, and
        oneDNN runs such a layer norm inside a region, where a bf16-parameter
        one falls back to ATen (65 us against a partition's 20 on the zoo
        transformer).
        """
        kept = {
            arg.name
            for i in _NORM_POSITIONS.get(node.op, ())
            if i < len(node.args) and isinstance(arg := node.args[i], WeightRef)
        }

        def convert(leaf: Any) -> Any:
            if (
                isinstance(leaf, WeightRef)
                and precision != "fp32"
                and leaf.name not in kept
                and self.plan.weights[leaf.name].is_floating_point()
            ):
                return WeightRef(self._converted_weight(leaf.name, precision))
            return leaf

        typed = replace(
            node,
            args=map_leaves(node.args, convert),
            kwargs=map_leaves(node.kwargs, convert),
            outputs=tuple(
                None if m is None else self._float_as(m, precision) for m in node.outputs
            ),
        )
        casts = tuple(
            precision if d in FLOAT_DTYPES and d != precision else None for d in in_dtypes
        )
        return self._variant(typed, casts)

    def _variant(
        self, node: Node, casts: tuple[str | None, ...], refs: list[Ref] | None = None
    ) -> _Variant:
        """``node`` with its inputs cast by ``casts`` and the tactics offered for it (``refs``:
        ``node.refs()``, where the caller has them)."""
        refs = node.refs() if refs is None else refs
        metas = self._typed_metas(node, casts, refs)
        precision = _compute_precision(node, [metas[r.name] for r in refs])
        found = tactics.offer(node, metas, self.plan.weights)
        for impl, reason in found.left_out.items():
            left_out = self.left_out.setdefault(reason, ({}, {}))
            left_out[0][tactics.tactic_name(impl, precision)] = None
            left_out[1][node.name] = None
        return _Variant(precision, node, casts, found.impls)

    def _typed_metas(
        self, node: Node, casts: tuple[str | None, ...], refs: list[Ref] | None = None
    ) -> dict[str, TensorMeta]:
        """Metas of the node's inputs as the chosen variant receives them (after casts)."""
        metas = {}
        for ref, cast in zip(node.refs() if refs is None else refs, casts, strict=True):
            meta = self.runtime[ref.name]
            metas[ref.name] = meta if cast is None else TensorMeta(meta.shape, cast)
        return metas

    def _converted_weight(self, name: str, precision: str) -> str:
        converted = f"{name}.{precision}"
        if converted not in self.plan.weights:
            self.plan.weights[converted] = self.plan.weights[name].to(dtype_from_name(precision))
        return converted

    @staticmethod
    def _float_as(meta: TensorMeta, dtype: str) -> TensorMeta:
        return TensorMeta(meta.shape, dtype) if meta.dtype in FLOAT_DTYPES else meta

    def _choose_precisions(self, graph: Plan, example_inputs: Sequence[torch.Tensor]) -> None:
        """In a weak mode, run every layer this build timed in the low precision if the whole run is then faster.

        Each layer's timing includes casting its inputs from what its producer
        chose, but not what its own choice costs the layers after it: an fp32
        layer between bf16 ones adds a cast on each side and splits the
        regions around it (TensorRT weighs such reformats in its choice). So
        the plan as timed and the plan with each timed layer on its fastest
        low-precision candidate (from the same timings: nothing is timed
        again) run whole, in alternating rounds, each in the forms the later
        passes may give it (:meth:`_later_forms`) and counted at its faster
        one; the low precision wins only by :data:`LOWERING_MARGIN`, as it
        costs accuracy. As in
        :meth:`_choose_regions`, an editable cache records the decision, so a
        rebuild from it is the same engine.
        """
        low = self.weak_low
        timed = {t.key: t for t in self.timings if t.key in self.timed}
        lowered = {}
        for key, record in timed.items():
            options = [c for c in record.candidates if tactics.parse_tactic(c.tactic)[1] == low]
            if options and tactics.parse_tactic(record.chosen)[1] != low:
                best = min(options, key=lambda c: c.time_ms)
                lowered[key] = replace(record, chosen=best.tactic, chosen_hash=best.tactic_hash)
        if not lowered:
            return
        as_timed = {name: getattr(self, name) for name in _PASS_STATE}  # _decide_all rebinds, never mutates
        self.forced = {**timed, **lowered}
        try:
            self._decide_all(graph, example_inputs)
        finally:
            self.forced = {}
        inputs = [self.values[name] for name, _ in self.plan.inputs]
        # Each as it may run: regions and primitives are decided after, and each side counts
        # at its faster form.
        mixed = self._later_forms(as_timed["plan"], as_timed["runtime"])
        in_low = self._later_forms(self.plan, self.runtime)
        times = run_ms([*mixed, *in_low], inputs, self.timing)
        mixed_ms, low_ms = min(times[: len(mixed)]), min(times[len(mixed) :])
        if low_ms > mixed_ms * (1 - LOWERING_MARGIN):
            for name, value in as_timed.items():
                setattr(self, name, value)
            self.messages.append(
                f"kept the timed precisions: with {len(lowered)} more layer(s) in {low} "
                f"the run takes {low_ms:.4g} ms, against {mixed_ms:.4g} ms (lowering them costs "
                f"accuracy, so it must save at least {LOWERING_MARGIN:.0%})"
            )
            return
        self._record_choices({key: record.chosen for key, record in lowered.items()})
        self.messages.append(
            f"ran {len(lowered)} more layer(s) in {low} than their own timings chose: the run takes "
            f"{low_ms:.4g} ms, against {mixed_ms:.4g} ms with fp32 layers and casts between "
            f"(e.g. {next(iter(lowered.values())).layer!r})"
        )

    def _graph_switched(self, plan: Plan, metas: Mapping[str, TensorMeta]) -> list[Node]:
        """``plan``'s nodes with the layers this build timed on their graph tactic (same
        precision), on the form a region traces into partitions (attention), or, off a
        primitive, on their own ATen call, which a region takes in (a cast between an AMP
        transformer's graph layers), where that puts them in a region with another graph
        layer."""
        switched = self._switched(plan, metas, _region_form)
        for group in region_groups(switched):
            graph_layers = [i for i in group if tactics.on_graph_tactic(switched[i])]
            for i in group:
                if switched[i] is not plan.nodes[i] and len(graph_layers) < 2:
                    switched[i] = plan.nodes[i]  # alone either way: keep its own fastest tactic
        return switched

    def _later_forms(self, plan: Plan, metas: Mapping[str, TensorMeta]) -> list[Plan]:
        """``plan`` with its timed layers on graph tactics where that forms regions (as
        :meth:`_choose_regions` may put them), and on oneDNN's primitives (as
        :meth:`_choose_primitives` may): a plan compared in its per-layer tactics alone would
        be judged in a form it rarely keeps (mobilenet bf16: 1.4 ms as timed, 1.1 ms on
        primitives)."""
        return [
            replace(plan, nodes=self._graph_switched(plan, metas)),
            replace(plan, nodes=self._primitive_switched(plan, metas)),
        ]

    def _primitive_switched(self, plan: Plan, metas: Mapping[str, TensorMeta]) -> list[Node]:
        """``plan``'s nodes with the layers this build timed on their oneDNN primitive (same
        precision), where they have one, and the other timed layers that then run outside a
        region back on their own fastest tactic of that precision: a region's form of a layer
        gains only in a region (the transformer's attention in explicit matmuls: 0.57 ms
        alone against 0.47 ms for ATen's fused call, fp32, an AMD EPYC)."""
        switched = self._switched(plan, metas, _primitive_form)
        for i in self._primitive_outliers(switched):
            switched[i] = plan.nodes[i]
        in_regions = {
            i
            for group in region_groups(switched)
            if sum(tactics.on_graph_tactic(switched[j]) for j in group) >= 2
            for i in group
        }
        records = {t.key: t for t in self.timings}
        for i, node in enumerate(switched):
            if node.op == GETITEM or node.key not in self.timed or i in in_regions or tactics.on_primitive(node):
                continue
            precision = tactics.parse_tactic(node.tactic)[1]
            own = min(
                (c for c in records[node.key].candidates if tactics.parse_tactic(c.tactic)[1] == precision),
                key=lambda c: c.time_ms,
            )
            if own.tactic != node.tactic:
                switched[i] = replace(node, tactic=own.tactic, tactic_hash=own.tactic_hash)
        return switched

    def _primitive_outliers(self, nodes: Sequence[Node]) -> dict[int, tuple[float, float]]:
        """Index -> (its time, its fastest candidate's) of each layer of ``nodes`` on a
        primitive whose own timing there was over :data:`PRIMITIVE_OUTLIER` times its fastest
        candidate's of the same precision."""
        records = {t.key: t for t in self.timings}
        outliers = {}
        for i, node in enumerate(nodes):
            if node.op == GETITEM or node.key not in self.timed or not tactics.on_primitive(node):
                continue
            precision = tactics.parse_tactic(node.tactic)[1]
            times = {c.tactic: c.time_ms for c in records[node.key].candidates}
            fastest = min(ms for tactic, ms in times.items() if tactics.parse_tactic(tactic)[1] == precision)
            if node.tactic in times and times[node.tactic] > PRIMITIVE_OUTLIER * fastest:
                outliers[i] = (times[node.tactic], fastest)
        return outliers

    def _switched(
        self, plan: Plan, metas: Mapping[str, TensorMeta], form_of: Callable[[str, list[str]], str | None]
    ) -> list[Node]:
        """``plan``'s nodes with each layer this build timed on ``form_of(its implementation,
        the implementations it has)`` in the same precision, where that names another."""
        switched = list(plan.nodes)
        for i, node in enumerate(plan.nodes):
            if node.op == GETITEM or node.key not in self.timed:
                continue
            impl, precision = tactics.parse_tactic(node.tactic)
            form = form_of(impl, tactics.impl_names(node, metas, plan.weights))
            if form is not None and form != impl:
                tactic = tactics.tactic_name(form, precision)
                switched[i] = replace(node, tactic=tactic, tactic_hash=tactics.tactic_hash(tactic))
        return switched

    def _record_choices(self, chosen: Mapping[str, str]) -> None:
        """Layer key -> the tactic a whole-run decision gave it, in the records and an editable cache."""
        for key, tactic in chosen.items():
            if key in self.added:  # the cache records the decision the build made
                entry = self.added[key]
                # The new tactic was one of the layer's timed candidates.
                time_ms = next(c.time_ms for c in entry.candidates if c.tactic == tactic)
                self.added[key] = replace(
                    entry, tactic=tactic, tactic_hash=tactics.tactic_hash(tactic), time_ms=time_ms
                )
        self.timings = [
            replace(t, chosen=chosen[t.key], chosen_hash=tactics.tactic_hash(chosen[t.key])) if t.key in chosen else t
            for t in self.timings
        ]

    def _choose_regions(self) -> None:
        """Move timed layers onto their oneDNN Graph tactic if the whole run is then faster.

        Consecutive oneDNN Graph layers run as one region (one call, blocked
        layouts between partitions: :mod:`harness.engines.cpu.program`), a
        gain no layer's own timing sees: a squeeze-excite block's 1x1
        convolutions are faster alone as GEMMs but break the region around
        them. So the plan as timed and the plan with every layer this build
        timed on its graph tactic (same precision) run whole, in alternating
        rounds, and the faster stays. Only layers that would then share a
        region with another graph layer are moved (one called alone gains
        nothing). Layers taken from the cache keep their tactic, and an
        editable cache records the decision, so a rebuild from it is the same
        engine; without one (``--disable-cache``, ``--no-editable-cache``)
        each build decides again, by timing.
        """
        self._keep_if_faster(
            self._graph_switched(self.plan, self.runtime),
            "oneDNN Graph tactics (or, off primitives, the ATen calls regions take in)",
            " so that consecutive layers run as regions",
        )

    def _choose_primitives(self) -> None:
        """Move timed linear layers and convolutions onto oneDNN's primitives (``gemm_dnnl``,
        ``conv_dnnl``) if the whole run is then faster, out of regions too.

        A layer's own timing (one call after the other candidates' calls)
        misjudges the primitives on small layers: on digits, timed alone, the
        64x64x64 layer took 9.6 µs on ``gemm_dnnl`` against 8.5 µs on
        ``gemm_nn``, while in the engine's run the layer on the primitive made
        the whole run faster (14.3 against 15.8 µs). And a region's gain is
        what the TorchScript bridge saves over per-layer ATen calls, which the
        primitives save too, at a lower cost per call: mobilenet fp32, every
        convolution and linear layer on its primitive, 2.21-2.38 ms against
        2.43-2.56 ms in regions. So the plan as chosen and the plan with those
        layers on their primitives run whole, as for regions, and the faster
        stays.
        """
        # The plan as timed, each layer on the primitive, says which layers the guard keeps off.
        on_all = self._switched(self.plan, self.runtime, _primitive_form)
        outliers = self._primitive_outliers(on_all)
        if outliers:
            i, (ms, fastest) = next(iter(outliers.items()))
            self.messages.append(
                f"left {len(outliers)} layer(s) off {PRIMITIVES}: their own timing there was over "
                f"{PRIMITIVE_OUTLIER:g}x their fastest tactic's (e.g. {on_all[i].name!r}: {ms:.4g} ms "
                f"on {on_all[i].tactic}, against {fastest:.4g} ms), a kernel oneDNN has only as a slow "
                "fallback for that layer's operands"
            )
        self._keep_if_faster(
            self._primitive_switched(self.plan, self.runtime), PRIMITIVES, ", which their own timing or a region had"
        )

    def _keep_if_faster(self, switched: list[Node], onto: str, why: str) -> None:
        """Run the plan as it is and with ``switched`` nodes, whole, in alternating rounds; keep the faster.

        ``why`` follows the tactics' name in the message (", which ..." or " so that ...").
        """
        moved = [new for new, old in zip(switched, self.plan.nodes, strict=True) if new is not old]
        if not moved:
            return
        inputs = [self.values[name] for name, _ in self.plan.inputs]
        as_timed, candidate = run_ms([self.plan, replace(self.plan, nodes=switched)], inputs, self.timing)
        if candidate >= as_timed:
            self.messages.append(
                f"kept the timed tactics: with {len(moved)} more layer(s) on {onto} "
                f"the run takes {candidate:.4g} ms, against {as_timed:.4g} ms"
            )
            return
        self.plan.nodes = switched
        self._record_choices({node.key: node.tactic for node in moved})
        self.messages.append(
            f"moved {len(moved)} layer(s) onto {onto}{why}: the run takes {candidate:.4g} ms, "
            f"against {as_timed:.4g} ms on the tactics chosen before (e.g. {moved[0].name!r})"
        )

    # --- emission -------------------------------------------------------------------------

    def _emit(self, variant: _Variant, key: str, tactic: str, tuned: bool) -> None:
        casts = iter(variant.casts)  # one per Ref, in refs() order

        def rename(ref: Ref) -> Ref:
            cast = next(casts)
            return ref if cast is None else Ref(self._cast(ref.name, cast))

        node = replace(
            variant.node,
            layer_type=tactics.layer_type(variant.node),
            key=key,
            tactic=tactic,
            tactic_hash=tactics.tactic_hash(tactic),
            tuned=tuned,
        )
        if any(variant.casts):
            node.map_refs(rename)
        self._append(node)

    def _emit_getitem(self, node: Node) -> None:
        """A getitem takes the (possibly retyped) meta of its producer's output."""
        source, index = node.args
        produced = next(n for n in reversed(self.plan.nodes) if n.name == source.name)
        self._append(replace(node, outputs=(produced.outputs[index],)))

    def _cast(self, source: str, dtype: str) -> str:
        """Name of ``source`` converted to ``dtype``, adding one reformat layer per pair."""
        if (source, dtype) in self.cast_names:
            return self.cast_names[(source, dtype)]
        meta = self.runtime[source]
        name = f"{source}.to_{dtype}"
        node = Node(
            name,
            "aten::_to_copy.default",
            (Ref(source),),
            {"dtype": dtype_from_name(dtype)},
            (TensorMeta(meta.shape, dtype),),
            layer_type="reformat",
        )
        node.key = layer_key(node, self.runtime, self.plan.weights, [dtype])
        node.tactic = tactics.tactic_name("direct", dtype)
        node.tactic_hash = tactics.tactic_hash(node.tactic)
        self._append(node)
        self.timings.append(LayerTiming(name, node.key, (), node.tactic, node.tactic_hash, False))
        self.cast_names[(source, dtype)] = name
        return name

    def _append(self, node: Node) -> None:
        self.plan.nodes.append(node)
        if not node.multi and node.outputs and node.outputs[0] is not None:
            self.runtime[node.name] = node.outputs[0]

    def _output(self, out: Ref | WeightRef) -> Ref | WeightRef:
        if isinstance(out, WeightRef):
            return out
        source = out.name
        wanted = self.graph_metas[out.name].dtype
        return Ref(source if self.runtime[source].dtype == wanted else self._cast(source, wanted))

    # --- execution during the build --------------------------------------------------------

    def _materialize(self) -> None:
        """Run the plan built so far (chosen tactics) up to its end, so timing sees real inputs."""
        metas = self.runtime
        with torch.inference_mode():
            for node in self.plan.nodes[self.executed :]:
                args = [self.values[r.name] for r in node.refs()]
                if node.op == GETITEM:
                    self.values[node.name] = operator.getitem(args[0], node.args[1])
                else:
                    impl, _ = tactics.parse_tactic(node.tactic)
                    self.values[node.name] = tactics.bind(node, impl, metas, self.plan.weights)(
                        *args
                    )
        self.executed = len(self.plan.nodes)

    def _timed_fn(self, variant: _Variant, impl: str) -> Callable[..., Any]:
        metas = self._typed_metas(variant.node, variant.casts)
        fn = tactics.bind(variant.node, impl, metas, self.plan.weights)
        if not any(variant.casts):
            return fn
        targets = [None if c is None else dtype_from_name(c) for c in variant.casts]

        def with_casts(*inputs: Any) -> Any:
            return fn(*(x if t is None else x.to(t) for x, t in zip(inputs, targets, strict=True)))

        return with_casts


def run_ms(plans: Sequence[Plan], inputs: Sequence[torch.Tensor], timing: TimingOptions) -> list[float]:
    """Median time of a whole run of each plan, timed as candidates are (alternating rounds)."""
    return median_ms([compile_plan(plan).run for plan in plans], inputs, timing)


def _left_out_note(reason: str, impls: Mapping[str, None], layers: Mapping[str, None]) -> str:
    """Say which tactics this CPU did not offer, for how many layers, and why."""
    names = list(layers)
    return (
        f"not offered on this CPU: {', '.join(impls)} for {len(names)} layer(s) (e.g. {names[0]!r}): "
        f"{reason}, so not worth timing"
    )


def _untimed_note(untimed: dict[str, list[str]]) -> str:
    """Say which cached layers never competed against tactics this harness has.

    The cache's choice still stands (that is what makes rebuilds
    deterministic), but a user comparing speeds should know the engine may be
    missing a faster tactic, and how to let it compete.
    """
    layers = sorted({layer for names in untimed.values() for layer in names})
    tactics_ = ", ".join(sorted({name.split("[")[0] for name in untimed}))
    return (
        f"{len(layers)} layer(s) use cached tactics timed before this harness had {tactics_} "
        f"(e.g. {layers[0]!r}); to let them compete, delete the cache file: the next "
        "`harness build --cache` or `harness bench` times every layer again and writes a new one"
    )


def _primitive_form(impl: str, impls: list[str]) -> str | None:
    """The form of a layer on oneDNN's primitives: the first it has."""
    return next((p for p in tactics.PRIMITIVE_IMPLS if p in impls), None)


def _region_form(impl: str, impls: list[str]) -> str | None:
    """The form of a layer on ``impl`` that a region takes in: its graph tactic, the form a
    region traces into partitions, or, off a primitive without a graph tactic, its ATen call."""
    graph = [g for g in impls if g in tactics.GRAPH_IMPLS]
    if graph:
        return None if impl in graph else graph[0]
    if tactics.REGION_FORMS.get(impl) in impls:
        return tactics.REGION_FORMS[impl]
    return impls[0] if impl in tactics.PRIMITIVE_IMPLS else None


def _compute_precision(node: Node, input_metas: list[TensorMeta]) -> str:
    """The dtype a layer computes in: its float output's, else its float input's."""
    for meta in (*node.outputs, *input_metas):
        if meta is not None and meta.dtype in FLOAT_DTYPES:
            return meta.dtype
    first = node.outputs[0] if node.outputs else None
    return first.dtype if first is not None else "none"
