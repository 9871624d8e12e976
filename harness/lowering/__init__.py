"""Lowering: passes that rewrite an FX graph into the form later stages expect."""

from harness.lowering.pass_manager import (
    GraphPass,
    PassManager,
    default_pass_manager,
    register_pass,
)

__all__ = ["GraphPass", "PassManager", "default_pass_manager", "register_pass"]
