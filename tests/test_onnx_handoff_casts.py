"""The ONNX hand-off writes no Cast that changes nothing: checked on the file and run in ONNX Runtime.

References: the typed graph's own casts (``aten._to_copy`` nodes), the ONNX
file as written (``onnx.load``), and eager fp32 run by PyTorch against the
file run by ONNX Runtime.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from harness.autocast import compile
from harness.engines.onnx_export import export_onnx

ort = pytest.importorskip("onnxruntime")


class Reductions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        total = h.abs().sum(-1, keepdim=True) + torch.cumsum(h, -1) / 16
        return self.out(total * (1 + 0.1 * h).prod(-1, keepdim=True))


class SqueezeExcite(nn.Module):
    """Convolutions (stored channels-last by the compiler) and a global pooling between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        scale = torch.sigmoid(self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(h, 1)))))
        return self.head((h * scale).mean((2, 3)))


def _export(module: nn.Module, x: torch.Tensor, tmp_path):
    torch.manual_seed(0)
    compiled = compile(module.eval(), (x,), policy="rule", low_precision_type="fp16")
    record = export_onnx(compiled, tmp_path / "m.onnx")
    return compiled, record, onnx.load(record.path)


def _placed(compiled) -> int:
    return sum(1 for n in compiled.graph_module.graph.nodes if n.target is torch.ops.aten._to_copy.default)


def _run(path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def test_reductions_run_in_the_low_precision_without_the_exporters_cast_pairs(tmp_path):
    torch.manual_seed(0)
    module, x = Reductions(), torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    compiled, record, proto = _export(module, x, tmp_path)
    casts = [n for n in proto.graph.node if n.op_type == "Cast"]
    assert len(casts) == _placed(compiled) == len(record.compiler_casts) and not record.exporter_casts
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    ops = {n.op_type: types.get(n.output[0]) for n in proto.graph.node}
    for op in ("Abs", "ReduceSum", "CumSum", "ReduceProd"):
        assert ops[op] == onnx.TensorProto.FLOAT16, (op, ops)
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(_run(record.path, x), want, atol=2e-2, rtol=2e-2)


def test_a_channels_last_graph_exports_without_layout_copies(tmp_path):
    torch.manual_seed(0)
    module, x = SqueezeExcite(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    compiled, record, proto = _export(module, x, tmp_path)
    assert any(not t.is_contiguous() for t in compiled.graph_module.parameters())  # the compiler's layout
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    assert ops["Gather"] == 0 and ops["Reshape"] <= 1, ops  # no as_strided restoring a layout
    assert all(t.is_contiguous() or t.dim() == 4 for t in compiled.graph_module.parameters())
    assert any(not t.is_contiguous() for t in compiled.graph_module.parameters())  # given back after export
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(_run(record.path, x), want, atol=1e-2, rtol=1e-2)
