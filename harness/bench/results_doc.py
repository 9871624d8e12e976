"""The results document, typed: the classes a run's JSON is read as and its schema is generated from.

:data:`RESULTS_SCHEMA` (what every results file is checked against on load) is generated from
:class:`Run` and the classes it holds, so the format and what readers get cannot drift apart.
:func:`read_run` gives the typed run of a loaded document; the gate reads it by attribute.

Classes of the closed objects (machine and settings among them) refuse keys they do not
declare, naming them; the open ones (telemetry, scenario, source, outputs) declare what
readers use and keep the rest in the file for people to read. A field that a file may leave out but never sets to null
is ``X | Absent = None``: absent from its schema's required keys, null refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from harness.bench.clocks import NamedClock
from harness.documents import Digest, OneOf, read_typed, schema_of
from harness.limits import MAX_BATCH_SIZE, MAX_ITERS, MAX_THREADS
from harness.precision import LOW_PRECISIONS, PrecisionMode

SCHEMA_VERSION = 2
STATUSES = ("ok", "non-finite", "failed")
# The bound of a run's spread threshold (1000%: harness.cli.argtypes.threshold_value).
MAX_SPREAD_THRESHOLD = 10
# The backend of a peer's case: a plain runtime measured as a reference (harness.bench.peers),
# never one of the harness's engines; its mode is the precision it ran at.
PEER_PREFIX = "peer:"
# The scenario of a case that records none (harness.bench.scenarios.SINGLE_STREAM).
SINGLE_STREAM = "single-stream"
CaseKey = tuple[str, str, str, "int | None", str]

_CLOSED = ConfigDict(extra="forbid", allow_inf_nan=False)
_OPEN = ConfigDict(extra="ignore", allow_inf_nan=False)

Absent = SkipJsonSchema[None]
Name = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Batch = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
Threads = Annotated[int, Field(ge=1, le=MAX_THREADS)]
# A cosine computed in float64 may land a rounding error outside -1..1; nothing further.
_COSINE_SLACK = 1e-6


@dataclass(frozen=True, config=_CLOSED)
class Summary:
    """Statistics of a latency sample (harness.bench.stats.Summary), in ``unit``."""

    unit: Literal["ns", "us", "ms", "s"]
    count: Annotated[int, Field(ge=1)]
    min: Positive
    max: Positive
    mean: Positive
    median: Positive
    q1: Positive
    q3: Positive
    p90: Positive
    p95: Positive
    p99: Positive
    std: NonNegative
    cov: NonNegative
    spread: NonNegative
    mad: NonNegative
    outliers: NonNegative


@dataclass(frozen=True, config=_CLOSED)
class SlowPhase:
    """A stretch of samples slower than the rest (harness.bench.step_detect)."""

    start: Count
    end: Count
    fraction: NonNegative
    ratio: Positive


@dataclass(frozen=True, config=_CLOSED)
class DeviceFigures:
    """A GPU query's figures beside its compute time (harness.bench.latency.DeviceFigures)."""

    h2d: Summary
    d2h: Summary
    end_to_end: Summary
    enqueue: Summary
    cuda_graph: bool
    queries_in_flight: Annotated[int, Field(ge=1)]


@dataclass(frozen=True, config=_CLOSED)
class Latency:
    """A case's timing loop: its settings, summary and raw samples (harness.bench.latency.LatencyResult)."""

    timer: Literal["cpu", "cuda"]
    batch_size: Batch
    iterations: Annotated[int, Field(ge=1, le=MAX_ITERS)]
    duration_s: NonNegative
    warmup_iterations: Count
    warmup_s: NonNegative
    summary: Summary
    # positive integers, checked by the loader: a JSON Schema over every item of a full
    # run's hundreds of thousands of samples takes seconds
    samples_ns: Annotated[list[int], Field(min_length=1), WithJsonSchema({"type": "array", "minItems": 1})]
    throughput_per_s: Positive
    spread_threshold: Annotated[float, Field(ge=0, le=MAX_SPREAD_THRESHOLD)]
    unstable: bool
    slow_phase: SlowPhase | None
    remeasured: bool
    overhead: Summary | None
    # total items over the loop's wall time; absent from older files
    offline_throughput_per_s: Positive | Absent = None
    # which clock each figure came from; absent from older files, whose figures are all the timer's
    clocks: dict[str, Literal["host", "cuda-event"]] | Absent = None
    device: DeviceFigures | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class Memory:
    """A case's memory figures (harness.bench.memory.MemoryReport); None where not measured."""

    peak_rss_bytes: Count | None
    rss_before_bytes: Count | None
    peak_rss_method: Literal["vmhwm", "ru_maxrss"] | None
    weight_bytes: dict[str, Count] | None
    weight_bytes_total: Count | None
    engine_bytes: Count | None
    engine_device_bytes: Count | None
    gpu: dict[str, int] | None


