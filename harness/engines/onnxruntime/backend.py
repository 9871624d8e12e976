"""The ONNX Runtime backend: the TensorRT hand-off file, run on ONNX Runtime's CPU provider.

The engine is the ONNX model from :func:`harness.engines.onnx_export.export_onnx`
(the very file TensorRT's parser gets) in an ``InferenceSession`` on
``CPUExecutionProvider``. ONNX Runtime does not choose kernels by timing, so
there is one tactic per layer ("ort-default"), nothing to autotune and no
timing cache to read or write; weak modes, where a builder picks precisions by
timing, are refused.

What the CPU provider does with reduced precision (ONNX Runtime 1.2x-1.3x):

* fp16: most CPU kernels exist only in fp32. ORT's ``InsertCastTransformer``
  runs such nodes in fp32 with casts around them, and then drops cast pairs
  it considers redundant, *including the compiler's* fp32->fp16->fp32 pairs
  around such nodes. The engine therefore computes mostly in fp32; its
  outputs agree with the typed graph to fp16 accuracy, not bit for bit. Every
  build reports which nodes ran in another precision and which casts ORT
  removed (``BuildLog.messages``), and the engine's layers are the graph ORT
  really executes (as TensorRT's engine inspector reports fused layers).
* bf16: the CPU provider has almost no bf16 kernels (not even ``Add``), so
  bf16, autocast-bf16 and amp-bf16 graphs are refused at build time with the
  op and dtype that has no kernel. Use the cpu or tensorrt backend for them.

Modes that work: fp32, fp16, autocast-fp16, amp-fp16 (where the typed graph
is valid ONNX) and explicit files without bf16.

Speed: the engine runs at plain ONNX Runtime's speed on the same graph. The
session is what a user of ONNX Runtime gets (``ORT_ENABLE_ALL``: Conv with
BatchNormalization and activation fused, the NCHWc convolution layout, Gemm and
SkipLayerNormalization fusions; ``intra_op_num_threads`` = the build's
threads, sequential execution), and the file handed to it is unchanged: ORT's
optimizer works on its own copy. ``basic`` (constant folding and
semantics-preserving fusions only) ran MobileNetV3-small 8x and resnet 2x
slower here, so it is an option, not the default. A call shares memory
with numpy both ways (no copies) and leaves checking the inputs' dtypes and
shapes to the native session, whose refusal is then explained by the
harness's own check; a 10 µs model pays about half a microsecond for the
engine around the session.

Saved engines are a directory with ``model.onnx`` and ``plan.json``. Loading
checks the model's digest, that this ONNX Runtime version built it, and that it
still executes the layers the plan records (the fingerprint covers the version,
the plan's fields and the executed layers), then runs bit-identically.
"""

from __future__ import annotations

import graphlib
import hashlib
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import onnx
import onnxruntime as ort
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state
from pydantic import Field
from pydantic import dataclasses as pydantic_dataclasses

from harness.cache.timing_cache import Provenance, TimingCache
from harness.documents import DOCUMENT, OneOf, document_json
from harness.engines.onnx_export import (
    CastRecord,
    TensorSpec,
    check_inputs,
    export_notes,
    export_onnx,
    graph_description,
    listed,
    onnx_dtype_name,
)
from harness.engines.onnx_plan import (
    MODEL_FILE,
    ExportedInterface,
    ModelEngine,
    ModelPlan,
    check_output_count,
    first_difference,
    interface_json,
    read_interface,
    read_model_plan,
)
from harness.engines.protocol import (
    BuildConfig,
    BuildLog,
    ExecutedPrecision,
    LayerInfo,
    LayerRecord,
)
from harness.engines.saved import PlanFormat, PlanHeader
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
from harness.limits import MAX_THREADS
from harness.machine import cpu_info
from harness.outputs import OutputSpec
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph

BACKEND = "onnxruntime"
PROVIDER = "CPUExecutionProvider"
TACTIC = "ort-default"
TACTIC_HASH = "0x" + hashlib.sha256(f"{PROVIDER}/{TACTIC}".encode()).hexdigest()[:16]
PLAN_FORMAT = "harness-onnxruntime-engine"
# 3: compiler_settings holds the settings themselves, not their digest;
# 4: the fingerprint covers the onnxruntime version, and the recorded layers are checked on load
PLAN_VERSION = 4

