"""The inputs a model file is benchmarked on: declared, shaped, generated or loaded.

A model file (ONNX, ``torch.export`` archive, Hugging Face directory) declares
its inputs (:class:`InputDecl`: a name, a dtype and a shape whose dimensions
may be unknown until run time); the user says what the unknown ones are and
what the values look like (:class:`InputOptions`, from ``harness bench``'s
flags or a model's table in the project file):

* ``--input-shapes name:1x3x224x224,...`` as trtexec's ``--shapes``: the
  shape of each named input, which must keep every dimension the file fixes;
* ``--input-range "[name=]uniform(a,b);..."``: the distribution generated
  values are drawn from (``uniform(a,b)``: floats in [a, b), integers in
  a..b-1; ``normal(mean,std)``: floats only). Without it floating inputs are
  uniform in [-1, 1) and integer inputs are drawn below the vocabulary the
  model declares (:attr:`InputDecl.vocabulary`), else all ones (masks);
* ``--load-inputs FILE``: real inputs, by name, from an ``.npz`` file (read
  with ``allow_pickle=False``) or a safetensors file, as Polygraphy's
  ``--load-inputs`` takes them.

Generated values come from a local generator seeded with a fixed seed (the
example inputs with seed 0, calibration batch ``k`` with ``k + 1``), so every
process benchmarks the same inputs and no global random state is touched.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.dtypes import dtype_label
from harness.errors import HarnessError, first_line
from harness.fileio import shown
from harness.limits import MAX_BATCH_SIZE

# Elements of one generated or loaded input: a 4096 x 3 x 224 x 224 fp32 batch is 2.4 GB.
MAX_INPUT_ELEMENTS = MAX_BATCH_SIZE * 3 * 224 * 224
# Bytes of an inputs file (its arrays are read whole).
MAX_INPUTS_FILE_BYTES = 4 << 30
CALIBRATION_BATCHES = 4
_NAME = r"[A-Za-z0-9_.:/\-]+"


@dataclass(frozen=True)
class InputDecl:
    """One input as a model file declares it.

    ``shape`` holds None for a dimension the file leaves open (a dynamic axis);
    ``vocabulary`` is, for an integer input that indexes a table (token ids),
    the table's size: generated ids stay below it.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int | None, ...]
    vocabulary: int | None = None

    def describe(self) -> str:
        dims = "x".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name} ({dtype_label(self.dtype)} {dims or 'scalar'})"


@dataclass(frozen=True)
class Distribution:
    """What generated values are drawn from: ``uniform(low, high)`` or ``normal(mean, std)``."""

    kind: str
    a: float
    b: float

    def describe(self) -> str:
        return f"{self.kind}({self.a:g},{self.b:g})"


@dataclass(frozen=True)
class InputOptions:
    """How a model file's inputs are shaped and filled (all empty: the file's own, generated)."""

    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # input name ("" for every input without its own) -> distribution
    ranges: Mapping[str, Distribution] = field(default_factory=dict)
    load: Path | None = None

    @property
    def given(self) -> bool:
        return bool(self.shapes or self.ranges or self.load is not None)

    def key(self) -> tuple[Any, ...]:
        """A hashable identity (for caches of loaded models)."""
        return (
            tuple(sorted(self.shapes.items())),
            tuple(sorted((k, v.kind, v.a, v.b) for k, v in self.ranges.items())),
            None if self.load is None else str(self.load.resolve()),
        )

    def to_json(self) -> dict[str, Any]:
        """What the results record (the file by name: its values are the inputs' digest's business)."""
        return {
            "shapes": {k: list(v) for k, v in sorted(self.shapes.items())},
            "ranges": {k or "*": v.describe() for k, v in sorted(self.ranges.items())},
            "load": None if self.load is None else self.load.name,
        }


NO_OPTIONS = InputOptions()


