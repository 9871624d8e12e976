"""Results documents: schema, interrupted writes, shard merge, baselines, machine info, tables."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.bench.accuracy import TaskAccuracy, compare_outputs, output_digest
from harness.bench.clocks import locked_clocks
from harness.bench.latency import measure_latency
from harness.bench.machine import git_info, machine_info
from harness.bench.memory import MemoryReport, measure_memory
from harness.bench.results import (
    SCHEMA_VERSION,
    CaseResult,
    ResultsWriter,
    content_digest,
    load_results,
    merge_results,
    sealed,
    write_results,
)
from harness.bench.results_doc import read_run
from harness.bench.stats import Summary
from harness.bench.store import FileStore
from harness.bench.tables import format_bytes, format_ns, results_table
from harness.bench.telemetry import TelemetrySampler
from harness.documents import document_json
from harness.errors import HarnessError
from harness.machine import MACHINE_ID_ENV, cpu_info, gpu_info, machine_id, slug
from tests.test_documents import same_record
from tests.test_telemetry_gpus import B, Gpu, NvmlDouble, cuda_double, gpus

MACHINE: dict[str, Any] = {"id": "test-machine-2c", "cpu": {"model": "test", "isa_flags": []}, "gpu": {"devices": []}}
GIT = {"commit": "0" * 40, "dirty": False}
SETTINGS: dict[str, Any] = {"backend": "cpu", "quick": False, "threads": 1}


def real_case(model: str, mode: str, dtype: torch.dtype = torch.float32) -> CaseResult:
    """Measure a real (tiny) linear layer in ``dtype`` against its fp32 result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen)
    w = torch.randn(16, 10, generator=gen)
    reference = x @ w
    xl, wl = x.to(dtype), w.to(dtype)

    def run() -> torch.Tensor:
        return (xl @ wl).float()

    with TelemetrySampler(interval_s=0.05) as tel:
        latency = measure_latency(
            run, warmup_s=0.0, min_iters=10, min_duration_s=0.01, max_iters=50
        )
        out, memory = measure_memory(run)
    return CaseResult(
        model=model,
        mode=mode,
        backend="cpu",
        latency=latency,
        memory=memory,
        accuracy=compare_outputs(out, reference, logits=True),
        task_accuracy=TaskAccuracy("top1", 0.75, 4),
        telemetry=tel.summary(),
        engine_fingerprint=f"sha256:{mode}",
        output_digest=output_digest(out),
        layers=[{"name": "linear", "tactic": "gemm"}],
    )


def new_writer(
    path: Path, settings: dict[str, Any] | None = None, machine: dict[str, Any] | None = None
) -> ResultsWriter:
    return ResultsWriter.create(
        path, settings=settings or SETTINGS, machine=machine or MACHINE, git=GIT
    )


