"""The CPU engine: a plan with its tactics bound and compiled to straight-line Python.

At construction every layer's tactic is bound once (weights pre-converted and
pre-laid-out), then the plan becomes one generated function, as fx's codegen
does, that calls the bound layers in order and drops each intermediate after
its last use (:mod:`harness.engines.cpu.program`). A call therefore costs the
kernels plus one Python call per layer, without interpreting the graph.
:meth:`CpuEngine.profile` runs the same calls with a clock around each layer.

Saved engines are a directory of ``plan.json`` and ``weights.safetensors``.
Loading checks the schema version, the plan's fingerprint (any edit of the
plan is detected), the weights' digest, and every op and tactic name, before
binding anything; it never writes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from harness.dtypes import dtype_from_name, dtype_name
from harness.engines.cpu.plan import PLAN, WEIGHTS_FILE, Plan, plan_from_saved
from harness.engines.cpu.profile import (
    DEFAULT_ITERATIONS,
    DEFAULT_WARMUP,
    Profile,
    check_counts,
    measure,
)
from harness.engines.cpu.program import compile_plan
from harness.engines.cpu.tactic import compiled
from harness.engines.protocol import EngineBase, LayerInfo
from harness.engines.saved import PLAN_FILE
from harness.errors import HarnessError
from harness.fileio import MAX_PAYLOAD_BYTES, canonical_json, digest, json_bytes, read_regular_file

_InferenceMode = torch._C._InferenceMode


class CpuEngine(EngineBase):
    backend = "cpu"

    def __init__(self, plan: Plan, regions: bool = True) -> None:
        self.plan = plan
        self.mode = plan.mode
        self.outputs = plan.output_structure
        self._expected = [
            (name, torch.Size(meta.shape), dtype_from_name(meta.dtype)) for name, meta in plan.inputs
        ]
        self._inputs_fit = _fit_check([(shape, dtype) for _, shape, dtype in self._expected])
        self._program = compile_plan(plan, regions)

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._check_inputs(inputs)
        # torch.inference_mode() is this guard behind a Python context manager,
        # whose cost per call is noticeable on a small model's run.
        with _InferenceMode(True):
            return self._program.run(*inputs)

    def profile(
        self,
        inputs: Sequence[torch.Tensor] | None = None,
        iterations: int = DEFAULT_ITERATIONS,
        warmup: int = DEFAULT_WARMUP,
        threads: int | None = None,
    ) -> Profile:
        """Time every layer of a real run (see :mod:`harness.engines.cpu.profile`).

        ``inputs`` default to :meth:`synthetic_inputs`; ``threads`` sets torch's
        intra-op thread count for the profile only.
        """
        check_counts(iterations, warmup)
        inputs = tuple(self.synthetic_inputs() if inputs is None else inputs)
        self._check_inputs(inputs)
        if threads is not None and not 1 <= threads <= 1024:
            raise HarnessError(f"profile threads {threads}: expected 1 to 1024")
        previous = torch.get_num_threads()
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            return measure(self._program, self.mode, inputs, iterations, warmup)
        finally:
            torch.set_num_threads(previous)

    def synthetic_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Inputs of the declared shapes and dtypes when the model's own are not at hand.

        Floating inputs are standard normal (seeded); integer and boolean ones
        are zero, the one value every index op (an embedding, a gather) accepts.
        Kernel times do not depend on the values beyond that.
        """
        generator = torch.Generator().manual_seed(seed)
        return tuple(
            torch.randn(shape, generator=generator).to(dtype)
            if dtype.is_floating_point
            else torch.zeros(shape, dtype=dtype)
            for _, shape, dtype in self._expected
        )

    def _check_inputs(self, inputs: Sequence[Any]) -> None:
        if self._inputs_fit(inputs):
            return
        if len(inputs) != len(self._expected):
            raise HarnessError(f"engine takes {len(self._expected)} input(s), got {len(inputs)}")
        for tensor, (name, shape, dtype) in zip(inputs, self._expected, strict=True):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.shape != shape:
                got = (
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise HarnessError(f"engine input {name!r}: expected {dtype} {tuple(shape)}, got {got}")

    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self._expected)

    def layers(self) -> list[LayerInfo]:
        return self.plan.layers()

    def fingerprint(self) -> str:
        return self.plan.fingerprint()

    def weights_digest(self) -> str:
        return self.plan.weights_digest()

    def size_bytes(self) -> int:
        return len(canonical_json(self.plan.to_json())) + sum(self.weight_bytes_by_dtype().values())

    def device_memory_bytes(self) -> int | None:
        return None  # host engine: its memory is in the run's peak RSS

    def compiler_settings(self) -> dict[str, Any] | None:
        return self.plan.compiler_settings

    def weight_bytes_by_dtype(self) -> dict[str, int]:
        sizes: dict[str, int] = defaultdict(int)
        for tensor in self.plan.weights.values():
            sizes[dtype_name(tensor.dtype)] += tensor.numel() * tensor.element_size()
        return dict(sizes)

    def files(self) -> dict[str, bytes]:
        """``plan.json`` and ``weights.safetensors``."""
        weights = {name: t.contiguous() for name, t in self.plan.weights.items()}
        return {WEIGHTS_FILE: save_safetensors(weights), PLAN_FILE: json_bytes(self.plan.to_json())}

    @staticmethod
    def load(path: str | os.PathLike[str], regions: bool = True) -> CpuEngine:
        directory, obj, where = PLAN.read(path)
        body = {k: v for k, v in obj.items() if k not in ("fingerprint", "weights_digest")}
        saved = PLAN.typed(obj, where)
        if digest(canonical_json(body)) != saved.fingerprint:
            raise HarnessError(
                f"{where}: contents do not match the recorded fingerprint; the file was modified or corrupted"
            )
        weights_path = directory / WEIGHTS_FILE
        weights = _read_weights(weights_path)
        plan = plan_from_saved(saved, weights, where)
        if plan.weights_digest() != saved.weights_digest:
            raise HarnessError(
                f"engine weights {weights_path}: digest does not match the plan's; "
                "the weights were modified or belong to another engine"
            )
        return CpuEngine(plan, regions)


def _fit_check(expected: Sequence[tuple[torch.Size, torch.dtype]]) -> Callable[[Sequence[Any]], bool]:
    """Whether a run's inputs are tensors of the expected shapes and dtypes, as one generated
    expression, cheaper per run than a loop over them (noticeable on a small model's run)."""
    terms = [f"len(inputs) == {len(expected)}"]
    for i in range(len(expected)):
        terms.append(f"isinstance(inputs[{i}], Tensor) and inputs[{i}].dtype is d{i} and inputs[{i}].shape == s{i}")
    namespace: dict[str, Any] = {"Tensor": torch.Tensor}
    for i, (shape, dtype) in enumerate(expected):
        namespace[f"s{i}"], namespace[f"d{i}"] = shape, dtype
    return eval(compiled(f"lambda inputs: {' and '.join(terms)}", "<string>", "eval"), namespace)  # type: ignore[no-any-return]


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    data = read_regular_file(path, "engine weights", MAX_PAYLOAD_BYTES)  # no FIFO, no endless device
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for every kind of damage
        raise HarnessError(
            f"engine weights {path}: not a valid safetensors file ({exc}); it may be truncated or corrupt"
        ) from None
