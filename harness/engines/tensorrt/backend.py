"""The TensorRT backend: typed graph -> ONNX -> strongly typed TensorRT network -> engine.

The typed graph is exported with :func:`~harness.engines.onnx_export.export_onnx`
(explicit ``Cast`` nodes where the compiler put them) and parsed by
``trt.OnnxParser`` into a network created with ``STRONGLY_TYPED``, which
follows those types exactly. Weak modes (TensorRT 10.x only) parse the fp32
graph into a weakly typed network and let ``BuilderFlag.FP16``/``BF16``
choose; TensorRT 11 removed that and the mode is refused with the
replacements named (:func:`~harness.engines.tensorrt.versions.require_weak_typing`).
``explicit`` is the compiler's explicit-precision graph, strongly typed like
the others: its casts carry the user's choices.

Timing cache and reproducible builds (TensorRT >= 10.8). Builds use an
editable timing cache. The JSON cache handed to :meth:`TensorRTBackend.build`
is authoritative: ``ITimingCache.update`` can only replace keys a TensorRT
cache already holds, so when the JSON has entries and no binary cache of
this network is known yet, a first *key-discovery* build records the
network's keys; the cache is then rewritten to say exactly what the JSON
says (:func:`~harness.engines.tensorrt.builder.run_builder`) and the real
build runs with it (``ERROR_ON_TIMING_CACHE_MISS`` when asked). The binary
cache of each build is remembered per network for the life of the backend
object, so repeated builds (``harness rebuild``) discover keys once.
Every cache entry is a selection the build must keep (not only the entries
a user pinned with ``harness cache pin``: those are merely edited by hand).
After a build with a non-empty cache every selected key is looked up in the
built cache (``query``) and compared with the cache's selection, a selected key
the built cache lacks is an error, and every keyed layer is checked through the
one measured candidate it runs: kept, moved, or unverifiable with the reason
(a kernel no candidate or several candidates fit), which the build log reports;
a build whose tactics moved fails (``ERROR_ON_TIMING_CACHE_MISS`` has not
stopped re-timing on every TensorRT version). Only an editable cache has its
keys listed (``queryKeys``): a build without one records no keys. The
binary cache joined with the VERBOSE log (op names, candidates) then updates
the JSON cache in place; entries whose tactic did not change are left
untouched, so a rebuild from a complete cache leaves the file as it was. The log's ops
are joined to the inspector's engine layers by the ONNX nodes both list, by
name, or by a prefix at a name boundary (:mod:`harness.engines.tensorrt.join`),
which gives each engine layer its key and tactic hash. What the join cannot
place, and a log without keys, reach the build log's messages.

A batch sweep builds one engine (:class:`~harness.engines.protocol.BatchProfile`
in the config): the ONNX gets a dynamic batch axis and the build one
optimization profile over it (:func:`~harness.engines.tensorrt.builder.add_batch_profile`),
recorded in the kernel options (the cache provenance), the engine record
(``builder.batch_profile``) and the fingerprint; such an engine sets its
inputs' shapes on every run.

Engines are saved as a directory with ``engine.plan`` (TensorRT's serialized
engine, opaque and specific to the GPU model and TensorRT version) and
``plan.json``. Determinism is judged by the fingerprint: per-key tactic
hashes and per-layer tactic names from the engine inspector, never plan
bytes or timing-cache bytes, which differ between two GPUs of one model
even when every layer runs the same tactic.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import onnx
import torch
from pydantic import ConfigDict, Field
from pydantic import dataclasses as pydantic_dataclasses

from harness.cache.timing_cache import (
    CacheEntry,
    Provenance,
    TimingCache,
    normalize_hash,
)
from harness.documents import DOCUMENT, Digest, document_json
from harness.dtypes import dtype_from_name
from harness.engines.device import CudaQuery
from harness.engines.onnx_export import (
    CastRecord,
    TensorSpec,
    check_inputs,
    export_onnx,
    initializer_bytes_by_dtype,
    initializers_digest,
)
from harness.engines.onnx_plan import (
    ExportedInterface,
    check_output_count,
    interface_json,
    io_json,
    read_interface,
)
from harness.engines.protocol import (
    BatchProfile,
    BuildConfig,
    BuildLog,
    EngineBase,
    LayerInfo,
    LayerRecord,
)
from harness.engines.saved import PLAN_FILE, PlanFormat, PlanHeader, read_payload
from harness.engines.tensorrt.builder import (
    BuildSettings,
    TrtModule,
    build_settings,
    capture_log,
    layer_timings,
    load_trt,
    process_logger,
    run_builder,
)
from harness.engines.tensorrt.cache_bridge import (
    UNKNOWN_LAYER,
    check_pinned_layers,
    export_trt_cache,
    selections_not_kept,
)
from harness.engines.tensorrt.inspector import (
    InspectedLayer,
    engine_information_json,
    parse_engine_information,
    trt_fingerprint,
)
from harness.engines.tensorrt.join import join_ops, layer_keys
from harness.engines.tensorrt.log_parser import ParsedLog, parse_log
from harness.engines.tensorrt.versions import (
    ERROR_ON_TIMING_CACHE_MISS,
    TrtVersion,
    installed_version,
    require_weak_typing,
)
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest, json_bytes
from harness.machine import gpu_info
from harness.outputs import OutputSpec
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    import tensorrt

    from harness.autocast import CompiledGraph

BACKEND = "tensorrt"
PLAN_FORMAT = "harness-tensorrt-engine"
PLAN_VERSION = 4  # 4: compiler_settings holds the settings themselves; builder.batch_profile; the
# fingerprint covers mode, I/O and casts (EngineRecord.interface)
ENGINE_FILE = "engine.plan"


def _shape_of(dims: Any) -> tuple[int, ...]:
    """A TensorRT ``Dims`` as a plain tuple (its stubs declare indexing, not iteration)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise HarnessError(
            "the tensorrt backend needs a CUDA GPU, and PyTorch sees none "
            "(torch.cuda.is_available() is False); use backend cpu or onnxruntime here"
        )


