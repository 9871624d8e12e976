"""Benchmarks of the harness itself, each runnable as ``python -m harness.benchmarks.<name>``."""
