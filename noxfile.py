"""Sessions: ``tests``, ``lint``, ``bench`` (posargs go to ``harness bench``), ``gate``, ``gpu``, ``docs``.

torch is installed before the project so that pip never resolves a bare
``torch`` requirement on a CPU-only machine (that would pull a multi-GB CUDA
build). GPU machines (``nvidia-smi`` on PATH) get the default CUDA build;
``HARNESS_TORCH`` overrides the requirement either way. Each session installs
the extras it uses (``tests``: ``test``, which holds them all; ``bench``: what
a default run needs); ``gate`` installs no torch at all.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

CPU_TORCH = "torch==2.13.0"
GPU_TORCH = "torch>=2.13,<2.14"  # pyproject.toml's tested range; PyPI's default build is CUDA


# What `harness gate` imports (harness/cli/results_cmd.py and the modules it reads
# results with): the gate session installs the project without its dependencies and
# only these, taken with their bounds from pyproject.toml. No torch, no ONNX, no plots.
GATE_PACKAGES = ("jsonschema", "pydantic", "numpy", "scipy", "tabulate", "psutil", "nvidia-ml-py", "tomli")


def _is_gpu_machine() -> bool:
    return shutil.which("nvidia-smi") is not None


def _skip_if_unchanged(session: nox.Session, *what: str) -> Callable[[], None] | None:
    """None when the virtualenv's stamp says ``what`` (and pyproject.toml) is installed already.

    Else the function that writes the stamp, to call once the installs succeeded. A re-run
    with the same stamp skips pip, which otherwise re-resolves every dependency each time.
    """
    pyproject = Path(__file__).with_name("pyproject.toml").read_bytes()
    wanted = hashlib.sha256(b"\0".join([*(w.encode() for w in what), pyproject])).hexdigest()
    stamp = Path(session.virtualenv.location) / ".harness-install-stamp"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == wanted:
        session.log(f"install skipped: {', '.join(what)} unchanged since the last run")
        return None
    return lambda: stamp.write_text(wanted, encoding="utf-8")


def _install(session: nox.Session, *extras: str) -> None:
    """Install torch, then the project (editable) with ``extras``, unless nothing changed."""
    torch_req = os.environ.get("HARNESS_TORCH") or (GPU_TORCH if _is_gpu_machine() else CPU_TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    done = _skip_if_unchanged(session, torch_req, spec)
    if done is None:
        return
    session.install(torch_req)
    session.install("-e", spec)
    done()


def _gate_requirements() -> list[str]:
    """pyproject.toml's requirements of :data:`GATE_PACKAGES` (bounds and markers kept)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: nox's own dependencies bring tomli
        import tomli as tomllib  # type: ignore[no-redef]

    project = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [req for req in project["dependencies"] if re.split(r"[<>=!~;\s\[]", req, maxsplit=1)[0] in GATE_PACKAGES]
    names = {re.split(r"[<>=!~;\s\[]", req, maxsplit=1)[0] for req in found}
    if names != set(GATE_PACKAGES):
        raise RuntimeError(f"pyproject.toml lists no {sorted(set(GATE_PACKAGES) - names)}; update GATE_PACKAGES")
    return found


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite (GPU-marked tests skip where there is no GPU).

    The real TensorRT bindings of several versions (tests/test_trt_real_bindings.py)
    are downloaded here, with the other installs, into the session's virtualenv, so
    that a missing network fails at set-up with pip's message and later runs reuse them.

    The suite runs in one worker process per core (xdist's ``-n auto``, which
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides; at most ``MAX_TEST_WORKERS``;
    every test already passes beside a CPU-heavy process, which is all a second
    worker is to it), then the pytest-benchmark cases on their own:
    pytest-benchmark turns itself off under xdist, so they would time nothing.
    Posargs that only select (``nox -s tests -- -m "not slow"``, the quick tier)
    apply to both runs; posargs naming test files or directories
    (``nox -s tests -- tests/test_x.py -k y``) are one plain pytest of exactly those.
    """
    _install(session, "test")
    # onnx2torch (the onnx-import extra) alone: its torchvision requirement would resolve to a CUDA
    # wheel that does not import beside a CPU torch and breaks transformers' imports (pyproject.toml)
    session.install("--no-deps", "onnx2torch>=1.5.15")
    _ensure_chromium(session)
    wheels = Path(session.virtualenv.location) / "trt-bindings"
    session.run("python", "tests/trt_bindings.py", str(wheels))
    env = {"HARNESS_TRT_WHEELS": str(wheels)}
    pytest = ("pytest", "-q", "-p", "no:cacheprovider")
    if _names_test_files(session.posargs):
        session.run(*pytest, *session.posargs, env=env)
        return
    selection = tuple(session.posargs)
    workers = ("-n", "auto", "--maxprocesses", str(MAX_TEST_WORKERS))
    session.run(*pytest, *workers, *selection, "--ignore", BENCHMARK_TESTS, env=env)
    # a selection may take no benchmark case: pytest's "no tests collected" (5) is no failure then
    session.run(*pytest, *selection, BENCHMARK_TESTS, env=env, success_codes=[0, 5] if selection else [0])


def _names_test_files(args: Sequence[str]) -> bool:
    """Whether pytest arguments name test files or directories (``tests/test_x.py``,
    ``tests/test_x.py::test_y``) rather than only select by marker or keyword."""
    return any(not arg.startswith("-") and Path(arg.split("::")[0]).exists() for arg in args)


CHROMIUM = Path("/usr/bin/chromium")


def _ensure_chromium(session: nox.Session) -> None:
    """Debian's Chromium for the browser tests (tests/headless_chromium.py), installed where this
    session may (root, apt-get); elsewhere those tests skip and say why."""
    if CHROMIUM.exists():
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium", external=True)
    else:
        session.warn(f"{CHROMIUM} is missing and cannot be installed here (needs root and apt-get): "
                     "the browser tests skip")


# The suite's pytest-benchmark cases (run serially: see ``tests``).
BENCHMARK_TESTS = "tests/benchmarks"
# Each worker holds torch, ONNX Runtime and OpenVINO (1.1-1.8 GB seen); past a few workers the
# suite is bound by its longest tests, not by cores.
MAX_TEST_WORKERS = 4


# Repairs for tensorrt-stubs 10.13, whose generated .pyi files do not parse:
# parameters named with the keyword ``in`` (plugin interfaces) and
# ``add_scale_nd``'s ``channel_axis`` without a default after defaulted ones.
_TRT_STUB_FIXES = (
    (re.compile(r"\bin: "), "in_: "),
    (re.compile(r"channel_axis: int\)"), "channel_axis: int = ...)"),
)
_TRT_STUB_PACKAGES = ("tensorrt", "tensorrt_bindings")


def _write_fixed_trt_stubs(site_packages: Path, dest: Path) -> None:
    """Copy the TensorRT stub packages into ``dest``, repaired and checkable by mypy.

    mypy ignores the installed stubs (no ``py.typed``, and ``ignore_missing_imports``
    hides that), so without this the TensorRT backend is checked against ``Any``.
    Put on ``MYPYPATH``, the copies are used instead; each starts with
    ``# mypy: ignore-errors`` so that only *our* calls into them are judged.
    """
    for package in _TRT_STUB_PACKAGES:
        source = site_packages / package
        stubs = sorted(source.glob("*.pyi"))
        if not stubs:
            raise RuntimeError(f"no TensorRT type stubs in {source}; is tensorrt-stubs installed?")
        (dest / package).mkdir(parents=True)
        for stub in stubs:
            text = stub.read_text(encoding="utf-8")
            for pattern, replacement in _TRT_STUB_FIXES:
                text = pattern.sub(replacement, text)
            (dest / package / stub.name).write_text("# mypy: ignore-errors\n" + text, encoding="utf-8")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy; the TensorRT backend is type-checked against tensorrt-stubs."""
    # tensorrt-stubs depends on the tensorrt wheel, whose native libraries only download
    # from NVIDIA's host: the stubs alone, without it. The extras whose packages the code
    # imports are installed so that mypy checks the calls into them.
    _install(session, "onnx", "plots", "digits", "lint")
    session.install("--no-deps", "tensorrt-stubs>=10.8")
    session.run("ruff", "check", "harness", "models", "tests", "noxfile.py")
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    if not isinstance(purelib, str):  # --install-only: no command runs
        return
    with tempfile.TemporaryDirectory(prefix="trt-stubs-") as stubs:
        _write_fixed_trt_stubs(Path(purelib.strip()), Path(stubs))
        session.run("mypy", env={"MYPYPATH": stubs})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark the model zoo across precision modes (posargs go to ``harness bench``).

    The extras of the default run: ``onednn`` (the CPU engine's tactics on oneDNN's
    primitives: ``gemm_dnnl``, ``conv_dnnl``, ``pool_dnnl``, ``binary_dnnl``,
    ``cast_dnnl``, ``layernorm_dnnl``, ``sdpa_dnnl``), ``plots`` (its PNGs) and ``digits`` (a default model); on a GPU
    machine also ``onnx``, the TensorRT backend's hand-off.
    """
    _install(session, "onednn", "plots", "digits", *(("onnx",) if _is_gpu_machine() else ()))
    session.run("harness", "bench", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU smoke check (``python -m harness.smoke``, posargs go to it): build, pinned rebuild,
    a pin that moves a kernel, bench with telemetry, promote and gate, ``pytest -m gpu``, each
    once on a small model, with a table of the checks. Fails, saying so, without a GPU.

    Installs a CUDA build of torch (``HARNESS_TORCH`` overrides it) and the TensorRT extra for
    its CUDA major (``tensorrt-cu12`` or ``tensorrt-cu13``, :func:`harness.extras.tensorrt_extra`),
    or the TensorRT requirement ``HARNESS_TENSORRT`` names (a release of the CI matrix).
    """
    if not _is_gpu_machine():
        session.error("nox -s gpu: no GPU here (nvidia-smi is not on PATH); nothing was checked")
    torch_req = os.environ.get("HARNESS_TORCH") or GPU_TORCH
    session.install(torch_req)
    # harness.extras needs nothing but the standard library: it runs before the project is installed.
    extra = session.run(
        "python", "-c", "import torch; from harness.extras import tensorrt_extra; print(tensorrt_extra(torch.version.cuda))",
        silent=True,
    )
    pinned = os.environ.get("HARNESS_TENSORRT")  # a TensorRT release of the CI matrix, e.g. tensorrt-cu12==10.*
    if pinned:
        session.install("-e", ".[test]", pinned)
    elif isinstance(extra, str):  # None with --install-only: no command runs
        session.install("-e", f".[test,{extra.strip()}]")
    session.run("python", "-m", "harness.smoke", *session.posargs)


@nox.session
def gate(session: nox.Session) -> None:
    """Gate the newest run against this machine's baseline (posargs go to ``harness gate``).

    The gate compares two JSON files: no torch. The project is installed without its
    dependencies, plus what the gate imports (:data:`GATE_PACKAGES`).
    """
    requirements = _gate_requirements()
    done = _skip_if_unchanged(session, "gate", *requirements)
    if done is not None:
        session.install(*requirements)
        session.install("--no-deps", "-e", ".")
        done()
    session.run("harness", "gate", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: ``mkdocs build --strict`` into ``build/site/`` (posargs go to ``mkdocs build``).

    The CLI reference, project-file keys, JSON schemas, Python API and benchmark pages are
    generated from the code and the committed results while the site builds (docs/hooks/), so
    the project is installed with the ``docs`` extra; a broken link, anchor or reference fails.
    """
    _install(session, "docs")
    # NO_MKDOCS_2_WARNING: Material for MkDocs prints a banner about its successor on every build
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})