def device_identity() -> tuple[str, dict[str, Any]]:
    """The GPU model and compute capability (they decide the kernels), plus driver details."""
    require_cuda()
    index = torch.cuda.current_device()  # the device engines are built for and run on
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    return f"{name} (sm_{major}{minor})", {
        "capability": f"{major}.{minor}",
        "cuda": torch.version.cuda,
        "driver": gpu_info().get("driver"),
    }


@pydantic_dataclasses.dataclass(frozen=True, config=ConfigDict(**DOCUMENT, serialize_by_alias=True, validate_by_name=True))
class AutotunedOp:
    """An op of the build log that owns a timing-cache key, with what joins it to engine layers
    (plans store ``layer`` as ``op``)."""

    layer: Annotated[str, Field(alias="op")]  # the op's name in the log
    key: str
    onnx_layers: tuple[str, ...]


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class CacheEntryRecord:
    """A timing-cache selection an engine was built with, as its plan records it."""

    key: str
    tactic_hash: str


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class BatchProfileRecord:
    """A :class:`~harness.engines.protocol.BatchProfile` as the plan's builder settings record it."""

    dim: Annotated[int, Field(ge=0)]
    min: Annotated[int, Field(ge=0)]
    opt: Annotated[int, Field(ge=0)]
    max: Annotated[int, Field(ge=0)]


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class BuilderRecord:
    """The builder settings of an engine (:meth:`~harness.engines.tensorrt.builder.BuildSettings.to_json`)."""

    tensorrt_version: str
    mode: str
    network_flags: tuple[str, ...]
    builder_flags: tuple[str, ...]
    tf32: bool
    builder_optimization_level: int
    avg_timing_iterations: int
    batch_profile: BatchProfileRecord | None