def test_interrupted_writer_keeps_finished_cases(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    writer = new_writer(path)
    assert load_results(path)["cases"] == [] and load_results(path)["complete"] is False
    writer.add(real_case("mlp", "fp32"))
    writer.add(CaseResult.failed("mlp", "fp16", "cpu", "engine build failed: layer fc2"))
    # never finished (the process "died" here): the file has both cases
    doc = load_results(path)
    assert doc["complete"] is False and doc["schema_version"] == SCHEMA_VERSION
    assert [(c["mode"], c["status"]) for c in doc["cases"]] == [("fp32", "ok"), ("fp16", "failed")]
    ok = doc["cases"][0]
    assert len(ok["latency"]["samples_ns"]) == ok["latency"]["iterations"]
    assert ok["accuracy"]["identical"] is True and ok["memory"]["peak_rss_bytes"] > 0
    assert ok["telemetry"]["samples"] >= 2 and ok["layers"] == [
        {"name": "linear", "tactic": "gemm"}
    ]


def test_context_manager_finishes_only_on_success(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    with new_writer(good) as w:
        w.add(real_case("mlp", "fp32"))
    assert load_results(good)["complete"] is True

    bad = tmp_path / "bad.json"
    with pytest.raises(KeyboardInterrupt), new_writer(bad) as w:
        w.add(real_case("mlp", "fp32"))
        raise KeyboardInterrupt
    doc = load_results(bad)
    assert doc["complete"] is False and len(doc["cases"]) == 1


def test_writer_refuses_duplicates_existing_files_and_invalid_cases(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    w = new_writer(path)
    w.add(CaseResult.failed("m", "fp32", "cpu", "boom"))
    with pytest.raises(HarnessError, match="m/fp32/cpu was already recorded"):
        w.add(CaseResult.failed("m", "fp32", "cpu", "boom"))
    with pytest.raises(HarnessError, match="already exists"):
        new_writer(path)
    with pytest.raises(HarnessError, match="invalid at"):
        w.add({"model": "m", "mode": "bf16", "backend": "cpu", "status": "maybe"})
    with pytest.raises(HarnessError, match="error"):  # a failed case must say why
        w.add({"model": "m", "mode": "bf16", "backend": "cpu", "status": "failed"})
    assert len(load_results(path)["cases"]) == 1


def test_resume_continues_an_interrupted_run(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    new_writer(path).add(CaseResult.failed("m", "fp32", "cpu", "x"))
    with pytest.raises(HarnessError, match="settings"):
        ResultsWriter.resume(path, settings={**SETTINGS, "quick": True}, machine=MACHINE, git=GIT)
    with pytest.raises(HarnessError, match="machine id"):
        ResultsWriter.resume(path, settings=SETTINGS, machine={"id": "elsewhere"}, git=GIT)
    w = ResultsWriter.resume(path, settings=SETTINGS, machine=MACHINE, git=GIT)
    assert w.has("m", "fp32", "cpu") and not w.has("m", "fp16", "cpu")
    w.add(CaseResult.failed("m", "fp16", "cpu", "y"))
    w.finish()
    assert [c["mode"] for c in load_results(path)["cases"]] == ["fp32", "fp16"]
    with pytest.raises(HarnessError, match="nothing to resume"):
        ResultsWriter.resume(path, settings=SETTINGS, machine=MACHINE, git=GIT)


def steady_case(model: str, mode: str) -> CaseResult:
    """:func:`real_case` with its timings replaced by steady ones: a case whose timings the
    machine's load made unstable is one ``baseline promote`` refuses, and no test may depend on load."""
    case = real_case(model, mode)
    assert case.latency is not None
    steady = Summary.from_samples([1000 + i % 7 for i in range(200)])
    return replace(case, latency=replace(case.latency, summary=steady, iterations=200, slow_phase=None), warnings=[])


def _finished_run(path: Path) -> dict[str, Any]:
    """A finished run of one steady real case."""
    with new_writer(path) as w:
        w.add(steady_case("mlp", "fp32"))
    return load_results(path)


def test_load_rejects_corrupt_truncated_and_wrong_version(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    _finished_run(good)
    text = good.read_text()

    def broken(name: str, content: str) -> Path:
        p = tmp_path / name
        p.write_text(content)
        return p

    truncated = broken("truncated.json", text[: len(text) // 2])
    with pytest.raises(HarnessError, match=r"truncated\.json: not valid JSON"):
        load_results(truncated)
    with pytest.raises(HarnessError, match=r"garbage\.json: not valid JSON"):
        load_results(broken("garbage.json", "\x00\x01 not json"))
    doc = json.loads(text)
    doc["schema_version"] = 1
    with pytest.raises(HarnessError, match=r"v1\.json: schema_version 1 is an old results format: `harness report`"):
        load_results(broken("v1.json", json.dumps(doc)))
    doc["schema_version"] = 7
    with pytest.raises(HarnessError, match=r"v7\.json: schema_version 7 is not supported; this harness reads version 2"):
        load_results(broken("v7.json", json.dumps(doc)), upgrade=True)
    with pytest.raises(HarnessError, match=r"list\.json: not a results document"):
        load_results(broken("list.json", "[1, 2]"))
    doc = json.loads(text)
    del doc["cases"][0]["latency"]["samples_ns"]
    with pytest.raises(HarnessError, match=r"nosamples\.json: invalid at cases/0/latency"):
        load_results(broken("nosamples.json", json.dumps(doc)))
    doc = json.loads(text)
    doc["cases"][0]["latency"]["samples_ns"].append(5)
    with pytest.raises(HarnessError, match=r"tampered\.json: contents do not match the recorded digest"):
        load_results(broken("tampered.json", json.dumps(doc)))
    # Tampered with the digest fixed up: every check of the contents still holds.
    with pytest.raises(HarnessError, match=r"count\.json: case 0 \(mlp/fp32/cpu\): \d+ latency samples but \d+ iterations"):
        load_results(broken("count.json", json.dumps(resealed(doc))))
    doc = json.loads(text)
    doc["cases"][0]["latency"]["samples_ns"][0] = 1.5
    with pytest.raises(HarnessError, match=r"float\.json: case 0 \(mlp/fp32/cpu\): latency samples must be positive"):
        load_results(broken("float.json", json.dumps(resealed(doc))))
    doc = json.loads(text)
    doc["cases"].append(doc["cases"][0])
    with pytest.raises(HarnessError, match="appears twice"):
        load_results(broken("dup.json", json.dumps(resealed(doc))))
    with pytest.raises(HarnessError, match="no such file"):
        load_results(tmp_path / "absent.json")
    # the failed loads left every file as it was
    assert truncated.read_text() == text[: len(text) // 2]


def resealed(doc: dict[str, Any]) -> dict[str, Any]:
    """A tampered document with its digest recomputed, as a forger would."""
    return {**doc, "digest": content_digest(doc)}


def _mutated(text: str, change: Any) -> dict[str, Any]:
    doc = json.loads(text)
    change(doc["cases"][0])
    return resealed(doc)


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        # 10x slower samples under the old summary: the gate tests samples, a reader sees the summary
        ("slower", lambda c: c["latency"].update(samples_ns=[s * 10 for s in c["latency"]["samples_ns"]]),
         "the latency summary disagrees with its raw samples"),
        ("zero", lambda c: c["latency"]["summary"].update(median=0), "invalid at cases/0/latency/summary/median"),
        ("negative", lambda c: c["latency"]["samples_ns"].__setitem__(0, -5), "latency samples must be positive"),
        ("zero-sample", lambda c: c["latency"]["samples_ns"].__setitem__(0, 0), "latency samples must be positive"),
        ("no-threshold", lambda c: c["latency"].pop("spread_threshold"), "'spread_threshold' is a required property"),
        ("flag", lambda c: c["latency"].update(unstable=not c["latency"]["unstable"]), "unstable flag disagrees"),
        ("status", lambda c: c["accuracy"].update(nan_count=3), "status 'ok' but the outputs hold 3 NaN"),
        ("unknown-field", lambda c: c.update(extra=1), "Additional properties are not allowed"),
    ],
)
def test_results_whose_numbers_do_not_add_up_are_refused(tmp_path: Path, name: str, change: Any, match: str) -> None:
    good = tmp_path / "good.json"
    _finished_run(good)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(_mutated(good.read_text(), change)))
    before = path.read_bytes()
    with pytest.raises(HarnessError, match=match):
        load_results(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"schema_version": NaN}', "NaN is not a number JSON allows"),
        ('{"schema_version": Infinity}', "Infinity is not a number JSON allows"),
        ('{"schema_version": 1e999}', "out of the floating-point range"),
        ('{"schema_version": ' + "9" * 5000 + "}", "digits is larger than any the harness writes"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),
        ('{"a": ' * 70 + "1" + "}" * 70, "nested deeper than 64 levels"),
    ],
)
def test_json_edge_cases_are_one_clear_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "edge.json"
    path.write_text(text)
    with pytest.raises(HarnessError, match=match):
        load_results(path)


def test_non_regular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(HarnessError, match="not a regular file"):
        load_results(fifo)
    with pytest.raises(HarnessError, match="is a directory"):
        load_results(tmp_path)


def _shard(path: Path, cases: list[CaseResult], *, finish: bool = True, **kw: Any) -> Path:
    w = new_writer(path, **kw)
    for c in cases:
        w.add(c)
    if finish:
        w.finish()
    return path


def test_merge_shards(tmp_path: Path) -> None:
    a = _shard(
        tmp_path / "a.json", [real_case("mlp", "fp32"), real_case("mlp", "bf16", torch.bfloat16)]
    )
    b = _shard(tmp_path / "b.json", [real_case("cnn", "fp32")], finish=False)
    merged = merge_results([a, b])
    assert [(c["model"], c["mode"]) for c in merged["cases"]] == [
        ("mlp", "fp32"),
        ("mlp", "bf16"),
        ("cnn", "fp32"),
    ]
    assert merged["complete"] is False  # one shard was interrupted
    assert merged["machine"] == MACHINE and merged["settings"] == SETTINGS
    out = tmp_path / "merged.json"
    write_results(out, merged)
    assert load_results(out) == merged

    dup = _shard(tmp_path / "dup.json", [CaseResult.failed("mlp", "bf16", "cpu", "x")])
    with pytest.raises(HarnessError, match=r"mlp/bf16/cpu is in both .*a\.json and .*dup\.json"):
        merge_results([a, dup])
    other_settings = _shard(tmp_path / "s.json", [], settings={**SETTINGS, "threads": 2})
    with pytest.raises(
        HarnessError, match=r"cannot merge .*s\.json with .*a\.json: settings differ"
    ):
        merge_results([a, other_settings])
    other_machine = _shard(tmp_path / "m.json", [], machine={**MACHINE, "id": "gpu-box"})
    with pytest.raises(HarnessError, match="machine id differs"):
        merge_results([a, other_machine])
    with pytest.raises(HarnessError, match="at least one"):
        merge_results([])


def test_paths_and_promote_baseline(tmp_path: Path) -> None:
    root = tmp_path / "results"
    store = FileStore(root)
    assert store.directory("box-1") == root / "box-1"
    assert store.baseline("box-1") == root / "box-1" / "baseline.json"
    assert store.new_run("box-1", created="2025-03-04T05:06:07Z") == root / "box-1" / "run-20250304T050607Z.json"
    assert store.new_run("box-1", created="2025-03-04T05:06:07Z", shard=(2, 3)).name == "run-20250304T050607Z-shard2of3.json"
    for bad in ("../up", "a/b", "", ".hidden"):
        with pytest.raises(HarnessError, match="not a valid directory name"):
            store.directory(bad)

    run = store.new_run(MACHINE["id"], created="2025-03-04T05:06:07Z")
    doc = _finished_run(run)
    dest = store.promote(run)
    baseline = load_results(dest)
    assert dest == store.baseline(MACHINE["id"])
    assert {k: v for k, v in baseline.items() if k not in ("promoted", "digest")} == {
        k: v for k, v in doc.items() if k != "digest"
    }
    assert baseline["promoted"]["from"] == str(run) and baseline["promoted"]["forced_over"] == []
    before = dest.read_bytes()

    partial = _shard(
        tmp_path / "partial.json", [CaseResult.failed("m", "fp32", "cpu", "x")], finish=False
    )
    with pytest.raises(HarnessError, match="incomplete"):
        store.promote(partial)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(run.read_text()[:100])
    with pytest.raises(HarnessError, match="corrupt.json"):
        store.promote(corrupt)
    assert dest.read_bytes() == before  # a bad run never replaces the baseline


def test_results_table() -> None:
    fp32 = real_case("mlp", "fp32")
    bf16 = real_case("mlp", "bf16", torch.bfloat16)
    assert fp32.latency is not None and bf16.latency is not None
    # bf16 at exactly a quarter of the fp32 median: the speed-up column reads x4.00
    quarter = [round(fp32.latency.summary.median / 4)] * 3
    bf16.latency = replace(bf16.latency, summary=Summary.from_samples(quarter), iterations=3)
    bf16.memory = MemoryReport(weight_bytes={"bfloat16": 16})
    failed = CaseResult.failed("mlp", "fp16", "cpu", "build failed\ntraceback follows")
    doc = sealed(
        {
            "schema_version": SCHEMA_VERSION, "created": "2025-01-01T00:00:00Z", "complete": False,
            "machine": MACHINE, "git": {"commit": "abcdef1234567890", "dirty": True}, "settings": {},
            "cases": [fp32.to_dict(), bf16.to_dict(), failed.to_dict()],
        },
        "test document",
    )  # fmt: skip
    text = results_table(doc)
    assert "machine test-machine-2c, commit abcdef123456 (dirty), 3 cases, INCOMPLETE" in text
    modes = ("fp32", "bf16", "fp16")
    rows = {next(t for t in line.split() if t in modes): line for line in text.splitlines()[4:] if set(line.split()) & set(modes)}
    assert "x1.00" in rows["fp32"] and "1.000000" in rows["fp32"]  # cosine of an exact fp32 run
    # items/s is the batch over the median, the figure beside it, in every row
    for case, mode in ((fp32, "fp32"), (bf16, "bf16")):
        lat = case.latency
        assert rows[mode].split()[1] == str(lat.batch_size)
        assert f"{lat.batch_size * 1e9 / lat.summary.median:.4g}" in rows[mode].split()
    assert "x4.00" in rows["bf16"] and "16 B" in rows["bf16"]
    # the whole failure reason, wrapped in the cell (never cut)
    assert "failed: build failed traceback follows" in rows["fp16"]
    # a mode 400x slower than fp32 keeps its digits
    slow = [round(fp32.latency.summary.median * 400)] * 3
    bf16.latency = replace(bf16.latency, summary=Summary.from_samples(slow), iterations=3)
    doc["cases"][1] = bf16.to_dict()
    assert "x0.0025" in results_table(doc)
    md = results_table(doc, fmt="github")
    assert md.splitlines()[2].startswith("| model") and md.splitlines()[3].startswith("|--")
    assert (
        format_ns(1_500_000) == "1.5 ms"
        and format_ns(999) == "999 ns"
        and format_ns(2.5e9) == "2.5 s"
    )
    assert format_bytes(3 << 20) == "3.0 MiB" and format_bytes(None) == ""


def test_cpu_info_from_cpuinfo_text(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu vme sse sse2 avx avx2 fma f16c avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 md_clear\n"
    )
    info = cpu_info(cpuinfo)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["isa_flags"] == sorted(
        [
            "sse",
            "sse2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512_bf16",
            "avx512_fp16",
            "amx_tile",
            "amx_bf16",
            "amx_int8",
        ]
    )
    assert info["logical_cores"] >= 1


def test_machine_id_and_slug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MACHINE_ID_ENV, raising=False)
    assert slug("Intel(R) Xeon(R) Platinum 8480+") == "intel-xeon-platinum-8480"
    cpu = {"model": "AMD EPYC 7763 64-Core Processor", "logical_cores": 16, "isa_flags": ["avx2", "avx512_bf16"]}
    assert machine_id(cpu, {"devices": []}) == "amd-epyc-7763-64-core-processor-16c-avx512bf16"
    # A VM's generic model name, with and without AMX: two machine classes.
    vm = {"model": "Intel(R) Xeon(R) Processor", "logical_cores": 2}
    amx = ["amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f"]
    assert machine_id({**vm, "isa_flags": amx}, {}) == "intel-xeon-processor-2c-amxbf16-avx512fp16-avx512bf16"
    assert machine_id({**vm, "isa_flags": amx[2:]}, {}) == "intel-xeon-processor-2c-avx512fp16-avx512bf16"
    assert machine_id({**vm, "isa_flags": ["avx2", "avx512f"]}, {}) == "intel-xeon-processor-2c-avx512"
    assert machine_id({**vm, "isa_flags": []}, {}) == "intel-xeon-processor-2c-base"
    gpus = {"devices": [{"name": "NVIDIA A100-SXM4-40GB"}, {"name": "NVIDIA A100-SXM4-40GB"}]}
    assert machine_id(cpu, gpus) == "nvidia-a100-sxm4-40gb-x2"
    monkeypatch.setenv(MACHINE_ID_ENV, "ci-l4")
    assert machine_id(cpu, gpus) == "ci-l4"
    monkeypatch.setenv(MACHINE_ID_ENV, "bad/id")
    with pytest.raises(HarnessError, match="not a valid directory name"):
        machine_id(cpu, gpus)


def test_real_machine_info_is_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MACHINE_ID_ENV, raising=False)
    a, b = machine_info(), machine_info()
    assert a["id"] == b["id"] and re.fullmatch(r"[a-z0-9-]+", a["id"])
    assert (
        a["torch"]["version"] == torch.__version__
        and a["torch"]["threads"] == torch.get_num_threads()
    )
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].splitlines()[0].split())
    assert set(a["cpu"]["isa_flags"]) <= flags
    assert a["tensorrt"] is None or isinstance(a["tensorrt"], str)
    json.dumps(a)  # serializable as is


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def test_the_machine_record_this_machine_writes_round_trips_through_its_class(tmp_path: Path) -> None:
    """Every key machine_info() and git_info() write is a field of the typed record, with its value."""
    machine, git = machine_info(), git_info()
    path = tmp_path / "run.json"
    ResultsWriter.create(path, settings=SETTINGS, machine=machine, git=git).finish()
    run = read_run(load_results(path))
    assert same_record(document_json(run.machine), machine) and document_json(run.git) == git
    assert run.machine.torch is not None and run.machine.torch.version == machine["torch"]["version"]


