"""A plan turned into straight-line Python: the engine's run function and its timed twin.

Both functions are generated from one list of steps (the bound call, the
variables it reads and writes, the intermediates it frees), as fx's codegen
does, so the profiler times exactly the calls the engine makes, in the same
order with the same frees, instead of a second interpreter of the plan that
could drift from the real one. The timed variant only adds a clock reading
before and after each call.

A call is one layer, or a region: consecutive layers whose tactics are oneDNN
Graph partitions, with the plain layers before, among and after them, traced
together as one graph
(:func:`harness.engines.cpu.onednn_graph.compile_region`), so the run pays
one call for them and the partitions pass each other oneDNN's own layouts.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.dtypes import dtype_from_name
from harness.engines.cpu import onednn_graph, tactics
from harness.engines.cpu.plan import GETITEM, Node, Plan, Ref, TensorMeta
from harness.engines.cpu.tactic import compiled
from harness.errors import HarnessError
from harness.opnames import plan_packet

RunFn = Callable[..., tuple[torch.Tensor, ...]]
# timed(clock, stamps, *inputs): stamps[2i], stamps[2i + 1] = clock() around call i.
TimedRunFn = Callable[..., tuple[torch.Tensor, ...]]
# Plain layers that may join a region after one of its oneDNN Graph layers: on a tactic a
# region may trace (``Tactic.traceable``: the op's own ATen call, or explicit attention, whose
# matmuls, scaling and softmax the bridge runs as partitions, so the region needs fewer calls),
# of these layer types, and the global pooling of squeeze-excite blocks (other poolings can
# make the bridge fail to compile the region: max_pool2d with its default stride).
_INNER_TYPES = frozenset(
    {"elementwise", "reduce", "shuffle", "cast", "reformat", "normalization", "softmax", "attention"}
)
_INNER_OPS = frozenset({"adaptive_avg_pool2d"})
# Where planned results start in a thread's arena: a cache line, and more than any dtype's size.
ARENA_ALIGNMENT = 64
# ATen calls that always return a new tensor (never their input, never a view), run by a
# tactic that is the op's own ATen call (``Tactic.aten_call``): a primitive's result read only
# by these and by other primitives may be written into a thread's arena (see private_results).
_FRESH_OPS = frozenset(
    {"add", "sub", "mul", "div", "relu", "hardswish", "hardsigmoid", "sigmoid", "silu", "gelu", "tanh"}
    | {"adaptive_avg_pool2d", "avg_pool2d", "max_pool2d", "mean", "_to_copy", "cat"}
)


@dataclass(frozen=True)
class Program:
    """The plan's layers, bound once, and the two generated functions calling them."""

    calls: tuple[tuple[Node, ...], ...]  # the layers of each call the timed function stamps, in order
    run: RunFn
    timed: TimedRunFn
    pinned: frozenset[str] = frozenset()  # the layers run as bare calls (see _pinned_layers)


