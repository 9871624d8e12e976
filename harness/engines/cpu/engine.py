"""The CPU engine: a plan with its tactics bound and compiled to straight-line Python.

At construction every layer's tactic is bound once (weights pre-converted and
pre-laid-out), then the plan becomes one generated function, as fx's codegen
does, that calls the bound layers in order and drops each intermediate after
its last use. A call therefore costs the kernels plus one Python call per
layer, without interpreting the graph.

Saved engines are a directory of ``plan.json`` and ``weights.safetensors``.
Loading checks the schema version, the plan's fingerprint (any edit of the
plan is detected), the weights' digest, and every op and tactic name, before
binding anything; it never writes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from harness.engines.cpu import tactics
from harness.engines.cpu.plan import (
    GETITEM,
    PLAN_FORMAT,
    PLAN_SCHEMA,
    PLAN_VERSION,
    Plan,
    Ref,
    plan_from_json,
)
from harness.engines.protocol import EngineBase, LayerInfo, dtype_from_name, dtype_name
from harness.engines.saved import PLAN_FILE, read_plan
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest, json_bytes

WEIGHTS_FILE = "weights.safetensors"


class CpuEngine(EngineBase):
    backend = "cpu"

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.mode = plan.mode
        self.outputs = plan.output_structure
        self._expected = [
            (name, tuple(meta.shape), dtype_from_name(meta.dtype)) for name, meta in plan.inputs
        ]
        self._run = _compile(plan)

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self._expected):
            raise HarnessError(f"engine takes {len(self._expected)} input(s), got {len(inputs)}")
        for tensor, (name, shape, dtype) in zip(inputs, self._expected, strict=True):
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dtype != dtype
                or tuple(tensor.shape) != shape
            ):
                got = (
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise HarnessError(f"engine input {name!r}: expected {dtype} {shape}, got {got}")
        with torch.inference_mode():
            return self._run(*inputs)

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
    def load(path: str | os.PathLike[str]) -> CpuEngine:
        directory, obj, where = read_plan(
            path,
            backend="cpu",
            plan_format=PLAN_FORMAT,
            version=PLAN_VERSION,
            schema=PLAN_SCHEMA,
            payload=WEIGHTS_FILE,
        )
        body = {k: v for k, v in obj.items() if k not in ("fingerprint", "weights_digest")}
        if digest(canonical_json(body)) != obj["fingerprint"]:
            raise HarnessError(
                f"{where}: contents do not match the recorded fingerprint; the file was modified or corrupted"
            )
        weights_path = directory / WEIGHTS_FILE
        weights = _read_weights(weights_path)
        plan = plan_from_json(obj, weights, where)
        if plan.weights_digest() != obj["weights_digest"]:
            raise HarnessError(
                f"engine weights {weights_path}: digest does not match the plan's; "
                "the weights were modified or belong to another engine"
            )
        return CpuEngine(plan)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise HarnessError(f"engine weights {path}: no such file") from None
    except OSError as exc:
        raise HarnessError(f"engine weights {path}: cannot read ({exc})") from None
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for every kind of damage
        raise HarnessError(
            f"engine weights {path}: not a valid safetensors file ({exc}); it may be truncated or corrupt"
        ) from None


def _compile(plan: Plan) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Generate ``def run(a0, ...)`` calling each bound layer in plan order."""
    metas = plan.value_metas()
    variables = {name: f"a{i}" for i, (name, _) in enumerate(plan.inputs)}
    namespace: dict[str, Any] = {}
    last_use: dict[str, int] = {}
    for index, node in enumerate(plan.nodes):
        for ref in node.refs():
            last_use[ref.name] = index
    outputs = {o.name for o in plan.outputs if isinstance(o, Ref)}
    lines = [f"def run({', '.join(variables.values())}):"]
    for index, node in enumerate(plan.nodes):
        var = variables[node.name] = f"v{index}"
        args = ", ".join(variables[r.name] for r in node.refs())
        if node.op == GETITEM:
            lines.append(f"    {var} = {args}[{int(node.args[1])}]")
        else:
            impl, _ = tactics.parse_tactic(node.tactic)
            namespace[f"f{index}"] = tactics.bind(node, impl, metas, plan.weights)
            lines.append(f"    {var} = f{index}({args})")
        dead = sorted(
            {
                variables[r.name]
                for r in node.refs()
                if last_use[r.name] == index and r.name not in outputs
            }
        )
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    results = []
    for i, out in enumerate(plan.outputs):
        if isinstance(out, Ref):
            results.append(f"{variables[out.name]}.contiguous()")
        else:
            namespace[f"w{i}"] = plan.weights[out.name]
            results.append(f"w{i}.clone()")
    lines.append(f"    return ({''.join(r + ', ' for r in results)})")
    exec(compile("\n".join(lines), "<cpu-engine>", "exec"), namespace)
    return namespace["run"]  # type: ignore[no-any-return]
