"""Per-layer implementations ("tactics") of the CPU engine: which ones a layer is offered here,
and each bound to the layer.

Like GPU kernels, the implementations of one layer compute the same function
with different memory layouts, libraries or orders of accumulation, so their
results can differ in the last bits while all stay close to the exact value.
Each is one :class:`~harness.engines.cpu.tactic.Tactic` in the catalogue
(:mod:`harness.engines.cpu.families`): convolutions, GEMMs, attention,
softmax and layer norm have several, most other ops the single tactic
``direct``. A convolution or linear layer may carry an epilogue activation
and a residual input (:mod:`harness.engines.cpu.epilogues`), which every one
of its tactics applies.

A tactic is named ``impl[precision]`` (``gemm_splitk2[bf16]``): the precision
is part of the name because in weak modes it is one of the builder's choices.
:func:`offer` walks the layer's family and applies the emulation rule;
:func:`bind` turns (node, tactic) into a callable of the node's dynamic inputs
with weights already prepared (pre-transposed, channels-last, contiguous), so
the engine pays layout conversions once, at build or load, not per call.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from harness.engines.cpu import onednn_attention, onednn_primitive
from harness.engines.cpu.epilogues import CONV_EPILOGUES, LINEAR_EPILOGUES
from harness.engines.cpu.families import FAMILIES
from harness.engines.cpu.families.conv import PACKETS as CONV_PACKETS
from harness.engines.cpu.families.conv import conv_ok
from harness.engines.cpu.families.gemm import linear_ok
from harness.engines.cpu.families.plain import avg_pool_window as avg_pool_window
from harness.engines.cpu.families.plain import window_pool as window_pool
from harness.engines.cpu.plan import GETITEM, Node, TensorMeta
from harness.engines.cpu.tactic import (
    Bound,
    Family,
    Layer,
    Tactic,
    context,
    named_args,
    no_native_aten,
)
from harness.engines.cpu.tactic import make_call as make_call
from harness.errors import HarnessError, first_line
from harness.opnames import plan_packet

_TACTIC_NAME = re.compile(r"^(\w+)\[(\w+)\]$")


def _catalogue() -> dict[str, Tactic]:
    """Name -> entry over every family, in catalogue order; a name must be one entry."""
    entries: dict[str, Tactic] = {}
    for family in FAMILIES:
        for tactic in family.tactics:
            if entries.setdefault(tactic.name, tactic) is not tactic:
                raise AssertionError(f"two catalogue entries are named {tactic.name!r}")
    return entries


# Every tactic, by name, in catalogue order.
CATALOGUE: Mapping[str, Tactic] = _catalogue()
# The tactics on one of oneDNN's primitives through its C API (a result slot, per-thread calls:
# :mod:`harness.engines.cpu.onednn_primitive`).
PRIMITIVE_IMPLS = tuple(
    t.name for t in CATALOGUE.values() if t.primitive is not None and issubclass(t.primitive, onednn_primitive._Primitive)
)
# Attention on three oneDNN primitives: a layer like any other, its result a new tensor per call.
SDPA_DNNL = onednn_attention.Attention.tactic
# The tactics that compile a layer into a oneDNN Graph partition (regions are made of them).
GRAPH_IMPLS = tuple(t.name for t in CATALOGUE.values() if t.graph_layout is not None)
# A plain layer's form that a region traces into oneDNN partitions, where its own tactic stays
# one ATen call there: attention's explicit matmuls, scaling and softmax, not ATen's fused call.
REGION_FORMS = {t.name: t.region_form.name for t in CATALOGUE.values() if t.region_form is not None}

_LAYER_TYPES = {
    "convolution": "conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d conv_transpose3d",
    "matmul": "linear addmm mm bmm matmul baddbmm einsum",
    "softmax": "softmax _softmax log_softmax _log_softmax",
    "normalization": "layer_norm native_layer_norm batch_norm _native_batch_norm_legit_no_training "
    "group_norm native_group_norm rms_norm",
    "attention": "scaled_dot_product_attention",
    "gather": "embedding index_select gather index",
    "pooling": "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices avg_pool1d avg_pool2d "
    "avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool2d",
    "reduce": "mean sum amax amin max min argmax argmin var std prod cumsum linalg_vector_norm logsumexp",
    "shuffle": "view reshape _unsafe_view flatten unflatten transpose t permute unsqueeze squeeze "
    "expand slice select contiguous clone alias split split_with_sizes chunk unbind narrow repeat "
    "tile flip roll movedim pixel_shuffle pad constant_pad_nd dropout lift_fresh_copy",
    "concatenation": "cat stack",
    "cast": "_to_copy to type_as",
    "constant": "arange zeros ones full zeros_like ones_like full_like scalar_tensor",
    "resize": "upsample_nearest2d upsample_bilinear2d",
}
_TYPE_OF = {packet: kind for kind, packets in _LAYER_TYPES.items() for packet in packets.split()}


def layer_type(node: Node) -> str:
    """TensorRT-style layer type of a node ("convolution", "matmul", ..., "elementwise")."""
    return _TYPE_OF.get(plan_packet(node.op), "elementwise")


def tactic_name(impl: str, precision: str) -> str:
    return f"{impl}[{precision}]"


@functools.lru_cache(maxsize=4096)
def parse_tactic(name: str) -> tuple[str, str]:
    """``gemm_splitk2[bf16]`` -> ("gemm_splitk2", "bf16"); a HarnessError for another form.

    A pure function of the name, asked for every layer many times a build: each valid
    name is parsed once per process."""
    match = _TACTIC_NAME.match(name)
    if match is None:
        raise HarnessError(
            f"malformed tactic name {name!r}; expected impl[precision], e.g. gemm_direct[fp32]"
        )
    return match.group(1), match.group(2)


@functools.lru_cache(maxsize=4096)
def tactic_hash(name: str) -> str:
    """Stable 64-bit id of a tactic name, written like TensorRT's tactic hashes (a pure
    function of the name, computed once per process for each)."""
    return "0x" + hashlib.sha256(name.encode()).hexdigest()[:16]


def entry(node: Node) -> Tactic | None:
    """The catalogue's entry for ``node``'s tactic; None for a getitem or a name it lacks."""
    if node.op == GETITEM:
        return None
    return CATALOGUE.get(parse_tactic(node.tactic)[0])


def on_graph_tactic(node: Node) -> bool:
    """Whether ``node`` is a layer compiled into a oneDNN Graph partition (regions start at one)."""
    return node.op != GETITEM and parse_tactic(node.tactic)[0] in GRAPH_IMPLS


def on_primitive(node: Node) -> bool:
    """Whether ``node`` is a layer on one of oneDNN's primitives (:data:`PRIMITIVE_IMPLS`)."""
    return node.op != GETITEM and parse_tactic(node.tactic)[0] in PRIMITIVE_IMPLS


