"""Record one benchmark with its machine, date and commit, for the documentation's benchmark pages.

``python docs/hooks/record_benchmark.py KIND [-- ARGS]``, from the root of a
checkout, runs one benchmark module (``ARGS`` go to it) and writes
``results/<machine>/benchmarks/<kind>-<UTC time>.json``, which the site's
benchmark page of that machine then shows (docs/hooks/docs_gen.py):

- ``engine``: ``python -m harness.benchmarks.engine_bench`` (the CPU engine
  against eager PyTorch and the peers; ``data`` is its ``--json`` ratios);
- ``build``: ``python -m harness.benchmarks.build_bench`` (cold and warm build
  times; ``data`` is its ``--json`` rows);
- ``conformance``: the conformance suite (``pytest tests/conformance``);
  ``data`` is its per-test report, which the page renders as the model x stage
  table of ``python -m harness.benchmarks.conformance_bench --conformance-table``.

The file holds ``kind``, ``created``, ``machine`` and ``git`` (as a results
file records them), the ``command``, the ``report`` the module printed and its
``data``. Record on a quiet machine and commit the file. A benchmark that
fails writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODULES = {
    "engine": "harness.benchmarks.engine_bench",
    "build": "harness.benchmarks.build_bench",
}


def _run(command: list[str], env: dict[str, str] | None = None) -> str:
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, check=False)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"{command[2] if len(command) > 2 else command[0]} exited {done.returncode}: nothing recorded")
    return done.stdout


def record(kind: str, args: Sequence[str]) -> Path:
    from harness.bench.machine import git_info, machine_info
    from harness.bench.results import utc_now

    created = utc_now()
    with tempfile.TemporaryDirectory(prefix="record-") as tmp:
        data_path = Path(tmp) / "data.json"
        if kind == "conformance":
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance", *args]
            env = {**os.environ, "HARNESS_CONFORMANCE_REPORT": str(data_path)}
            done = subprocess.run(command, cwd=REPO, env=env, stdout=sys.stderr, check=False)
            if not data_path.is_file():
                raise SystemExit(f"the conformance suite wrote no report (pytest exit code {done.returncode})")
            data: Any = json.loads(data_path.read_text(encoding="utf-8"))
            from harness.benchmarks.conformance_bench import conformance_table

            report = conformance_table(data)
        else:
            command = [sys.executable, "-m", MODULES[kind], *args]
            report = _run([*command, "--json", str(data_path)])
            data = json.loads(data_path.read_text(encoding="utf-8"))
    machine: dict[str, Any] = machine_info()
    doc = {
        "kind": kind,
        "created": created,
        "machine": machine,
        "git": git_info(REPO),
        "command": ["python", *command[1:]],
        "report": report,
        "data": data,
    }
    stamp = created.replace("-", "").replace(":", "")
    dest = REPO / "results" / str(machine["id"]) / "benchmarks" / f"{kind}-{stamp}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/hooks/record_benchmark.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=[*MODULES, "conformance"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: the benchmark's own arguments")
    parsed = parser.parse_args(argv)
    args = parsed.args[1:] if parsed.args[:1] == ["--"] else parsed.args
    dest = record(parsed.kind, args)
    print(f"recorded: {dest.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