def compile_plan(plan: Plan, regions: bool = True) -> Program:
    """Bind every layer's tactic once and generate ``run`` and ``timed`` from the same steps.

    ``regions=False`` calls every layer on its own (a profile then times each
    oneDNN Graph layer separately).
    """
    metas = plan.value_metas()
    groups = region_groups(plan.nodes) if regions else [[i] for i in range(len(plan.nodes))]
    refs = [node.refs() for node in plan.nodes]
    last_use: dict[str, int] = {}
    for index, node_refs in enumerate(refs):
        for ref in node_refs:
            last_use[ref.name] = index
    for out in plan.outputs:
        if isinstance(out, Ref):
            last_use[out.name] = len(plan.nodes)  # never freed
    offsets, size = arena_offsets(plan, private_results(plan, groups), last_use)
    arena = Arena(size)
    bound: dict[int, Any] = {}
    for index, node in enumerate(plan.nodes):
        if node.op != GETITEM:
            impl, _ = tactics.parse_tactic(node.tactic)
            result = None if index not in offsets else functools.partial(arena.view, offsets[index], _bytes(node))
            bound[index] = tactics.bind(node, impl, metas, plan.weights, result=result)
    pinned = _pinned_layers(plan, bound, offsets)
    variables = {name: f"a{i}" for i, (name, _) in enumerate(plan.inputs)}
    direct: set[int] = set()  # layers on primitives called as the thread's own call
    namespace: dict[str, Any] = {}
    body: list[tuple[str, bool]] = []  # (statement, is a timed call)
    calls: list[tuple[Node, ...]] = []
    for group in groups:
        first, last = group[0], group[-1]
        nodes = [plan.nodes[i] for i in group]
        if len(group) > 1:
            statement = _region_call(f"r{first}", nodes, group, bound, metas, last_use, variables, namespace)
        else:
            node = nodes[0]
            var = variables[node.name] = f"v{first}"
            args = ", ".join(variables[r.name] for r in refs[first])
            if node.op == GETITEM:
                statement = f"{var} = {args}[{int(node.args[1])}]"
            elif first in pinned:  # its result tensor, after the bare call (see _pinned_layers)
                namespace[f"f{first}"] = bound[first]
                statement = f"{var} = f{first}.failed(s) if (s := x{first}()) else t{first}"
            elif tactics.on_primitive(node):  # the thread's own call (see _thread_bindings)
                direct.add(first)
                statement = f"{var} = p{first}({args}{', None' if len(refs[first]) == 1 else ''})"
            else:
                namespace[f"f{first}"] = bound[first]
                statement = f"{var} = f{first}({args})"
        is_call = len(group) > 1 or nodes[0].op != GETITEM
        if is_call:
            calls.append(tuple(nodes))
        body.append((statement, is_call))
        dead = sorted(
            {
                variables[r.name]
                for i in group
                for r in refs[i]
                if first <= last_use[r.name] <= last and r.name in variables
            }
        )
        if dead:
            body.append((f"del {', '.join(dead)}", False))
    results = []
    for i, out in enumerate(plan.outputs):
        if isinstance(out, Ref):
            results.append(f"{variables[out.name]}.contiguous()")
        else:
            namespace[f"w{i}"] = plan.weights[out.name]
            results.append(f"w{i}.clone()")
    ret = f"return ({''.join(r + ', ' for r in results)})"
    params = ", ".join(variables[name] for name, _ in plan.inputs)
    run_lines = [f"def run({params}):", *(f"    {s}" for s, _ in body), f"    {ret}"]
    timed_lines = [f"def timed(clock, stamps{', ' if params else ''}{params}):"]
    call = 0
    for statement, is_call in body:
        if is_call:
            timed_lines += [
                f"    stamps[{2 * call}] = clock()",
                f"    {statement}",
                f"    stamps[{2 * call + 1}] = clock()",
            ]
            call += 1
        else:
            timed_lines.append(f"    {statement}")
    timed_lines.append(f"    {ret}")
    source = "\n".join(run_lines) + "\n\n" + "\n".join(timed_lines)
    code = compiled(source, "<cpu-engine>", "exec")
    if not pinned and not direct:
        exec(code, namespace)
        return Program(tuple(calls), namespace["run"], namespace["timed"])
    threads = _PerThread(code, namespace, functools.partial(_thread_bindings, plan, bound, offsets, pinned, direct))
    return Program(tuple(calls), threads.run, threads.timed, frozenset(plan.nodes[i].name for i in pinned))


def _pinned_layers(plan: Plan, bound: Mapping[int, Any], offsets: Mapping[int, int]) -> set[int]:
    """The layers on primitives that run as their bare call (:meth:`~harness.engines.cpu.
    onednn_primitive.Matmul.pinned`): result and operands all in the arena, so in the same
    place in every run of a thread. Each skips the primitive's per-call checks and pointer
    updates. Decided by pinning them in this thread: where one fits here, it fits in every
    thread, as each thread's arena holds the same views."""
    producer = {node.name: i for i, node in enumerate(plan.nodes)}
    candidates = {i for i in offsets if all(producer.get(r.name) in offsets for r in plan.nodes[i].refs())}
    return {i for i, (call, _) in _thread_pins(plan, bound, offsets, candidates).items() if call is not None}


