"""Cast insertion on edges.

Walks the graph once in topological order. For each node, the decision is
resolved against the dtypes that actually reach it (AMP's promote and
fall-through depend on them), casts are inserted on the incoming edges, and the
node's ``meta["val"]`` is recomputed on fake tensors so that every later
decision, and every engine, sees the dtype that really runs.

One cast per tensor per target dtype, placed right after the producer and
shared by all consumers. Weights are never cast at run time: a converted copy
is made ahead of time (one per precision when a weight is used by both), with
fp16 copies clipped to the fp16 range and the clipped values counted. The amp policy
does not clip, because eager autocast does not either (``.to(float16)``
overflows to inf) and AMP's contract is to match eager bit for bit.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

import torch
import torch.utils._pytree as pytree

from harness.autocast.decision import Action, Decision
from harness.autocast.follow import DtypeLinks
from harness.dtypes import dtype_label, dtype_name
from harness.errors import HarnessError
from harness.fxutil import fake_mode_of
from harness.opnames import resolve_op

aten = torch.ops.aten
FP16_MAX = float(torch.finfo(torch.float16).max)
CAST = aten._to_copy.default


@dataclass
class CastStats:
    inserted: int = 0
    weights_converted: int = 0
    clipped_values: int = 0
    overflowed_values: int = 0
    clipped_weights: list[str] = field(default_factory=list)


def is_cast(node: torch.fx.Node) -> bool:
    """A pure dtype conversion (what this pass inserts and the clean-up passes rewrite)."""
    return (
        node.op == "call_function"
        and node.target is CAST
        and len(node.args) == 1
        and set(node.kwargs) == {"dtype"}
    )


def arg_node(node: torch.fx.Node, index: int = 0) -> torch.fx.Node:
    """``node.args[index]`` where the op's schema makes it a tensor, hence a graph node."""
    arg = node.args[index]
    if not isinstance(arg, torch.fx.Node):
        raise HarnessError(
            f"node {node.name} ({node.target}): argument {index} is {type(arg).__name__}, expected a graph node"
        )
    return arg


