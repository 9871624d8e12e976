"""oneDNN's matmul primitive called through libdnnl's C API, for linear layers.

PyTorch reaches oneDNN only through ops that rebuild the primitive
descriptor on every call (``mkldnn._linear_pointwise``) or through the
TorchScript bridge (:mod:`harness.engines.cpu.onednn_graph`), and its own
fp32 GEMM is MKL's, which on AMD CPUs takes its AVX2 path. A primitive
created once, with its weight reordered once into the layout the kernel
wants, its bias, residual and activation as post-ops and its memory objects
reused, costs a call the kernel plus about two microseconds (the result's
allocation, two ctypes calls). On an AMD EPYC (AVX-512 BF16), one thread,
side by side in one process, the zoo's digits layers (batch 64): 64->64
with relu 7.9 µs against 9.1 µs for ATen's MKL GEMM on a pre-transposed
weight (the oneDNN kernel itself: 5.9 µs), 64->10 4.5 µs against 8.2 µs.

The library is the ``onednn-cpu-gomp`` wheel (the ``onednn`` extra): its
CPU runtime is GNU OpenMP, and loaded after torch it shares torch's
``libgomp.so.1`` (the soname is already loaded), so ``torch.set_num_threads``
governs it as it governs ATen. A primitive fixes its blocking for the thread
count it was created at, so one is created per thread count, on first use,
and shared by every thread. Memory objects carry data pointers, so each
thread running the layer has its own, freed when that thread ends.

Enum values are looked up by name through the library's own ``*2str``
functions, not copied from headers, so another oneDNN 3 build cannot
silently mean another algorithm.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.dtypes import dtype_from_name, dtype_name
from harness.errors import HarnessError
from harness.extras import install_command

log = logging.getLogger(__name__)

# Where the onednn-cpu-gomp wheel puts the library: its data files go under the environment's prefix.
LIBRARY = Path(sys.prefix) / "lib" / "libdnnl.so.3"
_RUNTIME_OMP = 2  # DNNL_RUNTIME_OMP (dnnl_config.h)
_MAX_DIMS = 12  # DNNL_MAX_NDIMS
_ARG_SRC, _ARG_SRC_1, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 2, 17, 33, 41
_ARG_POST_OP_0 = 32768  # DNNL_ARG_ATTR_MULTIPLE_POST_OP(0)
_QUERY_IMPL_INFO_STR = 8  # dnnl_query_impl_info_str: stable since oneDNN 1.0
_QUERY_EXEC_ARG_MD = 255
_ENGINE_CPU = 1
_STREAM_IN_ORDER = 1
_DIMS = ctypes.c_int64 * _MAX_DIMS
_VOID = ctypes.c_void_p


class _Version(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    ]


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _VOID)]


@dataclass(frozen=True)
class Eltwise:
    """A oneDNN eltwise post-op: its algorithm's name (``dnnl_alg_kind2str``) and parameters."""

    algorithm: str
    alpha: float = 0.0
    beta: float = 0.0


