"""The real TensorRT Python bindings of several versions, importable on a machine without a GPU.

NVIDIA publishes the bindings (``tensorrt-cu12-bindings``) apart from the native
libraries. Their extension module links ``libnvinfer.so.N``,
``libnvonnxparser.so.N`` and ``libnvinfer_plugin.so.N`` and calls nine C entry
points (``createInferBuilder_INTERNAL`` and friends). A stand-in shared library,
compiled here from :data:`STANDIN_SOURCE` with the system C compiler, supplies
those nine and nothing else, so the bindings import and everything they
implement themselves is real: the enums with their members and integer values,
``TimingCacheKey.parse``, ``TimingCacheValue``, the ``ILogger`` trampoline and
the methods' signatures.

What the stand-in does NOT exercise: every entry point returns NULL or 0, so
no builder, runtime, parser, network, config, timing cache or engine object can
exist; nothing is built, timed, serialized or run, and no message ever comes
from TensorRT itself. It only records the logger pointer and the version the
bindings pass when they try to create a builder or runtime.

Wheels are downloaded once with pip into a cache directory: ``$HARNESS_TRT_WHEELS``
(``nox -s tests`` sets it inside its virtualenv and fills it before the tests
start), else one beside pytest's temporary directories. ``python
tests/trt_bindings.py DIR`` fills DIR.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSIONS = ("10.8", "10.13", "11.0", "11.4")
PACKAGE = "tensorrt-cu12-bindings"
ENV = "HARNESS_TRT_WHEELS"
REPO = Path(__file__).resolve().parent.parent

STANDIN_SOURCE = r"""
/* The nine native entry points the TensorRT Python bindings link; see tests/trt_bindings.py. */
#include <stdint.h>
#define KEPT 16
static void *loggers[KEPT];
static int32_t versions[KEPT];
static int32_t count;
static void *keep(void *logger, int32_t version) {
    if (count < KEPT) { loggers[count] = logger; versions[count] = version; }
    count++;
    return (void *)0;
}
void *createInferBuilder_INTERNAL(void *logger, int32_t version) { return keep(logger, version); }
void *createInferRuntime_INTERNAL(void *logger, int32_t version) { return keep(logger, version); }
void *createInferRefitter_INTERNAL(void *engine, void *logger, int32_t version) { return (void *)0; }
void *createNvOnnxParser_INTERNAL(void *network, void *logger, int32_t version) { return (void *)0; }
void *createNvOnnxParserRefitter_INTERNAL(void *refitter, void *logger, int32_t version) { return (void *)0; }
void *getPluginRegistry(void) { return (void *)0; }
void *getBuilderPluginRegistry(int32_t capability) { return (void *)0; }
int32_t getNvOnnxParserVersion(void) { return 0; }
int initLibNvInferPlugins(void *logger, const char *name_space) { return 0; }
int32_t standin_count(void) { return count; }
void *standin_logger(int32_t i) { return i < KEPT ? loggers[i] : (void *)0; }
int32_t standin_version(int32_t i) { return i < KEPT ? versions[i] : -1; }
"""
_LIBRARIES = ("libnvinfer", "libnvonnxparser", "libnvinfer_plugin")


class Unavailable(Exception):
    """The wheels or the stand-in could not be had (no network, no C compiler)."""


def cache_dir(default: Path) -> Path:
    return Path(os.environ.get(ENV) or default)


def _python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _cached_wheel(dest: Path, version: str) -> Path | None:
    name = PACKAGE.replace("-", "_")
    found = sorted(dest.glob(f"{name}-{version}.*-{_python_tag()}-*.whl"))
    return found[-1] if found else None


def fetch_wheels(dest: Path) -> dict[str, Path]:
    """One wheel per version in :data:`VERSIONS` for this Python, downloaded unless cached."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for version in VERSIONS:
        wheel = _cached_wheel(dest, version)
        if wheel is None:
            with tempfile.TemporaryDirectory(dir=dest) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={version}.*"]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True)
                got = sorted(Path(tmp).glob("*.whl"))
                if done.returncode != 0 or not got:
                    raise Unavailable(
                        f"cannot download {PACKAGE}=={version}.* for {_python_tag()} with pip "
                        f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
                    )
                os.replace(got[-1], dest / got[-1].name)  # atomic: a concurrent run sees all or nothing
            wheel = _cached_wheel(dest, version)
            assert wheel is not None
        wheels[version] = wheel
    return wheels


def _install_once(target: Path, fill) -> Path:
    """``fill`` a fresh directory and move it to ``target``, unless another run already did."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def extracted(wheel: Path) -> Path:
    """The wheel unpacked (it is a zip); the directory to put on ``PYTHONPATH``."""

    def unpack(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tmp)

    return _install_once(wheel.parent / "extracted" / wheel.stem, unpack)


def standin(dest: Path, major: int) -> Path:
    """A directory of stand-in libraries for TensorRT ``major``; the one to put on ``LD_LIBRARY_PATH``."""
    digest = hashlib.sha256(STANDIN_SOURCE.encode()).hexdigest()[:12]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unavailable("no C compiler (cc or gcc) to build the TensorRT stand-in library")

    def build(tmp: Path) -> None:
        source = tmp / "standin.c"
        source.write_text(STANDIN_SOURCE)
        main = f"{_LIBRARIES[0]}.so.{major}"
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{main}", "-o", str(tmp / main), str(source)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise Unavailable(f"building the TensorRT stand-in failed: {done.stderr.strip()}")
        for name in _LIBRARIES[1:]:  # one library answers for all three: symbols resolve globally
            (tmp / f"{name}.so.{major}").symlink_to(main)

    return _install_once(dest / f"standin-{digest}" / str(major), build)


def run_probe(dest: Path, version: str, wheel: Path) -> dict:
    """Run tests/trt_bindings_probe.py under the real bindings of ``version``; its JSON report."""
    major = int(version.split(".")[0])
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(standin(dest, major)), os.environ.get("LD_LIBRARY_PATH")) if p),
        "PYTHONPATH": os.pathsep.join((str(extracted(wheel)), str(REPO))),
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "trt_bindings_probe.py"), f"libnvinfer.so.{major}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(f"the probe under {wheel.name} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/trt_bindings.py DIR")
    try:
        for ver, path in fetch_wheels(Path(sys.argv[1])).items():
            print(f"TensorRT {ver}: {path.name}")
    except Unavailable as exc:
        sys.exit(f"error: {exc}")
