"""Measurement library of the benchmark harness, independent of any engine.

Everything here measures plain callables or compares plain tensors, so a
runner only has to build an engine, hand its ``run`` to these functions and
append the resulting case to a :class:`~harness.bench.results.ResultsWriter`:

- :mod:`.stats`: summaries of raw samples, Mann-Whitney U, bootstrap ratio CI
- :mod:`.latency`: timing loop (CPU ``perf_counter_ns`` or CUDA events)
- :mod:`.memory`: peak host RSS of a run, weight bytes, engine size, GPU memory
- :mod:`.accuracy`: error metrics against the fp32 reference, output digests
- :mod:`.telemetry`: background CPU/GPU sampler
- :mod:`.machine`: machine description and a stable machine id
- :mod:`.results`: the versioned results JSON, writer, loader, shard merge
- :mod:`.gate`: regression gate between a baseline and a run
- :mod:`.compare`: determinism comparison of two runs (across machines too)
- :mod:`.tables`, :mod:`.plots`: terminal/Markdown tables and Pareto plots
- :mod:`.peers`: plain runtimes (eager, inductor, ONNX Runtime, OpenVINO) timed as reference rows

Submodules are not imported here on purpose: plotting pulls in matplotlib and
telemetry may load NVML, and a runner that only times a callable should not
pay for either.
"""
