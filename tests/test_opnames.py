"""Op names (harness.opnames), dtype names (harness.dtypes) and fresh names (harness.naming)."""

from __future__ import annotations

import operator

import pytest
import torch

from harness.autocast import compile
from harness.dtypes import (
    DTYPES,
    EXPLICIT_DTYPES,
    FLOAT_DTYPES,
    LOW_DTYPES,
    dtype_from_name,
    dtype_label,
    dtype_name,
)
from harness.engines.cpu.plan import GETITEM, plan_op_name, runnable_op
from harness.errors import HarnessError
from harness.models import load
from harness.naming import fresh_name
from harness.opnames import (
    op_name,
    out_of_place_packet,
    plan_name,
    plan_packet,
    resolve_op,
    resolve_op_names,
)


def _aten_ops(*models: str) -> set[torch._ops.OpOverload]:
    ops: set[torch._ops.OpOverload] = set()
    for model in models:
        spec = load(model)
        for policy in ("fp32", "rule"):
            gm = compile(spec.module, spec.example_inputs, policy=policy, low_precision_type="bf16").graph_module
            ops |= {n.target for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    return {op for op in ops if op.namespace == "aten"}


@pytest.fixture(scope="module")
def graph_ops() -> set[torch._ops.OpOverload]:
    ops = _aten_ops("lenet", "transformer")
    assert len(ops) > 10
    return ops


def test_every_aten_op_of_a_graph_round_trips_through_both_forms(graph_ops):
    for op in graph_ops:
        assert resolve_op(op_name(op)) is op
        assert resolve_op(plan_name(op)) is op
        assert plan_packet(plan_name(op)) == op.overloadpacket.__name__


def test_the_plan_form_is_byte_identical_to_the_schema_name_saved_plans_hold(graph_ops):
    # Saved plans and the committed caches under results/ were written as schema name + "." + overload.
    for op in graph_ops:
        assert plan_name(op) == f"{op._schema.name}.{op._overloadname}"
        assert plan_op_name(op) == plan_name(op)
    assert plan_name(torch.ops.aten.conv2d.default) == "aten::conv2d.default"
    assert plan_op_name(operator.getitem) == GETITEM and runnable_op(GETITEM, "here") is operator.getitem


def test_user_form():
    assert op_name(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
    assert op_name(torch.ops.aten.conv2d.default) == "aten.conv2d.default"
    assert op_name(torch.ops.higher_order.wrap_with_autocast) == "higher_order.wrap_with_autocast"
    assert op_name(operator.getitem) == "getitem"


@pytest.mark.parametrize("name", ["aten.conv2d", "aten.conv2d.default", "aten::conv2d", "aten::conv2d.default"])
def test_every_valid_form_resolves(name):
    assert resolve_op(name) is torch.ops.aten.conv2d.default


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("conv2d", r"not of the form aten\.NAME, aten\.NAME\.OVERLOAD, aten::NAME or aten::NAME\.OVERLOAD"),
        ("prims.convert_element_type.default", "not of the form aten.NAME"),
        ("aten.conv2d.default.extra", "not of the form aten.NAME"),
        ("aten.nope", "torch.ops.aten has no operator 'nope'"),
        ("aten.add.nope", r"unknown overload 'aten\.add\.nope'; add has: .*Tensor"),
    ],
)
def test_unknown_names_are_refused_naming_what_is_valid(name, match):
    with pytest.raises(HarnessError, match=match):
        resolve_op(name)


def test_a_name_without_overload_means_every_overload():
    names = resolve_op_names(["aten.conv2d", "aten::relu.default"])
    assert names == {"aten.conv2d.default", "aten.conv2d.padding", "aten.relu.default"}


def test_the_plan_accepts_only_its_own_form():
    with pytest.raises(HarnessError, match=r"expected aten::<op>\.<overload>"):
        runnable_op("aten.relu.default", "layer 'x'")
    with pytest.raises(HarnessError, match="does not exist in this PyTorch"):
        runnable_op("aten::relu.nope", "layer 'x'")
    assert runnable_op("aten::relu.default", "layer 'x'") is torch.ops.aten.relu.default


def test_out_of_place_packet():
    assert out_of_place_packet(torch.ops.aten.transpose_.default) is torch.ops.aten.transpose
    assert out_of_place_packet(torch.ops.aten.relu.default) is None


def test_dtype_names():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name and dtype_from_name(name) is dtype
    assert FLOAT_DTYPES == {"fp32", "fp16", "bf16", "fp64"}
    assert list(LOW_DTYPES) == ["fp16", "bf16"] and list(EXPLICIT_DTYPES) == ["fp32", "fp16", "bf16"]
    assert dtype_label(torch.complex64) == "complex64" and dtype_label(torch.float16) == "fp16"
    with pytest.raises(HarnessError, match="dtype torch.complex64 is not supported by the engines; supported: fp32"):
        dtype_name(torch.complex64)
    with pytest.raises(HarnessError, match="unknown dtype 'half'; valid: fp32, fp16"):
        dtype_from_name("half")


def test_fresh_name():
    taken = {"w", "w_1"}
    assert fresh_name("v", taken.__contains__) == "v"
    assert fresh_name("w", taken.__contains__) == "w_2"
    assert fresh_name("w", {"w"}.__contains__, sep="#") == "w#1"
