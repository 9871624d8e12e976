"""From a typed FX graph to the CPU engine's plan, with the builder's graph rewrites.

Rewrites are the ones an inference engine makes before autotuning, and each
keeps the numbers within rounding of the graph's own:
- assertion nodes and dead code are dropped;
- constant subgraphs (nodes fed only by weights, e.g. a slice of a position
  table or a transposed weight, and what is built from a tensor's shape
  alone, e.g. a Swin attention mask filled into ``x.new_zeros(...)``) are
  evaluated once into new weights;
- an inference ``batch_norm`` right after a convolution is folded into the
  convolution's weight and bias (computed in float64, rounded once to the
  convolution's dtype), as TensorRT and oneDNN do;
- an activation (relu, hardswish, hardsigmoid after a convolution or linear
  layer; gelu after a linear layer) that is the only consumer of its
  producer, in the same dtype, becomes that layer's epilogue: one pass over
  memory instead of two, and oneDNN tactics apply it inside the kernel;
- likewise a residual ``add`` of a convolution's or linear layer's result and
  a tensor of the same shape and dtype computed before that layer becomes the
  layer's residual input, added before its epilogue (conv + add + relu of a
  ResNet block is one layer): tactics add it in place or inside the kernel.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from harness.dtypes import dtype_from_name
from harness.engines.cpu import tactics
from harness.engines.cpu.plan import (
    GETITEM,
    Node,
    Plan,
    Ref,
    TensorMeta,
    WeightRef,
    check_strided_ops,
    iter_leaves,
    map_leaves,
    plan_op_name,
    random_switch_off,
)
from harness.engines.cpu.tactic import op_function
from harness.errors import HarnessError
from harness.lowering.fold_batch_norm import fold_conv_batch_norm
from harness.naming import fresh_name
from harness.opnames import plan_packet

_DROPPED = (
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range_for_size",
)
_CONVS = ("conv2d", "convolution")
_BATCH_NORM = "aten::batch_norm.default"
# Ops whose result depends on their tensor inputs' shape and dtype, never on their values:
# with the engine's static shapes, constants.
_VALUE_FREE = frozenset({"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"})


def lower(gm: torch.fx.GraphModule, mode: str) -> tuple[Plan, list[str]]:
    """The plan of ``gm`` (tactics not chosen yet) and messages describing the rewrites."""
    plan = _translate(gm, mode)
    messages: list[str] = []
    _drop_dead(plan)
    folded = _fold_constants(plan)
    if folded:
        messages.append(f"constant-folded {folded} node(s) fed only by weights or shapes")
    for conv, bn in _fold_batch_norms(plan):
        messages.append(f"folded batch_norm {bn} into convolution {conv}")
    for layer, fused, residual in _fuse_epilogues(plan):
        if residual:
            messages.append(f"fused residual {fused} (adding {residual}) into {layer}")
        else:
            messages.append(f"fused activation {fused} into {layer}")
    _drop_dead(plan)
    check_strided_ops(plan, "graph")
    return plan, messages


def _translate(gm: torch.fx.GraphModule, mode: str) -> Plan:
    inputs: list[tuple[str, TensorMeta]] = []
    nodes: list[Node] = []
    weights: dict[str, torch.Tensor] = {}
    outputs: list[Ref | WeightRef] = []
    refs: dict[str, Ref | WeightRef] = {}

    refused: list[str] = []

    def arg(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return refs[value.name]
        return value

    for fx_node in gm.graph.nodes:
        where = f"graph node {fx_node.name!r}"
        if fx_node.op == "placeholder":
            inputs.append((fx_node.name, _meta(fx_node.meta.get("val"), where)))
            refs[fx_node.name] = Ref(fx_node.name)
        elif fx_node.op == "get_attr":
            value = _attr(gm, fx_node.target)
            if not isinstance(value, torch.Tensor):
                raise HarnessError(
                    f"{where}: attribute {fx_node.target} is a {type(value).__name__}, not a tensor"
                )
            weights[fx_node.name] = value.detach()
            refs[fx_node.name] = WeightRef(fx_node.name)
        elif fx_node.op == "call_function":
            if (
                isinstance(fx_node.target, torch._ops.OpOverload)
                and fx_node.target.overloadpacket.__name__ in _DROPPED
            ):
                continue
            op = plan_op_name(fx_node.target)
            if fx_node.target is not operator.getitem:
                try:
                    fn = op_function(op, f"node {fx_node.name}")
                    if not random_switch_off(fn, fx_node.args, fx_node.kwargs):
                        raise HarnessError(f"node {fx_node.name}: {op} draws random numbers (dropout is on)")
                except HarnessError as exc:
                    refused.append(str(exc))
            val = fx_node.meta.get("val")
            multi = isinstance(val, (tuple, list))
            metas = tuple(
                _meta(v, where) if isinstance(v, torch.Tensor) else None
                for v in (val if multi else (val,))
            )
            nodes.append(
                Node(
                    fx_node.name,
                    op,
                    tuple(map_leaves(tuple(fx_node.args), arg)),
                    dict(map_leaves(dict(fx_node.kwargs), arg)),
                    metas,
                    multi,
                )
            )
            refs[fx_node.name] = Ref(fx_node.name)
        elif fx_node.op == "output":
            outputs = [arg(o) for o in iter_leaves(fx_node.args[0])]
        else:
            raise HarnessError(
                f"{where}: {fx_node.op} nodes are not supported; compile the model first"
            )
    if refused:
        raise HarnessError(
            f"the CPU engine cannot run {len(refused)} node(s) of this graph: " + "; ".join(refused)
        )
    return Plan(mode=mode, inputs=inputs, nodes=nodes, outputs=outputs, weights=weights)


def _meta(val: Any, where: str) -> TensorMeta:
    if not isinstance(val, torch.Tensor):
        raise HarnessError(
            f"{where}: no tensor metadata (meta['val']); the graph must come from torch.export"
        )
    try:
        return TensorMeta.of(val)
    except TypeError:
        raise HarnessError(
            f"{where}: dynamic shape {tuple(val.shape)}; the CPU engine needs static shapes"
        ) from None


def _attr(gm: torch.nn.Module, target: Any) -> Any:
    value: Any = gm
    for part in str(target).split("."):
        value = getattr(value, part)
    return value


def _drop_dead(plan: Plan) -> None:
    live = {o.name for o in plan.outputs}
    kept = []
    for node in reversed(plan.nodes):
        if node.name in live:
            kept.append(node)
            live.update(
                leaf.name
                for leaf in iter_leaves((node.args, node.kwargs, node.residual))
                if isinstance(leaf, (Ref, WeightRef))
            )
    plan.nodes = kept[::-1]
    plan.weights = {name: t for name, t in plan.weights.items() if name in live}


def _fold_constants(plan: Plan) -> int:
    """Evaluate nodes with no dynamic input once; their users then see a weight.

    A value-free op (``x.new_zeros(...)``) reads only its inputs' shape and
    dtype, so it is evaluated on stand-ins of them.
    """
    folded = 0
    replacements: dict[str, WeightRef] = {}
    metas = plan.value_metas()
    kept = []
    for node in plan.nodes:
        _substitute(node, replacements)
        dynamic = bool(node.refs()) and plan_packet(node.op) not in _VALUE_FREE
        if dynamic or node.multi or node.op == GETITEM:
            kept.append(node)
            continue
        fn = op_function(node.op, f"layer {node.name!r}")
        args, kwargs = map_leaves((node.args, node.kwargs), lambda leaf: _constant_value(plan, metas, leaf))
        with torch.inference_mode(), tactics.layer_failures(node):
            value = fn(*args, **kwargs)
        name = fresh_name(node.name, plan.weights.__contains__)
        plan.weights[name] = value.detach().clone(memory_format=torch.contiguous_format)
        replacements[node.name] = WeightRef(name)
        folded += 1
    plan.nodes = kept
    plan.outputs = [replacements.get(o.name, o) if isinstance(o, Ref) else o for o in plan.outputs]
    return folded


Absorb = Callable[[Node, dict[str, Node], Counter[str]], Node | None]


def _absorb_into_producers(plan: Plan, absorb: Absorb) -> list[tuple[str, str]]:
    """Remove each node ``absorb`` merges into its producer; its users read the producer.

    ``absorb(node, producers, users)`` returns the producer that took the node
    over (after updating it), or None to keep the node.
    """
    users = Counter(r.name for node in plan.nodes for r in node.refs())
    users.update(o.name for o in plan.outputs if isinstance(o, Ref))
    producers = {node.name: node for node in plan.nodes}
    merged: list[tuple[str, str]] = []
    replacements: dict[str, Ref] = {}
    kept = []
    for node in plan.nodes:
        _substitute(node, replacements)
        producer = absorb(node, producers, users)
        if producer is None:
            kept.append(node)
            continue
        producer.fused = (*producer.fused, node.name)
        replacements[node.name] = Ref(producer.name)
        merged.append((producer.name, node.name))
    plan.nodes = kept
    plan.outputs = [replacements.get(o.name, o) if isinstance(o, Ref) else o for o in plan.outputs]
    return merged


def _fold_batch_norms(plan: Plan) -> list[tuple[str, str]]:
    if not any(node.op == _BATCH_NORM for node in plan.nodes):
        return []  # nothing to fold: the pass would keep every node

    def absorb(node: Node, producers: dict[str, Node], users: Counter[str]) -> Node | None:
        conv = _foldable_conv(node, producers, users, plan)
        if conv is not None:
            _fold_into(conv, node, plan)
        return conv

    return _absorb_into_producers(plan, absorb)


def _foldable_conv(
    bn: Node, producers: dict[str, Node], users: Counter[str], plan: Plan
) -> Node | None:
    if bn.op != _BATCH_NORM or len(bn.args) < 8:
        return None
    source, *params = bn.args[:5]
    training = bn.args[5]
    if (
        training
        or not isinstance(source, Ref)
        or not all(p is None or isinstance(p, WeightRef) for p in params)
    ):
        return None
    if params[2] is None or params[3] is None:  # running statistics
        return None
    conv = producers.get(source.name)
    if conv is None or plan_packet(conv.op) not in _CONVS or users[conv.name] != 1 or conv.multi:
        return None
    weight = conv.args[1] if len(conv.args) > 1 else None
    bias = conv.args[2] if len(conv.args) > 2 else None
    transposed = plan_packet(conv.op) == "convolution" and bool(conv.args[6])
    if (
        transposed
        or not isinstance(weight, WeightRef)
        or not (bias is None or isinstance(bias, WeightRef))
    ):
        return None
    if conv.out() != bn.out() or not plan.weights[weight.name].is_floating_point():
        return None
    return conv


def _fold_into(conv: Node, bn: Node, plan: Plan) -> None:
    gamma, beta, mean, var = (None if p is None else plan.weights[p.name] for p in bn.args[1:5])
    weight_ref = conv.args[1]
    assert isinstance(weight_ref, WeightRef) and mean is not None and var is not None
    bias_ref = conv.args[2] if len(conv.args) > 2 else None
    bias = plan.weights[bias_ref.name] if isinstance(bias_ref, WeightRef) else None
    new_weight, new_bias = fold_conv_batch_norm(
        plan.weights[weight_ref.name], bias, gamma, beta, mean, var, float(bn.args[7])
    )
    w_name = fresh_name(f"{conv.name}.folded_weight", plan.weights.__contains__)
    plan.weights[w_name] = new_weight
    b_name = fresh_name(f"{conv.name}.folded_bias", plan.weights.__contains__)
    plan.weights[b_name] = new_bias
    args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
    args[1], args[2] = WeightRef(w_name), WeightRef(b_name)
    conv.args = tuple(args)


def _fuse_epilogues(plan: Plan) -> list[tuple[str, str, str]]:
    """(layer, absorbed node, the residual it adds or "") for every activation and add absorbed."""
    position: dict[str, float] = {node.name: index for index, node in enumerate(plan.nodes)}
    metas = plan.value_metas()
    residuals: dict[str, str] = {}
    hoists: list[tuple[str, str]] = []  # (node, the layer it must now run before)

    def absorb(node: Node, producers: dict[str, Node], users: Counter[str]) -> Node | None:
        epilogue = _activation(node)
        if epilogue is None:
            chosen = _residual_taker(node, producers, users, position, metas, plan.weights)
            if chosen is None:
                return None
            taker, other, hoist = chosen
            taker.residual = other
            residuals[node.name] = other.name
            if hoist:
                hoists.append((other.name, taker.name))
                position[other.name] = position[taker.name] - 0.5  # for later decisions
            return taker
        source = node.args[0] if node.args else None
        producer = producers.get(source.name) if isinstance(source, Ref) else None
        if (
            producer is None
            or producer.epilogue
            or users[producer.name] != 1
            or producer.outputs != node.outputs
            or not tactics.epilogue_ok(producer, epilogue)
        ):
            return None
        producer.epilogue = epilogue
        return producer

    merged = _absorb_into_producers(plan, absorb)
    for name, before in hoists:
        node = next(n for n in plan.nodes if n.name == name)
        plan.nodes.remove(node)
        plan.nodes.insert(next(i for i, n in enumerate(plan.nodes) if n.name == before), node)
    return [(layer, fused, residuals.get(fused, "")) for layer, fused in merged]


def _residual_taker(
    add: Node,
    producers: dict[str, Node],
    users: Counter[str],
    position: dict[str, float],
    metas: dict[str, TensorMeta],
    weights: dict[str, torch.Tensor],
) -> tuple[Node, Ref, bool] | None:
    """The layer taking over ``add(a, b)``, the other summand as its residual, and whether
    that summand must be computed earlier than in the graph; None if no layer can.

    A summand's producer can take the add if the add is its only user and the
    other summand exists where it runs, or can be computed there (its inputs
    do): the plan then computes that summand first. Of two candidates the one
    with more multiply-adds takes it, so the add rides on the larger kernel
    (the 3x3 convolution of a ResNet block rather than its 1x1 shortcut).
    Addition commutes exactly: which summand is the residual changes no bit.
    """
    if add.op != "aten::add.Tensor" or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    refs = [a for a in add.args if isinstance(a, Ref)]
    if len(refs) != 2 or refs[0] == refs[1]:
        return None
    options = []
    for producer_ref, other in zip(refs, refs[::-1], strict=True):
        producer = producers.get(producer_ref.name)
        if (
            producer is None
            or producer.epilogue
            or producer.residual is not None
            or users[producer.name] != 1
            or not producer.outputs == add.outputs == (metas.get(other.name),)
            or not tactics.residual_ok(producer)
        ):
            continue
        here = position[producer.name]
        if position.get(other.name, -1) < here:
            options.append((producer, other, False))
        elif all(position.get(r.name, -1) < here for r in producers[other.name].refs()):
            options.append((producer, other, True))
    if not options:
        return None
    return max(options, key=lambda option: _multiply_adds(option[0], weights))


def _multiply_adds(layer: Node, weights: dict[str, torch.Tensor]) -> int:
    """Multiply-adds of a convolution or linear layer with a constant weight."""
    weight = weights[layer.weight_refs()[0].name]
    return math.prod(layer.out().shape) * (weight.numel() // int(weight.shape[0]))


def _activation(node: Node) -> str | None:
    """The epilogue name of an activation node, None for anything else."""
    if not node.args or len(node.args) > 2 or not isinstance(node.args[0], Ref):
        return None
    if node.op in _PLAIN_ACTIVATIONS and len(node.args) == 1 and not node.kwargs:
        return _PLAIN_ACTIVATIONS[node.op]
    if node.op == "aten::gelu.default":
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


_PLAIN_ACTIVATIONS = {
    "aten::relu.default": "relu",
    "aten::hardswish.default": "hardswish",
    "aten::hardsigmoid.default": "hardsigmoid",
}


def _substitute(node: Node, replacements: dict[str, Any]) -> None:
    if replacements:
        node.map_refs(lambda ref: replacements.get(ref.name, ref))


def _constant_value(plan: Plan, metas: dict[str, TensorMeta], leaf: Any) -> Any:
    """A weight's tensor; for a node's value, an uninitialized stand-in of its shape and dtype."""
    if isinstance(leaf, WeightRef):
        return plan.weights[leaf.name]
    if isinstance(leaf, Ref):
        meta = metas[leaf.name]
        return torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype))
    return leaf