OPTIMIZATION_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
BUILDER_OPTIONS = ("graph_optimization_level", "intra_op_num_threads")
# Errors the native runtime raises (they derive from Exception, not from one base).
_ORT_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
    ort_state.EPFail,
)
_NO_KERNEL = re.compile(
    r"Could not find an implementation for (?P<op>[\w.]+)\((?P<version>\d+)\) node with name '(?P<node>[^']*)'"
)


DEFAULT_OPTIMIZATION_LEVEL = "all"


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class SessionSettings:
    """The session options that change what runs, hence part of the fingerprint.

    ``all`` (the default, and ONNX Runtime's own) fuses into ORT's kernels
    and picks the blocked NCHWc layout for convolutions: what a plain
    ``InferenceSession`` runs, hence the speed a user of ORT compares with.
    ``basic`` keeps the graph as exported apart from semantics-preserving
    folds and fusions (other rounding than ``all``, several times slower on
    convolution networks); ``extended`` sits between them.

    Threads: ``intra_op_num_threads`` is the build's thread count (one
    thread: no thread pool at all); a single inter-op thread with sequential
    execution, since the harness runs one request at a time. Spinning of the
    intra-op pool stays ORT's default, as in a plain session.
    """

    graph_optimization_level: Annotated[str, OneOf(OPTIMIZATION_LEVELS)]
    intra_op_num_threads: Annotated[int, Field(ge=1, le=MAX_THREADS)]

    @classmethod
    def from_options(cls, options: Mapping[str, Any], default_threads: int | None = None) -> SessionSettings:
        unknown = sorted(set(options) - set(BUILDER_OPTIONS))
        if unknown:
            raise HarnessError(
                f"unknown onnxruntime builder option(s) {', '.join(unknown)}; valid: {', '.join(BUILDER_OPTIONS)}"
            )
        level = options.get("graph_optimization_level", DEFAULT_OPTIMIZATION_LEVEL)
        if not isinstance(level, str) or level not in OPTIMIZATION_LEVELS:
            raise HarnessError(
                f"onnxruntime option graph_optimization_level={level!r}; valid: {', '.join(OPTIMIZATION_LEVELS)}"
            )
        threads = options.get("intra_op_num_threads", default_threads or torch.get_num_threads())
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise HarnessError(
                f"onnxruntime option intra_op_num_threads={threads!r}; expected an integer from 1 to {MAX_THREADS}"
            )
        return cls(level, threads)

    def to_json(self) -> dict[str, Any]:
        json: dict[str, Any] = document_json(self)
        return json

    def session_options(self, optimized_model_path: Path) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.graph_optimization_level = OPTIMIZATION_LEVELS[self.graph_optimization_level]
        options.intra_op_num_threads = self.intra_op_num_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.use_deterministic_compute = True
        options.log_severity_level = 3  # errors only; ORT warns about every folded initializer
        # ORT writes the graph it will execute here: the engine's real layers.
        options.optimized_model_filepath = os.fspath(optimized_model_path)
        return options


@dataclass(frozen=True)
class EngineRecord:
    """Everything plan.json says about an engine besides what is recomputed on load."""

    mode: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    settings: SessionSettings
    structure: OutputSpec
    compiler_settings: dict[str, Any] | None  # the autocast settings as JSON (None: they did not apply)

    def to_json(self) -> dict[str, Any]:
        return {**interface_json(self), "session": self.settings.to_json()}

    @classmethod
    def from_plan(cls, plan: OnnxRuntimePlan, where: str) -> EngineRecord:
        """The record of a plan, refusing an output structure of another size (a HarnessError naming ``where``)."""
        record = cls(**read_interface(plan, where), settings=plan.session)
        check_output_count(record.structure, record.outputs, where)
        return record


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class _Runtime(PlanHeader):
    """The fields an onnxruntime plan states after its header: the runtime that built it."""

    onnxruntime_version: str
    provider: Literal["CPUExecutionProvider"]


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class _Record(ExportedInterface, _Runtime):
    """The header, the runtime, the interface and the session settings (:meth:`EngineRecord.to_json`)."""

    session: SessionSettings


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class OnnxRuntimePlan(ModelPlan, _Record):
    """A saved onnxruntime engine's ``plan.json``: the header, the runtime, the interface, the
    session settings, then the model file, its digest, the executed layers and the fingerprint."""


PLAN = PlanFormat(BACKEND, PLAN_FORMAT, PLAN_VERSION, MODEL_FILE, OnnxRuntimePlan)


