"""The contract every engine backend (cpu, onnxruntime, tensorrt) implements.

A backend turns a typed graph plus a :class:`BuildConfig` and an optional
timing cache into an :class:`Engine` and a :class:`BuildLog`. The log and the
engine's per-layer :class:`LayerInfo` carry the same (layer name, key, tactic)
triples as TensorRT's verbose builder log and engine inspector, so the timing
cache tools, the rebuild report and ``cache verify`` work identically on every
backend. Backends refuse a precision mode they cannot honour
(:meth:`Backend.check_mode`) instead of silently running another one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self

import torch
from pydantic import dataclasses as pydantic_dataclasses

from harness.autocast.settings import AutocastSettings
from harness.documents import DOCUMENT, document_json
from harness.dtypes import FLOAT_DTYPES
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
from harness.fxutil import cast_floating
from harness.outputs import OutputSpec
from harness.precision import (
    PRECISION_MODES as PRECISION_MODES,  # the modes engines are asked to build
)
from harness.precision import ExecutedPrecision as ExecutedPrecision  # what engines report
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    from harness.autocast import CompiledGraph
    from harness.cache.timing_cache import CacheEntry, Candidate, Provenance, TimingCache

@dataclass(frozen=True)
class BatchProfile:
    """The batch sizes one engine serves: TensorRT's optimization profile over the batch axis.

    A batch sweep on a backend that builds profiles (:func:`builds_batch_profiles`)
    builds one engine for the whole sweep instead of one per size. ``dim`` is
    the inputs' batch dimension (``ModelSpec.batch_dim``), ``min`` and ``max``
    the smallest and largest size of the sweep, and ``opt``, the size TensorRT
    tunes kernels for, the *first* size listed: the sizes of a sweep are
    distinct (``--batch-sizes`` refuses repeats), so there is no most common
    one, and the one a user lists first is the one they care about most (their
    deployment's usual batch; ``1,8,32`` tunes for 1). The profile is part of
    the cache provenance and of the engine record: kernels tuned for another
    range are other kernels.
    """

    dim: int
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if self.dim < 0 or not 1 <= self.min <= self.opt <= self.max:
            raise HarnessError(f"batch profile {self.to_json()}: need dim >= 0 and 1 <= min <= opt <= max")

    @classmethod
    def for_sweep(cls, dim: int, sizes: Sequence[int]) -> BatchProfile:
        if not sizes:
            raise HarnessError("a batch profile needs at least one batch size")
        return cls(dim, min(sizes), sizes[0], max(sizes))

    def covers(self, size: int) -> bool:
        return self.min <= size <= self.max

    def shape(self, shape: Sequence[int], size: int) -> tuple[int, ...]:
        """``shape`` (its batch dimension dynamic, -1) with the batch dimension set to ``size``."""
        return tuple(size if i == self.dim else d for i, d in enumerate(shape))

    def to_json(self) -> dict[str, int]:
        return {"dim": self.dim, "min": self.min, "opt": self.opt, "max": self.max}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BatchProfile:
        return cls(int(obj["dim"]), int(obj["min"]), int(obj["opt"]), int(obj["max"]))


def effective_settings(settings: AutocastSettings, mode: PrecisionMode) -> AutocastSettings:
    """``settings`` with the low precision type ``mode`` implies (the mode decides it for builds)."""
    low = mode.low_dtype()
    return dataclasses.replace(settings, low_precision_type=low) if low is not None else settings


def builds_batch_profiles(backend: object) -> bool:
    """Whether ``backend`` builds one engine for a whole batch sweep (a :class:`BatchProfile`).

    Backends opt in with a true ``batch_profiles`` class attribute; only
    TensorRT does (see ``TensorRTBackend``). The others build one engine per
    batch size: the CPU engine times its tactics and lays out its buffers for
    fixed shapes, and ONNX Runtime and OpenVINO run the static export that the
    engines of every backend are verified and fingerprinted on.
    """
    return bool(getattr(backend, "batch_profiles", False))


def settings_differences(recorded: Mapping[str, Any] | None, expected: Mapping[str, Any] | None) -> list[str]:
    """``autocast.<setting>: recorded != expected`` for every setting that differs (empty: the same).

    The vocabulary of the timing-cache provenance (``builder_options.autocast.<setting>``),
    so an engine and a cache made under other settings are refused in the same words.
    """
    from harness.cache.timing_cache import dict_differences

    if recorded is None or expected is None:  # None: the mode's graph does not depend on them
        return [] if recorded == expected else [f"autocast: {recorded} != {expected}"]
    return dict_differences("autocast", dict(recorded), dict(expected))


def check_engine_settings(engine: Engine, expected: Mapping[str, Any] | None, where: str) -> None:
    """Refuse an engine compiled under other autocast settings than ``expected``, naming them."""
    differences = settings_differences(engine.compiler_settings(), expected)
    if differences:
        raise HarnessError(
            f"{where}: the engine was compiled under other autocast settings (engine != expected):\n  "
            + "\n  ".join(differences)
        )


@dataclass(frozen=True)
class BuildConfig:
    """Everything besides the graph that decides which engine a build produces.

    ``mode`` may be given by name; it is held as a :class:`PrecisionMode` (an
    unknown name is refused here, naming the valid ones).
    """

    mode: PrecisionMode
    # JSON file mapping node-name regexes to dtypes ("fp32"|"fp16"|"bf16"), for mode "explicit".
    explicit_path: str | None = None
    # A layer whose key the cache lacks fails the build, naming the layer.
    error_on_cache_miss: bool = False
    editable_cache: bool = True
    disable_cache: bool = False
    ignore_cache_mismatch: bool = False
    # Backend options that change kernels (timing iterations, tf32, optimization
    # level); recorded in the cache provenance so a cache is reused only under them.
    options: Mapping[str, Any] = field(default_factory=dict)
    # Intra-op threads of host engines (timing and running); None: torch's current count.
    # Tactic timings depend on it, so it is part of the cache provenance.
    threads: int | None = None
    # The autocast compiler's settings (exclusions, thresholds, calibration data).
    autocast: AutocastSettings = field(default_factory=AutocastSettings)
    # One engine for a range of batch sizes (backends that build profiles only; see
    # builds_batch_profiles). None: the engine serves the example inputs' shapes.
    batch_profile: BatchProfile | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, PrecisionMode):
            object.__setattr__(self, "mode", PrecisionMode.parse(self.mode))

    def compiler_settings(self) -> dict[str, Any] | None:
        """The settings that shape this mode's graph, as JSON (None where they change nothing).

        They go into the cache provenance and the engine fingerprint: an
        engine or cache made under other settings is refused, naming them.
        """
        return effective_settings(self.autocast, self.mode).to_json() if self.mode.settings_apply else None

    def autocast_digest(self) -> str | None:
        """Digest of :meth:`compiler_settings`, for engine fingerprints and results."""
        settings = self.compiler_settings()
        return None if settings is None else digest(canonical_json(settings))

    def thread_count(self) -> int:
        return self.threads if self.threads is not None else torch.get_num_threads()


@dataclass(frozen=True)
class LayerInfo:
    """One layer of a built engine, as TensorRT's engine inspector reports it.

    Dtypes use the short names of :data:`harness.dtypes.DTYPES`.
    """

    name: str
    layer_type: str
    key: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    tactic: str
    tactic_hash: str

    def to_json(self) -> dict[str, Any]:
        """The layer as plans and results record it (its :class:`LayerRecord`)."""
        json: dict[str, Any] = document_json(LayerRecord.of(self, self.key))
        return json


def precision_of_layers(layers: Sequence[LayerInfo], mode: PrecisionMode) -> ExecutedPrecision | None:
    """The executed precision that an engine's layer dtypes show (None: the mode asks no low type).

    Under weak typing the builder picked each layer's type: every layer with a
    floating output counts, and those whose floating outputs are all fp32 ran
    wider. Otherwise the layers carry the typed graph's types, which the engine
    computes in: the layers with a ``mode.low`` output count, none ran wider.
    """
    low = mode.low
    if low is None:
        return None
    floats = [[d for d in layer.output_dtypes if d in FLOAT_DTYPES] for layer in layers]
    if mode.weak:
        counted = [(layer, dtypes) for layer, dtypes in zip(layers, floats, strict=True) if dtypes]
        wider = tuple(layer.name for layer, dtypes in counted if set(dtypes) == {"fp32"})
        return ExecutedPrecision(low, len(counted), wider, chosen=True)
    return ExecutedPrecision(low, sum(1 for dtypes in floats if low in dtypes))


@pydantic_dataclasses.dataclass(frozen=True, config=DOCUMENT)
class LayerRecord:
    """A :class:`LayerInfo` as saved engine plans store it (the ``layers`` of every plan).

    ``key`` is null for a layer that was not autotuned (nothing for ``harness cache verify``
    to check). Its fields, in order, are the files' keys, in order.
    """

    name: str
    key: str | None
    tactic: str
    tactic_hash: str
    layer_type: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]

    @classmethod
    def of(cls, layer: LayerInfo, key: str | None, **fields: Any) -> Self:
        """The record of ``layer``, with ``key`` as the plan states it (and a subclass's ``fields``)."""
        return cls(
            name=layer.name,
            key=key,
            tactic=layer.tactic,
            tactic_hash=layer.tactic_hash,
            layer_type=layer.layer_type,
            input_dtypes=layer.input_dtypes,
            output_dtypes=layer.output_dtypes,
            **fields,
        )


@dataclass(frozen=True)
class LayerTiming:
    """The autotuning record of one layer: every candidate timed and the one kept.

    ``candidates`` is empty when the layer had a single implementation (nothing
    was timed); on a cache hit it holds the candidates recorded in the cache.
    """

    layer: str
    key: str
    candidates: tuple[Candidate, ...]
    chosen: str
    chosen_hash: str
    from_cache: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "key": self.key,
            "candidates": [document_json(c) for c in self.candidates],
            "chosen": self.chosen,
            "chosen_hash": self.chosen_hash,
            "from_cache": self.from_cache,
        }


@dataclass
class BuildLog:
    """What a build did, kept next to the engine so a changed rebuild can be explained."""

    backend: str
    mode: str
    layers: list[LayerTiming]
    messages: list[str]
    build_seconds: float
    # Timing-cache entries this build timed or decided differently from the cache it was
    # given. Backends never change that cache; the build orchestration writes these.
    new_entries: list[CacheEntry] = field(default_factory=list)
    # The messages that make the engine's measurements doubtful (also in ``messages``):
    # `harness bench` shows them as the case's warnings.
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mode": self.mode,
            "build_seconds": self.build_seconds,
            "layers": [layer.to_json() for layer in self.layers],
            "messages": list(self.messages),
        }


