"""The OpenVINO properties an engine is compiled with: what decides its kernels and precisions.

Every property is set explicitly, never left to OpenVINO's defaults, because
the defaults depend on the machine: on a CPU with AMX or AVX512-BF16,
OpenVINO's default ``INFERENCE_PRECISION_HINT`` is ``bf16``, so an fp32 model
would silently run in bf16 there and in f32 elsewhere.

* ``INFERENCE_PRECISION_HINT``: ``f32`` for fp32 and for every strongly typed
  mode (OpenVINO then runs each op in the type the graph gives it, so the
  compiler's ``Convert`` nodes decide); ``f16``/``bf16`` for the weak modes,
  where OpenVINO lowers the fp32 graph itself, keeping in f32 what it deems
  precision-sensitive (the CPU counterpart of TensorRT's weak typing).
* ``INFERENCE_NUM_THREADS``: the build's thread count, OpenVINO's own pool
  (the caller's torch thread count is never touched).
* one stream, latency hint, no CPU pinning (the harness measures on shared
  machines next to other engines), and dynamic quantization off (it would
  quantize activations of fully connected layers behind the graph's back).

The same settings are recorded in the engine's plan and in the timing-cache
provenance, so an engine or a cache made under other settings is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema
from pydantic.dataclasses import dataclass

from harness.documents import DOCUMENT, OneOf, document_json
from harness.engines.openvino.runtime import ov_type_name
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.limits import MAX_THREADS
from harness.precision import PrecisionMode

PRECISION_HINTS = ("f32", "f16", "bf16")
# The fixed part of every engine's properties (see the module docstring for why).
FIXED_PROPERTIES: dict[str, Any] = {
    "NUM_STREAMS": 1,
    "PERFORMANCE_HINT": "LATENCY",
    "EXECUTION_MODE_HINT": "PERFORMANCE",
    "ENABLE_CPU_PINNING": False,
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
}


def hint_for(mode: PrecisionMode) -> str:
    """The precision hint of ``mode``: the low type for weak modes, else ``f32`` (follow the graph)."""
    return ov_type_name(mode.low) if mode.weak and mode.low is not None else "f32"


@dataclass(frozen=True, config=DOCUMENT)
class CompileSettings:
    """The properties of one compiled model (see the module docstring), as engine plans store
    them: the two that vary, then ``fixed``, always :data:`FIXED_PROPERTIES`."""

    inference_precision_hint: Annotated[str, OneOf(PRECISION_HINTS)]
    inference_num_threads: Annotated[int, Field(ge=1, le=MAX_THREADS)]
    fixed: Annotated[dict[str, Any], WithJsonSchema({"const": FIXED_PROPERTIES})] = (
        dataclasses.field(default_factory=lambda: dict(FIXED_PROPERTIES))
    )

    @classmethod
    def for_build(cls, config: BuildConfig) -> CompileSettings:
        """The settings ``config`` asks for; builder options are refused (there are none to set)."""
        if config.options:
            raise HarnessError(
                f"backend openvino takes no builder options (got {', '.join(sorted(config.options))}): "
                "its precision follows the mode and its threads follow --threads"
            )
        threads = config.thread_count()
        if not 1 <= threads <= MAX_THREADS:
            raise HarnessError(f"openvino: {threads} threads; expected 1 to {MAX_THREADS}")
        return cls(hint_for(config.mode), threads)

    def to_json(self) -> dict[str, Any]:
        json: dict[str, Any] = document_json(self)
        return json

    def properties(self) -> dict[str, Any]:
        """The ``compile_model`` properties."""
        return {
            **FIXED_PROPERTIES,
            "INFERENCE_PRECISION_HINT": self.inference_precision_hint,
            "INFERENCE_NUM_THREADS": self.inference_num_threads,
        }
