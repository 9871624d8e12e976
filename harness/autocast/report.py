"""The precision report: every node, the precision it runs in, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tabulate import tabulate

from harness.autocast.casts import CastStats
from harness.autocast.decision import Decision
from harness.dtypes import dtype_label, dtype_name
from harness.fxutil import input_nodes, module_path, output_dtypes
from harness.opnames import op_name


@dataclass(frozen=True)
class NodeRow:
    name: str
    op: str
    module: str
    precision: str
    rule: str
    reason: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]


@dataclass
class PrecisionReport:
    policy: str
    low_precision_type: str
    rows: list[NodeRow]
    casts_inserted: int = 0
    weights_converted: int = 0
    clipped_values: int = 0
    overflowed_values: int = 0
    clipped_weights: list[str] = field(default_factory=list)
    # lowered layers whose bias took out the mean shift of their rounded weights (harness.autocast.bias_correction)
    biases_corrected: int = 0
    # what the compile was asked that changed nothing (an exclusion matching no node)
    warnings: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(r.rule for r in self.rows).items()))

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["counts"] = self.counts()
        return doc

    def table(self) -> str:
        body = [
            (r.name, r.op, r.module or "-", r.precision, r.reason, ",".join(r.input_dtypes) or "-", ",".join(r.output_dtypes) or "-")
            for r in self.rows
        ]
        head = ("node", "op", "module", "precision", "reason", "inputs", "outputs")
        counts = tabulate(sorted(self.counts().items()), headers=("rule", "nodes"))
        summary = (
            f"policy {self.policy}, low precision {self.low_precision_type}: {self.casts_inserted} casts inserted, "
            f"{self.weights_converted} weight copies converted ahead of time, "
            f"{self.clipped_values} weight values clipped to the {self.low_precision_type} range"
        )
        if self.biases_corrected:
            summary += f", {self.biases_corrected} biases corrected for their layers' rounded weights"
        if self.overflowed_values:
            summary += f", {self.overflowed_values} weight values overflow {self.low_precision_type} (as in eager autocast)"
        warnings = "".join(f"\nwarning: {w}" for w in self.warnings)
        return f"{tabulate(body, headers=head)}\n\n{counts}\n\n{summary}{warnings}"


def _precision(node: torch.fx.Node) -> str:
    outs = [d for d in output_dtypes(node) if d.is_floating_point]
    ins = [v.dtype for a in input_nodes(node) if isinstance(v := a.meta.get("val"), torch.Tensor) and v.is_floating_point()]
    chosen = outs or ins
    return dtype_label(chosen[0]) if chosen else "-"


def build_report(
    gm: torch.fx.GraphModule, decisions: dict[str, Decision], policy: str, low: torch.dtype, stats: CastStats
) -> PrecisionReport:
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        d = decisions.get(node.name)
        if node.meta.get("inserted_cast"):
            rule, reason = "inserted_cast", f"cast inserted on the edge from {node.args[0].name}"
        elif d is None:
            origin = node.meta.get("decomposed_from")
            rule, reason = "decomposed", f"part of the decomposition of {origin}" if origin else "not classified"
        else:
            rule, reason = d.rule, d.reason
        ins = tuple(dtype_label(v.dtype) for a in input_nodes(node) if isinstance(v := a.meta.get("val"), torch.Tensor))
        rows.append(
            NodeRow(
                name=node.name,
                op=op_name(node.target),
                module=module_path(node),
                precision=_precision(node),
                rule=rule,
                reason=reason,
                input_dtypes=ins,
                output_dtypes=tuple(dtype_label(t) for t in output_dtypes(node)),
            )
        )
    return PrecisionReport(
        policy=policy,
        low_precision_type=dtype_name(low),
        rows=rows,
        casts_inserted=sum(1 for r in rows if r.rule == "inserted_cast"),
        weights_converted=stats.weights_converted,
        clipped_values=stats.clipped_values,
        overflowed_values=stats.overflowed_values,
        clipped_weights=stats.clipped_weights,
    )
