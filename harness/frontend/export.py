"""Export a model with ``torch.export`` and make the graph standalone.

``torch.export`` (pre-dispatch / training IR) keeps ``with torch.autocast``
regions as ``torch.ops.higher_order.wrap_with_autocast`` nodes and keeps
composite ops such as ``aten.linear`` whole, which is what both the rule-based
classifier and exact AMP semantics need. The exported graph takes weights as
placeholder inputs; engines and passes want a graph whose only inputs are the
user's tensors, so weights become ``get_attr`` constants owned by the module.
"""

from __future__ import annotations

import copy
import io
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.overrides import TorchFunctionMode

from harness.errors import HarnessError, first_line
from harness.frontend.provenance import DtypeProvenance, confirm_links, probe_calls
from harness.globalstate import preserves_global_state
from harness.naming import fresh_name

_log = logging.getLogger(__name__)

_DTYPE_METHODS = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
    torch.Tensor.double: torch.float64,
}


class _CastsCopy(TorchFunctionMode):
    """Make every dtype conversion in the traced code a real copy.

    At export time everything is fp32, so ``h.float()`` returns ``h`` itself and
    the tracer then records later uses of ``h`` as uses of the cast. Once the
    compiler lowers ``h`` that is wrong (eager autocast sees two tensors there).
    Tracing the cast with ``copy=True`` keeps the two values apart; the copy
    has the same values, so the model's meaning is unchanged.
    """

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DTYPE_METHODS and len(args) == 1 and not kwargs.get("memory_format"):
            return args[0].to(_DTYPE_METHODS[func], copy=True)
        if func is torch.Tensor.type_as and len(args) == 2:
            return args[0].to(args[1].dtype, copy=True)
        if func is torch.Tensor.to and "copy" not in kwargs:
            kwargs = {**kwargs, "copy": True}
        return func(*args, **kwargs)


@contextmanager
def _torch_output_captured() -> Iterator[io.StringIO]:
    """Keep what torch.export writes while tracing (its log, graph dumps on failure) off the terminal.

    A failed export prints a dozen lines of its own before raising; the user
    needs the one error the harness makes of it. The text is kept for
    ``harness -v`` (debug log) and the logging switch is restored afterwards.
    """
    captured = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with redirect_stderr(captured):
            yield captured
    finally:
        logging.disable(previous)


