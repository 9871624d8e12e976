"""The precision modes: the one definition every part of the harness reads.

A :class:`PrecisionMode` is a ``str`` (its name: what command lines, project
files, results and caches write) that also says what the mode means: the
compiler policy that types its graph, its reduced precision, whether the
builder (weak typing) or the graph (strong typing) decides each layer's
type, and the precision peers are compared at. Names are parsed once, where
they enter (:meth:`PrecisionMode.parse`, :func:`mode_argtype`); everything
after holds the typed value. No torch import: the gate reads modes without it.

| mode | policy | decides each layer's type |
|---|---|---|
| ``fp32`` | fp32 | nothing is lowered |
| ``fp16``, ``bf16`` | full | the whole graph in the low type (strong) |
| ``weak-fp16``, ``weak-bf16`` | fp32 | the builder, by timing (TensorRT 10.x weak typing) |
| ``autocast-fp16``, ``autocast-bf16`` | rule | the rule-based classifier (strong) |
| ``amp-fp16``, ``amp-bf16`` | amp | PyTorch AMP's cast policy, exactly (strong) |
| ``explicit`` | explicit | a user file of node-name patterns (strong) |
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.errors import HarnessError

if TYPE_CHECKING:
    import torch

LOW_PRECISIONS = ("bf16", "fp16")
# The precisions modes compute in and peers are compared at, in table order.
PRECISIONS = ("fp32", *LOW_PRECISIONS)


class PrecisionMode(str, enum.Enum):
    """One precision mode; compares, hashes and serializes as its name."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    WEAK_FP16 = "weak-fp16"
    WEAK_BF16 = "weak-bf16"
    AUTOCAST_FP16 = "autocast-fp16"
    AUTOCAST_BF16 = "autocast-bf16"
    AMP_FP16 = "amp-fp16"
    AMP_BF16 = "amp-bf16"
    EXPLICIT = "explicit"

    def __str__(self) -> str:
        """The name wherever a string is wanted (messages, f-strings, file names), on every Python."""
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, text: str, where: str | None = None) -> PrecisionMode:
        """The mode named ``text``; HarnessError naming the valid names (and ``where``, the flag or
        file it came from) otherwise."""
        try:
            return cls(text)
        except ValueError:
            prefix = f"{where}: " if where else ""
            raise HarnessError(
                f"{prefix}unknown precision mode {text!r}; valid modes: {', '.join(PRECISION_MODES)}"
            ) from None

    @property
    def policy(self) -> str:
        """The compiler policy that types this mode's graph (weak modes build the fp32 graph)."""
        family = self.value.partition("-")[0]
        return {"weak": "fp32", "fp16": "full", "bf16": "full", "autocast": "rule"}.get(family, family)

    @property
    def low(self) -> str | None:
        """The reduced precision the mode works with ("fp16", "bf16"); None for fp32 and explicit."""
        last = self.value.rpartition("-")[2]
        return last if last in LOW_PRECISIONS else None

    @property
    def weak(self) -> bool:
        """Whether the builder chooses each layer's precision (TensorRT weak typing), not the graph."""
        return self.value.startswith("weak-")

    @property
    def precision(self) -> str | None:
        """The precision its layers compute in, to compare with peers (None: ``explicit``, mixed by file)."""
        return "fp32" if self is PrecisionMode.FP32 else self.low

    @property
    def settings_apply(self) -> bool:
        """Whether the autocast compiler's settings change this mode's graph (the rule policy's
        classifier; the I/O types of the full and explicit policies)."""
        return self.policy in ("rule", "full", "explicit")

    def low_dtype(self) -> torch.dtype | None:
        """The torch dtype of :attr:`low`."""
        if self.low is None:
            return None
        from harness.dtypes import dtype_from_name

        return dtype_from_name(self.low)


PRECISION_MODES: tuple[str, ...] = tuple(m.value for m in PrecisionMode)


def mode_argtype(text: str) -> PrecisionMode:
    """``argparse`` type of a ``--mode`` flag."""
    try:
        return PrecisionMode.parse(text.strip())
    except HarnessError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def precision_of(mode: str) -> str | None:
    """The precision mode ``mode`` (a name) computes in; None for ``explicit`` (mixed by file)."""
    return PrecisionMode.parse(mode).precision


def run_precisions(modes: Sequence[str]) -> list[str]:
    """The precisions of a run's modes, in :data:`PRECISIONS` order: the ones its peers run at."""
    present = {precision_of(mode) for mode in modes}
    return [p for p in PRECISIONS if p in present]


@dataclass(frozen=True)
class ExecutedPrecision:
    """What an engine computed in, against what its mode asked.

    Of the ``layers`` layers the mode puts in ``asked`` (a short dtype name),
    those named in ``wider`` ran in fp32. ``chosen``: the backend chose each
    layer's precision itself (weak typing), so ``wider`` is its choice; else
    they are layers whose graph type the backend has no kernel for.
    """

    asked: str
    layers: int
    wider: tuple[str, ...] = ()
    chosen: bool = False

    def to_json(self) -> dict[str, object]:
        return {"asked": self.asked, "layers": self.layers, "ran_fp32": list(self.wider), "chosen_by_backend": self.chosen}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ExecutedPrecision:
        """The record :meth:`to_json` wrote (a results file's case field, already validated)."""
        return cls(obj["asked"], obj["layers"], tuple(obj["ran_fp32"]), obj["chosen_by_backend"])

    def describe(self) -> str | None:
        """"fp16 asked, 41 of 52 layers ran fp32" when layers ran wider than asked; None otherwise."""
        if not self.wider:
            return None
        why = " (the backend's choice: weak typing)" if self.chosen else " (no kernel in the asked type)"
        return f"{self.asked} asked, {len(self.wider)} of {self.layers} layers ran fp32{why}"
