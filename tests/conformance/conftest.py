"""Record the conformance suite's outcomes per model and stage, for the README's table.

Each test names the stage it checks with ``@pytest.mark.stage("label")``; the
label may use the test's parameters (``"engine {mode}"``). With
``HARNESS_CONFORMANCE_REPORT=path.json`` set, every test of this folder is
recorded as (model, stage, outcome) and the list is written to that file when
the session ends. ``python -m harness.benchmarks.conformance_bench
--conformance-table`` runs the suite this way and renders the file as a
Markdown model x stage table, so the README's table is the output of a real
run, not a hand-kept summary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPORT_ENV = "HARNESS_CONFORMANCE_REPORT"
_RESULTS: list[dict[str, Any]] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stage(label): the conformance stage a test checks (the README table's column)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("stage")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None or "subject" not in callspec.params:
        return
    # A failing fixture (the model does not load) fails the test at setup: recorded too.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        params = {k: str(v) for k, v in callspec.params.items()}
        _RESULTS.append({
            "model": params["subject"].rpartition(":")[2],
            "stage": marker.args[0].format(**params),
            "outcome": report.outcome,
        })


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_RESULTS, indent=1))
