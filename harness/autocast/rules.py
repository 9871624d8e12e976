"""Classifier rules, one small class each (the ModelOpt AutoCast shape).

A rule looks at one node and either decides (returns a :class:`Decision`) or
abstains (returns ``None``). The classifier only combines rules in order; the
first rule that decides wins, and its reason is kept with the node.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.autocast.amp_lists import CastPolicy, policy_for
from harness.autocast.calibrate import Calibration
from harness.autocast.decision import Action, Decision
from harness.autocast.regions import Region, regions_of
from harness.autocast.settings import AutocastSettings
from harness.dtypes import dtype_name
from harness.errors import HarnessError
from harness.fxutil import input_nodes, module_path, output_dtypes
from harness.opnames import op_name, resolve_op_names

aten = torch.ops.aten
FP32 = torch.float32


@dataclass
class Context:
    """What rules may consult besides the node itself."""

    gm: torch.fx.GraphModule
    device: str
    low: torch.dtype
    settings: AutocastSettings
    calibration: Calibration | None = None
    ambient: Region | None = None  # amp policy: the caller's autocast state
    _absmax: dict[str, float] = field(default_factory=dict)

    def weight_absmax(self, node: torch.fx.Node) -> float:
        """Absmax of a constant tensor; 0 for what has no float values (int tensors, submodules)."""
        name = str(node.target)
        if name not in self._absmax:
            t = getattr(self.gm, name)
            floating = isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
            self._absmax[name] = float(t.detach().abs().max()) if floating else 0.0
        return self._absmax[name]


class Rule(Protocol):
    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None: ...


def _keep(rule: str, reason: str) -> Decision:
    return Decision(Action.KEEP, rule, reason)


def _cast(rule: str, reason: str, dtype: torch.dtype) -> Decision:
    return Decision(Action.CAST, rule, reason, dtype)


def _float_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    ins = [v.dtype for n in input_nodes(node) if isinstance(v := n.meta.get("val"), torch.Tensor)]
    return [d for d in ins + list(output_dtypes(node)) if d.is_floating_point]


class NotFloat:
    """Integer and bool tensors are never cast."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        return None if _float_dtypes(node) else _keep("not_floating_point", "no floating-point tensors: never cast")


class Float64:
    """float64 is never lowered (AMP's eligibility rule)."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        return _keep("float64", "float64 is never lowered") if torch.float64 in _float_dtypes(node) else None


class Getitem:
    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        return _keep("getitem", "getitem passes its producer's dtype through") if node.target is operator.getitem else None


_EXPLICIT_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default}


class ExplicitCast:
    """A cast written in the model decides its own output type."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        return _keep("explicit_cast", "cast written in the model") if node.target in _EXPLICIT_CASTS else None


def effective_state(node: torch.fx.Node, device: str, base: Region | None) -> Region | None:
    """The autocast state a node runs under: the innermost region for ``device``, else ``base``."""
    state = base
    for region in regions_of(node):
        if region.device == device:
            state = region
    return state


def amp_decision(node: torch.fx.Node, device: str, state: Region, rule: str, where: str) -> Decision:
    """AMP ``CastPolicy`` semantics for one node under an enabled autocast state."""
    target = node.target
    entry = policy_for(target, device) if isinstance(target, torch._ops.OpOverload) else None
    if entry is None:
        return _keep(f"{rule}:fallthrough", f"{where}: not in the {device} autocast lists; runs in its input dtype")
    low, name = state.dtype, op_name(target)
    policy = entry.policy
    if policy is CastPolicy.LOWER_PRECISION_FP:
        return _cast(f"{rule}:lower_precision_fp", f"{where}: {name} is lower_precision_fp -> {dtype_name(low)}", low)
    if policy is CastPolicy.FP32:
        return _cast(f"{rule}:fp32", f"{where}: {name} is on the fp32 list", FP32)
    if policy is CastPolicy.PROMOTE:
        return Decision(Action.PROMOTE, f"{rule}:promote", f"{where}: {name} promotes to the widest input type", low)
    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        return Decision(Action.SET_OPT_DTYPE, f"{rule}:fp32_set_opt_dtype", f"{where}: {name} runs with dtype=float32", FP32)
    if policy is CastPolicy.FP32_APPEND_DTYPE:
        return Decision(Action.APPEND_DTYPE, f"{rule}:fp32_append_dtype", f"{where}: {name} redispatches to {entry.redispatch}", FP32, entry.redispatch)
    raise HarnessError(f"node {node.name}: {name} is banned under {device} autocast (PyTorch refuses to run it)")