@dataclass(frozen=True, config=_OPEN)
class Output:
    """One output tensor's comparison with the fp32 reference."""

    path: str
    shape: list[Count]
    dtype: Any
    count: Any
    compared: Any
    nan_count: Count
    inf_count: Count


@dataclass(frozen=True, config=_CLOSED)
class Accuracy:
    """A case's outputs against the fp32 reference (harness.bench.accuracy.AccuracyResult)."""

    max_abs_error: NonNegative | None
    mean_abs_error: NonNegative | None
    max_rel_error: NonNegative | None
    cosine: Annotated[float, Field(ge=-1 - _COSINE_SLACK, le=1 + _COSINE_SLACK)] | None
    snr_db: float | None
    top1_agreement: Fraction | None
    nan_count: Count
    inf_count: Count
    identical: bool
    outputs: list[Output]


@dataclass(frozen=True, config=_CLOSED)
class TaskAccuracy:
    """The model's own metric on labelled data (harness.bench.accuracy.TaskAccuracy)."""

    name: str
    value: Fraction
    samples: Annotated[int, Field(ge=1)]


@dataclass(frozen=True, config=_CLOSED)
class GpuClocks:
    """What a GPU's clocks were set to (harness.nvml.CLOCK_SETTINGS); None where NVML did not say."""

    applications_graphics_mhz: Count | None = None
    applications_mem_mhz: Count | None = None
    default_applications_graphics_mhz: Count | None = None
    max_graphics_mhz: Count | None = None
    power_limit_mw: Count | None = None
    locked_graphics_mhz: Count | None = None


@dataclass(frozen=True, config=_OPEN)
class GpuTelemetry:
    """The GPU a case ran on and its clock settings (harness.bench.telemetry); absent from older files."""

    uuid: str | None = None
    clocks: GpuClocks | None = None


@dataclass(frozen=True, config=_OPEN)
class Telemetry:
    """Device telemetry sampled while a case ran (harness.bench.telemetry)."""

    samples: Count
    cpu: dict[str, Any]
    gpu: GpuTelemetry | str
    throttled: bool
    error: str | None = None


_Load = Annotated[list[NonNegative], Field(min_length=3, max_length=3)]


@dataclass(frozen=True, config=_CLOSED)
class LoadAverage:
    """The machine's 1, 5 and 15-minute load averages as a case started and ended, and its CPUs."""

    start: _Load
    end: _Load
    cpus: Annotated[int, Field(ge=1)]


@dataclass(frozen=True, config=_CLOSED)
class Peer:
    """A peer's reference case (backend ``peer:<name>``; harness.bench.peers): what ran, its setup time."""

    name: Name
    precision: Literal["fp32", "bf16", "fp16"]
    setup_seconds: NonNegative
    details: str


@dataclass(frozen=True, config=_CLOSED)
class BatchProfile:
    """The batch range of one engine built for a whole sweep (TensorRT)."""

    dim: Count
    min: Count
    opt: Count
    max: Count


@dataclass(frozen=True, config=_CLOSED)
class Build:
    """How a case's engine was built: time, timing-cache use, settings digest."""

    seconds: NonNegative
    backend_seconds: NonNegative
    cache_file: str | None
    cache_hits: Count
    cache_misses: Count
    cache_entries_added: Count
    # the settings digest the engine was compiled under (its cache file's and fingerprint's)
    autocast_digest: Digest | None = None
    batch_profile: BatchProfile | None = None
    # an earlier case of the run built this engine
    reused: bool | Absent = None
    note: str | None = None


@dataclass(frozen=True, config=_CLOSED)
class Probe:
    """One arrival rate a server scenario's search tried."""

    rate: Positive
    achieved: NonNegative
    p50_ns: NonNegative
    p99_ns: NonNegative
    met: bool


