"""Upper bounds of every count and duration a user can ask for.

Each is generous (far beyond any useful run) but finite: an unbounded value
does not fail, it hangs the command for days or is killed for memory after
a long run (``--batch-sizes 100000000``, ``max_iters = 10**19``,
``min_duration_s = 1e9``). The project file's schema, the measurement
settings and the command-line flags all check against these, so a value is
refused up front with the same "valid: 1..N" range wherever it is given.
"""

from __future__ import annotations

from harness.errors import HarnessError

# A batch of 4096 of the zoo's largest inputs (3x224x224 fp32) is 2.4 GB.
MAX_BATCH_SIZE = 4096
# Builds of one model compared by `harness rebuild`; each is a full build.
MAX_REBUILDS = 100
# Seconds of warm-up, and of timing, per case (an hour each).
MAX_WARMUP_S = 3600.0
MAX_MIN_DURATION_S = 3600.0
# Timed iterations per case: every raw sample is stored in the results file,
# and a million samples (about 10 MB of JSON) keep a whole run within what the
# results reader accepts (fileio.MAX_JSON_BYTES).
MAX_ITERS = 1_000_000
# Batches of a calibration file: each is a run of the model during compilation.
MAX_CALIBRATION_BATCHES = 10_000
# Intra-op threads of a run (torch, ONNX Runtime, OpenVINO).
MAX_THREADS = 1024


def check_int(value: object, name: str, least: int, most: int) -> int:
    """``value`` as an integer in ``least..most``; else one error naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise HarnessError(f"{name} {value!r}: valid: {least}..{most}")
    return value


def check_seconds(value: object, name: str, most: float) -> float:
    """``value`` as a finite number of seconds in ``0..most`` (NaN and infinity refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
        raise HarnessError(f"{name} {value!r}: valid: 0..{most:g} seconds")
    return float(value)
