"""The benchmark matrix: models x precision modes on one backend, one case at a time.

Each case builds an engine through :func:`harness.build.build_engine` with a
timing cache of its own (``<cache dir>/<model>-<mode>.json``), so the first
run times tactics and every later run takes them from the cache; then it measures
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

import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.autocast.settings import AutocastSettings
from harness.bench.accuracy import TaskAccuracy, compare_outputs, output_digest
from harness.bench.latency import Timer, measure_latency, measure_overhead
from harness.bench.memory import MemoryReport, measure_memory
from harness.bench.results import CaseResult, ResultsWriter
from harness.bench.stats import Summary
from harness.bench.telemetry import TelemetrySampler
from harness.build import BuildResult, build_engine
from harness.cache.timing_cache import TimingCache
from harness.engines.protocol import Backend, BuildConfig, Engine
from harness.errors import HarnessError
from harness.globalstate import preserves_global_state
from harness.outputs import tensor_paths
from harness.weights import module_weights_digest

DEFAULT_MODELS = ("resnet", "transformer", "digits")
# Backends whose engines run on a CUDA device: timed with CUDA events, GPU memory recorded.
GPU_BACKENDS = frozenset({"tensorrt"})
EXPLICIT_MODE = "explicit"


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
    max_iters: int | None = 20000
    telemetry_interval_s: float = 0.25
    # IQR/median above which a case is flagged unstable; None: the timer's
    # default (5% on CPU, 2.5% on GPU as trtexec warns).
    spread_threshold: float | None = None
    # Intra-op threads of every candidate (engines, the eager reference),
    # pinned for the whole case and restored afterwards.
    threads: int = DEFAULT_THREADS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


QUICK = MeasureSettings(
    warmup_s=0.02, min_iters=5, min_duration_s=0.05, max_iters=200, telemetry_interval_s=0.05
)


def default_modes(backend: Backend) -> tuple[str, ...]:
    """Every mode the backend builds except ``explicit``, which needs a user file."""
    return tuple(m for m in backend.supported_modes() if m != EXPLICIT_MODE)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` with 1 <= i <= n, as given to ``--shard``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise HarnessError(f"--shard {text!r}: expected i/n, e.g. 1/2 (shard i of n, 1-based)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise HarnessError(f"--shard {text!r}: need 1 <= i <= n and n >= 1")
    return index, count


Case = tuple[str, str, "int | None"]  # (model reference, mode, batch size or None: the model's own)


def build_matrix(
    models: Sequence[str],
    modes: Sequence[str],
    shard: tuple[int, int] | None = None,
    batch_sizes: Sequence[int | None] = (None,),
) -> list[Case]:
    """(model, mode, batch) in the deterministic order, restricted to ``shard`` if given."""
    cases = [(model, mode, batch) for model in models for batch in batch_sizes for mode in modes]
    if shard is None:
        return cases
    index, count = shard
    return cases[index - 1 :: count]


def cache_file(cache_dir: str | os.PathLike[str], model: str, config: BuildConfig, backend: str) -> Path:
    """One timing cache per (model name, mode, backend, threads, autocast settings).

    Each of these decides which tactics a build may time, so each gets its own
    file: switching backend, thread count or settings starts a new cache
    instead of failing every case against the previous run's.
    """
    parts = [model, config.mode, backend, f"t{config.thread_count()}"]
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
    results record needs is observed here instead of assumed.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples = 0

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if inputs and inputs[0].dim() > 0:
            self.samples += int(inputs[0].shape[0])
        return self.engine(*inputs)


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
        cache_dir: str | os.PathLike[str],
        settings: MeasureSettings = MeasureSettings(),
        plans: Mapping[str, ModelPlan] | None = None,
        load_model: ModelLoader = _load_model,
        ignore_cache_mismatch: bool = False,
    ) -> None:
        self.backend = backend
        self.cache_dir = Path(cache_dir)
        self.settings = settings
        self.plans = dict(plans or {})
        self.load_model = load_model
        self.ignore_cache_mismatch = ignore_cache_mismatch
        self._overheads: dict[Timer, Summary] = {}
        self._references: dict[tuple[str, int | None], _Reference] = {}

    def reference(self, model: str, batch: int | None = None) -> _Reference:
        """fp32 eager outputs on the spec's fixed example inputs, once per model and batch size."""
        if (model, batch) not in self._references:
            spec = self.load_model(model, batch)
            module = spec.module.float().eval()
            with torch.inference_mode():
                outputs = module(*spec.example_inputs)
            self._references[model, batch] = _Reference(
                outputs, _is_logits([t for _, t in tensor_paths(outputs, "reference")])
            )
        return self._references[model, batch]

    @preserves_global_state
    def run_case(self, model: str, mode: str, batch: int | None = None) -> dict[str, Any]:
        """One case as a results entry; any failure becomes a ``failed`` entry naming its stage.

        Peak RSS covers the whole case (build, accuracy runs and the timing
        loop), the "peak host RSS during the run" a reader expects. Every
        candidate runs with ``settings.threads`` intra-op threads.
        """
        torch.set_num_threads(self.settings.threads)
        load_start = list(os.getloadavg())
        stage = ["load model"]
        try:
            (case, build), peaks = measure_memory(
                lambda: self._measure_case(model, mode, batch, stage), gpu_index=self._gpu_index()
            )
            engine_memory = case.memory or MemoryReport()
            case.threads = self.settings.threads
            case.load_average = {"start": load_start, "end": list(os.getloadavg()), "cpus": os.cpu_count() or 1}
            case.memory = dataclasses.replace(
                peaks,
                weight_bytes=engine_memory.weight_bytes,
                engine_bytes=engine_memory.engine_bytes,
                engine_device_bytes=engine_memory.engine_device_bytes,
            )
            return {**case.to_dict(), "build": build}
        except Exception as exc:  # recorded, and the matrix goes on; Ctrl-C is not an Exception
            name = self.name_of(model)
            return CaseResult.failed(name, mode, self.backend.name, _error_text(stage[0], exc), batch).to_dict()

    def name_of(self, model: str) -> str:
        """The name results use for a model reference: its ModelSpec's name (never a file path)."""
        try:
            return str(self.load_model(model, None).name)
        except Exception:  # noqa: BLE001 - a model that does not load is named by its reference
            return model

    def config(self, model: str, mode: str) -> BuildConfig:
        plan = self.plans.get(model, ModelPlan())
        return BuildConfig(
            mode=mode,
            explicit_path=plan.explicit if mode == EXPLICIT_MODE else None,
            threads=self.settings.threads,
            autocast=plan.autocast,
            ignore_cache_mismatch=self.ignore_cache_mismatch,
        )

    def _gpu_index(self) -> int | None:
        """The CUDA device a GPU backend runs on (GPU memory is recorded for it), else None."""
        if self.backend.name not in GPU_BACKENDS or not torch.cuda.is_available():
            return None
        return int(torch.cuda.current_device())

    def _measure_case(
        self, model: str, mode: str, batch: int | None, stage: list[str]
    ) -> tuple[CaseResult, dict[str, Any]]:
        """The case (memory: the engine's parts only) and its build record.

        ``stage[0]`` names the step in progress, for the error of a failed case.
        """
        spec = self.load_model(model, batch)
        stage[0] = "fp32 eager reference"
        ref = self.reference(model, batch)
        stage[0] = "build"
        config = self.config(model, mode)
        name = spec.name if batch is None else f"{spec.name}-b{batch}"
        cache_path = cache_file(self.cache_dir, name, config, self.backend.name)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        built = build_engine(spec, config, self.backend, cache_path)
        build_s = time.perf_counter() - t0
        engine = built.engine
        inputs = spec.example_inputs
        stage[0] = "run"
        with torch.inference_mode():
            outputs = engine(*inputs)
        stage[0] = "accuracy"
        accuracy = compare_outputs(outputs, ref.outputs, logits=ref.logits)
        task = self._task_accuracy(spec, engine)
        stage[0] = "latency"
        latency, telemetry = self._latency(engine, inputs, spec.batch_dim)
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
            model_weights_digest=module_weights_digest(spec.module),
            layers=[layer.to_json() for layer in engine.layers()],
        ), _build_record(built, build_s)

    def _task_accuracy(self, spec: Any, engine: Engine) -> TaskAccuracy | None:
        if spec.evaluate is None:
            return None
        run = _CountingRun(engine)
        with torch.inference_mode():
            value = float(spec.evaluate(run))
        if run.samples == 0:
            raise HarnessError(f"model {spec.name!r}: evaluate() never ran the engine")
        return TaskAccuracy(name="top1", value=value, samples=run.samples)

    def overhead(self, timer: Timer) -> Summary:
        """The timing loop's own cost, measured once per timer and stored with every case."""
        if timer not in self._overheads:
            self._overheads[timer] = measure_overhead(timer=timer)
        return self._overheads[timer]

    def _latency(
        self, engine: Engine, inputs: tuple[torch.Tensor, ...], batch_dim: int | None
    ) -> tuple[Any, Any]:
        s = self.settings
        gpu = self._gpu_index()
        timer: Timer = "cpu" if gpu is None else "cuda"

        def call() -> object:
            return engine(*inputs)

        sampler = TelemetrySampler(interval_s=s.telemetry_interval_s, gpu_index=gpu or 0)
        with torch.inference_mode(), sampler:
            latency = measure_latency(
                call,
                warmup_s=s.warmup_s,
                min_iters=s.min_iters,
                min_duration_s=s.min_duration_s,
                max_iters=s.max_iters,
                timer=timer,
                batch_size=_batch_size(inputs, batch_dim),
                overhead=self.overhead(timer),
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
    ) -> dict[str, Any]:
        """Run every case into ``writer`` and finish it; an interrupt leaves it incomplete.

        Cases the writer already holds (a resumed run) are skipped. What a
        reader must know about a case (it failed, its outputs are not finite,
        the machine was busy) is printed above the progress bar as it happens;
        ``on_case`` sees each newly recorded case.
        """
        from tqdm import tqdm

        todo = [(m, mode, b) for m, mode, b in matrix if not writer.has(self.name_of(m), mode, self.backend.name, b)]
        bar = tqdm(todo, desc="bench", unit="case", file=sys.stderr, disable=not progress)
        try:
            for model, mode, batch in bar:
                bar.set_postfix_str(f"{model} {mode}" + ("" if batch is None else f" b{batch}"))
                entry = self.run_case(model, mode, batch)
                writer.add(entry)
                for line in case_messages(entry):
                    tqdm.write(line, file=sys.stderr)
                if on_case is not None:
                    on_case(entry)
        finally:
            bar.close()
        return writer.finish()


def case_messages(case: Mapping[str, Any]) -> list[str]:
    """One line for each thing about a finished case that makes its numbers doubtful or absent."""
    name = f"{case['model']}/{case['mode']}"
    if case["status"] == "failed":
        return [f"case {name} failed: {case['error']}"]
    lines = []
    acc = case["accuracy"]
    if case["status"] == "non-finite":
        lines.append(f"case {name}: outputs not finite ({acc['nan_count']} NaN, {acc['inf_count']} Inf)")
    load = case.get("load_average")
    if load is not None and max(load["start"][0], load["end"][0]) > load["cpus"]:
        lines.append(
            f"case {name}: the machine was busier than its {load['cpus']} cores (load average "
            f"{load['start'][0]:.1f} -> {load['end'][0]:.1f}); its latency may be inflated"
        )
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


def _build_record(built: BuildResult, seconds: float) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "backend_seconds": built.log.build_seconds,
        "cache_file": os.fspath(built.cache_path) if built.cache_path is not None else None,
        "cache_hits": built.cache_hits,
        "cache_misses": built.cache_misses,
        "cache_entries_added": built.cache_entries_added,
    }