class AutocastRegionRule:
    """Rule policy: the user's own ``torch.autocast`` regions decide inside them."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        regions = [r for r in regions_of(node) if r.device == ctx.device]
        if not regions:
            return None
        region = regions[-1]
        if not region.enabled:
            return _cast("autocast_region", f"inside {region.describe()}: kept fp32", FP32)
        return amp_decision(node, ctx.device, region, "autocast_region", f"inside {region.describe()}")


class AmpPolicyRule:
    """Amp policy: the caller's autocast state, changed by the model's own regions."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision:
        state = effective_state(node, ctx.device, ctx.ambient)
        if state is None or not state.enabled:
            return _keep("amp:disabled", "autocast disabled here: runs in its input dtype")
        return amp_decision(node, ctx.device, state, "amp", f"amp {dtype_name(state.dtype)}")


def _matches(node: torch.fx.Node, patterns: Sequence[re.Pattern[str]]) -> str | None:
    path = module_path(node)
    for p in patterns:
        if p.search(node.name) or (path and p.search(path)):
            return p.pattern
    return None


def unmatched_selectors(gm: torch.fx.GraphModule, settings: AutocastSettings) -> list[str]:
    """Each exclusion or inclusion (pattern or op) that selects no node of ``gm``: a typo, or a name
    from another version of the model, which would otherwise change nothing without a word."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    ops = {op_name(n.target) for n in nodes}
    found = []
    for setting, patterns in (("nodes_to_exclude", settings.exclude_patterns), ("nodes_to_include", settings.include_patterns)):
        found += [
            f"{setting} {p.pattern!r} matches no node (by name or module path)"
            for p in patterns
            if not any(_matches(n, [p]) for n in nodes)
        ]
    for setting, given in (("targets_to_exclude", settings.targets_to_exclude), ("targets_to_include", settings.targets_to_include)):
        found += [f"{setting} {t} is the op of no node" for t in given if not resolve_op_names([t]) & ops]
    return found


class Include:
    """``nodes_to_include`` / ``targets_to_include`` force low, overriding the exclusions."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        s = ctx.settings
        if (pat := _matches(node, s.include_patterns)) is not None:
            return _cast("nodes_to_include", f"matches nodes_to_include {pat!r}", ctx.low)
        if op_name(node.target) in s.include_targets:
            return _cast("targets_to_include", f"{op_name(node.target)} in targets_to_include", ctx.low)
        return None


class Exclude:
    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        s = ctx.settings
        if (pat := _matches(node, s.exclude_patterns)) is not None:
            return _cast("nodes_to_exclude", f"matches nodes_to_exclude {pat!r}", FP32)
        if op_name(node.target) in s.exclude_targets:
            return _cast("targets_to_exclude", f"{op_name(node.target)} in targets_to_exclude", FP32)
        return None


class Custom:
    """A user's callable: returns a reason to keep fp32, or None."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        for rule in ctx.settings.custom_rules:
            reason = rule(node, ctx)
            if reason:
                return _cast(f"custom:{getattr(rule, '__name__', type(rule).__name__)}", str(reason), FP32)
        return None


class InitMax:
    """A weight or buffer beyond the low type's safe range keeps its consumer fp32."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        limit = ctx.settings.init_max
        if limit is None:
            return None
        for arg in input_nodes(node):
            if arg.op == "get_attr" and (m := ctx.weight_absmax(arg)) > limit:
                label = arg.meta.get("weight_name", arg.target)
                return _cast("init_max", f"weight {label} absmax {m:.4g} > init_max {limit:g}", FP32)
        return None


class DataMax:
    """Activations beyond ``data_max`` on calibration data: the node's own inputs and outputs."""

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        limit = ctx.settings.data_max
        if limit is None or ctx.calibration is None:
            return None
        seen = [(s.absmax, "output") for s in ctx.calibration.get(node.name, [])]
        for arg in input_nodes(node):
            if arg.op != "get_attr":
                seen += [(s.absmax, f"input {arg.name}") for s in ctx.calibration.get(arg.name, [])]
        worst = max(seen, default=None, key=lambda x: x[0])
        if worst is not None and (worst[0] > limit or math.isnan(worst[0])):
            return _cast("data_max", f"{worst[1]} absmax {worst[0]:.4g} > data_max {limit:g}", FP32)
        return None


