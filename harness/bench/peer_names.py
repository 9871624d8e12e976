"""The names of the peers and the precisions they compare at, without importing any runtime.

:mod:`harness.bench.peers` measures the peers and imports torch;
the command line's parser, the project file's schema and the tables only
need these names, and ``harness gate`` must run where torch is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

PRECISIONS = ("fp32", "bf16", "fp16")
PEER_NAMES = ("eager", "inductor", "onnxruntime", "openvino", "eager-cuda")


def precision_of(mode: str) -> str | None:
    """The precision a mode computes in, for comparing it with peers (None: ``explicit``, mixed by file)."""
    if mode == "fp32":
        return "fp32"
    low = mode.rpartition("-")[2]
    return low if low in PRECISIONS[1:] else None


def run_precisions(modes: Sequence[str]) -> list[str]:
    """The precisions of a run's modes, in :data:`PRECISIONS` order: the ones its peers run at."""
    present = {precision_of(mode) for mode in modes}
    return [p for p in PRECISIONS if p in present]
