"""Read the autotuned ops, their candidates and (with an editable cache) their keys out of a VERBOSE build log.

The verbose log is the only place TensorRT says which tactics it measured for
which op, and, when the editable timing cache is on, which cache key an op
has and which tactic it kept. Two kinds of block carry that (real output:
tests/data/trt)::

    Autotuning op matMul1(key: 0x1814870c44ff0f8574df6e3dda04cbd7):
    Sorted table of all evaluated tactics:
    tactic_id, cost(in ms), cost/fastest_cost, prediction_correlation, kernel_name, tactic_hash, tunable_parameter
       3, 0.0112640, 1.00000, 0.50673, sm80_xmma_gemm_..., 0x665ded9abbf88,
    The selected tactic is (tactic hash, cost(in ms)):0x665ded9abbf88,  0.011264

Without the editable cache the same table is printed, but the op line has no
``(key: ...)`` and there is no selection line; Myelin ops then name the ONNX
nodes they implement instead (``(foreignNode) Autotuning op node_linear:
[ONNX Layer: node_linear][ONNX Layer: node_relu_2]``). Cask layers (plain
convolutions, poolings) are timed in ``Computing costs for NAME`` blocks of
``Tactic Name: K Tactic: 0x... Time: T`` lines, or answered from the cache
(``got cached result: ..., tactic 0x..., T ms``); their NAME is the engine
layer's name.

This is not a stable API, so the parser is forgiving: lines may carry any
logger prefix, unknown lines are skipped, table columns are located by the
header's names (extra or reordered columns are fine), and anything it cannot
make sense of is reported in :attr:`ParsedLog.problems` instead of failing the
whole parse.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace

from harness.cache.timing_cache import CacheEntry, Candidate, normalize_hash
from harness.errors import HarnessError
from harness.fileio import read_text_file

# The op name may itself contain parentheses ("(Unnamed Layer* 3) [Convolution]"),
# so the name ends at the *first* "(key: 0x...)", or at the ":" before the ONNX layers.
_OP = re.compile(
    r"Autotuning op (?P<name>.+?)(?:\(key: (?P<key>0x[0-9a-fA-F]+)\))?:[ \t]*(?P<meta>\[ONNX Layer: .*)?$"
)
_SELECTED = re.compile(
    r"The selected tactic is \(tactic hash, cost\(in ms\)\):\s*(?P<hash>0x[0-9a-fA-F]+)\s*,\s*(?P<time>[^\s,]+)"
)
# A table row starts with an integer tactic id followed by a comma. The
# look-behind keeps digits inside timestamps ("10:22:31,123") from matching.
_ROW_START = re.compile(r"(?<![\w.:/-])\d+\s*,")
_HEX = re.compile(r"^0x[0-9a-fA-F]+$")
_REQUIRED_COLUMNS = ("tactic_id", "cost(in ms)", "kernel_name", "tactic_hash")
_COSTS = re.compile(r"=+ Computing (?P<reformat>reformatting )?costs(?: for (?P<name>.+))?$")
_CASK_TACTIC = re.compile(
    r"(?:Tactic Name: (?P<kernel>\S+) )?(?<!Fastest )Tactic: (?P<hash>0x[0-9a-fA-F]+) Time: (?P<time>[0-9.eE+-]+)\s*$"
)
_CACHED = re.compile(r"got cached result: [^,]*, tactic (?P<hash>0x[0-9a-fA-F]+), (?P<time>[0-9.eE+-]+) ms")
# "[ONNX Layer: a][ONNX Layer: b]": the separators between entries are "" in logs
# and \x1e or \x1f in the inspector's Metadata. A name ends at the "]" that is
# followed by the next entry or the end, so names may contain brackets.
_ONNX_LAYER = re.compile(r"\[ONNX Layer: (.*?)\](?=[\x1e\x1f\s]*(?:\[ONNX Layer: |$))")
_FOREIGN_NODE = "{ForeignNode["


def log_lines(text: str) -> list[str]:
    """Lines split at newlines only: str.splitlines() also splits at the \x1e and \x1f that
    separate the ``[ONNX Layer: ...]`` entries of inspector Metadata."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def onnx_layers(text: str) -> tuple[str, ...]:
    """The ONNX node names of a ``[ONNX Layer: ...]`` list (log op lines, inspector Metadata)."""
    return tuple(_ONNX_LAYER.findall(text.strip()))