@dataclass(frozen=True, config=_CLOSED)
class Search:
    """A server scenario's search for the highest rate that meets its latency bound."""

    found: Probe | None
    above: Probe | None
    ceiling: Positive
    probes: list[Probe]


@dataclass(frozen=True, config=_OPEN)
class Scenario:
    """A serving scenario's parameters and figures (harness.bench.scenarios); absent: single-stream."""

    name: Literal["offline", "multi-stream", "server"]
    label: Name
    params: dict[str, Any]
    queries: Count | Absent = None
    samples_per_query: Annotated[int, Field(ge=1)] | Absent = None
    concurrency: Annotated[int, Field(ge=1)] | Absent = None
    achieved_rate: NonNegative | Absent = None
    throughput_per_s: NonNegative | Absent = None
    p50_ns: NonNegative | Absent = None
    p99_ns: NonNegative | Absent = None
    latency_bound_ns: float | None = None
    met_bound: bool | None = None
    search: Search | None = None


@dataclass(frozen=True, config=_OPEN)
class Source:
    """The model file a case's model came from (harness.sources): kind, file name, digest, inputs."""

    kind: Any
    digest: Digest


@dataclass(frozen=True, config=_CLOSED)
class ExecutedPrecision:
    """What the engine computed in against the mode's low type (harness.precision.ExecutedPrecision)."""

    asked: Literal["fp16", "bf16"]
    layers: Count
    ran_fp32: list[str]
    chosen_by_backend: bool


@dataclass(frozen=True, config=_OPEN)
class Layer:
    """One engine layer and the tactic it runs."""

    name: str
    tactic: str


@dataclass(frozen=True, config=_CLOSED)
class Case:
    """One (model, mode, backend, batch, scenario) measurement of a run."""

    model: Name
    mode: Name
    backend: Name
    status: Literal["ok", "non-finite", "failed"]
    batch: Batch | None = None
    error: str | None = None
    latency: Latency | None = None
    memory: Memory | None = None
    accuracy: Accuracy | None = None
    task_accuracy: TaskAccuracy | None = None
    telemetry: Telemetry | None = None
    engine_fingerprint: str | None = None
    timing_cache_digest: str | None = None
    model_weights_digest: Digest | None = None
    from_cache: bool | Absent = None
    output_digest: str | None = None
    threads: Threads | None = None
    load_average: LoadAverage | None = None
    # what makes the case's numbers doubtful that its other fields do not say (a busy machine)
    warnings: list[Name] = dataclasses.field(default_factory=list)
    peer: Peer | Absent = None
    build: Build | Absent = None
    scenario: Scenario | Absent = None
    source: Source | Absent = None
    executed_precision: ExecutedPrecision | Absent = None
    layers: list[Layer] | None = None

    @property
    def key(self) -> CaseKey:
        """(model, mode, backend, batch, scenario): what identifies a case within a run and across runs
        (:func:`harness.bench.results.case_key`)."""
        label = SINGLE_STREAM if self.scenario is None else self.scenario.label
        return (self.model, self.mode, self.backend, self.batch, label)

    @property
    def is_peer(self) -> bool:
        """Whether the case is a peer's reference row rather than an engine's."""
        return self.backend.startswith(PEER_PREFIX)


@dataclass(frozen=True, config=_CLOSED)
class Cpu:
    """The CPU record (harness.machine.cpu_info): its kernel-relevant ISA flags (the gate compares
    them), model and core counts. Only the flags are required: a record without the rest (one
    imported from pytest-benchmark, or written by hand) still says what the gate needs."""

    isa_flags: list[str]
    model: str | Absent = None
    logical_cores: Annotated[int, Field(ge=1)] | Absent = None
    # psutil cannot always tell
    physical_cores: Annotated[int, Field(ge=1)] | None = None


@dataclass(frozen=True, config=_CLOSED)
class GpuDevice:
    """One GPU NVML listed (harness.machine.gpu_info); the UUID is absent from older files."""

    name: str | Absent = None
    uuid: str | Absent = None
    capability: str | Absent = None
    memory_bytes: Count | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class Gpus:
    """The GPUs of a machine (harness.machine.gpu_info), or why there are none (``status``)."""

    devices: list[GpuDevice]
    status: str | Absent = None
    driver: str | None = None


@dataclass(frozen=True, config=_CLOSED)
class OsRecord:
    """The operating system a run ran on (platform.uname)."""

    system: str
    release: str
    platform: str