@dataclass(frozen=True)
class EngineRecord:
    """What plan.json says about an engine besides the plan bytes."""

    mode: str
    settings: dict[str, Any]
    device: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    casts: tuple[CastRecord, ...]
    autotuned: tuple[AutotunedOp, ...]  # keyed ops, joined to the inspector's layers on load
    cache_entries: tuple[tuple[str, str], ...]  # (key, tactic hash) the engine was built with
    weights_digest: str
    weight_bytes: dict[str, int]
    structure: OutputSpec
    compiler_settings: dict[str, Any] | None  # the autocast settings as JSON (None: they did not apply)

    @classmethod
    def from_plan(cls, plan: TensorRTPlan, where: str) -> EngineRecord:
        """The record of a plan (its digests are checked by the caller); a HarnessError naming
        ``where`` for an output structure that cannot be read."""
        return cls(
            **read_interface(plan, where),
            settings=document_json(plan.builder),
            device=plan.device,
            autotuned=plan.autotuned_ops,
            cache_entries=tuple((e.key, e.tactic_hash) for e in plan.cache_entries),
            weights_digest=plan.weights_digest,
            weight_bytes=dict(plan.weight_bytes_by_dtype),
        )

    @property
    def batch_profile(self) -> BatchProfile | None:
        """The optimization profile over the batch axis the engine was built with (None: static shapes)."""
        profile = self.settings.get("batch_profile")
        return None if profile is None else BatchProfile.from_json(profile)

    def interface(self) -> dict[str, Any]:
        """Mode, I/O tensors and casts: the fingerprint covers them besides the tactic decisions."""
        return io_json(self)

    def settings_digest(self) -> str | None:
        """Digest of :attr:`compiler_settings`, as the fingerprint covers it."""
        return None if self.compiler_settings is None else digest(canonical_json(self.compiler_settings))

    def to_json(self) -> dict[str, Any]:
        """The record's fields of plan.json (the inverse of :meth:`from_plan`)."""
        return {
            **interface_json(self),
            "builder": self.settings,
            "device": self.device,
            "autotuned_ops": [document_json(op) for op in self.autotuned],
            "cache_entries": [{"key": k, "tactic_hash": h} for k, h in self.cache_entries],
            "weights_digest": self.weights_digest,
            "weight_bytes_by_dtype": dict(self.weight_bytes),
        }

    def digest(self) -> str:
        """Digest of everything the record says; the fingerprint covers tactic decisions only.

        Two fields are digested under other names or forms than plan.json
        gives them (``weight_bytes``; entries as ``[key, tactic_hash]``
        pairs), as every saved engine's ``record_digest`` was computed.
        """
        fields = self.to_json()
        fields["weight_bytes"] = fields.pop("weight_bytes_by_dtype")
        fields["cache_entries"] = [list(e) for e in self.cache_entries]
        return digest(canonical_json(fields))


