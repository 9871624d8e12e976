"""Turn in-place writes into values, through views onto their base.

Export keeps a model's in-place ops in its pre-dispatch graph. A write such as
``mask[:, a:b, c:d] = k`` arrives as ``fill_`` on an ``aten.slice`` *view* of
``mask``: it changes ``mask`` (and every other view of it), although no node
reads the ``fill_``. Cast insertion gives tensors typed copies, and engines run
nodes as pure functions, so every mutation must become a value and every
reader must read the value current at its position in the program.

This pass does what PyTorch's functionalization does at the dispatcher, on the
FX graph, so that composite ops and autocast-region tags survive (running
``ExportedProgram.run_decompositions`` would decompose the former and trip
over the latter). Storage is tracked per *base* tensor:

- a view (an op whose schema says its result aliases its input: ``slice``,
  ``select``, ``view``, ``transpose``, ``split`` + ``getitem``, ...) records
  its base and the chain of view steps from it;
- an in-place op ``op_(v, ...)`` becomes ``op(v, ...)``; if ``v`` is a view,
  the new value is scattered back up the chain (``slice_scatter``,
  ``select_scatter``, an inverse permute or reshape, ...) to give the base's
  new value;
- every later reader of the base, or of any view of it, reads the current
  value: views created before the write are replayed on the new base.

A write through a view with no inverse (``expand``, ``unfold``) and a mutating
op with no functional twin are refused, naming the node. So is a write whose
base is a weight, buffer or tensor attribute (a ``get_attr``), whether direct
or through a view (``self.buf[1:3] += x``): eager changes the model on every
call, which a typed graph cannot reproduce, and making it a value would hide
that. The refusal is the one :func:`standalone_graph` gives for direct writes.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.passes.infra.pass_base import PassResult

from harness.errors import HarnessError
from harness.frontend.export import weight_write_error
from harness.fxutil import fake_mode_of
from harness.lowering.registry import register_pass
from harness.opnames import op_name, out_of_place_packet, overload_name

logger = logging.getLogger(__name__)
aten = torch.ops.aten
Node = torch.fx.Node
OpOverload = torch._ops.OpOverload

# View ops whose result has the base's elements in the same row-major order:
# the inverse of any of them is a reshape to the parent's shape.
_RESHAPING_VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints,
    aten.unflatten.int, aten.view_as.default, aten.reshape_as.default, aten.alias.default,
    aten.contiguous.default, aten.view.dtype, aten.detach.default,
}  # fmt: skip


def _schema_view(op: object) -> bool:
    """Schema says the result may alias the first argument (without writing it)."""
    if not isinstance(op, OpOverload) or not op._schema.arguments or not op._schema.returns:
        return False
    arg = op._schema.arguments[0].alias_info
    ret = op._schema.returns[0]
    if arg is None or arg.is_write:
        return False
    return ret.alias_info is not None or isinstance(ret.type, torch.ListType)


def _is_multi_view(op: object) -> bool:
    return (
        isinstance(op, OpOverload)
        and _schema_view(op)
        and isinstance(op._schema.returns[0].type, torch.ListType)
    )


def is_view(node: Node) -> bool:
    """Whether ``node``'s result shares its first input's memory when it runs.

    The schema only says *may* alias: ``reshape`` of a transposed tensor, or
    ``to`` traced with ``copy=True``, returns a copy, and a write to a copy
    must not reach the base. The op is run on a meta tensor with the input's
    sizes and strides, and its result's storage decides, as in eager.
    """
    if node.op != "call_function" or not _schema_view(node.target) or _is_multi_view(node.target):
        return False
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    probe = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    rest = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, Node) else a, (node.args[1:], node.kwargs))
    try:
        out = node.target(probe, *rest[0], **rest[1])  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - an op meta cannot run: trust its schema
        return True
    return isinstance(out, torch.Tensor) and out.untyped_storage()._cdata == probe.untyped_storage()._cdata


def _written_args(op: OpOverload) -> list[int]:
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _functional_twin(op: OpOverload) -> OpOverload | None:
    """``aten.fill_.Tensor`` -> ``aten.fill.Tensor``: the same op, returning a new tensor."""
    packet = out_of_place_packet(op)
    if packet is None or op.overloadpacket.__name__.startswith("_"):
        return None
    return getattr(packet, overload_name(op), None)


@dataclass(frozen=True)
class ViewStep:
    """One view op applied to a parent: how to redo it, and how to write a value back through it."""

    op: OpOverload
    args: tuple[Any, ...]  # everything after the parent
    kwargs: dict[str, Any]
    origin: Node  # the graph node that took this view (names the error and the new nodes)

    def replay(self, g: _Builder, parent: Node) -> Node:
        return g.call(self.op, (parent, *self.args), self.kwargs, self.origin, "view")

    def scatter(self, g: _Builder, parent: Node, value: Node) -> Node:
        """The parent with this view's elements replaced by ``value``."""
        op, args, kw = self.op, self.args, self.kwargs
        if op is aten.slice.Tensor:
            dim, start, end, step = (list(args) + [0, None, None, 1][len(args):])[:4]
            return g.call(aten.slice_scatter.default, (parent, value, dim, start, end, step), {}, self.origin, "scatter")
        if op is aten.narrow.default:
            dim, start, length = args
            return g.call(aten.slice_scatter.default, (parent, value, dim, start, start + length, 1), {}, self.origin, "scatter")
        if op is aten.select.int:
            return g.call(aten.select_scatter.default, (parent, value, *args), {}, self.origin, "scatter")
        if op is aten.diagonal.default:
            return g.call(aten.diagonal_scatter.default, (parent, value, *args), kw, self.origin, "scatter")
        if op is aten.as_strided.default:
            return g.call(aten.as_strided_scatter.default, (parent, value, *args), kw, self.origin, "scatter")
        if op is aten.permute.default:
            dims = [d % len(args[0]) for d in args[0]]
            inverse = sorted(range(len(dims)), key=dims.__getitem__)
            return g.call(aten.permute.default, (value, inverse), {}, self.origin, "scatter")
        if op in (aten.transpose.int, aten.t.default):
            return g.call(op, (value, *args), kw, self.origin, "scatter")
        if op in _RESHAPING_VIEWS and op is not aten.view.dtype:
            shape = list(parent.meta["val"].shape)
            return g.call(aten.reshape.default, (value, shape), {}, self.origin, "scatter")
        raise HarnessError(
            f"node {self.origin.name}: an in-place write goes through the view {op_name(op)}, "
            "which has no inverse to write it back to its base; write to a copy "
            "(e.g. .clone()) or index the base directly"
        )


