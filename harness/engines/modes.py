"""From a precision mode name to the typed graph a backend builds.

The ten modes of DESIGN.md section 2 map onto four compiler modes; weak modes
hand the backend the fp32 graph because there the builder, not the compiler,
decides each layer's precision.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.engines.protocol import PRECISION_MODES
from harness.errors import HarnessError
from harness.fileio import read_json

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from models import ModelSpec

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
EXPLICIT_DTYPES = {"fp32": torch.float32, **LOW_DTYPES}

_EXPLICIT_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": {"enum": sorted(EXPLICIT_DTYPES)},
}


def check_mode_name(mode: str) -> None:
    if mode not in PRECISION_MODES:
        raise HarnessError(f"unknown precision mode {mode!r}; valid modes: {', '.join(PRECISION_MODES)}")


def is_weak(mode: str) -> bool:
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


def compile_for_mode(spec: ModelSpec, mode: str, explicit_path: str | None) -> CompiledGraph:
    """Compile ``spec`` into the typed graph that precision ``mode`` asks a backend to build."""
    from harness.autocast import compile

    check_mode_name(mode)
    if (mode == "explicit") != (explicit_path is not None):
        raise HarnessError(
            "mode 'explicit' needs an explicit precision file (--explicit FILE)"
            if mode == "explicit"
            else f"an explicit precision file was given, but mode is {mode!r}; use mode 'explicit'"
        )
    low = low_dtype(mode)
    kwargs: dict[str, object] = {"calibration_data": spec.calibration_data}
    explicit: Mapping[str, torch.dtype] | None = None
    if mode == "fp32" or is_weak(mode):
        compiler_mode = "fp32"
    elif mode in ("fp16", "bf16"):
        compiler_mode = "full"
    elif mode.startswith("autocast-"):
        compiler_mode = "rule"
    elif mode.startswith("amp-"):
        compiler_mode = "amp"
    else:
        assert explicit_path is not None
        compiler_mode = "explicit"
        explicit = load_explicit(explicit_path)
    if low is not None and not is_weak(mode):
        kwargs["low_precision_type"] = low
    return compile(spec.module, spec.example_inputs, mode=compiler_mode, explicit=explicit, **kwargs)
