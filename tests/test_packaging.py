"""The installed distribution: every subpackage shipped, no top-level name claimed but ``harness``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness.extras import install_command
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


def _requirement_names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~;\s\[]", r, maxsplit=1)[0].lower() for r in requirements}


RUNTIME_EXTRAS = ("onednn", "onnx", "openvino", "plots", "digits", "hf", "history", "ray")
# Runtime extras left out of `all` and `test`, each for its reason (pyproject.toml says it there too).
SEPARATE_EXTRAS = {
    # onnx2torch requires torchvision; the torchvision that resolves beside a CPU torch does not import
    # and breaks transformers' model imports; nox -s tests installs onnx2torch with --no-deps.
    "onnx-import": "onnx2torch",
}


def test_the_optional_packages_are_extras_not_dependencies():
    project = parse_toml_file(ROOT / "pyproject.toml", "pyproject")["project"]
    extras = project["optional-dependencies"]
    hard = _requirement_names(project["dependencies"])
    assert not hard & {"onnx", "onnxscript", "onnx-ir", "onnxruntime", "openvino", "matplotlib", "scikit-learn",
                       "transformers"}  # fmt: skip
    assert any(r.startswith("torch>=2.13,<2.14") for r in project["dependencies"])  # the tested range
    assert _requirement_names(extras["onnx"]) == {"onnx", "onnxscript", "onnx-ir", "onnxruntime"}
    assert _requirement_names(extras["plots"]) == {"matplotlib"}
    assert _requirement_names(extras["onednn"]) == {"onednn-cpu-gomp"}
    assert _requirement_names(extras["digits"]) == {"scikit-learn"}
    # `all` is exactly the union of the runtime extras (same bounds), and the tests need all of it
    union = {r for name in RUNTIME_EXTRAS for r in extras[name]}
    assert set(extras["all"]) == union
    assert set(extras["test"]) >= union
    for extra, package in SEPARATE_EXTRAS.items():
        assert package in _requirement_names(extras[extra])
        assert package not in _requirement_names(extras["all"]) | _requirement_names(extras["test"])


def test_nox_installs_the_separate_extras_packages_without_their_dependencies():
    noxfile = (ROOT / "noxfile.py").read_text()
    for package in SEPARATE_EXTRAS.values():
        assert f'"--no-deps", "{package}' in noxfile


def test_every_extra_the_code_names_exists_and_holds_the_package():
    from harness.extras import PACKAGES

    extras = parse_toml_file(ROOT / "pyproject.toml", "pyproject")["project"]["optional-dependencies"]
    named = {
        ("onnxruntime", "onnx"), ("onnx", "onnx"), ("onnxscript", "onnx"), ("onnx_ir", "onnx"),
        ("openvino", "openvino"), ("onnx", "openvino"), ("onnxscript", "openvino"),
        ("matplotlib", "plots"), ("sklearn", "digits"), ("onnx2torch", "onnx-import"),
    }  # fmt: skip
    for module, extra in named:
        assert PACKAGES[module] in _requirement_names(extras[extra]), (module, extra)


def test_a_missing_optional_module_names_its_package_and_extra(monkeypatch):
    import pytest

    from harness.errors import HarnessError
    from harness.extras import MissingExtra, require

    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(MissingExtra) as exc:
        require("sklearn", "digits", "the zoo model 'digits'")
    assert isinstance(exc.value, HarnessError) and exc.value.exit_code == 2
    assert str(exc.value) == (
        "the zoo model 'digits' needs scikit-learn, which is not installed; it comes with the 'digits' extra: "
        + install_command("digits")
    )
    assert require("json", "none", "-").dumps(1) == "1"


def test_the_registry_checks_a_backends_extra_before_importing_it(monkeypatch):
    import pytest

    from harness.engines import registry
    from harness.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingExtra, match=r"backend 'onnxruntime' needs onnxruntime.*\[onnx\]'"):
        registry.get_backend("onnxruntime")
    assert registry.resolve_name("auto") in ("cpu", "tensorrt")
    assert registry.get_backend("cpu").name == "cpu"


def test_the_gate_session_installs_what_the_gate_imports():
    """noxfile.GATE_PACKAGES: each a dependency, and no torch (the gate's whole point)."""
    import ast

    tree = ast.parse((ROOT / "noxfile.py").read_text())
    gate = next(
        node.value for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GATE_PACKAGES" for t in node.targets)
    )  # fmt: skip
    packages = set(ast.literal_eval(gate))
    hard = _requirement_names(parse_toml_file(ROOT / "pyproject.toml", "pyproject")["project"]["dependencies"])
    assert packages <= hard and "torch" not in packages
    assert {"jsonschema", "numpy", "scipy", "tabulate"} <= packages


def test_the_install_command_is_one_that_works_here(monkeypatch, tmp_path):
    from harness import extras

    root = Path(extras.__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    assert extras.install_command("plots") == "pip install '.[plots]'"
    monkeypatch.chdir(tmp_path)
    (where,) = re.findall(r"^pip install '(.+)\[plots\]'$", extras.install_command("plots"))
    assert (tmp_path / where).resolve() == root
    monkeypatch.setattr(extras, "checkout", lambda: None)  # installed from a wheel
    assert extras.install_command("plots") == "pip install 'mixed-precision-harness[plots]'"


def test_the_tests_session_runs_a_selection_in_parallel_and_named_files_as_they_are(tmp_path, monkeypatch):
    """``nox -s tests -- -m "not slow"`` (the quick tier) is the parallel run over a selection;
    ``nox -s tests -- tests/test_x.py -k y`` one plain pytest of the files named."""
    import ast
    from collections.abc import Sequence

    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (rule,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "_names_test_files"]
    namespace: dict = {"Path": Path, "Sequence": Sequence}
    exec(compile(ast.Module([rule], type_ignores=[]), "noxfile.py", "exec"), namespace)
    names_test_files = namespace["_names_test_files"]
    monkeypatch.chdir(ROOT)
    assert not names_test_files(["-m", "not slow"]) and not names_test_files(["-k", "spread", "-x"])
    assert names_test_files(["tests/test_bench_gate.py", "-k", "spread"])
    assert names_test_files(["tests/test_packaging.py::test_the_gate_session_installs_what_the_gate_imports"])
    assert names_test_files(["tests"])
