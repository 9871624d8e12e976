"""Compiler settings, validated up front.

Everything the user can get wrong (a regex that does not compile, an op name
that does not exist, a dtype that is not a low-precision float, a threshold
that is not a positive number) is caught here, before export or calibration
spends any time, with a message that names the setting and what is valid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.errors import HarnessError
from harness.lowering.decompose import resolve_op_names

LOW_PRECISION_TYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
DTYPES = {**LOW_PRECISION_TYPES, "fp32": torch.float32, "float32": torch.float32}

# A custom rule sees the node and the compile context and returns a reason to
# keep the node in fp32, or None to let the remaining rules decide.
CustomRule = Callable[[torch.fx.Node, Any], "str | None"]


def parse_dtype(value: str | torch.dtype, what: str, allowed: dict[str, torch.dtype] = LOW_PRECISION_TYPES) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in allowed.values():
            return value
    elif value in allowed:
        return allowed[value]
    valid = ", ".join(sorted(allowed))
    raise HarnessError(f"{what}: unknown dtype {value!r}; valid: {valid}")


def compile_patterns(patterns: Iterable[str], what: str) -> tuple[re.Pattern[str], ...]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise HarnessError(f"{what}: invalid regular expression {p!r}: {exc}") from None
    return tuple(out)


def _threshold(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise HarnessError(f"{what} must be a positive number or None, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AutocastSettings:
    """Rule-mode settings (seed 000), plus ``keep_io_types`` and custom rules."""

    low_precision_type: torch.dtype | str = torch.float16
    nodes_to_exclude: Sequence[str] = ()
    targets_to_exclude: Sequence[str] = ()
    nodes_to_include: Sequence[str] = ()
    targets_to_include: Sequence[str] = ()
    data_max: float | None = 512.0
    init_max: float | None = 65504.0
    max_depth_of_reduction: int | None = None
    calibration_data: Sequence[Sequence[torch.Tensor]] | None = None
    keep_io_types: bool = True
    custom_rules: Sequence[CustomRule] = ()
    # derived, validated forms
    low: torch.dtype = field(init=False)
    exclude_patterns: tuple[re.Pattern[str], ...] = field(init=False)
    include_patterns: tuple[re.Pattern[str], ...] = field(init=False)
    exclude_targets: frozenset[str] = field(init=False)
    include_targets: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "low", parse_dtype(self.low_precision_type, "low_precision_type"))
        set_(self, "exclude_patterns", compile_patterns(_strings(self.nodes_to_exclude, "nodes_to_exclude"), "nodes_to_exclude"))
        set_(self, "include_patterns", compile_patterns(_strings(self.nodes_to_include, "nodes_to_include"), "nodes_to_include"))
        set_(self, "exclude_targets", frozenset(_ops(self.targets_to_exclude, "targets_to_exclude")))
        set_(self, "include_targets", frozenset(_ops(self.targets_to_include, "targets_to_include")))
        set_(self, "data_max", _threshold(self.data_max, "data_max"))
        set_(self, "init_max", _threshold(self.init_max, "init_max"))
        depth = self.max_depth_of_reduction
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0):
            raise HarnessError(f"max_depth_of_reduction must be a positive integer or None, got {depth!r}")
        for rule in self.custom_rules:
            if not callable(rule):
                raise HarnessError(f"custom_rules: {rule!r} is not callable (expected f(node, context) -> reason or None)")


def _strings(values: Iterable[str], what: str) -> list[str]:
    if isinstance(values, str):
        raise HarnessError(f"{what} must be a collection of strings, not a single string {values!r}")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise HarnessError(f"{what}: {v!r} is not a string")
    return out


def _ops(values: Iterable[str], what: str) -> set[str]:
    try:
        return resolve_op_names(_strings(values, what))
    except HarnessError as exc:
        raise HarnessError(f"{what}: {exc}") from None
