"""A precision plan: which layers stay fp32, as the explicit precision file ``build`` reads.

The file is the one ``harness build --mode explicit --explicit FILE`` and
``harness bench --mode explicit`` take (:func:`harness.engines.modes.load_explicit`):
a JSON object of node-name regexes to ``"fp32"|"fp16"|"bf16"``, first match
wins. A plan writes one anchored pattern per fp32 layer, in graph order, then
``".*"`` for the low precision; a plan that keeps every layer is ``{".*": "fp32"}``.
Node names are identifiers, escaped all the same. The bytes depend on nothing
but the kept layers and their order, so the same search writes the same file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.documents import document_json
from harness.engines.modes import ExplicitFile
from harness.fileio import atomic_write_bytes, json_bytes

FP32 = "fp32"


@dataclass(frozen=True)
class PrecisionPlan:
    """The layers kept in fp32 (graph order) out of ``layers``; every other layer runs ``low``."""

    low: str  # "bf16" or "fp16"
    layers: tuple[str, ...]  # every layer the plan decides, in graph order
    kept: tuple[str, ...]

    @classmethod
    def keeping(cls, low: str, layers: Sequence[str], kept: Iterable[str]) -> PrecisionPlan:
        """The plan keeping ``kept`` (any order) in fp32; unknown names are a bug of the caller."""
        chosen = set(kept)
        unknown = chosen - set(layers)
        if unknown:
            raise ValueError(f"not layers of this graph: {sorted(unknown)}")
        return cls(low, tuple(layers), tuple(name for name in layers if name in chosen))

    @property
    def all_fp32(self) -> bool:
        return len(self.kept) == len(self.layers)

    def explicit(self) -> dict[str, str]:
        """The explicit precision mapping (what the file holds)."""
        if self.all_fp32:
            return {".*": FP32}
        return {**{f"^{re.escape(name)}$": FP32 for name in self.kept}, ".*": self.low}

    def file_bytes(self) -> bytes:
        """The file: an :class:`~harness.engines.modes.ExplicitFile`, checked as one."""
        return json_bytes(document_json(ExplicitFile.model_validate(self.explicit())))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the explicit precision file atomically."""
        atomic_write_bytes(path, self.file_bytes())
        return Path(path)

    def describe(self) -> str:
        if not self.kept:
            return f"all {self.low}"
        if self.all_fp32:
            return "all fp32"
        return f"{len(self.kept)} fp32: {', '.join(self.kept)}"
