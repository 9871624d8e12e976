"""``compile``: model in, explicitly typed FX graph and precision report out.

Pipeline (DESIGN.md section 1): export -> inline autocast regions -> structural
lowering -> (AMP: expand composites whose parts autocast sees) -> calibrate ->
classify -> insert casts -> clean up -> decompositions. Every stage is a
function of the graph; the result runs with ambient autocast disabled, so its
types are the ones written in it whatever the caller's autocast state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from harness.autocast.amp_lists import policy_for
from harness.autocast.calibrate import (
    Calibration,
    calibrate,
    check_calibration_data,
    default_calibration_data,
)
from harness.autocast.casts import insert_casts, retype_inputs
from harness.autocast.classify import MODES, classify, rules_for
from harness.autocast.cleanup import CLEANUP
from harness.autocast.regions import Region, inline_higher_order_ops
from harness.autocast.report import PrecisionReport, build_report
from harness.autocast.rules import Context, effective_state
from harness.autocast.settings import DTYPES, AutocastSettings, compile_patterns, parse_dtype
from harness.autocast.verify import verify_graph
from harness.errors import HarnessError
from harness.frontend.export import export_program, standalone_graph
from harness.fxutil import fake_mode_of, splice, trace_call
from harness.globalstate import preserves_global_state
from harness.lowering.decompose import DecompositionTable, decompose
from harness.lowering.layout import channels_last_weights
from harness.lowering.pass_manager import PassManager, default_pass_manager, validate
from harness.outputs import OutputSpec, output_spec_of


@dataclass
class CompiledGraph:
    """An explicitly typed graph: what engines consume."""

    graph_module: torch.fx.GraphModule
    report: PrecisionReport
    example_inputs: tuple[torch.Tensor, ...]
    mode: str
    low_precision_type: torch.dtype
    outputs: OutputSpec
    device: str = "cpu"
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(n.meta["val"].dtype for n in self.graph_module.graph.nodes if n.op == "placeholder")

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The model's outputs in the structure the eager model returns (dict, ModelOutput, ...)."""
        return self.outputs.unflatten(self.run(*inputs))

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The flat output tuple, in :attr:`outputs` order (what engines compute)."""
        # Ambient autocast must not re-type an explicitly typed graph.
        with ExitStack() as stack:
            for device in {"cpu", self.device}:
                stack.enter_context(torch.autocast(device, enabled=False))
            stack.enter_context(torch.inference_mode())
            return tuple(self.graph_module(*inputs))


def _expand_autocast_composites(gm: torch.fx.GraphModule, device: str, ambient: Region | None) -> None:
    """Composite ops autocast does not list run as their parts, which autocast does see.

    Eager autocast intercepts listed ops only; an unlisted composite (e.g.
    ``einsum``) falls through to its decomposition, whose ``bmm`` *is* listed.
    Such composites are replaced by their decomposition so the policy applies
    to the parts, as in eager; composites whose parts are all unlisted stay whole.
    """
    fake_mode = fake_mode_of(gm)
    pending = [n for n in gm.graph.nodes if n.op == "call_function"]
    while pending:
        node = pending.pop()
        op = node.target
        if not isinstance(op, torch._ops.OpOverload) or policy_for(op, device) is not None:
            continue
        state = effective_state(node, device, ambient)
        if state is None or not state.enabled:
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            continue
        sub = trace_call(node, op.decompose, fake_mode)
        parts = [n.target for n in sub.graph.nodes if n.op == "call_function"]
        if any(isinstance(t, torch._ops.OpOverload) and policy_for(t, device) is not None for t in parts):
            pending.extend(splice(gm, node, sub))
    gm.graph.lint()
    gm.recompile()


def _explicit_patterns(explicit: Mapping[str, Any] | None) -> list[tuple[Any, torch.dtype]]:
    if not explicit:
        raise HarnessError("mode 'explicit' needs a mapping of node-name regexes to dtypes (fp32, fp16, bf16)")
    patterns = compile_patterns(list(explicit), "explicit")
    return [(p, parse_dtype(explicit[p.pattern], f"explicit pattern {p.pattern!r}", DTYPES)) for p in patterns]


@preserves_global_state
def compile(
    model: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[torch.Tensor] | None = None,
    *,
    mode: str = "rule",
    low_precision_type: torch.dtype | str | None = None,
    settings: AutocastSettings | None = None,
    explicit: Mapping[str, Any] | None = None,
    calibration_data: Sequence[Sequence[torch.Tensor]] | None = None,
    device: str = "cpu",
    amp_enabled: bool = True,
    lowering: PassManager | None = None,
    decompositions: DecompositionTable | None = None,
    verify: bool = True,
) -> CompiledGraph:
    """Compile ``model`` to an explicitly typed graph.

    Modes: ``fp32`` (nothing lowered; the model's own autocast regions apply as
    in eager), ``full`` (whole graph low), ``rule`` (rule-based classifier),
    ``amp`` (PyTorch AMP policy for ``device``; with ``amp_enabled=False`` it
    is the plain eager behaviour), ``explicit`` (node-name regex -> dtype).
    With ``verify`` the result is run once on the example inputs (see verify.py).
    """
    if mode not in MODES:
        raise HarnessError(f"unknown compile mode {mode!r}; valid: {', '.join(MODES)}")
    if settings is None:
        settings = AutocastSettings(low_precision_type=low_precision_type or torch.float16)
    elif low_precision_type is not None and parse_dtype(low_precision_type, "low_precision_type") != settings.low:
        raise HarnessError("low_precision_type disagrees with settings.low_precision_type; give it once")
    low = settings.low
    patterns = _explicit_patterns(explicit) if mode == "explicit" else []
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
        gm = (lowering or default_pass_manager(exact=mode in ("amp", "fp32")))(gm)
        ambient = None
        if mode == "amp":
            ambient = Region(device, low, amp_enabled)
        elif mode == "fp32":
            ambient = Region(device, low, False)
        if mode in ("amp", "fp32"):
            _expand_autocast_composites(gm, device, ambient)
        timings["lowering"] = time.perf_counter() - t0 - timings["export"]

        calib: Calibration | None = None
        if mode == "rule" and settings.data_max is not None:
            t1 = time.perf_counter()
            data = settings.calibration_data or calibration_data
            batches = check_calibration_data(data, examples) if data is not None else default_calibration_data(examples)
            calib = calibrate(gm, batches)
            timings["calibration"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        ctx = Context(gm=gm, device=device, low=low, settings=settings, calibration=calib, ambient=ambient)
        decisions = classify(gm, ctx, rules_for(mode, patterns))
        timings["classify"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        exact_amp = mode in ("amp", "fp32")
        stats = insert_casts(
            gm,
            decisions,
            clip_fp16=not exact_amp,
            cast_outputs_back=settings.keep_io_types and not exact_amp,
            mixed_norms=not exact_amp,
        )
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
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            verify_graph(gm, [x.to(p.meta["val"].dtype) for x, p in zip(examples, placeholders, strict=True)])
            timings["verify"] = time.perf_counter() - t4

    report = build_report(gm, decisions, mode, low, stats)
    timings["total"] = time.perf_counter() - t0
    return CompiledGraph(gm, report, examples, mode, low, output_spec_of(ep), device, timings)