class OnnxRuntimeEngine(ModelEngine):
    backend = BACKEND
    plan = PLAN

    def __init__(self, model_bytes: bytes, record: EngineRecord) -> None:
        super().__init__(model_bytes, record)
        self.record: EngineRecord = record
        self._session, executed = _open_session(model_bytes, self._onnx, record.settings)
        self._input_names = [spec.name for spec in record.inputs]
        self._output_names = [spec.name for spec in record.outputs]
        self._one_input = self._input_names[0] if len(self._input_names) == 1 else None
        # InferenceSession.run re-validates the feed's names in Python on every call
        # (about 1 µs, a tenth of a small model's latency) before the native session
        # checks them again; the engine calls the native session it wraps, where there is one.
        native = getattr(self._session, "_sess", None)
        self._run: Callable[..., list[Any]] = getattr(native, "run", None) or self._session.run
        # Without run options ORT makes default ones on every call (about 0.9 µs).
        self._run_options = ort.RunOptions()
        # each value's type in the model and in what ORT runs (shape inference: once per graph)
        before, after = _value_dtypes(self._onnx), _value_dtypes(executed)
        self._layers = _layers(executed, self._onnx, after)
        self.notes = _precision_notes(self._onnx, executed, before, after, record.casts)
        self._executed_precision = _executed_precision(self._onnx, executed, before, after, PrecisionMode(record.mode))
        self._fingerprint = digest(
            canonical_json(
                {
                    "backend": BACKEND,
                    "provider": PROVIDER,
                    # the runtime's kernels decide the engine's numbers, as the graph does
                    "onnxruntime_version": ort.__version__,
                    **record.to_json(),
                    "graph": graph_description(self._onnx),
                    "layers": [layer.to_json() for layer in self._layers],
                }
            )
        )

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The fast path hands the inputs' memory to ORT (a strided array it copies
        # itself), and ORT checks their dtypes and shapes against the model; only
        # when something fails does check_inputs say, in the harness's terms, what.
        # One input and one output (most models) skip the generic zip and map: on a
        # 10 µs model they cost 0.6 µs more here, more than the rest of the wrapper.
        try:
            if self._one_input is not None:
                (tensor,) = inputs  # ValueError for another count
                feeds = {self._one_input: tensor.numpy()}
            else:
                feeds = dict(zip(self._input_names, map(torch.Tensor.numpy, inputs), strict=True))
            results = self._run(self._output_names, feeds, self._run_options)
        except (*_ORT_ERRORS, AttributeError, TypeError, RuntimeError, ValueError) as exc:
            results = self._run_checked(inputs, exc)
        # ORT's CPU outputs are fresh, C-contiguous and writable: shared, not copied.
        if len(results) == 1:
            return (torch.from_numpy(results[0]),)
        return tuple(map(torch.from_numpy, results))

    def _run_checked(self, inputs: tuple[torch.Tensor, ...], failure: Exception) -> list[Any]:
        """The slow path: refuse wrong inputs by name, convert the ones numpy() refused, else report ORT."""
        check_inputs(inputs, self.record.inputs, "onnxruntime engine")
        if isinstance(failure, _ORT_ERRORS):
            raise HarnessError(f"onnxruntime failed to run the engine: {failure}") from None
        # Valid inputs numpy() cannot view: on another device, or requiring grad.
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self._input_names, inputs, strict=True)}
        try:
            return list(self._run(self._output_names, feeds, self._run_options))
        except _ORT_ERRORS as exc:
            raise HarnessError(f"onnxruntime failed to run the engine: {exc}") from None

    def layers(self) -> list[LayerInfo]:
        return list(self._layers)

    def session_options(self) -> ort.SessionOptions:
        """The options ONNX Runtime's session really runs with (as it reports them back)."""
        return self._session.get_session_options()

    def _runtime_json(self) -> dict[str, Any]:
        return {"onnxruntime_version": ort.__version__, "provider": PROVIDER}

    def _layers_json(self) -> list[dict[str, Any]]:
        return [document_json(layer) for layer in _layer_records(self._layers)]

    def executed_precision(self) -> ExecutedPrecision | None:
        return self._executed_precision

    @staticmethod
    def load(path: str | os.PathLike[str]) -> OnnxRuntimeEngine:
        model_bytes, plan, where = read_model_plan(PLAN, path)
        record = EngineRecord.from_plan(plan, where)
        if plan.onnxruntime_version != ort.__version__:
            raise HarnessError(
                f"{where}: built with onnxruntime {plan.onnxruntime_version}, this is onnxruntime "
                f"{ort.__version__}, whose kernels and graph optimizations may differ; rebuild the engine"
            )
        try:
            engine = OnnxRuntimeEngine(model_bytes, record)
        except HarnessError as exc:
            raise HarnessError(f"{where}: {exc}") from None
        if engine.fingerprint() != plan.fingerprint:
            raise HarnessError(
                f"{where}: fingerprint mismatch: onnxruntime executes a different graph, or the plan was "
                "edited; rebuild the engine"
            )
        _check_recorded_layers(plan.layers, engine.layers(), where)
        return engine


