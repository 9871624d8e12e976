"""Fuzz every JSON reader and the engine loaders: nothing but HarnessError may come out.

Valid documents made by the harness are mutated at random places (a value
replaced by arbitrary JSON, a key dropped or added) and read back, with
their digests recomputed where a forger would recompute them, so the
mutation reaches the checks behind the digest as well.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.bench.results import content_digest, load_results
from harness.cache.timing_cache import TimingCache
from harness.cli.main import main
from harness.engines.cpu import CpuEngine
from harness.engines.modes import load_explicit
from harness.engines.onnxruntime.backend import OnnxRuntimeEngine
from harness.engines.protocol import BuildConfig
from harness.engines.tensorrt import backend as trt_backend
from harness.engines.tensorrt.backend import TensorRTBackend, TensorRTEngine
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest, read_regular_file
from harness.outputs import OutputSpec

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):  # long sample lists: their first items stand for the rest
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from(_paths(doc)[1:]))
    *parent_path, last = path
    parent = doc
    for key in parent_path:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "drop" and isinstance(parent, dict):
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(JSON)
    else:
        parent[last] = draw(JSON)
    return doc


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("made")
    os.environ["HARNESS_MACHINE_ID"] = "fuzz-machine"
    try:
        assert main(["build", "--model", "lenet", "--mode", "fp32", "--cache", str(base / "cache.json"),
                     "-o", str(base / "cpu"), "--option", "timing_runs=1"]) == 0  # fmt: skip
        assert main(["build", "--model", "digits", "--mode", "fp16", "--backend", "onnxruntime",
                     "-o", str(base / "ort")]) == 0  # fmt: skip
        assert main(["bench", "--quick", "--no-progress", "--no-plots", "--models", "digits", "--modes", "fp32",
                     "--cache-dir", str(base / "caches"), "-o", str(base / "run.json")]) == 0  # fmt: skip
    finally:
        del os.environ["HARNESS_MACHINE_ID"]
    return {"cache": base / "cache.json", "cpu": base / "cpu", "ort": base / "ort", "results": base / "run.json"}


def saved_trt_engine(directory: Path) -> Any:
    """A TensorRT engine saved by the real backend, built and loaded with the stand-in ``tensorrt``
    of tests/test_tensorrt_backend.py (no GPU); returns that module, which ``load`` needs."""
    from tests.test_tensorrt_backend import builder_trt, lenet_fp16, sample_engine_layers

    with _gpu_double():
        trt, _ = builder_trt(layers=sample_engine_layers())
        engine, _ = TensorRTBackend(trt).build(lenet_fp16(), BuildConfig("fp16"), None)
        engine.save(directory)
    return trt


@contextmanager
def _gpu_double() -> Iterator[None]:
    """The CUDA queries of the TensorRT backend, answered as on an H100 (as tests/test_tensorrt_backend.py does)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trt_backend, "require_cuda", lambda: None)
        mp.setattr(trt_backend, "device_identity", lambda: ("NVIDIA H100 80GB HBM3 (sm_90)", {"capability": "9.0"}))
        yield


def _resign_cache(doc: Any) -> Any:
    if isinstance(doc, dict) and isinstance(doc.get("entries"), list):
        body = {k: v for k, v in doc.items() if k != "digest"}
        try:
            body["entries"] = sorted(body["entries"], key=lambda e: e["key"])
            doc["digest"] = digest(canonical_json(body))
        except (KeyError, TypeError, ValueError):
            pass
    return doc


def _resign_results(doc: Any) -> Any:
    if isinstance(doc, dict):
        try:
            doc["digest"] = content_digest(doc)
        except (TypeError, ValueError):
            pass
    return doc


def _resign_plan(doc: Any) -> Any:
    if isinstance(doc, dict):
        try:
            body = {k: v for k, v in doc.items() if k not in ("fingerprint", "weights_digest")}
            doc["fingerprint"] = digest(canonical_json(body))
        except (TypeError, ValueError):
            pass
    return doc


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _only_harness_errors(read, path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))
    try:
        read(path)
    except HarnessError:
        pass


@pytest.mark.parametrize("resign", [False, True], ids=["as-mutated", "digest-recomputed"])
def test_timing_cache_reader(made, tmp_path_factory, resign):
    original = json.loads(made["cache"].read_text())
    path = tmp_path_factory.mktemp("c") / "cache.json"

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(TimingCache.load, path, _resign_cache(doc) if resign else doc)

    check()


