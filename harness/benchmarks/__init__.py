"""Benchmarks of the harness itself: how its compiler scales and what its typed graphs buy."""
