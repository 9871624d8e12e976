"""From a precision mode to the typed graph a backend builds.

Each mode (:class:`harness.precision.PrecisionMode`) names one of the
compiler's five policies (``fp32``, ``full``, ``rule``, ``amp``,
``explicit``); weak modes hand the backend the fp32 graph because there the
builder, not the compiler, decides each layer's precision.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.autocast.settings import AutocastSettings
from harness.dtypes import EXPLICIT_DTYPES
from harness.engines.protocol import effective_settings
from harness.errors import HarnessError
from harness.fileio import read_json, shown
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec

_EXPLICIT_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": {"enum": sorted(EXPLICIT_DTYPES)},
}


def load_explicit(path: str | Path) -> dict[str, torch.dtype]:
    """Read an explicit-precision file: a JSON object of node-name regex -> "fp32"|"fp16"|"bf16"."""
    obj = read_json(path, _EXPLICIT_SCHEMA, what="explicit precision file")
    for pattern in obj:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise HarnessError(
                f"explicit precision file {path}: entry {shown(pattern)} is not a valid regular expression ({exc})"
            ) from None
    return {pattern: EXPLICIT_DTYPES[name] for pattern, name in obj.items()}


def compile_for_mode(
    spec: ModelSpec,
    mode: PrecisionMode | str,
    explicit_path: str | None,
    settings: AutocastSettings | None = None,
) -> CompiledGraph:
    """Compile ``spec`` into the typed graph that precision ``mode`` asks a backend to build.

    ``settings`` carry the classifier's options (exclusions, thresholds,
    calibration data) from the command line or project file to the compiler.
    """
    from harness.autocast import compile

    mode = mode if isinstance(mode, PrecisionMode) else PrecisionMode.parse(mode)
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
        policy=mode.policy,
        settings=effective_settings(settings or AutocastSettings(), mode),
        explicit=explicit,
        calibration_data=spec.calibration_data,
    )