def test_git_info_on_a_scratch_repository(tmp_path: Path) -> None:
    assert git_info(tmp_path) == {"commit": None, "dirty": None}  # not a repository
    _git(tmp_path, "init", "-q")
    assert git_info(tmp_path) == {"commit": None, "dirty": None}  # no commit yet
    (tmp_path / "f.txt").write_text("1")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "commit", "-q", "-m", "x")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_info(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "untracked.json").write_text("{}")
    assert git_info(tmp_path)["dirty"] is False  # result files do not make a run dirty
    (tmp_path / "f.txt").write_text("2")
    assert git_info(tmp_path) == {"commit": head, "dirty": True}


SCHEMA1_RUN = Path(__file__).parent / "data" / "results" / "schema1_run.json"


def test_schema1_run_is_upgraded_on_read_with_everything_derived_recomputed() -> None:
    old = json.loads(SCHEMA1_RUN.read_text())
    assert old["schema_version"] == 1 and "digest" not in old  # a real schema-1 file (tests/data/results/README.md)
    doc = load_results(SCHEMA1_RUN, upgrade=True)

    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["upgraded_from"]["schema_version"] == 1 and doc["upgraded_from"]["digest"] is None
    assert "unverified" in doc["upgraded_from"]["note"]
    assert doc["digest"] == content_digest(doc)  # covers the upgrade only; the note says so
    assert [(c["model"], c["mode"]) for c in doc["cases"]] == [(c["model"], c["mode"]) for c in old["cases"]]
    for before, case in zip(old["cases"], doc["cases"], strict=True):
        lat, samples = case["latency"], before["latency"]["samples_ns"]
        assert lat["samples_ns"] == samples
        summary = Summary.from_samples(samples)
        assert lat["summary"] == summary.stats_dict()  # q1/q3/spread/mad/outliers exist now
        assert lat["spread_threshold"] == 0.05 and "cov_threshold" not in lat
        assert lat["unstable"] == (summary.spread > 0.05 or lat["slow_phase"] is not None)
        assert lat["remeasured"] is False and lat["overhead"] is None  # no samples behind the old overhead
        assert case["from_cache"] == before["pinned"] and "pinned" not in case
        assert case["model_weights_digest"] is None and case["threads"] is None and case["load_average"] is None
        assert [o["path"] for o in case["accuracy"]["outputs"]] == [""]
        assert case["accuracy"]["max_abs_error"] == before["accuracy"]["max_abs_error"]
    # The old CoV flag called all three unstable; the robust spread does not.
    assert all(c["latency"]["unstable"] for c in old["cases"])
    assert not all(c["latency"]["unstable"] for c in doc["cases"])
    table = results_table(doc)
    assert "upgraded on read from schema 1" in table and "contents are unverified" in table


