"""pytest-benchmark's saved JSON, both ways: a harness run written in its format, and its files read as a run.

Written (:func:`to_pytest_benchmark`): one benchmark per timed case, its
``stats`` computed as pytest-benchmark computes them (seconds; quartiles by
its method; ``ops`` = rounds / total) from the case's raw samples, which go
along as ``data``, so that ``pytest-benchmark compare`` and its
``--benchmark-compare-fail`` checks read the file as one of theirs. The
harness's own fields of each case (key, status, accuracy, fingerprints) ride
in ``extra_info["harness"]``, so the file reads back as the same run.

Read (:func:`from_pytest_benchmark`): each benchmark with raw timings
(pytest's ``--benchmark-save-data``) becomes a case on the CPU timer, its
summary, spread and stability computed from those timings as a harness run
computes them. A benchmark saved without its timings is refused by name: the
gate tests significance on raw samples, never on two summaries. A file from
pytest-benchmark itself holds no outputs, so its cases' accuracy is null in
every figure, and the document's ``imported_from`` says that it was not
compared.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from harness.bench.latency import DEFAULT_SPREAD_THRESHOLD, LatencyResult
from harness.bench.results import SCHEMA_VERSION, case_key, format_key, sealed
from harness.bench.stats import Summary, slow_phase
from harness.errors import HarnessError
from harness.fileio import validate
from harness.machine import isa_flags, machine_id

FORMAT = "pytest-benchmark"
# The version of pytest-benchmark's JSON layout written here (its ``version`` field).
WRITTEN_VERSION = "5.1.0"
# Where a written benchmark keeps the harness's own fields of its case.
EXTRA_KEY = "harness"
# The backend of a case read from a file pytest-benchmark wrote (its tests are not engines).
IMPORTED_BACKEND = FORMAT
NO_OUTPUTS_NOTE = (
    "read from pytest-benchmark's JSON: latency only; pytest-benchmark records no outputs, so accuracy, "
    "output digests and engine fingerprints were not compared"
)

WRITTEN_NOTE = "read back from the pytest-benchmark JSON `harness report --format pytest-benchmark` wrote"

_SECONDS = {"type": "number", "exclusiveMinimum": 0}
# What the reader uses of a pytest-benchmark file; the rest of it is left open, as that format is.
PYTEST_BENCHMARK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["machine_info", "benchmarks"],
    "properties": {
        "machine_info": {
            "type": "object",
            "properties": {
                "node": {"type": "string"},
                "cpu": {
                    "type": "object",
                    "properties": {
                        "brand_raw": {"type": "string"},
                        "count": {"type": "integer", "minimum": 1},
                        "flags": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
        },
        "commit_info": {
            "type": "object",
            "properties": {"id": {"type": ["string", "null"]}, "dirty": {"type": ["boolean", "null"]}},
        },
        "datetime": {"type": "string"},
        "benchmarks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "stats"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "fullname": {"type": "string", "minLength": 1},
                    "group": {"type": ["string", "null"]},
                    "param": {"type": ["string", "null"]},
                    "extra_info": {"type": "object"},
                    "stats": {
                        "type": "object",
                        "properties": {"data": {"type": "array", "items": _SECONDS}},
                    },
                },
            },
        },
    },
}


def is_pytest_benchmark(doc: Any) -> bool:
    """Whether a parsed JSON document is pytest-benchmark's (its two top-level keys, no harness schema)."""
    return isinstance(doc, dict) and "benchmarks" in doc and "machine_info" in doc and "schema_version" not in doc


# --- written ------------------------------------------------------------------------------


