"""Attention, ``softmax(q @ kᵀ · scale) @ v``, as three of oneDNN's primitives on the operands' own strides.

ATen's fused attention for CPU (``_scaled_dot_product_flash_attention_for_cpu``)
works through blocks of queries and keys with its own GEMM calls, and in bf16
widens every block of scores to fp32 and back in separate loops. The same
attention as oneDNN's batched matmul (the scale as its post-op, scores in
fp32), its softmax and a second batched matmul runs each step as one kernel
over every head, which is the faster on the modest sequence lengths whose
scores fit (:data:`MAX_SCORES_BYTES`), most of all in bf16.

The matmuls read the operands where they are: a head split by ``view`` and
``transpose`` (``[B, S, H, D]`` seen as ``[B, H, S, D]``) is described by its
strides, not copied, and ``kᵀ`` is ``k``'s strides swapped. The result is laid
out as ATen's fused call lays it out, heads split from a ``[B, S, H, D]``
tensor, so that merging the heads back is a view. The scores and the
softmax's result live in buffers of each thread's own.

Precision follows ATen's fused call: fp32 scores (the matmul accumulates in
fp32 and applies the scale before rounding), an fp32 softmax, its result
rounded to the inputs' type for the product with ``v``, which accumulates in
fp32 and rounds once.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness.dtypes import dtype_name
from harness.engines.cpu.onednn_primitive import (
    ARG_DST,
    ARG_POST_OP_0,
    ARG_SCRATCHPAD,
    ARG_SRC,
    ARG_SRC_1,
    ARG_WEIGHTS,
    LIBRARY,
    MAX_DIMS,
    QUERY_EXEC_ARG_MD,
    VOID,
    Arg,
    BinaryPostOp,
    Eltwise,
    ThreadRuns,
    describing,
    free_owned,
    layout_tag,
    library,
    owned_memory,
)
from harness.errors import HarnessError
from harness.extras import install_command

Strides = tuple[int, ...]
# The mask's argument: the operand of the first matmul's second post-op (the scale is its first).
_ARG_MASK = 2 * ARG_POST_OP_0 | ARG_SRC_1  # DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1
# The largest scores an attention takes. Unlike ATen's fused call, which works through blocks
# of queries and keys, it holds all of them, in fp32, per thread (with the softmax's result
# and maybe an expanded mask beside them): a 2048-token layer of 32 heads would hold 512 MiB.
MAX_SCORES_BYTES = 32 << 20
# A thread's call for one thread count and the operands' strides: (q, k, v) -> result.
_Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention:
    """``scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale)`` without
    dropout, for fixed shapes, a constant mask (or none) and one dtype (fp32, bf16, or fp16
    where oneDNN has kernels).

    The mask (boolean, or added to the scores; broadcast over them) or the
    causal one is added to the scaled scores by the first matmul, as its
    post-op, in fp32. Where oneDNN has no optimized kernel for the mask's
    broadcast (over heads but not batches, say), the mask is expanded to the
    scores' shape once. A mask that hides every key from some query is
    refused: ATen gives such a query zeros, a softmax of nothing but
    ``-inf`` gives NaN.

    The primitives depend on the thread count (their blocking) and on the
    operands' strides, so they are created per pair, once, and shared by
    every thread; the ones for heads split from ``[B, S, H, D]`` tensors are
    created with the object, so an engine that cannot create them fails where
    it is built or loaded, and its first run pays no kernel generation. Other
    strides get theirs on first sight, or, where oneDNN has only a reference
    loop for them, run on contiguous copies. Each thread has its own memory
    objects, scratchpads and score buffers.
    """

    tactic = "sdpa_dnnl"
    kind = "attention"

    def __init__(
        self,
        dtype: torch.dtype,
        query: Sequence[int],
        key: Sequence[int],
        value: Sequence[int],
        scale: float | None = None,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> None:
        lib = library()
        if lib is None:
            raise HarnessError(f"oneDNN primitives need the library at {LIBRARY}: {install_command('onednn')}")
        self._lib = lib
        self.shapes = (tuple(query), tuple(key), tuple(value))
        q, k, v = self.shapes
        if not fits(q, k, v):
            raise HarnessError(
                f"{self.tactic}: query {q}, key {k} and value {v} do not make an attention it runs: it "
                f"takes 3 to {MAX_DIMS} dimensions, the same leading ones (no broadcasting), keys and "
                "values of the same length, queries and keys of the same width, and fp32 scores of at "
                f"most {MAX_SCORES_BYTES >> 20} MiB"
            )
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(q[-1]) if scale is None else float(scale)
        self.out_shape = (*q[:-1], v[-1])
        self._scores = (*q[:-1], k[-2])
        self._mask = additive_mask(self._scores, mask, causal)
        self._out_strides = split_heads_strides(self.out_shape)
        # (thread count, strides of q, k, v) -> the three primitives, or None where oneDNN has
        # no optimized kernel for those strides
        self._shared: dict[tuple[int, Strides, Strides, Strides], tuple[VOID, ...] | None] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # .calls: (threads, strides...) -> _Call; .runs: ThreadRuns
        self._owned: list[tuple[str, VOID]] = []
        weakref.finalize(self, free_owned, lib, self._owned)
        if self._mask is not None and self._mask.shape != self._scores and self._reference_kernel(self._split_key()):
            self._mask = self._mask.expand(self._scores).contiguous()
        if not describing():
            self._thread_call(self._split_key())

    def impl(self) -> str:
        """oneDNN's implementations of the three steps, for heads split from ``[B, S, H, D]``
        tensors at the current thread count (``brg:avx512_core, jit:avx512_core, ...``)."""
        descs = self._descs(*self._split_key()[1:])
        try:
            return ", ".join(self._lib.impl(pd) for pd in descs)
        finally:
            self._lib.destroy("primitive_desc", *descs)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key = (torch.get_num_threads(), q.stride(), k.stride(), v.stride())
        run: _Call
        try:
            run = self._local.calls[key]
        except (AttributeError, KeyError):  # this thread's first call at this thread count and strides
            self._check(q, k, v)
            run = self._thread_call(key)
        return run(q, k, v)

    def _split_key(self) -> tuple[int, Strides, Strides, Strides]:
        q, k, v = (split_heads_strides(shape) for shape in self.shapes)
        return torch.get_num_threads(), q, k, v

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """oneDNN would read whatever memory the pointers lead to: refuse what does not fit."""
        got = tuple((t.dtype, tuple(t.shape)) for t in (q, k, v))
        if got != tuple((self.dtype, shape) for shape in self.shapes):
            wanted = ", ".join(f"{dtype_name(self.dtype)} {shape}" for shape in self.shapes)
            given = ", ".join(f"{dtype} {shape}" for dtype, shape in got)
            raise HarnessError(f"{self.tactic}: expected query, key and value {wanted}; got {given}")

    def _descs(self, q: Strides, k: Strides, v: Strides) -> tuple[VOID, VOID, VOID]:
        """The three primitive descriptors for operands of strides ``q``, ``k``, ``v`` (the
        caller frees them)."""
        lib, dtype = self._lib, self.dtype
        qs, ks, vs = self.shapes
        descs: list[VOID] = []
        attrs: list[VOID] = []
        made: list[VOID] = []
        try:
            descs += [
                lib.strided_desc(qs, dtype, q),
                lib.strided_desc((*ks[:-2], ks[-1], ks[-2]), dtype, (*k[:-2], k[-1], k[-2])),  # kᵀ
                lib.strided_desc(vs, dtype, v),
                lib.desc(self._scores, torch.float32, layout_tag(torch.contiguous_format, len(qs))),
                lib.desc(self._scores, dtype, layout_tag(torch.contiguous_format, len(qs))),
                lib.strided_desc(self.out_shape, dtype, self._out_strides),
            ]
            q_md, kt_md, v_md, scores_md, probs_md, out_md = descs
            mask_md = None
            if self._mask is not None:
                descs.append(mask_md := lib.strided_desc(self._mask.shape, torch.float32, self._mask.stride()))
            # q @ kᵀ scales its scores and adds the mask as post-ops.
            scale_ops: list[Eltwise | BinaryPostOp] = [Eltwise("linear", self.scale)]
            if mask_md is not None:
                scale_ops.append(BinaryPostOp("binary_add", mask_md))
            attrs = [lib.attributes(scale_ops), lib.attributes(), lib.attributes()]
            steps: list[tuple[str, Callable[[Any], int]]] = [
                ("q @ kᵀ", lambda pd: lib.lib.dnnl_matmul_primitive_desc_create(
                    pd, lib.engine, q_md, kt_md, None, scores_md, attrs[0])),
                ("the softmax", lambda pd: lib.lib.dnnl_softmax_forward_primitive_desc_create(
                    pd, lib.engine, lib.prop_kinds["forward_inference"], lib.algorithms["softmax_accurate"],
                    scores_md, probs_md, len(qs) - 1, attrs[1])),
                ("@ v", lambda pd: lib.lib.dnnl_matmul_primitive_desc_create(
                    pd, lib.engine, probs_md, v_md, None, out_md, attrs[2])),
            ]
            for doing, create in steps:
                pd = VOID()
                lib.check(create(ctypes.byref(pd)), f"creating {doing} of a {dtype_name(dtype)} attention {qs}")
                made.append(pd)
            first, second, third = made
            made = []
            return first, second, third
        finally:
            lib.destroy("primitive_desc", *made)
            lib.destroy("primitive_attr", *attrs)
            lib.destroy("memory_desc", *descs)

    def _reference_kernel(self, key: tuple[int, Strides, Strides, Strides]) -> bool:
        """Whether one of oneDNN's kernels for ``key`` is a reference loop."""
        descs = self._descs(*key[1:])
        try:
            return self._reference(descs)
        finally:
            self._lib.destroy("primitive_desc", *descs)

    def _reference(self, descs: Sequence[VOID]) -> bool:
        return any(self._lib.impl(pd).startswith("ref") for pd in descs)

    def _primitives(self, key: tuple[int, Strides, Strides, Strides]) -> tuple[VOID, ...] | None:
        """The shared descriptors and primitives for ``key``, created once; None where one of
        oneDNN's kernels for them is a reference loop."""
        lib = self._lib
        with self._lock:
            if key not in self._shared:
                descs = self._descs(*key[1:])
                if self._reference(descs):
                    lib.destroy("primitive_desc", *descs)
                    self._shared[key] = None
                else:
                    self._owned += [("primitive_desc", pd) for pd in descs]
                    primitives = []
                    for pd in descs:
                        primitives.append(lib.primitive(pd))
                        self._owned.append(("primitive", primitives[-1]))
                    self._shared[key] = (*descs, *primitives)
            return self._shared[key]

    def _thread_call(self, key: tuple[int, Strides, Strides, Strides]) -> _Call:
        """This thread's call for ``key`` (thread count, strides), made once."""
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = {}
            self._local.runs = ThreadRuns(self._lib)
        shared = self._primitives(key)
        if shared is not None:
            call: _Call = self._runner(shared, self._local.runs)
        else:  # no optimized kernel for these strides: run on contiguous copies
            q, k, v = (_contiguous_strides(shape) for shape in self.shapes)
            if key[1:] == (q, k, v):
                raise HarnessError(
                    f"{self.tactic}: oneDNN {self._lib.version} has only reference kernels for a "
                    f"{dtype_name(self.dtype)} attention {self.shapes}"
                )
            plain_key = (key[0], q, k, v)
            plain = calls[plain_key] if plain_key in calls else self._thread_call(plain_key)

            def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return plain(q.contiguous(), k.contiguous(), v.contiguous())

        calls[key] = call
        return call

    def _runner(self, shared: tuple[VOID, ...], runs: ThreadRuns) -> _Call:
        """The per-call path: the operands' pointers set, the three primitives run."""
        lib = self._lib
        descs, primitives = shared[:3], shared[3:]

        def memory(pd: VOID, arg: int, data: int = 0) -> VOID:
            md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, arg)
            return owned_memory(lib, runs.owned, md, data)

        runs.buffers.append(scores := torch.empty(self._scores, dtype=torch.float32))
        # In fp32 the softmax runs in place, on the scores.
        probs = scores if self.dtype == torch.float32 else torch.empty(self._scores, dtype=self.dtype)
        runs.buffers.append(probs)
        q, kt = memory(descs[0], ARG_SRC), memory(descs[0], ARG_WEIGHTS)
        v, out = memory(descs[2], ARG_WEIGHTS), memory(descs[2], ARG_DST)
        operands = [
            [Arg(ARG_SRC, q), Arg(ARG_WEIGHTS, kt), Arg(ARG_DST, memory(descs[0], ARG_DST, scores.data_ptr()))],
            [
                Arg(ARG_SRC, memory(descs[1], ARG_SRC, scores.data_ptr())),
                Arg(ARG_DST, memory(descs[1], ARG_DST, probs.data_ptr())),
            ],
            [Arg(ARG_SRC, memory(descs[2], ARG_SRC, probs.data_ptr())), Arg(ARG_WEIGHTS, v), Arg(ARG_DST, out)],
        ]
        if self._mask is not None:
            operands[0].append(Arg(_ARG_MASK, memory(descs[0], _ARG_MASK, self._mask.data_ptr())))
        for pd, args in zip(descs, operands, strict=True):
            scratchpad = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, ARG_SCRATCHPAD)
            if size := lib.lib.dnnl_memory_desc_get_size(scratchpad):
                runs.buffers.append(buffer := torch.empty(size, dtype=torch.uint8))
                args.append(Arg(ARG_SCRATCHPAD, owned_memory(lib, runs.owned, scratchpad, buffer.data_ptr())))
        arrays = [(Arg * len(args))(*args) for args in operands]
        runs.arrays += arrays
        (p1, p2, p3), stream = primitives, runs.stream
        (n1, n2, n3), (a1, a2, a3) = (len(a) for a in arrays), (ctypes.cast(a, VOID) for a in arrays)
        set_handle, execute = lib.lib.dnnl_memory_set_data_handle, lib.lib.dnnl_primitive_execute
        result = functools.partial(torch.empty_strided, self.out_shape, self._out_strides, dtype=self.dtype)
        dtype, shapes, check = self.dtype, self.shapes, self._check

        def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            if (
                query.dtype is not dtype
                or key.dtype is not dtype
                or value.dtype is not dtype
                or (query.shape, key.shape, value.shape) != shapes
            ):
                check(query, key, value)
            y = result()
            set_handle(q, query.data_ptr())
            set_handle(kt, key.data_ptr())
            set_handle(v, value.data_ptr())
            set_handle(out, y.data_ptr())
            status = execute(p1, stream, n1, a1) or execute(p2, stream, n2, a2) or execute(p3, stream, n3, a3)
            if status:
                lib.check(status, "running an attention")
            return y

        return run


