"""The benchmark matrix: models x precision modes on one backend, one case at a time.

Each case builds an engine through :func:`harness.build.build_engine` with a
timing cache of its own (``<cache dir>/<model>-<mode>.json``), so the first
run times tactics and every later run takes them from the cache. On a backend
that builds batch profiles (TensorRT, :func:`~harness.engines.protocol.builds_batch_profiles`)
a batch sweep builds one engine per (model, mode), covering every size of the
sweep, and runs each size on it; elsewhere each size gets its own engine. Then it measures
accuracy against the fp32 eager model, latency (with telemetry sampled
around the timing loop) and memory, and appends the case to the results
file at once. A case that fails at any stage is recorded with the stage and
the error, and the matrix goes on; a KeyboardInterrupt propagates after the
finished cases are on disk (the file stays ``complete: false``).

The matrix order is fixed (models in the order given, modes in the order
given), so ``--shard i/n`` (every n-th case starting at the i-th) splits it
the same way on every CI runner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from harness.autocast.settings import AutocastSettings
from harness.bench.accuracy import TaskAccuracy, compare_outputs, output_digest
from harness.bench.latency import measure_device_latency, measure_latency, measure_overhead
from harness.bench.memory import MemoryReport, measure_memory
from harness.bench.results import BUSY_PREFIX, CaseKey, CaseResult, ResultsWriter, is_peer
from harness.bench.scenarios import Scenario
from harness.bench.stats import Summary
from harness.bench.telemetry import TelemetrySampler
from harness.build import BuildResult, build_engine
from harness.cache.timing_cache import TimingCache
from harness.engines.device import DeviceEngine, DeviceQuery
from harness.engines.protocol import (
    Backend,
    BatchProfile,
    BuildConfig,
    Engine,
    builds_batch_profiles,
    engine_inputs,
)
from harness.errors import HarnessError, StaticBatchError
from harness.fileio import WriteFailed, digest
from harness.globalstate import preserves_global_state
from harness.limits import (
    MAX_ITERS,
    MAX_MIN_DURATION_S,
    MAX_THREADS,
    MAX_WARMUP_S,
    check_int,
    check_seconds,
)
from harness.outputs import tensor_paths
from harness.precision import PrecisionMode

DEFAULT_MODELS = ("resnet", "transformer", "digits")
# Zoo models of DEFAULT_MODELS that need an extra: (module it imports, the extra).
_DEFAULT_MODEL_EXTRAS = {"digits": ("sklearn", "digits")}
# Backends whose engines run on a CUDA device: timed with CUDA events, GPU memory recorded.
GPU_BACKENDS = frozenset({"tensorrt"})
EXPLICIT_MODE = PrecisionMode.EXPLICIT


# One thread by default: on a busy 2-core machine PyTorch's default thread
# count turned 0.05 ms calls into 30 ms ones for seconds at a time (its worker
# threads wait for cores other processes hold); one thread had no slow calls.
DEFAULT_THREADS = 1


@dataclass(frozen=True)
class MeasureSettings:
    """How long each case is measured; recorded in the results ``settings``.

    The defaults keep the 27-case CPU matrix (3 models x 9 modes) at about
    10 s per case including the build, well inside the 15-minute budget of
    ``nox -s bench`` on two cores, while giving the gate at least 30 samples
    per case; ``QUICK`` is for smoke tests of the pipeline, not for numbers.
    """

    warmup_s: float = 1.0
    min_iters: int = 30
    min_duration_s: float = 4.0
    # Caps microsecond-scale cases (20000 samples are plenty for the gate's
    # test) so a run file with raw samples stays around a megabyte.
    max_iters: int = 20000
    telemetry_interval_s: float = 0.25
    # IQR/median above which a case is flagged unstable; None: the timer's
    # default (5% on CPU, 2.5% on GPU as trtexec warns).
    spread_threshold: float | None = None
    # Intra-op threads of every candidate (engines, the eager reference),
    # pinned for the whole case and restored afterwards.
    threads: int = DEFAULT_THREADS
    # A GPU engine's enqueue captured once into a CUDA graph and replayed (trtexec --useCudaGraph).
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        """Refuse, before any case runs, what would hang a run or exhaust memory (harness.limits).

        Unbounded, ``min_duration_s = 1e9`` never ends and ``max_iters = 10**19``
        stores samples until the process is killed; NaN, which passes the
        project file's schema, would disable the bound it stands in.
        """
        check_seconds(self.warmup_s, "[timing] warmup_s", MAX_WARMUP_S)
        check_seconds(self.min_duration_s, "[timing] min_duration_s", MAX_MIN_DURATION_S)
        check_int(self.max_iters, "[timing] max_iters", 1, MAX_ITERS)
        check_int(self.min_iters, "[timing] min_iters", 1, self.max_iters)  # more would fail every case
        check_int(self.threads, "threads", 1, MAX_THREADS)
        if not 0 < self.telemetry_interval_s <= 60:
            raise HarnessError(f"telemetry interval {self.telemetry_interval_s!r}: valid: 0..60 seconds, not 0")
        if self.spread_threshold is not None and not 0 <= self.spread_threshold < 10:
            raise HarnessError(f"spread threshold {self.spread_threshold!r}: valid: 0%..1000%")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


QUICK = MeasureSettings(
    warmup_s=0.02, min_iters=5, min_duration_s=0.05, max_iters=200, telemetry_interval_s=0.05
)


def default_modes(backend: Backend) -> tuple[PrecisionMode, ...]:
    """Every mode the backend builds except ``explicit``, which needs a user file."""
    return tuple(m for m in backend.supported_modes() if m != EXPLICIT_MODE)


def default_models() -> tuple[list[str], list[str]]:
    """:data:`DEFAULT_MODELS` that can load here, and a note for each left out (its extra missing)."""
    from harness.extras import missing

    models, notes = [], []
    for name in DEFAULT_MODELS:
        module, extra = _DEFAULT_MODEL_EXTRAS.get(name, (None, None))
        problem = None if module is None or extra is None else missing((module,), extra, f"the zoo model {name!r}")
        if problem is None:
            models.append(name)
        else:
            notes.append(f"default model {name} left out: {problem}")
    return models, notes


def _static_batch_errors() -> tuple[type[Exception], ...]:
    """What a build raises when the typed graph pins the batch size.

    ``harness.errors.StaticBatchError``, and the ONNX hand-off's class of that
    name while it defines its own: looked up only if that module was imported
    (it raises it), so the runner never imports the optional ONNX exporter.
    """
    onnx_export = sys.modules.get("harness.engines.onnx_export")
    other = getattr(onnx_export, "StaticBatchError", StaticBatchError)
    return (StaticBatchError, other)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` with 1 <= i <= n, as given to ``--shard``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise HarnessError(f"--shard {text!r}: expected i/n, e.g. 1/2 (shard i of n, 1-based)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise HarnessError(f"--shard {text!r}: need 1 <= i <= n and n >= 1")
    return index, count


Case = tuple[str, PrecisionMode, "int | None"]  # (model reference, mode, batch size or None: the model's own)


def build_matrix(
    models: Sequence[str],
    modes: Sequence[PrecisionMode],
    shard: tuple[int, int] | None = None,
    batch_sizes: Sequence[int | None] = (None,),
) -> list[Case]:
    """(model, mode, batch) in the deterministic order, restricted to ``shard`` if given."""
    cases = [(model, mode, batch) for model in models for batch in batch_sizes for mode in modes]
    if shard is None:
        return cases
    index, count = shard
    return cases[index - 1 :: count]


def cache_file(cache_dir: str | os.PathLike[str], model: str, config: BuildConfig, backend: Backend) -> Path:
    """One timing cache per (model name, mode, backend, threads, device, autocast settings).

    Each of these decides which tactics a build may time, so each gets its own
    file: switching backend, thread count or settings starts a new cache
    instead of failing every case against the previous run's. The device is the
    one the backend's caches record (:meth:`Backend.provenance`: a CPU with its
    kernel-relevant ISA, a GPU), so machines that share a machine id but not their
    kernels (two CPUs of one generic model name) keep their caches side by side.
    """
    device = digest(backend.provenance(config).device.encode()).removeprefix("sha256:")[:8]
    parts = [model, config.mode, backend.name, f"t{config.thread_count()}", f"d{device}"]
    settings = config.autocast_digest()
    if settings is not None:
        parts.append(settings.removeprefix("sha256:")[:10])
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)).strip("._")
    return Path(cache_dir) / f"{stem}.json"


@dataclass(frozen=True)
class ModelPlan:
    """How one model is benchmarked besides its modes: its compiler settings and explicit file."""

    autocast: AutocastSettings = field(default_factory=AutocastSettings)
    explicit: str | None = None


def _is_logits(outputs: list[torch.Tensor]) -> bool:
    """Top-1 agreement means something for (batch, classes) outputs only."""
    return all(o.dim() == 2 and o.shape[-1] > 1 and o.is_floating_point() for o in outputs)


def _error_text(stage: str, exc: Exception) -> str:
    detail = str(exc) if isinstance(exc, HarnessError) else f"{type(exc).__name__}: {exc}"
    return f"{stage}: {detail or type(exc).__name__}"


class _CountingRun:
    """An engine call that counts the examples (rows of the first input) fed to it.

    ``ModelSpec.evaluate`` returns only the metric; the sample count the
    results record needs is observed here instead of assumed. ``evaluate``
    feeds the model's own (fp32) inputs: they reach the engine in the dtypes
    it declares (:func:`engine_inputs`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples = 0

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The engine's outputs, in the structure the eager model returns (:meth:`Engine.__call__`)."""
        if inputs and inputs[0].dim() > 0:
            self.samples += int(inputs[0].shape[0])
        return self.engine(*engine_inputs(self.engine, inputs))


@dataclass
class _Shared:
    """The one engine every batch size of a (model, mode) sweep runs on, or why it failed."""

    built: BuildResult | None = None
    seconds: float = 0.0
    error: Exception | None = None
    cases: int = 0  # cases run on it so far (the first one's build made it)


@dataclass
class _Reference:
    outputs: Any
    logits: bool


CaseHook = Callable[[dict[str, Any]], None]
ModelLoader = Callable[[str, "int | None"], Any]


def _load_model(name: str, batch_size: int | None = None) -> Any:
    from harness import models

    return models.load(name, batch_size)


class BenchRunner:
    """Runs (model, mode) cases on one backend and appends them to a results writer."""

    def __init__(
        self,
        backend: Backend,
        *,
        cache_dir: str | os.PathLike[str] | None,
        settings: MeasureSettings = MeasureSettings(),
        plans: Mapping[str, ModelPlan] | None = None,
        load_model: ModelLoader = _load_model,
        ignore_cache_mismatch: bool = False,
        batch_sizes: Sequence[int] = (),
        scenarios: Sequence[Scenario] = (Scenario(),),
    ) -> None:
        self.backend = backend
        # None: no timing cache; every case's build times every layer (``--disable-cache``)
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.settings = settings
        self.plans = dict(plans or {})
        self.load_model = load_model
        self.ignore_cache_mismatch = ignore_cache_mismatch
        # The whole sweep (not a shard's part of it): a shared engine's profile covers it all,
        # so every shard builds the same engine and reads the same cache file.
        self.batch_sizes = tuple(batch_sizes)
        self._overhead: Summary | None = None
        self._references: dict[tuple[str, int | None], _Reference] = {}
        self._profiles: dict[str, BatchProfile | None] = {}
        self._shared: dict[tuple[str, str], _Shared] = {}
        # (model, mode) sweeps whose typed graph fixes the batch size: one engine per size, and why.
        self._per_size: dict[tuple[str, str], str] = {}
        # Every engine case is measured in each scenario, on one build (harness.bench.scenarios).
        self.scenarios = tuple(scenarios) or (Scenario(),)
        self._recent: tuple[tuple[str, str, int | None], BuildResult, dict[str, Any]] | None = None

    def reference(self, model: str, batch: int | None = None) -> _Reference:
        """fp32 eager outputs on the spec's fixed example inputs, once per model and batch size;
        for an ONNX file, the file's own fp32 run in ONNX Runtime (:mod:`harness.sources`)."""
        if (model, batch) not in self._references:
            from harness.sources import reference_outputs

            spec = self.load_model(model, batch)
            outputs = reference_outputs(spec)
            if outputs is None:
                module = spec.module.float().eval()
                with torch.inference_mode():
                    outputs = module(*spec.example_inputs)
            self._references[model, batch] = _Reference(
                outputs, _is_logits([t for _, t in tensor_paths(outputs, "reference")])
            )
        return self._references[model, batch]

    def run_case(
        self, model: str, mode: PrecisionMode, batch: int | None = None, scenario: Scenario | None = None
    ) -> dict[str, Any]:
        """One engine case as a results entry (see :meth:`measured_case`), in ``scenario``
        (single-stream when None)."""
        scenario = scenario or Scenario()

        def measure(stage: list[str]) -> tuple[CaseResult, dict[str, Any]]:
            case, build = self._measure_case(model, mode, batch, stage, scenario)
            return case, {"build": build}

        return self.measured_case(
            model, mode, self.backend.name, batch, measure, gpu_index=self._gpu_index(), scenario=scenario
        )

    @preserves_global_state
    def measured_case(
        self,
        model: str,
        mode: str,
        backend: str,
        batch: int | None,
        measure: Callable[[list[str]], tuple[CaseResult, dict[str, Any]]],
        *,
        gpu_index: int | None = None,
        scenario: Scenario | None = None,
    ) -> dict[str, Any]:
        """A case as a results entry; any failure becomes a ``failed`` entry naming its stage.

        ``measure`` returns the case and the fields it adds to the entry (an
        engine's ``build``, a peer's ``peer``: :mod:`harness.bench.peers`),
        keeping in ``stage[0]`` the step in progress. Peak RSS covers the whole
        case (build, accuracy runs and the timing loop), the "peak host RSS
        during the run" a reader expects. Every candidate runs with
        ``settings.threads`` intra-op threads.
        """
        torch.set_num_threads(self.settings.threads)
        load_start = list(os.getloadavg())
        stage = ["load model"]
        try:
            (case, extra), peaks = measure_memory(lambda: measure(stage), gpu_index=gpu_index)
            engine_memory = case.memory or MemoryReport()
            case.threads = self.settings.threads
            case.load_average = {"start": load_start, "end": list(os.getloadavg()), "cpus": os.cpu_count() or 1}
            case.warnings = [*case.warnings, *load_warnings(case.load_average)]
            case.memory = dataclasses.replace(
                peaks,
                weight_bytes=engine_memory.weight_bytes,
                engine_bytes=engine_memory.engine_bytes,
                engine_device_bytes=engine_memory.engine_device_bytes,
            )
            return {**case.to_dict(), **extra}
        except WriteFailed:  # a full disk or a quota ends the run (nothing of it is kept), not one case
            raise
        except Exception as exc:  # recorded, and the matrix goes on; Ctrl-C is not an Exception
            return self.failed_entry(model, mode, backend, batch, scenario, _error_text(stage[0], exc))

    def failed_entry(
        self, model: str, mode: str, backend: str, batch: int | None, scenario: Scenario | None, error: str
    ) -> dict[str, Any]:
        """The results entry of a case that failed with ``error`` (its stage and reason)."""
        from harness.bench.scenario_run import scenario_stub

        stub = None if scenario is None or scenario.single_stream else scenario_stub(scenario)
        return CaseResult.failed(self.name_of(model), mode, backend, error, batch, stub).to_dict()

    def replica(self, cache_dir: str | os.PathLike[str] | None) -> BenchRunner:
        """A fresh runner of this configuration (nothing built or measured yet) keeping its timing
        caches in ``cache_dir`` (None: none)."""
        return BenchRunner(
            self.backend,
            cache_dir=cache_dir,
            settings=self.settings,
            plans=self.plans,
            load_model=self.load_model,
            ignore_cache_mismatch=self.ignore_cache_mismatch,
            batch_sizes=self.batch_sizes,
            scenarios=self.scenarios,
        )

    def name_of(self, model: str) -> str:
        """The name results use for a model reference: its ModelSpec's name (never a file path)."""
        try:
            return str(self.load_model(model, None).name)
        except Exception:  # noqa: BLE001 - a model that does not load is named by its reference
            return model

    def config(self, model: str, mode: PrecisionMode) -> BuildConfig:
        """The build configuration of ``model`` in ``mode``, with the sweep's profile where one engine serves it."""
        plan = self.plans.get(model, ModelPlan())
        profile = None if (model, mode) in self._per_size else self.batch_profile(model)
        return BuildConfig(
            mode=mode,
            explicit_path=plan.explicit if mode == EXPLICIT_MODE else None,
            threads=self.settings.threads,
            autocast=plan.autocast,
            ignore_cache_mismatch=self.ignore_cache_mismatch,
            disable_cache=self.cache_dir is None,
            batch_profile=profile,
        )

    def batch_profile(self, model: str) -> BatchProfile | None:
        """The profile of one engine for the whole sweep, on backends that build them; else None.

        Its dimension is the model's declared ``batch_dim``, else the one
        dimension of its inputs that changes with the batch size (a factory
        taking ``batch_size``); a model where that is not one dimension gets one
        engine per size.
        """
        sizes = self.batch_sizes
        if not builds_batch_profiles(self.backend) or len(set(sizes)) < 2:
            return None
        if model not in self._profiles:
            dim = self.load_model(model, None).batch_dim
            if dim is None:
                low, high = (self.load_model(model, n).example_inputs for n in (min(sizes), max(sizes)))
                changed = {
                    i
                    for a, b in zip(low, high, strict=True)
                    for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=False))
                    if x != y
                }
                dim = changed.pop() if len(changed) == 1 else None
            self._profiles[model] = None if dim is None else BatchProfile.for_sweep(dim, sizes)
        return self._profiles[model]

    def cache_path(self, model: str, config: BuildConfig, batch: int | None) -> Path | None:
        """The timing cache of a case: per batch size, or one per sweep for an engine serving it all
        (None when the run keeps no caches)."""
        if self.cache_dir is None:
            return None
        name = self.name_of(model)
        profile = config.batch_profile
        if profile is not None:
            name += f"-b{profile.min}to{profile.max}opt{profile.opt}"
        elif batch is not None:
            name += f"-b{batch}"
        return cache_file(self.cache_dir, name, config, self.backend)

    def gpu_index(self) -> int | None:
        """The CUDA device a GPU backend runs on (GPU memory is recorded for it), else None."""
        return self._gpu_index()

    def _gpu_index(self) -> int | None:
        """The CUDA device a GPU backend runs on (GPU memory is recorded for it), else None."""
        if self.backend.name not in GPU_BACKENDS or not torch.cuda.is_available():
            return None
        return int(torch.cuda.current_device())

    def _measure_case(
        self, model: str, mode: PrecisionMode, batch: int | None, stage: list[str], scenario: Scenario | None = None
    ) -> tuple[CaseResult, dict[str, Any]]:
        """The case (memory: the engine's parts only) and its build record.

        ``stage[0]`` names the step in progress, for the error of a failed case.
        The scenarios of one (model, mode, batch) run on one build: the first
        builds it, the others reuse it (their build record says so).
        """
        from harness.sources import model_identity, source_of

        scenario = scenario or Scenario()
        spec = self.load_model(model, batch)
        stage[0] = "fp32 eager reference"
        ref = self.reference(model, batch)
        stage[0] = "build"
        recent = self._recent
        if recent is not None and recent[0] == (model, mode, batch):
            built, build = recent[1], {**recent[2], "reused": True}
        else:
            self._recent = None  # the previous case's engine goes before this one is built
            built, build = self._build(model, mode, batch, spec)
            if len(self.scenarios) > 1:
                self._recent = ((model, mode, batch), built, build)
        engine = built.engine
        inputs = engine_inputs(engine, spec.example_inputs)  # the reference ran on the originals
        stage[0] = "run"
        with torch.inference_mode():
            outputs = engine(*inputs)
        stage[0] = "accuracy"
        accuracy = compare_outputs(outputs, ref.outputs, logits=ref.logits)
        task = self._task_accuracy(spec, engine)
        stage[0] = "latency" if scenario.single_stream else f"scenario {scenario.label()}"
        record = None
        if scenario.single_stream:
            latency, telemetry = self._latency(engine, inputs, spec.batch_dim)
        else:
            from harness.bench.scenario_run import measure_scenario

            latency, telemetry, record = measure_scenario(
                self, engine, inputs, _batch_size(inputs, spec.batch_dim), scenario
            )
        source = source_of(spec)
        executed = engine.executed_precision()
        stage[0] = "memory"
        return CaseResult(
            model=spec.name,
            mode=mode,
            batch=batch,
            backend=self.backend.name,
            latency=latency,
            memory=MemoryReport(
                weight_bytes=dict(sorted(engine.weight_bytes_by_dtype().items())),
                engine_bytes=engine.size_bytes(),
                engine_device_bytes=engine.device_memory_bytes(),
            ),
            accuracy=accuracy,
            task_accuracy=task,
            telemetry=telemetry,
            engine_fingerprint=engine.fingerprint(),
            timing_cache_digest=_cache_digest(built),
            from_cache=built.cache_hits > 0 and built.cache_misses == 0,
            output_digest=output_digest(outputs),
            model_weights_digest=model_identity(spec),
            layers=[layer.to_json() for layer in engine.layers()],
            warnings=[
                *built.log.warnings,
                *(engine.run_warnings if isinstance(engine, DeviceEngine) else ()),
                *(record.get("warnings", []) if record else ()),
            ],
            scenario=None if record is None else {k: v for k, v in record.items() if k != "warnings"},
            source=None if source is None else source.to_json(),
            executed_precision=None if executed is None else executed.to_json(),
        ), build

    def _build(self, model: str, mode: PrecisionMode, batch: int | None, spec: Any) -> tuple[BuildResult, dict[str, Any]]:
        """The engine a case runs on, and its build record.

        Where one engine serves the sweep, the first case of a (model, mode)
        builds it (from the model at the sweep's largest size: torch.export
        keeps a batch axis dynamic only for a size above 1) and the others
        reuse it, its failure included; a graph that fixes its batch size falls
        back to one engine per size, saying why in the build record.
        """
        config = self.config(model, mode)
        if config.batch_profile is None:
            built, seconds = self._timed_build(model, spec, config, batch)
            return built, _build_record(built, seconds, config, reused=False, note=self._per_size.get((model, mode)))
        key = (model, mode)
        shared = self._shared.get(key)
        if shared is None:
            # The matrix runs a model's sizes and modes together: earlier models' engines can go.
            self._shared = {k: v for k, v in self._shared.items() if k[0] == model}
            shared = _Shared()
            try:
                biggest = self.load_model(model, config.batch_profile.max)
                shared.built, shared.seconds = self._timed_build(model, biggest, config, batch)
            except _static_batch_errors() as exc:
                self._per_size[key] = f"one engine per batch size: {exc}"
                return self._build(model, mode, batch, spec)
            except Exception as exc:
                shared.error = exc
            self._shared[key] = shared
        if shared.error is not None:
            raise shared.error
        assert shared.built is not None
        shared.cases += 1
        return shared.built, _build_record(shared.built, shared.seconds, config, reused=shared.cases > 1)

    def _timed_build(self, model: str, spec: Any, config: BuildConfig, batch: int | None) -> tuple[BuildResult, float]:
        cache_path = self.cache_path(model, config, batch)
        if cache_path is not None:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        built = build_engine(spec, config, self.backend, cache_path)
        return built, time.perf_counter() - start

    def _task_accuracy(self, spec: Any, engine: Engine) -> TaskAccuracy | None:
        if spec.evaluate is None:
            return None
        run = _CountingRun(engine)
        with torch.inference_mode():
            value = float(spec.evaluate(run))
        if run.samples == 0:
            raise HarnessError(f"model {spec.name!r}: evaluate() never ran the engine")
        return TaskAccuracy(name="top1", value=value, samples=run.samples)

    def overhead(self) -> Summary:
        """The host timing loop's own cost, measured once and stored with every host-timed case."""
        if self._overhead is None:
            self._overhead = measure_overhead()
        return self._overhead

    def _latency(
        self, engine: Engine, inputs: tuple[torch.Tensor, ...], batch_dim: int | None
    ) -> tuple[Any, Any]:
        """An engine's latency: a GPU engine's as trtexec measures it (its inputs staged on the
        device once, on its own stream), any other's on the host clock."""
        gpu = self._gpu_index()
        if gpu is not None and isinstance(engine, DeviceEngine):
            query = engine.stage(*inputs, cuda_graph=self.settings.cuda_graph)
            return self.time_query(query, inputs, batch_dim, gpu)
        return self.time_call(lambda: engine(*inputs), inputs, batch_dim)

    def time_call(
        self, call: Callable[[], object], inputs: tuple[torch.Tensor, ...], batch_dim: int | None
    ) -> tuple[Any, Any]:
        """Latency and telemetry of ``call`` (one inference on ``inputs``) on the host clock:
        every host-timed case's one procedure (engines and peers, :mod:`harness.bench.peers`),
        with the same settings, loop overhead and telemetry, under ``torch.inference_mode``."""
        s = self.settings
        sampler = TelemetrySampler(interval_s=s.telemetry_interval_s)
        with torch.inference_mode(), sampler:
            latency = measure_latency(
                call,
                warmup_s=s.warmup_s,
                min_iters=s.min_iters,
                min_duration_s=s.min_duration_s,
                max_iters=s.max_iters,
                batch_size=_batch_size(inputs, batch_dim),
                overhead=self.overhead(),
                spread_threshold=s.spread_threshold,
            )
        return latency, sampler.summary()

    def time_query(
        self, query: DeviceQuery, inputs: tuple[torch.Tensor, ...], batch_dim: int | None, gpu_index: int
    ) -> tuple[Any, Any]:
        """Latency and telemetry of a query staged on CUDA device ``gpu_index``, as trtexec measures
        it (:func:`~harness.bench.latency.measure_device_latency`), with that GPU's telemetry."""
        s = self.settings
        sampler = TelemetrySampler(interval_s=s.telemetry_interval_s, gpu_index=gpu_index)
        with torch.inference_mode(), sampler:
            latency = measure_device_latency(
                query,
                warmup_s=s.warmup_s,
                min_iters=s.min_iters,
                min_duration_s=s.min_duration_s,
                max_iters=s.max_iters,
                batch_size=_batch_size(inputs, batch_dim),
                spread_threshold=s.spread_threshold,
            )
        return latency, sampler.summary()

    def run(
        self,
        matrix: Sequence[Case],
        writer: ResultsWriter,
        *,
        progress: bool = True,
        on_case: CaseHook | None = None,
        extra: Sequence[ExtraCase] = (),
    ) -> dict[str, Any]:
        """Run every case into ``writer`` and finish it; an interrupt leaves it incomplete.

        ``extra`` cases (peers) run among the engine cases: each just before the
        first engine case of its model and batch size, so it is measured close in
        time to the engines it is compared with. Cases the writer already holds
        (a resumed run) are skipped. What a reader must know about a case (it
        failed, its outputs are not finite, the machine was busy) is printed
        above the progress bar as it happens; ``on_case`` sees each newly
        recorded case.
        """
        from tqdm import tqdm

        todo = self.pending(matrix, writer, extra)
        # disable=None: no bar where stderr is no terminal (a CI log would get its \r fragments)
        bar = tqdm(todo, desc="bench", unit="case", file=sys.stderr, disable=None if progress else True)
        try:
            with messages_above_bar(tqdm):
                self._run_cases(bar, writer, on_case)
        finally:
            bar.close()
        return writer.finish()

    def pending(
        self, matrix: Sequence[Case], writer: ResultsWriter, extra: Sequence[ExtraCase] = ()
    ) -> list[ScenarioCase | ExtraCase]:
        """The run's cases in the order :meth:`run` runs them (each matrix case in every scenario,
        each extra case before its model's first), less those ``writer`` already holds."""
        cases = [(*case, scenario) for case in matrix for scenario in self.scenarios]
        return [item for item in _with_extra(cases, extra) if not writer.has(*self.key_of(item))]

    def key_of(self, item: ScenarioCase | ExtraCase) -> CaseKey:
        """The key the results give the case ``item``."""
        if isinstance(item, tuple):
            model, mode, batch, scenario = item
            return (self.name_of(model), mode, self.backend.name, batch, scenario.label())
        return item.key(self)

    def run_item(self, item: ScenarioCase | ExtraCase) -> dict[str, Any]:
        """One case of :meth:`pending` as its results entry (a failure as a ``failed`` entry)."""
        if isinstance(item, tuple):
            model, mode, batch, scenario = item
            # a single-stream case is called as before scenarios existed (overrides of run_case keep working)
            return self.run_case(model, mode, batch) if scenario.single_stream else self.run_case(model, mode, batch, scenario)
        return item.run(self)

    def _run_cases(self, bar: Any, writer: ResultsWriter, on_case: CaseHook | None) -> None:
        """Each case, recorded as it ends; what makes it doubtful said above the bar (a busy
        machine once, then counted at the end: the table's footnote lists those cases)."""
        from tqdm import tqdm

        busy = 0
        for item in bar:
            bar.set_postfix_str(item_label(item))
            entry = self.run_item(item)
            writer.add(entry)
            for line in case_messages(entry):
                if BUSY_PREFIX in line:
                    busy += 1
                    if busy > 1:
                        continue
                tqdm.write(line, file=sys.stderr)
            if on_case is not None:
                on_case(entry)
        if busy > 1:
            tqdm.write(f"{busy} cases ran while the machine was busier than its cores (listed under the table)", file=sys.stderr)


