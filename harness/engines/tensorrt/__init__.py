"""TensorRT backend pieces that need no GPU to test: log parsing, inspector, the log-to-layer join,
cache bridge, trtexec artifacts, versions.

Nothing here imports ``tensorrt`` at module level; functions that call the real
API import it lazily (see :func:`harness.engines.tensorrt.versions.load_tensorrt`).
"""
