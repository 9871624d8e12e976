"""Run the typed graph once and hold it to its own metadata.

Fake-tensor propagation does not check everything a real kernel checks (a
``linear`` with an fp16 input and an fp32 weight passes on fake tensors and
fails for real), and every engine trusts ``meta["val"]``. So compilation ends
with one real run on the example inputs: a node that cannot run with the
decided types is reported by name, and a node whose real dtype or shape
differs from its metadata is a compiler bug, reported as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from harness.errors import HarnessError, first_line
from harness.fxutil import tensor_vals
from harness.opnames import op_name


class _Checker(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        expected = list(tensor_vals(n.meta.get("val")))
        for fake in expected:
            _check_static_shape(n, fake)
        try:
            result = super().run_node(n)
        except Exception as exc:
            first = first_line(exc)
            raise HarnessError(
                f"node {n.name} ({op_name(n.target)}) cannot run with the types it was given: {first}"
            ) from exc
        actual = list(tensor_vals(result))
        for real, fake in zip(actual, expected, strict=False):
            if real.dtype != fake.dtype or tuple(real.shape) != tuple(fake.shape):
                raise AssertionError(
                    f"compiler bug: node {n.name} runs as {real.dtype}{list(real.shape)} "
                    f"but its metadata says {fake.dtype}{list(fake.shape)}"
                )
        return result


def _check_static_shape(n: torch.fx.Node, fake: torch.Tensor) -> None:
    """Refuse a node whose output shape depends on the input values (``x[x > 0]``, ``nonzero``).

    torch.export traces such a node with an unbacked size symbol (``u0``);
    comparing it with a real shape raises a 60-line data-dependent-guard
    error, and no engine can allocate an output whose size only the data
    knows. Named here, before the node runs, as one error.
    """
    symbolic = [str(d) for d in fake.shape if free_unbacked_symbols(d)]
    if symbolic:
        shape = ", ".join(str(d) for d in fake.shape)
        raise HarnessError(
            f"node {n.name} ({op_name(n.target)}) has an output shape that depends on the input values "
            f"([{shape}]; {', '.join(symbolic)} is only known at run time), as boolean-mask indexing or "
            "nonzero() give; engines need shapes known at compile time: index with a fixed-size "
            "operation (torch.where, masked_fill) instead"
        )


def verify_graph(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> None:
    try:
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):
            _Checker(gm).run(*inputs)
    except HarnessError as exc:
        # fx.Interpreter appends the node's source and a tlparse hint; keep one clear line.
        raise HarnessError(str(exc).strip().splitlines()[0]) from exc.__cause__