class OnnxRuntimeBackend:
    name = BACKEND

    def check_available(self) -> None:
        """Nothing beyond the import of onnxruntime, which loading this module did."""

    def supported_modes(self) -> tuple[PrecisionMode, ...]:
        return tuple(mode for mode in PrecisionMode if not mode.weak and mode.low != "bf16")

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        mode = PrecisionMode.parse(mode)
        if mode.low == "bf16":
            raise HarnessError(
                f"backend onnxruntime cannot build {mode}: ONNX Runtime has almost no bf16 kernels on "
                "CPU. Use the fp16 or fp32 modes here, or backend cpu/tensorrt for bf16"
            )
        if mode.weak:
            raise HarnessError(
                f"backend onnxruntime cannot build {mode}: weak typing lets a builder pick each "
                "layer's precision by timing, and ONNX Runtime never times kernels. Use "
                f"autocast-{mode.low} here, or backend cpu/tensorrt for {mode}"
            )
        return mode

    def provenance(self, config: BuildConfig) -> Provenance:
        settings = SessionSettings.from_options(config.options, config.threads)
        cpu = cpu_info()
        return Provenance(
            backend=BACKEND,
            backend_version=ort.__version__,
            # MLAS picks kernels by ISA extension, so they belong to the compared device.
            device=f"{cpu['model']} [{' '.join(cpu['isa_flags'])}] ({PROVIDER})",
            device_details=cpu,
            builder_options={
                "mode": config.mode,
                "provider": PROVIDER,
                **settings.to_json(),
                "autocast": config.compiler_settings(),
            },
        )

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[OnnxRuntimeEngine, BuildLog]:
        settings = SessionSettings.from_options(config.options, config.threads)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="harness-onnx-") as tmp:
            exported = export_onnx(graph, Path(tmp) / MODEL_FILE)
            model_bytes = exported.path.read_bytes()
        for spec in (*exported.inputs, *exported.outputs):
            if spec.dtype == "bf16":
                raise HarnessError(
                    f"backend onnxruntime: model {'input' if spec in exported.inputs else 'output'} "
                    f"{spec.name!r} is bf16, which neither numpy nor ORT's CPU kernels handle; use "
                    "backend cpu or tensorrt for this mode"
                )
        record = EngineRecord(
            config.mode, exported.inputs, exported.outputs, exported.casts, settings, graph.outputs,
            config.compiler_settings(),
        )
        engine = OnnxRuntimeEngine(model_bytes, record)
        engine(*graph.example_inputs)  # a first run surfaces kernels that fail only when executed
        messages = [
            *export_notes(exported),
            *engine.notes,
            "onnxruntime does not autotune: nothing was timed and no timing cache was read or written",
        ]
        return engine, BuildLog(BACKEND, config.mode, [], messages, time.perf_counter() - start)

    def load(self, path: str | os.PathLike[str]) -> OnnxRuntimeEngine:
        return OnnxRuntimeEngine.load(path)


def _check_recorded_layers(recorded: tuple[LayerRecord, ...], executed: list[LayerInfo], where: str) -> None:
    """The plan's ``layers`` must be the graph onnxruntime executes now.

    The fingerprint covers the executed layers, computed on load; the
    recorded ones are what a reader of plan.json sees, so a plan whose list
    was edited (its fingerprint left alone) is refused rather than shown.
    """
    now = _layer_records(executed)
    if recorded == now:
        return
    index = first_difference(recorded, now)
    which = recorded[index].name if index < len(recorded) else now[index].name
    raise HarnessError(
        f"{where}: layer {index} ({which!r}) of the recorded layers is not what onnxruntime executes "
        f"({len(recorded)} recorded, {len(now)} executed); the plan was edited, rebuild the engine"
    )


def _layer_records(layers: list[LayerInfo]) -> tuple[LayerRecord, ...]:
    """The plan's ``layers`` of the executed layers (each with its key)."""
    return tuple(LayerRecord.of(layer, layer.key) for layer in layers)


