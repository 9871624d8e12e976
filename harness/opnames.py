"""Op names: how the harness writes an operator, and how it reads one back.

Two written forms, each produced here only:

- the user-facing form, ``aten.conv2d.default`` (:func:`op_name`): what reports
  print and what users write in ``targets_to_exclude`` or ``--decompose``;
- the plan form, ``aten::conv2d.default`` (:func:`plan_name`): what the CPU
  engine's saved plans and timing caches hold, so its bytes never change.

:func:`resolve_op` reads either form back to the ``OpOverload`` (``aten.conv2d``
alone meaning its ``default`` overload). Only ATen ops are named by users and
stored in plans, so only ``aten`` names resolve.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import torch

from harness.errors import HarnessError

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

# aten.NAME, aten.NAME.OVERLOAD, aten::NAME, aten::NAME.OVERLOAD
_NAME = re.compile(r"^aten(?:\.|::)(\w+)(?:\.(\w+))?$")
_PLAN_NAME = re.compile(r"^aten::(\w+)\.(\w+)$")
VALID_FORMS = "aten.NAME, aten.NAME.OVERLOAD, aten::NAME or aten::NAME.OVERLOAD (e.g. aten.conv2d.default)"


def op_name(target: Any) -> str:
    """User-facing name of an FX call target: ``aten.conv2d.default``, ``higher_order.wrap_with_autocast``.

    Other callables (``operator.getitem``) are named by their ``__name__``.
    """
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target.__name__}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"{target.namespace}.{target.name()}"  # type: ignore[no-untyped-call]  # torch leaves name() unannotated
    return getattr(target, "__name__", str(target))


def plan_name(op: OpOverload) -> str:
    """Plan form of ``op``: ``aten::conv2d.default`` (the overload always written, ``default`` included)."""
    return f"{op.namespace}::{op.__name__}"


def is_plan_name(name: str) -> bool:
    """Whether ``name`` is written in the plan form of an ATen op (``aten::conv2d.default``)."""
    return _PLAN_NAME.match(name) is not None


def plan_packet(name: str) -> str:
    """``aten::conv2d.default`` -> ``conv2d``; a string not in the plan form is returned unchanged."""
    match = _PLAN_NAME.match(name)
    return match.group(1) if match else name


def overload_name(op: OpOverload) -> str:
    """``aten.add.Tensor`` -> ``Tensor``: the overload part of ``op``'s name."""
    return op.__name__.partition(".")[2]


def resolve_packet(name: str) -> tuple[OpOverloadPacket, str | None]:
    """The ATen op packet a name stands for, and the overload it names (None when it names none)."""
    match = _NAME.match(name)
    if match is None:
        raise HarnessError(f"op name {name!r} is not of the form {VALID_FORMS}")
    packet = getattr(torch.ops.aten, match.group(1), None)
    if not isinstance(packet, OpOverloadPacket):
        raise HarnessError(f"unknown op {name!r}: torch.ops.aten has no operator {match.group(1)!r}")
    return packet, match.group(2)


@functools.cache
def resolve_op(name: str) -> OpOverload:
    """The ``OpOverload`` a name in either form stands for (``aten.conv2d`` means ``aten.conv2d.default``);
    a HarnessError naming the valid forms or overloads for any other name."""
    packet, overload = resolve_packet(name)
    overload = overload or "default"
    if overload not in overload_names(packet):
        raise HarnessError(
            f"unknown overload {name!r}; {packet.__name__} has: {', '.join(sorted(overload_names(packet)))}"
        )
    op: OpOverload = getattr(packet, overload)  # a packet's attribute of an overload name
    return op


def overload_names(packet: OpOverloadPacket) -> list[str]:
    """The names of ``packet``'s overloads (``default``, ``Tensor``, ...)."""
    names: list[str] = packet.overloads()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return names


def out_of_place_packet(op: OpOverload) -> OpOverloadPacket | None:
    """``aten.transpose_`` -> ``aten.transpose``: the packet an in-place op's name drops its ``_`` for, if any."""
    name = op.overloadpacket.__name__
    if op.namespace != "aten" or not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return packet if isinstance(packet, OpOverloadPacket) else None


def resolve_op_names(names: Iterable[str]) -> set[str]:
    """Validate op names; return them in the user-facing form. A name without an overload means every overload."""
    out: set[str] = set()
    for name in names:
        packet, overload = resolve_packet(name)
        if overload is None:
            out.update(op_name(getattr(packet, o)) for o in overload_names(packet))
        else:
            out.add(op_name(resolve_op(name)))
    return out