def _thread_pins(
    plan: Plan, bound: Mapping[int, Any], offsets: Mapping[int, int], layers: set[int]
) -> dict[int, tuple[Callable[[], int] | None, torch.Tensor]]:
    """This thread's bare calls of ``layers`` (None where one does not fit) and their results."""
    producer = {node.name: i for i, node in enumerate(plan.nodes)}
    results = {i: bound[i].thread_result() for i in offsets}
    return {
        i: (bound[i].pinned(*(results[producer[r.name]] for r in plan.nodes[i].refs())), results[i])
        for i in sorted(layers)
    }


def _thread_bindings(
    plan: Plan, bound: Mapping[int, Any], offsets: Mapping[int, int], pinned: set[int], direct: set[int]
) -> dict[str, Any]:
    """This thread's names in the generated code: ``x{i}`` and ``t{i}``, the bare call and
    result of each pinned layer, and ``p{i}``, the thread's own call of each other layer on a
    primitive (a primitive's call otherwise looks up the thread's memory objects on every
    call, a cost comparable to a small layer's kernel)."""
    names: dict[str, Any] = {}
    for i, (call, result) in _thread_pins(plan, bound, offsets, pinned).items():
        if call is None:  # the arena's views are the same in every thread: not expected
            raise HarnessError(f"layer {plan.nodes[i].name!r}: its primitive cannot run in place in this thread")
        names[f"x{i}"], names[f"t{i}"] = call, result
    for i in direct:
        names[f"p{i}"] = bound[i].thread_run()
    return names