@pytest.mark.parametrize("resign", [False, True], ids=["as-mutated", "digest-recomputed"])
def test_results_reader(made, tmp_path_factory, resign):
    original = json.loads(made["results"].read_text())
    path = tmp_path_factory.mktemp("r") / "run.json"

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(load_results, path, _resign_results(doc) if resign else doc)

    check()


@pytest.mark.parametrize("resign", [False, True], ids=["as-mutated", "fingerprint-recomputed"])
def test_cpu_engine_loader(made, tmp_path_factory, resign):
    import shutil

    directory = tmp_path_factory.mktemp("e") / "engine"
    shutil.copytree(made["cpu"], directory)
    original = json.loads((made["cpu"] / "plan.json").read_text())

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(lambda p: CpuEngine.load(p.parent), directory / "plan.json",
                             _resign_plan(doc) if resign else doc)  # fmt: skip

    check()


def test_onnxruntime_engine_loader(made, tmp_path_factory):
    import shutil

    directory = tmp_path_factory.mktemp("o") / "engine"
    shutil.copytree(made["ort"], directory)
    original = json.loads((made["ort"] / "plan.json").read_text())

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(lambda p: OnnxRuntimeEngine.load(p.parent), directory / "plan.json", doc)

    check()


@FUZZ
@given(JSON)
def test_explicit_precision_reader(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("x") / "explicit.json"
    _only_harness_errors(load_explicit, path, doc)


@FUZZ
@given(mutated([1, {"type": "builtins.dict", "context": '["a", "b"]', "children_spec": [
    {"type": None, "context": None, "children_spec": []}, {"type": None, "context": None, "children_spec": []}]}]))
def test_output_structure_reader(doc):  # fmt: skip
    try:
        OutputSpec.from_json(json.dumps(doc), "plan.json")
    except HarnessError:
        pass


# --- the TensorRT loader and the inspector's JSON ------------------------------------------------


def _resign_trt(doc: Any, plan: bytes, trt: Any) -> Any:
    """Recompute what a forger can: the record digest and the fingerprint of the edited fields."""
    from harness.engines.tensorrt.backend import PLAN, EngineRecord

    if isinstance(doc, dict):
        try:
            record = EngineRecord.from_plan(PLAN.typed(doc, "forger"), "forger")
            doc["record_digest"] = record.digest()
            with _gpu_double():
                doc["fingerprint"] = TensorRTEngine(plan, record, trt).fingerprint()
        except Exception:  # noqa: BLE001 - a document the forger cannot sign is fuzzed as it is
            pass
    return doc


@pytest.mark.parametrize("resign", [False, True], ids=["as-mutated", "digests-recomputed"])
def test_tensorrt_engine_loader(tmp_path_factory, resign):
    """The loader of a saved TensorRT engine, with the stand-in ``tensorrt`` (no GPU needed)."""
    directory = tmp_path_factory.mktemp("t") / "engine"
    trt = saved_trt_engine(directory)
    original = json.loads((directory / "plan.json").read_text())
    plan = (directory / "engine.plan").read_bytes()

    def load(path: Path) -> None:
        with _gpu_double():
            TensorRTEngine.load(path.parent, trt)

    load(directory / "plan.json")  # the unmutated engine loads

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(load, directory / "plan.json", _resign_trt(doc, plan, trt) if resign else doc)

    check()


def test_tensorrt_engine_payload_is_read_bounded(tmp_path):
    """A FIFO in place of engine.plan would block the loader forever; it is refused by its type."""
    directory = tmp_path / "engine"
    trt = saved_trt_engine(directory)
    (directory / "engine.plan").unlink()
    os.mkfifo(directory / "engine.plan")
    with _gpu_double(), pytest.raises(HarnessError, match="engine.plan: not a regular file"):
        TensorRTEngine.load(directory, trt)


def test_a_file_longer_than_its_size_says_is_read_on_in_bounded_pieces():
    """A regular file may hold more than its stat size (procfs says 0): the reader reserves the stat
    size, then reads on in pieces while there is more, and refuses past its limit."""
    status = Path("/proc/self/status")
    if not status.exists() or status.stat().st_size:
        pytest.skip("needs a procfs file whose size reads as 0")
    assert read_regular_file(status, "status").startswith(b"Name:")
    with pytest.raises(HarnessError, match="more than the 16 bytes this harness reads"):
        read_regular_file(status, "status", limit=16)


INSPECTOR_FILES = ("trtexec_10.4_alexnet_fp16_layers.json", "inspector_10.1_resnet18.json")


@pytest.mark.parametrize("name", INSPECTOR_FILES)
def test_inspector_json_reader(name):
    """``parse_engine_information``: the engine inspector's JSON (trtexec --exportLayerInfo, the loader)."""
    from harness.engines.tensorrt.inspector import parse_engine_information

    original = json.loads((Path(__file__).parent / "data" / "trt" / name).read_text())
    parse_engine_information(json.dumps(original), name)

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        try:
            parse_engine_information(json.dumps(doc), name)
        except HarnessError:
            pass

    check()


@pytest.mark.parametrize(
    "text",
    ['{"Layers": [], "Bindings": [' + "9" * 5000 + "]}", '{"Layers": [], "Bindings": NaN}',
     "[" * 50_000 + "]" * 50_000, '{"Layers": [], "Bindings": "ab"}', '{"Layers": [{"Name": "a", "Inputs": 5}]}'],
    ids=["long-integer", "nan-bindings", "deep", "bindings-string", "inputs-not-a-list"],
)  # fmt: skip
def test_inspector_json_edge_cases_are_harness_errors(text):
    from harness.engines.tensorrt.inspector import parse_engine_information

    with pytest.raises(HarnessError, match="^layers.json: "):
        parse_engine_information(text, "layers.json")


# --- gate, compare, merge and report on documents that load ------------------------------------


def _consumers(doc_path: Path, good: Path, out: Path) -> None:
    """What gate, compare, merge and report do with a results file, as their commands do it."""
    from harness.bench.compare import compare
    from harness.bench.gate import gate
    from harness.bench.plots import plot_results
    from harness.bench.results import merge_results
    from harness.bench.tables import compare_table, gate_table, results_table

    doc, other = load_results(doc_path), load_results(good)
    for base, cur in ((other, doc), (doc, other)):
        try:
            gate_table(gate(base, cur))
        except HarnessError:
            pass
        compare_table(compare(base, cur))
    try:
        merge_results([doc_path])
    except HarnessError:
        pass
    results_table(doc)
    plot_results(doc, out / "run.json")


@pytest.mark.slow  # every mutation of a run through gate, compare, merge and report
@pytest.mark.parametrize("resign", [False, True], ids=["as-mutated", "digest-recomputed"])
def test_gate_compare_merge_and_report(made, tmp_path_factory, resign):
    """Every document that loads can be gated, compared, merged and reported: no exception but HarnessError."""
    original = json.loads(made["results"].read_text())
    base = tmp_path_factory.mktemp("g")
    path = base / "run.json"

    @FUZZ
    @given(mutated(original))
    def check(doc: Any) -> None:
        _only_harness_errors(lambda p: _consumers(p, made["results"], base), path, _resign_results(doc) if resign else doc)

    check()


def test_cases_with_and_without_a_batch_size_sort_in_gate_and_compare(made):
    """A sweep's cases (batch 2) next to the model's own (batch None): sorting them once raised TypeError."""
    from harness.bench.compare import compare
    from harness.bench.gate import gate
    from harness.bench.results import sealed

    doc = json.loads(made["results"].read_text())
    doc["cases"].append({**copy.deepcopy(doc["cases"][0]), "batch": 2})
    mixed = sealed(doc, "mixed")
    report = gate(mixed, mixed)
    assert [v.key[3] for v in report.cases] == [None, 2]
    assert [c.key[3] for c in compare(mixed, mixed).cases] == [None, 2]


@pytest.mark.parametrize(
    "change",
    [lambda m: m.pop("gpu"), lambda m: m.pop("cpu"), lambda m: m.__setitem__("gpu", "x"),
     lambda m: m.__setitem__("cpu", {"isa_flags": 5}), lambda m: m["gpu"].__setitem__("devices", "ab")],
    ids=["no-gpu", "no-cpu", "gpu-string", "isa-flags-int", "devices-string"],
)  # fmt: skip
def test_a_machine_record_gate_cannot_read_is_refused_on_load(made, tmp_path, change):
    """The gate reads machine.cpu.isa_flags and machine.gpu.devices: the schema requires them."""
    doc = json.loads(made["results"].read_text())
    change(doc["machine"])
    doc["digest"] = content_digest(doc)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(HarnessError, match="invalid at machine"):
        load_results(path)
