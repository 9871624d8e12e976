"""OpenVINO engine: the TensorRT hand-off file compiled by OpenVINO's CPU plugin.

The CPU runtime with a precision hint that is the CPU counterpart of
TensorRT's weak typing: strongly typed modes follow the graph's casts under
``INFERENCE_PRECISION_HINT=f32``, weak modes let the hint lower the fp32
graph. See :mod:`.backend` for the modes and :mod:`.layers` for the tactics
read from OpenVINO's runtime model. An optional dependency: importing this
package without OpenVINO raises an ImportError naming the ``openvino`` extra.
"""

from harness.engines.openvino.backend import OpenVinoBackend
from harness.engines.openvino.engine import OpenVinoEngine

__all__ = ["OpenVinoBackend", "OpenVinoEngine"]
