"""Peers: the plain runtimes a user would deploy instead, measured next to the engines.

``harness bench --peers eager,inductor,onnxruntime,openvino`` adds reference
cases to a run, so its table says whether the harness's engines are the
bottleneck. For every model (and batch size) of the run, each peer runs at
each precision of the run's modes (:func:`~harness.bench.peer_names.run_precisions`) it can do here:

* ``eager``: the model in PyTorch, fp32, or under ``torch.autocast("cpu", dtype)``
  for bf16 and fp16;
* ``inductor``: ``torch.compile`` of the same (fp32, or the model under
  autocast); compiling is setup, timed and stored apart from latency;
* ``onnxruntime``: the eager model's own ONNX (``torch.onnx.export``, as a user
  exports it, not the typed graph's hand-off file) in an ``InferenceSession``
  with ``ORT_ENABLE_ALL`` and ``intra_op_num_threads`` = the run's threads;
  fp32 only, since ORT's CPU provider has almost no fp16/bf16 kernels and a
  reduced-precision session would time its fp32 fallbacks;
* ``openvino``: that ONNX compiled by OpenVINO's CPU plugin with
  ``INFERENCE_PRECISION_HINT`` f32, bf16 or f16 (a low hint only where this
  CPU's OpenVINO honours it, probed as the openvino backend probes its weak
  modes) and the backend's other properties (its threads, one stream);
* ``eager-cuda``: the model in PyTorch on the GPU (fp32, or under
  ``torch.autocast("cuda", dtype)``), its inputs resident, on a stream of its
  own, timed with CUDA events as the GPU engines are: the harness's GPU
  clock against a plain torch measurement of the same model.

Each case is measured like an engine case (:meth:`BenchRunner.measured_case`,
:meth:`BenchRunner.time_call`): same example inputs, same pinned threads,
same timing loop, accuracy against the same fp32 eager reference. It is
stored with backend ``peer:<name>`` and mode = its precision, with a
``peer`` record (name, precision, setup seconds, what ran). No task accuracy:
the ONNX peers are exported for the example inputs' shapes only.

Peers are references, not the commit's work: the gate skips them (a new
PyTorch or ORT would otherwise fail a pull request that changed nothing), and
tables and plots show them as reference rows and points.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils._pytree as pytree

from harness.bench.accuracy import compare_outputs, output_digest
from harness.bench.memory import MemoryReport
from harness.bench.peer_names import PEER_NAMES
from harness.bench.results import PEER_PREFIX, SINGLE_STREAM, CaseKey, CaseResult
from harness.engines.device import CudaQuery, DeviceQuery
from harness.errors import HarnessError
from harness.extras import ONNX_EXPORT_MODULES, ONNX_MODULES, require_all
from harness.outputs import OutputSpec, flat_tensors
from harness.sources import model_identity

if TYPE_CHECKING:
    from harness.bench.runner import BenchRunner

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ONNX_OPSET = 18  # what torch.onnx.export gives a user; the ONNX backends' hand-off uses 18 too


@dataclass
class PeerModel:
    """One model at one batch size as every peer of a case gets it.

    ``onnx`` exports the eager fp32 model on first use, once per run, for the
    peers that read ONNX; ``structure`` nests their flat outputs as the eager
    model returns them, so accuracy pairs outputs by path as for engines.
    """

    spec: Any  # harness.models.ModelSpec
    structure: OutputSpec
    onnx: Callable[[], Path]

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.spec.example_inputs)


@dataclass
class PeerRun:
    """A peer ready to time: ``call`` is one inference on the example inputs, as timed on the host
    clock; a peer on a GPU gives its inference staged on the device as ``query`` instead, timed
    as the GPU engines are (:func:`~harness.bench.latency.measure_device_latency`)."""

    call: Callable[[], object]
    outputs: Callable[[], Any]  # the outputs in the model's structure, as torch tensors
    details: str  # what runs, for the results
    size_bytes: int | None = None  # the model file it runs, where there is one
    query: DeviceQuery | None = None


class Peer(Protocol):
    """A plain runtime: whether it is installed, what it can run here, and one model ready to time."""

    name: str

    def check_installed(self) -> None:
        """Raise HarnessError naming what to install when this peer cannot run here at all."""
        ...

    def refusal(self, precision: str) -> str | None:
        """Why this peer does not run ``precision`` here (None: it does)."""
        ...

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        """Load, export or compile ``model`` for ``precision`` with ``threads`` intra-op threads."""
        ...


class _Autocast(torch.nn.Module):
    """``module`` under ``torch.autocast("cpu", dtype)``: one module, so torch.compile captures the casts."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *inputs: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=self.dtype):
            return self.module(*inputs)