def _open_session(
    model_bytes: bytes, model: onnx.ModelProto, settings: SessionSettings
) -> tuple[Any, onnx.ModelProto]:
    """The session and the graph it executes (after ORT's transformers), or a HarnessError."""
    with tempfile.TemporaryDirectory(prefix="harness-ort-") as tmp:
        executed_path = Path(tmp) / "executed.onnx"
        try:
            session = ort.InferenceSession(
                model_bytes, sess_options=settings.session_options(executed_path), providers=[PROVIDER]
            )
        except _ORT_ERRORS as exc:
            raise _session_error(str(exc), model) from None
        executed = onnx.load(executed_path)
    return session, executed


def _session_error(text: str, model: onnx.ModelProto) -> HarnessError:
    missing = _NO_KERNEL.search(text)
    if missing is None:
        return HarnessError(f"onnxruntime ({PROVIDER}) cannot load the exported model: {text}")
    dtypes = _value_dtypes(model)
    node = next((n for n in model.graph.node if n.name == missing["node"]), None)
    types = ", ".join(dtypes.get(i, "?") for i in node.input if i) if node is not None else "?"
    return HarnessError(
        f"onnxruntime's {PROVIDER} has no kernel for {missing['op']} (opset {missing['version']}) "
        f"with inputs ({types}) at node {missing['node']!r}. Its CPU kernels cover fp32 and, "
        "through fp32 fallbacks, fp16, but almost no bf16: build bf16 modes with backend cpu "
        "or tensorrt"
    )