_REDUCTIONS = {
    "sum", "mean", "cumsum", "cumprod", "prod", "var", "std", "var_mean", "std_mean", "logsumexp",
    "linalg_vector_norm", "norm", "softmax", "log_softmax", "_softmax", "_log_softmax",
}  # fmt: skip


def reduction_depth(node: torch.fx.Node) -> int | None:
    """How many values one output element accumulates, from shape metadata alone."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    base = target.overloadpacket.__name__
    shapes = [tuple(v.shape) if isinstance(v := a.meta.get("val"), torch.Tensor) else () for a in input_nodes(node)]
    if not shapes:
        return None
    if base in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
        w = shapes[1]
        return math.prod(w[1:]) if len(w) > 1 else None
    if base in ("linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot"):
        a = shapes[1] if base in ("addmm", "baddbmm", "addbmm", "addmv") else shapes[0]
        return a[-1] if a else None
    if base in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        return shapes[0][-1] if shapes[0] else None
    if base in ("layer_norm", "native_layer_norm", "rms_norm"):
        normalized = node.args[1]
        return math.prod(normalized) if isinstance(normalized, (list, tuple)) else None
    if base in _REDUCTIONS:
        shape = shapes[0]
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if base in ("softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod") and isinstance(dims, int):
            return shape[dims] if shape else 1
        if dims is None or dims == [] or isinstance(dims, (float, str)):
            return math.prod(shape)
        listed = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        ints = [d for d in listed if isinstance(d, int)]
        if len(ints) != len(listed):
            raise TypeError(f"{node.name}: reduction dims {dims!r} are not ints")
        return math.prod(shape[d] for d in ints) if shape else 1
    return None


class ReductionDepth:
    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        limit = ctx.settings.max_depth_of_reduction
        if limit is None:
            return None
        depth = reduction_depth(node)
        if depth is not None and depth > limit:
            return _cast("max_depth_of_reduction", f"reduction depth {depth} > max_depth_of_reduction {limit}", FP32)
        return None


_HEAVY = frozenset({
    "linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "einsum",
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
})  # fmt: skip


def _activations(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The floating-point tensors ``node`` reads that are no weights."""
    return {
        a for a in input_nodes(node)
        if a.op != "get_attr" and isinstance(v := a.meta.get("val"), torch.Tensor) and v.is_floating_point()
    }  # fmt: skip


class OutputLayer:
    """With ``keep_io_types`` (and ``fp32_output_tail``), the model's last layers keep fp32 where that costs no cast.

    The outputs are cast back to fp32 anyway. The layer that computes an
    output from one activation, and before it any chain of light layers
    (no matrix product, convolution or attention) each reading one
    activation and feeding only that tail, run in fp32: the one cast moves to
    the tail's input (none if that input is fp32 already), and the outputs
    are not rounded to the low precision last.
    """

    def __init__(self) -> None:
        self._tail: dict[torch.fx.Node, bool] = {}

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        settings = ctx.settings
        if not (settings.keep_io_types and settings.fp32_output_tail) or not self.in_tail(node):
            return None
        return _cast("output_layer", "computes the outputs from one activation: fp32 costs no cast", FP32)

    def in_tail(self, node: torch.fx.Node) -> bool:
        if node not in self._tail:
            val = node.meta.get("val")
            users = list(node.users)
            single = isinstance(val, torch.Tensor) and val.is_floating_point() and len(_activations(node)) == 1
            if not single or not users:
                self._tail[node] = False
            elif all(u.op == "output" for u in users):
                self._tail[node] = True
            else:
                target = node.target
                light = isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__ not in _HEAVY
                self._tail[node] = light and all(u.op != "output" and self.in_tail(u) for u in users)
        return self._tail[node]


class Default:
    def __init__(self, rule: str, reason: str) -> None:
        self.rule, self.reason = rule, reason

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision:
        return _cast(self.rule, self.reason.format(low=dtype_name(ctx.low)), ctx.low)


@dataclass
class ExplicitPatterns:
    """``explicit`` policy: the first matching node-name pattern decides the dtype."""

    patterns: Sequence[tuple[Any, torch.dtype]]

    def __call__(self, node: torch.fx.Node, ctx: Context) -> Decision | None:
        for pattern, dtype in self.patterns:
            if _matches(node, [pattern]) is not None:
                return _cast("explicit", f"matches explicit pattern {pattern.pattern!r} -> {dtype_name(dtype)}", dtype)
        return _cast("explicit:unmatched", "no explicit pattern matches: fp32", FP32)
