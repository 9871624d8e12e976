"""An OpenVINO engine: the exported ONNX model compiled for the CPU plugin, saved and loaded.

The engine holds the exact ONNX file of :func:`harness.engines.onnx_export.export_onnx`
(the one TensorRT's parser gets, with every compiler cast as a ``Cast``,
which OpenVINO reads as a ``Convert``) and the properties it is compiled with
(:mod:`.settings`). Its layers are OpenVINO's runtime model (:mod:`.layers`);
what its ``plan.json`` records is :mod:`.plan`.

A saved engine is a directory with ``model.onnx`` and ``plan.json``.
Everything in them is untrusted on load: the plan is validated against its
schema, the model against the plan's digest (and refused if it names
external data files, which OpenVINO would read from wherever they point),
the mode against the precision hint, and the model is compiled again; the
layers this OpenVINO executes must be the ones the plan records, and the
fingerprint over the record, the graph and the layers must match.
"""

from __future__ import annotations

import os
from typing import Any

import onnx
import torch

from harness.documents import document_json
from harness.engines.onnx_export import TensorSpec, check_inputs, graph_description
from harness.engines.onnx_plan import ModelEngine, first_difference, read_model_plan
from harness.engines.openvino.layers import (
    Deviation,
    ExecutedLayer,
    StableNames,
    deviations,
    executed_layers,
    executed_precision,
    graph_float_dtypes,
)
from harness.engines.openvino.plan import BACKEND, PLAN, EngineRecord, OpenVinoLayerRecord
from harness.engines.openvino.runtime import (
    DEVICE,
    OV_ERRORS,
    VERSION,
    copy_in,
    core,
    dtype_of,
    error_text,
    frontend_failures,
    host_view,
    to_torch,
)
from harness.engines.openvino.settings import CompileSettings
from harness.engines.protocol import ExecutedPrecision, LayerInfo
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
from harness.precision import PrecisionMode


class OpenVinoEngine(ModelEngine):
    backend = BACKEND
    plan = PLAN

    def __init__(self, model_bytes: bytes, record: EngineRecord) -> None:
        super().__init__(model_bytes, record)
        self.record: EngineRecord = record
        self.model = _read(model_bytes)  # the graph as OpenVINO read it, before its own passes
        self.compiled = _compile(self.model, record.settings)
        self._request = self.compiled.create_infer_request()
        self._inputs = [host_view(self._request.get_tensor(port))
                        for port in _ports(self.compiled.inputs, record.inputs, "input")]  # fmt: skip
        self._outputs = _ports(self.compiled.outputs, record.outputs, "output")
        names = StableNames(_model_names(self._onnx))
        self.executed: list[ExecutedLayer] = executed_layers(self.compiled, names)
        graph = graph_float_dtypes(self.model, names)
        self.deviations: list[Deviation] = deviations(self.executed, graph)
        self._executed_precision = executed_precision(self.executed, graph, PrecisionMode(record.mode))
        self._fingerprint = digest(
            canonical_json(
                {
                    "backend": BACKEND,
                    "device": DEVICE,
                    **record.to_json(),
                    "graph": graph_description(self._onnx),
                    "layers": self._layers_json(),
                }
            )
        )

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_inputs(inputs, self.record.inputs, "openvino engine")
        for buffer, tensor in zip(self._inputs, inputs, strict=True):
            copy_in(buffer, tensor)
        try:
            self._request.infer()
        except OV_ERRORS as exc:
            raise HarnessError(f"openvino failed to run the engine: {error_text(exc)}") from None
        return tuple(to_torch(self._request.get_tensor(port)) for port in self._outputs)

    def layers(self) -> list[LayerInfo]:
        return [layer.info() for layer in self.executed]

    def executed_precision(self) -> ExecutedPrecision | None:
        return self._executed_precision

    def compiled_property(self, name: str) -> Any:
        """A property of the compiled model as OpenVINO reports it (what it really applied)."""
        return self.compiled.get_property(name)

    def layer_records(self) -> tuple[OpenVinoLayerRecord, ...]:
        """The plan's ``layers`` of the layers OpenVINO executes (no key: nothing is autotuned)."""
        return tuple(
            OpenVinoLayerRecord.of(layer.info(), None, precision=layer.precision, origins=layer.origins)
            for layer in self.executed
        )

    def _layers_json(self) -> list[dict[str, Any]]:
        return [document_json(layer) for layer in self.layer_records()]

    @staticmethod
    def load(path: str | os.PathLike[str]) -> OpenVinoEngine:
        model_bytes, plan, where = read_model_plan(PLAN, path)
        record = EngineRecord.from_plan(plan, where)
        try:
            engine = OpenVinoEngine(model_bytes, record)
        except HarnessError as exc:
            raise HarnessError(f"{where}: {exc}") from None
        now = engine.layer_records()
        if now != plan.layers:
            first = first_difference(plan.layers, now)
            raise HarnessError(
                f"{where}: OpenVINO {VERSION} executes other layers than the plan records (built with "
                f"OpenVINO {record.openvino_version}; {len(now)} layers now, {len(plan.layers)} in "
                f"the plan, first difference at layer {first}: {_layer_text(now, first)} now, "
                f"{_layer_text(plan.layers, first)} in the plan); rebuild the engine"
            )
        if engine.fingerprint() != plan.fingerprint:
            raise HarnessError(
                f"{where}: the plan was edited or belongs to another engine (fingerprint mismatch); "
                "rebuild the engine"
            )
        return engine


def _model_names(model: onnx.ModelProto) -> set[str]:
    """The names the exported model gives its nodes, values and weights (never renamed)."""
    graph = model.graph
    names = {node.name for node in graph.node} | {v for node in graph.node for v in (*node.input, *node.output)}
    return names | {t.name for t in graph.initializer}


def _read(model_bytes: bytes) -> Any:
    try:
        return core().read_model(model_bytes)
    except OV_ERRORS as exc:
        raise HarnessError(f"OpenVINO {VERSION} cannot read the exported model: {frontend_failures(exc)}") from None


def _compile(model: Any, settings: CompileSettings) -> Any:
    try:
        return core().compile_model(model, DEVICE, settings.properties())
    except OV_ERRORS as exc:
        raise HarnessError(
            f"OpenVINO {VERSION} cannot compile the model for {DEVICE} with "
            f"{settings.properties()}: {error_text(exc)}"
        ) from None


def _ports(ports: Any, specs: tuple[TensorSpec, ...], what: str) -> list[Any]:
    """The compiled model's ports in the order of ``specs``, matched by name."""
    by_name = {name: port for port in ports for name in port.get_names()}
    missing = [spec.name for spec in specs if spec.name not in by_name]
    if missing or len(ports) != len(specs):
        raise HarnessError(
            f"the compiled model's {what}s ({', '.join(sorted(by_name))}) are not the plan's "
            f"({', '.join(s.name for s in specs)})"
        )
    for spec in specs:
        port = by_name[spec.name]
        shape = port.get_partial_shape()
        found = (dtype_of(port.get_element_type()), tuple(shape.to_shape()) if shape.is_static else str(shape))
        if found != (spec.dtype, spec.shape):
            raise HarnessError(
                f"the compiled model's {what} {spec.name!r} is {found[0]} {found[1]}, the plan says "
                f"{spec.dtype} {spec.shape}"
            )
    return [by_name[spec.name] for spec in specs]


def _layer_text(layers: tuple[OpenVinoLayerRecord, ...], index: int) -> str:
    if index >= len(layers):
        return "none"
    layer = layers[index]
    return f"{layer.name} ({layer.layer_type}, {layer.tactic})"
