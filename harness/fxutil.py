"""Small FX helpers shared by the lowering passes and the autocast compiler."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def fake_mode_of(gm: torch.fx.GraphModule) -> FakeTensorMode:
    """The fake mode that produced the graph's ``meta["val"]`` (a fresh one if none)."""
    vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)


def tensor_vals(val: Any) -> Iterator[torch.Tensor]:
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def output_dtypes(node: torch.fx.Node) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in tensor_vals(node.meta.get("val")))


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued argument nodes, in argument order (lists such as ``cat``'s included)."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]


def module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path)


def op_name(target: Any) -> str:
    """``aten.conv2d.default`` style names; what users write in ``targets_to_exclude``."""
    if isinstance(target, torch._ops.OpOverload):
        ns, _, rest = target.name().partition("::")
        base, _, overload = rest.partition(".")
        return f"{ns}.{base}.{overload or 'default'}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__name__", str(target))


def trace_call(node: torch.fx.Node, fn: Callable[..., Any], fake_mode: FakeTensorMode) -> torch.fx.GraphModule:
    """Trace ``fn(*node.args, **node.kwargs)`` on the node's fake inputs into ATen ops."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

    def call(*tensors: torch.Tensor) -> Any:
        vals = list(flat)
        for i, t in zip(positions, tensors, strict=True):
            vals[i] = t
        args, kwargs = pytree.tree_unflatten(vals, spec)
        return fn(*args, **kwargs)

    with fake_mode:
        return make_fx(call)(*[flat[i].meta["val"] for i in positions])


def splice(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Replace ``node`` by the body of ``sub`` (traced by :func:`trace_call`).

    New nodes are named after the replaced node so reports and engine layer
    names still point at the user's op, and inherit its module path and tags.
    """
    inputs = input_nodes(node)
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, inputs, strict=True):
        env[ph] = arg
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    created: list[torch.fx.Node] = []
    result: Any = None
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, sn.args[0])
                continue
            if sn.op == "get_attr":
                attr = f"{node.name}_{sn.target}"
                gm.register_buffer(attr, getattr(sub, str(sn.target)))
                new = gm.graph.get_attr(attr)
            else:
                args = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, (sn.args, sn.kwargs))
                new = gm.graph.create_node(sn.op, sn.target, args[0], args[1], name=f"{node.name}_{sn.name}")
            new.meta.update(inherited)
            new.meta["val"] = sn.meta.get("val")
            new.meta["decomposed_from"] = node.name
            env[sn] = new
            created.append(new)
    if isinstance(result, torch.fx.Node) or not isinstance(result, (tuple, list)):
        node.replace_all_uses_with(result)
    else:
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return created


def drop_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Delete weights no ``get_attr`` reads any more, so engines never carry dead copies."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in [*gm.named_buffers(recurse=False), *gm.named_parameters(recurse=False)]:
        if name not in used:
            delattr(gm, name)
