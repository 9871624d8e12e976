"""The names of the peers, without importing any runtime.

:mod:`harness.bench.peers` measures the peers and imports torch; the command
line's parser, the project file's schema and the tables only need these
names, and ``harness gate`` must run where torch is not installed. The
precisions peers compare at are :data:`harness.precision.PRECISIONS`.
"""

from __future__ import annotations

PEER_NAMES = ("eager", "inductor", "onnxruntime", "openvino", "eager-cuda")
