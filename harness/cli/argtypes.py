"""``type=`` functions for argparse: a bad flag value fails while the command line is parsed.

Each returns the parsed value or raises :class:`argparse.ArgumentTypeError`
with what would be valid; argparse then prints the usage and ``argument
--flag: <message>`` and exits with code 2, before anything is loaded. The
project file's values are checked by its schema and again where they are
used (:mod:`harness.limits`), with the same ranges.

This module imports nothing but the standard library, :mod:`harness.limits`
and :func:`harness.fileio.shown` (a value echoed cut short): parsers of the
light commands (``gate``) use it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from harness.fileio import shown
from harness.limits import MAX_BATCH_SIZE, MAX_ITERS, MAX_REBUILDS, MAX_THREADS


def _int(text: str, least: int, most: int | None) -> int:
    valid = f"{least}..{most}" if most is not None else f"an integer >= {least}"
    raw = text.strip()
    if not re.fullmatch(r"[+-]?\d{1,12}", raw):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer; valid: {valid}")
    value = int(raw)
    if value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"{value} is out of range; valid: {valid}")
    return value


def int_range(least: int, most: int | None, name: str = "int") -> Callable[[str], int]:
    """An integer in ``least..most`` (``most`` None: no upper bound)."""

    def parse(text: str) -> int:
        return _int(text, least, most)

    parse.__name__ = name
    return parse


threads = int_range(1, MAX_THREADS, "threads")
positive_int = int_range(1, None, "positive_int")
non_negative_int = int_range(0, 1_000_000, "non_negative_int")
iterations = int_range(1, MAX_ITERS, "iterations")
warmup_runs = int_range(0, MAX_ITERS, "warmup_runs")
rebuild_times = int_range(2, MAX_REBUILDS, "rebuild_times")


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected a finite number")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (an accepted drop or growth of an error metric)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected a finite number >= 0")
    return value


def probability(text: str) -> float:
    """A number strictly between 0 and 1 (a significance level)."""
    value = _float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected a number strictly between 0 and 1, e.g. 0.01")
    return value


def seconds(most: float) -> Callable[[str], float]:
    """A number of seconds above 0 and at most ``most``."""

    def parse(text: str) -> float:
        value = _float(text)
        if not 0 < value <= most:
            raise argparse.ArgumentTypeError(f"{shown(text)}: expected a number of seconds above 0 and at most {most:g}")
        return value

    parse.__name__ = "seconds"
    return parse


def threshold_value(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; a bare number of 1 or more is refused as ambiguous.

    Raises ValueError with the reason (without the flag's name, which the caller adds).
    """
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"{shown(text)}: expected a percentage such as 5% or a fraction such as 0.05") from None
    if not math.isfinite(value):
        raise ValueError(f"{shown(text)}: expected a percentage such as 5% or a fraction such as 0.05")
    if not raw.endswith("%") and value >= 1:
        raise ValueError(
            f"{shown(text)}: read as the fraction {value:g}, i.e. {value:.0%}; "
            f"write {raw}% for {raw} percent, or a fraction below 1 such as {value / 100:g}"
        )
    if not 0 <= value < 10:
        raise ValueError(f"{shown(text)}: must be between 0% and 1000%")
    return value


def threshold(text: str) -> float:
    """A percentage or fraction (:func:`threshold_value`), as a ``type=``."""
    try:
        return threshold_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard(text: str) -> tuple[int, int]:
    """``"i/n"`` with 1 <= i <= n: run every n-th case starting at the i-th."""
    match = re.fullmatch(r"\s*(\d{1,9})\s*/\s*(\d{1,9})\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected i/n, e.g. 1/2 (shard i of n, 1-based)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{shown(text)}: need 1 <= i <= n and n >= 1")
    return index, count


# Far above any GPU's graphics clock; the GPU's own list of supported clocks decides (harness.bench.clocks).
MAX_CLOCK_MHZ = 10_000


def lock_clocks(text: str) -> str | int:
    """``base``, ``max`` (harness.bench.clocks.NAMED_CLOCKS) or a clock in MHz (1..MAX_CLOCK_MHZ)."""
    raw = text.strip().lower()
    if raw in ("base", "max"):
        return raw
    try:
        return _int(raw, 1, MAX_CLOCK_MHZ)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{shown(text)}: expected base, max or a clock in MHz (1..{MAX_CLOCK_MHZ}), e.g. 1410"
        ) from None


def batch_sizes(text: str) -> list[int]:
    """``N,N,...``: distinct batch sizes, each within 1..MAX_BATCH_SIZE."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{shown(text)}: give at least one batch size, e.g. 1,8")
    sizes = []
    for part in parts:
        if not part.isdigit() or len(part) > 9:
            raise argparse.ArgumentTypeError(f"{shown(text)}: {shown(part)} is not an integer; valid: 1..{MAX_BATCH_SIZE}")
        size = int(part)
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise argparse.ArgumentTypeError(f"{shown(text)}: {size} is out of range; valid: 1..{MAX_BATCH_SIZE}")
        sizes.append(size)
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{shown(text)}: a batch size appears twice")
    return sizes
