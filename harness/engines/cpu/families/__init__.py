"""The CPU engine's catalogue of tactics: one :class:`~harness.engines.cpu.tactic.Family` per kind
of layer, each an ordered tuple of :class:`~harness.engines.cpu.tactic.Tactic` entries, each
entry beside its own code in its family's module.

A layer belongs to the first family in :data:`FAMILIES` that matches it
(:data:`~harness.engines.cpu.families.plain.PLAIN`, the last, matches every
layer). The order of a family's entries is the order its layer's tactics are
offered, timed and listed in: timing caches and tests depend on it.
"""

from __future__ import annotations

from harness.engines.cpu.families.attention import ATTENTION
from harness.engines.cpu.families.conv import CONV
from harness.engines.cpu.families.gemm import GEMM
from harness.engines.cpu.families.normalization import LAYER_NORM, SOFTMAX
from harness.engines.cpu.families.plain import BINARY, CAST, PLAIN, POOL, VIEW
from harness.engines.cpu.tactic import Family

FAMILIES: tuple[Family, ...] = (VIEW, GEMM, CONV, POOL, BINARY, CAST, SOFTMAX, LAYER_NORM, ATTENTION, PLAIN)
