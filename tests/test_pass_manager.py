"""The pass manager: PassResult from every pass, one DEBUG line per pass, graph dumps."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from harness import models
from harness.errors import HarnessError
from harness.frontend.export import load_graph
from harness.lowering.pass_manager import (
    DEFAULT_PASSES,
    DUMP_DIR_ENV,
    DUMP_GRAPH_ENV,
    PassManager,
    PassResult,
    registered_passes,
)
from harness.lowering.remove_dropout import remove_dropout

LOGGER = "harness.lowering.pass_manager"


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).relu()


X = (torch.randn(3, 6),)


def _dropouts(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten.dropout.default for n in gm.graph.nodes)


def test_remove_dropout_reports_modified_then_not():
    gm = load_graph(WithDropout().eval(), X)
    assert _dropouts(gm) == 1
    first = remove_dropout(gm)
    assert isinstance(first, PassResult) and first.modified and first.graph_module is gm
    assert _dropouts(gm) == 0
    second = remove_dropout(gm)
    assert not second.modified


def test_the_manager_logs_one_line_per_pass_with_modified_and_node_counts(caplog):
    module = WithDropout().eval()
    gm = load_graph(module, X)
    before = len(gm.graph.nodes)
    manager = PassManager.from_names(["remove_dropout", "remove_detach"])
    with caplog.at_level(logging.DEBUG, logger="harness"):
        result = manager.run(gm)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2
    assert lines[0].startswith(f"lowering: remove_dropout modified=yes nodes {before} -> {before - 1} (")
    assert lines[0].endswith(" ms)")
    assert lines[1].startswith(f"lowering: remove_detach modified=no nodes {before - 1} -> {before - 1} (")
    assert result.modified and torch.equal(result.graph_module(*X)[0], module(*X))

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="harness"):
        again = manager.run(result.graph_module)
    assert not again.modified
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == LOGGER] == [
        f"lowering: remove_dropout modified=no nodes {before - 1} -> {before - 1}",
        f"lowering: remove_detach modified=no nodes {before - 1} -> {before - 1}",
    ]


@pytest.mark.parametrize("name", sorted(registered_passes()))
def test_every_registered_pass_returns_a_pass_result_and_a_second_run_changes_nothing(name):
    spec = models.load("resnet")
    gm = load_graph(spec.module, spec.example_inputs)
    fn = registered_passes()[name]
    first = fn(gm)
    assert isinstance(first, PassResult) and isinstance(first.graph_module, torch.fx.GraphModule)
    graph_text = str(first.graph_module.graph)
    second = fn(first.graph_module)
    assert isinstance(second, PassResult) and second.modified is False
    assert str(second.graph_module.graph) == graph_text


def test_passes_that_change_resnet_say_so():
    spec = models.load("resnet")
    modified = {}
    for name, fn in registered_passes().items():
        modified[name] = fn(load_graph(spec.module, spec.example_inputs)).modified
    # resnet has 9 conv + batch norm pairs and 2-D convolutions; no dropout, guards or in-place writes
    assert modified["fold_batch_norm"] and modified["channels_last_weights"]
    assert not modified["remove_dropout"] and not modified["pin_strided_layouts"]


def test_dump_after_a_named_pass_writes_the_graph_after_it(tmp_path):
    gm = load_graph(WithDropout().eval(), X)
    manager = PassManager.from_names(DEFAULT_PASSES)
    manager.dump_after, manager.dump_dir = {"remove_dropout"}, tmp_path
    manager(gm)
    (dump,) = tmp_path.iterdir()
    assert dump.name.endswith("-lowering-remove_dropout.txt")
    text = dump.read_text()
    assert "aten.linear.default" in text and "dropout" not in text


def test_dump_from_the_environment_goes_to_the_log_without_a_directory(monkeypatch, caplog):
    monkeypatch.setenv(DUMP_GRAPH_ENV, "remove_asserts,remove_dropout")
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    gm = load_graph(WithDropout().eval(), X)
    with caplog.at_level(logging.DEBUG, logger="harness"):
        PassManager.from_names(DEFAULT_PASSES)(gm)
    dumps = [r.getMessage() for r in caplog.records if "graph after" in r.getMessage()]
    assert [d.splitlines()[0] for d in dumps] == [
        "lowering: graph after remove_asserts:",
        "lowering: graph after remove_dropout:",
    ]
    assert "aten.dropout.default" in dumps[0] and "aten.dropout.default" not in dumps[1]


def test_dump_all_from_the_environment_into_a_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(DUMP_GRAPH_ENV, "all")
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "dumps"))
    PassManager.from_names(DEFAULT_PASSES)(load_graph(WithDropout().eval(), X))
    names = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "dumps").iterdir())
    assert names == sorted(f"lowering-{name}.txt" for name in DEFAULT_PASSES)
    in_run_order = [p.name.split("-", 2)[2][:-4] for p in sorted((tmp_path / "dumps").iterdir())]
    assert in_run_order == list(DEFAULT_PASSES)


def test_dumping_after_a_pass_the_manager_does_not_run_is_refused():
    with pytest.raises(HarnessError, match="cannot dump the graph after 'fold_batch_norm': lowering runs only"):
        PassManager(PassManager.from_names(DEFAULT_PASSES).passes, name="lowering", dump_after=["fold_batch_norm"])


def test_a_pass_that_changes_the_graph_but_reports_unmodified_is_caught():
    def sneaky(gm: torch.fx.GraphModule) -> PassResult:
        remove_dropout(gm)
        return PassResult(gm, False)

    with pytest.raises(HarnessError, match="pass 'sneaky' reported modified=False but changed the graph"):
        PassManager([("sneaky", sneaky)])(load_graph(WithDropout().eval(), X))


def test_a_pass_returning_something_else_is_refused():
    with pytest.raises(HarnessError, match="pass 'bad' returned NoneType, not a PassResult"):
        PassManager([("bad", lambda gm: None)])(load_graph(WithDropout().eval(), X))  # type: ignore[arg-type,return-value]