def additive_mask(scores: tuple[int, ...], mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """What :class:`Attention` adds to the scaled ``scores``: ``mask`` (``-inf`` where a boolean
    one is False) or the causal mask, in fp32 and of the scores' rank; None for neither."""
    if causal and mask is not None:
        raise HarnessError("an attention takes a mask or is causal, not both (as ATen's)")
    if causal:
        mask = torch.ones(scores[-2:], dtype=torch.bool).tril()
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    mask = mask.float().reshape((1,) * (len(scores) - mask.dim()) + tuple(mask.shape))
    if mask.dim() != len(scores) or any(m not in (1, n) for m, n in zip(mask.shape, scores, strict=True)):
        raise HarnessError(f"a mask {tuple(mask.shape)} does not broadcast over an attention's scores {scores}")
    if torch.isneginf(mask).all(-1).any():
        raise HarnessError(
            "the mask hides every key from some query, which ATen answers with zeros and a softmax with NaN"
        )
    return mask.contiguous()


def fits(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> bool:
    """Whether :class:`Attention` takes operands of these shapes."""
    q, k, v = tuple(query), tuple(key), tuple(value)
    return (
        3 <= len(q) <= MAX_DIMS
        and len(q) == len(k) == len(v)
        and q[:-2] == k[:-2] == v[:-2]
        and k[-2] == v[-2]
        and q[-1] == k[-1]
        and math.prod(q[:-1]) * k[-2] * 4 <= MAX_SCORES_BYTES
    )


def split_heads_strides(shape: Sequence[int]) -> Strides:
    """The strides of a 4-D ``[B, H, S, D]`` tensor whose heads were split from a contiguous
    ``[B, S, H, D]`` one (``view`` then ``transpose(1, 2)``); a contiguous tensor's for other ranks."""
    if len(shape) != 4:
        return _contiguous_strides(shape)
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def _contiguous_strides(shape: Sequence[int]) -> Strides:
    return tuple(torch.empty(tuple(shape), device="meta").stride())
