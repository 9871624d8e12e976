"""Atomic writes and validated JSON reads.

Every file the harness writes goes through :func:`atomic_write_bytes`: the data
lands in a temporary file in the same directory, is fsynced, and replaces the
target in one ``os.replace``. An interrupted run therefore leaves either the
old file or the new one, never half of one, and a corrupt input that failed to
load is never overwritten by accident because readers raise before writers run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jsonschema

from harness.errors import HarnessError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same-directory temp file + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; results and caches are shared files
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


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: str | os.PathLike[str], schema: dict[str, Any] | None = None, what: str = "file") -> Any:
    """Load JSON from ``path`` and validate it; any failure names the file and the problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HarnessError(f"{what} {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HarnessError(f"{what} {p}: cannot read ({exc})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HarnessError(
            f"{what} {p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file may be truncated or corrupt and was left untouched"
        ) from None
    if schema is not None:
        validate(obj, schema, f"{what} {p}")
    return obj


def validate(obj: Any, schema: dict[str, Any], where: str) -> None:
    """Validate against a JSON schema, naming the first offending field."""
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        field = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise HarnessError(f"{where}: invalid at {field}: {err.message}")