def test_schema1_run_is_refused_where_it_would_be_trusted(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match=r"schema1_run\.json: schema_version 1 is an old results format.*rerun"):
        load_results(SCHEMA1_RUN)
    with pytest.raises(HarnessError, match="schema_version 1 is an old results format"):
        FileStore(tmp_path).promote(SCHEMA1_RUN)
    with pytest.raises(HarnessError, match="schema_version 1 is an old results format"):
        merge_results([SCHEMA1_RUN])
    assert not list(tmp_path.iterdir())


def test_schema1_settings_written_with_a_cov_threshold_are_upgraded_without_it(tmp_path: Path) -> None:
    """Schema-1 runs of the version that judged stability by CoV recorded its threshold in the
    measure settings; schema 2 has none, so the upgrade drops it (as from each latency) and the
    rest of the settings read as they were."""
    doc = json.loads(SCHEMA1_RUN.read_text())
    doc["settings"]["measure"]["cov_threshold"] = 0.1
    path = tmp_path / "v1-cov.json"
    path.write_text(json.dumps(doc))
    settings = read_run(load_results(path, upgrade=True)).settings
    assert settings.measure is not None and settings.measure.min_iters == 30 and settings.measure.threads is None
    assert (settings.explicit, settings.modes) == (None, ["fp32", "bf16", "amp-bf16"])


