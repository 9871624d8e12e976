"""A run from any file the harness reads: its own results JSON, or pytest-benchmark's saved JSON."""

from __future__ import annotations

import os
from typing import Any

from harness.bench.pytest_benchmark import from_pytest_benchmark, is_pytest_benchmark
from harness.bench.results import results_from_json
from harness.fileio import read_json


def load_run(path: str | os.PathLike[str], *, upgrade: bool = False) -> dict[str, Any]:
    """The results document in ``path``, validated; pytest-benchmark's JSON is read as a run.

    ``upgrade`` as for :func:`harness.bench.results.load_results`. Any problem
    is a HarnessError naming the file.
    """
    doc = read_json(path, None, "results file")
    if is_pytest_benchmark(doc):
        return from_pytest_benchmark(doc, f"pytest-benchmark file {path}")
    return results_from_json(doc, f"results file {path}", upgrade=upgrade)
