"""The installed distribution: every subpackage shipped, no top-level name claimed but ``harness``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.fileio import parse_toml_file

ROOT = Path(__file__).resolve().parents[1]


def _declared_packages() -> set[str]:
    setuptools = parse_toml_file(ROOT / "pyproject.toml", "pyproject")["tool"]["setuptools"]
    return set(setuptools["packages"])


def test_every_harness_subpackage_on_disk_is_declared():
    # An undeclared subpackage works from the checkout and is missing from the wheel.
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "harness").rglob("__init__.py")
    }
    assert on_disk - _declared_packages() == set()


def test_the_zoo_ships_as_harness_zoo():
    setuptools = parse_toml_file(ROOT / "pyproject.toml", "pyproject")["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"harness.zoo": "models"}
    assert "harness.zoo" in _declared_packages()
    assert {p for p in _declared_packages() if not p.startswith("harness")} == set()


def test_no_top_level_models_module_outside_the_checkout(tmp_path):
    # Run away from the repository so its folder is not on sys.path: a user's
    # own `models` package must not be shadowed by ours.
    proc = subprocess.run(
        [sys.executable, "-c", "import models"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert "No module named 'models'" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-c", "import harness.zoo.resnet, harness.models as m; print(m.ModelSpec.__name__)"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ModelSpec"


def test_no_module_imports_another_modules_private_names():
    # A helper two modules share is public in the one that defines it (one definition, a stable
    # name): a private import from elsewhere (``from harness.bench.plots import _save``) breaks
    # silently when its owner renames what it believes only it uses.
    import ast

    found = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                found += [f"{path.relative_to(ROOT)}: from {node.module} import {name}" for name in private]
    assert found == []