def test_schema1_upgrade_refuses_bad_samples_naming_the_case(tmp_path: Path) -> None:
    doc = json.loads(SCHEMA1_RUN.read_text())
    doc["cases"][1]["latency"]["samples_ns"][3] = -4
    bad = tmp_path / "bad-v1.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(HarnessError, match=r"bad-v1\.json: case 1: latency samples must be a non-empty list of positive"):
        load_results(bad, upgrade=True)


def test_markdown_tables_keep_a_wrapped_cell_in_one_row_and_show_stored_warnings() -> None:
    from harness.bench.gate import gate
    from harness.bench.tables import gate_table

    reason = "build: " + " ".join(f"word{i}" for i in range(40)) + " and a | pipe"
    failed = CaseResult.failed("mlp", "fp16", "cpu", reason).to_dict()
    busy = real_case("mlp", "fp32")
    assert busy.latency is not None  # fixed samples: a stable case whatever the machine did
    busy.latency = replace(busy.latency, summary=Summary.from_samples([50_000] * 8), iterations=8, slow_phase=None)
    busy.warnings = ["the machine was busier than its 2 cores (load average 3.0 -> 2.5); its latency may be inflated"]
    doc = sealed(
        {
            "schema_version": SCHEMA_VERSION, "created": "2025-01-01T00:00:00Z", "complete": True,
            "machine": MACHINE, "git": GIT, "settings": {},
            "cases": [busy.to_dict(), failed],
        },
        "test document",
    )  # fmt: skip

    terminal = " ".join(results_table(doc).split())
    # the busy machine is said once, under the table, with the cases it touched; the row is marked
    assert "warning: the machine was busier" not in terminal and terminal.count("busier than its") == 1
    assert terminal.endswith(
        "busy: 1 of 2 cases ran while the machine was busier than its cores, so their latency may be inflated "
        "(marked 'ok (busy)'): mlp/fp32/cpu"
    )
    md = results_table(doc, fmt="github").splitlines()
    columns = md[2].count("|")
    body = [line for line in md[4:] if line.startswith("|")]
    assert len(body) == 2  # one Markdown row per case, however long its cells (tabulate adds rows)
    fp32, fp16 = sorted(body, key=lambda line: "fp16" in line)
    assert fp16.count("<br>") >= 2 and "word39" in fp16 and "\\| pipe" in fp16
    assert fp16.count("|") - fp16.count("\\|") == columns  # the escaped pipe opens no column
    assert "ok (busy)" in fp32 and "warning" not in fp32

    # the gate shows the stored warning as information, one row per case
    report = gate(doc, doc)
    verdicts = {v.key[1]: v for v in report.cases}
    assert verdicts["fp32"].verdict == "warning" and not verdicts["fp32"].fails
    messages = [f.message for f in verdicts["fp32"].findings]
    assert "current run: the machine was busier than its 2 cores (load average 3.0 -> 2.5); its latency may be inflated" in messages
    gate_md = [line for line in gate_table(report, "github").splitlines() if line.startswith("| mlp")]
    assert len(gate_md) == len(report.cases) == 2