def _quartiles(data: Sequence[float]) -> tuple[float, float]:
    """Q1 and Q3 as pytest-benchmark computes them (Wikipedia's method 3 for an odd count, else 2)."""
    s = sorted(data)
    n = len(s)
    if n == 1:
        return s[0], s[0]
    if n % 2 == 0:
        return statistics.median(s[: n // 2]), statistics.median(s[n // 2 :])
    k, r = divmod(n, 4)
    if r == 1:
        return 0.25 * s[k - 1] + 0.75 * s[k], 0.75 * s[3 * k] + 0.25 * s[3 * k + 1]
    return 0.75 * s[k] + 0.25 * s[k + 1], 0.25 * s[3 * k + 1] + 0.75 * s[3 * k + 2]


def stats_of(data: Sequence[float]) -> dict[str, Any]:
    """pytest-benchmark's ``stats`` of timings in seconds, ``data`` included."""
    x = np.asarray(data, dtype=np.float64)
    # the standard library's, as pytest-benchmark's: a sample on a fence counts as it counts there
    mean = statistics.mean(data)
    stddev = statistics.stdev(data) if x.size > 1 else 0.0
    q1, q3 = _quartiles(data)
    iqr = q3 - q1
    low, high = q1 - 1.5 * iqr, q3 + 1.5 * iqr
    inside = np.sort(x[(x >= low) & (x <= high)])
    iqr_outliers = int(x.size - inside.size)
    stddev_outliers = int(np.count_nonzero((x < mean - stddev) | (x > mean + stddev)))
    total = float(x.sum())
    return {
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": mean,
        "stddev": stddev,
        "rounds": int(x.size),
        "median": statistics.median(data),
        "iqr": iqr,
        "q1": q1,
        "q3": q3,
        "iqr_outliers": iqr_outliers,
        "stddev_outliers": stddev_outliers,
        "outliers": f"{stddev_outliers};{iqr_outliers}",
        "ld15iqr": float(inside[0]) if x.size > 1 else float(x[0]),
        "hd15iqr": float(inside[-1]) if x.size > 1 else float(x[0]),
        "ops": x.size / total if total else 0.0,
        "total": total,
        "data": [float(v) for v in x],
        "iterations": 1,
    }


def benchmark_name(case: Mapping[str, Any]) -> tuple[str, str]:
    """A case's pytest-benchmark ``name`` and ``param``: ``model[mode-backend(-bN)]``, pytest's own shape."""
    param = f"{case['mode']}-{case['backend']}" + (f"-b{case['batch']}" if case.get("batch") is not None else "")
    return f"{case['model']}[{param}]", param


def to_pytest_benchmark(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A harness run as pytest-benchmark's JSON, and the cases left out (failed: nothing was timed).

    Each benchmark is grouped by its model; ``fullname`` is ``harness::`` and
    its name, so two files of one matrix pair case by case in ``compare``.
    """
    machine = doc["machine"]
    cpu = machine["cpu"]
    benchmarks, left_out = [], []
    for case in doc["cases"]:
        if case.get("latency") is None:
            left_out.append(f"{format_key(case_key(case))}: {case['status']}, not timed")
            continue
        name, param = benchmark_name(case)
        extra = {k: v for k, v in case.items() if k != "latency"}
        extra["latency"] = {k: v for k, v in case["latency"].items() if k != "samples_ns"}
        benchmarks.append(
            {
                "group": case["model"],
                "name": name,
                "fullname": f"harness::{name}",
                "params": {"mode": case["mode"], "backend": case["backend"], "batch": case.get("batch")},
                "param": param,
                "extra_info": {EXTRA_KEY: extra},
                "options": {"disable_gc": False, "timer": "perf_counter_ns", "min_rounds": 1,
                            "max_time": None, "min_time": None, "warmup": case["latency"]["warmup_iterations"] > 0},
                "stats": stats_of([s / 1e9 for s in case["latency"]["samples_ns"]]),
            }
        )  # fmt: skip
    out = {
        "machine_info": {
            "node": machine.get("hostname", ""),
            "machine": machine["id"],
            "system": (machine.get("os") or {}).get("system", ""),
            "release": (machine.get("os") or {}).get("release", ""),
            "python_version": (machine.get("python") or {}).get("version", ""),
            "cpu": {"brand_raw": cpu.get("model", ""), "count": cpu.get("logical_cores"), "flags": cpu["isa_flags"]},
            EXTRA_KEY: {k: v for k, v in doc.items() if k not in ("cases", "digest", "imported_from")},
        },
        "commit_info": {"id": doc["git"]["commit"], "dirty": doc["git"]["dirty"], "project": "harness",
                        "time": doc.get("finished") or doc["created"]},  # fmt: skip
        "benchmarks": benchmarks,
        "datetime": doc["created"],
        "version": WRITTEN_VERSION,
    }
    return out, left_out


# --- read ---------------------------------------------------------------------------------


_NO_ACCURACY: dict[str, Any] = {
    "max_abs_error": None, "mean_abs_error": None, "max_rel_error": None, "cosine": None, "snr_db": None,
    "top1_agreement": None, "nan_count": 0, "inf_count": 0, "identical": False, "outputs": [],
}  # fmt: skip


def _latency_of(data: Sequence[float], where: str) -> dict[str, Any]:
    """The ``latency`` of a case timed as pytest-benchmark timed it: one call per sample, the CPU timer."""
    samples = [max(1, round(v * 1e9)) for v in data]
    summary = Summary.from_samples(samples, unit="ns")
    result = LatencyResult(
        summary=summary,
        iterations=len(samples),
        duration_s=float(sum(data)),
        warmup_iterations=0,
        warmup_s=0.0,
        timer="cpu",
        batch_size=1,
        spread_threshold=DEFAULT_SPREAD_THRESHOLD["cpu"],
        slow_phase=slow_phase(samples),
        remeasured=False,
        overhead=None,
    )
    return result.to_dict()


_PARAM = re.compile(r"^(?P<base>.*?)\[(?P<param>.*)\]$")


def _case_of(bench: Mapping[str, Any], where: str) -> dict[str, Any]:
    data = bench["stats"].get("data")
    if not data:
        raise HarnessError(
            f"{where}: benchmark {bench['name']!r} holds no raw timings (stats.data); the gate tests "
            "significance on samples, not summaries: save the run with pytest's --benchmark-save-data"
        )
    latency = _latency_of(data, where)
    own = (bench.get("extra_info") or {}).get(EXTRA_KEY)
    if isinstance(own, Mapping):  # a file the harness wrote: its case, as it was
        case = {k: v for k, v in own.items() if k != "latency"}
        case["latency"] = {**latency, **(own.get("latency") or {}), "samples_ns": latency["samples_ns"]}
        return case
    fullname = str(bench.get("fullname") or bench["name"])
    match = _PARAM.match(fullname)
    model, mode = (match["base"], match["param"]) if match else (fullname, "default")
    return {
        "model": model, "mode": mode, "backend": IMPORTED_BACKEND, "batch": None, "status": "ok", "error": None,
        "latency": latency, "memory": None, "accuracy": dict(_NO_ACCURACY), "task_accuracy": None,
        "telemetry": None, "engine_fingerprint": None, "timing_cache_digest": None, "from_cache": False,
        "output_digest": None, "model_weights_digest": None, "threads": None, "load_average": None,
        "warnings": [], "layers": None,
    }  # fmt: skip


def _machine_of(info: Mapping[str, Any]) -> dict[str, Any]:
    cpu_in = info.get("cpu") or {}
    cpu = {"model": str(cpu_in.get("brand_raw") or info.get("processor") or "unknown"),
           "isa_flags": isa_flags(cpu_in.get("flags", [])), "logical_cores": cpu_in.get("count") or 1}  # fmt: skip
    gpus: dict[str, Any] = {"status": "not recorded by pytest-benchmark", "driver": None, "devices": []}
    return {"id": machine_id(cpu, gpus), "hostname": info.get("node", ""), "cpu": cpu, "gpu": gpus}


def from_pytest_benchmark(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """pytest-benchmark's JSON as a sealed harness results document (schema :data:`SCHEMA_VERSION`).

    A file the harness wrote reads back as its run (machine, settings, cases
    and their accuracy). Any other file gets a machine id computed from its
    ``machine_info`` as this machine's would be, its commit from
    ``commit_info``, and an ``imported_from`` note that says what was not
    compared. A case key that repeats is refused: the gate pairs cases by it.
    """
    validate(raw, PYTEST_BENCHMARK_SCHEMA, where)
    info = raw["machine_info"]
    commit = raw.get("commit_info") or {}
    cases = [_case_of(b, f"{where}: benchmark {i}") for i, b in enumerate(raw["benchmarks"])]
    seen: set[Any] = set()
    for case in cases:
        key = case_key(case)
        if key in seen:
            raise HarnessError(f"{where}: two benchmarks are the case {format_key(key)}; each must be named once")
        seen.add(key)
    own = info.get(EXTRA_KEY)
    if isinstance(own, Mapping):
        head = dict(own)
    else:
        head = {
            "created": str(raw.get("datetime") or commit.get("time") or "unknown"),
            "complete": True,
            "machine": _machine_of(info),
            "git": {"commit": commit.get("id"), "dirty": commit.get("dirty")},
            "settings": {"quick": False},
        }
    note = NO_OUTPUTS_NOTE if not isinstance(own, Mapping) else WRITTEN_NOTE
    doc = {**head, "schema_version": SCHEMA_VERSION, "cases": cases, "imported_from": {"format": FORMAT, "note": note}}
    return sealed(doc, where)

