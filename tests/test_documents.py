"""Typed documents: the JSON Schemas generated from the classes, and what readers get from them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.bench.results import content_digest, load_results
from harness.bench.results_doc import RESULTS_SCHEMA, GpuClocks, read_run
from harness.cache.timing_cache import SCHEMA, CacheEntry, Candidate, Provenance, TimingCache
from harness.debug.plan import PrecisionPlan
from harness.documents import document_json
from harness.dtypes import EXPLICIT_DTYPES
from harness.engines.modes import EXPLICIT_SCHEMA, load_explicit
from harness.errors import HarnessError
from harness.fileio import validate
from harness.nvml import CLOCK_SETTINGS

ROOT = Path(__file__).resolve().parent.parent
COMMITTED_RUNS = sorted((ROOT / "results").glob("*/run-*.json")) + sorted((ROOT / "results").glob("*/baseline.json"))
COMMITTED_CACHES = sorted((ROOT / "results").glob("*/caches/*.json"))
SCHEMA1_RUN = ROOT / "tests" / "data" / "results" / "schema1_run.json"


def _defs(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return schema["$defs"][name]


def test_the_timing_cache_schema_is_its_classes() -> None:
    """Every field of an entry, a candidate and a provenance is required in a file and no other
    key is allowed, with the bounds the classes declare."""
    for cls in (CacheEntry, Candidate, Provenance):
        definition = _defs(SCHEMA, cls.__name__)
        names = [f.name for f in dataclasses.fields(cls)]
        assert list(definition["properties"]) == names
        assert definition["required"] == names and definition["additionalProperties"] is False
    time = _defs(SCHEMA, "CacheEntry")["properties"]["time_ms"]
    assert (time["minimum"], time["maximum"]) == (0, 3_600_000)
    assert SCHEMA["required"] == ["schema_version", "provenance", "entries", "digest"]


@pytest.mark.parametrize("path", COMMITTED_CACHES, ids=lambda p: p.name)
def test_every_committed_cache_reads_as_its_classes_and_round_trips(path: Path) -> None:
    cache = TimingCache.load(path)
    assert cache.to_json() == json.loads(path.read_text())
    assert all(isinstance(e, CacheEntry) and all(isinstance(c, Candidate) for c in e.candidates) for e in cache.entries())


def test_a_cache_key_the_classes_do_not_declare_is_refused_naming_the_valid_ones(tmp_path: Path) -> None:
    doc = json.loads(COMMITTED_CACHES[0].read_text())
    doc["entries"][0]["pined"] = True
    with pytest.raises(HarnessError, match=r"invalid at entries/0: .*'pined' was unexpected.*valid keys: key, layer, tactic"):
        validate(doc, SCHEMA, "cache")


@pytest.mark.parametrize("path", COMMITTED_RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_run_reads_as_its_classes(path: Path) -> None:
    """The typed run carries the document's values: what the gate reads by attribute is what
    the file says."""
    doc = load_results(path)
    run = read_run(doc)
    assert run.machine.id == doc["machine"]["id"] and run.complete == doc["complete"]
    assert run.machine.cpu.isa_flags == doc["machine"]["cpu"]["isa_flags"]
    assert len(run.cases) == len(doc["cases"])
    for case, raw in zip(run.cases, doc["cases"], strict=True):
        assert (case.model, case.mode, case.backend, case.status) == (raw["model"], raw["mode"], raw["backend"], raw["status"])
        if raw["status"] == "failed":
            continue
        assert case.latency is not None and case.accuracy is not None
        assert case.latency.summary.median == raw["latency"]["summary"]["median"]
        assert case.latency.samples_ns == raw["latency"]["samples_ns"]
        assert case.accuracy.max_abs_error == raw["accuracy"]["max_abs_error"]
        assert case.warnings == raw.get("warnings", [])


def same_record(dumped: Any, raw: Any) -> bool:
    """Whether a typed record's JSON (:func:`document_json`) says what the file said: equal values,
    and a field the file left out null in the record."""
    if isinstance(raw, dict):
        return (
            isinstance(dumped, dict)
            and raw.keys() <= dumped.keys()
            and all(dumped[k] is None for k in dumped.keys() - raw.keys())
            and all(same_record(dumped[k], v) for k, v in raw.items())
        )
    if isinstance(raw, list):
        return isinstance(dumped, list) and len(dumped) == len(raw) and all(map(same_record, dumped, raw))
    return bool(dumped == raw)


RECORD_FILES = [*COMMITTED_RUNS, SCHEMA1_RUN]


@pytest.mark.parametrize("path", RECORD_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_settings_and_machine_of_every_committed_run_and_fixture_read_as_their_classes(path: Path) -> None:
    """Every key a run's settings and machine record hold is a typed field that says what the file said."""
    doc = load_results(path, upgrade=True)
    run = read_run(doc)
    assert same_record(document_json(run.settings), doc["settings"])
    assert same_record(document_json(run.machine), doc["machine"])
    assert run.settings.measure is not None and run.machine.os is not None and run.machine.os.system == "Linux"


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("settings", lambda d: d["settings"].update(treads=1)),
        ("settings/measure", lambda d: d["settings"]["measure"].update(warmup=1.0)),
        ("settings/model_settings/resnet/autocast", lambda d: d["settings"]["model_settings"]["resnet"]["autocast"].update(datamax=1.0)),
        ("settings/model_settings/resnet/modes/fp16/compiler_settings",
         lambda d: d["settings"]["model_settings"]["resnet"]["modes"]["fp16"]["compiler_settings"].update(initmax=1.0)),
        ("machine", lambda d: d["machine"].update(hostnmae="vm")),
        ("machine/cpu", lambda d: d["machine"]["cpu"].update(isa_flag=[])),
        ("machine/gpu", lambda d: d["machine"]["gpu"].update(drivers=None)),
        ("machine/torch", lambda d: d["machine"]["torch"].update(version_=None)),
        ("git", lambda d: d["git"].update(comit=None)),
    ],
)  # fmt: skip
def test_a_misspelt_settings_or_machine_key_is_refused_naming_it(tmp_path: Path, where: str, change: Any) -> None:
    doc = load_results(COMMITTED_RUNS[0])
    change(doc)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**doc, "digest": content_digest(doc)}))
    with pytest.raises(HarnessError, match=rf"invalid at {where}: Additional properties are not allowed \('[a-z_]+' was unexpected\)"):
        load_results(path)


