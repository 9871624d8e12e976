"""Precision debugging: where the error enters a typed graph, and the fastest plan that meets a target.

Data flow::

    model + batches (inputs.py)
      ├─ layers.py      fp32 reference and typed graph run side by side (capture.py), the
      │                 engine's own intermediates where the backend exposes them (taps.py):
      │                 per layer the accumulated, introduced and output-impact error (metrics.py)
      └─ precision.py   the search: candidate plans (plan.py) built and run on the backend
                        (evaluate.py), the fastest verified plan kept (select.py)
                        → explicit precision file for ``build`` / ``bench --mode explicit``
    plots.py            error along the graph's depth; the search's error against latency
"""

from harness.debug.layers import LayerError, LayerReport, attribute_errors, debug_layers
from harness.debug.metrics import METRICS, ErrorStats, Target, parse_target
from harness.debug.plan import PrecisionPlan
from harness.debug.precision import SearchResult, Step, search_precision

__all__ = [
    "METRICS",
    "ErrorStats",
    "LayerError",
    "LayerReport",
    "PrecisionPlan",
    "SearchResult",
    "Step",
    "Target",
    "attribute_errors",
    "debug_layers",
    "parse_target",
    "search_precision",
]
