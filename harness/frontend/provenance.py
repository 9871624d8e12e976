"""Which traced values take their dtype from another tensor at run time.

``torch.export`` records every dtype argument as a constant, the dtype it saw
while tracing. Several ways of writing a dtype in Python do not name one,
though: they name a tensor whose dtype is read when the line runs.

- ``x.to(y)``, ``x.type_as(y)``: ``y``'s dtype;
- ``x.to(y.device)`` (or ``x.to(copy=True)``): ``x``'s own dtype, which ``Tensor.to``
  fills in, so the trace bakes the dtype of the trace into a cast;
- ``torch.zeros(n, dtype=y.dtype)``, ``y.new_zeros(n, dtype=d)``, ``x.to(d)`` with
  ``d = y.dtype`` read earlier: ``y``'s dtype, passed as a bare ``torch.dtype``.

Under autocast those tensors change dtype and eager follows them; a typed graph
holding the constant does not. :class:`DtypeProvenance` watches the Python calls
while export traces and writes the link into the traced nodes' metadata:
:data:`VALUE_ID` names a tensor's node, :data:`DTYPE_FOLLOWS` on a node says
that its ``dtype`` argument is that tensor's dtype at run time. The compiler
resolves the links once the tensors have their decided types
(:mod:`harness.autocast.follow`).

The first two kinds are exact: the call names the tensor. A bare dtype carries
no tensor; its source is taken to be the tensor whose ``dtype`` was read last in
a Python frame that is still running when the call is made (the frame that reads
it, or one of its callers; reads inside functions that have returned do not
count). Whether the dtype came from that read or was written as a literal
(``h.to(torch.float32)`` right after ``d = h.dtype``) is settled by a probe:
the model is traced a second time with every floating tensor in float64 on the
``meta`` device, and a bare dtype that followed a tensor changes with it while
a literal does not. Links whose probe answer is missing (the probe failed, or
its calls did not line up with the trace's) are dropped: the constant stays, as
``torch.export`` recorded it.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.experimental import proxy_tensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

_log = logging.getLogger(__name__)

VALUE_ID = "harness_value_id"
DTYPE_FOLLOWS = "harness_dtype_follows"
# A link still to be confirmed by the probe: (value id, index of the bare-dtype call).
_PENDING = "harness_dtype_follows_pending"

PROBE_DTYPE = torch.float64
_DTYPE_GETTER = torch._C.TensorBase.dtype
_SKIPPED_FILES = (__file__, torch.overrides.__file__)


@dataclass(frozen=True)
class _Read:
    """A ``tensor.dtype`` read while tracing: the frame that read it, and the tensor's node."""

    frame: FrameType
    node: torch.fx.Node
    dtype: torch.dtype


def _traced_node(value: object) -> torch.fx.Node | None:
    """The node the running export trace records ``value`` as (``None`` outside a trace or for a constant)."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(value, torch.Tensor):
        return None
    slot = proxy_tensor.get_proxy_slot(value, mode.tracer, None)
    proxy = getattr(slot, "proxy", None)
    node = getattr(proxy, "node", None)
    return node if isinstance(node, torch.fx.Node) else None


def _caller_frame() -> FrameType | None:
    """The innermost frame that is no torch-function handler (this mode's, export's own): the code that made the call."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_name == "__torch_function__" or frame.f_code.co_filename in _SKIPPED_FILES):
        frame = frame.f_back
    return frame


def _running_frames() -> set[int]:
    ids: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        ids.add(id(frame))
        frame = frame.f_back
    return ids


