"""Small FX helpers shared by the lowering passes and the autocast compiler."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from harness.naming import fresh_name


def cast_floating(batch: Sequence[Any], dtypes: Sequence[torch.dtype]) -> tuple[Any, ...]:
    """``batch`` with each floating tensor cast to the floating dtype declared for its position.

    The one place model inputs (fp32 example or calibration batches) are put
    in the dtypes a typed graph or an engine takes: with ``keep_io_types=False``
    the compiler lowers a floating input to the low precision, and its
    consumers must be fed that dtype. Everything else is passed as is (an
    integer input, a count mismatch, an int tensor where a float is declared),
    so that the consumer's own input check names what is wrong instead of a
    silent conversion hiding it.
    """
    if len(batch) != len(dtypes):
        return tuple(batch)
    return tuple(
        x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and dtype.is_floating_point else x
        for x, dtype in zip(batch, dtypes, strict=True)
    )


def has_eager_kernel(op: torch._ops.OpOverload, key: str) -> bool:
    """Whether eager's C++ dispatcher holds a kernel for ``op`` under dispatch key ``key``.

    The composite questions (does eager run ``op`` as a composite of other ATen
    ops, whose code a pass then runs through ``op._op_dk(key)``?) need the C++
    dispatcher's answer. The public ``OpOverload.has_kernel_for_dispatch_key``
    also counts Python kernels (``py_impl``), which only Python dispatch runs:
    in torch 2.13 ``native_batch_norm`` and the ``upsample_nearest`` overloads
    have a Python ``CompositeImplicitAutograd`` kernel and no C++ one, so the
    public call answers True where eager has no composite and ``_op_dk`` has
    nothing to call. For every other key the two agree on every ATen op, and
    callers asking about a backend or autocast key use the public call.
    """
    name = op.name()  # type: ignore[no-untyped-call]  # torch leaves OpOverload.name() unannotated
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


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


def trace_call(
    node: torch.fx.Node,
    fn: Callable[..., Any],
    fake_mode: FakeTensorMode,
    decomposition_table: dict[Any, Callable[..., Any]] | None = None,
    pre_dispatch: bool = False,
) -> torch.fx.GraphModule:
    """Trace ``fn(*node.args, **node.kwargs)`` on the node's fake inputs into ATen ops.

    ``decomposition_table`` and ``pre_dispatch`` are make_fx's: an op the table
    maps is traced through its function instead of being recorded whole, and a
    pre-dispatch trace records ops as export does (``linear`` stays ``linear``)
    rather than their decompositions.
    """
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

    def call(*tensors: torch.Tensor) -> Any:
        vals = list(flat)
        for i, t in zip(positions, tensors, strict=True):
            vals[i] = t
        args, kwargs = pytree.tree_unflatten(vals, spec)
        return fn(*args, **kwargs)

    with fake_mode:
        return make_fx(call, decomposition_table=decomposition_table, pre_dispatch=pre_dispatch)(*[flat[i].meta["val"] for i in positions])


def copy_body(
    owner: torch.fx.GraphModule,
    at: torch.fx.Node,
    body: torch.fx.GraphModule,
    inputs: list[Any],
    prefix: str = "",
    annotate: Callable[[torch.fx.Node], None] | None = None,
) -> tuple[Any, list[torch.fx.Node]]:
    """Copy ``body``'s nodes into ``owner`` before ``at``, its placeholders bound to ``inputs``.

    Returns the body's output value in ``owner``'s terms and the nodes created.
    Constants the body reads move onto ``owner``; ``get_attr`` nodes nothing
    reads (an already inlined subgraph) are skipped. Copies keep the body's
    meta, then ``annotate`` may add to it.
    """
    env: dict[torch.fx.Node, Any] = dict(
        zip([n for n in body.graph.nodes if n.op == "placeholder"], inputs, strict=True)
    )

    def mapped(a: Any) -> Any:
        return pytree.tree_map(lambda x: env[x] if isinstance(x, torch.fx.Node) else x, a)

    result: Any = None
    created: list[torch.fx.Node] = []
    with owner.graph.inserting_before(at):
        for sn in body.graph.nodes:
            if sn.op == "placeholder" or (sn.op == "get_attr" and not sn.users):
                continue
            if sn.op == "output":
                result = mapped(sn.args[0])
                continue
            if sn.op == "get_attr":
                name = fresh_name(f"{prefix}{sn.target}", lambda n: hasattr(owner, n))
                value = getattr(body, str(sn.target))
                if isinstance(value, torch.Tensor):
                    owner.register_buffer(name, value)
                else:
                    setattr(owner, name, value)
                new = owner.graph.get_attr(name)
            else:
                new = owner.graph.create_node(sn.op, sn.target, mapped(sn.args), mapped(sn.kwargs), name=f"{prefix}{sn.name}")
            new.meta.update(sn.meta)
            if annotate is not None:
                annotate(new)
            env[sn] = new
            created.append(new)
    return result, created


def splice(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Replace ``node`` by the body of ``sub`` (traced by :func:`trace_call`).

    New nodes are named after the replaced node so reports and engine layer
    names still point at the user's op, and inherit its module path and tags.
    """
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}

    def annotate(new: torch.fx.Node) -> None:
        new.meta.update(inherited)
        new.meta["decomposed_from"] = node.name

    result, created = copy_body(gm, node, sub, input_nodes(node), prefix=f"{node.name}_", annotate=annotate)
    if isinstance(result, torch.fx.Node) or not isinstance(result, (tuple, list)):
        node.replace_all_uses_with(result)
    else:
        for user in list(node.users):
            if user.target is operator.getitem:
                index = user.args[1]
                assert isinstance(index, int)  # getitem of a tuple result: a position
                user.replace_all_uses_with(result[index])
                gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return created


def drop_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Delete weights and subgraphs no ``get_attr`` reads any more, so engines never carry dead copies."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    subgraphs = [(n, m) for n, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    for name, _ in [*gm.named_buffers(recurse=False), *gm.named_parameters(recurse=False), *subgraphs]:
        if name not in used:
            delattr(gm, name)
