"""Run the bad-input matrix (tests/test_bad_inputs.py) and print its figures.

``python -m tests.bad_input_figures`` prints: inputs tried, clean one-line
errors with exit 2, tracebacks, native crashes, hangs, other exit codes,
inputs modified, and clean errors that do not name the culprit; then, per
family of inputs, how many were tried, and every case that was not clean.
Extra arguments go to pytest (``-k project`` runs one family).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.json"
        env = {**os.environ, "HARNESS_BAD_INPUT_FIGURES": str(figures)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rN",
                   "tests/test_bad_inputs.py", *argv]  # fmt: skip
        listed = subprocess.run([*command, "--collect-only"], cwd=REPO, env=env, capture_output=True, text=True)
        families = Counter(
            line.split("[", 1)[1].split("/", 1)[0] for line in listed.stdout.splitlines() if "[" in line
        )
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if not figures.exists():
            print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
            return 1
        data = json.loads(figures.read_text())
    print(data["line"])
    print("per family: " + ", ".join(f"{family} {n}" for family, n in sorted(families.items())))
    for failure in data["failures"]:
        print(f"  not clean: {failure}")
    return 0 if not data["failures"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