def parse_input_shapes(text: str, where: str = "--input-shapes") -> dict[str, tuple[int, ...]]:
    """``name:1x3x224x224,name2:1x128`` (trtexec's ``--shapes``) as {name: shape}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(rf"({_NAME})\s*:\s*(\d+(?:\s*x\s*\d+)*|scalar)", part)
        if not match:
            raise HarnessError(
                f"{where} {shown(text)}: {shown(part) if part else 'an empty entry'} is not NAME:DIMxDIMx...; "
                "e.g. pixel_values:1x3x224x224,input_ids:1x128"
            )
        name, dims = match.group(1), match.group(2)
        shape = () if dims == "scalar" else tuple(int(d) for d in re.split(r"\s*x\s*", dims))
        if any(d < 1 for d in shape):
            raise HarnessError(f"{where} {shown(text)}: input {name!r} has a dimension below 1")
        if math.prod(shape) > MAX_INPUT_ELEMENTS:
            raise HarnessError(f"{where} {shown(text)}: input {name!r} would hold more than {MAX_INPUT_ELEMENTS} elements")
        if name in shapes:
            raise HarnessError(f"{where} {shown(text)}: input {name!r} is given twice")
        shapes[name] = shape
    return shapes


def parse_input_ranges(text: str, where: str = "--input-range") -> dict[str, Distribution]:
    """``[name=]uniform(a,b);[name=]normal(mean,std);...`` as {name or "": distribution}."""
    ranges: dict[str, Distribution] = {}
    for part in (p.strip() for p in text.split(";")):
        match = re.fullmatch(rf"(?:({_NAME})\s*=\s*)?(uniform|normal)\(\s*([^,()]+?)\s*,\s*([^,()]+?)\s*\)", part)
        if not match:
            raise HarnessError(
                f"{where} {shown(text)}: {shown(part) if part else 'an empty entry'} is not [NAME=]uniform(LOW,HIGH) "
                "or [NAME=]normal(MEAN,STD); separate entries with ';'"
            )
        name, kind = match.group(1) or "", match.group(2)
        try:
            a, b = float(match.group(3)), float(match.group(4))
        except ValueError:
            raise HarnessError(f"{where} {shown(part)}: the bounds must be numbers") from None
        if not (math.isfinite(a) and math.isfinite(b)):
            raise HarnessError(f"{where} {shown(part)}: the bounds must be finite")
        if kind == "uniform" and not a < b:
            raise HarnessError(f"{where} {shown(part)}: uniform(LOW,HIGH) needs LOW < HIGH")
        if kind == "normal" and not b > 0:
            raise HarnessError(f"{where} {shown(part)}: normal(MEAN,STD) needs STD > 0")
        if name in ranges:
            raise HarnessError(f"{where} {shown(text)}: {'input ' + repr(name) if name else 'the default'} is given twice")
        ranges[name] = Distribution(kind, a, b)
    return ranges


def input_options(
    shapes: str | None = None, ranges: str | None = None, load: str | None = None, *, where: str = ""
) -> InputOptions:
    """Options from the flags' (or a project table's) texts; ``where`` prefixes the names in errors."""
    prefix = f"{where}: " if where else ""
    path = None
    if load is not None:
        path = Path(load).expanduser()
        if path.suffix not in (".npz", ".safetensors"):
            raise HarnessError(f"{prefix}--load-inputs {shown(load)}: expected an .npz or .safetensors file")
        if not path.is_file():
            raise HarnessError(f"{prefix}--load-inputs {shown(load)}: {'not a regular file' if path.exists() else 'no such file'}")
    return InputOptions(
        shapes=parse_input_shapes(shapes, f"{prefix}--input-shapes") if shapes is not None else {},
        ranges=parse_input_ranges(ranges, f"{prefix}--input-range") if ranges is not None else {},
        load=path,
    )


def read_input_file(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` (no pickles) or safetensors file, by name; a bad file is one error naming it."""
    size = path.stat().st_size
    if size > MAX_INPUTS_FILE_BYTES:
        raise HarnessError(f"inputs file {path}: {size} bytes, more than the {MAX_INPUTS_FILE_BYTES} read")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: np.asarray(archive[name]) for name in archive.files}
        from safetensors.numpy import load_file

        return dict(load_file(str(path)))
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise HarnessError(f"inputs file {path} cannot be read: {first_line(exc)}") from None
    except Exception as exc:  # safetensors raises its own SafetensorError for a damaged header
        raise HarnessError(f"inputs file {path} cannot be read: {type(exc).__name__}: {first_line(exc)}") from None


def resolve_shapes(decls: Sequence[InputDecl], options: InputOptions, culprit: str, batch: int | None = None) -> list[tuple[int, ...]]:
    """The shape of each input: ``--input-shapes``, else the file's, with an open leading
    dimension (the batch) set to ``batch`` (1 when None); any other open one needs the flag."""
    names = [d.name for d in decls]
    unknown = sorted(set(options.shapes) - set(names))
    if unknown:
        raise HarnessError(
            f"--input-shapes names {', '.join(repr(n) for n in unknown)}, which {culprit} does not take; "
            f"its inputs: {', '.join(d.describe() for d in decls)}"
        )
    shapes = []
    for decl in decls:
        given = options.shapes.get(decl.name)
        if given is not None:
            check_shape(decl, given, culprit, "--input-shapes")
            shape = given
        else:
            open_dims = [i for i, d in enumerate(decl.shape) if d is None]
            if any(i != 0 for i in open_dims):
                raise HarnessError(
                    f"{culprit}: input {decl.describe()} has open dimensions besides the batch; give its shape "
                    f"with --input-shapes {decl.name}:" + "x".join("N" if d is None else str(d) for d in decl.shape)
                )
            shape = tuple((batch or 1) if d is None else d for d in decl.shape)
        if batch is not None and shape and decl.shape and decl.shape[0] is None:
            shape = (batch, *shape[1:])
        shapes.append(shape)
    return shapes


