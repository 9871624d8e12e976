"""The project file: a team's benchmark configuration, checked in next to its model.

Read from ``--config FILE``, else ``./harness.toml``, else the ``[tool.harness]``
table of ``./pyproject.toml`` (nothing found: no project, defaults apply). It
is TOML read with the standard reader and validated against :data:`SCHEMA`;
an unknown key is an error naming it. Command-line flags override it, and the
effective configuration is stored in every results file.

Example (``harness.toml``; the same keys go under ``[tool.harness]``)::

    models = ["my_model.py:make", "resnet"]
    modes = ["fp32", "autocast-bf16", "amp-bf16"]
    backend = "cpu"
    threads = 1
    batch_sizes = [1, 8]

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
the project file's directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.autocast import options
from harness.autocast.settings import AutocastSettings
from harness.errors import HarnessError
from harness.fileio import parse_toml_file, validate

_PERCENT = {"anyOf": [{"type": "string", "pattern": r"^\s*[0-9.]+\s*%?\s*$"}, {"type": "number", "minimum": 0}]}
_NONNEG = {"type": "number", "minimum": 0}

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "models": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        "modes": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        "backend": {"type": "string"},
        "threads": {"type": "integer", "minimum": 1, "maximum": 1024},
        "batch_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "cache_dir": {"type": "string", "minLength": 1},
        "autocast": options.SCHEMA,
        "model": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"autocast": options.SCHEMA, "explicit": {"type": "string", "minLength": 1}},
            },
        },
        "timing": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "warmup_s": _NONNEG,
                "min_iters": {"type": "integer", "minimum": 1},
                "min_duration_s": _NONNEG,
                "max_iters": {"type": "integer", "minimum": 1},
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
            },
        },
    },
}


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

    def section(self, key: str) -> dict[str, Any]:
        return dict(self.data.get(key, {}))

    def model_reference(self, ref: str) -> str:
        """A ``file.py:factory`` reference of the file made relative to the project's directory."""
        path, sep, factory = ref.rpartition(":")
        if sep and path.endswith(".py") and self.path is not None and not Path(path).is_absolute():
            return f"{self.root / path}:{factory}"
        return ref

    def models(self) -> list[str] | None:
        given = self.data.get("models")
        return None if given is None else [self.model_reference(m) for m in given]

    def _model_table(self, ref: str, name: str | None = None) -> dict[str, Any]:
        tables = self.data.get("model", {})
        for key in (ref, name):
            if key is not None and key in tables:
                return dict(tables[key])
        resolved = {self.model_reference(k): v for k, v in tables.items()}
        return dict(resolved.get(ref, {}))

    def autocast_values(self, ref: str, name: str | None = None) -> dict[str, Any]:
        """The file's autocast keys for a model: the global table, then the model's own."""
        return {**self.section("autocast"), **self._model_table(ref, name).get("autocast", {})}

    def autocast_settings(
        self, ref: str, cli: Mapping[str, Any], name: str | None = None, **fixed: Any
    ) -> AutocastSettings:
        """Defaults < project file (global, then the model's table) < command line."""
        merged = {**self.autocast_values(ref, name), **cli}
        file_paths = {k: v for k, v in merged.items() if k == "calibration_data" and k not in cli}
        settings = options.settings_from({k: v for k, v in merged.items() if k not in file_paths}, **fixed)
        if file_paths:
            calibration = options.settings_from(file_paths, base_dir=self.root).calibration_data
            settings = AutocastSettings(**{**_fields(settings), "calibration_data": calibration})
        return settings

    def explicit_for(self, ref: str, name: str | None = None) -> str | None:
        explicit = self._model_table(ref, name).get("explicit")
        return None if explicit is None else os.fspath(self.root / explicit)

    def to_json(self) -> dict[str, Any]:
        return {"file": None if self.path is None else os.fspath(self.path), **self.data}


def _fields(settings: AutocastSettings) -> dict[str, Any]:
    names = (
        "low_precision_type", "nodes_to_exclude", "targets_to_exclude", "nodes_to_include",
        "targets_to_include", "data_max", "init_max", "max_depth_of_reduction",
        "calibration_data", "keep_io_types", "custom_rules",
    )  # fmt: skip
    return {n: getattr(settings, n) for n in names}


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


def load_project(explicit: str | os.PathLike[str] | None = None) -> Project:
    """The project of ``--config FILE`` or of the current directory (an empty Project if none)."""
    found = find_project_file(explicit)
    if found is None:
        return Project()
    path, table = found
    where = f"project file {path}"
    doc: Any = parse_toml_file(path, "project file")
    for key in table:
        if not isinstance(doc, dict) or key not in doc:
            if explicit is None:  # a pyproject.toml without [tool.harness]: no project
                return Project()
            raise HarnessError(f"{where}: no [{'.'.join(table)}] table")
        doc = doc[key]
    where += f" [{'.'.join(table)}]" if table else ""
    validate(doc, SCHEMA, where)
    return Project(path, doc)
