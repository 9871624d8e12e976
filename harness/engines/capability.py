"""What this CPU runs natively, asked of the runtimes themselves; and the CPU kinds the project knows.

Every decision an engine takes by ISA asks :func:`current`, never a CPU flag:

* ATen's reduced-precision matmuls and convolutions are native where torch
  routes them to oneDNN (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``,
  ``..._fp16_supported()``); elsewhere ATen runs generic loops that convert
  every element in software (:meth:`Capability.aten_native`).
* A oneDNN primitive's kernel is the implementation its primitive descriptor
  names (``dnnl_query_impl_info_str``), asked without creating the primitive
  (:meth:`Capability.onednn_kernel`): ``ref:*`` is a reference loop,
  ``None`` means oneDNN has no kernel at all (``unimplemented``).
* OpenVINO's CPU plugin is asked by compiling a probe
  (:mod:`harness.engines.openvino.probe`), which consults
  :meth:`Capability.openvino_runs_in` first.

:data:`KINDS` are the kinds of CPU seen so far, each with the answers its
probes give. :func:`forced` makes one of them the current capability, so
that every ISA-dependent decision can be checked for every kind on any
machine; a kind this CPU can be reduced to (``ONEDNN_MAX_CPU_ISA``) is also
checked against the real answers (``tests/test_cpu_kinds.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from harness import precision
from harness.errors import HarnessError

PRECISIONS = precision.PRECISIONS
# The primitives whose kernels the CPU engine asks about, by the name the tables use.
PRIMITIVES = ("matmul", "convolution", "pooling", "binary", "layernorm", "reorder", "attention")
# A reorder's precision is its conversion, "source>target".
REORDERS = tuple(f"{s}>{t}" for s in PRECISIONS for t in PRECISIONS if s != t)


def reference_kernel(primitive: str, precision: str, impl: str | None) -> str | None:
    """Why the kernel ``impl`` of a ``primitive`` of ``precision`` is not a native one (None: it is).

    ``None`` is no kernel; a part named ``ref...`` is oneDNN's reference loop;
    a reorder that is not JIT-compiled (``simple:any``) is a generic C++ loop.
    """
    what = f"{precision} conversion" if primitive == "reorder" else f"{precision} {primitive}"
    if impl is None:
        return f"oneDNN has no {what} kernel here"
    if any(part.startswith("ref") for part in impl.split(", ")):
        return f"oneDNN has only its reference loop for this {what} here ({impl})"
    if primitive == "reorder" and not impl.startswith("jit"):
        return f"oneDNN's {what} is a generic loop here ({impl}), not JIT-compiled"
    return None


class Capability(Protocol):
    """The answers to every question an ISA-dependent decision asks."""

    @property
    def name(self) -> str:
        """What the answers are of: "this CPU", or a known kind's name."""
        ...

    def aten_native(self, precision: str) -> bool:
        """Whether ATen computes ``precision`` matmuls and convolutions natively (fp32 always)."""
        ...

    def onednn_kernel(
        self, primitive: str, precision: str, signature: Hashable, describe: Callable[[], str | None]
    ) -> str | None:
        """The implementation oneDNN picks for a ``primitive`` of ``precision`` described by
        ``signature`` at the current thread count (None: oneDNN has none). ``describe`` asks
        the real library."""
        ...

    def openvino_runs_in(self, dtype: str, hint: str) -> str | None:
        """The precision OpenVINO runs a ``dtype`` MatMul in under ``hint``; None: ask OpenVINO."""
        ...


class ThisMachine:
    """This machine's answers, from torch and the libraries; oneDNN's cached per signature and thread count."""

    name = "this CPU"

    def __init__(self) -> None:
        self._kernels: dict[Hashable, str | None] = {}
        self._lock = threading.Lock()

    def aten_native(self, precision: str) -> bool:
        if precision == "fp32":
            return True
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        if precision == "bf16":
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if precision == "fp16":
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        return False

    def onednn_kernel(
        self, primitive: str, precision: str, signature: Hashable, describe: Callable[[], str | None]
    ) -> str | None:
        key = (primitive, precision, signature, torch.get_num_threads())
        with self._lock:
            if key in self._kernels:
                return self._kernels[key]
        impl = describe()
        with self._lock:
            self._kernels[key] = impl
        return impl

    def openvino_runs_in(self, dtype: str, hint: str) -> str | None:
        return None


@dataclass(frozen=True)
class CpuKind:
    """A kind of CPU, as its probes answer.

    ``kernels`` maps "primitive precision" (:data:`PRIMITIVES`; a reorder's
    precision is ``source>target``) to the implementation oneDNN 3.2 names
    for the engine's probe of that primitive (``standard_kernels`` in
    :mod:`harness.engines.cpu.onednn_primitive`); a pair it lacks has no
    kernel. Per-layer questions get the answer of their primitive and
    precision, whatever the layer's shape. ``openvino`` maps "dtype hint" to
    the precision OpenVINO's CPU plugin runs its probe MatMul in.
    """

    name: str
    # The ONEDNN_MAX_CPU_ISA value that reduces a larger CPU to this kind, and the
    # dnnl_cpu_isa_t value oneDNN 3 then reports as its effective ISA.
    onednn_isa: str
    onednn_isa_value: int
    native: frozenset[str]
    kernels: Mapping[str, str]
    openvino: Mapping[str, str]
    source: str  # where the tables come from

    def aten_native(self, precision: str) -> bool:
        return precision == "fp32" or precision in self.native

    def onednn_kernel(
        self, primitive: str, precision: str, signature: Hashable, describe: Callable[[], str | None]
    ) -> str | None:
        return self.kernels.get(f"{primitive} {precision}")

    def openvino_runs_in(self, dtype: str, hint: str) -> str | None:
        return self.openvino[f"{dtype} {hint}"]


