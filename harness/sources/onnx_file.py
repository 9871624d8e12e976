"""ONNX files as models: read, declared, referenced in ONNX Runtime, converted for the compiler.

An ONNX file (``--model path/model.onnx``) reaches the harness in two ways:

* as given, by the backends that read ONNX, in ``fp32``, the weak modes and
  the whole-graph modes (:mod:`harness.engines.given_onnx`);
* as a PyTorch graph, for the compiler's policies (``autocast-*``, ``amp-*``,
  ``explicit``) and the CPU engine: converted with ``onnx2torch`` (the
  ``onnx-import`` extra). Before conversion the file is specialised to the
  case's input shapes and constant-folded (so shape computations become
  constants), and after it the converter's shape-taking modules whose shapes
  are now constants are replaced by plain ``reshape``/``expand``/``select``
  calls (``torch.export`` cannot trace their data-dependent Python). An op
  the converter does not cover is named, with the modes that remain
  (:class:`Conversion`).

Its accuracy reference is the file's own fp32 run in ONNX Runtime
(:func:`reference_outputs`), not a conversion of it. Its identity is the
digest of its bytes: the same file at another path is the same model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.errors import HarnessError, first_line
from harness.fileio import digest, read_regular_file
from harness.sources.inputs import InputDecl

# ONNX's protobuf limit: larger models keep their weights in external files, which are refused.
MAX_ONNX_BYTES = 2 << 30
# The highest opset onnx2torch 1.5 converts most ops at; newer files are down-converted to it
# when that makes every op convertible.
CONVERTIBLE_OPSET = 17

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnnxFile:
    """A read, checked ONNX file: its bytes, digest, declared inputs and output names."""

    path: Path
    data: bytes
    digest: str
    inputs: tuple[InputDecl, ...]
    output_names: tuple[str, ...]
    opset: int

    @property
    def where(self) -> str:
        return f"ONNX file {self.path}"


def read_onnx(path: Path) -> OnnxFile:
    """Read ``path`` as an ONNX model; anything unreadable or unsupported is one error naming it."""
    import onnx
    from google.protobuf.message import DecodeError

    data = read_regular_file(path, "ONNX file", MAX_ONNX_BYTES)
    where = f"ONNX file {path}"
    try:
        model = onnx.load_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise HarnessError(f"{where} is not an ONNX model ({first_line(exc)})") from None
    if not model.graph.node:
        raise HarnessError(f"{where} holds no graph (no nodes)")
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        model, data = _with_external_data(model, external, path, where)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise HarnessError(f"{where} is not a valid ONNX model: {first_line(exc)}") from None
    return OnnxFile(path, data, digest(data), _declared_inputs(model, where), tuple(o.name for o in model.graph.output), _opset(model))


def _with_external_data(model: Any, external: list[Any], path: Path, where: str) -> tuple[Any, bytes]:
    """The model with its external weights read in, and its bytes as one self-contained file.

    Each data file must lie in the model file's own directory (a plain file
    name, no ``..``, no absolute path), so a file cannot make the harness read
    elsewhere; the identity is then the digest of the self-contained model.
    """
    import onnx
    import onnx.external_data_helper as helper

    for tensor in external:
        location = dict((e.key, e.value) for e in tensor.external_data).get("location", "")
        if not location or Path(location).name != location or location in (".", ".."):
            raise HarnessError(
                f"{where}: tensor {tensor.name!r} keeps its data at {location!r}; external data must be a file "
                "beside the model (a plain file name)"
            )
        if not (path.parent / location).is_file():
            raise HarnessError(f"{where}: tensor {tensor.name!r} keeps its data in {location}, which does not exist beside it")
    try:
        helper.load_external_data_for_model(model, str(path.parent))
        data = model.SerializeToString()
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{where}: its external data cannot be read: {first_line(exc)}") from None
    if len(data) > MAX_ONNX_BYTES:
        raise HarnessError(f"{where}: with its external data the model exceeds ONNX's 2 GB single-file limit")
    return onnx.load_from_string(data), data


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _declared_inputs(model: Any, where: str) -> tuple[InputDecl, ...]:
    """The graph's inputs (not initializers), with dtypes, open dimensions and vocabularies."""
    import onnx

    initializers = {t.name: t for t in model.graph.initializer}
    decls = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        try:
            np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            dtype = torch.from_numpy(np.zeros(0, dtype=np_dtype)).dtype
        except (KeyError, TypeError, ValueError):
            raise HarnessError(f"{where}: input {value.name!r} has an element type the harness cannot feed") from None
        if not tensor_type.HasField("shape"):
            raise HarnessError(f"{where}: input {value.name!r} has no declared rank; give a file with input shapes")
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim)
        decls.append(InputDecl(value.name, dtype, shape, _vocabulary(model, value.name, initializers)))
    if not decls:
        raise HarnessError(f"{where}: the graph takes no inputs")
    return tuple(decls)


