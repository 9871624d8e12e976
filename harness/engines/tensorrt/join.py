"""Join the build log's autotuned ops to the engine inspector's layers.

The two never name things alike: the log's ``matMul1`` is the engine's
``matMul1_myl0_0``, ``node_linear`` is ``node_linear_myl4_0`` (every layer of a
TensorRT 11 engine is ``<op>_myl<k>_<n>``), a second optimization profile adds
`` [profile 1]``. What both carry is the list of ONNX nodes: the log prints it
on Myelin op lines (``Autotuning op node_linear: [ONNX Layer: node_linear][ONNX
Layer: node_relu_2]``) and the inspector in each layer's ``Metadata``. So an
op is joined

1. to the layers whose ONNX nodes are exactly the op's, else
2. to the layer of exactly its name (Cask layers: ``node_conv2d + node_relu``
   is timed and named alike), else to the layers whose name without the
   Myelin and profile suffixes is the op's name, else
3. by prefix, as NVIDIA's sampleEditableTimingCache does, when every layer the
   op's name is a prefix of is one op's (the same name up to the suffixes).

An op that joins no layer, or whose prefix is ambiguous, is reported by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from harness.engines.tensorrt.inspector import InspectedLayer

_MYELIN_SUFFIX = re.compile(r"_myl\d+_\d+$")
_PROFILE_SUFFIX = re.compile(r" \[profile \d+\]$")


class JoinableOp(Protocol):
    @property
    def layer(self) -> str: ...  # the op's name in the log

    @property
    def onnx_layers(self) -> tuple[str, ...]: ...


OpT = TypeVar("OpT", bound=JoinableOp)


def base_name(layer_name: str) -> str:
    """An engine layer's name without the Myelin (``_myl4_0``) and profile suffixes."""
    return _PROFILE_SUFFIX.sub("", _MYELIN_SUFFIX.sub("", layer_name))


@dataclass(frozen=True)
class Joined(Generic[OpT]):
    """One op and the engine layers it was joined to (empty: none); ``how`` says by what."""

    op: OpT
    layers: tuple[str, ...]
    how: str


def _by_name(name: str, layers: Sequence[InspectedLayer]) -> tuple[list[str], str]:
    exact = [layer.name for layer in layers if layer.name == name]
    if exact:
        return exact, "name"
    based = [layer.name for layer in layers if base_name(layer.name) == name]
    if based:
        return based, "name"
    prefixed = [layer.name for layer in layers if layer.name.startswith(name)]
    if prefixed and len({base_name(n) for n in prefixed}) == 1:
        return prefixed, "prefix"
    return prefixed, "ambiguous" if prefixed else ""


def join_ops(
    ops: Iterable[OpT], layers: Sequence[InspectedLayer]
) -> tuple[list[Joined[OpT]], list[str]]:
    """Every op with the layers it joins, and a problem line for each op that joins none."""
    joined: list[Joined[OpT]] = []
    problems: list[str] = []
    for op in ops:
        names: list[str] = []
        how = ""
        if op.onnx_layers:
            names = [layer.name for layer in layers if layer.onnx_layers == op.onnx_layers]
            how = "onnx-layers" if names else ""
        if not names:
            names, how = _by_name(op.layer, layers)
        if how == "ambiguous":
            problems.append(
                f"autotuned op {op.layer!r} cannot be joined to an engine layer: its name is a "
                f"prefix of several layers' ({', '.join(names)}) and no layer has its ONNX nodes"
            )
            names, how = [], ""
        elif not names:
            nodes = "".join(f"[ONNX Layer: {n}]" for n in op.onnx_layers) or "none in the log"
            problems.append(
                f"autotuned op {op.layer!r} matches no engine layer by its ONNX nodes ({nodes}) "
                "or its name"
            )
        joined.append(Joined(op, tuple(names), how))
    return joined, problems


def ops_by_layer(joined: Iterable[Joined[OpT]]) -> dict[str, list[OpT]]:
    """Engine layer name -> the ops joined to it, in log order."""
    result: dict[str, list[OpT]] = {}
    for item in joined:
        for name in item.layers:
            result.setdefault(name, []).append(item.op)
    return result


class KeyedOp(JoinableOp, Protocol):
    @property
    def key(self) -> str: ...


KeyedT = TypeVar("KeyedT", bound=KeyedOp)


def layer_keys(joined: Iterable[Joined[KeyedT]]) -> tuple[dict[str, str], list[str]]:
    """Engine layer name -> the timing-cache key of the first keyed op joined to it, and a
    problem line for each layer that several keys claim."""
    keys: dict[str, str] = {}
    problems = []
    for item in joined:
        for name in item.layers:
            if keys.setdefault(name, item.op.key) != item.op.key:
                problems.append(
                    f"engine layer {name!r} joins several keyed ops; its key is {keys[name]}, not "
                    f"{item.op.key} (op {item.op.layer!r})"
                )
    return keys, problems
