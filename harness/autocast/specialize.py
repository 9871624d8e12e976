"""A drop-in module that behaves like the eager one in every autocast state.

Specialisation on the ambient autocast state (docs/design.md, "Autocast
compiler"): statically typed graphs are only right for the autocast
state they were compiled for, so the module looks at the caller's autocast
state on every call and runs the AMP specialization compiled for that state.
Specializations are compiled lazily on first use and cached; the model's own
``torch.autocast`` regions are applied inside each one. This is for eager
users; engines take the fixed graphs from :func:`harness.autocast.compile`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.export import ExportedProgram

from harness.autocast.amp_lists import check_amp_table
from harness.autocast.compiler import CompiledGraph, compile
from harness.frontend.export import export_program
from harness.globalstate import preserves_global_state

StateKey = tuple[bool, torch.dtype | None, bool]


class AutocastModule(torch.nn.Module):
    # Export runs the model's forward, which may reseed, pin threads or switch
    # grad mode: construction leaves the caller's process as it found it.
    @preserves_global_state
    def __init__(
        self,
        module: torch.nn.Module,
        example_inputs: Sequence[torch.Tensor],
        device: str = "cpu",
        *,
        program: ExportedProgram | None = None,
    ) -> None:
        super().__init__()
        check_amp_table(device)  # every specialization has the amp policy: refused now, not at the first call
        if program is None:
            with torch.autocast(device, enabled=False):
                program = export_program(module, example_inputs)
        self._program = program
        self._examples = tuple(example_inputs)
        self._device = device
        self.specializations: dict[StateKey, CompiledGraph] = {}

    def state(self) -> StateKey:
        """The caller's autocast state for this module's device, and whether inference mode is on."""
        inference = torch.is_inference_mode_enabled()
        if not torch.is_autocast_enabled(self._device):
            return (False, None, inference)
        return (True, torch.get_autocast_dtype(self._device), inference)

    def specialization(self, key: StateKey) -> CompiledGraph:
        if key not in self.specializations:
            enabled, dtype, inference = key
            self.specializations[key] = compile(
                self._program,
                self._examples,
                policy="amp",
                low_precision_type=dtype or torch.get_autocast_dtype(self._device),
                amp_enabled=enabled,
                inference_mode=inference,
                device=self._device,
            )
        return self.specializations[key]

    @preserves_global_state
    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.specialization(self.state())(*inputs)


def jit(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    device: str = "cpu",
    *,
    program: ExportedProgram | None = None,
) -> AutocastModule:
    """Wrap ``module`` so that it follows the caller's autocast state exactly.

    Neither wrapping nor calling changes the caller's global state or the
    module's ``training`` flags (see :class:`AutocastModule`).

    ``program``, if given, is compiled instead of a new export of ``module``, so
    one export can serve several wrappers. It must be what the wrapper would make:
    :func:`~harness.frontend.export.export_program` of this ``module`` on
    ``example_inputs``, outside any autocast region (not checked).
    """
    return AutocastModule(module, example_inputs, device, program=program)
