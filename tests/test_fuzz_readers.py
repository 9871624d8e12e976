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
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
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
