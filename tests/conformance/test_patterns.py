"""Each conformance subject exercises what it is in the suite for, where its source says.

A model earns its place by a pattern that once broke the harness (a write
through a view, a grad-mode switch, nested outputs, ops outside the CPU
engine's former list). Third-party code changes under us: Swin's mask is no
longer built by slice assignment and LLaMA's rotary embedding is no longer
``@torch.no_grad()`` in current ``transformers``, so those models silently
stopped covering the defects they were added for. Every claim in
``EXERCISES`` (models/thirdparty.py, recreations.py) is checked here against
the program ``torch.export`` actually produces, at the location claimed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness.zoo.thirdparty import EXERCISES as THIRD_PARTY_EXERCISES
from harness.zoo.thirdparty import THIRD_PARTY
from torch.export import ExportedProgram

from harness import models
from harness.frontend.export import export_program
from harness.frontend.provenance import DTYPE_FOLLOWS
from harness.lowering.functionalize import is_view
from harness.outputs import tensor_paths
from tests.conformance.recreations import EXERCISES as RECREATION_EXERCISES
from tests.conformance.recreations import RECREATIONS

RECREATIONS_FILE = Path(__file__).with_name("recreations.py")
CLAIMS = {
    **{name: claims for name, claims in THIRD_PARTY_EXERCISES.items()},
    **{f"{RECREATIONS_FILE}:{name}": claims for name, claims in RECREATION_EXERCISES.items()},
}
Node = torch.fx.Node


def _located(node: Node, where: str) -> bool:
    """``where`` names a module class on the node's module stack, or appears in its recorded source line."""
    classes = [cls.rpartition(".")[2] for _, cls in (node.meta.get("nn_module_stack") or {}).values()]
    return where in classes or where in (node.meta.get("stack_trace") or "")


def _calls(ep: ExportedProgram) -> list[Node]:
    """Every call in the program, higher-order op bodies included."""
    return [n for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
            for n in gm.graph.nodes if n.op == "call_function"]


def _writes_through_view(ep: ExportedProgram, spec: models.ModelSpec, where: str) -> bool:
    def written(node: Node) -> list[Node]:
        schema = node.target._schema  # type: ignore[union-attr]
        return [a for a, s in zip(node.args, schema.arguments, strict=False)
                if s.alias_info is not None and s.alias_info.is_write and isinstance(a, Node)]

    return any(
        _located(node, where) and any(is_view(target) for target in written(node))
        for node in _calls(ep)
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
    )


def _set_grad_region(ep: ExportedProgram, spec: models.ModelSpec, where: str) -> bool:
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    return any(node.target is hop and _located(node, where) for node in _calls(ep))


def _aten_op(ep: ExportedProgram, spec: models.ModelSpec, where: str) -> bool:
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target._opname == where for node in _calls(ep)
    )


def _dtype_follows(ep: ExportedProgram, spec: models.ModelSpec, where: str) -> bool:
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target._opname == where and DTYPE_FOLLOWS in node.meta
        for node in _calls(ep)
    )


def _nested_output(ep: ExportedProgram, spec: models.ModelSpec, where: str) -> bool:
    with torch.inference_mode():
        out = spec.module(*spec.example_inputs)
    return any(path.startswith(f"['{where}']") and path.count("[") >= 3 for path, _ in tensor_paths(out))


DETECTORS: dict[str, Callable[[ExportedProgram, models.ModelSpec, str], bool]] = {
    "write-through-view": _writes_through_view,
    "set-grad-region": _set_grad_region,
    "aten-op": _aten_op,
    "nested-output": _nested_output,
    "dtype-follows": _dtype_follows,
}


def test_every_subject_claims_something_it_is_in_the_suite_for():
    # The re-creations each stand for a pattern; of the third-party models, those named in
    # the zoo's docstring do. Every claim uses a pattern this file can check.
    assert set(RECREATION_EXERCISES) == set(RECREATIONS)
    assert set(THIRD_PARTY_EXERCISES) <= set(THIRD_PARTY)
    assert {"write-through-view", "set-grad-region"} <= {p for c in THIRD_PARTY_EXERCISES.values() for p, _ in c}
    assert {p for claims in CLAIMS.values() for p, _ in claims} <= set(DETECTORS)


@pytest.mark.stage("claimed pattern present")
@pytest.mark.parametrize("subject", sorted(CLAIMS), ids=lambda s: s.rpartition(":")[2])
def test_the_claimed_patterns_are_present_where_claimed(subject):
    spec = models.load(subject)
    ep = export_program(spec.module, spec.example_inputs)
    missing = [(p, where) for p, where in CLAIMS[subject] if not DETECTORS[p](ep, spec, where)]
    assert not missing, f"{subject} no longer exercises {missing} in the installed code"


def test_the_detectors_do_not_see_patterns_that_are_not_there():
    """An in-place op on a tensor of its own is no write through a view; no decorator, no grad region."""

    class InPlace(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y.relu_()
            return y

    spec = models.ModelSpec("inplace", "in place", InPlace(), (torch.zeros(2, 3),), [(torch.zeros(2, 3),)])
    ep = export_program(spec.module, spec.example_inputs)
    assert not _writes_through_view(ep, spec, "InPlace")
    assert not _set_grad_region(ep, spec, "InPlace")
    assert not _nested_output(ep, spec, "hidden")