def test_a_later_document_relabelled_schema1_is_not_upgraded(tmp_path: Path) -> None:
    """Only a real schema-1 shape is upgraded: a current run with its version set to 1 is refused, named."""
    doc = json.loads(json.dumps(_finished_run(tmp_path / "run.json")))
    doc["schema_version"] = 1
    relabelled = tmp_path / "relabelled.json"
    relabelled.write_text(json.dumps(doc))
    with pytest.raises(HarnessError, match=r"relabelled\.json \(read as schema 1\): invalid at .*digest"):
        load_results(relabelled, upgrade=True)


def test_a_corrupt_schema1_field_is_one_clear_error_when_upgrading(tmp_path: Path) -> None:
    """Every field of the document, of a case, its latency and accuracy, set to a wrong type or value."""
    old = json.loads(SCHEMA1_RUN.read_text())
    spots = [(), ("cases", 0), ("cases", 0, "latency"), ("cases", 0, "accuracy")]
    tried = 0
    for spot in spots:
        parent: Any = old
        for step in spot:
            parent = parent[step]
        for key in list(parent):
            for value in (None, "x", -1, [], {}):
                doc = json.loads(json.dumps(old))
                target = doc
                for step in spot:
                    target = target[step]
                target[key] = value
                path = tmp_path / "corrupt.json"
                path.write_text(json.dumps(doc))
                try:
                    load_results(path, upgrade=True)
                except HarnessError as exc:
                    assert "corrupt.json" in str(exc)
                tried += 1
    assert tried > 150


