"""One exception type for every user-facing failure.

Anything the user can fix (a bad flag, a corrupt file, a model that does not
export) raises :class:`HarnessError` with a message that names the culprit and
says what would be valid. The command line turns it into ``error: ...`` on
stderr and exit code 2; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HarnessError(Exception):
    """A failure caused by input the user can correct."""

    exit_code = 2


class StaticBatchError(HarnessError):
    """The typed graph fixes its batch size, so no engine can serve other sizes with it.

    Raised by the ONNX hand-off; defined here so that code catching it (the
    bench runner) does not import the ONNX exporter, an optional extra.
    """


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name if it has none): what a one-line
    error about a failing third-party call quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
