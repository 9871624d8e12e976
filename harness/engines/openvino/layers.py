"""The layers OpenVINO executes, read from its runtime model, and how their precisions relate to the graph.

``compiled_model.get_runtime_model()`` is OpenVINO's counterpart of
TensorRT's engine inspector: one node per executed layer, after its fusions,
whose ``rt_info`` names the layer type, the primitive (kernel) that runs it
(``brgconv_avx512_amx_bf16``, ``gemm_mlas_f32``, ``jit_avx512_f32``), the
precision it computes in and the ops of the model it was fused from
(``originalLayersNames``, the ONNX node names, which the export names after
the typed graph's nodes). The primitive is the layer's tactic. OpenVINO picks
it by ISA and shape heuristics, never by timing, so there is nothing to time
and nothing a timing cache could pin: layers carry no key.

Comparing each layer's runtime precision with the types its source ops have
in the model tells whether OpenVINO followed the graph (strongly typed modes)
and shows what it chose (weak modes, where the precision hint decides).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harness.dtypes import FLOAT_DTYPES, dtype_from_name
from harness.engines.onnx_export import listed
from harness.engines.openvino.runtime import dtype_of
from harness.engines.protocol import ExecutedPrecision, LayerInfo
from harness.precision import PrecisionMode

# Runtime-model nodes that run no kernel: weights, and the request's input and output ports.
NOT_KERNELS = frozenset(("Const", "Input", "Output"))
_NO_KEY = ""  # nothing is autotuned: no layer has a timing-cache key


def _bits(dtype: str) -> int:
    """Width of a floating dtype name (FLOAT_DTYPES) in bits."""
    return dtype_from_name(dtype).itemsize * 8


def tactic_hash(primitive: str) -> str:
    """A stable hash of a primitive name, as the timing-cache tools compare tactics by hash."""
    return "0x" + hashlib.sha256(f"openvino/{primitive}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ExecutedLayer:
    """One layer of OpenVINO's runtime model (dtypes in the harness's names)."""

    name: str
    layer_type: str
    primitive: str
    precision: str  # what the kernel computes in (rt_info runtimePrecision)
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    origins: tuple[str, ...]  # the model's ops fused into it

    @property
    def from_graph(self) -> bool:
        """Whether the layer computes ops of the model (not a reorder OpenVINO inserted)."""
        return bool(self.origins) and self.layer_type != "Reorder"

    def info(self) -> LayerInfo:
        return LayerInfo(
            self.name, self.layer_type, _NO_KEY, self.input_dtypes, self.output_dtypes,
            self.primitive, tactic_hash(self.primitive),
        )  # fmt: skip


# OpenVINO names the nodes its frontend and passes create <Type>_<n>, n from a
# process-wide counter ("Reshape_38550", "MVN_35097"), alone or inside a reorder's
# name ("Convert_44751_abcd_acdb_conv2d"). The export's own names never look so
# outside "origin/Op_k" (hence no "/" before one).
_COUNTER_NAME = re.compile(r"(?<![A-Za-z0-9/])([A-Z][A-Za-z0-9]*)_(\d+)(?![0-9])")


class StableNames:
    """Renames OpenVINO's counter names to ``<Type>#<k>``, k by first appearance.

    The counter keeps running across models in a process, so the same graph
    built twice would otherwise get other layer names, fingerprints and
    plans. Names the model itself uses (``keep``) are never renamed.
    """

    def __init__(self, keep: Iterable[str]) -> None:
        self._keep = frozenset(keep)
        self._names: dict[str, str] = {}
        self._counts: Counter[str] = Counter()

    def __call__(self, name: str) -> str:
        return name if name in self._keep else _COUNTER_NAME.sub(self._replace, name)

    def kept(self, name: str) -> bool:
        """Whether ``name`` is one of the model's own names."""
        return name in self._keep

    def _replace(self, match: re.Match[str]) -> str:
        token = match.group(0)
        if token in self._keep:
            return token
        if token not in self._names:
            kind = match.group(1)
            self._counts[kind] += 1
            self._names[token] = f"{kind}#{self._counts[kind]}"
        return self._names[token]