class TensorRTEngine(EngineBase):
    backend = BACKEND

    def __init__(self, plan: bytes, record: EngineRecord, trt_module: TrtModule | None = None) -> None:
        require_cuda()
        self.mode = record.mode
        self.record = record
        self.outputs = record.structure
        self._plan = plan
        trt = load_trt(trt_module)
        self._trt = trt
        with capture_log(trt) as capture:
            self._runtime = trt.Runtime(process_logger(trt))
            engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise HarnessError(
                "TensorRT cannot deserialize the engine plan (built by another TensorRT version or "
                "for another GPU?): " + ("; ".join(capture.problems) or "no error logged")
            )
        self._engine: tensorrt.ICudaEngine = engine
        self._check_io(trt)
        info = parse_engine_information(engine_information_json(engine, trt))
        self.inspected_layers = info.layers
        joined, unjoined = join_ops(record.autotuned, info.layers)
        keys, claimed_twice = layer_keys(joined)
        self.join_problems = [*unjoined, *claimed_twice]
        hashes = dict(record.cache_entries)
        self._layers = [_layer_info(layer, keys.get(layer.name, ""), hashes) for layer in info.layers]
        self._fingerprint = trt_fingerprint(
            info.layers,
            [CacheEntry(k, "", h, h, 0.0) for k, h in record.cache_entries],
            record.settings_digest(),
            record.batch_profile,
            record.interface(),
        )
        context = engine.create_execution_context()
        if context is None:
            raise HarnessError("TensorRT could not create an execution context (out of GPU memory?)")
        self._context: tensorrt.IExecutionContext = context
        self._stream: torch.cuda.Stream | None = None
        # What TensorRT warned while running the engine (each message once), for the case's warnings.
        self.run_warnings: list[str] = []

    def _check_io(self, trt: TrtModule) -> None:
        names = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)}
        expected = {s.name for s in (*self.record.inputs, *self.record.outputs)}
        if names != expected:
            raise HarnessError(
                f"engine I/O tensors {sorted(names)} differ from the plan's {sorted(expected)}"
            )
        for spec in self.record.inputs:
            if self._engine.get_tensor_mode(spec.name) != trt.TensorIOMode.INPUT:
                raise HarnessError(f"engine tensor {spec.name!r} is not an input")

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run once on the engine's own stream; inputs may live anywhere, outputs are CUDA tensors.

        An engine with a batch profile takes any batch size in its range: the
        inputs' shapes are set on the context, which then gives the outputs'.
        """
        check_inputs(inputs, self.record.inputs, "tensorrt engine")
        device = self._device()
        stream = self._own_stream()
        with torch.cuda.stream(stream):
            staged = tuple(t.detach().to(device, non_blocking=False).contiguous() for t in inputs)
            outputs = self._enqueue(stream, staged)
        stream.synchronize()  # type: ignore[no-untyped-call]
        return outputs

    def stage(self, *inputs: torch.Tensor, cuda_graph: bool = False) -> CudaQuery:
        """One inference on ``inputs`` staged on the GPU, for timing as trtexec times it
        (:class:`harness.engines.device.CudaQuery`: its own stream, buffers fixed, optionally
        a CUDA graph of the enqueue)."""
        check_inputs(inputs, self.record.inputs, "tensorrt engine")
        return CudaQuery(inputs, self._enqueue, device=self._device(), cuda_graph=cuda_graph)

    def replica(self) -> TensorRTEngine:
        """This engine on an execution context and a CUDA stream of its own: what a worker of a
        serving scenario runs (``trtexec --streams``; :mod:`harness.bench.scenario_run`).

        The deserialized engine (plan, weights) is shared; the context, its
        activation memory and the stream are the replica's, so replicas run
        concurrently on the GPU, each enqueueing on its own stream.
        """
        context = self._engine.create_execution_context()
        if context is None:
            raise HarnessError("TensorRT could not create another execution context (out of GPU memory?)")
        twin = copy.copy(self)
        twin._context = context
        twin._stream = None  # made on first use, on the replica's device
        twin.run_warnings = []
        return twin

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _own_stream(self) -> torch.cuda.Stream:
        """The stream :meth:`run` enqueues on: the engine's own, never the legacy default stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device())  # type: ignore[no-untyped-call]
        return self._stream

    def _enqueue(self, stream: torch.cuda.Stream, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Queue one inference on ``stream`` (never the default stream, handle 0), the inputs on the
        device: outputs allocated, every address set, ``execute_async_v3``. What TensorRT warns
        while queuing is kept in :attr:`run_warnings`; what it reports as an error fails the run."""
        if stream.cuda_stream == 0:
            raise HarnessError("the tensorrt engine runs on a stream of its own, not on the legacy default stream")
        device = inputs[0].device if inputs else self._device()
        if self.record.batch_profile is not None:
            self._set_input_shapes(list(inputs), self.record.batch_profile)
            shapes = [_shape_of(self._context.get_tensor_shape(spec.name)) for spec in self.record.outputs]
        else:
            shapes = [spec.shape for spec in self.record.outputs]
        outputs = tuple(
            torch.empty(shape, dtype=dtype_from_name(spec.dtype), device=device)
            for spec, shape in zip(self.record.outputs, shapes, strict=True)
        )
        for spec, tensor in zip((*self.record.inputs, *self.record.outputs), (*inputs, *outputs), strict=True):
            if not self._context.set_tensor_address(spec.name, tensor.data_ptr()):
                raise HarnessError(f"TensorRT refused the address of tensor {spec.name!r}")
        with capture_log(self._trt) as capture:
            ok = self._context.execute_async_v3(stream.cuda_stream)
        for warning in capture.warnings:
            if warning not in self.run_warnings:
                self.run_warnings.append(warning)
        if not ok:
            raise HarnessError(
                "TensorRT failed to run the engine: " + ("; ".join(capture.problems) or "no error logged")
            )
        return outputs

    def _set_input_shapes(self, inputs: list[torch.Tensor], profile: BatchProfile) -> None:
        for spec, tensor in zip(self.record.inputs, inputs, strict=True):
            if -1 not in spec.shape:
                continue
            size = int(tensor.shape[profile.dim])
            if not profile.covers(size):
                raise HarnessError(
                    f"tensorrt engine input {spec.name!r}: batch size {size} is outside the engine's "
                    f"optimization profile ({profile.min} to {profile.max})"
                )
            if not self._context.set_input_shape(spec.name, tuple(tensor.shape)):
                raise HarnessError(f"TensorRT refused the shape {tuple(tensor.shape)} of input {spec.name!r}")

    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(spec.torch_dtype for spec in self.record.inputs)

    def layers(self) -> list[LayerInfo]:
        return list(self._layers)

    def fingerprint(self) -> str:
        return self._fingerprint

    def compiler_settings(self) -> dict[str, Any] | None:
        return self.record.compiler_settings

    def weights_digest(self) -> str:
        return self.record.weights_digest

    def size_bytes(self) -> int:
        return len(self._plan)

    def weight_bytes_by_dtype(self) -> dict[str, int]:
        return dict(self.record.weight_bytes)

    def device_memory_bytes(self) -> int | None:
        return int(self._engine.device_memory_size_v2)

    def plan_json(self) -> dict[str, Any]:
        return {
            **PLAN.header(),
            **self.record.to_json(),
            # key is null for a layer the build log does not name (e.g. not autotuned).
            "layers": [document_json(LayerRecord.of(layer, layer.key or None)) for layer in self._layers],
            "record_digest": self.record.digest(),
            "plan_file": ENGINE_FILE,
            "plan_digest": digest(self._plan),
            "fingerprint": self._fingerprint,
        }

    def files(self) -> dict[str, bytes]:
        """``engine.plan`` and ``plan.json``."""
        return {ENGINE_FILE: self._plan, PLAN_FILE: json_bytes(PLAN.dump(self.plan_json()))}

    @staticmethod
    def load(path: str | os.PathLike[str], trt_module: TrtModule | None = None) -> TensorRTEngine:
        directory, saved, where = PLAN.load(path)
        plan = read_payload(directory, saved.plan_file, saved.plan_digest, "engine")
        record = EngineRecord.from_plan(saved, where)
        if record.digest() != saved.record_digest:
            raise HarnessError(f"{where}: the plan's fields do not match its record digest; it was edited")
        check_output_count(record.structure, record.outputs, where)
        engine = TensorRTEngine(plan, record, trt_module)
        if engine.fingerprint() != saved.fingerprint:
            raise HarnessError(
                f"{where}: the fingerprint does not match the engine's layers, cache entries, mode, I/O and "
                "casts; the plan was edited or belongs to another engine, rebuild it"
            )
        return engine


def _layer_info(layer: InspectedLayer, key: str, hashes: dict[str, str]) -> LayerInfo:
    return LayerInfo(
        name=layer.name,
        layer_type=layer.layer_type,
        key=key,
        input_dtypes=layer.input_dtypes,
        output_dtypes=layer.output_dtypes,
        tactic=layer.tactic_name or "",
        tactic_hash=hashes.get(key, "") if key else (layer.tactic_value or ""),
    )


class TensorRTBackend:
    """Builds TensorRT engines. A batch sweep gets one engine (an optimization profile over the
    batch axis, :class:`~harness.engines.protocol.BatchProfile`) instead of one per size:
    TensorRT builds take minutes, and one engine serving every size is how it is deployed."""

    name = BACKEND
    batch_profiles = True

    def __init__(self, trt_module: TrtModule | None = None) -> None:
        self._trt_module = trt_module
        # network id -> serialized ITimingCache of its last build (the keys a cache's selections
        # can update) and the ops its logs named (a rebuild whose every key the cache selects
        # autotunes nothing, so logs nothing).
        self._key_sources: dict[str, tuple[bytes, ParsedLog]] = {}

    def check_available(self) -> None:
        """TensorRT's bindings with their native libraries, and a CUDA GPU."""
        self._trt()
        require_cuda()

    def _trt(self) -> tuple[TrtModule, TrtVersion]:
        trt = load_trt(self._trt_module)
        return trt, installed_version(trt)

    def supported_modes(self) -> tuple[PrecisionMode, ...]:
        _, version = self._trt()
        return tuple(m for m in PrecisionMode if version.major <= 10 or not m.weak)

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        mode = PrecisionMode.parse(mode)
        if mode.weak:
            _, version = self._trt()
            require_weak_typing(version, mode)
        return mode

    def settings(self, config: BuildConfig) -> BuildSettings:
        """The flag names and numbers a build with ``config`` uses on this TensorRT."""
        _, version = self._trt()
        return build_settings(
            version,
            config.mode,
            config.options,
            timing_cache=not config.disable_cache,
            editable=config.editable_cache,
            error_on_cache_miss=config.error_on_cache_miss,
            batch_profile=config.batch_profile,
        )

    def provenance(self, config: BuildConfig) -> Provenance:
        settings = self.settings(config)
        device, details = device_identity()
        options = {**settings.kernel_options(), "autocast": config.compiler_settings()}
        return Provenance(BACKEND, str(settings.version), device, details, options)

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[TensorRTEngine, BuildLog]:
        trt, _ = self._trt()
        settings = self.settings(config)
        provenance = self.provenance(config)
        if config.disable_cache:
            cache = None
        # Every entry of a non-empty cache is a selection this build must keep.
        enforced = cache if cache is not None and len(cache) else None
        if enforced is not None and not config.editable_cache:
            raise HarnessError(
                "enforcing a timing cache's tactic selections needs an editable TensorRT cache; "
                "enable editable_cache (the default) or build without the cache"
            )
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="harness-trt-") as tmp:
            batch_dim = None if config.batch_profile is None else config.batch_profile.dim
            exported = export_onnx(graph, Path(tmp) / "model.onnx", batch_dim=batch_dim)
            onnx_bytes = exported.path.read_bytes()
        network_id = digest(onnx_bytes + canonical_json(settings.kernel_options()))
        base, earlier_log, messages = self._selection_base(
            trt, onnx_bytes, settings, enforced, network_id, config, exported.inputs
        )
        run = run_builder(
            trt,
            onnx_bytes,
            settings,
            base_cache=base,
            enforced=enforced,
            ignore_mismatch=config.ignore_cache_mismatch,
            inputs=exported.inputs,
        )
        parsed = parse_log(run.capture.text)
        entries: list[CacheEntry] = []
        named = ParsedLog(earlier_log.layers + parsed.layers)
        if run.cache is not None:
            self._key_sources[network_id] = (run.cache_bytes, named)
            entries = name_entries(export_trt_cache(run.cache, named, provenance), cache)
        messages += [*run.selection_messages, *parsed.problems, *run.capture.problems]
        model = onnx.load_from_string(onnx_bytes)
        record = EngineRecord(
            mode=config.mode,
            settings=settings.to_json(),
            device=provenance.device,
            inputs=exported.inputs,
            outputs=exported.outputs,
            casts=exported.casts,
            autotuned=autotuned_ops(named, entries),
            cache_entries=tuple((e.key, e.tactic_hash) for e in entries),
            weights_digest=initializers_digest(model),
            weight_bytes=initializer_bytes_by_dtype(model),
            structure=graph.outputs,
            compiler_settings=config.compiler_settings(),
        )
        engine = TensorRTEngine(run.plan, record, self._trt_module)
        if enforced is not None:
            messages += unverifiable_pins(config.mode, enforced, engine)
        joined, join_problems = join_ops(parsed.layers, engine.inspected_layers)
        messages = list(dict.fromkeys([*messages, *join_problems, *engine.join_problems]))
        known = {key.lower() for key in enforced.query_keys()} if enforced is not None else set()
        keyed = {layer.name for layer in engine.layers() if layer.key}
        timings = layer_timings(parsed, entries, known, joined, engine.inspected_layers, keyed)
        new_entries = changed_decisions(cache, entries) if cache is not None else []
        log = BuildLog(BACKEND, config.mode, timings, messages, time.perf_counter() - start, new_entries)
        return engine, log

    def _selection_base(
        self,
        trt: TrtModule,
        onnx_bytes: bytes,
        settings: BuildSettings,
        enforced: TimingCache | None,
        network_id: str,
        config: BuildConfig,
        inputs: tuple[TensorSpec, ...],
    ) -> tuple[bytes | None, ParsedLog, list[str]]:
        """The binary cache the selections are written into: remembered, or recorded by a discovery build;
        with the log of the build that recorded it.

        Without a cache to enforce a build starts from an empty cache and times everything, as
        an independent build would.
        """
        if enforced is None:
            return None, ParsedLog(), []
        remembered = self._key_sources.get(network_id)
        if remembered is not None:
            return remembered[0], remembered[1], []
        discovery = run_builder(
            trt,
            onnx_bytes,
            _without_error_on_miss(settings),
            base_cache=None,
            enforced=None,
            ignore_mismatch=config.ignore_cache_mismatch,
            inputs=inputs,
        )
        parsed = parse_log(discovery.capture.text)
        note = (
            f"key discovery: a first build recorded {len(parsed.by_key())} autotuned layer key(s) so "
            "that the JSON cache's tactics could be written into TensorRT's cache"
        )
        return discovery.cache_bytes, parsed, [note]

    def load(self, path: str | os.PathLike[str]) -> TensorRTEngine:
        return TensorRTEngine.load(path, self._trt_module)