def test_gpu_uuids_are_recorded_and_the_machine_id_ignores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MACHINE_ID_ENV, raising=False)
    nvml = gpus()
    info = gpu_info(nvml)
    assert info["status"] == "ok" and nvml.inits == nvml.shutdowns == 1
    assert [d["uuid"] for d in info["devices"]] == [g.uuid for g in nvml.gpus]  # NVML's order
    assert info["devices"][0] == {"name": "NVIDIA H100 80GB HBM3", "uuid": nvml.gpus[0].uuid, "capability": "9.0",
                                  "memory_bytes": 80 << 30}  # fmt: skip
    # Another runner of the type: other GPUs, one baseline.
    other = gpu_info(NvmlDouble([Gpu(f"GPU-{i}" * 4, mem_used=0) for i in range(3)]))
    cpu = {"model": "AMD EPYC 9654", "logical_cores": 8, "isa_flags": []}
    assert machine_id(cpu, info) == machine_id(cpu, other) == "nvidia-h100-80gb-hbm3-x3"


def _gpu_run(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A run on NvmlDouble's second GPU with its clocks locked at base, written as the bench writes it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda_double(monkeypatch, B)
    nvml = gpus()
    with locked_clocks("base", module=nvml), TelemetrySampler(interval_s=0.01, nvml_module=nvml) as tel:
        pass
    case = replace(real_case("mlp", "fp32"), telemetry=tel.summary())
    machine = {**MACHINE, "gpu": gpu_info(nvml)}
    with new_writer(path, settings={**SETTINGS, "lock_clocks": "base"}, machine=machine) as w:
        w.add(case)
    return load_results(path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["cases"][0]["telemetry"]["gpu"]["clocks"].update(locked_graphics_mhz="1410"),
         "invalid at cases/0/telemetry/gpu"),
        (lambda d: d["cases"][0]["telemetry"]["gpu"]["clocks"].update(boost=True), "invalid at cases/0/telemetry/gpu"),
        (lambda d: d["cases"][0]["telemetry"]["gpu"].update(uuid=7), "invalid at cases/0/telemetry/gpu"),
        (lambda d: d["machine"]["gpu"]["devices"][0].update(uuid=None), "invalid at machine/gpu/devices/0/uuid"),
        (lambda d: d["settings"].update(lock_clocks="fastest"), "invalid at settings/lock_clocks"),
        (lambda d: d["settings"].update(lock_clocks=0), "invalid at settings/lock_clocks"),
    ],
)
def test_the_gpu_and_clock_fields_are_checked_and_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, match: str
) -> None:
    doc = _gpu_run(tmp_path / "gpu.json", monkeypatch)
    gpu = doc["cases"][0]["telemetry"]["gpu"]
    assert gpu["uuid"] == f"GPU-{B}" and gpu["clocks"]["locked_graphics_mhz"] == 1410
    assert doc["machine"]["gpu"]["devices"][1]["uuid"] == f"GPU-{B}" and doc["settings"]["lock_clocks"] == "base"
    # older files have none of them and still load
    assert "uuid" not in json.dumps(_finished_run(tmp_path / "older.json"))
    change(doc)
    (tmp_path / "bad.json").write_text(json.dumps(resealed(doc)))
    with pytest.raises(HarnessError, match=match):
        load_results(tmp_path / "bad.json")
