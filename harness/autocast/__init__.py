"""The autocast compiler: typed FX graphs with a reason for every precision."""

from harness.autocast.compiler import CompiledGraph, compile
from harness.autocast.settings import AutocastSettings
from harness.autocast.specialize import AutocastModule, jit

__all__ = ["AutocastModule", "AutocastSettings", "CompiledGraph", "compile", "jit"]
