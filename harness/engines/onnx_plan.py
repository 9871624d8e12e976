"""The ``plan.json`` fields of engines that run the exported ONNX model.

The onnxruntime, openvino and tensorrt backends all build from the file of
:func:`harness.engines.onnx_export.export_onnx`, so their plans record the
same interface: the mode, the exported model's inputs, outputs and casts,
the model's output structure and the autocast settings. The onnxruntime and
openvino engines store that model itself beside the plan (``model.onnx``,
checked against ``model_digest`` on load) and share what such an engine
reports about itself (:class:`ModelEngine`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal, Protocol, TypedDict, TypeVar

import onnx
import torch
from google.protobuf.message import DecodeError
from pydantic import dataclasses as pydantic_dataclasses

from harness.documents import DOCUMENT, Digest, OneOf, document_json
from harness.engines.onnx_export import (
    CastRecord,
    TensorSpec,
    initializer_bytes_by_dtype,
    initializers_digest,
)
from harness.engines.protocol import EngineBase, LayerRecord
from harness.engines.saved import PLAN_FILE, PlanFormat, PlanHeader, read_payload
from harness.errors import HarnessError, first_line
from harness.fileio import digest, json_bytes
from harness.outputs import OutputSpec
from harness.precision import PRECISION_MODES

MODEL_FILE = "model.onnx"


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class ExportedInterface:
    """The fields of a plan that record the exported model's interface: the mode, the model's
    inputs, outputs and casts, its output structure (:meth:`OutputSpec.to_json`) and the
    autocast settings as JSON (null: they did not apply). A plan class of an engine built from
    the exported model derives from this one."""

    mode: Annotated[str, OneOf(PRECISION_MODES)]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    output_structure: str
    compiler_settings: dict[str, Any] | None


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class ModelPayload:
    """The closing fields of a plan stored beside ``model.onnx``: the model file and its digest,
    the layers the runtime executes and the engine's fingerprint."""

    model_file: Literal["model.onnx"]
    model_digest: Digest
    layers: tuple[LayerRecord, ...]
    fingerprint: Digest


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class ModelPlan(ModelPayload, PlanHeader):
    """A plan stored beside ``model.onnx``: the header first, the :class:`ModelPayload` last.

    A backend's plan class derives from this one and from a class holding its own fields
    (which derives from :class:`ExportedInterface` and :class:`PlanHeader`), so those come
    in between (see :class:`~harness.engines.saved.PlanHeader` on the order of fields).
    """


M = TypeVar("M", bound=ModelPlan)


class Interface(TypedDict):
    """The interface fields of an engine record, as its constructor takes them."""

    mode: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    structure: OutputSpec
    compiler_settings: dict[str, Any] | None  # the autocast settings as JSON (None: they did not apply)


class ExportedRecord(Protocol):
    """An engine record holding the interface (each backend's ``EngineRecord``)."""

    @property
    def mode(self) -> str: ...
    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def casts(self) -> tuple[CastRecord, ...]: ...
    @property
    def structure(self) -> OutputSpec: ...
    @property
    def compiler_settings(self) -> dict[str, Any] | None: ...
    def to_json(self) -> dict[str, Any]:
        """The record's plan.json fields."""
        ...


def io_json(record: ExportedRecord) -> dict[str, Any]:
    """The mode, the I/O tensors and the casts as plan.json gives them."""
    return {
        "mode": record.mode,
        "inputs": [document_json(s) for s in record.inputs],
        "outputs": [document_json(s) for s in record.outputs],
        "casts": [document_json(c) for c in record.casts],
    }


def interface_json(record: ExportedRecord) -> dict[str, Any]:
    """The plan.json fields of :class:`ExportedInterface`."""
    return {
        **io_json(record),
        "output_structure": record.structure.to_json(),
        "compiler_settings": record.compiler_settings,
    }


def read_interface(plan: ExportedInterface, where: str) -> Interface:
    """The interface of a plan (:func:`check_output_count` is the caller's); a HarnessError
    naming ``where`` for an output structure that cannot be read."""
    return Interface(
        mode=plan.mode,
        inputs=plan.inputs,
        outputs=plan.outputs,
        casts=plan.casts,
        structure=OutputSpec.from_json(plan.output_structure, where),
        compiler_settings=plan.compiler_settings,
    )


