"""Weight draws in place: one export serves every draw, and the module gets its own weights back.

The conformance suite checks its exact stages on several draws of each
subject's weights, all compiled from the subject's one export
(tests/conformance/test_conformance.py). That is only the check it was if a
compile from the shared export after an in-place draw computes what a compile
from a reseeded copy does, and if the other tests sharing the module see its
original weights afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from harness import models
from harness.autocast import compile, jit
from harness.frontend.export import export_program
from harness.models import ModelSpec
from tests.conformance import recreations
from tests.helpers import as_tuple, assert_same_outputs, bits_equal
from tests.seeds import redrawn, reseeded

LOW = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return models.load(f"{recreations.__file__}:token_mixer")  # convolution, linears, layer norms


def _saved(module: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    return [(p, p.detach().clone()) for p in module.parameters()]


def _assert_restored(module: torch.nn.Module, saved: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """The same Parameter objects (an export holds them), each with its former bits."""
    params = list(module.parameters())
    assert len(params) == len(saved)
    for p, (q, bits) in zip(params, saved, strict=True):
        assert p is q
        assert bits_equal(p.detach(), bits)


def _states() -> Iterator[torch.dtype | None]:
    yield None
    yield from LOW


def _run(wrapped: torch.nn.Module, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> object:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return wrapped(*inputs)


def test_redrawn_draws_what_reseeded_draws_then_puts_every_parameter_back(spec):
    saved = _saved(spec.module)
    copy = reseeded(spec.module, 3)
    with redrawn(spec.module, 3) as module:
        assert module is spec.module
        for p, q in zip(module.parameters(), copy.parameters(), strict=True):
            assert bits_equal(p.detach(), q.detach())
        assert not all(bits_equal(p.detach(), bits) for p, bits in saved)
    _assert_restored(spec.module, saved)


def test_redrawn_puts_every_parameter_back_when_the_body_raises(spec):
    saved = _saved(spec.module)
    with pytest.raises(RuntimeError, match="in the body"), redrawn(spec.module, 3):
        raise RuntimeError("in the body")
    _assert_restored(spec.module, saved)


@pytest.mark.parametrize("low", LOW, ids=str)
def test_a_compile_from_one_export_follows_each_draw(spec, low):
    x = spec.example_inputs
    program = export_program(spec.module, x)
    # Compiled before any draw: a cache keyed on the export (or the parameters) would serve it stale below.
    original = compile(program, x, policy="amp", low_precision_type=low)(*x)
    for seed in (0, 1):
        want = compile(reseeded(spec.module, seed), x, policy="amp", low_precision_type=low)(*x)
        with redrawn(spec.module, seed):
            got = compile(program, x, policy="amp", low_precision_type=low)(*x)
        assert_same_outputs(got, want)
        # The draw changed what is computed, so the equality above is not one of untouched weights.
        assert not all(bits_equal(a, b) for a, b in zip(as_tuple(got), as_tuple(original), strict=True))


def test_jit_from_a_given_export_is_jit_from_the_module(spec, monkeypatch):
    x = spec.example_inputs
    program = export_program(spec.module, x)
    own = jit(spec.module, x)
    with monkeypatch.context() as patched:  # the given export is the one compiled: none is made
        patched.setattr("harness.autocast.specialize.export_program", lambda *args: pytest.fail("exported again"))
        given = jit(spec.module, x, program=program)
    for dtype in _states():
        assert_same_outputs(_run(given, x, dtype), _run(own, x, dtype))
    # One export serves wrappers of several draws: each follows the weights it was drawn with.
    with redrawn(spec.module, 0):
        drawn = jit(spec.module, x, program=program)
        got = [_run(drawn, x, dtype) for dtype in _states()]
    copy = reseeded(spec.module, 0)
    reference = jit(copy, x)
    for dtype, out in zip(_states(), got, strict=True):
        assert_same_outputs(out, _run(reference, x, dtype))
