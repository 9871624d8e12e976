"""The on-disk envelope every saved engine shares: a directory with ``plan.json`` beside its payload.

Each backend stores a different payload (safetensors weights, an ONNX model,
a TensorRT plan), but the checks before trusting a saved engine are the
same: the directory exists, ``plan.json`` is JSON of this backend's format and
a plan version this harness reads, and it matches the schema generated from the
backend's plan class (:class:`PlanHeader` and its subclasses). One
place for them keeps every backend's messages for damaged or foreign engines
alike, and lets tools that only read the plan (``harness cache verify``) tell
which backend must load it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic.dataclasses import dataclass

from harness.documents import DOCUMENT, document_json, read_typed, schema_of
from harness.errors import HarnessError
from harness.fileio import (
    MAX_PAYLOAD_BYTES,
    atomic_write_bytes,
    check_writable_dir,
    current_umask,
    digest,
    directories_for,
    path_errors_named,
    read_json,
    read_regular_file,
    record_created,
    shown,
    validate,
    write_failures_named,
)

PLAN_FILE = "plan.json"
# The backends that save engines: harness.engines.registry's, without "auto" (it imports the
# engine protocol, which imports this module, so the names are given here; a test holds them
# equal). A plan naming another was not saved by this harness.
ENGINE_BACKENDS = ("cpu", "onnxruntime", "openvino", "tensorrt")


@dataclass(frozen=True, config=DOCUMENT)
class PlanHeader:
    """The fields every plan opens with: its format, the format's version, the backend that saved it.

    A backend's plan class derives from this one; a class's fields, in order, are its file's
    keys, in order (a base's fields before a subclass's own, bases in reverse method-resolution
    order), so a plan written from its class is the file its format describes. The three values
    are the :class:`PlanFormat`'s, which its schema holds as constants.
    """

    format: str
    version: int
    backend: str


P = TypeVar("P", bound=PlanHeader)


@dataclasses.dataclass(frozen=True, eq=False)
class PlanFormat(Generic[P]):
    """One backend's saved-engine format: what its ``plan.json`` must say and hold.

    ``document`` is the plan's class: the :attr:`schema` a plan is checked against is generated
    from it (every field required, no other key allowed), with the format's header values as
    constants. ``payload`` is the file stored beside the plan.
    """

    backend: str
    name: str  # the plan's "format"
    version: int
    payload: str
    document: type[P]

    def header(self) -> dict[str, Any]:
        """The fields a plan of this format opens with."""
        return {"format": self.name, "version": self.version, "backend": self.backend}

    @functools.cached_property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of a whole plan of this format: :attr:`document`'s, with the header's values."""
        schema = schema_of(self.document, f"{self.backend} engine plan")
        constants = {name: {"const": value} for name, value in self.header().items()}
        return {**schema, "properties": {**schema["properties"], **constants}}

    def read(self, path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], str]:
        """``plan.json`` of the engine directory ``path``, as JSON that matches :attr:`schema`.

        Returns the directory, the plan and the "engine plan FILE" prefix for further messages.
        Raises HarnessError naming the file: for a missing directory or plan, a plan of another
        format (naming the backend that saved it), another version, or the first field that
        does not match the schema (with what would be valid).
        """
        directory = Path(path)
        if not directory.exists():
            raise HarnessError(
                f"engine {directory}: no such directory (expected {PLAN_FILE} and {self.payload} in it)"
            )
        if not directory.is_dir():
            raise HarnessError(
                f"engine {directory}: not a directory (expected {PLAN_FILE} and {self.payload} in it)"
            )
        plan_path = directory / PLAN_FILE
        where = f"engine plan {plan_path}"
        obj = read_json(plan_path, what="engine plan")
        if not isinstance(obj, dict) or obj.get("format") != self.name:
            found = obj.get("backend") if isinstance(obj, dict) else None
            saved_by = isinstance(found, str) and found != self.backend
            hint = f"; it was saved by backend {found}: use --backend {found}" if saved_by else ""
            raise HarnessError(
                f'{where}: not a {self.backend} engine plan (expected "format": "{self.name}"){hint}'
            )
        if obj.get("version") != self.version:
            raise HarnessError(
                f"{where}: plan schema version {obj.get('version')!r} is not supported "
                f"(this harness reads version {self.version}); rebuild the engine"
            )
        validate(obj, self.schema, where)
        return directory, obj, where

    def typed(self, obj: dict[str, Any], where: str) -> P:
        """The plan :meth:`read` returned, as a :attr:`document`."""
        return read_typed(self.document, obj, where)

    def load(self, path: str | os.PathLike[str]) -> tuple[Path, P, str]:
        """:meth:`read`, with the plan as a :attr:`document` (same errors)."""
        directory, obj, where = self.read(path)
        return directory, self.typed(obj, where), where

    def dump(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON of the plan ``obj`` (the fields an engine writes) as its :attr:`document` holds it.

        A writer's plan goes through the class, so a file holds exactly what the class declares,
        in its order; a field the class does not declare, or lacks, is a HarnessError.
        """
        plan: dict[str, Any] = document_json(read_typed(self.document, obj, f"{self.backend} engine plan being written"))
        return plan


def engine_directory(path: str | os.PathLike[str]) -> Path:
    """The directory an engine is saved into; refused, before any work, when it cannot be written."""
    return check_writable_dir(path, "engine path", replaced_whole=True)


def write_engine_dir(path: str | os.PathLike[str], files: Mapping[str, bytes]) -> Path:
    """Replace the engine directory ``path`` with ``files``, as a whole.

    Every file is written into a sibling temporary directory first; then the
    two directories trade places in one atomic ``renameat2(RENAME_EXCHANGE)``
    (or, for a new engine, one rename). A run interrupted at any point leaves
    the previous engine or the new one, never a plan with the other's weights;
    a write the system refuses (a full disk) is one :class:`WriteFailed`
    naming ``path``, and leaves the previous engine, no staging directory and
    no directory made for the engine.
    """
    target = engine_directory(path)
    existed = target.exists()
    with write_failures_named(path), directories_for(target.parent):
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            os.chmod(staging, 0o777 & ~current_umask())
            for name, data in files.items():
                atomic_write_bytes(staging / name, data)
            if existed:
                _exchange(staging, target)  # staging now holds the previous engine
            else:
                os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not existed:
        record_created(target)
    return target


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Swap two directory entries atomically (Linux renameat2); else replace b in two renames."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        if result == 0:
            return
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
            error = ctypes.get_errno()
            raise HarnessError(f"cannot replace engine {b}: {os.strerror(error)}")
    old = b.with_name(f".{b.name}.old")  # no atomic swap here: the shortest possible gap
    shutil.rmtree(old, ignore_errors=True)
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)


def plan_backend(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """(engine directory, backend name) of a saved engine, given its directory or its plan.json."""
    given = Path(path)
    with path_errors_named("engine", given):
        is_directory, is_plan = given.is_dir(), given.name == PLAN_FILE and given.is_file()
    if is_directory:
        directory = given
    elif is_plan:
        directory = given.parent
    else:
        raise HarnessError(
            f"engine {given}: no such engine directory (expected a directory holding {PLAN_FILE}, "
            f"or the {PLAN_FILE} itself)"
        )
    plan_path = directory / PLAN_FILE
    obj = read_json(plan_path, what="engine plan")
    backend = obj.get("backend") if isinstance(obj, dict) else None
    if not isinstance(backend, str):
        raise HarnessError(f'engine plan {plan_path}: no "backend" field; this is not a saved engine plan')
    if backend not in ENGINE_BACKENDS:
        raise HarnessError(
            f'engine plan {plan_path}: "backend" is {shown(backend)}, no backend of this harness; '
            f"valid: {', '.join(ENGINE_BACKENDS)}"
        )
    return directory, backend


def read_payload(directory: Path, name: str, expected_digest: str, what: str) -> bytes:
    """The payload file beside ``plan.json``, refused when its digest is not the plan's."""
    path = directory / name
    data = read_regular_file(path, what, MAX_PAYLOAD_BYTES)  # a FIFO or /dev/zero would never end
    if digest(data) != expected_digest:
        raise HarnessError(
            f"{what} {path}: digest does not match {directory / PLAN_FILE}; it was modified "
            "or belongs to another engine"
        )
    return data
