"""The classifier: combines rules in order; it decides nothing by itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.autocast import rules as r
from harness.autocast.decision import Decision
from harness.errors import HarnessError

_STRUCTURAL: tuple[r.Rule, ...] = (r.NotFloat(), r.Float64(), r.Getitem(), r.ExplicitCast())

# How the compiler decides each node's precision (the precision modes of the
# engines map onto these: harness.engines.modes).
POLICIES = ("fp32", "full", "rule", "amp", "explicit")


def rules_for(policy: str, explicit: Sequence[tuple[object, torch.dtype]] = ()) -> tuple[r.Rule, ...]:
    if policy == "rule":
        return _STRUCTURAL + (
            r.AutocastRegionRule(),
            r.Include(),
            r.Exclude(),
            r.Custom(),
            r.InitMax(),
            r.DataMax(),
            r.ReductionDepth(),
            r.OutputLayer(),
            r.Default("default", "no rule keeps it in fp32: lowered to {low}"),
        )
    if policy == "full":
        return _STRUCTURAL + (r.Default("full", "whole graph in {low}"),)
    if policy == "explicit":
        return _STRUCTURAL + (r.ExplicitPatterns(list(explicit)),)
    if policy in ("amp", "fp32"):
        # AMP decides eligibility per input (float64 inputs stay, others are cast),
        # so only getitem and non-float nodes are settled structurally.
        return (r.NotFloat(), r.Getitem(), r.AmpPolicyRule())
    raise HarnessError(f"unknown compiler policy {policy!r}; valid: {', '.join(POLICIES)}")


def classify(gm: torch.fx.GraphModule, ctx: r.Context, rules: Sequence[r.Rule]) -> dict[str, Decision]:
    decisions: dict[str, Decision] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for rule in rules:
            decision = rule(node, ctx)
            if decision is not None:
                decisions[node.name] = decision
                break
    return decisions