@dataclass(frozen=True, config=_CLOSED)
class PythonRecord:
    """The Python a run ran on."""

    version: str
    implementation: str


@dataclass(frozen=True, config=_CLOSED)
class TorchRecord:
    """The PyTorch a run ran on, and its thread counts as the process started."""

    version: str
    cuda: str | None
    threads: Annotated[int, Field(ge=1)]
    interop_threads: Annotated[int, Field(ge=1)]


@dataclass(frozen=True, config=_CLOSED)
class Machine:
    """A run's machine record (harness.bench.machine.machine_info): its id, CPU and GPUs, and the
    software it ran (informative: a history's machine marker compares it, the gate does not).

    Only ``id``, ``cpu`` and ``gpu`` are required: a run imported from pytest-benchmark records
    nothing else. ``packages`` maps the packages machine_info looks for to their versions (None: not
    installed); which packages it looks for may change, so its keys are not fixed.
    """

    id: str
    cpu: Cpu
    gpu: Gpus
    hostname: str | Absent = None
    memory_bytes: Count | Absent = None
    os: OsRecord | Absent = None
    python: PythonRecord | Absent = None
    torch: TorchRecord | Absent = None
    tensorrt: str | None = None
    packages: dict[str, str | None] | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class Git:
    """The commit a run measured and whether tracked files differed from it (None: not a checkout)."""

    commit: str | None
    dirty: bool | None


_Iters = Annotated[int, Field(ge=1, le=MAX_ITERS)]


@dataclass(frozen=True, config=_CLOSED)
class Measure:
    """How long each case was measured: the record of harness.bench.runner.MeasureSettings (its
    ``to_dict``). Schema-1 files have no spread threshold or threads; files before ``--cuda-graph``
    have no ``cuda_graph``."""

    warmup_s: NonNegative
    min_iters: _Iters
    min_duration_s: NonNegative
    max_iters: _Iters
    telemetry_interval_s: Positive
    # None: the timer's default
    spread_threshold: Annotated[float, Field(ge=0, le=MAX_SPREAD_THRESHOLD)] | None = None
    threads: Threads | Absent = None
    cuda_graph: bool | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class AutocastRecord:
    """Autocast compiler settings as harness.autocast.settings.AutocastSettings.to_json gives them.

    ``low_precision_type`` is absent from a model's given settings (each mode decides it) and
    present in the settings a mode was compiled under; ``fp32_output_tail`` and ``bias_correction``
    are absent from files written before they existed.
    """

    nodes_to_exclude: list[str]
    targets_to_exclude: list[str]
    nodes_to_include: list[str]
    targets_to_include: list[str]
    data_max: Positive | None
    init_max: Positive | None
    max_depth_of_reduction: Annotated[int, Field(ge=1)] | None
    keep_io_types: bool
    # a digest of the calibration tensors
    calibration_data: str | None
    # qualified names of the custom rules
    custom_rules: list[str]
    low_precision_type: Annotated[str, OneOf(LOW_PRECISIONS)] | Absent = None
    fp32_output_tail: bool | Absent = None
    bias_correction: bool | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class ModeBuild:
    """What a mode's engines were compiled under (harness.engines.protocol.BuildConfig): the
    settings and their digest, None where the mode's graph does not depend on them."""

    compiler_settings: AutocastRecord | None
    autocast_digest: Digest | None


@dataclass(frozen=True, config=_CLOSED)
class ModelSettings:
    """How one model was built (harness.cli.bench_cmd): its reference, explicit precision file, the
    autocast settings the user gave and, per mode, what its engines were compiled under.

    Files written before settings were recorded per mode have no ``modes`` and one
    ``autocast_digest`` for the model.
    """

    reference: Name
    explicit: str | None
    autocast: AutocastRecord
    modes: dict[PrecisionMode, ModeBuild] | Absent = None
    autocast_digest: Digest | Absent = None


@dataclass(frozen=True, config=_CLOSED)
class ScenarioSettings:
    """One scenario a run measured: harness.bench.scenarios.Scenario's name, label and ``params()``."""

    name: Literal["single-stream", "offline", "multi-stream", "server"]
    label: Name
    concurrency: Annotated[int, Field(ge=1)]
    samples_per_query: Annotated[int, Field(ge=1)] | None
    interval_s: Positive | None
    target_rate: Positive | None
    latency_bound_s: Positive | None
    find_rate: bool
    seed: int


