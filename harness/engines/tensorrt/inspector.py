"""Per-layer facts of a built TensorRT engine, from the engine inspector's JSON.

The engine must be built with ``ProfilingVerbosity.DETAILED``; otherwise the
inspector lists bare layer names. Two layouts exist:

* TensorRT 10.x: top-level ``"Bindings"`` (list of names); each layer tensor
  has one ``"Format/Datatype"`` string such as
  ``"Row major linear FP16 format"`` (or just ``"Half"`` for Myelin layers).
* TensorRT 11.x: ``"Bindings"`` is replaced by ``"I/O Tensors"`` (objects
  with ``Name``, ``IOMode``, ``DataType``, ...), and the tensor field
  ``"Format/Datatype"`` is split into ``"Format"`` and a data type field.
  NVIDIA's own parser (trt-samples-for-hackathon-cn, tensorrt_cookbook
  ``get_engine_tensor_info``) reads the split field as ``"Datatype"`` while
  the ``I/O Tensors`` objects spell it ``"DataType"``; both are accepted.

Data types are normalised to the harness's names ("FP16", "Half" -> "fp16",
:mod:`harness.dtypes`) so layers compare across layouts and with the other
engines; formats are kept as TensorRT wrote them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from harness.cache.timing_cache import CacheEntry, normalize_hash
from harness.dtypes import dtype_name
from harness.engines.protocol import BatchProfile
from harness.engines.tensorrt.log_parser import log_lines, onnx_layers
from harness.engines.tensorrt.versions import TrtApi, load_tensorrt
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest, parse_json

if TYPE_CHECKING:
    import tensorrt

Layout = Literal["10.x", "11.x"]

# TensorRT's spellings (lower-cased) -> torch dtypes; types torch has no dtype for keep TensorRT's name.
_DTYPES: dict[str, torch.dtype | str] = {
    "float": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "half": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "double": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "fp8": "fp8",
    "fp4": "fp4",
    "int4": "int4",
    "e8m0": "e8m0",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # harness.dtypes name, or TensorRT's for types torch has not ("fp8")
    format: str
    dimensions: tuple[int, ...]


@dataclass(frozen=True)
class InspectedLayer:
    """One engine layer. ``tactic_value`` is absent on Myelin layers (every layer on 11.x).

    ``onnx_layers`` are the ONNX nodes of its ``Metadata`` (``[ONNX Layer: a][ONNX Layer: b]``),
    which is what joins it to the build log's autotuned ops.
    """

    name: str
    layer_type: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    tactic_name: str | None
    tactic_value: str | None
    onnx_layers: tuple[str, ...] = ()

    @property
    def input_dtypes(self) -> tuple[str, ...]:
        return tuple(t.dtype for t in self.inputs)

    @property
    def output_dtypes(self) -> tuple[str, ...]:
        return tuple(t.dtype for t in self.outputs)


@dataclass(frozen=True)
class EngineInformation:
    layout: Layout
    layers: tuple[InspectedLayer, ...]
    io_tensors: tuple[str, ...]


_ENUM_MEMBER = re.compile(r"k[A-Z0-9_]+")


def _canonical_dtype(text: str) -> str:
    """"FP16", "Half", and the enum spellings "kHALF", "DataType.HALF" -> "fp16"; an
    unknown spelling is kept as written. TensorRT 11.0 writes the DataType names ("Float",
    "Int32") in a layer tensor's ``Datatype``; the other spellings are read alike."""
    word = text.strip().rsplit("::", 1)[-1].rsplit(".", 1)[-1]
    if _ENUM_MEMBER.fullmatch(word):
        word = word[1:]
    dtype = _DTYPES.get(word.lower(), text.strip())
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype


def _dtype_from_combined(text: str) -> str:
    # "Row major linear FP16 format" / "Channel major BFloat16 format where ..." -> the word
    # before "format"; Myelin tensors just say "Half" or "Float".
    words = text.replace(".", "").split()
    if "format" in words[1:]:
        return _canonical_dtype(words[words.index("format", 1) - 1])
    return _canonical_dtype(words[-1]) if words else ""


def _tensor(obj: Any, where: str) -> TensorInfo:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("Name"), str):
        raise HarnessError(f"{where}: tensor entry without a Name: {obj!r}")
    dims = tuple(_dim(d, f"{where}: tensor {obj['Name']!r}") for d in _list(obj, "Dimensions", where))
    if "Format/Datatype" in obj:
        combined = str(obj["Format/Datatype"])
        return TensorInfo(obj["Name"], _dtype_from_combined(combined), combined, dims)
    dtype = obj.get("Datatype", obj.get("DataType"))
    if dtype is None:
        raise HarnessError(
            f"{where}: tensor {obj['Name']!r} has neither 'Format/Datatype' (10.x) nor "
            "'Datatype'/'DataType' (11.x)"
        )
    return TensorInfo(obj["Name"], _canonical_dtype(str(dtype)), str(obj.get("Format", "")), dims)


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    """``obj[key]`` as a list (absent: empty); anything else is refused, naming the field."""
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise HarnessError(f"{where}: {key!r} must be a list, not {type(value).__name__}")
    return value