def node_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype of the tensor ``node`` produces (its ``meta["val"]``)."""
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):
        raise HarnessError(f"node {node.name}: expected a tensor value, got {type(val).__name__}")
    return val.dtype


def _eligible(node: object) -> TypeGuard[torch.fx.Node]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype != torch.float64


def _promote_type(node: torch.fx.Node, inputs: list[torch.fx.Node], low: torch.dtype) -> torch.dtype:
    widest = low
    for a in inputs:
        d = node_dtype(a)
        if d == torch.float32:
            widest = torch.float32
        elif d != low:
            raise HarnessError(
                f"node {node.name}: autocast promote cannot mix {dtype_label(d)} with {dtype_name(low)} "
                "(PyTorch raises here too); cast the inputs to one type in the model"
            )
    return widest


# Normalization kernels take a low-precision activation with fp32 parameters
# and compute their statistics in fp32 (what eager autocast runs): their
# weights, biases and running statistics stay fp32 when the node is lowered.
NORM_PARAMETERS = {
    aten.batch_norm.default: (1, 2, 3, 4),
    aten.layer_norm.default: (2, 3),
    aten.group_norm.default: (2, 3),
}


def _fp32_parameters(node: torch.fx.Node) -> set[torch.fx.Node]:
    positions = NORM_PARAMETERS.get(node.target, ()) if isinstance(node.target, torch._ops.OpOverload) else ()
    return {
        a
        for i in positions
        if i < len(node.args)
        and isinstance(a := node.args[i], torch.fx.Node)
        and a.op == "get_attr"
        and node_dtype(a) == torch.float32
    }


def _dtype_arg_given(node: torch.fx.Node) -> bool:
    target = node.target
    assert isinstance(target, torch._ops.OpOverload), f"{node.name}: set_opt_dtype needs an OpOverload, got {target!r}"
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dtype":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dtype")
            return value is not None
    return False


class _Inserter:
    def __init__(self, gm: torch.fx.GraphModule, clip_fp16: bool, mixed_norms: bool, copies_require_grad: bool) -> None:
        self.gm = gm
        self.copies_require_grad = copies_require_grad
        self.mixed_norms = mixed_norms
        self.graph = gm.graph
        self.fake_mode = fake_mode_of(gm)
        self.clip_fp16 = clip_fp16
        self.stats = CastStats()
        self.cache: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.last_placeholder = placeholders[-1] if placeholders else None
        self.links = DtypeLinks(gm)

    def cast(self, src: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        key = (src, dtype)
        if key not in self.cache:
            self.cache[key] = self._weight_copy(src, dtype) if src.op == "get_attr" else self._cast_node(src, dtype)
        return self.cache[key]

    def _cast_node(self, src: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        anchor = self.last_placeholder if src.op == "placeholder" else src
        with self.graph.inserting_after(anchor):
            node = self.graph.create_node("call_function", CAST, (src,), {"dtype": dtype}, name=f"{src.name}_{dtype_name(dtype)}")
        with self.fake_mode:
            node.meta["val"] = src.meta["val"].to(dtype)
        node.meta["inserted_cast"] = True
        self.stats.inserted += 1
        return node

    def _weight_copy(self, src: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        tensor = getattr(self.gm, str(src.target)).detach()
        label = str(src.meta.get("weight_name", src.target))
        if dtype == torch.float16:
            over = int((tensor.abs() > FP16_MAX).sum())
            if over and self.clip_fp16:
                tensor = tensor.clamp(-FP16_MAX, FP16_MAX)
                self.stats.clipped_values += over
                self.stats.clipped_weights.append(label)
            elif over:
                self.stats.overflowed_values += over
        converted = tensor.to(dtype).contiguous()
        name = f"{src.target}_{dtype_name(dtype)}"
        source = getattr(self.gm, str(src.target))
        if isinstance(source, torch.nn.Parameter):
            # As eager autocast's cached cast of a parameter (outside inference mode): it requires
            # grad when the parameter does, and some kernels take another path then (linear on a
            # transposed 3-D input runs as clone + mm).
            grad = source.requires_grad and self.copies_require_grad
            self.gm.register_parameter(name, torch.nn.Parameter(converted, requires_grad=grad))
        else:
            self.gm.register_buffer(name, converted)
        with self.graph.inserting_after(src):
            node = self.graph.get_attr(name)
        node.meta["val"] = self.fake_mode.from_tensor(converted, static_shapes=True)
        node.meta["weight_name"] = label
        self.stats.weights_converted += 1
        return node

    def rewrite(self, node: torch.fx.Node, decision: Decision) -> None:
        inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _eligible(a)]
        action = decision.action
        targets: dict[torch.fx.Node, torch.dtype] = {}
        if action is Action.CAST:
            assert decision.dtype is not None
            keep = _fp32_parameters(node) if self.mixed_norms else set()
            targets = {a: decision.dtype for a in inputs if node_dtype(a) != decision.dtype and a not in keep}
        elif action is Action.PROMOTE:
            widest = _promote_type(node, inputs, decision.dtype or torch.float32)
            targets = {a: widest for a in inputs if node_dtype(a) != widest}
        elif action is Action.SET_OPT_DTYPE:
            if _eligible(node.args[0]) and not _dtype_arg_given(node):
                node.kwargs = {**node.kwargs, "dtype": torch.float32}
        elif action is Action.APPEND_DTYPE:
            first = arg_node(node)
            node.target = resolve_op(str(decision.redispatch))
            node.kwargs = {**node.kwargs, "dtype": torch.float32 if _eligible(first) else node_dtype(first)}
        if targets:
            node.args, node.kwargs = pytree.tree_map(
                lambda a: self.cast(a, targets[a]) if isinstance(a, torch.fx.Node) and a in targets else a,
                (node.args, node.kwargs),
            )
        self.refresh(node)

    def refresh(self, node: torch.fx.Node) -> None:
        """Recompute ``meta["val"]`` from the (possibly re-typed) inputs."""
        if node.target is operator.getitem:
            node.meta["val"] = arg_node(node).meta["val"][node.args[1]]
            return
        target = node.target
        if not callable(target):
            raise HarnessError(f"node {node.name} ({target}): not a callable op")
        args, kwargs = pytree.tree_map(
            lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs)
        )
        try:
            with self.fake_mode:
                node.meta["val"] = target(*args, **kwargs)
        except Exception as exc:
            raise HarnessError(f"node {node.name} ({node.target}) cannot run with the decided types: {exc}") from exc


def insert_casts(
    gm: torch.fx.GraphModule,
    decisions: Mapping[str, Decision],
    *,
    clip_fp16: bool,
    cast_outputs_back: bool,
    mixed_norms: bool = True,
    copies_require_grad: bool = True,
) -> CastStats:
    """Apply ``decisions``; with ``cast_outputs_back`` the public output dtypes are kept.

    ``mixed_norms`` keeps normalization parameters fp32 on lowered nodes (see
    ``NORM_PARAMETERS``); the amp policy turns it off because AMP's cast policy decides that.
    A converted copy of a parameter is a parameter that requires grad when its source does
    and ``copies_require_grad`` is set (eager autocast's casts outside ``torch.inference_mode``);
    a copy of a buffer is a buffer.
    """
    inserter = _Inserter(gm, clip_fp16, mixed_norms, copies_require_grad)
    output = gm.graph.output_node()
    original_out = [node_dtype(a) if _eligible(a) else None for a in _output_values(output)]
    with torch.autocast("cpu", enabled=False):
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.meta.get("inserted_cast"):
                continue
            inserter.links.resolve(node)
            decision = decisions.get(node.name)
            if decision is None:
                inserter.refresh(node)
            else:
                inserter.rewrite(node, decision)
        if cast_outputs_back:
            outs = _output_values(output)
            for i, (a, want) in enumerate(zip(outs, original_out, strict=True)):
                if want is not None and isinstance(a, torch.fx.Node) and node_dtype(a) != want:
                    outs[i] = inserter.cast(a, want)
            output.args = (tuple(outs),)
    return inserter.stats


def _output_values(output: torch.fx.Node) -> list[torch.fx.node.Argument]:
    """The graph's outputs: the output node's single argument is their tuple (or list)."""
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        raise HarnessError(f"graph output is {type(values).__name__}, expected a tuple of outputs")
    return list(values)


def retype_inputs(gm: torch.fx.GraphModule) -> None:
    """``keep_io_types=False``: an input only ever consumed in one other float type takes that type."""
    fake_mode = fake_mode_of(gm)
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder" and _eligible(n)]:
        users = list(ph.users)
        dtypes = {u.kwargs["dtype"] for u in users if is_cast(u)}
        if users and len(dtypes) == 1 and all(is_cast(u) for u in users):
            (dtype,) = dtypes
            with fake_mode:
                ph.meta["val"] = ph.meta["val"].to(dtype)
            for u in users:
                u.replace_all_uses_with(ph)
                gm.graph.erase_node(u)