def test_a_misspelt_key_in_a_closed_part_of_a_run_is_refused() -> None:
    doc = load_results(COMMITTED_RUNS[0])
    latency = doc["cases"][0]["latency"]
    latency["sumary"] = latency.pop("summary")
    with pytest.raises(HarnessError, match=r"invalid at cases/0/latency: .*valid keys: timer, batch_size"):
        validate(doc, RESULTS_SCHEMA, "run")


def test_a_failed_case_says_why_and_any_other_was_measured() -> None:
    doc = load_results(COMMITTED_RUNS[0])
    case = doc["cases"][0]
    validate(doc, RESULTS_SCHEMA, "run")
    case["latency"] = None
    with pytest.raises(HarnessError, match="invalid at cases/0/latency: None is not of type 'object'"):
        validate(doc, RESULTS_SCHEMA, "run")
    case.update(status="failed", error="")
    with pytest.raises(HarnessError, match="invalid at cases/0/error: '' should be non-empty"):
        validate(doc, RESULTS_SCHEMA, "run")
    case["error"] = "the build ran out of memory"
    validate(doc, RESULTS_SCHEMA, "run")
    assert read_run(doc).cases[0].error == "the build ran out of memory"


def test_the_gpu_clock_record_has_every_setting_nvml_reports() -> None:
    assert tuple(f.name for f in dataclasses.fields(GpuClocks)) == CLOCK_SETTINGS


def test_the_explicit_file_schema_is_its_class_and_a_written_plan_reads_back(tmp_path: Path) -> None:
    """The schema allows exactly the three precisions and at least one entry; the file a
    precision plan writes is a document of the class, and reads back as the plan's mapping."""
    assert EXPLICIT_SCHEMA["additionalProperties"]["enum"] == sorted(EXPLICIT_DTYPES, key=list(EXPLICIT_DTYPES).index)
    assert EXPLICIT_SCHEMA["minProperties"] == 1
    plan = PrecisionPlan.keeping("bf16", ["conv", "fc.1", "out"], ["fc.1"])
    path = plan.write(tmp_path / "plan.json")
    assert json.loads(path.read_text()) == {r"^fc\.1$": "fp32", ".*": "bf16"}
    assert load_explicit(path) == {r"^fc\.1$": torch.float32, ".*": torch.bfloat16}
    for bad, message in (({}, "should be non-empty"), ({"x": "fp8"}, "x: 'fp8' is not one of")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(HarnessError, match=f"explicit precision file {tmp_path / 'bad.json'}.*{message}"):
            load_explicit(tmp_path / "bad.json")
