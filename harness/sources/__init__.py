"""Models as users hold them: ONNX files, ``torch.export`` archives, Hugging Face directories.

A reference ending in ``.onnx`` or ``.pt2``, or starting with ``hf:``, names a
model file (:func:`is_source_reference`); :func:`load_source` turns it into a
:class:`SourcedSpec`, the :class:`~harness.modelspec.ModelSpec` every stage
takes, plus what only a file has (:class:`SourceInfo`): its content digest
(the model's identity in results, caches and the gate, as a factory's
weights digest is; never its path), its declared inputs and, for an ONNX
file, the file itself and whether it converted to PyTorch.

| source | module (compiler, cpu engine, peers) | ONNX backends | accuracy reference |
|---|---|---|---|
| ``.onnx`` | onnx2torch conversion | the file as given (fp32, weak, fp16/bf16), else the conversion | the file in ONNX Runtime, fp32 |
| ``.pt2`` | the archive's program | the program, exported | the program, eager fp32 |
| ``hf:DIR`` | ``transformers`` from the directory | the model, exported | the model, eager fp32 |

Inputs are shaped and filled by :class:`~harness.sources.inputs.InputOptions`.
Specs are built once per (file state, batch size, options) and each call gets
a private copy, as :func:`harness.models.load` hands them out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.errors import HarnessError
from harness.fileio import shown
from harness.modelspec import ModelSpec
from harness.sources.inputs import (
    NO_OPTIONS,
    InputDecl,
    InputOptions,
    batch_dimension,
    example_and_calibration,
)
from harness.sources.onnx_file import OnnxFile

HF_PREFIX = "hf:"
SUFFIXES = (".onnx", ".pt2")
# The backends that read ONNX files: they take an ONNX model's file as given where the mode allows.
ONNX_BACKENDS = frozenset({"onnxruntime", "openvino", "tensorrt"})


def is_source_reference(ref: str) -> bool:
    """Whether ``ref`` names a model file (``x.onnx``, ``x.pt2``, ``hf:DIR``), not a zoo name or factory."""
    return ref.startswith(HF_PREFIX) or ref.lower().endswith(SUFFIXES)


@dataclass(frozen=True, eq=False)
class SourceInfo:
    """What a model file adds to its spec (see the module docstring)."""

    kind: str  # "onnx", "pt2" or "hf"
    path: Path
    digest: str
    inputs: tuple[InputDecl, ...]
    options: InputOptions
    onnx: OnnxFile | None = None
    conversion_error: str | None = None  # why the ONNX file has no PyTorch graph
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """What the results record about the model file (its name, not its path)."""
        return {
            "kind": self.kind,
            "file": self.path.name,
            "digest": self.digest,
            "inputs": [d.describe() for d in self.inputs],
            "input_options": self.options.to_json(),
            "converted": self.conversion_error is None,
        }


@dataclass(frozen=True, eq=False)
class SourcedSpec(ModelSpec):
    """A :class:`ModelSpec` loaded from a model file; ``source`` says which and how."""

    source: SourceInfo | None = field(default=None)


def source_of(spec: Any) -> SourceInfo | None:
    source = getattr(spec, "source", None)
    return source if isinstance(source, SourceInfo) else None


def model_identity(spec: Any) -> str:
    """The digest results store as the model's weights digest: a file's content digest, else the
    module's weights (:func:`harness.weights.module_weights_digest`)."""
    source = source_of(spec)
    if source is not None:
        return source.digest
    from harness.weights import module_weights_digest

    return module_weights_digest(spec.module)


def reference_outputs(spec: Any) -> Any | None:
    """The accuracy reference of an ONNX file's spec (its fp32 run in ONNX Runtime, a bare tensor
    for one output), None for any other spec (whose eager module is the reference)."""
    source = source_of(spec)
    if source is None or source.onnx is None:
        return None
    from harness.sources.onnx_file import reference_outputs as ort_outputs

    outputs = ort_outputs(source.onnx, spec.example_inputs)
    return outputs[0] if len(outputs) == 1 else outputs


