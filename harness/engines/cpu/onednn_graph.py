"""One layer compiled into a oneDNN Graph partition, through PyTorch's TorchScript bridge (LLGA).

A call to ``mkldnn._convolution_pointwise`` rebuilds the oneDNN primitive
descriptor on every call before it finds the primitive in oneDNN's cache: on
the small layers of mobile networks that costs more than the kernel itself.
A compiled oneDNN Graph partition keeps its primitive, its prepacked weight
and its fused post-ops, so a call pays the kernel plus the TorchScript
executor. PyTorch reaches the Graph API only
from TorchScript: the layer is traced as a function of its inputs with its
weight as a constant, with oneDNN fusion switched on just while the executor
compiles it (the switch is process-wide and is restored at once).

The partition runs the same oneDNN kernels as the other oneDNN tactics, in
the layer's own dtype, with the bias, residual add and activation fused as
post-ops: its bits may differ from the unfused tactics', its precision does
not. oneDNN Graph has no fp16 kernels in PyTorch's bridge, so an fp16 layer
(or a bf16 one where the CPU has no bf16 kernels) gets the widened form
instead: the fp32 partition on its values widened exactly, the result rounded
once, as oneDNN's fp16 kernels do it. On a CPU without fp16 matrix units that
is also the faster kernel.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from harness.dtypes import dtype_from_name
from harness.engines import capability
from harness.errors import first_line
from harness.globalstate import onednn_fusion_enabled

log = logging.getLogger(__name__)

# The executor profiles a graph this many times before it fuses; a few more calls cover bailouts.
_WARMUP_CALLS = 3
_FUSION_GROUP = "prim::oneDNNFusionGroup"
_COMPILING = threading.Lock()
# An input's (shape, strides, dtype name), and what gives a tensor of that shape exactly those strides.
InputMeta = tuple[tuple[int, ...], tuple[int, ...], str]
Fixer = Callable[[torch.Tensor], torch.Tensor]


def available(precision: str) -> bool:
    """Whether this PyTorch can compile a layer of ``precision`` into a oneDNN Graph partition
    with native kernels: fp32, and bf16 where torch has native bf16 kernels (the current
    capability, :mod:`harness.engines.capability`)."""
    if precision not in ("fp32", "bf16") or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not hasattr(torch._C, "_jit_llga_enabled") or not hasattr(torch.jit, "trace"):
        return False
    return capability.current().aten_native(precision)


@contextmanager
def _fusion_on() -> Iterator[None]:
    previous = onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        yield
    finally:
        torch.jit.enable_onednn_fusion(previous)


@contextmanager
def _own_compilation_unit() -> Iterator[None]:
    """TorchScript functions made inside go to a compilation unit of their own.

    torch.jit.trace registers a traced function, constants (the layer's weights)
    included, in TorchScript's process-wide compilation unit, which never lets
    go of it; in a unit of its own the function lives as long as its callers
    hold it. Used under :data:`_COMPILING`, so that no other compile of the
    harness lands in this unit.
    """
    shared = torch.jit._state._python_cu
    torch.jit._state._python_cu = torch._C.CompilationUnit()
    try:
        yield
    finally:
        torch.jit._state._python_cu = shared


class _Layer(torch.nn.Module):
    """``post(op(x, weight, bias, *attrs) [+ residual])``: the graph the partition is compiled from.

    ``widened``: the layer's fp16/bf16 inputs and parameters widened to fp32
    (exactly: every fp16 and bf16 value is an fp32 value), the partition in
    fp32, and its result rounded once to the inputs' dtype: what oneDNN's own
    reduced-precision kernels compute (products exact in fp32, fp32
    accumulation, bias, residual and activation applied in fp32, one rounding
    on store). The casts stay in the traced graph as ATen calls around the
    partition.
    """

    def __init__(
        self,
        op: Callable[..., torch.Tensor],
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        attrs: Sequence[Any],
        post: Callable[[torch.Tensor], torch.Tensor] | None,
        residual: bool,
        widened: bool = False,
    ) -> None:
        super().__init__()
        self.op, self.attrs, self.post, self.residual = op, tuple(attrs), post, residual
        self.stored = weight.dtype if widened else None
        self.register_buffer("weight", weight.float() if widened else weight)
        self.register_buffer("bias", None if bias is None else bias.float() if widened else bias)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.stored is not None:
            inputs = tuple(t.float() for t in inputs)
        y = self.op(inputs[0], self.weight, self.bias, *self.attrs)
        if self.residual:
            y = y + inputs[1]
        y = y if self.post is None else self.post(y)
        return y if self.stored is None else y.to(self.stored)


class GraphLayer:
    """A layer compiled into a partition: its traced module, its inputs' exact layouts, and the call.

    The module and layouts stay available so that :func:`compile_region` can
    trace a run of consecutive layers as one graph. The module (with its
    widened weights) is made the first time it is asked for, by a compile of
    the layer or of a region holding it: a layer that only runs inside a
    region, or an engine never run, makes none.
    """

    def __init__(
        self,
        name: str,
        make: Callable[[], _Layer],
        inputs: Sequence[InputMeta],
        layout: torch.memory_format,
    ) -> None:
        self._make, self.inputs = functools.cache(make), tuple(inputs)
        self.fixers = tuple(exact_layout(shape, strides, layout) for shape, strides, _ in inputs)
        run = _lazy(name, self._make, self.inputs)
        if len(self.fixers) == 2:
            fix_x, fix_r = self.fixers
            self._call: Callable[..., torch.Tensor] = lambda x, r: run(fix_x(x), fix_r(r))
        else:
            (fix,) = self.fixers
            self._call = lambda x: run(fix(x))

    @property
    def module(self) -> _Layer:
        """The layer's module, the graph its partition is traced from (made on first use)."""
        return self._make()

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self._call(*args)


def compile_layer(
    name: str,
    op: Callable[..., torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    attrs: Sequence[Any],
    post: Callable[[torch.Tensor], torch.Tensor] | None,
    inputs: Sequence[InputMeta],
    layout: torch.memory_format = torch.contiguous_format,
    widened: bool = False,
) -> GraphLayer:
    """The layer as a compiled partition, called on tensors of ``inputs``' (shape, strides, dtype);
    ``widened``, an fp16/bf16 layer computed in fp32 and rounded once (see :class:`_Layer`).

    The partition is guarded on its inputs' exact strides (any other layout
    takes TorchScript's unfused fallback), so the call first gives each input
    those strides (``layout``-contiguous, size-1 dimensions included). A layer
    the bridge leaves unfused still computes the same function, only slower,
    which timing then shows; it is logged.
    """
    residual = len(inputs) > 1

    def make() -> _Layer:
        return _Layer(op, weight, bias, attrs, post, residual=residual, widened=widened).eval()

    return GraphLayer(name, make, inputs, layout)


class _Op(torch.nn.Module):
    """A plain layer between partitions (a pooling, a rescale), traced as the ATen call it is."""

    def __init__(self, call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.call = call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.call(*inputs)


class _Region(torch.nn.Module):
    """Consecutive layers as one module: ``wiring[i]`` indexes the values layer ``i`` reads
    (the region's inputs, then each layer's result in order); ``outputs`` those it returns."""

    def __init__(
        self, layers: Sequence[torch.nn.Module], wiring: Sequence[tuple[int, ...]], outputs: Sequence[int]
    ) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.wiring, self.outputs = tuple(wiring), tuple(outputs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _chain(self.layers, self.wiring, self.outputs, inputs)


def _chain(
    layers: Iterable[Callable[..., torch.Tensor]],
    wiring: Sequence[tuple[int, ...]],
    outputs: Sequence[int],
    inputs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    values = list(inputs)
    for layer, reads in zip(layers, wiring, strict=True):
        values.append(layer(*(values[i] for i in reads)))
    return tuple(values[i] for i in outputs)


def compile_region(
    name: str,
    layers: Sequence[GraphLayer | Callable[..., torch.Tensor]],
    inputs: Sequence[tuple[Fixer, InputMeta]],
    wiring: Sequence[tuple[int, ...]],
    outputs: Sequence[int],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Consecutive layers traced as one graph, called once per run.

    Per layer, a partition call pays the TorchScript executor, a Python call
    and plain-layout tensors at both ends; in one graph the bridge hands each
    partition's result to the next in oneDNN's own (blocked) layout and the
    run makes one call for the whole region. The partitions are the layers'
    own (the same ops, dtypes and fused post-ops), so the region computes
    what its layers compute. A layer that is not a :class:`GraphLayer` is a
    plain ATen call reading only values of the region: it is traced as that
    call, and the bridge may run it in oneDNN instead (a layer norm becomes a
    partition of its own, with fp32 statistics and its output in the layer's
    dtype, as ATen computes it).

    ``inputs[k]`` gives region input ``k`` the exact layout the trace sees
    (a partition's guard compares strides): the fixer of the graph layer
    reading it, or contiguous for a plain layer, with its (shape, strides,
    dtype); ``wiring`` and ``outputs`` index the region's values as
    :class:`_Region` does.
    """
    fixers = [fix for fix, _ in inputs]

    @functools.cache
    def module() -> _Region:
        modules = [layer.module if isinstance(layer, GraphLayer) else _Op(layer) for layer in layers]
        return _Region(modules, wiring, outputs).eval()

    def one_by_one(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _chain(layers, wiring, outputs, args)

    run = _lazy(name, module, [meta for _, meta in inputs], fallback=one_by_one)

    def region(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return run(*(fix(arg) for fix, arg in zip(fixers, args, strict=True)))  # type: ignore[no-any-return]

    return region


def exact_layout(shape: tuple[int, ...], strides: tuple[int, ...], layout: torch.memory_format) -> Fixer:
    """``layout``-contiguous with exactly ``strides``: a size-1 dimension leaves a tensor's
    strides ambiguous, and a partition's guard compares them all."""
    if 1 not in shape:
        return lambda t: t.contiguous(memory_format=layout)
    return lambda t: t.contiguous(memory_format=layout).as_strided(shape, strides)


def input_meta(shape: Sequence[int], dtype: str, layout: torch.memory_format) -> InputMeta:
    """The (shape, strides, dtype) of a ``layout``-contiguous input, as a partition's guard sees it."""
    shape = tuple(shape)
    return shape, _strides(shape, layout), dtype


@functools.lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...], layout: torch.memory_format) -> tuple[int, ...]:
    """The strides torch gives a ``layout``-contiguous tensor of ``shape``: they depend on nothing
    else, so each is asked of torch once per process."""
    return torch.empty(shape, device="meta", memory_format=layout).stride()


def _example(shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype_from_name(dtype)).as_strided(shape, strides)


def _lazy(
    name: str,
    module: Callable[[], torch.nn.Module],
    inputs: Sequence[InputMeta],
    fallback: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``module()`` compiled on first call, at each thread count, traced on zero tensors of
    ``inputs``; ``fallback`` where the bridge fails.

    A oneDNN primitive fixes its thread count when it is created, and a
    partition keeps its primitives, so one compiled while torch had 2 threads
    still runs on 2 after ``torch.set_num_threads(1)``, and a timing of it
    would not be a 1-thread one. Compiling on first use also leaves an engine
    that is only built and saved (``harness build``) without the compilation's
    cost.
    """
    threads = torch.get_num_threads
    compiled: dict[int, Callable[..., Any]] = {}

    def run(*args: torch.Tensor) -> Any:
        count = threads()
        fn = compiled.get(count)
        if fn is None:
            traced, examples = module(), [_example(*meta) for meta in inputs]
            try:
                fn = _compile(name, traced, examples)
            except Exception as exc:  # the bridge refuses some graphs whose ops it takes one by one
                if fallback is None:
                    raise
                first = first_line(exc)
                log.warning("region %r: oneDNN Graph cannot compile it (%s); its layers run one by one", name, first)
                fn = fallback
            compiled[count] = fn
        return fn(*args)

    return run


def _compile(name: str, module: torch.nn.Module, examples: Sequence[torch.Tensor]) -> Callable[..., Any]:
    # The fusion switch is process-wide: two threads compiling at once would
    # turn it off under each other (and could leave it on).
    with _COMPILING, warnings.catch_warnings(), torch.inference_mode(), _fusion_on():
        # torch.jit.trace is deprecated in favour of torch.compile, whose CPU
        # path calls the per-call-descriptor ops this tactic exists to avoid.
        warnings.simplefilter("ignore", DeprecationWarning)
        # Traced as a function, the module's weights become graph constants (as freezing makes
        # them) and no TorchScript class is registered: a traced module's classes live as long
        # as the process, and each one slows every later class-attribute assignment on nn.Module.
        with _own_compilation_unit():
            traced = torch.jit.trace(lambda *inputs: module(*inputs), tuple(examples), check_trace=False)  # type: ignore[no-untyped-call]
        torch._C._jit_pass_optimize_frozen_graph(traced.graph, True)  # what torch.jit.freeze runs after
        for _ in range(_WARMUP_CALLS):
            traced(*examples)
        graph = str(traced.graph_for(*examples))
    if _FUSION_GROUP not in graph:
        log.warning("%r: oneDNN Graph left it unfused; it runs as unfused ATen calls", name)
    log.debug("layer %r: compiled a oneDNN Graph partition for %d thread(s)", name, torch.get_num_threads())
    forward: Callable[..., Any] = traced
    return forward
