"""The project file: a team's benchmark configuration, checked in next to its model.

Read from ``--config FILE``, else ``./harness.toml``, else the ``[tool.harness]``
table of ``./pyproject.toml`` (nothing found: no project, defaults apply; a
``pyproject.toml`` that does not parse and never names ``harness`` is another
tool's, and left alone). It is TOML read with the standard reader and
validated against :func:`schema`: every number finite (TOML's ``nan`` and
``inf`` refused) and within its bounds, every list holding a value once, no
unknown key; an error names the key as the file writes it (``[timing]
warmup_s``). Command-line flags override it, and the
effective configuration is stored in every results file.

Example (``harness.toml``; the same keys go under ``[tool.harness]``)::

    models = ["my_model.py:make", "resnet"]
    modes = ["fp32", "autocast-bf16", "amp-bf16"]
    backend = "cpu"
    threads = 1
    batch_sizes = [1, 8]
    peers = ["eager", "onnxruntime"]   # reference rows (harness bench --peers)

    [autocast]                       # every model
    exclude_op = ["aten.softmax"]
    data_max = 256

    [model."my_model.py:make"]       # one model: overrides and its explicit precision file
    explicit = "precisions/my_model.json"
    autocast = { exclude = ["^head"] }

    [timing]
    min_duration_s = 4.0
    spread_threshold = "5%"

    [gate]
    latency_threshold = "5%"
    cosine_drop = 1e-4

Relative paths (model files, explicit and calibration files) are relative to
the project file's directory; paths on the command line to the current one.
A ``[model."<key>"]`` table is keyed by the model's reference as written here
or by its ``ModelSpec`` name (``[model.make]``), for every command; a table
that names no model configured here or given on the command line is an error
(:meth:`Project.check_model_tables`). :meth:`Project.to_json` is what the
results store, with paths as :func:`portable_path` gives them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from harness.bench.peer_names import PEER_NAMES
from harness.engines.registry import BACKEND_NAMES
from harness.errors import HarnessError
from harness.fileio import check_finite, parse_toml_file, read_regular_file, toml_key, validate
from harness.limits import MAX_BATCH_SIZE, MAX_ITERS, MAX_MIN_DURATION_S, MAX_THREADS, MAX_WARMUP_S

if TYPE_CHECKING:
    from harness.autocast.settings import AutocastSettings
    from harness.models import ModelSpec

_PERCENT = {
    "anyOf": [
        {"type": "string", "pattern": r"^\s*[0-9.]+\s*%?\s*$", "maxLength": 32},
        {"type": "number", "minimum": 0},
    ]
}
_NONNEG = {"type": "number", "minimum": 0}
# A path (or a model reference: a path, a colon and a factory) no filesystem would take is
# refused by the schema, whose message is cut short, before anything echoes it in full.
_PATH = {"type": "string", "minLength": 1, "maxLength": 4096}

# Stands for the autocast tables' schema (harness.autocast.options.SCHEMA), which
# imports torch: :func:`schema` puts in the real one, or leaves this for ``gate``.
_ANY_TABLE: dict[str, Any] = {"type": "object"}

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        # Each list holds a value once: the flags refuse a repeated batch size or model, and
        # a case measured twice is refused when its results are recorded, after the work.
        "models": {"type": "array", "items": _PATH, "minItems": 1, "uniqueItems": True},
        "modes": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 64},
            "minItems": 1,
            "uniqueItems": True,
        },
        "backend": {"enum": list(BACKEND_NAMES)},
        "threads": {"type": "integer", "minimum": 1, "maximum": MAX_THREADS},
        "batch_sizes": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH_SIZE},
            "minItems": 1,
            "uniqueItems": True,
        },
        "cache_dir": _PATH,
        "peers": {"type": "array", "items": {"enum": list(PEER_NAMES)}, "minItems": 1, "uniqueItems": True},
        "autocast": _ANY_TABLE,
        "model": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "autocast": _ANY_TABLE,
                    "explicit": _PATH,
                    # a model file's inputs (harness.sources.inputs; harness bench's flags of these names)
                    "input_shapes": {"type": "string", "minLength": 1, "maxLength": 4096},
                    "input_range": {"type": "string", "minLength": 1, "maxLength": 4096},
                    "load_inputs": _PATH,
                },
            },
        },
        # serving scenarios (harness.bench.scenarios; harness bench --scenario and its flags)
        "scenario": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "names": {
                    "type": "array",
                    "items": {"enum": ["single-stream", "offline", "multi-stream", "server"]},
                    "minItems": 1,
                    "uniqueItems": True,
                },
                "concurrency": {"type": "integer", "minimum": 1, "maximum": 256},
                "latency_bound": {"type": "string", "minLength": 1, "maxLength": 32},
                "target_rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
                "find_rate": {"type": "boolean"},
                "samples_per_query": {"type": "integer", "minimum": 1, "maximum": 65536},
                "query_interval": {"type": "string", "minLength": 1, "maxLength": 32},
            },
        },
        "timing": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                # Bounded (harness.limits): an hour-long warm-up or 10**19 iterations is
                # a hang, not a measurement. NaN passes a JSON schema's bounds: the file's
                # nan and inf are refused before the schema (fileio.check_finite).
                "warmup_s": {**_NONNEG, "maximum": MAX_WARMUP_S},
                "min_iters": {"type": "integer", "minimum": 1, "maximum": MAX_ITERS},
                "min_duration_s": {**_NONNEG, "maximum": MAX_MIN_DURATION_S},
                "max_iters": {"type": "integer", "minimum": 1, "maximum": MAX_ITERS},
                "spread_threshold": _PERCENT,
            },
        },
        "gate": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "latency_threshold": _PERCENT,
                "alpha": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "max_abs_error_increase": _NONNEG,
                "cosine_drop": _NONNEG,
                "top1_drop": _NONNEG,
                "task_accuracy_drop": _NONNEG,
                "fail_on_unstable": {"type": "boolean"},
                "allow_missing": {"type": "boolean"},
                "ignore_isa": {"type": "boolean"},
                "min_judged": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
            },
        },
    },
}


def schema(autocast: bool = True) -> dict[str, Any]:
    """The project file's JSON schema; ``autocast=False`` checks its autocast tables only as tables.

    The autocast keys' schema lives with the autocast options, which import
    torch; ``harness gate`` reads no autocast settings and runs without torch.
    """
    if not autocast:
        return _SCHEMA
    from harness.autocast import options

    model_table = _SCHEMA["properties"]["model"]["additionalProperties"]
    return {
        **_SCHEMA,
        "properties": {
            **_SCHEMA["properties"],
            "autocast": options.SCHEMA,
            "model": {
                **_SCHEMA["properties"]["model"],
                "additionalProperties": {
                    **model_table,
                    "properties": {**model_table["properties"], "autocast": options.SCHEMA},
                },
            },
        },
    }


def __getattr__(name: str) -> Any:
    """``SCHEMA``: the full schema (:func:`schema`), built on first use (it imports torch)."""
    if name == "SCHEMA":
        return schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Project:
    """A validated project file (or none: every getter then returns the defaults' None/empty)."""

    path: Path | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.path.parent if self.path is not None else Path.cwd()

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def setting(self, key: str, given: Any, default: Any = None) -> Any:
        """One setting, resolved as every command resolves it: the flag's value when given (not
        None), else the project file's ``key``, else ``default``."""
        if given is not None:
            return given
        found = self.data.get(key)
        return default if found is None else found

    @overload
    def threads(self, given: int | None, default: int) -> int: ...

    @overload
    def threads(self, given: int | None, default: None) -> int | None: ...

    def threads(self, given: int | None, default: int | None) -> int | None:
        """``--threads`` or the file's ``threads`` (:meth:`setting`), within 1..MAX_THREADS (the file's
        value named as the file's; a flag is checked where it is parsed)."""
        threads = self.setting("threads", given, default)
        if threads is not None and (isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS):
            raise HarnessError(f"{self.where}: threads {threads!r}: valid: 1..{MAX_THREADS}")
        return None if threads is None else int(threads)

    def section(self, key: str) -> dict[str, Any]:
        return dict(self.data.get(key, {}))

    def model_reference(self, ref: str) -> str:
        """A ``file.py:factory`` reference, or a model file (``x.onnx``, ``x.pt2``, ``hf:DIR``),
        made relative to the project's directory."""
        path, sep, factory = ref.rpartition(":")
        if sep and path.endswith(".py") and self.path is not None and not Path(path).is_absolute():
            return f"{self.root / path}:{factory}"
        file, prefix = (ref[3:], "hf:") if ref.startswith("hf:") else (ref, "")
        if (prefix or ref.lower().endswith((".onnx", ".pt2"))) and self.path is not None and not Path(file).is_absolute():
            return f"{prefix}{self.root / file}"
        return ref

    def inputs_table(self, ref: str, name: str | None = None) -> dict[str, Any]:
        """A model file's input keys from its ``[model."<ref>"]`` table (``input_shapes``, ``input_range``,
        ``load_inputs``; the last relative to the project's directory, which the caller joins)."""
        table = self._model_table(ref, name)
        return {k: table[k] for k in ("input_shapes", "input_range", "load_inputs") if k in table}

    def load_model(self, ref: str) -> ModelSpec:
        """The model ``--model REF`` names, as every command loads it from the command line.

        A file in ``ref`` is relative to the current directory, not to the
        project file's (only references written in the file are:
        :meth:`model_reference`), and the file's ``[model."<key>"]`` tables
        are checked against it (:meth:`check_model_tables`), so a table for
        another model is a named error here too.
        """
        from harness import models

        spec = models.load(ref)
        self.check_model_tables({ref: spec.name}, lambda other: models.load(other).name)
        return spec

    def models(self) -> list[str] | None:
        given = self.data.get("models")
        return None if given is None else [self.model_reference(m) for m in given]

    def _matches(self, key: str, ref: str, name: str | None) -> bool:
        """Whether the table ``[model."<key>"]`` is the model ``ref`` (named ``name``).

        A key is a model's reference (a file reference relative to the project
        file's directory; the same file by any path is the same model) or its
        ``ModelSpec`` name (its factory's name), as results name it.
        """
        return key == name or _same_reference(self.model_reference(key), ref)

    def _model_table(self, ref: str, name: str | None = None) -> dict[str, Any]:
        tables = self.data.get("model", {})
        found = [key for key in tables if self._matches(key, ref, name)]
        if len(found) > 1:
            listed = ", ".join(f'[model."{k}"]' for k in found)
            raise HarnessError(f"{self.where}: {listed} all name model {name or ref!r}; keep one table per model")
        return dict(tables[found[0]]) if found else {}

    def check_model_tables(self, used: Mapping[str, str], name_of: Callable[[str], str]) -> None:
        """Refuse a ``[model."<key>"]`` table that names no model configured here or given.

        ``used`` maps the references of the models this command uses to their
        names; the file's own ``models`` count too (a build of one model may
        share the file of a bench of several), named with ``name_of`` only
        when a key matches no reference. A table that matches nothing is a
        typo that would otherwise apply its settings to nothing, silently.
        """
        tables = self.data.get("model", {})
        known: dict[str, str | None] = dict(used)
        for ref in self.models() or []:
            if not any(_same_reference(ref, other) for other in known):
                known[ref] = None
        unmatched = [key for key in tables if not any(self._matches(key, ref, None) for ref in known)]
        if not unmatched:
            return
        names = {ref: name if name is not None else name_of(ref) for ref, name in known.items()}
        unmatched = [key for key in unmatched if key not in names.values()]
        if unmatched:
            valid = ", ".join(sorted({*(self._as_written(ref) for ref in names), *names.values()}))
            raise HarnessError(
                f"{self.where}: [model.\"{unmatched[0]}\"] matches no model configured here or given on the "
                f"command line; a model table is keyed by a model's reference or name: {valid}"
            )

    def _as_written(self, ref: str) -> str:
        """A reference as the file would spell it: relative to the project's directory when inside it."""
        path, sep, factory = ref.rpartition(":")
        if sep and path.endswith(".py") and self.path is not None:
            try:
                return f"{Path(path).resolve().relative_to(self.root.resolve()).as_posix()}:{factory}"
            except ValueError:
                return ref
        return ref

    @property
    def where(self) -> str:
        return f"project file {self.path}"

    def autocast_values(self, ref: str, name: str | None = None) -> dict[str, Any]:
        """The file's autocast keys for a model: the global table, then the model's own."""
        return {**self.section("autocast"), **self._model_table(ref, name).get("autocast", {})}

    def autocast_settings(
        self,
        ref: str,
        cli: Mapping[str, Any],
        name: str | None = None,
        *,
        example_inputs: Sequence[Any] | None = None,
        **fixed: Any,
    ) -> AutocastSettings:
        """Defaults < project file (global, then the model's table) < command line.

        With the model's ``example_inputs``, a calibration file is checked
        against them here, where its path is known: the compiler's own check
        comes later and can only say "calibration batch 0", not which file.
        """
        from harness.autocast import options

        merged = {**self.autocast_values(ref, name), **cli}
        file_paths = {k: v for k, v in merged.items() if k == "calibration_data" and k not in cli}
        settings = options.settings_from({k: v for k, v in merged.items() if k not in file_paths}, **fixed)
        if file_paths:
            calibration = options.settings_from(file_paths, base_dir=self.root).calibration_data
            settings = dataclasses.replace(settings, calibration_data=calibration)
        source = cli.get("calibration_data") or (self.root / file_paths["calibration_data"] if file_paths else None)
        if source is not None and example_inputs is not None and settings.calibration_data is not None:
            from harness.autocast.calibrate import check_calibration_data

            try:
                check_calibration_data(settings.calibration_data, example_inputs)
            except HarnessError as exc:
                raise HarnessError(f"calibration data {source}: {exc}") from None
        return settings

    def explicit_for(self, ref: str, name: str | None = None) -> str | None:
        explicit = self._model_table(ref, name).get("explicit")
        return None if explicit is None else os.fspath(self.root / explicit)

    def to_json(self) -> dict[str, Any]:
        """The file's effective contents, for the results; its path as :func:`portable_path` gives it."""
        return {"file": None if self.path is None else portable_path(self.path), **self.data}


def _same_reference(a: str, b: str) -> bool:
    """Two model references name one model: equal names, or one file (by any path) and factory."""
    if a == b:
        return True
    files = [r[3:] if r.startswith("hf:") else r for r in (a, b)]
    if all(r.startswith("hf:") or r.lower().endswith((".onnx", ".pt2")) for r in (a, b)):
        return a.startswith("hf:") == b.startswith("hf:") and (
            Path(files[0]).expanduser().resolve() == Path(files[1]).expanduser().resolve()
        )
    path_a, sep_a, factory_a = a.rpartition(":")
    path_b, sep_b, factory_b = b.rpartition(":")
    if not (sep_a and sep_b and path_a.endswith(".py") and path_b.endswith(".py")) or factory_a != factory_b:
        return False
    return Path(path_a).expanduser().resolve() == Path(path_b).expanduser().resolve()


def portable_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the current directory when it lies inside it, else absolute.

    Results store paths this way (model files, explicit and calibration
    files, the project file, the cache directory): runs started from the
    root of two checkouts then carry equal settings, so their shards merge.
    """
    absolute = Path(path).expanduser().resolve()
    try:
        return absolute.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return os.fspath(absolute)


def portable_reference(ref: str) -> str:
    """A model reference with its file given by :func:`portable_path` (zoo names unchanged)."""
    path, sep, factory = ref.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{portable_path(path)}:{factory}"
    return ref


def find_project_file(explicit: str | os.PathLike[str] | None = None) -> tuple[Path, tuple[str, ...]] | None:
    """(file, key path of the table) of the project file in use, or None."""
    if explicit is not None:
        path = Path(explicit)
        table = ("tool", "harness") if path.name == "pyproject.toml" else ()
        return path, table
    if Path("harness.toml").is_file():
        return Path("harness.toml").resolve(), ()
    if Path("pyproject.toml").is_file():
        return Path("pyproject.toml").resolve(), ("tool", "harness")
    return None


def load_project(explicit: str | os.PathLike[str] | None = None, *, autocast: bool = True) -> Project:
    """The project of ``--config FILE`` or of the current directory (an empty Project if none).

    ``autocast=False`` (``harness gate``) checks the autocast tables only as
    tables (:func:`schema`): the commands that use them check them in full.
    """
    found = find_project_file(explicit)
    if found is None:
        return Project()
    path, table = found
    where = f"project file {path}"
    try:
        doc: Any = parse_toml_file(path, "project file")
    except HarnessError:
        if explicit is None and table and not _may_configure_harness(path):
            return Project()  # another tool's pyproject.toml, broken: none of the harness's business
        raise
    for key in table:
        if not isinstance(doc, dict) or key not in doc:
            if explicit is None:  # a pyproject.toml without [tool.harness]: no project
                return Project()
            raise HarnessError(f"{where}: no [{'.'.join(table)}] table")
        doc = doc[key]
    where += f" [{'.'.join(table)}]" if table else ""
    check_finite(doc, where, toml_key)
    validate(doc, schema(autocast), where, toml_key)
    return Project(path, doc)


def _may_configure_harness(path: Path) -> bool:
    """Whether a pyproject.toml that does not parse could hold a ``[tool.harness]`` table: any
    spelling of one names ``harness``. One that cannot is another tool's, and is left alone."""
    try:
        return b"harness" in read_regular_file(path, "project file")
    except HarnessError:
        return True  # not readable as a file at all: the reader's own error says why
