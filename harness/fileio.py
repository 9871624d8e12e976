"""Atomic writes and validated JSON reads.

Every file the harness writes goes through :func:`atomic_write_bytes`: the data
lands in a temporary file in the same directory, is fsynced, and replaces the
target in one ``os.replace``. An interrupted run therefore leaves either the
old file or the new one, never half of one, and a corrupt input that failed to
load is never overwritten by accident because readers raise before writers run.

Files that several processes read, change and write back (timing caches,
results files of resumed runs) are changed under :func:`locked`, an
exclusive ``flock`` (as trtexec and Polygraphy lock timing caches): two
processes editing one cache at once both keep their changes. Every read is
bounded (:func:`read_regular_file`: regular files only, a size limit; JSON
through :func:`parse_json`), so no input can hang a command or exhaust memory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema

from harness.errors import HarnessError


def current_umask() -> int:
    """The process umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_target(path: str | os.PathLike[str], what: str = "output") -> Path:
    """The file a write of ``path`` replaces: ``path`` itself, or a symlink's existing target.

    A symlink is followed so that its target is replaced and the link stays a
    link. A dangling link is refused: following it would create its target's
    directories wherever it points (anywhere on the machine), and replacing
    the link instead would silently cut the user's indirection.
    """
    p = Path(path)
    if not p.is_symlink():
        return p
    if not p.exists():
        raise HarnessError(
            f"{what} {p}: is a symbolic link to {os.readlink(p)}, which does not exist; "
            "create the target's directory or remove the link"
        )
    return Path(os.path.realpath(p))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same-directory temp file + rename).

    A symlink is followed: its target is replaced and the link stays a link
    (a dangling one is refused, see :func:`write_target`).
    """
    target = write_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; results and caches are shared files
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def canonical_json(obj: Any) -> bytes:
    """Stable JSON bytes (sorted keys, no whitespace) used for digests."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def json_bytes(obj: Any) -> bytes:
    """How the harness writes a JSON document: indented, finite numbers only."""
    return (json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n").encode()


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


# Bounds of what any JSON file of the harness may hold; beyond them a file is
# refused before it can exhaust memory or the stack.
MAX_JSON_BYTES = 256 << 20
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 20  # 2**64 has 20 digits: nothing the harness writes is larger
# Engine payloads (weights, ONNX models, TensorRT plans) are read whole into memory;
# a file larger than any engine this harness builds is refused before it is read.
MAX_PAYLOAD_BYTES = 16 << 30


def read_regular_file(path: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path``, refusing what is not a regular file (a FIFO would block forever)."""
    p = Path(path)
    try:
        info = p.stat()
    except FileNotFoundError:
        raise HarnessError(f"{what} {p}: no such file") from None
    except OSError as exc:
        raise HarnessError(f"{what} {p}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise HarnessError(f"{what} {p}: is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise HarnessError(f"{what} {p}: not a regular file (a pipe, socket or device)")
    if info.st_size > limit:
        raise HarnessError(f"{what} {p}: {info.st_size} bytes is more than the {limit} this harness reads")
    try:
        with p.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise HarnessError(f"{what} {p}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:  # it grew after the size check
        raise HarnessError(f"{what} {p}: more than the {limit} bytes this harness reads")
    return data


def read_text_file(path: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES) -> str:
    """A text file (logs, layer listings) through :func:`read_regular_file`; bad bytes become U+FFFD.

    Logs of other tools may hold stray non-UTF-8 bytes (a device name, a
    truncated line); they are shown, never fatal.
    """
    return read_regular_file(path, what, limit).decode("utf-8", errors="replace")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows; the harness never writes it")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:30]} is out of the floating-point range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text)} digits is larger than any the harness writes")
    return int(text)


class JsonSyntaxError(HarnessError):
    """Text that is not JSON at all (as opposed to JSON the harness refuses).

    Callers that accept "JSON or else a plain string" (``--option KEY=VALUE``)
    catch this one only: JSON that is too deep, too large or non-finite is
    still an error.
    """


def parse_json(text: str | bytes, where: str) -> Any:
    """Parse JSON as the harness writes it: finite numbers, bounded integers and nesting.

    NaN, Infinity and out-of-range floats are refused (the writer refuses
    them too, so a file that holds one was not written by the harness), and
    every failure becomes one HarnessError naming ``where``.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HarnessError(
                f"{where}: not valid JSON (not UTF-8 text: byte {exc.start} cannot be decoded); "
                "the file may be corrupt and was left untouched"
            ) from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(
            f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file may be truncated or corrupt and was left untouched"
        ) from None
    except RecursionError:
        raise HarnessError(f"{where}: nested deeper than any file the harness writes") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HarnessError(f"{where}: {exc}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise HarnessError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    return obj


def _depth(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


def read_json(path: str | os.PathLike[str], schema: dict[str, Any] | None = None, what: str = "file") -> Any:
    """Load JSON from ``path`` and validate it; any failure names the file and the problem."""
    p = Path(path)
    obj = parse_json(read_regular_file(p, what), f"{what} {p}")
    if schema is not None:
        validate(obj, schema, f"{what} {p}")
    return obj


def validate(obj: Any, schema: dict[str, Any], where: str) -> None:
    """Validate against a JSON schema, naming the first offending field."""
    validator = jsonschema.Draft202012Validator(schema)
    # best_match looks inside anyOf/if-then branches for the error that explains the
    # failure, instead of "X is not valid under any of the given schemas" with X in full.
    err = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if err is not None:
        field = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        message = err.message if len(err.message) <= 300 else err.message[:297] + "..."
        bounds = err.schema if isinstance(err.schema, dict) else {}
        if err.validator in ("minimum", "maximum") and "minimum" in bounds and "maximum" in bounds:
            low, high = (f"{v:g}" if isinstance(v, float) else str(v) for v in (bounds["minimum"], bounds["maximum"]))
            message += f" (valid: {low}..{high})"
        raise HarnessError(f"{where}: invalid at {field}: {message}")


def check_writable(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written as a file.

    A directory in its place, a file where one of its parent directories
    should be, a pipe or device, or a nearest existing directory the user
    cannot write to: each is named, instead of a traceback after a long run.
    """
    p = Path(path)
    target = write_target(p, what)
    if target.is_dir():
        raise HarnessError(f"{what} {p}: is a directory; give a file path")
    if target.exists() and not target.is_file():
        raise HarnessError(f"{what} {p}: exists and is not a regular file")
    _check_ancestors(target.parent, p, what)
    return p


def check_writable_dir(path: str | os.PathLike[str], what: str, *, replaced_whole: bool = False) -> Path:
    """Refuse, before any work, a directory path that cannot be created or written into.

    The counterpart of :func:`check_writable` for output directories (engine
    directories, ``--cache-dir``): a file in its place or anywhere on its
    parent chain, a dangling symlink, or a nearest existing directory the user
    cannot write to is named now, not as a traceback after the work. A
    directory ``replaced_whole`` (an engine: a sibling is written, then
    renamed into place) needs its parent writable rather than itself.
    """
    p = Path(path)
    target = write_target(p, what)
    if target.exists() and not target.is_dir():
        raise HarnessError(f"{what} {p}: exists and is not a directory")
    _check_ancestors(target.parent if replaced_whole else target, p, what)
    return p


def _check_ancestors(start: Path, given: Path, what: str) -> None:
    """The nearest existing one of ``start`` and its ancestors is a writable directory."""
    existing = start
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise HarnessError(
            f"{what} {given}: {existing} is a symbolic link to {os.readlink(existing)}, which does not exist"
        )
    if not existing.is_dir():
        raise HarnessError(f"{what} {given}: {existing} is a file, so nothing can be written below it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise HarnessError(f"{what} {given}: directory {existing} is not writable")


@contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock for a read-modify-write of ``path`` (blocks until free).

    The lock is taken on the directory holding ``path``: the file itself is
    replaced by rename on every write, so a lock on its inode would protect
    nothing, and a lock file beside it would be litter. Critical sections are
    short (read, change, write one file), so sharing the directory's lock costs
    nothing noticeable.
    """
    directory = Path(os.path.realpath(write_target(path))).parent
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        raise HarnessError(f"cannot lock {path}: {exc.strerror or exc} ({directory})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def parse_toml_file(path: str | os.PathLike[str], what: str) -> Any:
    """A TOML file through the standard reader (tomllib; tomli before Python 3.11)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    p = Path(path)
    data = read_regular_file(p, what)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise HarnessError(f"{what} {p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"{what} {p}: not valid TOML ({exc})") from None
    except RecursionError:  # tomllib recurses per nesting level: [[[[...]]]] exhausts the stack
        raise HarnessError(f"{what} {p}: nested deeper than any project file needs") from None
    except ValueError as exc:  # an integer beyond int()'s digit limit
        first = str(exc).split(";")[0].strip() or type(exc).__name__
        raise HarnessError(f"{what} {p}: a value TOML cannot hold here ({first})") from None
