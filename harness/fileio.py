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
bounded (:func:`read_regular_file`: regular files only, a size limit, memory
for what the file holds and no more; JSON through :func:`parse_json`), so no
input can hang a command or exhaust memory.

A write the operating system refuses (a full disk, a quota, a file-size
limit, an I/O error) is one :class:`WriteFailed` naming the file, and leaves
nothing behind: the temporary file and every directory the write created are
removed. A command run under :func:`nothing_left_on_write_failure` goes
further: when a write fails, every file and directory it created before
(a started results file, its cache directory) is removed too.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
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


class WriteFailed(HarnessError):
    """A write the operating system refused: the file named, why, and what to do about it."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"cannot write {os.fspath(path)}: {reason}")
        self.reason = reason


# What the user can do about the errors a write meets on a healthy machine.
_WRITE_ADVICE = {
    errno.ENOSPC: "the filesystem is full: free space on it, or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space within it, or write elsewhere",
    errno.EFBIG: "larger than this process may write (ulimit -f) or the filesystem holds; write elsewhere",
    errno.EROFS: "the filesystem is read-only; write elsewhere",
    errno.EACCES: "permission denied; write elsewhere",
    errno.EPERM: "not permitted; write elsewhere",
    errno.EIO: "an I/O error: check the disk, or write elsewhere",
}


def _write_reason(exc: OSError) -> str:
    """``exc`` as a :class:`WriteFailed` says it: the system's words and the remedy."""
    advice = _WRITE_ADVICE.get(exc.errno or 0, "write elsewhere")
    return f"{exc.strerror or exc} ({advice})"


