"""Read layer -> cache key -> candidates -> selected tactic out of a VERBOSE TensorRT build log.

The verbose log is the only place TensorRT says which cache key belongs to
which layer and which tactics it evaluated. Per autotuned op it prints::

    Autotuning op NAME(key: 0x<32 hex>): [optional suffix]
    Sorted table of all evaluated tactics:
    tactic_id, cost(in ms), cost/fastest_cost, prediction_correlation, kernel_name, tactic_hash, ...
       3, 0.0112640, 1.00000, 0.50673, sm80_xmma_gemm_..., 0x665ded9abbf88,
    The selected tactic is (tactic hash, cost(in ms)):0x665ded9abbf88,  0.011264

This is not a stable API, so the parser is deliberately forgiving: lines may
carry any logger prefix (``[V] [TRT]``, timestamps), unknown lines are skipped,
table columns are located by the header's names (extra or reordered columns
are fine), and a block that never reaches its selection line is reported in
:attr:`ParsedLog.problems` instead of failing the whole parse.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.cache.timing_cache import CacheEntry, Candidate, normalize_hash
from harness.errors import HarnessError

# The op name may itself contain parentheses ("(Unnamed Layer* 3) [Convolution]"),
# so take everything up to the *first* "(key: 0x...)".
_OP = re.compile(r"Autotuning op (?P<name>.+?)\(key: (?P<key>0x[0-9a-fA-F]+)\)")
_SELECTED = re.compile(
    r"The selected tactic is \(tactic hash, cost\(in ms\)\):\s*(?P<hash>0x[0-9a-fA-F]+)\s*,\s*(?P<time>[^\s,]+)"
)
# A table row starts with an integer tactic id followed by a comma. The
# look-behind keeps digits inside timestamps ("10:22:31,123") from matching.
_ROW_START = re.compile(r"(?<![\w.:/-])\d+\s*,")
_HEX = re.compile(r"^0x[0-9a-fA-F]+$")
_REQUIRED_COLUMNS = ("tactic_id", "cost(in ms)", "kernel_name", "tactic_hash")


@dataclass(frozen=True)
class ParsedLayer:
    """One ``Autotuning op`` block. ``selected_hash`` is None when the block was cut off."""

    layer: str
    key: str
    candidates: tuple[Candidate, ...]
    selected_hash: str | None
    selected_time_ms: float | None
    line: int = 0

    def name_of(self, tactic_hash: str) -> str | None:
        """The kernel name the table gives for ``tactic_hash``, if it lists it."""
        wanted = normalize_hash(tactic_hash)
        return next(
            (c.tactic for c in self.candidates if normalize_hash(c.tactic_hash) == wanted), None
        )

    @property
    def selected_name(self) -> str | None:
        return None if self.selected_hash is None else self.name_of(self.selected_hash)

    def to_entry(self) -> CacheEntry:
        if self.selected_hash is None or self.selected_time_ms is None:
            raise HarnessError(
                f"build log line {self.line}: op {self.layer!r} (key {self.key}) has no selected tactic"
            )
        return CacheEntry(
            key=self.key,
            layer=self.layer,
            tactic=self.selected_name or self.selected_hash,
            tactic_hash=self.selected_hash,
            time_ms=self.selected_time_ms,
            candidates=self.candidates,
        )


@dataclass
class ParsedLog:
    layers: list[ParsedLayer] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def complete(self) -> list[ParsedLayer]:
        return [p for p in self.layers if p.selected_hash is not None]

    def by_key(self) -> dict[str, ParsedLayer]:
        """Complete blocks by lower-case key; a key autotuned twice keeps its last block."""
        return {p.key.lower(): p for p in self.complete()}

    def entries(self) -> list[CacheEntry]:
        return [p.to_entry() for p in self.by_key().values()]


@dataclass
class _Block:
    name: str
    key: str
    line: int
    columns: dict[str, int] | None = None
    candidates: list[Candidate] = field(default_factory=list)

    def finish(self, selected_hash: str | None, selected_time: float | None) -> ParsedLayer:
        return ParsedLayer(
            self.name, self.key, tuple(self.candidates), selected_hash, selected_time, self.line
        )


def _parse_header(line: str) -> dict[str, int] | None:
    names = [c.strip() for c in line[line.index("tactic_id") :].split(",")]
    columns = {name: i for i, name in enumerate(names) if name}
    return columns if all(c in columns for c in _REQUIRED_COLUMNS) else None


def _parse_row(line: str, columns: dict[str, int]) -> Candidate | None:
    start = _ROW_START.search(line)
    if start is None:
        return None
    fields = [f.strip() for f in line[start.start() :].split(",")]
    if len(fields) <= max(columns[c] for c in _REQUIRED_COLUMNS):
        return None
    tactic_hash = fields[columns["tactic_hash"]]
    kernel = fields[columns["kernel_name"]]
    try:
        int(fields[columns["tactic_id"]])
        cost = float(fields[columns["cost(in ms)"]])
    except ValueError:
        return None
    if not _HEX.match(tactic_hash) or not kernel or not math.isfinite(cost) or cost < 0:
        return None
    return Candidate(tactic=kernel, tactic_hash=tactic_hash, time_ms=cost)


def parse_log(text: str) -> ParsedLog:
    """Parse the autotuning blocks of a verbose build log (any logger prefix)."""
    result = ParsedLog()
    block: _Block | None = None
    first_op: dict[str, str] = {}

    def close(done: _Block, selected_hash: str | None, selected_time: float | None) -> None:
        parsed = done.finish(selected_hash, selected_time)
        result.layers.append(parsed)
        if selected_hash is None:
            return
        key = parsed.key.lower()
        if key in first_op:
            result.problems.append(
                f"line {parsed.line}: key {parsed.key} was autotuned again (op {parsed.layer!r}, "
                f"first for op {first_op[key]!r}); the later selection is used"
            )
        else:
            first_op[key] = parsed.layer

    for lineno, line in enumerate(text.splitlines(), start=1):
        op = _OP.search(line)
        if op is not None:
            if block is not None:
                result.problems.append(
                    f"line {block.line}: op {block.name!r} (key {block.key}) ended without "
                    "'The selected tactic is' line; no selection recorded"
                )
                close(block, None, None)
            block = _Block(op["name"].strip(), op["key"], lineno)
            continue
        selected = _SELECTED.search(line)
        if selected is not None:
            if block is None:
                result.problems.append(
                    f"line {lineno}: tactic selection outside an 'Autotuning op' block; ignored"
                )
                continue
            try:
                time_ms = float(selected["time"])
            except ValueError:
                time_ms = math.nan
            if not math.isfinite(time_ms) or time_ms < 0:
                result.problems.append(
                    f"line {lineno}: op {block.name!r}: unreadable selected cost {selected['time']!r}"
                )
                close(block, None, None)
            else:
                close(block, selected["hash"], time_ms)
            block = None
            continue
        if block is None:
            continue
        if "tactic_id" in line and "tactic_hash" in line:
            block.columns = _parse_header(line)
            if block.columns is None:
                result.problems.append(
                    f"line {lineno}: op {block.name!r}: tactic table header lacks one of "
                    f"{', '.join(_REQUIRED_COLUMNS)}; its rows are ignored"
                )
            continue
        if block.columns is not None:
            row = _parse_row(line, block.columns)
            if row is not None:
                block.candidates.append(row)
    if block is not None:
        result.problems.append(
            f"line {block.line}: op {block.name!r} (key {block.key}) has no selection before the "
            "end of the log (truncated?)"
        )
        close(block, None, None)
    return result


def parse_log_file(path: str | os.PathLike[str]) -> ParsedLog:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise HarnessError(f"build log {p}: no such file") from None
    except OSError as exc:
        raise HarnessError(f"build log {p}: cannot read ({exc})") from None
    return parse_log(text)
