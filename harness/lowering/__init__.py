"""Lowering: passes that rewrite an FX graph into the form later stages expect.

Each pass lives in its own module, registers itself under a name, and returns
torch's ``PassResult(graph_module, modified)``; :class:`PassManager` runs them
in order, validates the graph after each, logs one DEBUG line per pass and can
dump the graph after chosen passes (``HARNESS_DUMP_GRAPH``).
"""

from harness.lowering.pass_manager import (
    GraphPass,
    PassManager,
    PassResult,
    default_pass_manager,
    register_pass,
    registered_passes,
)

__all__ = ["GraphPass", "PassManager", "PassResult", "default_pass_manager", "register_pass", "registered_passes"]
