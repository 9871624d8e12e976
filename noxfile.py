"""Sessions: ``tests``, ``lint``, ``bench`` (posargs go to ``harness bench``), ``gate``.

torch is installed before the project so that pip never resolves a bare
``torch`` requirement on a CPU-only machine (that would pull a multi-GB CUDA
build). GPU machines (``nvidia-smi`` on PATH) get the default CUDA build;
``HARNESS_TORCH`` overrides the requirement either way.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

CPU_TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    torch_req = os.environ.get("HARNESS_TORCH") or ("torch" if shutil.which("nvidia-smi") else CPU_TORCH)
    session.install(torch_req)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite (GPU-marked tests skip where there is no GPU)."""
    _install(session, "test")
    session.run("pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy; the TensorRT backend is type-checked against tensorrt-stubs."""
    _install(session, "lint")
    # tensorrt-stubs depends on the tensorrt wheel, whose native libraries only
    # download from NVIDIA's host: take the stubs alone.
    session.install("--no-deps", "tensorrt-stubs")
    session.run("ruff", "check", "harness", "models", "tests", "noxfile.py")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark the model zoo across precision modes (posargs go to ``harness bench``)."""
    _install(session, "gpu")
    session.run("harness", "bench", *session.posargs)


@nox.session
def gate(session: nox.Session) -> None:
    """Gate the newest run against this machine's baseline (posargs go to ``harness gate``)."""
    _install(session)
    session.run("harness", "gate", *session.posargs)