def graph_input_layout(node: Node) -> torch.memory_format:
    """The layout the partition of ``node``'s oneDNN Graph tactic takes its inputs in (a
    HarnessError for a layer on another tactic)."""
    found = entry(node)
    if found is None or found.graph_layout is None:
        raise HarnessError(f"layer {node.name!r} is not on a oneDNN Graph tactic ({node.tactic})")
    return found.graph_layout


@dataclass(frozen=True)
class Offer:
    """The implementations that can run a layer on this CPU, and those it leaves out, with why."""

    impls: tuple[str, ...]
    left_out: Mapping[str, str]  # implementation -> why this CPU does not offer it


def impl_names(
    node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> list[str]:
    """The implementations :func:`offer` offers for ``node``."""
    return list(offer(node, metas, weights).impls)


def offer(node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]) -> Offer:
    """Implementations that can run ``node`` here, in its family's catalogue order; the first
    is the plain ATen call unless this CPU leaves it out.

    A tactic of the layer's family is considered where its structural check
    applies. One whose kernel here is a reference or emulated fallback for
    the layer's shape and type is left out, with its reason, as the current
    capability (:mod:`harness.engines.capability`) answers the tactic's
    question: a oneDNN primitive whose descriptor names a reference loop or no
    kernel; torch's oneDNN ops and Graph partitions in a type torch has no
    native kernels for. Then the emulation rule: in such a type, ATen's own
    matmuls, convolutions and explicit attention (``aten_low``), which convert
    every element in software, are left out where anything else remains (the
    widened tactics compute the same products, exactly, on fp32 kernels, and
    round once; they apply wherever the type is emulated). An emulated ATen
    call stays where nothing else can run the layer.

    A HarnessError for a node whose arguments do not match its op, or that
    carries an epilogue or residual it cannot apply.
    """
    offered, left_out = _walk(node, metas, weights)
    return Offer(tuple(t.name for t in offered), left_out)


