"""Per-op decompositions, configurable by op name.

Each enabled op is replaced in place by the ATen subgraph of its decomposition,
traced on the node's own fake inputs, so shapes and dtypes of the new nodes are
exact and the surrounding graph is untouched. Decomposition runs after the
autocast compiler has typed the graph: the traced subgraph then inherits the
decided dtypes instead of needing a decision of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._decomp import get_decompositions

from harness.errors import HarnessError
from harness.fxutil import fake_mode_of, has_eager_kernel, splice, trace_call
from harness.opnames import op_name, overload_names, resolve_op, resolve_op_names, resolve_packet

aten = torch.ops.aten

# Composite ops no engine of this project implements natively. Only composite
# implicit ops are on by default: their decomposition is PyTorch's own C++
# composite, the very code eager runs, so decomposing never changes a bit.
DEFAULT_DECOMPOSITIONS: tuple[str, ...] = (
    "aten.einsum.default",
    "aten.bilinear.default",
)


def _composite(op: torch._ops.OpOverload) -> bool:
    """Eager runs ``op`` as a C++ composite of other ATen ops, which is then its decomposition.

    The C++ dispatcher's answer (:func:`has_eager_kernel`): an op with only a
    Python composite kernel (``native_batch_norm``) has no eager composite and
    takes torch's decomposition table instead.
    """
    return has_eager_kernel(op, "CompositeImplicitAutograd")


def _functional(op: torch._ops.OpOverload) -> bool:
    """Neither in-place nor out=: the only kind of op a decomposition can replace in a pure graph."""
    return not op._schema.is_mutable and not any(a.name == "out" for a in op._schema.arguments)


def decomposable_op_names(names: Iterable[str]) -> set[str]:
    """Op names to decompose, canonical; a bare name means its functional overloads with a decomposition.

    A bare name such as ``aten.softmax`` also covers ``softmax.int_out``, and
    in-place or out= overloads have no decomposition (and never occur in the
    functional graphs decomposition sees), so expanding to every overload
    would make the table fail on an overload the user never meant.
    """
    out: set[str] = set()
    for name in names:
        packet, overload = resolve_packet(name)
        if overload is not None:
            out.add(op_name(resolve_op(name)))
            continue
        overloads = [getattr(packet, o) for o in overload_names(packet)]
        functional = [op for op in overloads if _functional(op)]
        known = get_decompositions(functional)
        chosen = sorted(op_name(op) for op in functional if op in known or _composite(op))
        if not chosen:
            raise HarnessError(
                f"no decomposition is known for any functional overload of {name} "
                f"(overloads: {', '.join(sorted(overload_names(packet)))}); remove it from the decomposition table"
            )
        out.update(chosen)
    return out


@dataclass(frozen=True)
class DecompositionTable:
    """Which ops are decomposed; ``enable``/``disable`` return adjusted copies.

    ``enable`` takes a bare name to mean the functional overloads that have a
    decomposition (:func:`decomposable_op_names`); ``disable`` takes it to mean
    every overload, since removing a name the table does not hold is harmless.
    """

    ops: frozenset[str] = field(default_factory=lambda: frozenset(decomposable_op_names(DEFAULT_DECOMPOSITIONS)))

    def enable(self, names: Iterable[str]) -> DecompositionTable:
        return DecompositionTable(self.ops | decomposable_op_names(names))

    def disable(self, names: Iterable[str]) -> DecompositionTable:
        return DecompositionTable(self.ops - resolve_op_names(names))

    def functions(self) -> dict[Any, Callable[..., Any]]:
        """Composite-implicit ops use their C++ composite (eager's own code); others torch's table."""
        overloads = [resolve_op(n) for n in sorted(self.ops)]
        table: dict[Any, Callable[..., Any]] = dict(get_decompositions(overloads))
        for op in overloads:
            if _composite(op):
                table[op] = op.decompose
            elif op not in table:
                raise HarnessError(f"no decomposition is known for {op_name(op)}; remove it from the decomposition table")
        return table


def decompose(gm: torch.fx.GraphModule, table: DecompositionTable | None = None) -> torch.fx.GraphModule:
    """Replace every node whose op is in ``table`` by its decomposition (recursively)."""
    fns = (table or DecompositionTable()).functions()
    fake_mode = fake_mode_of(gm)
    pending = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in fns]
    while pending:
        node = pending.pop()
        sub = trace_call(node, fns[node.target], fake_mode)
        created = splice(gm, node, sub)
        pending.extend(n for n in created if n.op == "call_function" and n.target in fns)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