class _Library:
    """The loaded libdnnl, its CPU engine and stream, and enum values resolved by name."""

    def __init__(self, path: Path) -> None:
        # Loaded after torch: its libgomp.so.1 dependency resolves to torch's, by soname.
        before = openmp_runtimes()
        self.lib = lib = ctypes.CDLL(str(path))
        self.openmp_added = openmp_runtimes() - before
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        version = lib.dnnl_version().contents
        self.version = f"{version.major}.{version.minor}.{version.patch}"
        if version.major != 3 or version.cpu_runtime != _RUNTIME_OMP:
            raise OSError(
                f"{path} is oneDNN {self.version} with CPU runtime {version.cpu_runtime}; "
                f"expected oneDNN 3 on OpenMP ({_RUNTIME_OMP}), whose threads torch sets"
            )
        if self.openmp_added:
            raise OSError(
                f"{path} brought its own OpenMP runtime ({', '.join(sorted(self.openmp_added))}): "
                "its threads would not follow torch.set_num_threads"
            )
        for name in ("dnnl_alg_kind2str", "dnnl_fmt_tag2str", "dnnl_dt2str", "dnnl_status2str"):
            getattr(lib, name).restype = ctypes.c_char_p
        lib.dnnl_primitive_desc_query_md.restype = _VOID
        lib.dnnl_primitive_desc_query_md.argtypes = [_VOID, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [_VOID]
        lib.dnnl_memory_set_data_handle.argtypes = [_VOID, _VOID]
        lib.dnnl_primitive_execute.argtypes = [_VOID, _VOID, ctypes.c_int, _VOID]
        # eltwise kinds from 0x20, binary ones from 0x1fff0 (dnnl_types.h)
        self.algorithms = _names(lib.dnnl_alg_kind2str, [*range(0x20, 0x100), *range(0x1FFF0, 0x20000)])
        self.tags = _names(lib.dnnl_fmt_tag2str, range(0, 64))
        self.types = _names(lib.dnnl_dt2str, range(0, 16))
        self.engine = _VOID()
        self.check(lib.dnnl_engine_create(ctypes.byref(self.engine), _ENGINE_CPU, 0), "creating the CPU engine")
        self.stream = _VOID()
        self.check(
            lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _STREAM_IN_ORDER), "creating a stream"
        )

    def check(self, status: int, doing: str) -> None:
        if status != 0:
            raise HarnessError(f"oneDNN {self.version} failed {doing}: {self.lib.dnnl_status2str(status).decode()}")

    def desc(self, shape: Sequence[int], dtype: torch.dtype, tag: str) -> _VOID:
        md = _VOID()
        name = dtype_name(dtype)
        if name not in _DNNL_TYPES:
            raise HarnessError(f"oneDNN primitives here take {', '.join(_DNNL_TYPES)}, not {name}")
        self.check(
            self.lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(md), len(shape), _DIMS(*shape), self.types[_DNNL_TYPES[name]], self.tags[tag]
            ),
            f"describing a {name} {tuple(shape)} tensor",
        )
        return md

    def memory(self, md: _VOID | int, data: int = 0) -> _VOID:
        mem, md = _VOID(), md if isinstance(md, _VOID) else _VOID(md)
        self.check(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, _VOID(data)), "creating memory")
        return mem

    def primitive(self, pd: _VOID) -> _VOID:
        prim = _VOID()
        self.check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "creating a primitive")
        return prim

    def execute(self, prim: _VOID, args: ctypes.Array[_Arg], doing: str) -> None:
        self.check(self.lib.dnnl_primitive_execute(prim, self.stream, len(args), ctypes.cast(args, _VOID)), doing)
        self.check(self.lib.dnnl_stream_wait(self.stream), doing)

    def destroy(self, kind: str, *handles: Any) -> None:
        """Free oneDNN objects (``kind``: memory_desc, primitive_desc, primitive_attr, post_ops,
        memory, primitive); descriptors are copied by what is created from them."""
        free = getattr(self.lib, f"dnnl_{kind}_destroy")
        for handle in handles:
            if handle is not None:
                free(handle)

    def impl(self, pd: _VOID) -> str:
        info = ctypes.c_char_p()
        self.check(self.lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO_STR, 0, ctypes.byref(info)), "a query")
        return (info.value or b"").decode()


# The project's dtype names -> oneDNN's (dnnl_dt2str).
_DNNL_TYPES = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def openmp_runtimes() -> set[str]:
    """The OpenMP libraries mapped into this process (Linux; empty where that cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}


def _names(to_str: Any, values: Iterable[int]) -> dict[str, int]:
    """Name -> value of a oneDNN enum, from the library's own printer (``undef``/unknown skipped)."""
    found: dict[str, int] = {}
    for value in values:
        name = to_str(value)
        if name and not name.startswith(b"unknown"):
            found.setdefault(name.decode().removeprefix("eltwise_"), value)
    return found


@functools.cache
def library() -> _Library | None:
    """The library, or None (logged once) where the ``onednn`` extra is not installed or unusable."""
    if not LIBRARY.is_file():
        log.debug("no %s (%s): gemm_dnnl is not offered", LIBRARY, install_command("onednn"))
        return None
    try:
        return _Library(LIBRARY)
    except (OSError, AttributeError, KeyError, HarnessError) as exc:
        log.warning("oneDNN at %s is not usable (%s); gemm_dnnl is not offered", LIBRARY, exc)
        return None