class Engine(Protocol):
    backend: str
    mode: str
    outputs: OutputSpec

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The model's outputs in the structure the eager model returns (see :class:`EngineBase`)."""
        ...

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The flat outputs, in ``outputs`` order."""
        ...

    def files(self) -> dict[str, bytes]:
        """The engine's directory: file name -> contents (plan.json and its payload)."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the engine as a directory, replaced as a whole (see :class:`EngineBase`)."""
        ...

    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtype of each input, as built: the typed graph's, so a floating input is in the
        low precision when the graph was compiled with ``keep_io_types=False``."""
        ...

    def layers(self) -> list[LayerInfo]: ...

    def fingerprint(self) -> str:
        """Digest of the canonical plan: graph, dtypes and tactic per layer (not weights)."""
        ...

    def weights_digest(self) -> str: ...

    def size_bytes(self) -> int: ...

    def weight_bytes_by_dtype(self) -> dict[str, int]: ...

    def device_memory_bytes(self) -> int | None:
        """Activation memory the engine needs on its device (TensorRT); None on the host."""
        ...

    def executed_precision(self) -> ExecutedPrecision | None:
        """What its layers ran in against what the mode asked (None: the mode asks no low type)."""
        ...

    def compiler_settings(self) -> dict[str, Any] | None:
        """The autocast settings its graph was compiled under, as JSON (None: they did not apply).

        The full settings, not only their digest, so that an engine made under
        other settings is refused naming them (:func:`check_engine_settings`).
        """
        ...


def engine_inputs(engine: Engine, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A batch of the model's inputs as ``engine`` takes them (its :meth:`Engine.input_dtypes`).

    Example and calibration batches are the model's (fp32); an engine built
    from a graph compiled with ``keep_io_types=False`` takes low-precision
    inputs, which its caller supplies: the conversion happens here, before a
    run or a timing loop, never inside the engine (whose latency must not
    include it). Accuracy is still measured against eager fp32 on the
    original batch.
    """
    return cast_floating(batch, engine.input_dtypes())


