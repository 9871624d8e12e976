"""One layer compiled into a oneDNN Graph partition, through PyTorch's TorchScript bridge (LLGA).

A call to ``mkldnn._convolution_pointwise`` rebuilds the oneDNN primitive
descriptor on every call before it finds the primitive in oneDNN's cache: on
the small layers of mobile networks that costs 20-30 µs per call, more than
the kernel itself (a 3x3 depthwise convolution on 88x28x28 runs 17 µs inside
a 44 µs call). A compiled oneDNN Graph partition keeps its primitive, its
prepacked weight and its fused post-ops, so a call pays the kernel plus the
TorchScript executor's few microseconds. PyTorch reaches the Graph API only
from TorchScript: the layer is traced as a tiny module with its weight as a
frozen constant, with oneDNN fusion switched on just while the executor
compiles it (the switch is process-wide and is restored at once).

The partition runs the same oneDNN kernels as the other oneDNN tactics, in
the layer's own dtype, with the bias, residual add and activation fused as
post-ops: its bits may differ from the unfused tactics', its precision does
not. oneDNN Graph has no fp16 kernels in PyTorch's bridge, so only fp32 and
bf16 layers get the tactic.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from harness.dtypes import dtype_from_name
from harness.globalstate import onednn_fusion_enabled

log = logging.getLogger(__name__)

# The executor profiles a graph this many times before it fuses; a few more calls cover bailouts.
_WARMUP_CALLS = 3
_FUSION_GROUP = "prim::oneDNNFusionGroup"
_COMPILING = threading.Lock()


def available(precision: str) -> bool:
    """Whether this PyTorch can compile a layer of ``precision`` into a oneDNN Graph partition."""
    if precision not in ("fp32", "bf16") or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not hasattr(torch._C, "_jit_llga_enabled") or not hasattr(torch.jit, "trace"):
        return False
    return precision == "fp32" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@contextmanager
def _fusion_on() -> Iterator[None]:
    previous = onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        yield
    finally:
        torch.jit.enable_onednn_fusion(previous)


class _Layer(torch.nn.Module):
    """``post(op(x, weight, bias, *attrs) [+ residual])``: the graph the partition is compiled from."""

    def __init__(
        self,
        op: Callable[..., torch.Tensor],
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        attrs: Sequence[Any],
        post: Callable[[torch.Tensor], torch.Tensor] | None,
        residual: bool,
    ) -> None:
        super().__init__()
        self.op, self.attrs, self.post, self.residual = op, tuple(attrs), post, residual
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        y = self.op(inputs[0], self.weight, self.bias, *self.attrs)
        if self.residual:
            y = y + inputs[1]
        return y if self.post is None else self.post(y)


def compile_layer(
    name: str,
    op: Callable[..., torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    attrs: Sequence[Any],
    post: Callable[[torch.Tensor], torch.Tensor] | None,
    inputs: Sequence[tuple[tuple[int, ...], tuple[int, ...], str]],
) -> Callable[..., torch.Tensor]:
    """The layer as a compiled partition, called on tensors of ``inputs``' (shape, strides, dtype).

    The partition is guarded on its inputs' exact strides (any other layout
    takes TorchScript's unfused fallback), so callers pass tensors with the
    strides given here. A layer the bridge leaves unfused still computes the
    same function, only slower, which timing then shows; it is logged.

    Nothing is compiled until the first call, at each thread count: a oneDNN
    primitive fixes its thread count when it is created, and a partition keeps
    its primitives, so one compiled while torch had 2 threads still runs on 2
    after ``torch.set_num_threads(1)`` (an engine loaded before pinning
    measured 0.93 ms where its 1-thread run takes 1.26 ms). Compiling on first
    use also leaves an engine that is only built and saved (``harness
    build``) without the cost (about 6 ms a layer).
    """
    module = _Layer(op, weight, bias, attrs, post, residual=len(inputs) > 1).eval()
    examples = [
        torch.zeros(shape, dtype=dtype_from_name(dtype)).as_strided(shape, strides)
        for shape, strides, dtype in inputs
    ]
    threads = torch.get_num_threads
    compiled: dict[int, Callable[..., torch.Tensor]] = {}

    def run(*args: torch.Tensor) -> torch.Tensor:
        count = threads()
        fn = compiled.get(count)
        if fn is None:
            fn = compiled[count] = _compile(name, module, examples)
        return fn(*args)

    return run


def _compile(name: str, module: _Layer, examples: Sequence[torch.Tensor]) -> Callable[..., torch.Tensor]:
    # The fusion switch is process-wide: two threads compiling at once would
    # turn it off under each other (and could leave it on).
    with _COMPILING, warnings.catch_warnings(), torch.inference_mode(), _fusion_on():
        # torch.jit.trace is deprecated in favour of torch.compile, whose CPU
        # path calls the per-call-descriptor ops this tactic exists to avoid.
        warnings.simplefilter("ignore", DeprecationWarning)
        # torch leaves torch.jit.trace unannotated.
        trace = torch.jit.trace(module, tuple(examples), check_trace=False)  # type: ignore[no-untyped-call]
        traced = torch.jit.freeze(trace)
        for _ in range(_WARMUP_CALLS):
            traced(*examples)
        graph = str(traced.graph_for(*examples))  # type: ignore[no-untyped-call]
    if _FUSION_GROUP not in graph:
        log.warning("layer %r: oneDNN Graph left it unfused; its onednn_graph tactic runs unfused ATen", name)
    log.debug("layer %r: compiled a oneDNN Graph partition for %d thread(s)", name, torch.get_num_threads())
    forward: Callable[..., torch.Tensor] = traced.forward
    return forward
