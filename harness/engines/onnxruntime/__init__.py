"""ONNX Runtime engine: runs, on CPU, the exact ONNX file the TensorRT backend hands its parser.

It answers "is the hand-off right?" on any machine: same export, same casts,
outputs compared against the typed graph. See :mod:`.backend` for what ONNX
Runtime's CPU provider does to fp16/bf16 graphs.
"""

from harness.engines.onnxruntime.backend import OnnxRuntimeBackend, OnnxRuntimeEngine

__all__ = ["OnnxRuntimeBackend", "OnnxRuntimeEngine"]