class EngineBase:
    """What every engine shares.

    It computes flat outputs (``run``) and callers get the model's structure:
    a dict, ``ModelOutput`` or nested tuple returned by the eager model comes
    back the same from every engine, so outputs are compared by path. It is
    saved as a whole directory of the files it names (``files``), replaced in
    one step, so no interruption leaves a plan beside another engine's weights.
    """

    outputs: OutputSpec
    mode: str

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def files(self) -> dict[str, bytes]:
        raise NotImplementedError

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.outputs.unflatten(self.run(*inputs))

    def save(self, path: str | os.PathLike[str]) -> None:
        from harness.engines.saved import write_engine_dir

        write_engine_dir(path, self.files())

    def layers(self) -> list[LayerInfo]:
        raise NotImplementedError

    def executed_precision(self) -> ExecutedPrecision | None:
        """By default what the layers' dtypes show (:func:`precision_of_layers`); a backend that
        can see the type each layer was given overrides it."""
        return precision_of_layers(self.layers(), PrecisionMode(self.mode))


class Backend(Protocol):
    name: str

    def check_available(self) -> None:
        """Raise HarnessError saying what is missing when this backend cannot build here."""
        ...

    def supported_modes(self) -> tuple[PrecisionMode, ...]: ...

    def check_mode(self, mode: PrecisionMode | str) -> PrecisionMode:
        """``mode`` parsed; HarnessError with the reason when this backend cannot build it (or it is
        no mode)."""
        ...

    def provenance(self, config: BuildConfig) -> Provenance: ...

    def build(
        self, graph: CompiledGraph, config: BuildConfig, cache: TimingCache | None
    ) -> tuple[Engine, BuildLog]:
        """Build ``graph``; ``cache`` (already checked by the caller) is read, never changed.

        The mode and the cache's compatibility are validated once, by the build
        orchestration (:mod:`harness.build`), before this is called.
        """
        ...

    def load(self, path: str | os.PathLike[str]) -> Engine: ...
