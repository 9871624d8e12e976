"""Fold inference batch norm into the convolution in front of it.

In eval mode ``batch_norm(conv(x, w, b))`` is ``conv(x, w', b')`` with
``w' = w * g / sqrt(var + eps)`` and ``b' = (b - mean) * g / sqrt(var + eps) + beta``.
The fold is computed in float64 and stored in the weight's dtype, so it is as
accurate as the unfolded pair in fp32 and more accurate once the graph is
lowered (one rounding of the folded weight instead of a low-precision
normalization). It changes the last bits relative to eager, so the exact modes
(``amp``, ``fp32``) do not run it; TensorRT performs the same fold itself.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassResult
from torch.nn.utils.fusion import fuse_conv_bn_weights

from harness.fxutil import drop_unused_attributes, fake_mode_of
from harness.lowering.registry import register_pass

logger = logging.getLogger(__name__)
aten = torch.ops.aten
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}


def fold_conv_batch_norm(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded (weight, bias), computed in float64 and stored in the weight's dtype.

    PyTorch's own fold (``torch.nn.utils.fusion.fuse_conv_bn_weights``, what
    ``torch.fx``'s and quantization's conv-bn fusions use) run on float64
    copies: it computes in its inputs' dtype, and in fp32 it rounds every
    intermediate (on the zoo resnet 126297 folded weight and 258 bias values
    differ from the float64 fold). The float64 route gives, bit for bit, the
    values of this module's former hand-written fold on the zoo resnet.

    Shared by this pass and the CPU engine's own fold (which runs in the exact
    modes, where the compiler leaves batch norm alone), so both fold alike.
    """

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().double()

    new_weight, new_bias = fuse_conv_bn_weights(
        weight.detach().double(), f64(bias), mean.detach().double(), var.detach().double(), eps, f64(gamma), f64(beta)
    )
    return new_weight.detach().to(weight.dtype).contiguous(), new_bias.detach().to(weight.dtype).contiguous()


def _const(gm: torch.fx.GraphModule, node: object) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, detached; None for anything else."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = getattr(gm, str(node.target))
        if isinstance(value, torch.Tensor):
            return value.detach()
    return None


def _attribute_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for _ in gm.named_buffers(recurse=False)) + sum(1 for _ in gm.named_parameters(recurse=False))


@register_pass("fold_batch_norm")
def fold_batch_norm(gm: torch.fx.GraphModule) -> PassResult:
    """Fold every eval-mode batch norm whose input is a convolution with constant weights."""
    fake_mode = fake_mode_of(gm)
    nodes_before, attributes_before = len(gm.graph.nodes), _attribute_count(gm)
    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not aten.batch_norm.default:
            continue
        conv, gamma, beta, mean, var, training, _momentum, eps = bn.args[:8]
        if training or not (isinstance(conv, torch.fx.Node) and conv.target in _CONVS and len(conv.users) == 1):
            continue
        weight = _const(gm, conv.args[1])
        bias = _const(gm, conv.args[2]) if len(conv.args) > 2 and conv.args[2] is not None else None
        mean_t, var_t = _const(gm, mean), _const(gm, var)
        if weight is None or mean_t is None or var_t is None or (len(conv.args) > 2 and conv.args[2] is not None and bias is None):
            continue
        g = _const(gm, gamma) if gamma is not None else None
        b = _const(gm, beta) if beta is not None else None
        if (gamma is not None and g is None) or (beta is not None and b is None):
            continue
        new_w, new_b = fold_conv_batch_norm(weight, bias, g, b, mean_t, var_t, eps)
        getters = []
        for suffix, tensor in (("weight", new_w), ("bias", new_b)):
            name = f"{conv.name}_folded_{suffix}"
            gm.register_buffer(name, tensor)
            with gm.graph.inserting_before(conv):
                get = gm.graph.get_attr(name)
            get.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
            get.meta["weight_name"] = f"{conv.name}.{suffix} (folded {bn.name})"
            getters.append(get)
        args = list(conv.args) + [None] * (3 - len(conv.args))
        args[1], args[2] = getters
        conv.args = tuple(args)
        conv.meta["folded_batch_norm"] = bn.name
        bn.replace_all_uses_with(conv)
        gm.graph.erase_node(bn)
        folded += 1
    drop_unused_attributes(gm)
    logger.debug("fold_batch_norm: %d batch norm(s) folded into their convolution", folded)
    modified = folded > 0 or len(gm.graph.nodes) != nodes_before or _attribute_count(gm) != attributes_before
    return PassResult(gm, modified)
