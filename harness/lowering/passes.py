"""Every lowering pass, registered: importing this module imports each pass module."""

from __future__ import annotations

from harness.lowering import (  # noqa: F401  (each registers its passes on import)
    fold_batch_norm,
    functionalize,
    layout,
    remove_asserts,
    remove_detach,
    remove_dropout,
)
from harness.lowering.registry import GraphPass, registered


def registered_passes() -> dict[str, GraphPass]:
    """Every lowering pass by name."""
    return registered()
