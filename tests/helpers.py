"""Helpers shared by the tests: exact comparisons that also hold for NaN, CLI exit codes."""

from __future__ import annotations

import torch

from harness.outputs import tensor_paths


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality that also holds for NaN payloads (torch.equal says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def as_tuple(x: object) -> tuple[torch.Tensor, ...]:
    """The tensors of an output structure, in pytree order."""
    return tuple(t for _, t in tensor_paths(x))


def assert_same_outputs(out: object, ref: object) -> None:
    """Same structure (container types and paths) and bit-identical tensors, NaNs included."""
    assert type(out) is type(ref), (type(out), type(ref))
    got, want = tensor_paths(out), tensor_paths(ref)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype, (path, a.dtype, b.dtype)
        assert bits_equal(a, b), (path, (a.float() - b.float()).abs().max())


def exit_code(argv: list[str]) -> int:
    """``harness argv``'s exit code, whether the command returned it or argparse exited while parsing a flag."""
    from harness.cli.main import main

    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
