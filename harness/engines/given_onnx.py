"""A user's ONNX file handed to the ONNX backends as given, in place of an exported typed graph.

The backends that read ONNX (onnxruntime, openvino, tensorrt) build from
the file :func:`harness.engines.onnx_export.export_onnx` writes. For a model
that *is* an ONNX file (``--model model.onnx``) the modes that need no
compiler policy take that file as it is, as ``trtexec --onnx`` and
``polygraphy run`` do:

* ``fp32`` and the weak modes (``weak-fp16``/``weak-bf16``, where the builder
  picks each layer's precision): the file unchanged, apart from its input
  shapes, which are fixed to the case's (trtexec's ``--shapes``; the batch axis
  stays dynamic for an engine serving a batch profile);
* the strongly typed whole-graph modes (``fp16``, ``bf16``): the file with
  every floating tensor in the low type (:func:`lowered`: initializers,
  constants and ``Cast`` targets; inputs and outputs keep fp32 behind one
  ``Cast`` each while ``keep_io_types`` holds, as the compiler's full policy
  does). An op ONNX does not type in the low precision at the file's opset is
  refused by name.

:class:`GivenOnnx` stands where a backend expects the compiler's
``CompiledGraph``: the backends read its ``outputs`` (the output structure),
``example_inputs`` and, through ``export_onnx``, the file; nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import torch
import torch.utils._pytree as pytree

from harness.dtypes import dtype_name
from harness.engines.onnx_export import DYNAMIC, OnnxExport, TensorSpec, onnx_dtype_name
from harness.errors import HarnessError, first_line
from harness.fileio import atomic_write_bytes
from harness.outputs import OutputSpec

_LOW = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def structure_of(count: int) -> OutputSpec:
    """The output structure of an ONNX file: a bare tensor for one output, else a tuple."""
    if count == 1:
        return OutputSpec(pytree.tree_flatten(torch.empty(0))[1])
    return OutputSpec.flat(count)


@dataclass(frozen=True)
class GivenReport:
    """What a build says about the file besides the backend's own log (the compiler's report's place)."""

    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class GivenOnnx:
    """An ONNX file as an ONNX backend builds it; see the module docstring."""

    model_bytes: bytes
    example_inputs: tuple[torch.Tensor, ...]
    outputs: OutputSpec
    output_specs: tuple[TensorSpec, ...]  # at the example inputs' shapes
    batch_dim: int | None  # the file's dynamic batch axis (0), if it has one
    report: GivenReport = field(default_factory=GivenReport)
    policy: str = "given"

    def export(self, path: str | os.PathLike[str], *, batch_dim: int | None = None) -> OnnxExport:
        """Write the file with its inputs fixed to the example shapes (``batch_dim`` left dynamic) to
        ``path``, and describe it as :func:`~harness.engines.onnx_export.export_onnx` describes an export."""
        if batch_dim is not None and self.batch_dim != batch_dim:
            from harness.errors import StaticBatchError

            raise StaticBatchError(f"the ONNX file has no dynamic batch axis {batch_dim}; one engine per batch size")
        model = onnx.load_from_string(self.model_bytes)
        inputs = [v for v in model.graph.input if v.name not in {t.name for t in model.graph.initializer}]
        specs = []
        for value, example in zip(inputs, self.example_inputs, strict=True):
            dims = value.type.tensor_type.shape.dim
            shape = []
            for i, (dim, size) in enumerate(zip(dims, example.shape, strict=True)):
                if batch_dim is not None and i == batch_dim:
                    dim.ClearField("dim_value")
                    dim.dim_param = "batch"
                    shape.append(DYNAMIC)
                else:
                    dim.ClearField("dim_param")
                    dim.dim_value = int(size)
                    shape.append(int(size))
            specs.append(TensorSpec(value.name, dtype_name(example.dtype), tuple(shape)))
        outputs = tuple(
            TensorSpec(s.name, s.dtype, tuple(DYNAMIC if batch_dim is not None and i == batch_dim else d for i, d in enumerate(s.shape)))
            for s in self.output_specs
        )
        atomic_write_bytes(path, model.SerializeToString())
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        initializers = {t.name: onnx_dtype_name(t.data_type) for t in model.graph.initializer}
        return OnnxExport(Path(path), opset, tuple(specs), outputs, (), initializers)


def output_specs(names: Sequence[str], outputs: Sequence[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in zip(names, outputs, strict=True))


def lowered(model_bytes: bytes, low: str, keep_io_types: bool, where: str) -> bytes:
    """``model_bytes`` with every fp32 tensor in ``low`` ("fp16" or "bf16"); see the module docstring.

    The result is checked with ONNX's strict type inference: a node whose op
    the file's opset does not type in ``low`` is refused, naming it.
    """
    target = _LOW[low]
    model = ir.from_proto(onnx.load_from_string(model_bytes))
    graph = model.graph
    float_type = ir.DataType.FLOAT
    for value in list(graph.initializers.values()):
        if value.dtype == float_type and value.const_value is not None:
            with np.errstate(over="ignore"):  # values beyond fp16's range become inf, as a cast does
                array = value.const_value.numpy().astype(target.numpy())
            value.const_value = ir.tensor(array, dtype=target, name=value.name)
            value.dtype = target
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type == "Cast" and node.attributes["to"].as_int() == int(float_type):
            node.attributes["to"] = ir.AttrInt64("to", int(target))
        for name in ("value",):
            attr = node.attributes.get(name)
            if node.op_type in ("Constant", "ConstantOfShape") and attr is not None and attr.type == ir.AttributeType.TENSOR:
                tensor = attr.as_tensor()
                if tensor.dtype == float_type:
                    with np.errstate(over="ignore"):
                        array = tensor.numpy().astype(target.numpy())
                    node.attributes[name] = ir.AttrTensor(name, ir.tensor(array, dtype=target))
        for out in node.outputs:
            if not out.is_graph_output():
                out.type = None
                out.shape = None
    taken = {n.name for n in graph}
    for value in list(graph.inputs):
        if value.dtype != float_type:
            continue
        if not keep_io_types:
            value.dtype = target
            continue
        cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", int(target))], name=_fresh(f"{value.name}_to_{low}", taken))
        cast.outputs[0].name = f"{value.name}_{low}"
        for use in list(value.uses()):
            if use.node is not cast:
                use.node.replace_input_with(use.idx, cast.outputs[0])
        graph.insert_before(graph[0], cast)
    for i, value in enumerate(list(graph.outputs)):
        if value.dtype != float_type:
            continue
        if not keep_io_types:
            value.dtype = target
            continue
        inner_name = f"{value.name}_{low}"
        value.name = inner_name
        value.type, value.shape = None, None
        cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", int(float_type))], name=_fresh(f"{inner_name}_to_fp32", taken))
        out = cast.outputs[0]
        out.name, out.dtype, out.shape = inner_name.removesuffix(f"_{low}"), float_type, None
        graph.append(cast)
        graph.outputs[i] = out
    proto = ir.to_proto(model)
    del proto.graph.value_info[:]
    try:
        checked = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        raise HarnessError(
            f"{where}: the file cannot run wholly in {low}: {first_line(exc)} (ONNX does not type that op in {low} "
            "at the file's opset); use fp32, a weak mode, or a mode the compiler types (autocast-*, amp-*)"
        ) from None
    return bytes(checked.SerializeToString())


def _fresh(base: str, taken: set[str | None]) -> str:
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}#{k}"
    taken.add(name)
    return name

