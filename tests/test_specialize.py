"""The drop-in module follows the caller's autocast state."""

from __future__ import annotations

import torch

from harness import models
from harness.autocast import jit
from tests.helpers import as_tuple, bits_equal


def _eager(module, inputs, dtype=None):
    if dtype is None:
        return as_tuple(module(*inputs))
    with torch.autocast("cpu", dtype=dtype):
        return as_tuple(module(*inputs))


def test_follows_every_autocast_state_and_caches():
    spec = models.load("transformer")
    m, x = spec.module, spec.example_inputs
    wrapped = jit(m, x)
    sequence = [None, torch.bfloat16, torch.float16, None, torch.bfloat16, torch.float16]
    for dtype in sequence:
        if dtype is None:
            out = as_tuple(wrapped(*x))
        else:
            with torch.autocast("cpu", dtype=dtype):
                out = as_tuple(wrapped(*x))
        ref = _eager(m, x, dtype)
        assert all(a.dtype == b.dtype and bits_equal(a, b) for a, b in zip(out, ref)), dtype
    assert set(wrapped.specializations) == {(False, None, False), (True, torch.bfloat16, False), (True, torch.float16, False)}
    cached = dict(wrapped.specializations)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(*x)
    assert wrapped.specializations[(True, torch.bfloat16, False)] is cached[(True, torch.bfloat16, False)]


def test_model_regions_apply_inside_each_specialization():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.a(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.b(x)
            return y, z

    m, x = M().eval(), (torch.randn(3, 8),)
    wrapped = jit(m, x)
    plain = wrapped(*x)
    assert plain[0].dtype == torch.float32 and plain[1].dtype == torch.bfloat16
    assert all(bits_equal(a, b) for a, b in zip(plain, _eager(m, x)))
    with torch.autocast("cpu", dtype=torch.float16):
        half = wrapped(*x)
    assert half[0].dtype == torch.float16 and half[1].dtype == torch.bfloat16
    assert all(bits_equal(a, b) for a, b in zip(half, _eager(m, x, torch.float16)))


def test_output_structure_matches_eager():
    spec = models.load("resnet")
    wrapped = jit(spec.module, spec.example_inputs)
    out = wrapped(*spec.example_inputs)
    assert isinstance(out, torch.Tensor)
    assert bits_equal(out, spec.module(*spec.example_inputs))