@functools.cache
def available(precision: str) -> bool:
    """Whether a linear layer of ``precision`` gets an optimized (not reference) oneDNN kernel here.

    oneDNN falls back to reference C++ loops where the CPU lacks the ISA
    (fp16 without AVX-512 FP16): correct, but tens of times slower, so never a
    sensible candidate to time.
    """
    if library() is None or precision not in _DNNL_TYPES:
        return False
    dtype = dtype_from_name(precision)
    try:
        impl = Matmul(torch.zeros(16, 16, dtype=dtype), None, (16, 16), None, None).impl()
    except HarnessError as exc:
        log.debug("oneDNN matmul in %s: %s", precision, exc)
        return False
    return not impl.startswith("ref")


class Matmul:
    """``act(x @ weight.T + bias [+ residual])`` as a oneDNN matmul primitive, for fixed shapes.

    ``x`` is ``input_shape`` (any leading dimensions; the rows are their
    product), ``weight`` is [N, K] as in ``torch.nn.functional.linear``, and
    the residual, when given, has the result's shape and ``residual`` dtype.
    The result has the weight's dtype: oneDNN accumulates in fp32 and rounds
    once, after the bias, residual and activation.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_shape: Sequence[int],
        eltwise: Eltwise | None,
        residual: torch.dtype | None,
    ) -> None:
        lib = library()
        if lib is None:
            raise HarnessError(f"gemm_dnnl needs oneDNN's library at {LIBRARY}: {install_command('onednn')}")
        self._lib = lib
        n, k = weight.shape
        if input_shape[-1] != k:
            raise HarnessError(f"gemm_dnnl: input {tuple(input_shape)} does not end in the weight's K={k}")
        self.rows = math.prod(input_shape[:-1])
        self.in_shape, self.out_shape = tuple(input_shape), (*input_shape[:-1], n)
        self.dtype = weight.dtype
        self._weight = weight.detach().contiguous()  # [N, K] row-major: oneDNN's {K, N} in "ba"
        self._bias = None if bias is None else bias.detach().reshape(1, n).contiguous()
        self._eltwise, self._residual = eltwise, residual
        # thread count -> its primitive descriptor, primitive and packed weight (buffer, memory)
        self._shared: dict[int, tuple[_VOID, _VOID, torch.Tensor, _VOID]] = {}
        self._local = threading.local()  # .runs: this thread's _ThreadRuns
        self._lock = threading.Lock()
        # The shared primitives, descriptors and weight memories, freed with this object.
        self._owned: list[tuple[str, _VOID]] = []
        weakref.finalize(self, _free, lib, self._owned)
        # Created now, not on the first call: that call would pay the kernel's JIT generation
        # (milliseconds), which the builder's whole-run timing must not see, and an engine
        # that cannot create its primitive fails where it is built or loaded.
        self._state()

    def impl(self) -> str:
        """The implementation oneDNN chose at the current thread count (``brg:avx512_core``)."""
        pd = self._desc()
        try:
            return self._lib.impl(pd)
        finally:
            self._lib.destroy("primitive_desc", pd)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        run: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
        try:
            run = self._local.runs.calls[torch.get_num_threads()]
        except (AttributeError, KeyError):  # this thread's first call at this thread count
            run = self._state()
        return run(x, residual)

    def _desc(self) -> _VOID:
        """The primitive descriptor, weights in the layout oneDNN prefers (the caller frees it)."""
        lib, raw = self._lib, self._lib.lib
        n, k = self._weight.shape
        if self._eltwise is not None and self._eltwise.algorithm not in lib.algorithms:
            raise HarnessError(f"oneDNN {lib.version} has no eltwise {self._eltwise.algorithm!r}")
        attr, post_ops, pd = _VOID(), _VOID(), _VOID()
        descs: list[_VOID | None] = []
        try:
            descs += [
                lib.desc((self.rows, k), self.dtype, "ab"),
                lib.desc((k, n), self.dtype, "any"),
                None if self._bias is None else lib.desc(self._bias.shape, self._bias.dtype, "ab"),
                lib.desc((self.rows, n), self.dtype, "ab"),
            ]
            lib.check(raw.dnnl_primitive_attr_create(ctypes.byref(attr)), "creating attributes")
            lib.check(raw.dnnl_post_ops_create(ctypes.byref(post_ops)), "creating post-ops")
            if self._residual is not None:
                descs.append(lib.desc((self.rows, n), self._residual, "ab"))
                add = lib.algorithms["binary_add"]
                lib.check(raw.dnnl_post_ops_append_binary(post_ops, add, descs[-1]), "adding a residual post-op")
            if self._eltwise is not None:
                alpha, beta = ctypes.c_float(self._eltwise.alpha), ctypes.c_float(self._eltwise.beta)
                algorithm = lib.algorithms[self._eltwise.algorithm]
                lib.check(raw.dnnl_post_ops_append_eltwise(post_ops, algorithm, alpha, beta), "adding an activation")
            lib.check(raw.dnnl_primitive_attr_set_post_ops(attr, post_ops), "setting post-ops")
            lib.check(
                raw.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), lib.engine, *descs[:4], attr),
                f"creating a {dtype_name(self.dtype)} matmul ({self.rows}x{k} by {k}x{n})",
            )
        finally:
            lib.destroy("memory_desc", *descs)
            lib.destroy("post_ops", post_ops if post_ops.value else None)
            lib.destroy("primitive_attr", attr if attr.value else None)
        return pd

    def _state(self) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """This thread's call of the current thread count's primitive, each created once."""
        threads, lib = torch.get_num_threads(), self._lib
        with self._lock:
            if threads not in self._shared:
                pd = self._desc()
                self._owned.append(("primitive_desc", pd))
                primitive = lib.primitive(pd)
                self._owned.append(("primitive", primitive))
                self._shared[threads] = (pd, primitive, *self._pack(pd))
            pd, primitive, _, weights = self._shared[threads]
        runs = getattr(self._local, "runs", None)
        if runs is None:
            runs = self._local.runs = _ThreadRuns(lib)

        def memory(arg: int, data: int = 0) -> _VOID:
            md = lib.lib.dnnl_primitive_desc_query_md(pd, _QUERY_EXEC_ARG_MD, arg)
            return _owned_memory(lib, runs.owned, md, data)

        src, dst = memory(_ARG_SRC), memory(_ARG_DST)
        args = [_Arg(_ARG_SRC, src), _Arg(_ARG_WEIGHTS, weights), _Arg(_ARG_DST, dst)]
        if self._bias is not None:
            args.append(_Arg(_ARG_BIAS, memory(_ARG_BIAS, self._bias.data_ptr())))
        residual = None
        if self._residual is not None:
            residual = memory(_ARG_POST_OP_0 | _ARG_SRC_1)
            args.append(_Arg(_ARG_POST_OP_0 | _ARG_SRC_1, residual))
        array = (_Arg * len(args))(*args)
        runs.arrays.append(array)  # ctypes.cast keeps no reference to it
        run = runs.calls[threads] = self._runner(primitive, src, dst, residual, array)
        return run

    def _runner(
        self, primitive: _VOID, src: _VOID, dst: _VOID, residual: _VOID | None, args: ctypes.Array[_Arg]
    ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """The per-call path, everything it touches bound as locals: at 64x64x64 the kernel
        takes 6 µs, and attribute lookups and argument conversions had added 4 more.

        No ``dnnl_stream_wait``: on oneDNN's OpenMP runtime a CPU primitive has
        finished when ``dnnl_primitive_execute`` returns. The operands are
        checked first (dtype, element count, the residual's presence), as oneDNN
        would read whatever memory their pointers lead to.
        """
        lib, empty, shape, dtype = self._lib, torch.empty, self.out_shape, self.dtype
        set_handle, execute = lib.lib.dnnl_memory_set_data_handle, lib.lib.dnnl_primitive_execute
        stream, count, pointer = lib.stream, len(args), ctypes.cast(args, _VOID)
        memories = (src, dst) if residual is None else (src, dst, residual)
        sizes = (math.prod(self.in_shape), math.prod(shape))
        wants_residual, residual_dtype = residual is not None, self._residual
        wanted = f"{dtype_name(dtype)} {self.in_shape}"
        if residual_dtype is not None:
            wanted += f" and a {dtype_name(residual_dtype)} {shape} residual"
        # The data pointers last set: the allocator often hands a run the same addresses.
        last = [0, 0, 0]

        def run(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
            if x.dtype is not dtype or x.numel() != sizes[0] or (r is not None) is not wants_residual:
                _refuse(wanted, x, r)
            x = x.contiguous()
            if r is not None:
                if r.dtype is not residual_dtype or r.numel() != sizes[1]:
                    _refuse(wanted, x, r)
                r = r.contiguous()  # held until the primitive has run
            y = empty(*shape, dtype=dtype)  # unpacked: torch parses a shape tuple 0.5 µs slower
            pointers = (x.data_ptr(), y.data_ptr(), 0 if r is None else r.data_ptr())
            for i, memory in enumerate(memories):
                if pointers[i] != last[i]:
                    set_handle(memory, pointers[i])
                    last[i] = pointers[i]
            status = execute(primitive, stream, count, pointer)
            if status:
                lib.check(status, "running a matmul")
            return y

        return run

    def _pack(self, pd: _VOID) -> tuple[torch.Tensor, _VOID]:
        """The weight reordered once into the primitive's layout, in a buffer this object owns."""
        lib = self._lib
        n, k = self._weight.shape
        packed_md = lib.lib.dnnl_primitive_desc_query_md(pd, _QUERY_EXEC_ARG_MD, _ARG_WEIGHTS)
        buffer = torch.empty(lib.lib.dnnl_memory_desc_get_size(packed_md), dtype=torch.uint8)
        packed = _owned_memory(lib, self._owned, packed_md, buffer.data_ptr())
        plain_md = lib.desc((k, n), self.dtype, "ba")
        reorder_pd, plain, reorder = _VOID(), None, None
        try:
            lib.check(
                lib.lib.dnnl_reorder_primitive_desc_create(
                    ctypes.byref(reorder_pd), plain_md, lib.engine, _VOID(packed_md), lib.engine, None
                ),
                "describing the weight's reorder",
            )
            plain = lib.memory(plain_md, self._weight.data_ptr())
            reorder = lib.primitive(reorder_pd)
            lib.execute(reorder, (_Arg * 2)(_Arg(_ARG_SRC, plain), _Arg(_ARG_DST, packed)), "reordering the weight")
        finally:
            lib.destroy("primitive", reorder)
            lib.destroy("memory", plain)
            lib.destroy("primitive_desc", reorder_pd if reorder_pd.value else None)
            lib.destroy("memory_desc", plain_md)
        return buffer, packed


def _refuse(wanted: str, x: torch.Tensor, r: torch.Tensor | None) -> None:
    got = f"{x.dtype} {tuple(x.shape)}" + ("" if r is None else f" and a {r.dtype} {tuple(r.shape)} residual")
    raise HarnessError(f"gemm_dnnl: expected {wanted}, got {got}")


class _ThreadRuns:
    """One thread's calls of a :class:`Matmul` (per thread count) and the memory objects and
    argument arrays they use, freed when the thread ends or the Matmul goes."""

    def __init__(self, lib: _Library) -> None:
        self.calls: dict[int, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {}
        self.arrays: list[ctypes.Array[_Arg]] = []
        self.owned: list[tuple[str, _VOID]] = []
        weakref.finalize(self, _free, lib, self.owned)


def _owned_memory(lib: _Library, owned: list[tuple[str, _VOID]], md: int, data: int) -> _VOID:
    """A memory object on ``md`` (and ``data``), listed in ``owned`` to be freed with its owner."""
    memory = lib.memory(md, data)
    owned.append(("memory", memory))
    return memory


def _free(lib: _Library, owned: list[tuple[str, _VOID]]) -> None:
    for kind, handle in reversed(owned):
        lib.destroy(kind, handle)
