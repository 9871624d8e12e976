"""The autocast settings as users write them: CLI flags and project-file keys, one vocabulary.

``harness compile``, ``build``, ``rebuild`` and ``bench`` share the flags
(:func:`add_flags`), the project file's ``[tool.harness.autocast]`` table uses
the same names with underscores, and :func:`settings_from` turns either (or
both, the command line winning) into one :class:`AutocastSettings`. Thresholds
take a positive number or ``off``; nothing else turns a rule off.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.autocast.settings import (
    DEFAULT_DATA_MAX,
    DEFAULT_INIT_MAX,
    DEFAULT_KEEP_IO_TYPES,
    AutocastSettings,
    load_calibration_file,
)
from harness.errors import HarnessError

OFF = "off"
# user-facing key -> AutocastSettings field
FIELDS = {
    "exclude": "nodes_to_exclude",
    "exclude_op": "targets_to_exclude",
    "include": "nodes_to_include",
    "include_op": "targets_to_include",
    "data_max": "data_max",
    "init_max": "init_max",
    "max_reduction_depth": "max_depth_of_reduction",
    "keep_io_types": "keep_io_types",
    "fp32_output_tail": "fp32_output_tail",
    "bias_correction": "bias_correction",
    "calibration_data": "calibration_data",
}
LIST_KEYS = ("exclude", "exclude_op", "include", "include_op")

# JSON schema of the keys in a project file (the CLI checks the same rules in settings_from).
_THRESHOLD = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": OFF}]}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        **{k: {"type": "array", "items": {"type": "string"}} for k in LIST_KEYS},
        "data_max": _THRESHOLD,
        "init_max": _THRESHOLD,
        "max_reduction_depth": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": OFF}]},
        "keep_io_types": {"type": "boolean"},
        "fp32_output_tail": {"type": "boolean"},
        "bias_correction": {"type": "boolean"},
        "calibration_data": {"type": "string", "minLength": 1},
    },
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The classifier's flags. Defaults are None ("not given"), so a project file can fill them."""
    group = parser.add_argument_group("autocast compiler settings (flags override the project file)")
    group.add_argument("--exclude", action="append", metavar="REGEX",
                       help="keep nodes whose name or module path matches REGEX in fp32 (repeatable)")
    group.add_argument("--exclude-op", action="append", metavar="OP",
                       help="keep ops such as aten.softmax (every overload) or aten.conv2d.default in fp32")
    group.add_argument("--include", action="append", metavar="REGEX", help="force matching nodes low")
    group.add_argument("--include-op", action="append", metavar="OP", help="force these ops low")
    group.add_argument("--data-max", metavar="X|off",
                       help=f"activation absmax on calibration data above which a node stays fp32 "
                       f"(default: {DEFAULT_DATA_MAX:g})")
    group.add_argument("--init-max", metavar="X|off",
                       help=f"weight absmax above which a node stays fp32 (default: {DEFAULT_INIT_MAX:g})")
    group.add_argument("--max-reduction-depth", metavar="N|off",
                       help="keep in fp32 every reduction that sums more than N values "
                       "(conv, matmul K, sum, softmax ...) (default: off)")
    group.add_argument("--keep-io-types", action=argparse.BooleanOptionalAction, default=None,
                       help=f"keep the model's input and output dtypes (default: {DEFAULT_KEEP_IO_TYPES})")
    group.add_argument("--fp32-output-tail", action=argparse.BooleanOptionalAction, default=None,
                       help="with --keep-io-types, run the layers after the last join in fp32 where that "
                       "costs no cast (default: on)")
    group.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=None,
                       help="take the mean output shift that rounding a lowered linear's or "
                       "convolution's weights causes on the calibration data out of its bias (default: on)")
    group.add_argument("--calibration-data", metavar="FILE",
                       help="safetensors file of calibration batches: tensors input0, input1, ... with "
                       "the batches stacked on a new first dimension (default: the model's own)")
    # fmt: skip


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave on the command line, in project-file form."""
    out: dict[str, Any] = {}
    for key in FIELDS:
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    return out


def settings_from(
    values: Mapping[str, Any], *, base_dir: str | os.PathLike[str] | None = None, **fixed: Any
) -> AutocastSettings:
    """One AutocastSettings from user-facing keys (CLI strings or project-file values).

    Paths (calibration data) are relative to ``base_dir`` (the project file's
    directory) when given. ``fixed`` are AutocastSettings fields set directly
    (the low precision type of ``harness compile``).
    """
    kwargs: dict[str, Any] = dict(fixed)
    for key, value in values.items():
        if key not in FIELDS:
            raise HarnessError(f"unknown autocast setting {key!r}; valid: {', '.join(FIELDS)}")
        flag = "--" + key.replace("_", "-")
        if key in ("data_max", "init_max"):
            value = _threshold(value, flag, float)
        elif key == "max_reduction_depth":
            value = _threshold(value, flag, int)
        elif key == "calibration_data":
            path = Path(value) if base_dir is None else Path(base_dir) / value
            value = load_calibration_file(path)
        kwargs[FIELDS[key]] = value
    return AutocastSettings(**kwargs)


def _threshold(value: Any, flag: str, kind: type[float] | type[int]) -> float | int | None:
    if value == OFF:
        return None
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            raise HarnessError(f"{flag} {value!r}: expected a positive number or {OFF!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HarnessError(f"{flag} {value!r}: expected a positive finite number, or {OFF!r} to turn the rule off")
    if kind is int and value != int(value):
        raise HarnessError(f"{flag} {value!r}: expected a positive integer or {OFF!r}")
    return kind(value)