def _value_dtypes(model: onnx.ModelProto) -> dict[str, str]:
    """Value name -> short dtype for every value whose type the model states or implies."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except onnx.shape_inference.InferenceError:
        pass  # ORT's own ops (com.microsoft) may not infer; keep what the model states
    graph = model.graph
    dtypes = {t.name: onnx_dtype_name(t.data_type) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            dtypes[value.name] = onnx_dtype_name(value.type.tensor_type.elem_type)
    # Values inference could not type (after a node ORT's own op feeds, or one ORT rewired around
    # its fp32 fallbacks): typed from the node's inputs where its ONNX schema ties the two.
    for node in graph.node:  # nodes are stored in topological order
        for j, out in enumerate(node.output):
            if out and out not in dtypes and (dtype := _output_dtype(node, j, dtypes)) is not None:
                dtypes[out] = dtype
    return dtypes


def _output_dtype(node: onnx.NodeProto, index: int, dtypes: Mapping[str, str]) -> str | None:
    """The type of ``node``'s output ``index`` from the types of its inputs, where the op's schema
    gives the output the type variable of an input (Gemm's ``T``), or from a Cast's target; None
    for an op without a schema here (ORT's contrib ops) or an output typed otherwise."""
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        return None if to is None else onnx_dtype_name(to)
    try:
        schema = onnx.defs.get_schema(node.op_type, domain=node.domain)
    except onnx.defs.SchemaError:
        return None
    if not schema.outputs or not schema.inputs:
        return None
    variable = schema.outputs[min(index, len(schema.outputs) - 1)].type_str
    for i, value in enumerate(node.input):
        if schema.inputs[min(i, len(schema.inputs) - 1)].type_str == variable and value in dtypes:
            return dtypes[value]
    return None


def _op_name(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


_TOKEN = re.compile(r"_token_\d+$")


def _executed_nodes(executed: onnx.ModelProto, model: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto]]:
    """The executed graph's nodes, named and ordered the same way in every session.

    ORT numbers the nodes its transformers add under one base name
    (``ReorderOutput``, ``ReorderOutput_token_15``, ...) in an order that
    changes from session to session (NCHWc layout at level ``all``), and it
    also places independent nodes in another order from one session to the
    next (mobilenet's squeeze-excite pooling before or after the reorder of the
    branch it rescales). So an added node is named by its base and, where the
    base repeats, by the model's value it writes (``ReorderOutput->relu``) or
    else reads (``ReorderInput<-mul``); names still equal are numbered
    (``<base>#<k>``). The nodes come in a topological order, step by step the
    nodes whose inputs are ready, by name. The model's own names stay.
    """
    own = {n.name for n in model.graph.node}
    own_values = {v.name for v in (*model.graph.input, *model.graph.output)}
    own_values.update(v for n in model.graph.node for v in n.output)
    nodes = list(executed.graph.node)
    bases = [
        (node.name if node.name in own else _TOKEN.sub("", node.name)) or f"(unnamed {node.op_type})"
        for node in nodes
    ]
    counts = Counter(bases)
    for k, node in enumerate(nodes):
        if counts[bases[k]] > 1 and node.name not in own:
            wrote = next((v for v in node.output if v in own_values), None)
            read = next((v for v in node.input if v in own_values), None)
            bases[k] = f"{bases[k]}->{wrote}" if wrote else f"{bases[k]}<-{read}" if read else bases[k]
    producer = {value: k for k, node in enumerate(nodes) for value in node.output if value}
    inputs_from = {k: {producer[v] for v in node.input if v in producer} for k, node in enumerate(nodes)}
    sorter = graphlib.TopologicalSorter(inputs_from)
    sorter.prepare()
    order: list[int] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready(), key=lambda k: (bases[k], k))
        order += ready
        sorter.done(*ready)
    counts = Counter(bases)
    seen: Counter[str] = Counter()
    named = []
    for k in order:
        name = bases[k]
        if counts[name] > 1 and nodes[k].name not in own:
            seen[name] += 1
            name = f"{name}#{seen[name]}"
        named.append((name, nodes[k]))
    return named


def _layers(executed: onnx.ModelProto, model: onnx.ModelProto, dtypes: Mapping[str, str]) -> list[LayerInfo]:
    """The executed graph's layers (``dtypes``: its values' types, :func:`_value_dtypes`)."""
    layers = []
    for name, node in _executed_nodes(executed, model):
        inputs = tuple(dtypes.get(v, "?") for v in node.input if v)
        outputs = tuple(dtypes.get(v, "?") for v in node.output if v)
        key_material = {"layer": name, "op": _op_name(node), "inputs": inputs, "outputs": outputs}
        key = "0x" + hashlib.sha256(canonical_json(key_material)).hexdigest()[:32]
        layers.append(LayerInfo(name, _op_name(node), key, inputs, outputs, TACTIC, TACTIC_HASH))
    return layers


def _executed_precision(
    model: onnx.ModelProto,
    executed: onnx.ModelProto,
    before: Mapping[str, str],
    after: Mapping[str, str],
    mode: PrecisionMode,
) -> ExecutedPrecision | None:
    """Of the ONNX model's nodes with a ``mode.low`` output, those ONNX Runtime runs with fp32
    outputs instead (no kernel of its provider for the low type); ``before``/``after``: the
    values' types in the model and in the executed graph (:func:`_value_dtypes`)."""
    low = mode.low
    if low is None:
        return None
    original = {n.name: n for n in model.graph.node if n.op_type != "Cast"}
    asked = {name for name, node in original.items() if low in {before.get(v) for v in node.output}}
    wider = tuple(
        node.name
        for node in executed.graph.node
        if node.name in asked
        and any(before.get(old) == low and after.get(new) == "fp32"
                for old, new in zip(original[node.name].output, node.output, strict=False))
    )  # fmt: skip
    return ExecutedPrecision(low, len(asked), wider)


def _precision_notes(
    model: onnx.ModelProto,
    executed: onnx.ModelProto,
    before: Mapping[str, str],
    after: Mapping[str, str],
    casts: tuple[CastRecord, ...],
) -> list[str]:
    """Where the executed graph's precisions differ from the ONNX model's (``before``/``after`` as
    :func:`_executed_precision` takes them)."""
    original = {n.name: n for n in model.graph.node}
    executed_names = {n.name for n in executed.graph.node}
    notes = []
    changed = []
    for node in executed.graph.node:
        source = original.get(node.name)
        if source is None or node.op_type == "Cast":
            continue
        wanted = [before.get(v, "?") for v in source.output]
        ran = [after.get(v, "?") for v in node.output]
        if wanted != ran:
            changed.append(f"{node.name} ({node.op_type} {'/'.join(wanted)} -> {'/'.join(ran)})")
    if changed:
        notes.append(
            f"onnxruntime runs {len(changed)} node(s) in another precision than the ONNX model "
            f"states (no {PROVIDER} kernel for their dtype): {listed(changed)}"
        )
    removed = [c.node for c in casts if c.node not in executed_names]
    if removed:
        notes.append(
            f"onnxruntime removed {len(removed)} cast(s) of the ONNX model as redundant around "
            f"its fp32 fallbacks: {listed(removed)}"
        )
    inserted = [n.name for n in executed.graph.node if n.op_type == "Cast" and n.name not in original]
    if inserted:
        notes.append(f"onnxruntime inserted {len(inserted)} cast(s) of its own for those fallbacks")
    return notes

