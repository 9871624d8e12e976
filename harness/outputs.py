"""A model's output structure, kept from export to every engine and the bench.

Graphs and engines compute a flat tuple of tensors; users wrote models that
return a dict, a ``transformers`` ``ModelOutput`` or nested tuples. The
exported program's pytree spec maps one to the other, so every stage returns
the eager structure, and the bench pairs an engine's outputs with the
reference's by *path* (``['last_hidden_state']``, ``[1][0]``), never by
position in some flattening order.

Saved engines store the spec as PyTorch's own JSON (``treespec_dumps``). A
process that has not registered a container type named there (a saved BERT
engine loaded where ``transformers`` was never imported) gets a plain dict in
its place: same keys, same paths; no module named in a file is ever imported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from harness.errors import HarnessError

_PLAIN_DICT = "builtins.dict"


@dataclass(frozen=True)
class OutputSpec:
    """How the flat outputs of a graph nest in the model's own return value."""

    spec: pytree.TreeSpec
    _bare: bool = field(init=False, repr=False, compare=False)

    @classmethod
    def flat(cls, count: int) -> OutputSpec:
        """A plain tuple of ``count`` tensors (graphs built without a model)."""
        return cls(pytree.tree_flatten(tuple(range(count)))[1])

    @property
    def count(self) -> int:
        return self.spec.num_leaves

    def __post_init__(self) -> None:
        # A model returning one bare tensor (most do): unflatten hands it back without
        # rebuilding a tree on every engine call, a cost a small model's latency shows.
        object.__setattr__(self, "_bare", self.spec.is_leaf())

    def unflatten(self, flat: Sequence[Any]) -> Any:
        if self._bare and len(flat) == 1:
            return flat[0]
        if len(flat) != self.count:
            raise HarnessError(f"expected {self.count} outputs for {self.describe()}, got {len(flat)}")
        return pytree.tree_unflatten(list(flat), self.spec)

    def paths(self) -> list[str]:
        """The path of every flat output, in flat order (``['logits']``, ``[0][1]``)."""
        return [path for path, _ in leaf_paths(pytree.tree_unflatten(list(range(self.count)), self.spec))]

    def describe(self) -> str:
        return f"{self.spec.type.__name__ if self.spec.type else 'tensor'} ({', '.join(self.paths())})"

    def to_json(self) -> str:
        try:
            return pytree.treespec_dumps(self.spec)
        except Exception as exc:  # a container type registered without a serialized name
            raise HarnessError(f"the model's output structure cannot be saved: {exc}") from None

    @classmethod
    def from_json(cls, text: str, where: str) -> OutputSpec:
        """Read a saved spec; unregistered container types become plain dicts (same paths)."""
        try:
            protocol, tree = json.loads(text)
            known = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE
            return cls(pytree.treespec_loads(json.dumps([protocol, _plain(tree, known)])))
        except HarnessError:
            raise
        except Exception as exc:
            raise HarnessError(f"{where}: invalid output structure ({type(exc).__name__}: {exc})") from None


def _plain(node: Any, known: dict[str, Any]) -> Any:
    if not isinstance(node, dict) or not isinstance(node.get("children_spec"), list):
        raise ValueError("each node needs type, context and children_spec")
    kind = node.get("type")
    if kind is not None and kind not in known:
        context = json.loads(node["context"])
        if not isinstance(context, list):
            raise ValueError(f"unknown container {kind!r} without a key list")
        node = {**node, "type": _PLAIN_DICT, "context": json.dumps(context)}
    return {**node, "children_spec": [_plain(child, known) for child in node["children_spec"]]}


def output_spec_of(program: torch.export.ExportedProgram) -> OutputSpec:
    spec = program.call_spec.out_spec
    if spec is None:
        return OutputSpec.flat(len(program.graph_signature.user_outputs))
    return OutputSpec(spec)


def leaf_paths(obj: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of an output structure, ``None`` fields left out."""
    leaves, _ = pytree.tree_flatten_with_path(obj)
    return [(pytree.keystr(path), leaf) for path, leaf in leaves if leaf is not None]


def tensor_paths(obj: Any, where: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Like :func:`leaf_paths`, refusing leaves that are not tensors (they cannot be compared)."""
    pairs = leaf_paths(obj)
    for path, leaf in pairs:
        if not isinstance(leaf, torch.Tensor):
            raise HarnessError(
                f"{where}{path} is a {type(leaf).__name__}; outputs must be tensors "
                "in tuples, lists, dicts or registered containers such as transformers' ModelOutput"
            )
    return pairs


def flat_tensors(obj: Any, where: str = "output") -> tuple[torch.Tensor, ...]:
    """The tensors of an output structure in pytree order (one structure's flat view)."""
    return tuple(t for _, t in tensor_paths(obj, where))