_MAX_DIM_DIGITS = 19  # a dimension is an int64 in TensorRT


def _dim(value: Any, where: str) -> int:
    """A tensor dimension: an integer (-1 for a dynamic one), as a number or a numeral."""
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)) or len(text.lstrip("-")) > _MAX_DIM_DIGITS:
        raise HarnessError(f"{where}: dimension {text[:30]!r} is not an integer TensorRT can hold")
    try:
        return int(text)
    except ValueError:
        raise HarnessError(f"{where}: dimension {text[:30]!r} is not an integer") from None


def _layer(obj: Any, where: str) -> InspectedLayer:
    if isinstance(obj, str):
        raise HarnessError(
            f"{where}: layers are bare names; rebuild the engine with "
            "config.profiling_verbosity = ProfilingVerbosity.DETAILED"
        )
    if not isinstance(obj, Mapping) or not isinstance(obj.get("Name"), str):
        raise HarnessError(f"{where}: layer entry without a Name")
    here = f"{where}: layer {obj['Name']!r}"
    tactic_name = obj.get("TacticName")
    tactic_value = obj.get("TacticValue")
    return InspectedLayer(
        name=obj["Name"],
        layer_type=str(obj.get("LayerType", "")),
        inputs=tuple(_tensor(t, here) for t in _list(obj, "Inputs", here)),
        outputs=tuple(_tensor(t, here) for t in _list(obj, "Outputs", here)),
        tactic_name=str(tactic_name) if tactic_name else None,
        tactic_value=None if tactic_value is None else str(tactic_value),
        onnx_layers=onnx_layers(str(obj.get("Metadata") or "")),
    )


def _layout(obj: Mapping[str, Any], raw_layers: list[Any]) -> Layout:
    if "I/O Tensors" in obj:
        return "11.x"
    if "Bindings" in obj:
        return "10.x"
    # Single-layer output (get_layer_information) has neither key: look at the tensors.
    for raw in raw_layers:
        for tensor in [*raw.get("Inputs", []), *raw.get("Outputs", [])]:
            return "10.x" if "Format/Datatype" in tensor else "11.x"
    raise HarnessError(
        "engine information: cannot tell the inspector layout (no Bindings, I/O Tensors or tensors)"
    )


def parse_engine_information(
    data: str | Mapping[str, Any], where: str = "engine information"
) -> EngineInformation:
    """Parse ``get_engine_information(LayerInformationFormat.JSON)`` output of either layout."""
    if isinstance(data, str):
        data = parse_json(data, where)  # the one reader: bounded depth and integers, no NaN
    if not isinstance(data, Mapping) or not isinstance(data.get("Layers"), list):
        raise HarnessError(f"{where}: expected an object with a 'Layers' list")
    raw_layers = data["Layers"]
    layers = tuple(_layer(item, where) for item in raw_layers)
    layout = _layout(data, raw_layers)
    # 10.x lists I/O names; 11.x lists objects that carry the name.
    io_raw = data.get("I/O Tensors", data.get("Bindings", []))
    if not isinstance(io_raw, list):
        raise HarnessError(f"{where}: 'I/O Tensors' / 'Bindings' must be a list")
    names = [t.get("Name") if isinstance(t, Mapping) else t for t in io_raw]
    io_tensors = tuple(name for name in names if isinstance(name, str))
    if len(io_tensors) != len(names):
        raise HarnessError(f"{where}: I/O tensor entries must be names or objects with a Name")
    return EngineInformation(layout, layers, io_tensors)