class ExtraCase(Protocol):
    """A case besides the backend's engine cases that a run records: a peer (:mod:`harness.bench.peers`)."""

    @property
    def model(self) -> str:
        """The model reference, as in the engine matrix."""
        ...

    @property
    def batch(self) -> int | None: ...

    @property
    def label(self) -> str: ...

    def key(self, runner: BenchRunner) -> CaseKey: ...

    def run(self, runner: BenchRunner) -> dict[str, Any]: ...


ScenarioCase = tuple[str, PrecisionMode, "int | None", Scenario]  # a matrix case in one scenario


def item_label(item: ScenarioCase | ExtraCase) -> str:
    """A case as progress shows it: ``model mode [bBATCH] [scenario]``, or the extra case's label."""
    if not isinstance(item, tuple):
        return item.label
    model, mode, batch, scenario = item
    where = "" if scenario.single_stream else f" {scenario.name}"
    return f"{model} {mode}" + ("" if batch is None else f" b{batch}") + where


def _with_extra(matrix: Sequence[ScenarioCase], extra: Sequence[ExtraCase]) -> list[ScenarioCase | ExtraCase]:
    """The matrix with each extra case just before the first engine case of its model and batch size.

    Extra cases of a model and batch size the matrix lacks (another shard's) come last.
    """
    pending = list(extra)
    items: list[ScenarioCase | ExtraCase] = []
    for case in matrix:
        here = [e for e in pending if (e.model, e.batch) == (case[0], case[2])]
        pending = [e for e in pending if (e.model, e.batch) != (case[0], case[2])]
        items += [*here, case]
    return items + pending


