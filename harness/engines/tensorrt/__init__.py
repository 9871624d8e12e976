"""TensorRT backend pieces that need no GPU to test: log parsing, cache bridge, inspector, versions.

Nothing here imports ``tensorrt`` at module level; functions that call the real
API import it lazily (see :func:`harness.engines.tensorrt.versions.load_tensorrt`).
"""
