"""A plan turned into straight-line Python: the engine's run function and its timed twin.

Both functions are generated from one list of steps (the bound layer, the
variables it reads and writes, the intermediates it frees), as fx's codegen
does, so the profiler times exactly the calls the engine makes, in the same
order with the same frees, instead of a second interpreter of the plan that
could drift from the real one. The timed variant only adds a clock reading
before and after each layer call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.engines.cpu import tactics
from harness.engines.cpu.plan import GETITEM, Node, Plan, Ref

RunFn = Callable[..., tuple[torch.Tensor, ...]]
# timed(clock, stamps, *inputs): stamps[2i], stamps[2i + 1] = clock() around layer i.
TimedRunFn = Callable[..., tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Program:
    """The plan's layers, bound once, and the two generated functions calling them."""

    layers: tuple[Node, ...]  # the nodes the timed function stamps, in call order
    run: RunFn
    timed: TimedRunFn


def compile_plan(plan: Plan) -> Program:
    """Bind every layer's tactic once and generate ``run`` and ``timed`` from the same steps."""
    metas = plan.value_metas()
    variables = {name: f"a{i}" for i, (name, _) in enumerate(plan.inputs)}
    namespace: dict[str, Any] = {}
    last_use: dict[str, int] = {}
    for index, node in enumerate(plan.nodes):
        for ref in node.refs():
            last_use[ref.name] = index
    outputs = {o.name for o in plan.outputs if isinstance(o, Ref)}
    body: list[tuple[str, bool]] = []  # (statement, is a layer call)
    layers: list[Node] = []
    for index, node in enumerate(plan.nodes):
        var = variables[node.name] = f"v{index}"
        args = ", ".join(variables[r.name] for r in node.refs())
        if node.op == GETITEM:
            body.append((f"{var} = {args}[{int(node.args[1])}]", False))
        else:
            impl, _ = tactics.parse_tactic(node.tactic)
            namespace[f"f{index}"] = tactics.bind(node, impl, metas, plan.weights)
            body.append((f"{var} = f{index}({args})", True))
            layers.append(node)
        dead = sorted(
            {variables[r.name] for r in node.refs() if last_use[r.name] == index and r.name not in outputs}
        )
        if dead:
            body.append((f"del {', '.join(dead)}", False))
    results = []
    for i, out in enumerate(plan.outputs):
        if isinstance(out, Ref):
            results.append(f"{variables[out.name]}.contiguous()")
        else:
            namespace[f"w{i}"] = plan.weights[out.name]
            results.append(f"w{i}.clone()")
    ret = f"return ({''.join(r + ', ' for r in results)})"
    params = ", ".join(variables[name] for name, _ in plan.inputs)
    run_lines = [f"def run({params}):", *(f"    {s}" for s, _ in body), f"    {ret}"]
    timed_lines = [f"def timed(clock, stamps{', ' if params else ''}{params}):"]
    layer = 0
    for statement, is_layer in body:
        if is_layer:
            timed_lines += [
                f"    stamps[{2 * layer}] = clock()",
                f"    {statement}",
                f"    stamps[{2 * layer + 1}] = clock()",
            ]
            layer += 1
        else:
            timed_lines.append(f"    {statement}")
    timed_lines.append(f"    {ret}")
    source = "\n".join(run_lines) + "\n\n" + "\n".join(timed_lines)
    exec(compile(source, "<cpu-engine>", "exec"), namespace)
    return Program(tuple(layers), namespace["run"], namespace["timed"])