@contextmanager
def write_failures_named(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError of the writes in the block, or a :class:`WriteFailed` of a file inside
    ``path`` (an engine's staging directory), into one WriteFailed naming ``path``."""
    try:
        yield
    except WriteFailed as exc:
        raise WriteFailed(path, exc.reason) from None
    except OSError as exc:
        raise WriteFailed(path, _write_reason(exc)) from None


@dataclass(eq=False)
class _Journal:
    """What the command running under :func:`nothing_left_on_write_failure` has created."""

    created: list[Path] = field(default_factory=list)  # files and engine directories, removed whole
    new_dirs: list[Path] = field(default_factory=list)  # absent when first named: removed when empty

    def undo(self) -> None:
        for path in reversed(self.created):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for top in sorted(set(self.new_dirs), key=lambda d: len(d.parts), reverse=True):
            if top.is_dir() and not top.is_symlink():
                for folder, _, _ in os.walk(top, topdown=False):
                    _remove_if_empty(Path(folder))


# The journal of the command running in this thread (a context's own: commands run side by side
# in threads, as the concurrency tests run them, each undo what it made).
_JOURNAL: ContextVar[_Journal | None] = ContextVar("harness_write_journal", default=None)


@contextmanager
def nothing_left_on_write_failure() -> Iterator[None]:
    """Run a command so that a failed write leaves nothing of it behind.

    Inside the block, every file :func:`atomic_write_bytes` creates and every
    engine directory :func:`record_created` is told of are recorded, and so
    is every directory that did not exist when the command named it
    (:func:`check_writable`, :func:`check_writable_dir`) or when a write
    created it. When the block ends with :class:`WriteFailed`, those files
    are removed, then every empty directory in the recorded ones: a results
    file started before the disk filled, and the cache directory made for
    it, go with the failed command. Files that existed before are left as
    the last complete write made them; any other way out (success, another
    error, Ctrl-C, which keeps an interrupted run to resume) undoes nothing.
    """
    journal = _Journal()
    token = _JOURNAL.set(journal)
    try:
        yield
    except WriteFailed:
        journal.undo()
        raise
    finally:
        _JOURNAL.reset(token)


def record_created(path: Path) -> None:
    """Tell the running command's journal (if any) that it created ``path``."""
    journal = _JOURNAL.get()
    if journal is not None:
        journal.created.append(path)


def _record_absent(path: Path) -> None:
    """Record, in the running command's journal (if any), the outermost of ``path`` and its
    ancestors that does not exist yet."""
    journal = _JOURNAL.get()
    if journal is None or path.exists() or path.is_symlink():
        return
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    journal.new_dirs.append(path)


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (or gone): kept
        pass


@contextmanager
def directories_for(directory: Path) -> Iterator[None]:
    """Create ``directory`` and its missing parents for the writes of the block; if the block
    fails, remove again those of them that are still empty. A directory the system refuses
    to create is a :class:`WriteFailed` naming it."""
    _record_absent(directory)
    created: list[Path] = []
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # another process made it meanwhile: theirs
                continue
            except OSError as exc:
                raise WriteFailed(folder, _write_reason(exc)) from None
            created.append(folder)
        yield
    except BaseException:
        for folder in reversed(created):
            _remove_if_empty(folder)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same-directory temp file + rename).

    A symlink is followed: its target is replaced and the link stays a link
    (a dangling one is refused, see :func:`write_target`). A write the system
    refuses is a :class:`WriteFailed` naming ``path``, and leaves the old file
    (or none), no temporary file and no directory the write created.
    """
    with write_failures_named(path):
        target = write_target(path)
        existed = target.exists()
    with write_failures_named(path), directories_for(target.parent):
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
    if not existed:
        record_created(target)


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


# A file that grew after its size was taken is read on in pieces of this size.
_READ_CHUNK = 1 << 20


def read_regular_file(path: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path``, refusing what is not a regular file (a FIFO would block forever).

    The size is checked against ``limit`` before anything is read, and the
    memory taken is what the file holds: one buffer of its size (filled by
    as many reads as the system needs), then pieces of :data:`_READ_CHUNK`
    while it grows, never ``limit`` up front (a 16 GiB limit reserved on
    every read fails under ``ulimit -v``).
    """
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
            chunks = [fh.read(info.st_size)] if info.st_size else []
            total = len(chunks[0]) if chunks else 0
            while total <= limit:
                chunk = fh.read(min(_READ_CHUNK, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
    except OSError as exc:
        raise HarnessError(f"{what} {p}: cannot read ({exc.strerror or exc})") from None
    if total > limit:  # it grew after the size check
        raise HarnessError(f"{what} {p}: more than the {limit} bytes this harness reads")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: a reader keeps only the last of two equal
    keys, silently, so which value the file meant is unknown."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(
                f"key {shown(key)} appears twice in one object (a JSON reader keeps only the last, "
                "silently); give each key once"
            )
        obj[key] = value
    return obj


# How long a value from a file or flag may be when an error message quotes it.
SHOWN_CHARS = 80


# A path is quoted whole up to the longest one a filesystem takes (PATH_MAX).
PATH_CHARS = 4096


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``limit`` characters with its
    length said (a 20 MB model name in a project file is named, not echoed)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class JsonSyntaxError(HarnessError):
    """Text that is not JSON at all (as opposed to JSON the harness refuses).

    Callers that accept "JSON or else a plain string" (``--option KEY=VALUE``)
    catch this one only: JSON that is too deep, too large or non-finite is
    still an error.
    """


def parse_json(text: str | bytes, where: str) -> Any:
    """Parse JSON as the harness writes it: finite numbers, bounded integers and nesting.

    NaN, Infinity and out-of-range floats are refused (the writer refuses
    them too, so a file that holds one was not written by the harness), so
    is a key given twice in one object, and every failure becomes one
    HarnessError naming ``where``.
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
        obj = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
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


def validate(
    obj: Any, schema: dict[str, Any], where: str, key_name: Callable[[Sequence[str | int]], str] | None = None
) -> None:
    """Validate against a JSON schema, naming the first offending field.

    The field is named as ``key_name`` spells a path of keys and indices
    (:func:`toml_key` for a TOML file); by default ``cases/0/latency``.
    """
    validator = jsonschema.Draft202012Validator(schema)
    # best_match looks inside anyOf/if-then branches for the error that explains the
    # failure, instead of "X is not valid under any of the given schemas" with X in full.
    err = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if err is not None:
        path = list(err.absolute_path)
        if key_name is not None:
            field = key_name(path) if path else "the top-level table"
        else:
            field = "/".join(str(p) for p in path) or "(top level)"
        message = err.message if len(err.message) <= 300 else err.message[:297] + "..."
        bounds = err.schema if isinstance(err.schema, dict) else {}
        if err.validator in ("minimum", "maximum") and "minimum" in bounds and "maximum" in bounds:
            low, high = (f"{v:g}" if isinstance(v, float) else str(v) for v in (bounds["minimum"], bounds["maximum"]))
            message += f" (valid: {low}..{high})"
        elif err.validator == "uniqueItems":
            twice = next(v for i, v in enumerate(err.instance) if v in err.instance[:i])
            message = f"{shown(twice)} is given twice; give each value once"
        elif err.validator == "additionalProperties" and isinstance(bounds.get("properties"), dict):
            message += f"; valid keys: {', '.join(bounds['properties'])}"
        raise HarnessError(f"{where}: invalid at {field}: {message}")


def check_writable(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written as a file.

    A directory in its place, a file where one of its parent directories
    should be, a pipe or device, or a nearest existing directory the user
    cannot write to: each is named, instead of a traceback after a long run.
    """
    p = Path(path)
    with path_errors_named(what, p):
        target = write_target(p, what)
        if target.is_dir():
            raise HarnessError(f"{what} {p}: is a directory; give a file path")
        if target.exists() and not target.is_file():
            raise HarnessError(f"{what} {p}: exists and is not a regular file")
        _check_ancestors(target.parent, p, what)
        _record_absent(target.parent)
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
    with path_errors_named(what, p):
        target = write_target(p, what)
        if target.exists() and not target.is_dir():
            raise HarnessError(f"{what} {p}: exists and is not a directory")
        _check_ancestors(target.parent if replaced_whole else target, p, what)
        _record_absent(target)
    return p


@contextmanager
def path_errors_named(what: str, path: Path) -> Iterator[None]:
    """An OSError of looking at ``path`` (a name longer than the filesystem takes, a loop of
    symbolic links) as one HarnessError naming it, as ``what`` the user gave it."""
    try:
        yield
    except OSError as exc:
        raise HarnessError(f"{what} {path}: {exc.strerror or exc}") from None


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
    nothing noticeable. It is :func:`locked_directory`'s lock, so a process that
    holds the whole directory (a bench on its cache directory) takes it again freely.
    """
    with locked_directory(Path(os.path.realpath(write_target(path))).parent, str(path)):
        yield


@dataclass
class _DirectoryLock:
    """One directory's lock in this process: a thread lock in front of the ``flock`` on
    the directory's descriptor, which is held while ``depth`` > 0."""

    thread_lock: threading.RLock = field(default_factory=threading.RLock)
    depth: int = 0


_DIRECTORY_LOCKS: dict[Path, _DirectoryLock] = {}
_DIRECTORY_LOCKS_GUARD = threading.Lock()


@contextmanager
def locked_directory(
    directory: Path, what: str | None = None, waiting: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold ``directory``'s exclusive lock for the block, against other processes (``flock``
    on the directory) and other threads; re-entrant within one thread, so a caller may
    hold it around work that locks files in it. ``waiting`` is called once, before
    blocking, when another process holds it. The directory is created if missing and
    removed again if the block fails and leaves it empty."""
    directory = Path(os.path.realpath(directory))
    with _DIRECTORY_LOCKS_GUARD:
        entry = _DIRECTORY_LOCKS.setdefault(directory, _DirectoryLock())
    with entry.thread_lock, directories_for(directory):
        if entry.depth:  # this thread holds it already
            entry.depth += 1
            try:
                yield
            finally:
                entry.depth -= 1
            return
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError as exc:
            raise HarnessError(f"cannot lock {what or directory}: {exc.strerror or exc} ({directory})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                fcntl.flock(fd, fcntl.LOCK_EX)
            entry.depth = 1
            try:
                yield
            finally:
                entry.depth = 0
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


def check_finite(doc: Any, where: str, key_name: Callable[[Sequence[str | int]], str]) -> None:
    """Refuse NaN and infinity anywhere in a parsed document (TOML has both), naming the key.

    A JSON schema cannot: every comparison with NaN is false, so ``nan``
    passes ``minimum`` and ``maximum`` alike, and the JSON the value is
    later stored in cannot hold it.
    """
    stack: list[tuple[list[str | int], Any]] = [([], doc)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise HarnessError(f"{where}: {key_name(path)} = {item}: not a finite number; give a finite one")
        if isinstance(item, dict):
            stack.extend(([*path, k], v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend(([*path, i], v) for i, v in enumerate(item))


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(path: Sequence[str | int]) -> str:
    """A key path as a TOML file writes it: ``threads``, ``[timing] warmup_s``,
    ``batch_sizes[1]``, ``[model."net.py:make".autocast] data_max``."""
    parts: list[str] = []
    for key in path:
        if isinstance(key, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{key}]"]
        else:
            parts.append(_toml_part(key))
    return parts[0] if len(parts) == 1 else f"[{'.'.join(parts[:-1])}] {parts[-1]}"


def _toml_part(key: str) -> str:
    """One key, bare when TOML allows it, else quoted (a long one cut, as :func:`shown` does)."""
    if _BARE_KEY.fullmatch(key):
        return key
    quoted = json.dumps(key)  # a TOML basic string escapes as JSON does
    return quoted if len(quoted) <= SHOWN_CHARS else f'{quoted[:SHOWN_CHARS]}..." ({len(key)} characters)'