# The CPU kinds seen. A pair a table lacks has no kernel there (oneDNN: unimplemented).
AVX2 = CpuKind(
    name="avx2",
    onednn_isa="AVX2",
    onednn_isa_value=0x7,
    native=frozenset(),
    kernels={
        "matmul fp32": "gemm:jit:f32",
        "convolution fp32": "brgconv:avx2",
        "pooling fp32": "jit:avx2",
        "binary fp32": "jit:uni",
        "layernorm fp32": "jit:uni",
        "attention fp32": "gemm:jit:f32, jit:avx2, gemm:jit:f32",
        **{f"reorder {r}": "simple:any" for r in ("fp32>bf16", "bf16>fp32", "fp32>fp16", "fp16>fp32")},
    },
    openvino={"fp32 bf16": "fp32", "fp32 f16": "fp32", "bf16 f32": "fp32", "fp16 f32": "fp32"},
    source="oneDNN 3.2 reduced to AVX2 (ONEDNN_MAX_CPU_ISA) on an AMD EPYC with AVX-512 BF16; "
    "OpenVINO as on an AMD EPYC with AVX2 only, which runs every probe in f32",
)
AVX512_BF16 = CpuKind(
    name="avx512-bf16",
    onednn_isa="AVX512_CORE_BF16",
    onednn_isa_value=0xE7,
    native=frozenset({"bf16"}),
    kernels={
        "matmul fp32": "brg:avx512_core",
        "matmul bf16": "brg:avx512_core_bf16",
        "convolution fp32": "brgconv:avx512_core",
        "convolution bf16": "brgconv:avx512_core_bf16",
        "pooling fp32": "jit:avx512_core",
        "pooling bf16": "jit:avx512_core_bf16",
        "binary fp32": "jit:uni",
        "binary bf16": "jit:uni",
        "layernorm fp32": "jit:uni",
        "layernorm bf16": "jit:uni",
        "attention fp32": "brg:avx512_core, jit:avx512_core_bf16, brg:avx512_core",
        "attention bf16": "brg:avx512_core_bf16, jit:avx512_core_bf16, brg:avx512_core_bf16",
        "reorder fp32>bf16": "jit:uni",
        "reorder bf16>fp32": "jit:uni",
        "reorder fp32>fp16": "simple:any",
        "reorder fp16>fp32": "simple:any",
    },
    openvino={"fp32 bf16": "bf16", "fp32 f16": "bf16", "bf16 f32": "bf16", "fp16 f32": "fp32"},
    source="oneDNN 3.2 and OpenVINO 2025 on an AMD EPYC (Zen 5) with AVX-512 BF16",
)
AVX512_FP16_AMX = CpuKind(
    name="avx512-fp16-amx",
    onednn_isa="AVX512_CORE_AMX",
    onednn_isa_value=0xFEF,
    native=frozenset({"bf16", "fp16"}),
    kernels={
        "matmul fp32": "brg:avx512_core",
        "matmul bf16": "brg:avx512_core_amx",
        "matmul fp16": "brg:avx512_core_fp16",
        "convolution fp32": "brgconv:avx512_core",
        "convolution bf16": "brgconv:avx512_core_amx",
        "convolution fp16": "brgconv:avx512_core_fp16",
        **{f"pooling {p}": "jit:avx512_core_fp16" for p in ("bf16", "fp16")},
        "pooling fp32": "jit:avx512_core",
        **{f"{p} {q}": "jit:uni" for p in ("binary", "layernorm") for q in PRECISIONS},
        "attention fp32": "brg:avx512_core, jit:avx512_core_fp16, brg:avx512_core",
        "attention bf16": "brg:avx512_core_amx, jit:avx512_core_fp16, brg:avx512_core_amx",
        "attention fp16": "brg:avx512_core_fp16, jit:avx512_core_fp16, brg:avx512_core_fp16",
        **{f"reorder {r}": "jit:uni" for r in ("fp32>bf16", "bf16>fp32", "fp32>fp16", "fp16>fp32")},
    },
    openvino={"fp32 bf16": "bf16", "fp32 f16": "fp16", "bf16 f32": "bf16", "fp16 f32": "fp32"},
    source="an Intel Xeon with AMX-BF16 and AVX-512 FP16 (Sapphire Rapids class): the bf16 matmul's name "
    "from oneDNN 3.2.0's benchdnn on such a CPU (uxlfoundation/oneDNN#1992), the fp16 matmul's from an "
    "Intel Xeon with AVX-512 FP16; the others as oneDNN names that ISA's kernels, not recorded here",
)
KINDS = (AVX2, AVX512_BF16, AVX512_FP16_AMX)

_REAL = ThisMachine()
_current: list[Capability] = [_REAL]


def current() -> Capability:
    """The capability every ISA-dependent decision asks: this machine's, unless :func:`forced`."""
    return _current[-1]


def kind(name: str) -> CpuKind:
    """The known kind named ``name``."""
    for known in KINDS:
        if known.name == name:
            return known
    raise HarnessError(f"unknown CPU kind {name!r}; known: {', '.join(k.name for k in KINDS)}")


@contextmanager
def forced(answers: Capability) -> Iterator[Capability]:
    """Within the block, every decision takes ``answers`` (a known kind, typically) instead of
    this machine's.

    For checking decisions only: kernels ``answers`` has and this CPU lacks
    cannot run here.
    """
    _current.append(answers)
    try:
        yield answers
    finally:
        _current.remove(answers)
