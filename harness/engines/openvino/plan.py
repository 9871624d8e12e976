"""What a saved OpenVINO engine's ``plan.json`` holds, and its schema.

The plan records everything about an engine besides what loading recomputes
(the layers OpenVINO executes, the fingerprint): the mode, the OpenVINO that
built it, the compile settings, the exported model's inputs, outputs and
casts, and the model's output structure. Loading validates it against
:data:`PLAN`'s schema and then :meth:`EngineRecord.from_plan` refuses what a
schema cannot express (an output structure of another size, a precision hint
that is not the mode's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.engines.onnx_export import CastRecord, TensorSpec
from harness.engines.onnx_plan import (
    check_output_count,
    interface_json,
    model_plan_format,
    read_interface,
)
from harness.engines.openvino.settings import SETTINGS_SCHEMA, CompileSettings, hint_for
from harness.engines.protocol import LAYER_SCHEMA
from harness.errors import HarnessError
from harness.outputs import OutputSpec
from harness.precision import PrecisionMode

BACKEND = "openvino"
PLAN_FORMAT = "harness-openvino-engine"
PLAN_VERSION = 1


@dataclass(frozen=True)
class EngineRecord:
    """Everything plan.json says about an engine besides what is recomputed on load."""

    mode: str
    openvino_version: str  # the OpenVINO that built it (a loaded engine keeps its builder's)
    settings: CompileSettings
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    structure: OutputSpec
    compiler_settings: dict[str, Any] | None  # the autocast settings as JSON (None: they did not apply)

    def to_json(self) -> dict[str, Any]:
        return {
            **interface_json(self),
            "openvino_version": self.openvino_version,
            "settings": self.settings.to_json(),
        }

    @classmethod
    def from_plan(cls, obj: dict[str, Any], where: str) -> EngineRecord:
        """From a schema-validated plan, refusing what the schema cannot see."""
        record = cls(
            **read_interface(obj, where),
            openvino_version=obj["openvino_version"],
            settings=CompileSettings.from_json(obj["settings"]),
        )
        check_output_count(record.structure, record.outputs, where)
        wanted = hint_for(PrecisionMode.parse(record.mode))
        if record.settings.inference_precision_hint != wanted:
            raise HarnessError(
                f"{where}: mode {record.mode} compiles with INFERENCE_PRECISION_HINT={wanted}, the plan "
                f"says {record.settings.inference_precision_hint}"
            )
        return record


_PLAN_LAYER_SCHEMA: dict[str, Any] = {
    **LAYER_SCHEMA,
    "required": [*LAYER_SCHEMA["required"], "precision", "origins"],
    "properties": {
        **LAYER_SCHEMA["properties"],
        "precision": {"type": "string"},
        "origins": {"type": "array", "items": {"type": "string"}},
    },
}

PLAN = model_plan_format(
    BACKEND,
    PLAN_FORMAT,
    PLAN_VERSION,
    {"openvino_version": {"type": "string"}, "settings": SETTINGS_SCHEMA},
    _PLAN_LAYER_SCHEMA,
)