@contextlib.contextmanager
def messages_above_bar(bar_class: Any) -> Iterator[None]:
    """Python warnings and console log records go through ``bar_class.write`` while a bar runs.

    Written straight to stderr they land on the bar's line (the bar redraws
    with ``\r`` and no newline); ``write`` clears the bar, prints the line and
    redraws it. ``-v`` logging is redirected with tqdm's own
    ``logging_redirect_tqdm`` (the root logger's console handlers, where
    ``-v`` puts them); warnings by a ``warnings.showwarning`` hook. Both are put
    back on exit, on success and on failure alike.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    previous = warnings.showwarning

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int,
        file: TextIO | None = None, line: str | None = None,
    ) -> None:  # fmt: skip
        text = warnings.formatwarning(message, category, filename, lineno, line)
        bar_class.write(text.rstrip("\n"), file=file or sys.stderr)

    warnings.showwarning = show
    try:
        with logging_redirect_tqdm(tqdm_class=bar_class):
            yield
    finally:
        warnings.showwarning = previous


def load_warnings(load: Mapping[str, Any]) -> list[str]:
    """The warning a case stores when the machine was busier than its cores while it ran.

    ``load`` is the case's ``load_average`` (1, 5, 15-minute averages at its
    start and end, and the logical CPU count). A 1-minute load above the core
    count means runnable threads queued for a CPU: some of the case's calls
    waited, so its latency measures the machine as well as the engine.
    Stored in the case (``warnings``) so the table and the gate can say it,
    not only the terminal that watched the run.
    """
    busiest = max(load["start"][0], load["end"][0])
    if busiest <= load["cpus"]:
        return []
    return [
        f"{BUSY_PREFIX} {load['cpus']} cores (load average "
        f"{load['start'][0]:.1f} -> {load['end'][0]:.1f}); its latency may be inflated"
    ]


def case_messages(case: Mapping[str, Any]) -> list[str]:
    """One line for each thing about a finished case that makes its numbers doubtful or absent."""
    name = f"{case['model']}/{case['mode']}" + (f" ({case['backend']})" if is_peer(case) else "")
    if case["status"] == "failed":
        return [f"case {name} failed: {case['error']}"]
    lines = []
    acc = case["accuracy"]
    if case["status"] == "non-finite":
        lines.append(f"case {name}: outputs not finite ({acc['nan_count']} NaN, {acc['inf_count']} Inf)")
    lines += [f"case {name}: {warning}" for warning in case.get("warnings", [])]
    phase = case["latency"]["slow_phase"]
    if phase is not None:
        lines.append(
            f"case {name}: a slow phase remained after re-measuring (samples {phase['start']}-{phase['end']} "
            f"at x{phase['ratio']:.2f}); marked unstable"
        )
    return lines


def _batch_size(inputs: tuple[torch.Tensor, ...], batch_dim: int | None) -> int:
    """Items per call: the declared batch dimension's size (else the first dimension's)."""
    dim = 0 if batch_dim is None else batch_dim
    return int(inputs[0].shape[dim]) if inputs and inputs[0].dim() > dim else 1


def _cache_digest(built: BuildResult) -> str | None:
    """Digest of the cache the engine's tactics came from (None without a cache file)."""
    path = built.cache_path
    if path is None or not path.exists():
        return None
    return TimingCache.load(path).digest()


def _build_record(
    built: BuildResult, seconds: float, config: BuildConfig, *, reused: bool, note: str | None = None
) -> dict[str, Any]:
    """What built a case's engine: time, cache use, the settings digest it was compiled under
    (the one in its cache file's name and fingerprint), and its batch profile if it serves a sweep
    (``reused``: an earlier case of the sweep built it)."""
    profile = config.batch_profile
    return {
        "seconds": seconds,
        "backend_seconds": built.log.build_seconds,
        "cache_file": os.fspath(built.cache_path) if built.cache_path is not None else None,
        "cache_hits": built.cache_hits,
        "cache_misses": built.cache_misses,
        "cache_entries_added": built.cache_entries_added,
        "autocast_digest": config.autocast_digest(),
        "batch_profile": None if profile is None else profile.to_json(),
        "reused": reused,
        "note": note,
    }
