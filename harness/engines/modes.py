"""From a precision mode name to the typed graph a backend builds.

The ten precision modes (:data:`harness.engines.protocol.PRECISION_MODES`; see
"Precision modes" in docs/design.md) map onto the compiler's five policies
(``fp32``, ``full``, ``rule``, ``amp``, ``explicit``); weak modes hand the
backend the fp32 graph because there the builder, not the compiler, decides
each layer's precision.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.autocast.settings import AutocastSettings
from harness.dtypes import EXPLICIT_DTYPES, LOW_DTYPES
from harness.engines.protocol import PRECISION_MODES
from harness.errors import HarnessError
from harness.fileio import read_json

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec

_EXPLICIT_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": {"enum": sorted(EXPLICIT_DTYPES)},
}


def check_mode_name(mode: str) -> None:
    if mode not in PRECISION_MODES:
        raise HarnessError(
            f"unknown precision mode {mode!r}; valid modes: {', '.join(PRECISION_MODES)}"
        )


def is_weak(mode: str) -> bool:
    """Whether ``mode`` lets the builder choose each layer's precision (``weak-fp16``, ``weak-bf16``)."""
    return mode.startswith("weak-")


def low_dtype(mode: str) -> torch.dtype | None:
    """The reduced precision a mode works with (None for fp32 and explicit)."""
    return LOW_DTYPES.get(mode.rpartition("-")[2])


def load_explicit(path: str | Path) -> dict[str, torch.dtype]:
    """Read an explicit-precision file: a JSON object of node-name regex -> "fp32"|"fp16"|"bf16"."""
    obj = read_json(path, _EXPLICIT_SCHEMA, what="explicit precision file")
    for pattern in obj:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise HarnessError(
                f"explicit precision file {path}: entry {pattern!r} is not a valid regular expression ({exc})"
            ) from None
    return {pattern: EXPLICIT_DTYPES[name] for pattern, name in obj.items()}


# precision mode -> compiler policy (weak modes build the fp32 graph)
_POLICIES = {
    "fp32": "fp32",
    "fp16": "full",
    "bf16": "full",
    "weak-fp16": "fp32",
    "weak-bf16": "fp32",
    "autocast-fp16": "rule",
    "autocast-bf16": "rule",
    "amp-fp16": "amp",
    "amp-bf16": "amp",
    "explicit": "explicit",
}


def settings_apply(mode: str) -> bool:
    """Whether the autocast settings change the graph of ``mode`` (policy rule; I/O types of full and explicit)."""
    return _POLICIES[mode] in ("rule", "full", "explicit")


def effective_settings(settings: AutocastSettings, mode: str) -> AutocastSettings:
    """``settings`` with the low precision type ``mode`` implies (the mode decides it for builds)."""
    low = low_dtype(mode)
    return dataclasses.replace(settings, low_precision_type=low) if low is not None else settings


def compile_for_mode(
    spec: ModelSpec, mode: str, explicit_path: str | None, settings: AutocastSettings | None = None
) -> CompiledGraph:
    """Compile ``spec`` into the typed graph that precision ``mode`` asks a backend to build.

    ``settings`` carry the classifier's options (exclusions, thresholds,
    calibration data) from the command line or project file to the compiler.
    """
    from harness.autocast import compile

    check_mode_name(mode)
    if (mode == "explicit") != (explicit_path is not None):
        raise HarnessError(
            "mode 'explicit' needs an explicit precision file (--explicit FILE)"
            if mode == "explicit"
            else f"an explicit precision file was given, but mode is {mode!r}; use mode 'explicit'"
        )
    explicit = load_explicit(explicit_path) if explicit_path is not None else None
    return compile(
        spec.module,
        spec.example_inputs,
        policy=_POLICIES[mode],
        settings=effective_settings(settings or AutocastSettings(), mode),
        explicit=explicit,
        calibration_data=spec.calibration_data,
    )
