"""Compiler settings, validated up front, defined once for every command.

Everything the user can get wrong (a regex that does not compile, an op name
that does not exist, a dtype that is not a low-precision float, a threshold
that is not a positive number) is caught here, before export or calibration
spends any time, with a message that names the setting and what is valid.

The same :class:`AutocastSettings` travels from the CLI flags or the project
file through :class:`harness.engines.protocol.BuildConfig` to the compiler;
its canonical JSON (:meth:`AutocastSettings.to_json`) and digest go into the
timing-cache provenance, the engine fingerprint and the results, so an engine
or cache made under other settings is never taken for this one.

A threshold of ``None`` turns its rule off (on the command line: ``off``);
0, negative numbers, NaN and infinity are refused everywhere.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.dtypes import EXPLICIT_DTYPES, LOW_DTYPES, dtype_name, with_torch_names
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest, read_regular_file
from harness.limits import MAX_CALIBRATION_BATCHES
from harness.opnames import resolve_op_names

# What the settings accept for a dtype: the short name or torch's spelling ("fp16", "float16").
LOW_PRECISION_TYPES = with_torch_names(LOW_DTYPES)
EXPLICIT_TYPES = with_torch_names(EXPLICIT_DTYPES)

# Defaults of the rule policy's settings (Torch-TensorRT's, and fp16's largest finite value).
DEFAULT_LOW_PRECISION_TYPE = "fp16"
DEFAULT_DATA_MAX = 512.0
DEFAULT_INIT_MAX = 65504.0
DEFAULT_MAX_DEPTH_OF_REDUCTION: int | None = None
DEFAULT_KEEP_IO_TYPES = True

# A custom rule sees the node and the compile context and returns a reason to
# keep the node in fp32, or None to let the remaining rules decide.
CustomRule = Callable[[torch.fx.Node, Any], "str | None"]


def parse_dtype(value: str | torch.dtype, what: str, allowed: Mapping[str, torch.dtype] = LOW_PRECISION_TYPES) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in allowed.values():
            return value
    elif value in allowed:
        return allowed[value]
    valid = ", ".join(sorted(allowed))
    raise HarnessError(f"{what}: unknown dtype {value!r}; valid: {valid}")


def compile_patterns(patterns: Iterable[str], what: str) -> tuple[re.Pattern[str], ...]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise HarnessError(f"{what}: invalid regular expression {p!r}: {exc}") from None
    return tuple(out)


def _threshold(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HarnessError(f"{what} must be a positive finite number, or None (off), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AutocastSettings:
    """The rule policy's settings (Torch-TensorRT's rule-based autocast options), plus ``keep_io_types`` and custom rules."""

    low_precision_type: torch.dtype | str = DEFAULT_LOW_PRECISION_TYPE
    nodes_to_exclude: Sequence[str] = ()
    targets_to_exclude: Sequence[str] = ()
    nodes_to_include: Sequence[str] = ()
    targets_to_include: Sequence[str] = ()
    data_max: float | None = DEFAULT_DATA_MAX
    init_max: float | None = DEFAULT_INIT_MAX
    max_depth_of_reduction: int | None = DEFAULT_MAX_DEPTH_OF_REDUCTION
    calibration_data: Sequence[Sequence[torch.Tensor]] | None = None
    keep_io_types: bool = DEFAULT_KEEP_IO_TYPES
    custom_rules: Sequence[CustomRule] = ()
    # With keep_io_types: the last layers run fp32 where that costs no cast (rules.OutputLayer).
    fp32_output_tail: bool = True
    # Lowered linears and convolutions: the mean output shift their rounded weights cause on the
    # calibration data is taken out of their bias (harness.autocast.bias_correction).
    bias_correction: bool = True
    # derived, validated forms
    low: torch.dtype = field(init=False)
    exclude_patterns: tuple[re.Pattern[str], ...] = field(init=False)
    include_patterns: tuple[re.Pattern[str], ...] = field(init=False)
    exclude_targets: frozenset[str] = field(init=False)
    include_targets: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "low", parse_dtype(self.low_precision_type, "low_precision_type"))
        # Sets in effect: sorted and deduplicated, so that `--exclude a --exclude b`,
        # `--exclude b --exclude a` and a Python set (whose order follows PYTHONHASHSEED)
        # are one setting with one digest. Order never changes a decision: a node
        # matching any pattern is excluded (included); the first match in this
        # order only names the pattern in the report's reason. custom_rules keep
        # the user's order: the first rule that answers names the report's rule.
        for name in _SET_FIELDS:
            set_(self, name, _canonical(getattr(self, name), name))
        set_(self, "exclude_patterns", compile_patterns(self.nodes_to_exclude, "nodes_to_exclude"))
        set_(self, "include_patterns", compile_patterns(self.nodes_to_include, "nodes_to_include"))
        set_(self, "exclude_targets", frozenset(_ops(self.targets_to_exclude, "targets_to_exclude")))
        set_(self, "include_targets", frozenset(_ops(self.targets_to_include, "targets_to_include")))
        set_(self, "data_max", _threshold(self.data_max, "data_max"))
        set_(self, "init_max", _threshold(self.init_max, "init_max"))
        depth = self.max_depth_of_reduction
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0):
            raise HarnessError(f"max_depth_of_reduction must be a positive integer or None, got {depth!r}")
        for flag in ("keep_io_types", "fp32_output_tail", "bias_correction"):
            if not isinstance(getattr(self, flag), bool):
                raise HarnessError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        for rule in self.custom_rules:
            if not callable(rule):
                raise HarnessError(f"custom_rules: {rule!r} is not callable (expected f(node, context) -> reason or None)")

    def to_json(self) -> dict[str, Any]:
        """The settings as canonical JSON: what the digest covers and a reader can compare.

        Calibration data is represented by a digest of its tensors, custom
        rules by their qualified names (a rule's code cannot be digested).
        """
        return {
            "low_precision_type": dtype_name(self.low),
            "nodes_to_exclude": list(self.nodes_to_exclude),
            "targets_to_exclude": sorted(self.exclude_targets),
            "nodes_to_include": list(self.nodes_to_include),
            "targets_to_include": sorted(self.include_targets),
            "data_max": self.data_max,
            "init_max": self.init_max,
            "max_depth_of_reduction": self.max_depth_of_reduction,
            "keep_io_types": self.keep_io_types,
            "fp32_output_tail": self.fp32_output_tail,
            "bias_correction": self.bias_correction,
            "calibration_data": None if self.calibration_data is None else _tensors_digest(self.calibration_data),
            "custom_rules": [f"{getattr(r, '__module__', '?')}.{getattr(r, '__qualname__', repr(r))}" for r in self.custom_rules],
        }

    def digest(self) -> str:
        return digest(canonical_json(self.to_json()))


def _tensors_digest(batches: Sequence[Sequence[torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for t in batch:
            c = t.detach().contiguous()
            h.update(f"{c.dtype}{tuple(c.shape)};".encode())
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def load_calibration_file(path: str | os.PathLike[str]) -> list[tuple[torch.Tensor, ...]]:
    """Calibration batches from a safetensors file (``--calibration-data``).

    The file holds one tensor per model input, named ``input0``, ``input1``,
    ..., each with one more leading dimension than the input: the batches,
    stacked. (safetensors, not pickle: the file may come from anyone.)
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = f"calibration data {os.fspath(path)}"
    data = read_regular_file(path, "calibration data", limit=1 << 32)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise HarnessError(f"{where}: not a safetensors file ({exc})") from None
    names = [f"input{i}" for i in range(len(tensors))]
    if sorted(tensors) != sorted(names) or not tensors:
        raise HarnessError(
            f"{where}: expected tensors named input0, input1, ... (one per model input, the batches "
            f"stacked on a new first dimension); found {', '.join(sorted(tensors)) or 'none'}"
        )
    counts = {tensors[n].shape[0] if tensors[n].dim() else 0 for n in names}
    if len(counts) != 1 or 0 in counts:
        raise HarnessError(f"{where}: every input must hold the same number (>= 1) of batches on dimension 0")
    (count,) = counts
    if count > MAX_CALIBRATION_BATCHES:  # empty batches cost no bytes, but each is a model run
        raise HarnessError(f"{where}: {count} batches; valid: 1..{MAX_CALIBRATION_BATCHES}")
    return [tuple(tensors[n][b].clone() for n in names) for b in range(count)]


_SET_FIELDS = ("nodes_to_exclude", "targets_to_exclude", "nodes_to_include", "targets_to_include")


def _canonical(values: Iterable[str], what: str) -> tuple[str, ...]:
    """``values`` sorted and deduplicated: the order of flags or of a set's iteration is no setting."""
    return tuple(sorted(set(_strings(values, what))))


def _strings(values: Iterable[str], what: str) -> list[str]:
    if isinstance(values, str):
        raise HarnessError(f"{what} must be a collection of strings, not a single string {values!r}")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise HarnessError(f"{what}: {v!r} is not a string")
    return out


def _ops(values: Iterable[str], what: str) -> set[str]:
    try:
        return resolve_op_names(_strings(values, what))
    except HarnessError as exc:
        raise HarnessError(f"{what}: {exc}") from None