# ONELINE layer information (trtexec --dumpLayerInfo, LayerInformationFormat.ONELINE), one
# layer a line: "Name: N, LayerType: T, Inputs: [ { Name: a, Location: Device, Dimensions:
# [1,3], Format/Datatype: Half }], Outputs: [...], ..., TacticName: K, TacticValue: 0x..,
# StreamId: 0, Metadata: [ONNX Layer: ...]". TensorRT 11 lists the layer's weights in a
# "Constants: [...]" field between Inputs and Outputs; they are no inputs of the layer, so
# they are skipped, as the JSON's "Constants" are. Tensors hold no braces, so "{[^{}]*}" is one.
_TENSOR_ITEMS = r"(?:\s*\{[^{}]*\},?)*"
_ONELINE = re.compile(
    rf"Name: (?P<name>.*?), LayerType: (?P<type>[^,]*), Inputs: \[(?P<inputs>{_TENSOR_ITEMS})\s*\]"
    rf"(?:, Constants: \[{_TENSOR_ITEMS}\s*\])?"
    rf", Outputs: \[(?P<outputs>{_TENSOR_ITEMS})\s*\]"
)
_ONELINE_TENSOR = re.compile(
    r"\{ Name: (?P<name>.*?), (?:Location: \w+, )?Dimensions: \[(?P<dims>[^\]]*)\], (?P<rest>[^{}]*?) \}"
)
_ONELINE_FIELD = re.compile(r"(?P<field>Format/Datatype|Format|Datatype|DataType): (?P<value>[^,]*)")
_ONELINE_TACTIC = re.compile(r", TacticName: (?P<name>[^,]*)")
_ONELINE_VALUE = re.compile(r", TacticValue: (?P<value>0x[0-9a-fA-F]+)")
_ONELINE_METADATA = re.compile(r", Metadata: (?P<meta>.*)$")


def _oneline_tensors(text: str, where: str) -> list[dict[str, Any]]:
    tensors = []
    for match in _ONELINE_TENSOR.finditer(text):
        dims = [_dim(d, f"{where}: tensor {match['name']!r}") for d in match["dims"].split(",") if d.strip()]
        fields = {m["field"]: m["value"].strip() for m in _ONELINE_FIELD.finditer(match["rest"])}
        tensors.append({"Name": match["name"], "Dimensions": dims, **fields})
    return tensors


def oneline_document(text: str, where: str) -> dict[str, Any]:
    """The ONELINE lines of ``text`` as the JSON document they abbreviate."""
    layers: list[dict[str, Any]] = []
    for line in log_lines(text):
        match = _ONELINE.search(line)
        if match is None:
            continue
        tail = line[match.end() :]
        tactic = _ONELINE_TACTIC.search(tail)
        value = _ONELINE_VALUE.search(tail)
        metadata = _ONELINE_METADATA.search(tail)
        layers.append(
            {
                "Name": match["name"],
                "LayerType": match["type"].strip(),
                "Inputs": _oneline_tensors(match["inputs"], where),
                "Outputs": _oneline_tensors(match["outputs"], where),
                **({"TacticName": tactic["name"].strip()} if tactic else {}),
                **({"TacticValue": value["value"]} if value else {}),
                "Metadata": metadata["meta"] if metadata else "",
            }
        )
    if not layers:
        raise HarnessError(
            f"{where}: neither inspector JSON nor ONELINE layer lines ('Name: ..., LayerType: ...'); "
            "give trtexec's --exportLayerInfo file or a log of --dumpLayerInfo, with "
            "--profilingVerbosity=detailed"
        )
    return {"Layers": layers}


def read_engine_information(text: str, where: str) -> EngineInformation:
    """Inspector output as JSON (either layout) or as ONELINE lines, e.g. inside a build log."""
    if text.lstrip().startswith("{"):
        return parse_engine_information(text, where)
    return parse_engine_information(oneline_document(text, where), where)


def engine_information_json(engine: tensorrt.ICudaEngine, trt_module: TrtApi | None = None) -> str:
    """The inspector's JSON for a whole engine (thin call into TensorRT)."""
    trt = load_tensorrt(trt_module)
    inspector = engine.create_engine_inspector()
    information: str = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    return information


def trt_fingerprint(
    layers: Iterable[InspectedLayer],
    cache_entries: Iterable[CacheEntry],
    compiler_settings: str | None = None,
    batch_profile: BatchProfile | None = None,
    interface: Mapping[str, Any] | None = None,
) -> str:
    """Digest of the tactic decisions: per-key tactic hashes and per-layer tactic names.

    Never plan or cache bytes: those differ between two GPUs of the same model
    even when every decision is identical. Both lists are sorted, so the order
    in which the inspector or the cache lists things does not matter.
    ``interface`` is what else describes the engine to its users (its
    precision mode, I/O tensors and compiler casts, as the backend records
    them): two engines that differ there are different engines, even with the
    same kernels, and an edited plan.json must not keep the fingerprint.
    """
    payload: dict[str, Any] = {
        "keys": sorted([e.key.lower(), normalize_hash(e.tactic_hash)] for e in cache_entries),
        "layers": sorted([layer.name, layer.tactic_name or ""] for layer in layers),
    }
    if compiler_settings is not None:  # graphs the autocast settings shaped
        payload["compiler_settings"] = compiler_settings
    if batch_profile is not None:  # kernels tuned for a range of batch sizes, not one shape
        payload["batch_profile"] = batch_profile.to_json()
    if interface is not None:
        payload["interface"] = dict(interface)
    return digest(canonical_json(payload))