def _vocabulary(model: Any, name: str, initializers: dict[str, Any]) -> int | None:
    """The size of the smallest table an integer input indexes (a ``Gather`` of an initializer), if any."""
    feeds = {name}
    for node in model.graph.node:  # through a Cast or two (int32 ids cast to int64)
        if node.op_type == "Cast" and node.input and node.input[0] in feeds:
            feeds.update(node.output)
    sizes = []
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in feeds and node.input[0] in initializers:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = list(initializers[node.input[0]].dims)
            if dims:
                sizes.append(int(dims[axis]))
    return min(sizes) if sizes else None


# --- the reference: the file's own fp32 run in ONNX Runtime -------------------------------


@functools.lru_cache(maxsize=4)
def _session(data_digest: str, data: bytes) -> Any:
    del data_digest  # the cache key; the bytes are not hashed twice
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's native errors share no base class
        raise HarnessError(f"ONNX Runtime cannot load the file for its fp32 reference: {first_line(exc)}") from None


def reference_outputs(source: OnnxFile, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The file's outputs on ``inputs`` from ONNX Runtime's CPU provider, fp32 as the file is."""
    session = _session(source.digest, source.data)
    feeds = {d.name: t.detach().cpu().contiguous().numpy() for d, t in zip(source.inputs, inputs, strict=True)}
    try:
        results = session.run(None, feeds)
    except Exception as exc:  # onnxruntime's native errors share no base class
        shapes = ", ".join(f"{d.name} {tuple(t.shape)}" for d, t in zip(source.inputs, inputs, strict=True))
        raise HarnessError(
            f"{source.where}: ONNX Runtime cannot run it on inputs {shapes}: {first_line(exc)}; the shapes or "
            "values do not fit the model (see --input-shapes, --input-range)"
        ) from None
    return tuple(torch.from_numpy(r.copy()) for r in results)


# --- conversion to a PyTorch graph ----------------------------------------------------------


@dataclass(frozen=True)
class Conversion:
    """The converted module, or why there is none (``error``, naming the ops)."""

    module: torch.nn.Module | None
    error: str | None
    notes: tuple[str, ...] = ()


class Unconverted(torch.nn.Module):
    """Stands for the PyTorch graph of a file that did not convert: running it says why."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        raise HarnessError(self.reason)


class _Outputs(torch.nn.Module):
    """The converted graph, returning a bare tensor for one output and a tuple for several."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> Any:
        out = self.inner(*inputs)
        if isinstance(out, (list, tuple)):
            return out[0] if len(out) == 1 else tuple(out)
        return out


@contextlib.contextmanager
def _torchvision_stand_in() -> Iterator[None]:
    """Let ``onnx2torch`` import where ``torchvision`` does not.

    onnx2torch imports torchvision at import time for two converters only
    (NonMaxSuppression, RoiAlign). Where torchvision is missing or does not
    import (a CUDA wheel beside a CPU torch), a stand-in module is registered
    for the duration of the import, whose functions raise when called: those
    two ops then fail to run, every other op converts. ``sys.modules`` is
    left as it was found.
    """
    before = {k: v for k, v in sys.modules.items() if k == "torchvision" or k.startswith("torchvision.")}
    try:
        importlib.import_module("torchvision")
        yield
        return
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            if key not in before:
                del sys.modules[key]

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise HarnessError("this op needs torchvision, which does not import here")

    stand_in, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    ops.nms = ops.roi_align = ops.box_convert = unavailable  # type: ignore[attr-defined]
    stand_in.ops = ops  # type: ignore[attr-defined]
    sys.modules["torchvision"], sys.modules["torchvision.ops"] = stand_in, ops
    try:
        yield
    finally:
        for key in ("torchvision", "torchvision.ops"):
            if sys.modules.get(key) in (stand_in, ops):
                del sys.modules[key]


@functools.cache
def _onnx2torch() -> Any:
    from harness.extras import require

    with _torchvision_stand_in(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return require("onnx2torch", "onnx-import", "converting an ONNX file for the compiler's modes and the cpu engine")


def _unconvertible(model: Any, o2t: Any) -> list[str]:
    """``Op-version (n nodes)`` for every op onnx2torch has no converter for, by its registry."""
    import onnx

    registry = getattr(importlib.import_module("onnx2torch.node_converters.registry"), "_CONVERTER_REGISTRY", None)
    if registry is None:
        return []
    known = {(k.domain, k.operation_type, k.version) for k in registry}
    opsets = {o.domain: o.version for o in model.opset_import}
    missing: dict[str, int] = {}
    for node in model.graph.node:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        try:
            version = onnx.defs.get_schema(node.op_type, opsets.get(node.domain, opsets.get("", 1)), node.domain).since_version
        except onnx.defs.SchemaError:
            version = -1
        if (domain, node.op_type, version) not in known:
            label = f"{node.op_type}-{version}" if version >= 0 else f"{node.domain}.{node.op_type}"
            missing[label] = missing.get(label, 0) + 1
    return [f"{op} ({n} node{'s' * (n > 1)})" for op, n in sorted(missing.items())]


def _specialised(source: OnnxFile, shapes: Sequence[tuple[int, ...]]) -> Any:
    """The file with its inputs fixed to ``shapes``, constant-folded, ``Reshape(allowzero=1)`` of a
    constant shape without zeros made plain (the same reshape; onnx2torch refuses the attribute)."""
    import numpy as np
    import onnx
    import onnx.numpy_helper
    import onnx_ir as ir
    import onnxscript.optimizer

    model = onnx.load_from_string(source.data)
    inputs = [v for v in model.graph.input if v.name in {d.name for d in source.inputs}]
    for value, shape in zip(inputs, shapes, strict=True):
        for dim, size in zip(value.type.tensor_type.shape.dim, shape, strict=True):
            dim.ClearField("dim_param")
            dim.dim_value = size
    del model.graph.value_info[:]
    ir_model = ir.from_proto(model)
    with warnings.catch_warnings(), _quiet("onnxscript"):
        warnings.simplefilter("ignore")
        onnxscript.optimizer.optimize(ir_model)
    model = ir.to_proto(ir_model)
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        for attr in list(node.attribute):
            if attr.name == "allowzero" and attr.i == 1:
                if bool(np.all(onnx.numpy_helper.to_array(initializers[node.input[1]]) != 0)):
                    node.attribute.remove(attr)
    return model


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _static_calls(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> None:
    """Replace onnx2torch's shape-taking modules whose shape is now fixed by plain calls.

    ``OnnxReshape``/``OnnxExpand`` become ``reshape``/``expand`` to the shape
    they produced on ``inputs`` (the file is specialised to those shapes, so
    it is their only shape); ``OnnxGather`` of one constant index becomes
    ``select``. Each decides its shape in Python from a tensor, which
    ``torch.export`` cannot trace.
    """
    from torch.fx.passes.shape_prop import ShapeProp

    with torch.no_grad():
        ShapeProp(gm).propagate(*inputs)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        kind = type(gm.get_submodule(node.target)).__name__
        meta = node.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            continue
        shape = tuple(int(d) for d in meta.shape)
        replacement = None
        with graph.inserting_after(node):
            if kind == "OnnxReshape":
                replacement = graph.call_function(torch.reshape, (node.args[0], shape))
            elif kind == "OnnxExpand":
                replacement = graph.call_method("expand", (node.args[0], *shape))
            elif kind == "OnnxGather" and len(node.args) == 2:
                index = _constant(gm, node.args[1])
                axis = int(getattr(gm.get_submodule(node.target), "_axis", 0))
                if index is not None and index.dim() == 0:
                    replacement = graph.call_function(torch.select, (node.args[0], axis, int(index)))
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _constant(gm: torch.fx.GraphModule, arg: Any) -> torch.Tensor | None:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = gm
        for part in str(arg.target).split("."):
            value = getattr(value, part)
        return value if isinstance(value, torch.Tensor) else None
    return None


def convert(source: OnnxFile, example_inputs: Sequence[torch.Tensor], modes_left: str) -> Conversion:
    """The file as a PyTorch module for ``example_inputs``' shapes, or why not.

    ``modes_left`` says, in the error of a file that does not convert, which
    modes still run (the file as given). The module is checked against ONNX
    Runtime's outputs and traced with ``torch.export`` here, so a conversion
    that would fail later fails now, naming the op.
    """
    try:
        o2t = _onnx2torch()
    except HarnessError as exc:  # not installed: the extra, or alone beside a CPU build of torch
        hint = "with a CPU build of torch: pip install --no-deps onnx2torch"
        return Conversion(None, f"{source.where}: {exc} ({hint}); {modes_left}")
    shapes = [tuple(t.shape) for t in example_inputs]
    notes: list[str] = []
    model = _specialised(source, shapes)
    missing = _unconvertible(model, o2t)
    if missing and source.opset > CONVERTIBLE_OPSET:
        import onnx.version_converter

        try:
            older = onnx.version_converter.convert_version(model, CONVERTIBLE_OPSET)
        except Exception:  # noqa: BLE001 - the converter's failures share no type
            older = None
        if older is not None and not _unconvertible(older, o2t):
            model, missing = older, []
            notes.append(f"converted from opset {source.opset} to {CONVERTIBLE_OPSET} for onnx2torch")
    if missing:
        return Conversion(
            None,
            f"{source.where}: op(s) onnx2torch cannot convert to PyTorch: {', '.join(missing)}; {modes_left}",
        )
    try:
        with warnings.catch_warnings(), _quiet("onnx2torch"):
            warnings.simplefilter("ignore")
            gm = o2t.convert(model)
        gm.eval()
        _static_calls(gm, list(example_inputs))
        module = _Outputs(gm).eval()
        with torch.no_grad():
            converted = module(*example_inputs)
    except HarnessError:
        raise
    except Exception as exc:  # whatever a converter raises
        return Conversion(None, f"{source.where}: onnx2torch cannot convert it: {type(exc).__name__}: {first_line(exc)}; {modes_left}")
    expected = reference_outputs(source, example_inputs)
    got = converted if isinstance(converted, tuple) else (converted,)
    bad = [
        source.output_names[i]
        for i, (a, b) in enumerate(zip(got, expected, strict=False))
        if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(a.double(), b.double(), rtol=1e-3, atol=1e-4)
    ]
    if len(got) != len(expected) or bad:
        return Conversion(
            None,
            f"{source.where}: the PyTorch conversion disagrees with ONNX Runtime on output(s) "
            f"{', '.join(bad) or 'count'}; {modes_left}",
        )
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.export.export(module, tuple(example_inputs), strict=False)
    except Exception as exc:  # noqa: BLE001 - torch.export's failures share no type
        op = _failing_op(str(exc), gm)
        return Conversion(
            None,
            f"{source.where}: the converted graph does not export ({op}): {first_line(exc)}; {modes_left}",
        )
    return Conversion(module, None, tuple(notes))


def _failing_op(text: str, gm: torch.fx.GraphModule) -> str:
    """The onnx2torch module (hence the ONNX op) torch.export failed in, from its message."""
    for name, sub in gm.named_children():
        if name in text:
            return f"at node {name}, {type(sub).__name__.removeprefix('Onnx')}"
    return "op not identified"