def _piece_step(getitem: Node, multi: Node) -> ViewStep:
    """``getitem(split(x, ...), i)`` as the equivalent ``slice`` / ``select`` of ``x``."""
    op, index = multi.target, getitem.args[1]
    assert isinstance(op, OpOverload) and isinstance(index, int)
    source = multi.args[0]
    assert isinstance(source, Node)
    if op is aten.unbind.int:
        dim = multi.args[1] if len(multi.args) > 1 else multi.kwargs.get("dim", 0)
        return ViewStep(aten.select.int, (dim, index), {}, getitem)
    pieces = multi.meta["val"]
    dim = _split_dim(multi)
    ndim = source.meta["val"].dim()
    dim = dim % ndim
    start = sum(int(p.shape[dim]) for p in pieces[:index])
    end = start + int(pieces[index].shape[dim])
    return ViewStep(aten.slice.Tensor, (dim, start, end, 1), {}, getitem)


def _split_dim(node: Node) -> int:
    schema = node.target._schema  # type: ignore[union-attr]
    names = [a.name for a in schema.arguments]
    if "dim" not in names:
        raise HarnessError(f"node {node.name}: cannot tell which dimension {op_name(node.target)} splits")
    position = names.index("dim")
    default = schema.arguments[position].default_value
    dim = node.args[position] if position < len(node.args) else node.kwargs.get("dim", default if default is not None else 0)
    if not isinstance(dim, int):
        raise HarnessError(f"node {node.name}: {op_name(node.target)} splits along a dimension that is not a constant ({dim!r})")
    return dim


@dataclass
class _Storage:
    """One base tensor's memory: the node holding its value now, and how often it was written."""

    origin: Node  # the node that allocated it (a get_attr is the model's own state)
    current: Node
    version: int = 0
    # (version, origins of the view steps) -> that view of the current value
    prefixes: dict[tuple[int, tuple[Node, ...]], Node] = field(default_factory=dict)


@dataclass(frozen=True)
class _Alias:
    storage: _Storage
    chain: tuple[ViewStep, ...]
    version: int