def load_source(ref: str, batch_size: int | None = None, options: InputOptions = NO_OPTIONS) -> SourcedSpec:
    """The spec of the model file ``ref`` at ``batch_size`` (its own batch when None), a private copy."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise HarnessError(f"batch size {batch_size!r}: expected a positive integer")
    path = _path(ref)
    try:
        stat = path.stat()
    except OSError as exc:
        raise HarnessError(f"model {shown(ref)}: {exc.strerror or exc}") from None
    # An edited file (another mtime or size) is read again.
    key = (ref, str(path.resolve()), stat.st_mtime_ns, stat.st_size, batch_size, options.key())
    spec = _BUILT.get(key)
    if spec is None:
        with torch.inference_mode(False):
            spec = _built(ref, batch_size, options)
        _BUILT[key] = spec
        while len(_BUILT) > _BUILT_KEPT:
            _BUILT.pop(next(iter(_BUILT)))
    with torch.inference_mode(False):
        return copy.deepcopy(spec)


_BUILT: dict[tuple[Any, ...], SourcedSpec] = {}
_BUILT_KEPT = 32


def _path(ref: str) -> Path:
    text = ref[len(HF_PREFIX):] if ref.startswith(HF_PREFIX) else ref
    if not text:
        raise HarnessError(f"model {shown(ref)}: no path; expected path/model.onnx, path/model.pt2 or hf:path/to/dir")
    path = Path(text).expanduser()
    if not path.exists():
        what = "directory" if ref.startswith(HF_PREFIX) else "file"
        raise HarnessError(f"model {shown(ref)}: no such {what}")
    return path


def _built(ref: str, batch: int | None, options: InputOptions) -> SourcedSpec:
    path = _path(ref)
    if ref.startswith(HF_PREFIX):
        return _from_hf(path, batch, options)
    if ref.lower().endswith(".pt2"):
        return _from_pt2(path, batch, options)
    return _from_onnx(path, batch, options)


def _culprit(kind: str, path: Path) -> str:
    return {"onnx": "ONNX file", "pt2": "torch.export archive", "hf": "Hugging Face directory"}[kind] + f" {path}"


def _inputs(
    decls: tuple[InputDecl, ...], options: InputOptions, culprit: str, batch: int | None
) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]], int | None]:
    dim = batch_dimension(decls)
    if batch is not None and dim is None:
        raise HarnessError(
            f"{culprit} has no batch dimension to sweep (its inputs' leading dimensions are fixed: "
            f"{', '.join(d.describe() for d in decls)})"
        )
    example, calibration = example_and_calibration(decls, options, culprit, batch)
    return example, calibration, dim


MODES_AS_GIVEN = (
    "the file as given still runs in fp32, the weak modes (weak-fp16, weak-bf16) and the whole-graph modes "
    "(fp16, bf16) on the backends that read ONNX (onnxruntime, openvino, tensorrt), each where that backend "
    "builds the mode; the cpu backend and the modes autocast-*, amp-*, explicit need the conversion"
)


def _from_onnx(path: Path, batch: int | None, options: InputOptions) -> SourcedSpec:
    from harness.sources.onnx_file import Unconverted, convert, read_onnx

    source = read_onnx(path)
    example, calibration, dim = _inputs(source.inputs, options, source.where, batch)
    conversion = convert(source, example, MODES_AS_GIVEN)
    module = conversion.module if conversion.module is not None else Unconverted(conversion.error or "")
    info = SourceInfo("onnx", path, source.digest, source.inputs, options, source, conversion.error, conversion.notes)
    return SourcedSpec(
        name=_name(path),
        description=f"ONNX file {path.name} (opset {source.opset})",
        module=module,
        example_inputs=example,
        calibration_data=calibration,
        batch_dim=dim,
        source=info,
    )


def _from_pt2(path: Path, batch: int | None, options: InputOptions) -> SourcedSpec:
    from harness.sources.pt2 import read_pt2

    archive = read_pt2(path)
    if not options.given and batch is None and archive.example_inputs:
        example: tuple[torch.Tensor, ...] = archive.example_inputs
        _, calibration, dim = _inputs(archive.inputs, _shapes_of(archive.inputs, example), archive.where, None)
    else:
        example, calibration, dim = _inputs(archive.inputs, options, archive.where, batch)
    module = archive.program.module()
    _check_runs(module, example, archive.where)
    info = SourceInfo("pt2", path, archive.digest, archive.inputs, options)
    return SourcedSpec(
        name=_name(path),
        description=f"torch.export archive {path.name}",
        module=module,
        example_inputs=example,
        calibration_data=calibration,
        batch_dim=dim,
        source=info,
    )


def _shapes_of(decls: tuple[InputDecl, ...], example: tuple[torch.Tensor, ...]) -> InputOptions:
    """Options fixing each input to its example's shape (calibration batches shaped like the examples)."""
    return InputOptions(shapes={d.name: tuple(t.shape) for d, t in zip(decls, example, strict=True)})


class _Keywords(torch.nn.Module):
    """A model whose inputs are fed by name: positional inputs in the declared order become keywords."""

    def __init__(self, inner: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.inner = inner
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.inner(**dict(zip(self.names, inputs, strict=True)))


def _from_hf(path: Path, batch: int | None, options: InputOptions) -> SourcedSpec:
    from harness.sources.hf import read_hf

    checkpoint = read_hf(path)
    example, calibration, dim = _inputs(checkpoint.inputs, options, checkpoint.where, batch)
    module = _Keywords(checkpoint.module, tuple(d.name for d in checkpoint.inputs)).eval()
    _check_runs(module, example, checkpoint.where)
    info = SourceInfo("hf", path, checkpoint.digest, checkpoint.inputs, options)
    return SourcedSpec(
        name=_name(path),
        description=f"transformers {checkpoint.architecture} from {path.name}",
        module=module,
        example_inputs=example,
        calibration_data=calibration,
        batch_dim=dim,
        source=info,
    )


def _check_runs(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], where: str) -> None:
    """Run the model once on its inputs: shapes that do not fit are named here, not in an export trace."""
    from harness.errors import first_line
    from harness.globalstate import preserved_global_state

    try:
        with preserved_global_state(), torch.no_grad():
            module(*inputs)
    except HarnessError:
        raise
    except Exception as exc:  # whatever the model raises on inputs that do not fit it
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
        raise HarnessError(f"{where}: the model fails on inputs {shapes}: {type(exc).__name__}: {first_line(exc)}") from None


def _name(path: Path) -> str:
    """A model file's name in results: the file's stem or the directory's name (never its path)."""
    name = path.resolve().name
    return name.rsplit(".", 1)[0] if path.is_file() and "." in name else name


# --- building from the file as given --------------------------------------------------------


def route(spec: Any, backend: str, mode: str) -> str:
    """How ``spec`` reaches ``backend`` in ``mode``: "given" (the ONNX file), "lowered" (the file in the
    mode's low precision), or "graph" (the compiler's typed graph of the module)."""
    from harness.precision import PrecisionMode

    source = source_of(spec)
    if source is None or source.onnx is None or backend not in ONNX_BACKENDS:
        return "graph"
    policy = PrecisionMode.parse(mode).policy
    return {"fp32": "given", "full": "lowered"}.get(policy, "graph")


__all__ = [
    "InputOptions",
    "SourceInfo",
    "SourcedSpec",
    "is_source_reference",
    "load_source",
    "model_identity",
    "reference_outputs",
    "route",
    "source_of",
]
