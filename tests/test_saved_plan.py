"""The saved-engine envelope every backend shares (harness.engines.saved.PlanFormat)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic.dataclasses import dataclass

from harness.documents import DOCUMENT
from harness.engines.saved import PLAN_FILE, PlanFormat, PlanHeader
from harness.errors import HarnessError


@dataclass(frozen=True, config=DOCUMENT)
class DemoPlan(PlanHeader):
    mode: str
    size: int


FORMAT = PlanFormat(backend="demo", name="harness-demo-engine", version=2, payload="payload.bin", document=DemoPlan)


def save(directory: Path, plan: dict[str, object]) -> Path:
    directory.mkdir()
    (directory / PLAN_FILE).write_text(json.dumps(plan))
    return directory


def test_a_plan_opens_with_its_header_and_is_read_back(tmp_path: Path) -> None:
    plan = {**FORMAT.header(), "mode": "fp32", "size": 3}
    assert list(plan)[:3] == ["format", "version", "backend"]
    directory, obj, where = FORMAT.read(save(tmp_path / "engine", plan))
    assert (directory, obj) == (tmp_path / "engine", plan)
    assert where == f"engine plan {tmp_path / 'engine' / PLAN_FILE}"
    assert FORMAT.load(tmp_path / "engine")[1] == DemoPlan("harness-demo-engine", 2, "demo", "fp32", 3)
    assert FORMAT.dump(plan) == plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"size": None}, "'size' is a required property"),
        ({"extra": 1}, "'extra' was unexpected"),
        ({"backend": "other"}, "invalid at backend: 'demo' was expected"),
        ({"size": "3"}, "invalid at size"),
        ({"version": 1}, "plan schema version 1 is not supported"),
        ({"format": "harness-other-engine", "backend": "other"}, "saved by backend other: use --backend other"),
    ],
)
def test_the_schema_requires_every_field_and_allows_no_other(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    plan = {**FORMAT.header(), "mode": "fp32", "size": 3, **change}
    plan = {k: v for k, v in plan.items() if v is not None}
    with pytest.raises(HarnessError, match=message):
        FORMAT.read(save(tmp_path / "engine", plan))


def test_a_missing_engine_names_the_payload(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="expected plan.json and payload.bin in it"):
        FORMAT.read(tmp_path / "missing")
