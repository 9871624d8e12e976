"""``compile``: model in, explicitly typed FX graph and precision report out.

Pipeline ("Autocast compiler" in docs/design.md): export -> inline autocast regions -> structural
lowering -> (AMP: expand composites whose parts autocast sees) -> calibrate ->
classify -> insert casts -> clean up -> decompositions. Every stage is a
function of the graph; the result runs with ambient autocast disabled, so its
types are the ones written in it whatever the caller's autocast state.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram

from harness.autocast import bias_correction
from harness.autocast.amp_lists import check_amp_table, policy_for
from harness.autocast.calibrate import (
    Calibration,
    calibrate,
    check_calibration_data,
    default_calibration_data,
)
from harness.autocast.casts import insert_casts, retype_inputs
from harness.autocast.classify import POLICIES, classify, rules_for
from harness.autocast.cleanup import CLEANUP
from harness.autocast.regions import Region, inline_higher_order_ops
from harness.autocast.report import PrecisionReport, build_report
from harness.autocast.rules import Context, effective_state, unmatched_selectors
from harness.autocast.settings import (
    EXPLICIT_TYPES,
    AutocastSettings,
    compile_patterns,
    parse_dtype,
)
from harness.autocast.verify import verify_graph
from harness.errors import HarnessError
from harness.frontend.export import export_program, standalone_graph
from harness.fxutil import (
    cast_floating,
    fake_mode_of,
    has_eager_kernel,
    input_nodes,
    splice,
    trace_call,
)
from harness.globalstate import preserves_global_state
from harness.lowering.decompose import DecompositionTable, decompose
from harness.lowering.functionalize import functionalize_inplace
from harness.lowering.layout import channels_last_weights
from harness.lowering.pass_manager import PassManager, default_pass_manager, validate
from harness.opnames import out_of_place_packet, overload_names
from harness.outputs import OutputSpec, output_spec_of


@dataclass
class CompiledGraph:
    """An explicitly typed graph: what engines consume.

    Its inputs are typed like every other value: with ``keep_io_types=False`` a
    floating input consumed only in the low precision takes that dtype
    (:attr:`input_dtypes`). ``example_inputs`` are therefore held in those
    dtypes (converted on construction), so that everything that runs or
    traces the graph on them (the CPU builder's timing runs, the ONNX export,
    an engine's first run) feeds what the graph declares; other batches of
    model inputs go through :meth:`typed_inputs`.
    """

    graph_module: torch.fx.GraphModule
    report: PrecisionReport
    example_inputs: tuple[torch.Tensor, ...]
    policy: str
    low_precision_type: torch.dtype
    outputs: OutputSpec
    device: str = "cpu"
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.example_inputs = self.typed_inputs(self.example_inputs)

    @property
    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(n.meta["val"].dtype for n in self.graph_module.graph.nodes if n.op == "placeholder")

    def typed_inputs(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A batch of the model's inputs in the dtypes the graph takes (see :func:`cast_floating`)."""
        return cast_floating(batch, self.input_dtypes)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The model's outputs in the structure the eager model returns (dict, ModelOutput, ...)."""
        return self.outputs.unflatten(self.run(*inputs))

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The flat output tuple, in :attr:`outputs` order (what engines compute).

        Inputs must have :attr:`input_dtypes`; an input of another floating
        dtype is refused by name (checked only once the graph has failed, so
        a call costs nothing more than the graph).
        """
        # Ambient autocast must not re-type an explicitly typed graph.
        with ExitStack() as stack:
            for device in {"cpu", self.device}:
                stack.enter_context(torch.autocast(device, enabled=False))
            stack.enter_context(torch.inference_mode())
            try:
                return tuple(self.graph_module(*inputs))
            except Exception:
                self._check_input_dtypes(inputs)
                raise

    def _check_input_dtypes(self, inputs: Sequence[Any]) -> None:
        placeholders = [n.name for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        for name, x, want in zip(placeholders, inputs, self.input_dtypes, strict=False):
            if isinstance(x, torch.Tensor) and x.dtype != want:
                raise HarnessError(
                    f"typed graph input {name!r}: expected {want}, got {x.dtype} (a graph compiled with "
                    "keep_io_types=False takes its floating inputs in the low precision; convert a batch "
                    "with CompiledGraph.typed_inputs)"
                )


_log = logging.getLogger(__name__)

_BACKEND_KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}
# Kernels written once in other ATen ops for every backend; eager runs them when
# the backend has no kernel of its own, and their calls re-enter the dispatcher,
# autocast included.
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd")
_MAX_EXPANSION_DEPTH = 4


def _mutates(sub: torch.fx.GraphModule) -> bool:
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in sub.graph.nodes
    )


def _out_of_place_view(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``transpose_.default`` -> ``transpose.int``: the view op with the same arguments, if ``op`` is an in-place view."""
    packet = out_of_place_packet(op)
    if packet is None:
        return None
    wanted = [(a.name, str(a.type)) for a in op._schema.arguments]
    for overload in overload_names(packet):
        twin = getattr(packet, overload)
        returns = twin._schema.returns
        if [(a.name, str(a.type)) for a in twin._schema.arguments] == wanted and returns and returns[0].alias_info:
            return twin if not returns[0].alias_info.is_write else None
    return None


def _restride_out_of_place(body: torch.fx.GraphModule) -> None:
    """In-place view ops (``transpose_``, ``squeeze_``) in a traced body become their view ops.

    They change a tensor's sizes and strides, never its data or any other
    alias, and a trace reads the tensor after the op through the op's own
    result, so the view op computes the same. (Writes of data are left to
    :func:`functionalize_inplace`.)
    """
    for node in body.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        twin = _out_of_place_view(node.target) if node.target._schema.is_mutable else None
        source = node.args[0] if node.args else None
        if twin is not None and isinstance(source, torch.fx.Node) and all(u < node for u in source.users if u is not node):
            node.target = twin  # nothing reads the tensor's old shape after the op
    body.recompile()


def _composite_body(node: torch.fx.Node, device: str, fake_mode: FakeTensorMode) -> torch.fx.GraphModule | None:
    """The ATen calls eager makes for ``node`` on ``device`` when its kernel is written in other ops.

    Two kinds of kernel are: ``CompositeImplicitAutograd`` ones (``einsum``,
    ``tensordot``, ``bilinear``, ``rnn_tanh``) and ``CompositeExplicitAutograd``
    ones the backend has no override for (``_trilinear``, which ``bilinear``
    calls: zeros, then one ``bmm`` pair per output feature added in). Views
    compute nothing and backend kernels are opaque, so both stay whole.

    The body is the kernel's *own* calls, one level deep, traced as export
    traces (pre-dispatch): autocast intercepts ``linear`` inside ``rnn_tanh``
    as ``linear`` (casting its bias too), not as the ``addmm`` it becomes
    further down. It is the C++ kernel eager runs, never a Python
    decomposition torch may register for the op (``upsample_bicubic2d.vec``),
    which computes differently.
    """
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.has_kernel_for_dispatch_key(_BACKEND_KEYS[device]):
        return None
    if op._schema.is_mutable or any(r.alias_info is not None for r in op._schema.returns):
        return None
    if not any(isinstance(v := a.meta.get("val"), torch.Tensor) and v.is_floating_point() for a in input_nodes(node)):
        return None  # autocast casts floating-point tensor arguments only (factories, integer ops)
    key = next((k for k in _COMPOSITE_KEYS if has_eager_kernel(op, k)), None)  # the C++ kernel, called below
    if key is None:
        return None
    kernel = functools.partial(op._op_dk, getattr(torch._C.DispatchKey, key))
    try:
        body = trace_call(node, op, fake_mode, {op: kernel}, pre_dispatch=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types from a kernel on fake tensors
        if key == "CompositeImplicitAutograd":
            raise
        # An explicit kernel that does not run on fake tensors stays whole (as every
        # explicit kernel did before they were looked into); logged for whoever
        # debugs a mismatch with eager.
        _log.debug("node %s: %s kept whole, its %s kernel does not trace: %s", node.name, op, key, exc)
        return None
    body.graph.eliminate_dead_code()  # queries such as cudnn_is_acceptable
    body.recompile()
    return body


def _autocast_expansion(
    node: torch.fx.Node, device: str, fake_mode: FakeTensorMode, depth: int = _MAX_EXPANSION_DEPTH
) -> torch.fx.GraphModule | None:
    """``node``'s composite body if eager autocast sees a listed op anywhere inside it, else ``None``.

    Looks through nested composites (``bilinear`` -> ``_trilinear`` -> ``bmm``):
    a body whose listed ops sit one composite deeper still changes types in
    eager. A body with no listed op at any depth runs in its inputs' dtypes
    exactly as the whole op does, so it stays whole (engines keep their kernel).
    """
    op = node.target
    if depth == 0 or not isinstance(op, torch._ops.OpOverload) or policy_for(op, device) is not None:
        return None
    body = _composite_body(node, device, fake_mode)
    if body is None:
        return None
    for part in body.graph.nodes:
        if part.op != "call_function" or not isinstance(part.target, torch._ops.OpOverload):
            continue
        if policy_for(part.target, device) is not None or _autocast_expansion(part, device, fake_mode, depth - 1):
            # Kernels write into buffers they allocate (_trilinear: zeros, then
            # narrow(...).add_); engines run nodes as pure functions.
            _restride_out_of_place(body)
            return functionalize_inplace(body).graph_module if _mutates(body) else body
    return None


def _expand_autocast_composites(gm: torch.fx.GraphModule, device: str, ambient: Region | None) -> None:
    """Composite ops autocast does not list run as their parts, which autocast does see.

    Eager autocast intercepts listed ops only; an unlisted composite (e.g.
    ``einsum``) falls through to its kernel, whose own calls (``bmm``) go
    through the dispatcher again, autocast included. Such composites are
    replaced by those calls so the policy applies to the parts, as in eager
    (see :func:`_autocast_expansion`).
    """
    fake_mode = fake_mode_of(gm)
    pending = [n for n in gm.graph.nodes if n.op == "call_function"]
    while pending:
        node = pending.pop()
        state = effective_state(node, device, ambient)
        if state is None or not state.enabled:
            continue
        sub = _autocast_expansion(node, device, fake_mode)
        if sub is not None:
            pending.extend(splice(gm, node, sub))
    gm.graph.lint()
    gm.recompile()


def _explicit_patterns(explicit: Mapping[str, Any] | None) -> list[tuple[Any, torch.dtype]]:
    if not explicit:
        raise HarnessError("policy 'explicit' needs a mapping of node-name regexes to dtypes (fp32, fp16, bf16)")
    patterns = compile_patterns(list(explicit), "explicit")
    return [(p, parse_dtype(explicit[p.pattern], f"explicit pattern {p.pattern!r}", EXPLICIT_TYPES)) for p in patterns]


@preserves_global_state
def compile(
    model: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[torch.Tensor] | None = None,
    *,
    policy: str = "rule",
    low_precision_type: torch.dtype | str | None = None,
    settings: AutocastSettings | None = None,
    explicit: Mapping[str, Any] | None = None,
    calibration_data: Sequence[Sequence[torch.Tensor]] | None = None,
    device: str = "cpu",
    amp_enabled: bool = True,
    inference_mode: bool = False,
    lowering: PassManager | None = None,
    decompositions: DecompositionTable | None = None,
    verify: bool = True,
) -> CompiledGraph:
    """Compile ``model`` to an explicitly typed graph.

    Policies: ``fp32`` (nothing lowered; the model's own autocast regions apply as
    in eager), ``full`` (whole graph low), ``rule`` (rule-based classifier),
    ``amp`` (PyTorch AMP policy for ``device``; with ``amp_enabled=False`` it
    is the plain eager behaviour), ``explicit`` (node-name regex -> dtype).
    The exact policies reproduce eager run with grad enabled or under ``torch.no_grad``;
    with ``inference_mode`` they reproduce eager under ``torch.inference_mode``, where
    autocast's casts of parameters do not require grad (some CPU kernels differ in the last
    bits between the two). With ``verify`` the result is run once on the example inputs
    (see verify.py).
    """
    if policy not in POLICIES:
        raise HarnessError(f"unknown compiler policy {policy!r}; valid: {', '.join(POLICIES)}")
    if policy == "amp":
        check_amp_table(device)  # exact only with this torch's own autocast lists
    if settings is None:
        settings = AutocastSettings(low_precision_type=low_precision_type or torch.float16)
    elif low_precision_type is not None and parse_dtype(low_precision_type, "low_precision_type") != settings.low:
        raise HarnessError("low_precision_type disagrees with settings.low_precision_type; give it once")
    low = settings.low
    patterns = _explicit_patterns(explicit) if policy == "explicit" else []
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    with torch.autocast("cpu", enabled=False):
        if isinstance(model, ExportedProgram):
            ep = model
            if example_inputs is None:
                example_inputs = tuple(ep.example_inputs[0]) if ep.example_inputs else None
        else:
            if example_inputs is None:
                raise HarnessError("compile: an nn.Module needs example_inputs")
            ep = export_program(model, example_inputs)
        if example_inputs is None:
            raise HarnessError("compile: the ExportedProgram carries no example inputs; pass example_inputs")
        examples = tuple(example_inputs)
        gm = standalone_graph(ep)
        timings["export"] = time.perf_counter() - t0

        gm = inline_higher_order_ops(gm)
        gm = (lowering or default_pass_manager(exact=policy in ("amp", "fp32")))(gm)
        ambient = None
        if policy == "amp":
            ambient = Region(device, low, amp_enabled)
        elif policy == "fp32":
            ambient = Region(device, low, False)
        if policy in ("amp", "fp32"):
            _expand_autocast_composites(gm, device, ambient)
        timings["lowering"] = time.perf_counter() - t0 - timings["export"]

        calib: Calibration | None = None
        batches: list[tuple[torch.Tensor, ...]] = []
        if policy == "rule" and (settings.data_max is not None or settings.bias_correction):
            t1 = time.perf_counter()
            data = settings.calibration_data or calibration_data
            batches = check_calibration_data(data, examples) if data is not None else default_calibration_data(examples)
            if settings.data_max is not None:
                calib = calibrate(gm, batches)
            timings["calibration"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        ctx = Context(gm=gm, device=device, low=low, settings=settings, calibration=calib, ambient=ambient)
        decisions = classify(gm, ctx, rules_for(policy, patterns))
        # the rule policy's classifier is the one that reads them; checked before casts rename nothing
        unmatched = unmatched_selectors(gm, settings) if policy == "rule" else []
        corrections = (
            bias_correction.measure(gm, decisions, low, batches) if policy == "rule" and settings.bias_correction else {}
        )
        timings["classify"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        exact_amp = policy in ("amp", "fp32")
        stats = insert_casts(
            gm,
            decisions,
            clip_fp16=not exact_amp,
            cast_outputs_back=settings.keep_io_types and not exact_amp,
            mixed_norms=not exact_amp,
            copies_require_grad=not inference_mode,
        )
        corrected = bias_correction.apply(gm, corrections, low) if corrections else 0
        if not settings.keep_io_types and not exact_amp:
            retype_inputs(gm)
        gm = CLEANUP(gm)
        if not exact_amp:
            gm = validate(channels_last_weights(gm))
        table = decompositions if decompositions is not None else DecompositionTable()
        gm = decompose(gm, table)
        timings["casts"] = time.perf_counter() - t3
        if verify:
            t4 = time.perf_counter()
            input_dtypes = [n.meta["val"].dtype for n in gm.graph.nodes if n.op == "placeholder"]
            verify_graph(gm, cast_floating(examples, input_dtypes))
            timings["verify"] = time.perf_counter() - t4

    report = build_report(gm, decisions, policy, low, stats)
    report.warnings = unmatched
    report.biases_corrected = corrected
    timings["total"] = time.perf_counter() - t0
    return CompiledGraph(gm, report, examples, policy, low, output_spec_of(ep), device, timings)
