"""Fresh names: the one way the harness picks a name that is not taken yet."""

from __future__ import annotations

from collections.abc import Callable


def fresh_name(base: str, taken: Callable[[str], bool], sep: str = "_") -> str:
    """``base`` if ``taken(base)`` is false, else the first free ``base{sep}1``, ``base{sep}2``, ...

    ``taken`` answers whether a name is in use (``names.__contains__`` for a
    set, ``lambda n: hasattr(module, n)`` for a module's attributes). ``sep``
    is part of names already saved (ONNX node names use ``#``), so callers
    keep theirs.
    """
    name, i = base, 1
    while taken(name):
        name, i = f"{base}{sep}{i}", i + 1
    return name