class _Builder:
    """Creates nodes before the node being rewritten, with ``meta["val"]`` from fake tensors."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph = gm.graph
        self.fake_mode = fake_mode_of(gm)
        self.at: Node | None = None

    def call(self, op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], origin: Node, role: str) -> Node:
        assert self.at is not None
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(op, tuple(args), dict(kwargs))
        node.name = self.graph._graph_namespace.create_name(f"{origin.name.rstrip('_')}_{role}", None)
        for key in ("nn_module_stack", "stack_trace", "autocast_regions", "source_fn_stack"):
            if key in origin.meta:
                node.meta[key] = origin.meta[key]
        vals = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, (tuple(args), dict(kwargs)))
        with self.fake_mode:
            node.meta["val"] = op(*vals[0], **vals[1])
        return node


class _Functionalizer:
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.g = _Builder(gm)
        self.storages: dict[Node, _Storage] = {}  # base node -> its storage
        self.aliases: dict[Node, _Alias] = {}  # view node -> where it points
        self.multi_views: dict[Node, tuple[Node, int]] = {}  # split-like node -> (its input, 0)
        self.fresh_multi: dict[tuple[Node, int, Node], Node] = {}
        self.writes = 0  # in-place ops rewritten

    def run(self) -> bool:
        """Rewrite the graph; whether anything changed (a write, or dead nodes removed)."""
        for node in list(self.gm.graph.nodes):
            if node.op not in ("call_function", "output"):
                continue
            self.g.at = node
            self._read_current(node)
            if node.op != "call_function":
                continue
            if _is_multi_view(node.target) and isinstance(node.args[0], Node):
                self.multi_views[node] = (node.args[0], 0)
            elif is_view(node):
                self._record_view(node, self._step(node))
            elif node.target is operator.getitem and self._is_piece(node):
                self._record_view(node, _piece_step(node, node.args[0]))
            elif isinstance(node.target, OpOverload) and _written_args(node.target):
                self._write(node)
        dead_removed = self.gm.graph.eliminate_dead_code()
        return self.writes > 0 or dead_removed

    # -- reading -------------------------------------------------------------

    def _read_current(self, node: Node) -> None:
        """Point every input of ``node`` at the value its storage holds now."""
        for inp in list(node.all_input_nodes):
            current = self._current(inp)
            if current is not inp:
                node.replace_input_with(inp, current)

    def _current(self, node: Node) -> Node:
        alias = self.aliases.get(node)
        if alias is not None:
            if alias.version == alias.storage.version:
                return node
            return self._prefix(alias.storage, alias.chain, len(alias.chain))
        pieces = self.multi_views.get(node)
        if pieces is not None:
            source, version = pieces
            fresh = self._current(source)
            if fresh is source:
                return node
            key = (node, version, fresh)
            if key not in self.fresh_multi:
                assert isinstance(node.target, OpOverload)  # multi_views holds split-like ops only
                self.fresh_multi[key] = self.g.call(node.target, (fresh, *node.args[1:]), dict(node.kwargs), node, "view")
                self.multi_views[self.fresh_multi[key]] = (fresh, version)
            return self.fresh_multi[key]
        storage = self.storages.get(node)
        return storage.current if storage is not None else node

    def _prefix(self, storage: _Storage, chain: tuple[ViewStep, ...], depth: int) -> Node:
        """The first ``depth`` view steps replayed on the storage's current value (memoized)."""
        if depth == 0:
            return storage.current
        key = (storage.version, tuple(step.origin for step in chain[:depth]))
        if key not in storage.prefixes:
            parent = self._prefix(storage, chain, depth - 1)
            view = chain[depth - 1].replay(self.g, parent)
            self.aliases[view] = _Alias(storage, chain[:depth], storage.version)
            storage.prefixes[key] = view
        return storage.prefixes[key]

    # -- views ----------------------------------------------------------------

    def _step(self, node: Node) -> ViewStep:
        return ViewStep(node.target, tuple(node.args[1:]), dict(node.kwargs), node)  # type: ignore[arg-type]

    def _is_piece(self, node: Node) -> bool:
        source = node.args[0]
        return isinstance(source, Node) and source.op == "call_function" and _is_multi_view(source.target)

    def _base_of(self, node: Node) -> tuple[_Storage, tuple[ViewStep, ...]]:
        alias = self.aliases.get(node)
        if alias is not None:
            return alias.storage, alias.chain
        storage = self.storages.setdefault(node, _Storage(node, node))
        return storage, ()

    def _record_view(self, node: Node, step: ViewStep) -> None:
        source = node.args[0]
        if node.target is operator.getitem:  # a piece of a split-like view: the split's input
            assert isinstance(source, Node)
            source = source.args[0]
        if not isinstance(source, Node) or not isinstance(source.meta.get("val"), torch.Tensor):
            return
        storage, chain = self._base_of(source)
        self.aliases[node] = _Alias(storage, chain + (step,), storage.version)

    # -- writing --------------------------------------------------------------

    def _write(self, node: Node) -> None:
        op = node.target
        assert isinstance(op, OpOverload)
        twin = _functional_twin(op)
        if twin is None or _written_args(op) != [0] or _written_args(twin):
            raise HarnessError(
                f"node {node.name} ({op_name(op)}) writes its inputs in place and has no functional "
                "form the compiler can use; rewrite the model with the out-of-place op"
            )
        target = node.args[0]
        assert isinstance(target, Node)
        storage, chain = self._base_of(target)
        if storage.origin.op == "get_attr":
            raise weight_write_error(node, storage.origin, target if chain else None)
        value = self.g.call(twin, node.args, node.kwargs, node, "value")
        for depth in range(len(chain), 0, -1):
            parent = self._prefix(storage, chain, depth - 1)
            value = chain[depth - 1].scatter(self.g, parent, value)
        storage.current = value
        storage.version += 1
        storage.prefixes.clear()
        self.storages[value] = storage  # views taken of the new value are views of this storage
        node.replace_all_uses_with(target)  # the op's result aliases its input: read it as such
        self.gm.graph.erase_node(node)
        self.writes += 1


@register_pass("functionalize_inplace")
def functionalize_inplace(gm: torch.fx.GraphModule) -> PassResult:
    """In-place writes become values; readers of a written tensor or its views read the new value."""
    functionalizer = _Functionalizer(gm)
    modified = functionalizer.run()
    logger.debug("functionalize_inplace: %d in-place write(s) made values", functionalizer.writes)
    return PassResult(gm, modified)
