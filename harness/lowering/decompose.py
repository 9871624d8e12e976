"""Per-op decompositions, configurable by op name (seed 004's first mechanism).

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
from harness.fxutil import fake_mode_of, op_name, splice, trace_call

aten = torch.ops.aten

# Composite ops no engine of this project implements natively. Only composite
# implicit ops are on by default: their decomposition is PyTorch's own C++
# composite, the very code eager runs, so decomposing never changes a bit.
DEFAULT_DECOMPOSITIONS: tuple[str, ...] = (
    "aten.einsum.default",
    "aten.bilinear.default",
)


def _packet(name: str) -> tuple[torch._ops.OpOverloadPacket, list[str]]:
    parts = name.replace("::", ".").split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten":
        raise HarnessError(f"op name {name!r} is not of the form aten.NAME or aten.NAME.OVERLOAD (e.g. aten.conv2d.default)")
    packet = getattr(torch.ops.aten, parts[1], None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise HarnessError(f"unknown op {name!r}: torch.ops.aten has no operator {parts[1]!r}")
    return packet, parts


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``aten.conv2d.default`` (or ``aten::conv2d.default``; ``aten.conv2d`` means ``.default``) to an OpOverload."""
    packet, parts = _packet(name)
    overload = parts[2] if len(parts) == 3 else "default"
    if overload not in packet.overloads():
        raise HarnessError(f"unknown overload {name!r}; {parts[1]} has: {', '.join(sorted(packet.overloads()))}")
    return getattr(packet, overload)


def resolve_op_names(names: Iterable[str]) -> set[str]:
    """Validate op names; return them canonical (``aten.NAME.OVERLOAD``). A bare name means every overload."""
    out: set[str] = set()
    for name in names:
        packet, parts = _packet(name)
        if len(parts) == 2:
            out.update(f"aten.{parts[1]}.{o}" for o in packet.overloads())
        else:
            out.add(op_name(resolve_op(name)))
    return out


@dataclass(frozen=True)
class DecompositionTable:
    """Which ops are decomposed; ``enable``/``disable`` return adjusted copies."""

    ops: frozenset[str] = field(default_factory=lambda: frozenset(resolve_op_names(DEFAULT_DECOMPOSITIONS)))

    def enable(self, names: Iterable[str]) -> DecompositionTable:
        return DecompositionTable(self.ops | resolve_op_names(names))

    def disable(self, names: Iterable[str]) -> DecompositionTable:
        return DecompositionTable(self.ops - resolve_op_names(names))

    def functions(self) -> dict[Any, Callable[..., Any]]:
        """Composite-implicit ops use their C++ composite (eager's own code); others torch's table."""
        overloads = [resolve_op(n) for n in sorted(self.ops)]
        table: dict[Any, Callable[..., Any]] = dict(get_decompositions(overloads))
        for op in overloads:
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
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
