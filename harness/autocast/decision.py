"""What the classifier decides for one node, and why.

A decision is not just "high" or "low": exact AMP semantics need the five
``CastPolicy`` behaviours, which depend on the dtypes that actually reach the
node. So a decision names an action; the cast-insertion pass resolves it to
concrete casts once the input dtypes are known.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Action(enum.Enum):
    CAST = "cast"  # cast every eligible float input to ``dtype``
    PROMOTE = "promote"  # cast eligible inputs to the widest of them (at least ``dtype``)
    SET_OPT_DTYPE = "set_opt_dtype"  # run with ``dtype=float32`` unless the call sets one
    APPEND_DTYPE = "append_dtype"  # redispatch to the overload taking a dtype, with float32
    KEEP = "keep"  # run in whatever dtype the inputs have


@dataclass(frozen=True)
class Decision:
    action: Action
    rule: str  # short id, counted in the report ("nodes_to_exclude", "data_max", ...)
    reason: str  # the sentence a user reads, with the measured value where there is one
    dtype: torch.dtype | None = None
    redispatch: str | None = None