def check_shape(decl: InputDecl, shape: Sequence[int], culprit: str, source: str) -> None:
    """Refuse a shape of another rank, or one that changes a dimension the file fixes."""
    if len(shape) != len(decl.shape) or any(d is not None and d != s for d, s in zip(decl.shape, shape, strict=True)):
        raise HarnessError(
            f"{source}: shape {'x'.join(map(str, shape)) or 'scalar'} does not fit input {decl.describe()} of {culprit}"
        )


def generated(decl: InputDecl, shape: tuple[int, ...], options: InputOptions, seed: int) -> torch.Tensor:
    """One input of ``shape`` drawn from its distribution with a generator seeded with ``seed``."""
    rng = np.random.default_rng([seed, _stable(decl.name)])
    dist = options.ranges.get(decl.name) or options.ranges.get("")
    if decl.dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(bool))
    if decl.dtype.is_floating_point:
        dist = dist or Distribution("uniform", -1.0, 1.0)
        if dist.kind == "uniform":
            values = rng.uniform(dist.a, dist.b, size=shape)
        else:
            values = rng.normal(dist.a, dist.b, size=shape)
        return torch.from_numpy(values.astype(np.float32)).to(decl.dtype)
    if dist is not None and dist.kind == "normal":
        raise HarnessError(f"--input-range: input {decl.describe()} is an integer input; give it uniform(LOW,HIGH)")
    if dist is not None:
        low, high = math.ceil(dist.a), math.ceil(dist.b)
        if low >= high:
            raise HarnessError(f"--input-range {dist.describe()}: no integer lies in it for input {decl.describe()}")
        ints = rng.integers(low, high, size=shape)
    elif decl.vocabulary is not None:
        ints = rng.integers(0, decl.vocabulary, size=shape)
    else:
        ints = np.ones(shape, dtype=np.int64)
    return torch.from_numpy(ints.astype(np.int64)).to(decl.dtype)


def _stable(name: str) -> int:
    """A per-input seed part that is the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little")


def example_and_calibration(
    decls: Sequence[InputDecl], options: InputOptions, culprit: str, batch: int | None = None
) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
    """The example inputs (loaded, or generated with seed 0) and the calibration batches (seeds 1..)."""
    if options.load is not None:
        example = loaded_inputs(decls, options, culprit, batch)
        shapes = [tuple(t.shape) for t in example]
    else:
        shapes = resolve_shapes(decls, options, culprit, batch)
        example = tuple(generated(d, s, options, 0) for d, s in zip(decls, shapes, strict=True))
    calibration = [
        tuple(generated(d, s, options, k + 1) for d, s in zip(decls, shapes, strict=True))
        for k in range(CALIBRATION_BATCHES)
    ]
    return example, calibration


def loaded_inputs(
    decls: Sequence[InputDecl], options: InputOptions, culprit: str, batch: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The inputs of ``--load-inputs``, by name, checked against the declarations (and resized
    along an open leading dimension to ``batch``, repeating the rows as a batch sweep does)."""
    assert options.load is not None
    arrays = read_input_file(options.load)
    names = [d.name for d in decls]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise HarnessError(
            f"inputs file {options.load} lacks input(s) {', '.join(map(repr, missing))} of {culprit} "
            f"(it holds {', '.join(map(repr, sorted(arrays))) or 'nothing'})"
        )
    out = []
    for decl in decls:
        array = arrays[decl.name]
        if array.dtype.kind not in "biuf":
            raise HarnessError(f"inputs file {options.load}: array {decl.name!r} has dtype {array.dtype}, not a number")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if tensor.dtype != decl.dtype:
            same_kind = tensor.dtype.is_floating_point == decl.dtype.is_floating_point and decl.dtype != torch.bool
            if not same_kind:
                raise HarnessError(
                    f"inputs file {options.load}: array {decl.name!r} is {array.dtype}; input {decl.describe()} "
                    "takes another kind of number"
                )
            tensor = tensor.to(decl.dtype)
        check_shape(decl, tuple(tensor.shape), culprit, f"inputs file {options.load}: array {decl.name!r}")
        if batch is not None and decl.shape and decl.shape[0] is None and tensor.shape[0] != batch:
            reps = -(-batch // tensor.shape[0])
            tensor = torch.cat([tensor] * reps).narrow(0, 0, batch).contiguous()
        out.append(tensor)
    if options.shapes:
        for decl, tensor in zip(decls, out, strict=True):
            given = options.shapes.get(decl.name)
            if given is not None and tuple(tensor.shape) != given:
                raise HarnessError(
                    f"--input-shapes {decl.name}:{'x'.join(map(str, given))} disagrees with inputs file "
                    f"{options.load} (shape {'x'.join(map(str, tensor.shape))})"
                )
    return tuple(out)


def batch_dimension(decls: Sequence[InputDecl]) -> int | None:
    """0 when every input's leading dimension is open (a dynamic batch axis), else None."""
    if decls and all(d.shape and d.shape[0] is None for d in decls):
        return 0
    return None