def unverifiable_pins(mode: str, enforced: TimingCache, engine: TensorRTEngine) -> list[str]:
    """A line per keyed engine layer whose selected tactic cannot be confirmed from the engine;
    a layer that runs another of its key's candidates fails the build (the engine is discarded)."""
    keys = {layer.name: layer.key for layer in engine.layers() if layer.key}
    checks = check_pinned_layers(
        enforced, [(layer, keys[layer.name]) for layer in engine.inspected_layers if layer.name in keys]
    )
    moved = [check.line() for check in checks if check.verdict == "moved"]
    if moved:
        raise selections_not_kept(mode, moved)
    return [check.line() for check in checks if check.verdict == "unverifiable"]


def _without_error_on_miss(settings: BuildSettings) -> BuildSettings:
    return replace(settings, builder_flags=tuple(f for f in settings.builder_flags if f != ERROR_ON_TIMING_CACHE_MISS))


def autotuned_ops(named: ParsedLog, entries: list[CacheEntry]) -> tuple[AutotunedOp, ...]:
    """The op of every key the engine was built with: from the logs (with its ONNX nodes) or,
    for a key served by the JSON cache, under that cache's layer name."""
    logged = {str(p.key).lower(): p for p in named.complete()}
    ops = []
    for entry in entries:
        op = logged.get(entry.key.lower())
        if op is not None:
            ops.append(AutotunedOp(op.layer, entry.key, op.onnx_layers))
        elif entry.layer != UNKNOWN_LAYER:
            ops.append(AutotunedOp(entry.layer, entry.key, ()))
    return tuple(ops)