def first_difference(recorded: Sequence[object], now: Sequence[object]) -> int:
    """The index of the first layer where a plan's recorded layers and the executed ones differ
    (the shorter list's length when one is the other's beginning)."""
    return next((i for i, (a, b) in enumerate(zip(recorded, now, strict=False)) if a != b), min(len(recorded), len(now)))


def check_output_count(structure: OutputSpec, outputs: tuple[TensorSpec, ...], where: str) -> None:
    """Refuse a plan whose output structure holds another number of outputs than the model has."""
    if structure.count != len(outputs):
        raise HarnessError(
            f"{where}: the output structure holds {structure.count} outputs, the plan {len(outputs)}"
        )


def read_model_plan(plan: PlanFormat[M], path: str | os.PathLike[str]) -> tuple[bytes, M, str]:
    """The model bytes (checked against the plan's digest), the plan and its "engine plan FILE" prefix.

    The bytes are parsed by the engine (:class:`ModelEngine`, through
    :func:`parse_model`); a loader names ``where`` in front of its errors.
    """
    directory, obj, where = plan.load(path)
    return read_payload(directory, obj.model_file, obj.model_digest, "engine model"), obj, where


def parse_model(model_bytes: bytes) -> onnx.ModelProto:
    """The one guarded reader of an engine's ``model.onnx``: refused (a HarnessError) when it is
    not an ONNX model, or names external data files a runtime would read from wherever they point.

    The digest in the plan says only that the file is the one the plan was
    written with; a plan re-signed over damaged bytes still reaches here.
    """
    try:
        model = onnx.load_from_string(model_bytes)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise HarnessError(f"{MODEL_FILE} is not an ONNX model ({first_line(exc)}); rebuild the engine") from None
    external = [t.name for t in _tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise HarnessError(
            f"{MODEL_FILE} stores tensors in external files ({', '.join(external[:5])}); engines "
            "made by the harness hold every weight inside model.onnx"
        )
    return model


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph stores: initializers and attribute tensors, subgraphs included."""
    yield from graph.initializer
    yield from (sparse.values for sparse in graph.sparse_initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _tensors(subgraph)


class ModelEngine(EngineBase):
    """An engine stored as ``model.onnx`` beside its plan: what it reports about itself.

    A subclass sets ``_fingerprint`` and names its plan format (``plan``), the
    fields its runtime adds before the record (``_runtime_json``) and the
    layers the plan records (``_layers_json``).
    """

    backend: str
    plan: PlanFormat[Any]
    _fingerprint: str

    def __init__(self, model_bytes: bytes, record: ExportedRecord) -> None:
        self.mode = record.mode
        self.record = record
        self.outputs = record.structure
        self._model_bytes = model_bytes
        self._onnx = parse_model(model_bytes)

    def _runtime_json(self) -> dict[str, Any]:
        return {}

    def _layers_json(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(spec.torch_dtype for spec in self.record.inputs)

    def fingerprint(self) -> str:
        return self._fingerprint

    def weights_digest(self) -> str:
        return initializers_digest(self._onnx)

    def size_bytes(self) -> int:
        return len(self._model_bytes)

    def device_memory_bytes(self) -> int | None:
        return None  # host engine: its memory is in the run's peak RSS

    def compiler_settings(self) -> dict[str, Any] | None:
        return self.record.compiler_settings

    def weight_bytes_by_dtype(self) -> dict[str, int]:
        return initializer_bytes_by_dtype(self._onnx)

    def plan_json(self) -> dict[str, Any]:
        return {
            **self.plan.header(),
            **self._runtime_json(),
            **self.record.to_json(),
            "model_file": MODEL_FILE,
            "model_digest": digest(self._model_bytes),
            "layers": self._layers_json(),
            "fingerprint": self._fingerprint,
        }

    def files(self) -> dict[str, bytes]:
        """``model.onnx`` and ``plan.json``."""
        return {MODEL_FILE: self._model_bytes, PLAN_FILE: json_bytes(self.plan.dump(self.plan_json()))}