def _family(
    node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> tuple[Layer, Family]:
    """``node`` as its tactics' checks see it, and its family; a HarnessError for an
    epilogue or residual the node cannot carry."""
    layer = Layer(node, metas, weights)
    if node.epilogue and not epilogue_ok(node, node.epilogue):
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) cannot apply epilogue {node.epilogue!r}; only convolutions "
            f"({', '.join(CONV_EPILOGUES)}) and linear layers with constant weights "
            f"({', '.join(LINEAR_EPILOGUES)}) can"
        )
    if node.residual is not None and not residual_ok(node):
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) cannot add a residual; only convolutions and linear "
            "layers with constant weights can"
        )
    return layer, next(f for f in FAMILIES if f.matches(layer))


def _walk(
    node: Node, metas: Mapping[str, TensorMeta], weights: Mapping[str, torch.Tensor]
) -> tuple[list[Tactic], dict[str, str]]:
    """The tactics :func:`offer` offers for ``node``, and the names it leaves out with why."""
    layer, family = _family(node, metas, weights)
    offered: list[Tactic] = []
    left_out: dict[str, str] = {}
    for tactic in family.tactics:
        if tactic.applies(layer):
            reason = tactic.native(layer)
            if reason is None:
                offered.append(tactic)
            else:
                left_out[tactic.name] = reason
    emulated = [t for t in offered if t.aten_low]
    if emulated and len(emulated) < len(offered) and layer.emulated:
        reason = no_native_aten(layer.precision) + "; ATen converts every element in software"
        for tactic in emulated:
            offered.remove(tactic)
            left_out[tactic.name] = reason
    return offered, left_out


def epilogue_ok(node: Node, epilogue: str) -> bool:
    """Whether ``node`` can absorb the activation ``epilogue`` (every tactic of it applies it)."""
    packet = plan_packet(node.op)
    if node.multi or not node.outputs:
        return False
    if packet in CONV_PACKETS:
        return epilogue in CONV_EPILOGUES and conv_ok(node, named_args(node))
    if packet == "linear":
        return epilogue in LINEAR_EPILOGUES and linear_ok(named_args(node))
    return False


def residual_ok(node: Node) -> bool:
    """Whether ``node`` can add a residual to its result (every tactic of it does)."""
    if node.multi or not node.outputs:
        return False
    packet = plan_packet(node.op)
    if packet in CONV_PACKETS:
        return conv_ok(node, named_args(node))
    return packet == "linear" and linear_ok(named_args(node))


def bind(
    node: Node,
    impl: str,
    metas: Mapping[str, TensorMeta],
    weights: Mapping[str, torch.Tensor],
    result: onednn_primitive.ResultSlot | None = None,
) -> Bound:
    """Callable computing ``node`` with ``impl`` from its dynamic inputs (``node.refs()`` order);
    a HarnessError where :func:`offer` does not offer ``impl`` (with the reason it is left out).

    ``result``: the caller reads no result after its last reader in the run,
    so a tactic may write every result of a thread into the one tensor this
    gives that thread, which may share memory with other layers' results once
    dead (the oneDNN primitives do: see
    :class:`harness.engines.cpu.onednn_primitive.Matmul`); other tactics ignore it.
    """
    layer, family = _family(node, metas, weights)
    chosen = next((t for t in family.tactics if t.name == impl), None)
    if chosen is None or not chosen.applies(layer) or chosen.native(layer) is not None or (
        chosen.aten_low and layer.emulated
    ):  # the whole rule decides (the emulation rule looks at the other tactics)
        offered, left_out = _walk(node, metas, weights)
        chosen = next((t for t in offered if t.name == impl), None)
    if chosen is None:
        why = f" ({left_out[impl]})" if impl in left_out else ""
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) has no implementation {impl!r} here{why}; "
            f"valid: {', '.join(t.name for t in offered)}"
        )
    if result is None:  # the context a primitive tactic's question may have made already
        return chosen.bind(layer.context)
    return chosen.bind(context(node, metas, weights, result, named=layer.named))


@contextmanager
def layer_failures(node: Node) -> Iterator[None]:
    """Turn a kernel's exception while building into a HarnessError naming the layer.

    A typed graph can hold an op PyTorch refuses (e.g. an exact-AMP graph of a
    model that also fails under eager autocast); the user needs the layer.
    """
    try:
        yield
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = first_line(exc)
        raise HarnessError(
            f"layer {node.name!r} ({node.op}) fails on its inputs: {first}; the typed graph cannot run as given"
        ) from exc