@dataclass(frozen=True)
class ParsedLayer:
    """One autotuned op of the log.

    ``key`` is None when the log has none (no editable cache, or a Cask
    layer); ``selected_hash`` is None when the log prints no selection for
    it. ``onnx_layers`` are the ONNX nodes the log says the op implements.
    """

    layer: str
    key: str | None
    candidates: tuple[Candidate, ...]
    selected_hash: str | None
    selected_time_ms: float | None
    line: int = 0
    onnx_layers: tuple[str, ...] = ()
    from_cache: bool = False  # every candidate was answered from the timing cache, none timed

    def name_of(self, tactic_hash: str) -> str | None:
        """The kernel name the table gives for ``tactic_hash``, if it lists it."""
        wanted = normalize_hash(tactic_hash)
        return next(
            (c.tactic for c in self.candidates if normalize_hash(c.tactic_hash) == wanted), None
        )

    @property
    def selected_name(self) -> str | None:
        return None if self.selected_hash is None else self.name_of(self.selected_hash)

    @property
    def fastest(self) -> Candidate | None:
        """The fastest measured candidate (the first of the fastest, in log order)."""
        return min(self.candidates, key=lambda c: c.time_ms, default=None)

    def to_entry(self) -> CacheEntry:
        if self.key is None or self.selected_hash is None or self.selected_time_ms is None:
            raise HarnessError(
                f"build log line {self.line}: op {self.layer!r} has no "
                + ("timing-cache key" if self.key is None else f"selected tactic (key {self.key})")
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
        """Ops with a key and a selected tactic (editable timing cache)."""
        return [p for p in self.layers if p.key is not None and p.selected_hash is not None]

    def by_key(self) -> dict[str, ParsedLayer]:
        """Complete blocks by lower-case key; a key autotuned twice keeps its last block."""
        return {str(p.key).lower(): p for p in self.complete()}

    def entries(self) -> list[CacheEntry]:
        return [p.to_entry() for p in self.by_key().values()]

    def keyless(self) -> list[ParsedLayer]:
        """Ops the log names without a cache key: their tactic can be read, not pinned."""
        return [p for p in self.layers if p.key is None]


@dataclass
class _Block:
    name: str
    key: str | None
    line: int
    onnx_layers: tuple[str, ...]
    columns: dict[str, int] | None = None
    candidates: list[Candidate] = field(default_factory=list)

    def finish(self, selected_hash: str | None, selected_time: float | None) -> ParsedLayer:
        return ParsedLayer(
            self.name,
            self.key,
            tuple(self.candidates),
            selected_hash,
            selected_time,
            self.line,
            self.onnx_layers,
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


def _time(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class _CaskOps:
    """``Computing costs for NAME`` blocks, merged by name, in order of first appearance."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.lines: dict[str, int] = {}
        self.candidates: dict[str, list[Candidate]] = {}
        self.timed: set[str] = set()  # ops with at least one tactic timed (not a cached result)
        self.kernels: dict[str, str] = {}  # normalized hash -> kernel name, from any Cask line

    def start(self, name: str | None, lineno: int) -> None:
        # Reformatting and Myelin (ForeignNode) blocks are no ops of their own: a
        # reformat has no engine layer of that name, and a ForeignNode's ops are its
        # "Autotuning op" blocks.
        if name is None or name.startswith(_FOREIGN_NODE):
            self.current = None
            return
        self.current = name
        self.lines.setdefault(name, lineno)
        self.candidates.setdefault(name, [])

    def add(self, tactic_hash: str, time_ms: float, kernel: str | None, cached: bool) -> None:
        if kernel:
            self.kernels[normalize_hash(tactic_hash)] = kernel
        if self.current is not None:
            self.candidates[self.current].append(Candidate(kernel or tactic_hash, tactic_hash, time_ms))
            if not cached:
                self.timed.add(self.current)

    def ops(self) -> list[ParsedLayer]:
        """One op per name; a tactic answered from the cache is named after a timed line of it."""
        ops = []
        for name, found in self.candidates.items():
            named = tuple(
                replace(c, tactic=self.kernels.get(normalize_hash(c.tactic_hash), c.tactic))
                for c in found
            )
            cached = bool(found) and name not in self.timed
            ops.append(ParsedLayer(name, None, named, None, None, self.lines[name], from_cache=cached))
        return ops


def parse_log(text: str) -> ParsedLog:
    """Parse the autotuned ops of a verbose build log (any logger prefix)."""
    result = ParsedLog()
    tables: list[ParsedLayer] = []
    block: _Block | None = None
    cask = _CaskOps()
    first_op: dict[str, str] = {}

    def close(done: _Block, selected_hash: str | None, selected_time: float | None) -> None:
        parsed = done.finish(selected_hash, selected_time)
        tables.append(parsed)
        if selected_hash is None or parsed.key is None:
            return
        key = parsed.key.lower()
        if key in first_op:
            result.problems.append(
                f"line {parsed.line}: key {parsed.key} was autotuned again (op {parsed.layer!r}, "
                f"first for op {first_op[key]!r}); the later selection is used"
            )
        else:
            first_op[key] = parsed.layer

    def unselected(done: _Block) -> None:
        if done.key is not None:
            result.problems.append(
                f"line {done.line}: op {done.name!r} (key {done.key}) ended without "
                "'The selected tactic is' line; no selection recorded"
            )
        close(done, None, None)

    for lineno, line in enumerate(log_lines(text), start=1):
        op = _OP.search(line)
        if op is not None:
            if block is not None:
                unselected(block)
            block = _Block(op["name"].strip(), op["key"], lineno, onnx_layers(op["meta"] or ""))
            continue
        costs = _COSTS.search(line)
        if costs is not None:
            cask.start(None if costs["reformat"] else (costs["name"] or "").strip() or None, lineno)
            continue
        timed = _CASK_TACTIC.search(line) or _CACHED.search(line)
        if timed is not None:
            time_ms = _time(timed["time"])
            if time_ms is not None:
                cask.add(timed["hash"], time_ms, timed.groupdict().get("kernel"), timed.re is _CACHED)
            continue
        selected = _SELECTED.search(line)
        if selected is not None:
            if block is None:
                result.problems.append(
                    f"line {lineno}: tactic selection outside an 'Autotuning op' block; ignored"
                )
                continue
            time_ms = _time(selected["time"])
            if time_ms is None:
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
            elif block.candidates:
                block.columns = None  # the table ended
    if block is not None:
        if block.key is not None:
            result.problems.append(
                f"line {block.line}: op {block.name!r} (key {block.key}) has no selection before "
                "the end of the log (truncated?)"
            )
        close(block, None, None)
    result.layers = sorted([*tables, *cask.ops()], key=lambda p: p.line)
    if result.layers and not any(p.key is not None for p in result.layers):
        result.problems.append(
            f"none of the log's {len(result.layers)} autotuned op(s) carries a timing-cache key or a "
            "selected tactic: TensorRT (10.8+) prints them only with the editable timing cache "
            "(BuilderFlag.EDITABLE_TIMING_CACHE, trtexec --editableTimingCache), so no tactic can be "
            "recorded or pinned from this build; per-layer tactics come from the engine inspector"
        )
    return result


def parse_log_file(path: str | os.PathLike[str]) -> ParsedLog:
    return parse_log(read_text_file(path, "build log"))
