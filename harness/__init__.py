"""Reproducible builds and benchmarks for mixed-precision inference."""

__version__ = "0.1.0"
