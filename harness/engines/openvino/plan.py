"""What a saved OpenVINO engine's ``plan.json`` holds, and its schema.

The plan records everything about an engine besides what loading recomputes
(the layers OpenVINO executes, the fingerprint): the mode, the OpenVINO that
built it, the compile settings, the exported model's inputs, outputs and
casts, and the model's output structure. Loading validates it against
:data:`PLAN`'s schema (generated from :class:`OpenVinoPlan`) and then
:meth:`EngineRecord.from_plan` refuses what a schema cannot express (an output
structure of another size, a precision hint that is not the mode's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import dataclasses as pydantic_dataclasses

from harness.documents import DOCUMENT
from harness.engines.onnx_export import CastRecord, TensorSpec
from harness.engines.onnx_plan import (
    MODEL_FILE,
    ExportedInterface,
    ModelPlan,
    check_output_count,
    interface_json,
    read_interface,
)
from harness.engines.openvino.settings import CompileSettings, hint_for
from harness.engines.protocol import LayerRecord
from harness.engines.saved import PlanFormat, PlanHeader
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
    def from_plan(cls, plan: OpenVinoPlan, where: str) -> EngineRecord:
        """The record of a plan, refusing what its schema cannot see (a HarnessError naming ``where``)."""
        record = cls(**read_interface(plan, where), openvino_version=plan.openvino_version, settings=plan.settings)
        check_output_count(record.structure, record.outputs, where)
        wanted = hint_for(PrecisionMode.parse(record.mode))
        if record.settings.inference_precision_hint != wanted:
            raise HarnessError(
                f"{where}: mode {record.mode} compiles with INFERENCE_PRECISION_HINT={wanted}, the plan "
                f"says {record.settings.inference_precision_hint}"
            )
        return record


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class OpenVinoLayerRecord(LayerRecord):
    """A layer of an OpenVINO plan: a :class:`LayerRecord` (its key null), the precision its
    kernel computes in and the model's ops fused into it (:class:`~harness.engines.openvino.layers.ExecutedLayer`)."""

    precision: str
    origins: tuple[str, ...]


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class _Record(ExportedInterface, PlanHeader):
    """The header, the interface, the OpenVINO that built the engine and its compile settings."""

    openvino_version: str
    settings: CompileSettings


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class OpenVinoPlan(ModelPlan, _Record):
    """A saved OpenVINO engine's ``plan.json``: the header, the interface, the OpenVINO that built
    it, its compile settings, then the model file, its digest, the executed layers and the
    fingerprint."""

    layers: tuple[OpenVinoLayerRecord, ...]


PLAN = PlanFormat(BACKEND, PLAN_FORMAT, PLAN_VERSION, MODEL_FILE, OpenVinoPlan)
