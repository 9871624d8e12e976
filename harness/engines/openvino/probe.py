"""What this CPU's OpenVINO really runs in a precision: asked of OpenVINO, never assumed from an ISA.

Which reduced precisions OpenVINO's CPU plugin executes depends on the CPU
(AVX512-BF16 or AMX for bf16, AVX512-FP16 or AMX-FP16 for f16) and on the
OpenVINO version: where it has no kernels it silently runs f32 instead, and
under ``INFERENCE_PRECISION_HINT=f32`` some versions convert a model's f16 ops
to f32 altogether. So before a mode is accepted, a one-MatMul model is
compiled the way the mode would compile its graph, and the precision the
runtime model reports for the MatMul decides: a mode whose precision does not
survive is refused with what OpenVINO did instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from harness.engines import capability
from harness.engines.openvino.runtime import (
    DEVICE,
    OV_ERRORS,
    VERSION,
    core,
    dtype_of,
    error_text,
    ov_type_name,
)

_MATMUL_LAYERS = ("FullyConnected", "MatMul")


@dataclass(frozen=True)
class Probe:
    """How a MatMul computing in ``dtype`` ran under ``hint``: its runtime precision, or OpenVINO's error."""

    dtype: str
    hint: str
    ran_in: str | None
    error: str | None = None

    @property
    def wanted(self) -> str:
        """The precision the question asks for: the graph's type under f32, else the hint's."""
        return self.dtype if self.hint == "f32" else dtype_of(self.hint)

    @property
    def honoured(self) -> bool:
        return self.ran_in == self.wanted

    def describe(self) -> str:
        if self.error is not None:
            return f"OpenVINO {VERSION} refused to compile it: {self.error}"
        return f"OpenVINO {VERSION} ran {self.dtype} MatMul under INFERENCE_PRECISION_HINT={self.hint} in {self.ran_in}"


def probe(dtype: str, hint: str) -> Probe:
    """Compile Parameter(f32) -> Convert(dtype) -> MatMul(dtype weights) -> Convert(f32) under ``hint``.

    ``dtype`` "fp32" with a low ``hint`` asks the weak-typing question (does
    OpenVINO lower an fp32 MatMul to the hint?); a low ``dtype`` with hint
    "f32" the strong one (does it keep the graph's type?). A forced CPU kind
    (:func:`harness.engines.capability.forced`) answers for itself;
    otherwise OpenVINO is asked, once per process: the answer is a property
    of this machine and OpenVINO build.
    """
    ran_in = capability.current().openvino_runs_in(dtype, hint)
    if ran_in is not None:
        return Probe(dtype, hint, ran_in)
    return _asked(dtype, hint)


@functools.cache
def _asked(dtype: str, hint: str) -> Probe:
    import openvino as ov
    from openvino import opset13 as ops

    target = ov_type_name(dtype)
    param = ops.parameter([4, 64], ov.Type.f32, name="x")
    x, weights = param, ops.constant(np.full((64, 64), 0.5, dtype=np.float32))
    if target != "f32":
        x, weights = ops.convert(x, target), ops.convert(weights, target)
    matmul = ops.matmul(x, weights, False, True)
    result = ops.convert(matmul, "f32") if target != "f32" else matmul
    model = ov.Model([result], [param], "precision_probe")
    try:
        compiled = core().compile_model(
            model, DEVICE, {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": 1}
        )
    except OV_ERRORS as exc:
        return Probe(dtype, hint, None, error_text(exc))
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in _MATMUL_LAYERS:
            return Probe(dtype, hint, dtype_of(info["runtimePrecision"].astype(str)))
    return Probe(dtype, hint, None, "the compiled probe has no MatMul layer")
