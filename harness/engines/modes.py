"""From a precision mode to the typed graph a backend builds.

Each mode (:class:`harness.precision.PrecisionMode`) names one of the
compiler's five policies (``fp32``, ``full``, ``rule``, ``amp``,
``explicit``); weak modes hand the backend the fp32 graph because there the
builder, not the compiler, decides each layer's precision.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import Field, RootModel

from harness.autocast.settings import AutocastSettings
from harness.documents import read_document, schema_of
from harness.dtypes import EXPLICIT_DTYPES
from harness.engines.protocol import effective_settings
from harness.errors import HarnessError
from harness.fileio import read_json, shown
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from harness.autocast import CompiledGraph
    from harness.models import ModelSpec


class ExplicitFile(RootModel[Annotated[dict[str, Literal["fp32", "fp16", "bf16"]], Field(min_length=1)]]):
    """An explicit-precision file: node-name regular expression -> the precision of the nodes
    it matches (the first match wins); at least one entry."""


EXPLICIT_SCHEMA = schema_of(ExplicitFile, "explicit precision file")


def load_explicit(path: str | Path) -> dict[str, torch.dtype]:
    """Read an explicit-precision file (:class:`ExplicitFile`) into regex -> dtype; a HarnessError
    naming the file and the entry for a value that is not a precision or a pattern that is not
    a regular expression."""
    where = f"explicit precision file {path}"
    obj = read_document(ExplicitFile, read_json(path, what="explicit precision file"), EXPLICIT_SCHEMA, where).root
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
    program: ExportedProgram | None = None,
) -> CompiledGraph:
    """Compile ``spec`` into the typed graph that precision ``mode`` asks a backend to build.

    ``settings`` carry the classifier's options (exclusions, thresholds,
    calibration data) from the command line or project file to the compiler.
    ``program`` is the spec's own export (:func:`harness.frontend.export.export_program`
    of its module on its example inputs), for a caller that compiles one spec in several
    modes: the compile starts from it, which it leaves unchanged, instead of exporting
    again. None: the module is exported here.
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
        spec.module if program is None else program,
        spec.example_inputs,
        policy=mode.policy,
        settings=effective_settings(settings or AutocastSettings(), mode),
        explicit=explicit,
        calibration_data=spec.calibration_data,
    )