def _eager_module(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    return module if precision == "fp32" else _Autocast(module, _AUTOCAST_DTYPES[precision])


def _describe_eager(precision: str) -> str:
    return "fp32" if precision == "fp32" else f"under torch.autocast('cpu', {_AUTOCAST_DTYPES[precision]})"


def _own_frame(module: torch.nn.Module) -> Callable[..., Any]:
    """A function calling ``module`` whose code object is its own.

    Dynamo caches compiled code per code object, falls back to eager, silently,
    after 8 entries, and checks every entry's guards on each call. Compiling
    the module itself would add each case's entry to its class's ``forward``
    (shared by every model of that class, the caller's own compiled ones too;
    the autocast wrapper's is one for every model). A code object per case
    keeps the case's one entry apart, freed with it, and leaves the caller's
    caches as they were, where ``torch._dynamo.reset()`` would empty them.
    """

    def call(*inputs: Any) -> Any:
        return module(*inputs)

    code = call.__code__.replace(co_name=f"peer_case_{id(module):x}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _infer(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():
            return fn()

    return run


class EagerPeer:
    """The model in eager PyTorch (threads: the torch intra-op count the runner pins)."""

    name = "eager"

    def check_installed(self) -> None:
        """PyTorch is the harness's own dependency."""

    def refusal(self, precision: str) -> str | None:
        return None

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        module, inputs = _eager_module(model.spec.module, precision), model.inputs
        return PeerRun(
            lambda: module(*inputs), _infer(lambda: module(*inputs)),
            f"torch {torch.__version__} eager, {_describe_eager(precision)}",
        )  # fmt: skip


class InductorPeer:
    """``torch.compile`` (inductor, static shapes) of the eager model; the first call compiles it."""

    name = "inductor"

    def check_installed(self) -> None:
        """Inductor writes C++ for the CPU and needs a compiler to build it."""
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - any failure means torch.compile cannot work here
            raise HarnessError(
                "peer 'inductor' cannot work here: torch.compile's CPU backend builds C++ and found no "
                f"usable compiler ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                "install g++ or set CXX to one"
            ) from None

    def refusal(self, precision: str) -> str | None:
        return None

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        compiled = torch.compile(_own_frame(_eager_module(model.spec.module, precision)), dynamic=False)
        inputs = model.inputs
        try:
            first = _infer(lambda: compiled(*inputs))
            first()  # compiles: setup, not latency
        except Exception as exc:  # noqa: BLE001 - dynamo and inductor raise many types
            text = str(exc).strip().splitlines()
            raise HarnessError(f"torch.compile failed: {type(exc).__name__}: {text[0] if text else ''}") from None
        return PeerRun(
            lambda: compiled(*inputs), first,
            f"torch {torch.__version__} torch.compile (inductor, dynamic=False), {_describe_eager(precision)}",
        )  # fmt: skip


class EagerCudaPeer:
    """The model in eager PyTorch on the GPU, fp32 or under ``torch.autocast("cuda", dtype)``,
    its inputs resident on the device and its stream its own: a plain torch measurement of the
    model on the GPU the engines run on, by the same CUDA-event clock."""

    name = "eager-cuda"

    def check_installed(self) -> None:
        """A CUDA build of PyTorch that sees a GPU."""
        if not torch.cuda.is_available():
            raise HarnessError(
                "peer 'eager-cuda' needs a CUDA GPU, and PyTorch sees none (torch.cuda.is_available() is False)"
            )

    def refusal(self, precision: str) -> str | None:
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name()} has no bf16 arithmetic"
        return None

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        device = torch.device("cuda", torch.cuda.current_device())
        module = copy.deepcopy(model.spec.module).to(device).eval()  # the reference stays on the host
        dtype = _AUTOCAST_DTYPES.get(precision)

        def run(stream: torch.cuda.Stream, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                return flat_tensors(module(*inputs))

        query = CudaQuery(model.inputs, run, device=device)

        def once() -> Any:
            query.h2d()
            query.enqueue()
            query.d2h()
            query.synchronize()
            return model.structure.unflatten(list(query.outputs()))

        where = "fp32" if dtype is None else f"under torch.autocast('cuda', {dtype})"
        return PeerRun(
            once, once, f"torch {torch.__version__} eager on {torch.cuda.get_device_name(device)}, {where}", query=query
        )


def ort_session_options(threads: int) -> Any:
    """A plain ONNX Runtime session as a user makes one: all optimizations, the run's threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only
    return options


class OnnxRuntimePeer:
    """The eager model's fp32 ONNX in a plain ``InferenceSession`` on ``CPUExecutionProvider``."""

    name = "onnxruntime"

    def check_installed(self) -> None:
        """ONNX Runtime, and the exporter that writes the eager model's ONNX: the ``onnx`` extra."""
        require_all(ONNX_MODULES, "onnx", "peer 'onnxruntime'")

    def refusal(self, precision: str) -> str | None:
        if precision == "fp32":
            return None
        return (
            "ONNX Runtime's CPU provider has almost no fp16/bf16 kernels: a reduced-precision session "
            "would time its fp32 fallbacks"
        )

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        import onnxruntime as ort

        path = model.onnx()
        try:
            session = ort.InferenceSession(os.fspath(path), ort_session_options(threads), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT's native errors share no base class
            raise HarnessError(f"onnxruntime cannot load the eager model's ONNX: {exc}") from None
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), model.inputs, strict=True)}

        def outputs() -> Any:
            return model.structure.unflatten([torch.from_numpy(a) for a in session.run(None, feeds)])

        return PeerRun(
            lambda: session.run(None, feeds), outputs,
            f"onnxruntime {ort.__version__} CPUExecutionProvider, ORT_ENABLE_ALL, {threads} intra-op thread(s), "
            f"torch.onnx.export (opset {ONNX_OPSET}) of the eager model",
            path.stat().st_size,
        )  # fmt: skip


