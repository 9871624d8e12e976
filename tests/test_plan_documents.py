"""Saved-engine plans as typed documents: each backend's schema is its class's, and the class
holds exactly what the engine writes (same keys, same order, same bytes)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.cli.main import main
from harness.documents import document_json
from harness.engines.cpu.plan import PLAN as CPU_PLAN
from harness.engines.onnxruntime.backend import PLAN as ORT_PLAN
from harness.engines.openvino.plan import PLAN as OPENVINO_PLAN
from harness.engines.saved import PLAN_FILE, PlanFormat
from harness.engines.tensorrt.backend import PLAN as TRT_PLAN
from harness.errors import HarnessError
from harness.fileio import json_bytes, validate

PLANS: dict[str, PlanFormat[Any]] = {
    "cpu": CPU_PLAN,
    "onnxruntime": ORT_PLAN,
    "openvino": OPENVINO_PLAN,
    "tensorrt": TRT_PLAN,
}
HEADER = ["format", "version", "backend"]
INTERFACE = ["mode", "inputs", "outputs", "casts", "output_structure", "compiler_settings"]
MODEL_PAYLOAD = ["model_file", "model_digest", "layers", "fingerprint"]
# Each plan's keys, in the order its file holds them: the on-disk format, which a plan class must keep.
KEYS = {
    "cpu": [*HEADER, "mode", "inputs", "weights", "nodes", "outputs", "output_structure", "compiler_settings",
            "layers", "fingerprint", "weights_digest"],
    "onnxruntime": [*HEADER, "onnxruntime_version", "provider", *INTERFACE, "session", *MODEL_PAYLOAD],
    "openvino": [*HEADER, *INTERFACE, "openvino_version", "settings", *MODEL_PAYLOAD],
    "tensorrt": [*HEADER, *INTERFACE, "builder", "device", "autotuned_ops", "cache_entries", "weights_digest",
                 "weight_bytes_by_dtype", "layers", "record_digest", "plan_file", "plan_digest", "fingerprint"],
}  # fmt: skip


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small engine saved by each backend (TensorRT's by its stand-in bindings, without a GPU)."""
    from tests.test_fuzz_readers import saved_trt_engine

    base = tmp_path_factory.mktemp("engines")
    previous = os.environ.get("HARNESS_MACHINE_ID")
    os.environ["HARNESS_MACHINE_ID"] = "plan-documents"
    try:
        assert main(["build", "--model", "lenet", "--mode", "fp32", "--backend", "cpu", "--disable-cache",
                     "--option", "timing_runs=1", "-o", str(base / "cpu")]) == 0  # fmt: skip
        assert main(["build", "--model", "digits", "--mode", "fp16", "--backend", "onnxruntime", "-o", str(base / "onnxruntime")]) == 0  # fmt: skip
        # fp32: OpenVINO's low-precision modes need kernels not every CPU has (AVX2-only CPUs lack bf16)
        assert main(["build", "--model", "digits", "--mode", "fp32", "--backend", "openvino", "-o", str(base / "openvino")]) == 0  # fmt: skip
    finally:
        if previous is None:
            del os.environ["HARNESS_MACHINE_ID"]
        else:
            os.environ["HARNESS_MACHINE_ID"] = previous
    saved_trt_engine(base / "tensorrt")
    return {backend: base / backend for backend in PLANS}


@pytest.mark.parametrize("backend", list(PLANS))
def test_the_schema_of_a_plan_is_its_class(backend: str) -> None:
    """Every field of the class, in its order, is a required key of the schema and no other key is
    allowed; the header holds the format's constants."""
    plan = PLANS[backend]
    names = [f.name for f in dataclasses.fields(plan.document)]
    assert names == KEYS[backend]
    assert list(plan.schema["properties"]) == names and plan.schema["required"] == names
    assert plan.schema["additionalProperties"] is False
    assert [plan.schema["properties"][k]["const"] for k in HEADER] == [
        plan.name,
        plan.version,
        plan.backend,
    ]


@pytest.mark.parametrize("backend", list(PLANS))
def test_a_saved_plan_matches_its_schema_and_its_class_writes_it_byte_for_byte(
    backend: str, engines: dict[str, Path]
) -> None:
    """What the engine wrote is valid under the generated schema, reads as the plan's class and
    comes back from it as the same bytes, keys in the same order."""
    plan = PLANS[backend]
    data = (engines[backend] / PLAN_FILE).read_bytes()
    obj = json.loads(data)
    validate(obj, plan.schema, "plan")
    directory, typed, _ = plan.load(engines[backend])
    assert isinstance(typed, plan.document) and directory == engines[backend]
    assert json_bytes(document_json(typed)) == data
    assert list(obj) == KEYS[backend]


@pytest.mark.parametrize(
    ("backend", "edit", "message"),
    [
        ("cpu", lambda p: p.update(comment="x"), "invalid at \\(top level\\): .*'comment' was unexpected"),
        ("onnxruntime", lambda p: p.update(fingerprnt=p.pop("fingerprint")), "invalid at \\(top level\\): .*'fingerprnt' was unexpected\\); valid keys: .*, layers, fingerprint$"),
        ("openvino", lambda p: p["layers"][0].update(tactic_hsh=p["layers"][0].pop("tactic_hash")),
         "invalid at layers/0: .*'tactic_hsh' was unexpected"),
        ("tensorrt", lambda p: p["inputs"][0].update(dtyp=p["inputs"][0]["dtype"]), "invalid at inputs/0: .*'dtyp' was unexpected"),
        ("cpu", lambda p: p["nodes"][0].update(epilogue="swish"), "invalid at nodes/0/epilogue: 'swish' is not one of"),
        ("tensorrt", lambda p: p["builder"].update(batch_size=8), "invalid at builder: .*'batch_size' was unexpected"),
    ],
)  # fmt: skip
def test_a_key_a_plan_class_does_not_declare_is_refused_naming_it(
    backend: str, edit: Any, message: str, engines: dict[str, Path], tmp_path: Path
) -> None:
    directory = tmp_path / "engine"
    shutil.copytree(engines[backend], directory)
    plan = json.loads((directory / PLAN_FILE).read_text())
    edit(plan)
    (directory / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(HarnessError, match=f"engine plan {directory / PLAN_FILE}: {message}"):
        PLANS[backend].load(directory)


def test_writing_a_plan_its_class_does_not_hold_is_refused(engines: dict[str, Path]) -> None:
    """A writer's plan goes through its class: a field the class does not declare is an error, not a file."""
    plan = json.loads((engines["cpu"] / PLAN_FILE).read_text())
    assert CPU_PLAN.dump(plan) == plan
    with pytest.raises(
        HarnessError, match="cpu engine plan being written: invalid at layer: Unexpected"
    ):
        CPU_PLAN.dump({**plan, "layer": []})
