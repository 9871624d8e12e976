"""What a saved OpenVINO engine's ``plan.json`` holds, and its schema.

The plan records everything about an engine besides what loading recomputes
(the layers OpenVINO executes, the fingerprint): the mode, the OpenVINO that
built it, the compile settings, the exported model's inputs, outputs and
casts, and the model's output structure. Loading validates it against
:data:`PLAN_SCHEMA` and then :meth:`EngineRecord.from_plan` refuses what a
schema cannot express (an output structure of another size, a precision hint
that is not the mode's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.engines.onnx_export import CAST_SCHEMA, TENSOR_SPEC_SCHEMA, CastRecord, TensorSpec
from harness.engines.openvino.settings import SETTINGS_SCHEMA, CompileSettings, hint_for
from harness.engines.protocol import LAYER_SCHEMA, PRECISION_MODES
from harness.errors import HarnessError
from harness.outputs import OutputSpec

BACKEND = "openvino"
PLAN_FORMAT = "harness-openvino-engine"
PLAN_VERSION = 1
MODEL_FILE = "model.onnx"


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
            "mode": self.mode,
            "openvino_version": self.openvino_version,
            "compiler_settings": self.compiler_settings,
            "settings": self.settings.to_json(),
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "casts": [c.to_json() for c in self.casts],
            "output_structure": self.structure.to_json(),
        }

    @classmethod
    def from_plan(cls, obj: dict[str, Any], where: str) -> EngineRecord:
        """From a schema-validated plan, refusing what the schema cannot see."""
        record = cls(
            mode=obj["mode"],
            openvino_version=obj["openvino_version"],
            settings=CompileSettings.from_json(obj["settings"]),
            inputs=tuple(TensorSpec.from_json(s) for s in obj["inputs"]),
            outputs=tuple(TensorSpec.from_json(s) for s in obj["outputs"]),
            casts=tuple(CastRecord.from_json(c) for c in obj["casts"]),
            structure=OutputSpec.from_json(obj["output_structure"], where),
            compiler_settings=obj["compiler_settings"],
        )
        if record.structure.count != len(record.outputs):
            raise HarnessError(
                f"{where}: the output structure holds {record.structure.count} outputs, the plan "
                f"{len(record.outputs)}"
            )
        wanted = hint_for(record.mode)
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

PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "format",
        "version",
        "backend",
        "mode",
        "openvino_version",
        "settings",
        "inputs",
        "outputs",
        "casts",
        "output_structure",
        "compiler_settings",
        "model_file",
        "model_digest",
        "layers",
        "fingerprint",
    ],
    "additionalProperties": False,
    "properties": {
        "format": {"const": PLAN_FORMAT},
        "version": {"const": PLAN_VERSION},
        "backend": {"const": BACKEND},
        "mode": {"enum": list(PRECISION_MODES)},
        "openvino_version": {"type": "string"},
        "settings": SETTINGS_SCHEMA,
        "inputs": {"type": "array", "items": TENSOR_SPEC_SCHEMA},
        "outputs": {"type": "array", "items": TENSOR_SPEC_SCHEMA},
        "casts": {"type": "array", "items": CAST_SCHEMA},
        "output_structure": {"type": "string"},
        "compiler_settings": {"type": ["object", "null"]},
        "model_file": {"const": MODEL_FILE},
        "model_digest": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        "layers": {"type": "array", "items": _PLAN_LAYER_SCHEMA},
        "fingerprint": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
    },
}