class _PerThread:
    """``run`` and ``timed`` for a program with layers on primitives: the generated functions,
    instantiated per thread and thread count with that thread's calls and results (see
    :func:`_thread_bindings`), as a primitive's memory objects are per thread and its
    blocking per thread count."""

    def __init__(self, code: Any, namespace: Mapping[str, Any], bindings: Callable[[], Mapping[str, Any]]) -> None:
        self._code, self._namespace, self._bindings = code, namespace, bindings
        self._local = threading.local()

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            fn = self._local.functions[torch.get_num_threads()][0]
        except (AttributeError, KeyError):  # this thread's first run at this thread count
            fn = self._instantiate()[0]
        return fn(*inputs)  # type: ignore[no-any-return]

    def timed(self, clock: Callable[[], int], stamps: list[int], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            fn = self._local.functions[torch.get_num_threads()][1]
        except (AttributeError, KeyError):
            fn = self._instantiate()[1]
        return fn(clock, stamps, *inputs)  # type: ignore[no-any-return]

    def _instantiate(self) -> tuple[RunFn, TimedRunFn]:
        namespace = {**self._namespace, **self._bindings()}
        exec(self._code, namespace)
        functions = getattr(self._local, "functions", None)
        if functions is None:
            functions = self._local.functions = {}
        made = functions[torch.get_num_threads()] = (namespace["run"], namespace["timed"])
        return made


def private_results(plan: Plan, groups: Sequence[Sequence[int]]) -> set[int]:
    """Indices of the layers on oneDNN primitives whose result nothing keeps past the run:
    not an output of the plan, and read only by layers that return new tensors (another
    primitive, or one of the ATen calls of ``_FRESH_OPS``), none in a region.

    Such a result is dead once its last reader has run, and each layer runs
    once a run, so the primitive may write it into memory planned for it in
    the thread's arena (:func:`arena_offsets`) instead of allocating a tensor
    per call. A view of the result, or a region (whose
    trace may return its input), could hand that memory to the caller, to be
    overwritten by the next run.
    """
    in_region = {i for group in groups if len(group) > 1 for i in group}
    fresh = {
        i
        for i, node in enumerate(plan.nodes)
        if i not in in_region and node.op != GETITEM and _returns_new(node)
    }
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(plan.nodes):
        for ref in node.refs():
            readers.setdefault(ref.name, []).append(index)
    outputs = {out.name for out in plan.outputs if isinstance(out, Ref)}
    return {
        index
        for index in fresh
        if tactics.on_primitive(plan.nodes[index])
        and plan.nodes[index].name not in outputs
        and set(readers.get(plan.nodes[index].name, [])) <= fresh
    }


def arena_offsets(plan: Plan, layers: set[int], last_use: Mapping[str, int]) -> tuple[dict[int, int], int]:
    """Byte offsets of ``layers``' results in one arena, and its size: results alive at the
    same time (from their layer to their last reader, both included) never overlap, and a
    result takes the lowest gap that fits among those alive, as ONNX Runtime's memory planner
    does.

    Reusing the memory of dead results keeps the arena about the size of the
    largest live set, so a result lands in memory a layer just used, still in
    the caches, as the allocator's most recently freed block would be; a buffer
    of its own for every result runs slower than new tensors per call.
    """
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, last use), by offset
    size = 0
    for index in sorted(layers):
        live = [block for block in live if block[2] >= index]
        need = -(-_bytes(plan.nodes[index]) // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
        start = 0
        for offset, end, _ in live:
            if offset - start >= need:
                break
            start = max(start, end)
        offsets[index] = start
        live = sorted([*live, (start, start + need, last_use.get(plan.nodes[index].name, index))])
        size = max(size, start + need)
    return offsets, size


class Arena:
    """Memory for planned results, one buffer per thread (a program's run may be called from
    several threads at once), each created by the thread's first call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._local = threading.local()

    def view(self, offset: int, nbytes: int, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This thread's tensor of ``shape``, ``strides`` and ``dtype`` on the ``nbytes`` planned at ``offset``."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = torch.empty(self.size, dtype=torch.uint8)
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
        if offset % ARENA_ALIGNMENT or offset + nbytes > self.size or extent * dtype.itemsize > nbytes:
            raise HarnessError(
                f"a result {tuple(shape)} {dtype} does not fit the {nbytes} bytes at {offset} of a {self.size}-byte arena"
            )
        return buffer[offset : offset + nbytes].view(dtype).as_strided(shape, strides)


def _bytes(node: Node) -> int:
    meta = node.out()
    return math.prod(meta.shape) * dtype_from_name(meta.dtype).itemsize


def _returns_new(node: Node) -> bool:
    """Whether ``node``'s tactic returns a new tensor, never its input or a view of it (a plan
    holds no op that writes its arguments, such as an ``out=`` overload: loading refuses them)."""
    entry = tactics.entry(node)
    aten_call = entry is not None and entry.aten_call
    return tactics.on_primitive(node) or (aten_call and plan_packet(node.op) in _FRESH_OPS)


def region_groups(nodes: Sequence[Node]) -> list[list[int]]:
    """Node indices in call order, the runs that form regions together.

    A run is made of oneDNN Graph layers and every plain layer (its op's own
    ATen call, one output, of the types above) before, between and after them:
    a transformer's positional add and first layer norm before its first
    linear layer, the pooling and the rescale of a squeeze-excite block
    between its convolutions, a transformer block's layer norms, attention,
    residual adds and the casts of weak and AMP typing. Plain layers with no
    graph layer after them before the next other layer stay calls of their
    own (a region of plain layers only would just add the trace's
    interpreter), and so do plain layers before a graph layer whose partition
    takes another layout than theirs: a channels-last convolution would be
    traced on the plain layout the leading layers give it, and compiled for it,
    a slower partition than the channels-last one. What a
    plain layer reads from before the region is made contiguous, as the trace
    saw it.
    """
    groups: list[list[int]] = []
    run: list[int] = []  # the open region's layers; the plain ones only, until a graph layer comes
    graph_seen = False

    def close() -> None:
        if graph_seen:
            groups.append(list(run))
        else:
            groups.extend([i] for i in run)
        run.clear()

    for index, node in enumerate(nodes):
        if tactics.on_graph_tactic(node):
            if not graph_seen and tactics.graph_input_layout(node) != torch.contiguous_format:
                close()
            run.append(index)
            graph_seen = True
        elif _plain_inner(node):
            run.append(index)
        else:
            close()
            graph_seen = False
            groups.append([index])
    close()
    return groups


def _plain_inner(node: Node) -> bool:
    """Whether ``node`` is a plain layer a region may trace (see :func:`region_groups`)."""
    entry = tactics.entry(node)
    return (
        entry is not None
        and entry.traceable
        and not node.multi
        and (tactics.layer_type(node) in _INNER_TYPES or plan_packet(node.op) in _INNER_OPS)
    )


def _region_call(
    name: str,
    nodes: Sequence[Node],
    group: Sequence[int],
    bound: dict[int, Any],
    metas: Mapping[str, TensorMeta],
    last_use: dict[str, int],
    variables: dict[str, str],
    namespace: dict[str, Any],
) -> str:
    """Compile ``nodes`` as one region; its statement assigns the results used after it."""
    inside = {node.name: k for k, node in enumerate(nodes)}
    keys: dict[tuple[str, tuple[int, ...]], int] = {}  # (value, strides) -> region input
    inputs: list[tuple[onednn_graph.Fixer, onednn_graph.InputMeta]] = []
    args: list[str] = []
    wiring: list[tuple[int, ...]] = []
    for k, node in enumerate(nodes):
        layer = bound[group[k]]
        reads = []
        for slot, ref in enumerate(node.refs()):
            if ref.name in inside:
                reads.append(-1 - inside[ref.name])  # resolved below, once the inputs are counted
                continue
            if isinstance(layer, onednn_graph.GraphLayer):  # its partition's layout
                fix, meta = layer.fixers[slot], layer.inputs[slot]
            else:  # a plain layer's input, contiguous as ATen ops mostly return them
                meta = onednn_graph.input_meta(metas[ref.name].shape, metas[ref.name].dtype, torch.contiguous_format)
                fix = onednn_graph.exact_layout(meta[0], meta[1], torch.contiguous_format)
            key = (ref.name, meta[1])
            if key not in keys:
                keys[key] = len(inputs)
                inputs.append((fix, meta))
                args.append(variables[ref.name])
            reads.append(keys[key])
        wiring.append(tuple(reads))
    wiring = [tuple(r if r >= 0 else len(inputs) - 1 - r for r in reads) for reads in wiring]
    produced = [k for k, node in enumerate(nodes) if last_use.get(node.name, -1) > group[-1]]
    for k in produced:
        variables[nodes[k].name] = f"v{group[k]}"
    namespace[name] = onednn_graph.compile_region(
        f"{nodes[0].name}..{nodes[-1].name}",
        [_traced_form(node, bound[i], metas) for node, i in zip(nodes, group, strict=True)],
        inputs,
        wiring,
        [len(inputs) + k for k in produced],
    )
    call = f"{name}({', '.join(args)})"
    return f"{''.join(f'v{group[k]}, ' for k in produced)}= {call}" if produced else call


def _traced_form(node: Node, layer: Any, metas: Mapping[str, TensorMeta]) -> Any:
    """What a region traces for ``node``: its bound call, except an adaptive average pooling
    that equals a fixed-window one, which is traced as that: the bridge maps only the
    fixed-window one to oneDNN, where the pooling then takes the convolution's result in
    oneDNN's layout instead of a reorder to a plain tensor and back (a squeeze-excite block's
    global pooling).
    """
    window = tactics.avg_pool_window(node, metas)
    return layer if window is None else tactics.window_pool(window)