def name_entries(exported: TimingCache, given: TimingCache | None) -> list[CacheEntry]:
    """Entries of the built cache; a key the logs do not name takes its name from the JSON cache."""
    entries = []
    for entry in exported.entries():
        prior = given.query(entry.key) if given is not None else None
        if entry.layer == UNKNOWN_LAYER and prior is not None:
            same = normalize_hash(prior.tactic_hash) == normalize_hash(entry.tactic_hash)
            entry = replace(
                entry,
                layer=prior.layer,
                tactic=prior.tactic if same else entry.tactic,
                candidates=prior.candidates,
            )
        entries.append(entry)
    return entries


def changed_decisions(cache: TimingCache, entries: list[CacheEntry]) -> list[CacheEntry]:
    """The build's decisions the cache lacks or records differently (what to write back)."""
    changed = []
    for entry in entries:
        prior = cache.query(entry.key)
        if prior is None or normalize_hash(prior.tactic_hash) != normalize_hash(entry.tactic_hash):
            changed.append(entry)
    return changed


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class TensorRTPlan(ExportedInterface, PlanHeader):
    """A saved TensorRT engine's ``plan.json``: the header, the interface, the rest of the
    :class:`EngineRecord` (covered by ``record_digest``), the engine's layers, then the engine
    file, its digest and the fingerprint."""

    builder: BuilderRecord
    device: str
    autotuned_ops: tuple[AutotunedOp, ...]
    cache_entries: tuple[CacheEntryRecord, ...]
    weights_digest: Digest
    weight_bytes_by_dtype: dict[str, int]
    layers: tuple[LayerRecord, ...]
    record_digest: Digest
    plan_file: Literal["engine.plan"]
    plan_digest: Digest
    fingerprint: Digest


PLAN = PlanFormat(BACKEND, PLAN_FORMAT, PLAN_VERSION, ENGINE_FILE, TensorRTPlan)
