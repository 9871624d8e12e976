"""Store 2-D convolution weights channels-last.

oneDNN runs convolutions fastest on channels-last (NHWC) tensors; given an
NCHW weight it reorders it on every call, and given a channels-last weight it
keeps the activations channels-last through the whole network. Reordering once
at compile time is the layout half of "weights are converted ahead of time"
(about 1.7x on the zoo's resnet in bf16 on this project's CPU). The values are
unchanged, only their memory order; kernels differ, so the exact modes (amp,
fp32) leave layouts alone, like every other last-bit-changing pass.
"""

from __future__ import annotations

import torch

from harness.fxutil import fake_mode_of
from harness.lowering.pass_manager import register_pass

_CONV2D = {torch.ops.aten.conv2d.default, torch.ops.aten.conv2d.padding}


@register_pass("channels_last_weights")
def channels_last_weights(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    fake_mode = fake_mode_of(gm)
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
    return gm
