"""One inference staged on a GPU as trtexec stages it: what the GPU timing loop drives.

:class:`DeviceQuery` is the contract (an engine of a GPU backend gives one from
``stage(*inputs)``, :class:`DeviceEngine`); :class:`CudaQuery` is its CUDA
implementation, shared by the TensorRT engine and the eager CUDA peer:

* the inputs are copied once into page-locked host buffers and once into
  device buffers that every query reuses, so a query's compute never waits
  for a host copy;
* everything runs on a stream of the query's own, never on the legacy
  default stream, which synchronizes with every other stream (TensorRT warns
  about it: "Using default stream in enqueueV3() may lead to performance
  issues");
* :meth:`DeviceQuery.h2d` and :meth:`DeviceQuery.d2h` enqueue the copies of
  the inputs and outputs, :meth:`DeviceQuery.enqueue` the inference alone
  (with ``cuda_graph``, the replay of a CUDA graph captured from it once, as
  ``trtexec --useCudaGraph`` does), each returning as soon as it is queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


class DeviceEvent(Protocol):
    """A timing event of a query's stream."""

    def record(self) -> None:
        """Mark the stream's current end: the event completes when the work queued before it has."""
        ...

    def synchronize(self) -> None:
        """Wait on the host until the event has completed."""
        ...

    def elapsed_ns(self, end: DeviceEvent) -> int:
        """Device time from this event to ``end`` (both completed), in nanoseconds."""
        ...


class DeviceQuery(Protocol):
    """One inference staged on a device, its buffers fixed, its stream its own."""

    cuda_graph: bool  # whether enqueue replays a captured CUDA graph

    def event(self) -> DeviceEvent:
        """A new timing event on the query's stream."""
        ...

    def h2d(self) -> None:
        """Queue the copies of the inputs from their page-locked host buffers to the device's."""
        ...

    def enqueue(self) -> None:
        """Queue one inference on the device buffers (no copy, no wait)."""
        ...

    def d2h(self) -> None:
        """Queue the copies of the last inference's outputs to their page-locked host buffers."""
        ...

    def synchronize(self) -> None:
        """Wait on the host until everything queued on the query's stream has run."""
        ...

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """The host copies of the outputs, as the last :meth:`d2h` left them (after a synchronize)."""
        ...


@runtime_checkable
class DeviceEngine(Protocol):
    """An engine that runs on a GPU and can be timed as trtexec times it."""

    # What its runtime warned while running it (each message once): the case's warnings too.
    run_warnings: list[str]

    def stage(self, *inputs: torch.Tensor, cuda_graph: bool = False) -> DeviceQuery:
        """One inference on ``inputs`` (host tensors), staged on the engine's device."""
        ...


class CudaEvent:
    """A CUDA timing event recorded on one stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._stream = stream

    def record(self) -> None:
        self._event.record(self._stream)

    def synchronize(self) -> None:
        self._event.synchronize()  # type: ignore[no-untyped-call]

    def elapsed_ns(self, end: DeviceEvent) -> int:
        if not isinstance(end, CudaEvent):
            raise TypeError(f"a CUDA event's elapsed time is to another CUDA event, not {type(end).__name__}")
        return round(float(self._event.elapsed_time(end._event)) * 1e6)


# (the query's stream, the device inputs) -> the device outputs of one inference queued on that stream
Enqueue = Callable[[torch.cuda.Stream, tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]


class CudaQuery:
    """:class:`DeviceQuery` on a CUDA device: ``run`` queues one inference on the given stream
    and returns its outputs (the same buffers every time, or new ones).

    Staging copies the inputs to the device, runs the inference once (which
    allocates what it needs and shows the outputs' shapes), and, with
    ``cuda_graph``, captures one more inference into a CUDA graph on the
    query's stream; each step waits for the device before it returns.
    """

    def __init__(
        self, inputs: Sequence[torch.Tensor], run: Enqueue, *, device: torch.device, cuda_graph: bool = False
    ) -> None:
        self.cuda_graph = cuda_graph
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._run = run
        self._host_inputs = [t.detach().contiguous().pin_memory() for t in inputs]
        self._device_inputs = tuple(torch.empty_like(t, device=device) for t in self._host_inputs)
        self.h2d()
        self._device_outputs = self._queued()
        self.synchronize()
        self._graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph:
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph, stream=self.stream):
                self._device_outputs = self._queued()
            self.synchronize()
        self._host_outputs = [torch.empty_like(t, device="cpu").pin_memory() for t in self._device_outputs]

    def _queued(self) -> tuple[torch.Tensor, ...]:
        with torch.cuda.stream(self.stream):
            return tuple(self._run(self.stream, self._device_inputs))

    def event(self) -> CudaEvent:
        return CudaEvent(self.stream)

    def h2d(self) -> None:
        with torch.cuda.stream(self.stream):
            for host, device in zip(self._host_inputs, self._device_inputs, strict=True):
                device.copy_(host, non_blocking=True)

    def enqueue(self) -> None:
        if self._graph is not None:
            with torch.cuda.stream(self.stream):
                self._graph.replay()
        else:
            self._device_outputs = self._queued()

    def d2h(self) -> None:
        with torch.cuda.stream(self.stream):
            for device, host in zip(self._device_outputs, self._host_outputs, strict=True):
                host.copy_(device, non_blocking=True)

    def synchronize(self) -> None:
        self.stream.synchronize()  # type: ignore[no-untyped-call]

    def outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in self._host_outputs)