@dataclass(frozen=True, config=_CLOSED)
class InputSettings:
    """How a model file's inputs were shaped and filled (harness.sources.inputs.InputOptions.to_json):
    shapes by input name, value ranges by input name (``*``: every other input), the file loaded."""

    shapes: dict[str, list[Count]]
    ranges: dict[str, str]
    load: str | None


@dataclass(frozen=True, config=_CLOSED)
class Settings:
    """How a run was made (harness.cli.bench_cmd): every key ``harness bench`` writes, and those
    older versions wrote. The gate names the ones that differ between two runs.

    Each may be absent: a run imported from pytest-benchmark records only ``quick``, and older
    files lack what was added later (``batch_sizes``, ``cache_dir``, ``project``, ``peers``,
    ``scenarios``, ...). ``explicit`` and ``project_file`` are what files written before
    ``model_settings`` and ``project`` recorded instead. ``project`` is the project file's
    contents as read (its own schema, harness.project's, checked them), with its path as ``file``.
    """

    backend: Name | Absent = None
    models: list[Name] | Absent = None
    modes: list[PrecisionMode] | Absent = None
    quick: bool | Absent = None
    threads: Threads | None = None
    batch_sizes: Annotated[list[Batch], Field(json_schema_extra={"uniqueItems": True})] | None = None
    measure: Measure | Absent = None
    cache_dir: str | None = None
    project: dict[str, Any] | None = None
    model_settings: dict[str, ModelSettings] | Absent = None
    ignore_cache_mismatch: bool | Absent = None
    peers: list[Name] | Absent = None
    # set only by a run with --lock-clocks (harness.bench.clocks)
    lock_clocks: NamedClock | Annotated[int, Field(ge=1)] | Absent = None
    # only where the run measured other than one single-stream scenario
    scenarios: list[ScenarioSettings] | Absent = None
    # only where model files' inputs were given shapes, ranges or a file
    inputs: dict[str, InputSettings] | Absent = None
    explicit: str | None = None
    project_file: str | None = None


@dataclass(frozen=True, config=_CLOSED)
class Promoted:
    """On a baseline: from which run, when, over which doubts (harness.bench.store.FileStore.promote)."""

    from_: Annotated[str, Field(alias="from")]
    at: str
    forced_over: list[str]


@dataclass(frozen=True, config=_CLOSED)
class ImportedFrom:
    """On a document read from another tool's format (harness.bench.pytest_benchmark)."""

    format: Literal["pytest-benchmark"]
    note: str


@dataclass(frozen=True, config=_CLOSED)
class UpgradedFrom:
    """On a document upgraded on read from an older schema (harness.bench.results.upgrade_results)."""

    schema_version: Annotated[int, Field(ge=1)]
    digest: None
    note: str


@dataclass(frozen=True, config=_CLOSED)
class Run:
    """One benchmark run: where and how it ran, and its cases."""

    schema_version: Literal[2]
    created: Name
    complete: bool
    machine: Machine
    git: Git
    settings: Settings
    cases: list[Case]
    digest: Digest
    # when the run completed (absent from an interrupted run and from older files)
    finished: Name | Absent = None
    promoted: Promoted | Absent = None
    imported_from: ImportedFrom | Absent = None
    upgraded_from: UpgradedFrom | Absent = None


RESULTS_SCHEMA: dict[str, Any] = schema_of(Run, "harness benchmark results")
# What a class cannot say: a failed case says why; any other was measured (latency and accuracy present, not null).
RESULTS_SCHEMA["$defs"]["Case"].update(
    {
        "if": {"properties": {"status": {"const": "failed"}}},
        "then": {"required": ["error"], "properties": {"error": {"type": "string", "minLength": 1}}},
        "else": {
            "required": ["latency", "accuracy"],
            "properties": {"latency": {"$ref": "#/$defs/Latency"}, "accuracy": {"$ref": "#/$defs/Accuracy"}},
        },
    }
)


def read_run(doc: Mapping[str, Any], where: str = "results") -> Run:
    """The typed run of a results document that passed :data:`RESULTS_SCHEMA` (as loaded)."""
    return read_typed(Run, doc, where)


# One case, as a writer adds it to a run.
CASE_SCHEMA: dict[str, Any] = {"$defs": RESULTS_SCHEMA["$defs"], "$ref": "#/$defs/Case"}