_OV_HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


class OpenVinoPeer:
    """The eager model's fp32 ONNX compiled by OpenVINO's CPU plugin under a precision hint."""

    name = "openvino"

    def check_installed(self) -> None:
        """OpenVINO, and the exporter that writes the eager model's ONNX: the ``openvino`` extra."""
        require_all(("openvino", *ONNX_EXPORT_MODULES), "openvino", "peer 'openvino'")
        try:
            import harness.engines.openvino.runtime  # noqa: F401
        except ImportError as exc:
            raise HarnessError(f"peer 'openvino' is not installed: {exc}") from None

    def refusal(self, precision: str) -> str | None:
        if precision == "fp32":
            return None
        from harness.engines.openvino.probe import probe

        result = probe("fp32", _OV_HINTS[precision])
        return None if result.honoured else f"this CPU's OpenVINO does not lower to {precision}: {result.describe()}"

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        from harness.engines.openvino.runtime import DEVICE, OV_ERRORS, VERSION, core, error_text
        from harness.engines.openvino.settings import CompileSettings

        path = model.onnx()
        settings = CompileSettings(_OV_HINTS[precision], threads)
        try:
            compiled = core().compile_model(core().read_model(os.fspath(path)), DEVICE, settings.properties())
        except OV_ERRORS as exc:
            raise HarnessError(f"openvino cannot compile the eager model's ONNX: {error_text(exc)}") from None
        request = compiled.create_infer_request()
        arrays = [t.numpy() for t in model.inputs]

        def outputs() -> Any:
            results = request.infer(arrays).to_tuple()  # copies: the request reuses its memory
            return model.structure.unflatten([torch.from_numpy(a) for a in results])

        return PeerRun(
            lambda: request.infer(arrays, share_inputs=True, share_outputs=True), outputs,
            f"openvino {VERSION} {DEVICE}, INFERENCE_PRECISION_HINT={settings.inference_precision_hint}, "
            f"{threads} thread(s), of the eager model's ONNX (opset {ONNX_OPSET})",
            path.stat().st_size,
        )  # fmt: skip


PEERS: dict[str, type[Peer]] = {
    "eager": EagerPeer,
    "inductor": InductorPeer,
    "onnxruntime": OnnxRuntimePeer,
    "openvino": OpenVinoPeer,
    "eager-cuda": EagerCudaPeer,
}
assert tuple(PEERS) == PEER_NAMES, "harness.bench.peer_names lists the peers defined here"


def resolve_peers(names: Sequence[str], where: str = "--peers", skipped: list[str] | None = None) -> list[Peer]:
    """The peers called ``names``, each installed here; anything else is refused before any work.

    With a ``skipped`` list, a peer that is not installed here (its optional
    packages missing) is left out instead, and a note naming it and the
    reason (with the extra that installs it) is appended to ``skipped``: the
    run's other cases still run, and the user reads why a row is absent.
    Unknown and repeated names are refused either way.
    """
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise HarnessError(
            f"{where}: unknown peer(s) {', '.join(map(repr, unknown))}; valid peers: {', '.join(PEER_NAMES)}"
        )
    if len(set(names)) != len(names):
        raise HarnessError(f"{where}: a peer is named twice ({', '.join(names)})")
    peers = []
    for peer in (PEERS[name]() for name in names):
        try:
            peer.check_installed()
        except HarnessError as exc:
            if skipped is None:
                raise HarnessError(f"{where}: {exc}") from None
            skipped.append(f"peer {peer.name} skipped: {exc}")
            continue
        peers.append(peer)
    return peers