@contextmanager
def _in_eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Trace the inference graph, then give every submodule its own ``training`` flag back.

    ``module.eval()`` is what export needs (dropout off, batch norm on running
    statistics), but the module is the caller's: one still training must not
    come back switched to eval mode, on success or on failure.
    """
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


@preserves_global_state
def export_program(module: torch.nn.Module, example_inputs: Sequence[Any]) -> ExportedProgram:
    """``torch.export.export`` with failures turned into one clear error.

    Nodes whose dtype argument follows another tensor at run time carry a link
    to it (:mod:`harness.frontend.provenance`; a bare ``dtype=`` argument costs a
    second, float64 trace on the ``meta`` device to confirm). Export runs the
    model's Python ``forward``: whatever it does to the process (reseeding,
    thread count, grad mode) is undone, and the module keeps its ``training``
    flags and its parameters.
    """
    if not isinstance(module, torch.nn.Module):
        raise HarnessError(f"expected a torch.nn.Module or ExportedProgram, got {type(module).__name__}")
    args = tuple(example_inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args) or "nothing"
        raise HarnessError(f"example inputs must be a non-empty tuple of tensors (got {kinds})")
    provenance = DtypeProvenance()
    try:
        ep = _trace(module, args, provenance)
    except Exception as exc:  # export raises many unrelated types; the user needs the text
        first = first_line(exc)
        raise HarnessError(
            f"model {type(module).__name__} failed to export with torch.export: {type(exc).__name__}: {first}. "
            "The model must be traceable by torch.export (no data-dependent Python control flow)."
        ) from exc
    finally:
        provenance.release()
    if provenance.pending:
        confirm_links(ep, provenance.calls, probe_calls(module, args, _trace))
    return ep


def _trace(module: torch.nn.Module, args: tuple[torch.Tensor, ...], provenance: TorchFunctionMode) -> ExportedProgram:
    """One ``torch.export`` of ``module`` in eval mode, casts traced as copies, ``provenance`` watching the calls."""
    with _in_eval_mode(module), _CastsCopy(), provenance, warnings.catch_warnings(), _torch_output_captured() as captured:
        # A torch.autocast(cpu, float32) region is recorded as disabled; the
        # precision report says so per node, so PyTorch's warning is noise here.
        warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
        try:
            return torch.export.export(module, args)
        except Exception:
            _log.debug("torch.export output before the failure:\n%s", captured.getvalue())
            raise


def _attr_name(target: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", target) or "const"
    if base[0].isdigit():
        base = "_" + base
    name = fresh_name(base, taken.__contains__)
    taken.add(name)
    return name


def standalone_graph(ep: ExportedProgram) -> torch.fx.GraphModule:
    """A GraphModule whose placeholders are the user inputs and whose weights are ``get_attr``.

    Outputs are returned as a flat tuple. Each weight node keeps its state-dict
    name in ``meta["weight_name"]`` so reports can name it. Buffer mutation
    (a module left in training mode) is refused: an inference graph must be pure.
    """
    sig = ep.graph_signature
    bad_out = [s for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if bad_out:
        raise HarnessError(
            f"the model mutates state during forward ({bad_out[0].kind.name} of {bad_out[0].target}); "
            "call model.eval() and remove in-place updates of buffers"
        )
    gm: torch.fx.GraphModule = copy.deepcopy(ep.graph_module)  # never mutate the caller's program
    taken = set(dict(gm.named_children())) | set(dict(gm.named_parameters())) | set(dict(gm.named_buffers()))
    constants = {**ep.state_dict, **ep.constants}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(sig.input_specs, placeholders, strict=True):
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise HarnessError(f"unsupported exported input {spec.arg.name} of kind {spec.kind.name}")
        value = constants[spec.target]
        attr = _attr_name(spec.target, taken)
        if spec.kind == InputKind.PARAMETER:
            # Keep Parameters as Parameters: some kernels (aten.matmul) take another
            # path for operands that require grad, and the typed graph must match eager.
            gm.register_parameter(attr, torch.nn.Parameter(value.detach(), requires_grad=value.requires_grad))
        else:
            gm.register_buffer(attr, value.detach())
        with gm.graph.inserting_before(node):
            get = gm.graph.get_attr(attr)
        get.meta.update(node.meta)
        get.meta["weight_name"] = spec.target
        node.replace_all_uses_with(get)
        gm.graph.erase_node(node)
    output = gm.graph.output_node()
    outs = output.args[0]
    output.args = (tuple(outs) if isinstance(outs, (list, tuple)) else (outs,),)
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            for arg, a in zip(target._schema.arguments, node.args, strict=False):
                if arg.is_write and isinstance(a, torch.fx.Node) and a.op == "get_attr":
                    raise weight_write_error(node, a)
    gm.graph.lint()
    gm.recompile()
    return gm


def weight_write_error(node: torch.fx.Node, weight: torch.fx.Node, through: torch.fx.Node | None = None) -> HarnessError:
    """The one refusal of a node that writes into a weight, buffer or tensor attribute.

    Eager would change the model itself on every call (the next call sees
    other values), which no typed graph or engine reproduces. Used here for
    direct writes and by the functionalization pass for writes through views
    (``self.buf[1:3] += x``), so both read alike.
    """
    view = f" through the view {through.name}" if through is not None else ""
    return HarnessError(
        f"node {node.name} ({node.target}) updates {weight.meta.get('weight_name', weight.target)} in place{view}; "
        "an inference graph must not mutate its weights or buffers (call model.eval(), or write into a copy "
        "such as .clone())"
    )


@preserves_global_state
def load_graph(model: torch.nn.Module | ExportedProgram, example_inputs: Sequence[Any] | None) -> torch.fx.GraphModule:
    """Accept an ``nn.Module`` with example inputs, or an ``ExportedProgram`` (global state preserved)."""
    if isinstance(model, ExportedProgram):
        return standalone_graph(model)
    if example_inputs is None:
        raise HarnessError("an nn.Module needs example inputs to export")
    return standalone_graph(export_program(model, example_inputs))
