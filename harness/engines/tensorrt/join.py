"""Join the build log's autotuned ops to the engine inspector's layers.

The two never name things alike: the log's ``matMul1`` is the engine's
``matMul1_myl0_0``, ``node_linear`` is ``node_linear_myl4_0`` (every layer of a
TensorRT 11 engine is ``<op>_myl<k>_<n>``), ``node_conv2d`` is the fused
``node_conv2d + node_relu``, a second optimization profile adds
`` [profile 1]``. What both carry is the list of ONNX nodes: the log prints it
on Myelin op lines (``Autotuning op node_linear: [ONNX Layer: node_linear][ONNX
Layer: node_relu_2]``) and the inspector in each layer's ``Metadata``. So an
op is joined, by the first rule that finds layers:

1. ``onnx-layers``: the layers whose ONNX nodes are exactly the op's, when they are
   copies of one base layer, else those of them its name continues (TensorRT 10
   lists ``/fc/Gemm`` on the ``reshape_after_/fc/Gemm`` it adds as well as on
   the Gemm's own layer);
2. ``name``: the layer of exactly its name (Cask layers: ``node_conv2d +
   node_relu`` is timed and named alike), else the layers whose name without
   the Myelin and profile suffixes is the op's name;
3. ``onnx-subset``: the layers whose ONNX nodes include all of the op's (an
   op that is part of a fusion), when they are copies of one base layer;
4. ``prefix``: the layers whose name starts with the op's name *at a name
   boundary* (followed by `` + ``, ``_myl``, `` [profile`` or nothing), as
   NVIDIA's sampleEditableTimingCache matches names, when they are copies of
   one base layer.

"Copies of one base layer" means one name once the Myelin and profile
suffixes are removed: a layer and its ``[profile N]`` copies (and the Myelin
layers of one op) are one layer to the join. The boundary keeps ``matMul1``
off ``matMul10_myl0_0`` and ``node_conv2d`` off ``node_conv2d_1 +
node_relu_1``. Several base layers for rules 3 and 4 is ambiguous: the op is
then joined to none rather than guessed. An op that joins no layer is reported
by name, with why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from harness.engines.tensorrt.inspector import InspectedLayer

_MYELIN_SUFFIX = re.compile(r"_myl\d+_\d+$")
_PROFILE_SUFFIX = re.compile(r" \[profile \d+\]$")
# What TensorRT appends to an op's name in a layer's name: a fused op (" + "), the Myelin
# graph and index ("_myl4_0"), an optimization profile (" [profile 1]").
_NAME_BOUNDARIES = (" + ", "_myl", " [profile")


class JoinableOp(Protocol):
    @property
    def layer(self) -> str: ...  # the op's name in the log

    @property
    def onnx_layers(self) -> tuple[str, ...]: ...


OpT = TypeVar("OpT", bound=JoinableOp)


def base_name(layer_name: str) -> str:
    """An engine layer's name without the Myelin (``_myl4_0``) and profile suffixes."""
    return _PROFILE_SUFFIX.sub("", _MYELIN_SUFFIX.sub("", layer_name))


def continues_name(layer_name: str, op_name: str) -> bool:
    """Whether ``layer_name`` is ``op_name``, or ``op_name`` followed by a name boundary.

    A bare ``startswith`` would join ``matMul1`` to ``matMul10_myl0_0``.
    """
    if not layer_name.startswith(op_name):
        return False
    rest = layer_name[len(op_name) :]
    return not rest or rest.startswith(_NAME_BOUNDARIES)


@dataclass(frozen=True)
class Joined(Generic[OpT]):
    """One op and the engine layers it was joined to (empty: none); ``how`` says by what."""

    op: OpT
    layers: tuple[str, ...]
    how: str


def _one_base(names: Sequence[str]) -> bool:
    return len({base_name(name) for name in names}) == 1


def _listed(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names)


def _join(op: JoinableOp, layers: Sequence[InspectedLayer]) -> tuple[list[str], str, str]:
    """(layer names, how, why not): the first rule that finds layers wins; ``why not`` says,
    for an op that joins none, what was tried and found ambiguous."""
    nodes = set(op.onnx_layers)
    if nodes:
        same = [layer.name for layer in layers if layer.onnx_layers == op.onnx_layers]
        if not _one_base(same):
            # Layers TensorRT adds around a node list it too (10.x's ``reshape_after_/fc/Gemm``
            # beside ``/fc/Gemm + ...``): the op's name picks its own, else none is guessed.
            same = [name for name in same if continues_name(name, op.layer)]
        if _one_base(same):
            return same, "onnx-layers", ""
    named = [layer.name for layer in layers if layer.name == op.layer] or [
        layer.name for layer in layers if base_name(layer.name) == op.layer
    ]
    if named:
        return named, "name", ""
    ambiguous = []
    if nodes:
        containing = [layer.name for layer in layers if nodes <= set(layer.onnx_layers)]
        if containing and _one_base(containing):
            return containing, "onnx-subset", ""
        if containing:
            ambiguous.append(f"its ONNX nodes are part of several layers ({_listed(containing)})")
    prefixed = [layer.name for layer in layers if continues_name(layer.name, op.layer)]
    if prefixed and _one_base(prefixed):
        return prefixed, "prefix", ""
    if prefixed:
        ambiguous.append(f"its name begins several layers' names ({_listed(prefixed)})")
    return [], "", "; ".join(ambiguous)


def join_ops(
    ops: Iterable[OpT], layers: Sequence[InspectedLayer]
) -> tuple[list[Joined[OpT]], list[str]]:
    """Every op with the layers it joins, and a problem line for each op that joins none."""
    joined: list[Joined[OpT]] = []
    problems: list[str] = []
    for op in ops:
        names, how, ambiguous = _join(op, layers)
        if ambiguous:
            problems.append(f"autotuned op {op.layer!r} cannot be joined to one engine layer: {ambiguous}")
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