class OnnxExports:
    """The eager fp32 ONNX of each model and batch size, exported once per run on first use.

    The files live in a temporary directory removed with this object (or at exit).
    """

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="harness-peers-")
        self._paths: dict[tuple[str, int | None], Path] = {}

    def __reduce__(self) -> tuple[type[OnnxExports], tuple[()]]:
        """Pickled (a peer case sent to another process: ``--executor ray``), a fresh, empty one:
        the files are this process's; the other exports its own."""
        return (OnnxExports, ())

    def path(self, key: tuple[str, int | None], spec: Any) -> Path:
        if key not in self._paths:
            path = Path(self._dir.name) / f"model-{len(self._paths)}.onnx"
            export_eager_onnx(spec.module, tuple(spec.example_inputs), path)
            self._paths[key] = path
        return self._paths[key]


def export_eager_onnx(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], path: Path) -> None:
    """``torch.onnx.export`` as a user runs it (dynamo exporter with its optimizer, opset 18)."""
    from harness.engines.onnx_export import quiet_exporter

    try:
        with torch.autocast("cpu", enabled=False), quiet_exporter():
            torch.onnx.export(module, inputs, os.fspath(path), dynamo=True, opset_version=ONNX_OPSET, verbose=False)
    except torch.onnx.OnnxExporterError as exc:
        raise HarnessError(f"torch.onnx.export of the eager model failed: {exc}") from None


@dataclass(frozen=True)
class PeerCase:
    """One peer at one precision on one model (and batch size): a case the runner runs and records."""

    model: str  # the model reference, as the engine cases have it
    batch: int | None
    peer: Peer
    precision: str
    exports: OnnxExports = field(compare=False)

    @property
    def backend(self) -> str:
        return PEER_PREFIX + self.peer.name

    @property
    def label(self) -> str:
        return f"{self.model} {self.backend} {self.precision}" + ("" if self.batch is None else f" b{self.batch}")

    def key(self, runner: BenchRunner) -> CaseKey:
        return (runner.name_of(self.model), self.precision, self.backend, self.batch, SINGLE_STREAM)

    def run(self, runner: BenchRunner) -> dict[str, Any]:
        return runner.measured_case(
            self.model, self.precision, self.backend, self.batch, lambda stage: self._measure(runner, stage)
        )

    def _measure(self, runner: BenchRunner, stage: list[str]) -> tuple[CaseResult, dict[str, Any]]:
        spec = runner.load_model(self.model, self.batch)
        stage[0] = "fp32 eager reference"
        ref = runner.reference(self.model, self.batch)
        stage[0] = "prepare"
        key = (self.model, self.batch)
        model = PeerModel(spec, OutputSpec(pytree.tree_flatten(ref.outputs)[1]), lambda: self.exports.path(key, spec))
        start = time.perf_counter()
        run = self.peer.prepare(model, self.precision, runner.settings.threads)
        setup_s = time.perf_counter() - start
        stage[0] = "run"
        outputs = run.outputs()
        stage[0] = "accuracy"
        accuracy = compare_outputs(outputs, ref.outputs, logits=ref.logits)
        stage[0] = "latency"
        if run.query is not None:
            gpu = torch.cuda.current_device()
            latency, telemetry = runner.time_query(run.query, model.inputs, spec.batch_dim, gpu)
        else:
            latency, telemetry = runner.time_call(run.call, model.inputs, spec.batch_dim)
        case = CaseResult(
            model=spec.name,
            mode=self.precision,
            backend=self.backend,
            batch=self.batch,
            latency=latency,
            memory=MemoryReport(engine_bytes=run.size_bytes),
            accuracy=accuracy,
            telemetry=telemetry,
            output_digest=output_digest(outputs),
            model_weights_digest=model_identity(spec),
        )
        record = {"name": self.peer.name, "precision": self.precision, "setup_seconds": setup_s, "details": run.details}
        return case, {"peer": record}


def peer_cases(
    models: Sequence[str],
    peers: Sequence[Peer],
    precisions: Sequence[str],
    batch_sizes: Sequence[int | None] = (None,),
    shard: tuple[int, int] | None = None,
) -> tuple[list[PeerCase], list[str]]:
    """The peer cases of a run, in a fixed order (sharded like the engine matrix), and the notes
    naming each (peer, precision) left out because the peer cannot run it here."""
    notes, runnable = [], []
    for peer in peers:
        for precision in precisions:
            reason = peer.refusal(precision)
            if reason is None:
                runnable.append((peer, precision))
            else:
                notes.append(f"peer {peer.name} at {precision} left out: {reason}")
    exports = OnnxExports()
    cases = [
        PeerCase(model, batch, peer, precision, exports)
        for model in models for batch in batch_sizes for peer, precision in runnable
    ]  # fmt: skip
    if shard is not None:
        index, count = shard
        cases = cases[index - 1 :: count]
    return cases, notes