def executed_layers(compiled: Any, names: StableNames) -> list[ExecutedLayer]:
    """The kernels of a compiled model in execution order, named by ``names``.

    A layer OpenVINO named itself (a convolution with a batch norm folded in
    is called after the ``Multiply`` that scaled its weights) is called after
    the first op of the model it computes instead, when no other layer is.
    """
    layers = []
    taken: set[str] = set()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer_type = info["layerType"].astype(str)
        if layer_type in NOT_KERNELS:
            continue
        origins = tuple(names(n) for n in info["originalLayersNames"].astype(str).split(",") if n)
        name = names(op.get_friendly_name())
        if not names.kept(name):
            name = next((o for o in origins if names.kept(o) and o not in taken), name)
        taken.add(name)
        layers.append(
            ExecutedLayer(
                name=name,
                layer_type=layer_type,
                primitive=info["primitiveType"].astype(str),
                precision=dtype_of(info["runtimePrecision"].astype(str)),
                input_dtypes=tuple(dtype_of(op.get_input_element_type(i)) for i in range(op.get_input_size())),
                output_dtypes=tuple(dtype_of(p) for p in info["outputPrecisions"].astype(str).split(",") if p),
                origins=origins,
            )
        )
    return layers


def graph_float_dtypes(model: Any, names: StableNames) -> dict[str, frozenset[str]]:
    """Op name (by ``names``) -> the float types it reads or writes in the model as read, before
    OpenVINO's passes."""
    types: dict[str, frozenset[str]] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() in ("Constant", "Parameter", "Result"):
            continue
        seen = {dtype_of(op.get_input_element_type(i)) for i in range(op.get_input_size())}
        seen |= {dtype_of(op.get_output_element_type(i)) for i in range(op.get_output_size())}
        floats = frozenset(seen & FLOAT_DTYPES)
        if floats:
            types[names(op.get_friendly_name())] = floats
    return types


@dataclass(frozen=True)
class Deviation:
    """A layer that computes in a precision none of its source ops has in the graph."""

    layer: ExecutedLayer
    graph: frozenset[str]

    @property
    def widened(self) -> bool:
        """Computed wider than any type the graph gives it (a kernel missing for the narrow type)."""
        return _bits(self.layer.precision) > max(_bits(dtype) for dtype in self.graph)

    def describe(self) -> str:
        return f"{self.layer.name} ({self.layer.layer_type} ran {self.layer.precision}, graph {'/'.join(sorted(self.graph))})"


def deviations(layers: list[ExecutedLayer], graph: dict[str, frozenset[str]]) -> list[Deviation]:
    """Layers whose runtime precision is not among their source ops' float types in the graph.

    Layers OpenVINO added (reorders) or whose sources hold no float value
    (shape arithmetic) have nothing to compare with and are skipped.
    """
    found = []
    for layer in layers:
        if layer.precision not in FLOAT_DTYPES:
            continue
        wanted = frozenset().union(*(graph.get(name, frozenset()) for name in layer.origins))
        if wanted and layer.precision not in wanted:
            found.append(Deviation(layer, wanted))
    return found


def precision_summary(layers: list[ExecutedLayer]) -> str:
    """"12 bf16, 5 fp32 layers of the graph's ops (+ 3 reorders)": what computes in which precision."""
    ops = [layer for layer in layers if layer.from_graph and layer.precision in FLOAT_DTYPES]
    counts = Counter(layer.precision for layer in ops)
    added = sum(1 for layer in layers if not layer.from_graph)
    shown = ", ".join(f"{n} {dtype}" for dtype, n in counts.most_common()) or "none in floating point"
    return f"{shown} layers of the graph's ops" + (f" (+ {added} inserted by OpenVINO)" if added else "")


def layers_in(layers: list[ExecutedLayer], precision: str) -> str:
    """The graph-op layers computing in ``precision``, listed for a build note."""
    return listed([layer.name for layer in layers if layer.from_graph and layer.precision == precision])


def executed_precision(
    layers: list[ExecutedLayer], graph: dict[str, frozenset[str]], mode: PrecisionMode
) -> ExecutedPrecision | None:
    """What the layers computing the graph's ops ran in against ``mode``'s low type: under weak
    typing OpenVINO chose, every such layer counts and those in fp32 ran wider; otherwise the layers
    whose source ops the graph gives that type count, and those computing in a type the graph does
    not give them ran wider (the widened :func:`deviations`: a narrower one is refused at build)."""
    low = mode.low
    if low is None:
        return None
    ops = [layer for layer in layers if layer.from_graph and layer.precision in FLOAT_DTYPES]
    if mode.weak:
        return ExecutedPrecision(low, len(ops), tuple(op.name for op in ops if op.precision == "fp32"), chosen=True)
    wanted = {op.name: frozenset().union(*(graph.get(name, frozenset()) for name in op.origins)) for op in ops}
    asked = [op for op in ops if low in wanted[op.name]]  # a cast to it included: its graph types are both
    return ExecutedPrecision(low, len(asked), tuple(op.name for op in asked if op.precision not in wanted[op.name]))
