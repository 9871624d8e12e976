"""Memory layouts: convolution weights channels-last; strided ops read a compact copy.

Store 2-D convolution weights channels-last.

oneDNN runs convolutions fastest on channels-last (NHWC) tensors; given an
NCHW weight it reorders it on every call, and given a channels-last weight it
keeps the activations channels-last through the whole network. Reordering once
at compile time is the layout half of "weights are converted ahead of time"
(about 1.7x on the zoo's resnet in bf16 on this project's CPU). The values are
unchanged, only their memory order; kernels differ, so the exact modes (amp,
fp32) leave layouts alone, like every other last-bit-changing pass.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassResult

from harness.fxutil import fake_mode_of
from harness.lowering.functionalize import is_view
from harness.lowering.registry import register_pass

logger = logging.getLogger(__name__)
aten = torch.ops.aten
_CONV2D = {aten.conv2d.default, aten.conv2d.padding}
# Ops that address their input's *memory* (storage offset and strides), not its values.
STRIDED_OPS = {aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default}


@register_pass("channels_last_weights")
def channels_last_weights(gm: torch.fx.GraphModule) -> PassResult:
    """Store every 4-D weight of a 2-D convolution channels-last (the graph's nodes are unchanged)."""
    fake_mode = fake_mode_of(gm)
    converted_count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CONV2D:
            continue
        weight = node.args[1]
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
            continue
        name = str(weight.target)
        tensor = getattr(gm, name)
        if tensor.dim() != 4 or tensor.is_contiguous(memory_format=torch.channels_last):
            continue
        converted = tensor.detach().contiguous(memory_format=torch.channels_last)
        if isinstance(tensor, torch.nn.Parameter):
            converted = torch.nn.Parameter(converted, requires_grad=tensor.requires_grad)
        setattr(gm, name, converted)
        weight.meta["val"] = fake_mode.from_tensor(converted, static_shapes=True)
        converted_count += 1
    logger.debug("channels_last_weights: %d convolution weight(s) made channels-last", converted_count)
    return PassResult(gm, converted_count > 0)


def _compact(val: object) -> bool:
    """Row-major, at offset 0, alone in its storage: memory order is then value order."""
    return (
        isinstance(val, torch.Tensor)
        and val.is_contiguous()
        and val.storage_offset() == 0
        and val.untyped_storage().nbytes() == val.numel() * val.element_size()
    )


def _compact_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The compact tensor whose memory ``node`` views (``node`` itself if compact), if there is one."""
    while not _compact(node.meta.get("val")):
        if not is_view(node) or not isinstance(node.args[0], torch.fx.Node):
            return None
        node = node.args[0]
    return node


@register_pass("pin_strided_layouts")
def pin_strided_layouts(gm: torch.fx.GraphModule) -> PassResult:
    """Give ``as_strided`` (and its copy/scatter forms) a contiguous copy of the memory it addresses.

    ``x.as_strided(size, stride, offset)`` reads ``x``'s storage, so its result
    depends on how ``x`` is laid out, not only on its values. Eager lays
    ``x`` out one way; the compiler's channels-last weights and the CPU
    engine's convolution tactics lay it out another, and the same node then
    reads other elements, silently. Where the tensor owning that memory is
    compact in eager (row-major, offset 0, alone in its storage; the common
    case, and always the case for the base the functionalization pass scatters
    into), the op is given ``clone(base, contiguous_format)`` instead: the same
    memory order as eager whatever produced it, and the same values. A view of
    such a base (``h.t().as_strided(...)``) addresses the base's memory, so
    the clone is of the base, with the view's storage offset made explicit.
    Anything else is left as it is: eager layouts still apply in the compiled
    graph, and the CPU engine refuses it, naming the node.
    """
    fake_mode = fake_mode_of(gm)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}  # one compact copy per base, shared by its readers
    pinned = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in STRIDED_OPS:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            continue
        base = _compact_base(source)
        if base is None or (base is not source and node.target is aten.as_strided_scatter.default):
            continue  # a scatter returns its own input's shape: only a compact input can be copied
        args, kwargs = list(node.args), dict(node.kwargs)
        if base is not source:
            # as_strided(self, size, stride, storage_offset=None): None means the view's own offset.
            offset = kwargs.pop("storage_offset", args[3] if len(args) > 3 else None)
            args = [*args[:3], source.meta["val"].storage_offset() if offset is None else offset]
        if base not in copies:
            with gm.graph.inserting_before(node):
                copy = gm.graph.call_function(aten.clone.default, (base,), {"memory_format": torch.contiguous_format})
            copy.name = gm.graph._graph_namespace.create_name(f"{base.name}_compact", None)
            for key in ("nn_module_stack", "stack_trace", "autocast_regions", "source_fn_stack"):
                if key in base.meta:
                    copy.meta[key] = base.meta[key]
            with fake_mode:
                copy.meta["val"] = base.meta["val"].clone(memory_format=torch.contiguous_format)
            copies[base] = copy
        args[0] = copies[base]
        node.args, node.kwargs = tuple(args), kwargs
        pinned += 1
    logger.debug("pin_strided_layouts: %d strided op(s) read %d compact copy(ies)", pinned, len(copies))
    return PassResult(gm, pinned > 0)