def _bare_dtype(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The floating ``torch.dtype`` passed to a call, by keyword or position (``x.to(d)``)."""
    given = kwargs.get("dtype")
    if given is None:
        given = next((a for a in args if isinstance(a, torch.dtype)), None)
    return given if isinstance(given, torch.dtype) and given.is_floating_point else None


def _func_name(func: Any) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func)


class DtypeProvenance(TorchFunctionMode):
    """Record, while export traces, which nodes' dtype arguments follow a tensor (see the module doc).

    ``calls`` is the sequence of calls given a bare floating dtype, as
    (function name, dtype): the probe trace records its own, and
    :func:`confirm_links` lines the two up.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype]] = []
        self.pending = 0
        self._reads: list[_Read] = []
        self._ids = itertools.count()

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            # Export traces a higher-order op's branches (torch.cond) with dynamo, which must
            # see through every active mode: this one only watches the Python-level trace.
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DTYPE_GETTER:
            result = func(*args, **kwargs)
            self._read(args[0], result)
            return result
        exact = self._named_source(func, args, kwargs)
        bare = None if exact is not None else _bare_dtype(args, kwargs)
        if bare is not None:
            self.calls.append((_func_name(func), bare))
        result = func(*args, **kwargs)
        node = _traced_node(result)
        if node is None or any(node is _traced_node(a) for a in args):
            return result  # nothing new recorded (an alias, or a value export keeps as a constant)
        if exact is not None:
            source = _traced_node(exact)
            if source is not None:
                node.meta[DTYPE_FOLLOWS] = self._value_id(source)
        elif bare is not None:
            read = self._live_read(bare)
            if read is not None:
                node.meta[_PENDING] = (self._value_id(read.node), len(self.calls) - 1)
                self.pending += 1
        return result

    def _read(self, tensor: object, dtype: object) -> None:
        node = _traced_node(tensor)
        frame = _caller_frame()
        # Inputs, weights and buffers keep their dtype in every typed graph: nothing to follow.
        if node is None or frame is None or node.op == "placeholder" or not isinstance(dtype, torch.dtype):
            return
        self._reads.append(_Read(frame, node, dtype))

    def _live_read(self, dtype: torch.dtype) -> _Read | None:
        running = _running_frames()
        return next((r for r in reversed(self._reads) if r.dtype == dtype and id(r.frame) in running), None)

    @staticmethod
    def _named_source(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The tensor whose dtype the call's result takes, where the call names it."""
        if func is torch.Tensor.type_as and len(args) == 2 and isinstance(args[1], torch.Tensor):
            return args[1]
        if func is not torch.Tensor.to or not args or not isinstance(args[0], torch.Tensor):
            return None
        other = next((a for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor)), None)
        if other is not None:
            return other
        if kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args[1:]):
            return args[0]  # x.to(device) / x.to(copy=True): x's own dtype
        return None

    def _value_id(self, node: torch.fx.Node) -> str:
        if VALUE_ID not in node.meta:
            node.meta[VALUE_ID] = f"v{next(self._ids)}"
        return str(node.meta[VALUE_ID])

    def release(self) -> None:
        """Drop the frames and nodes held from the trace."""
        self._reads.clear()


def _graph_nodes(ep: ExportedProgram) -> Iterator[torch.fx.Node]:
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            yield from gm.graph.nodes


def confirm_links(ep: ExportedProgram, traced: Sequence[tuple[str, torch.dtype]], probed: Sequence[tuple[str, torch.dtype]] | None) -> int:
    """Keep the pending links whose bare dtype changed with the probe's dtype; drop the rest. Returns how many were kept."""
    aligned = probed is not None and [f for f, _ in traced] == [f for f, _ in probed]
    if probed is not None and not aligned:
        _log.debug("dtype links: the probe trace made other calls than the trace; bare-dtype links dropped")
    kept = 0
    for node in _graph_nodes(ep):
        pending = node.meta.pop(_PENDING, None)
        if pending is None:
            continue
        value_id, index = pending
        if aligned and probed is not None and probed[index][1] != traced[index][1]:
            node.meta[DTYPE_FOLLOWS] = value_id
            kept += 1
    return kept


def _probe_value(t: torch.Tensor) -> torch.Tensor:
    dtype = PROBE_DTYPE if t.is_floating_point() else t.dtype
    return torch.empty_like(t, device="meta", dtype=dtype)


def probe_calls(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    trace: Callable[[torch.nn.Module, tuple[torch.Tensor, ...], TorchFunctionMode], object],
) -> list[tuple[str, torch.dtype]] | None:
    """The bare-dtype calls of a trace with every floating tensor in :data:`PROBE_DTYPE` (on ``meta``).

    ``trace`` runs the export the frontend runs, with the given mode active.
    ``None`` when that trace fails (a model whose code refuses float64).
    """
    state: dict[str, torch.Tensor] = {
        name: torch.nn.Parameter(_probe_value(p), requires_grad=p.requires_grad) for name, p in module.named_parameters()
    }
    state.update({name: _probe_value(b) for name, b in module.named_buffers()})
    probe = DtypeProvenance()
    try:
        # Tensors the model creates without naming a device are made on meta too.
        with _reparametrize_module(module, state, tie_weights=True, strict=False), torch.device("meta"):
            trace(module, tuple(_probe_value(a) for a in args), probe)
    except Exception as exc:  # noqa: BLE001 - any failure only means the links stay unconfirmed
        _log.debug("dtype links: the float64 probe trace failed (%s: %s); bare-dtype links dropped", type(exc).__name__, exc)
        return None
    finally:
        probe.release()
    return probe.calls
