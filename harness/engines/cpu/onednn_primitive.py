"""oneDNN's matmul, convolution, pooling, binary, layer-normalization and reorder primitives
called through libdnnl's C API.

PyTorch reaches oneDNN only through ops that rebuild the primitive
descriptor on every call (``mkldnn._linear_pointwise``,
``mkldnn._convolution_pointwise``) or through the TorchScript bridge
(:mod:`harness.engines.cpu.onednn_graph`, an executor per partition), and
its own fp32 GEMM is MKL's, which on AMD CPUs takes its AVX2 path. A
primitive here is created once, with its weight reordered once into the
layout the kernel wants, its bias, residual and activation as post-ops and
its memory objects reused, so a call costs the kernel plus the result's
allocation and two ctypes calls: on small layers that is the faster
tactic. Convolutions run channels-last in and out, the layout of the
kernels PyTorch's oneDNN Graph partitions run (``brgconv``, ``brdgmm_dw``),
so a chain of them needs no reorder. A primitive accumulates in fp32 and
rounds its result once, after the bias, residual and activation.

The library is the ``onednn-cpu-gomp`` wheel (the ``onednn`` extra): its
CPU runtime is GNU OpenMP, and loaded after torch it shares torch's
``libgomp.so.1`` (the soname is already loaded), so ``torch.set_num_threads``
governs it as it governs ATen. A primitive fixes its blocking for the thread
count it was created at, so one is created per thread count, on first use,
and shared by every thread. That takes a scratchpad per thread: oneDNN's
default is one for every primitive, which pins a primitive to the thread
that created it (shared by several threads, it gives wrong results). Memory
objects carry data pointers, so each thread running the layer has its own,
with its own stream and scratchpad, freed when that thread ends.

Every libdnnl function called is declared in :data:`SIGNATURES` (restype and
argtypes from oneDNN 3's C API), applied when the library loads; no other
function of the library can be called. Enum values are looked up by name
through the library's own ``*2str`` functions, not copied from headers, so
another oneDNN 3 build cannot silently mean another algorithm. A library
that is not oneDNN 3 on OpenMP, or lacks a declared function, is not used
(:func:`library` gives None and the primitive tactics are not offered).
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import math
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.dtypes import dtype_name
from harness.errors import HarnessError
from harness.extras import install_command

log = logging.getLogger(__name__)

# Where the onednn-cpu-gomp wheel puts the library: its data files go under the environment's prefix.
LIBRARY = Path(sys.prefix) / "lib" / "libdnnl.so.3"
_RUNTIME_OMP = 2  # DNNL_RUNTIME_OMP (dnnl_config.h)
MAX_DIMS = 12  # DNNL_MAX_NDIMS
# Execution arguments, attributes and queries (dnnl_types.h); :mod:`harness.engines.cpu.
# onednn_attention` builds on these too, as on the library, memory and per-thread helpers below.
ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_SCRATCHPAD = 1, 2, 17, 33, 41, 80
ARG_SCALE, ARG_SHIFT = 51, 52  # a normalization's
_USE_SCALE, _USE_SHIFT = 0x2, 0x4  # dnnl_normalization_flags_t
SCRATCHPAD_USER = 1  # dnnl_scratchpad_mode_user
ARG_POST_OP_0 = 32768  # DNNL_ARG_ATTR_MULTIPLE_POST_OP(0)
_QUERY_IMPL_INFO_STR = 8  # dnnl_query_impl_info_str: stable since oneDNN 1.0
QUERY_EXEC_ARG_MD = 255
_ENGINE_CPU = 1
_STREAM_IN_ORDER = 1
_DIMS = ctypes.c_int64 * MAX_DIMS
# Inputs with at most this many channels are images, which callers pass plain (NCHW).
_PLAIN_INPUT_CHANNELS = 4
VOID = ctypes.c_void_p
# Gives a thread the tensor its results go into: (shape, strides, dtype) -> tensor.
ResultSlot = Callable[[tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor]


class _Version(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    ]


class Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", VOID)]


@dataclass(frozen=True)
class Eltwise:
    """A oneDNN eltwise post-op: its algorithm's name (``dnnl_alg_kind2str``) and parameters."""

    algorithm: str
    alpha: float = 0.0
    beta: float = 0.0


@dataclass(frozen=True)
class BinaryPostOp:
    """A oneDNN binary post-op: its algorithm's name and the second operand's memory descriptor."""

    algorithm: str
    operand: VOID


# Every libdnnl function the engine calls, by name: (restype, argtypes) as oneDNN 3's C API
# declares it (dnnl.h, dnnl_common.h, dnnl_debug.h). Handles (dnnl_engine_t, dnnl_memory_desc_t,
# dnnl_primitive_desc_t, ...) are pointers; the enums (dnnl_status_t, dnnl_data_type_t,
# dnnl_alg_kind_t, ...) are C ints; a dnnl_dims_t argument is a pointer to MAX_DIMS int64s.
_STATUS = _ENUM = ctypes.c_int
_MADE = ctypes.POINTER(VOID)  # where a call that creates a handle writes it
_DIMS_ARG = ctypes.POINTER(ctypes.c_int64)
# The objects :meth:`_Library.destroy` frees, each by its dnnl_<kind>_destroy.
_DESTROYED = ("memory_desc", "primitive_desc", "primitive_attr", "post_ops", "memory", "primitive", "stream")
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    # service and the enums' names
    "dnnl_version": (ctypes.POINTER(_Version), ()),
    "dnnl_get_effective_cpu_isa": (_ENUM, ()),
    "dnnl_status2str": (ctypes.c_char_p, (_ENUM,)),
    "dnnl_dt2str": (ctypes.c_char_p, (_ENUM,)),
    "dnnl_fmt_tag2str": (ctypes.c_char_p, (_ENUM,)),
    "dnnl_prop_kind2str": (ctypes.c_char_p, (_ENUM,)),
    "dnnl_alg_kind2str": (ctypes.c_char_p, (_ENUM,)),
    # engine and stream
    "dnnl_engine_create": (_STATUS, (_MADE, _ENUM, ctypes.c_size_t)),
    "dnnl_stream_create": (_STATUS, (_MADE, VOID, ctypes.c_uint)),
    "dnnl_stream_wait": (_STATUS, (VOID,)),
    # memory: descriptor (ndims, dims, data type, tag or strides), size, object, data handle
    "dnnl_memory_desc_create_with_tag": (_STATUS, (_MADE, ctypes.c_int, _DIMS_ARG, _ENUM, _ENUM)),
    "dnnl_memory_desc_create_with_strides": (_STATUS, (_MADE, ctypes.c_int, _DIMS_ARG, _ENUM, _DIMS_ARG)),
    "dnnl_memory_desc_get_size": (ctypes.c_size_t, (VOID,)),
    "dnnl_memory_create": (_STATUS, (_MADE, VOID, VOID, VOID)),
    "dnnl_memory_set_data_handle": (_STATUS, (VOID, VOID)),
    # attributes: scratchpad mode, post-ops (eltwise: algorithm, alpha, beta; binary: algorithm, operand)
    "dnnl_primitive_attr_create": (_STATUS, (_MADE,)),
    "dnnl_primitive_attr_set_scratchpad_mode": (_STATUS, (VOID, _ENUM)),
    "dnnl_primitive_attr_set_post_ops": (_STATUS, (VOID, VOID)),
    "dnnl_post_ops_create": (_STATUS, (_MADE,)),
    "dnnl_post_ops_append_eltwise": (_STATUS, (VOID, _ENUM, ctypes.c_float, ctypes.c_float)),
    "dnnl_post_ops_append_binary": (_STATUS, (VOID, _ENUM, VOID)),
    # primitive descriptors: (out, engine, [prop kind, algorithm,] memory descriptors..., attr)
    "dnnl_matmul_primitive_desc_create": (_STATUS, (_MADE, VOID, VOID, VOID, VOID, VOID, VOID)),
    "dnnl_convolution_forward_primitive_desc_create": (
        _STATUS,
        (_MADE, VOID, _ENUM, _ENUM, VOID, VOID, VOID, VOID, _DIMS_ARG, _DIMS_ARG, _DIMS_ARG, _DIMS_ARG, VOID),
    ),
    "dnnl_pooling_forward_primitive_desc_create": (
        _STATUS,
        (_MADE, VOID, _ENUM, _ENUM, VOID, VOID, _DIMS_ARG, _DIMS_ARG, _DIMS_ARG, _DIMS_ARG, _DIMS_ARG, VOID),
    ),
    "dnnl_binary_primitive_desc_create": (_STATUS, (_MADE, VOID, _ENUM, VOID, VOID, VOID, VOID)),
    "dnnl_layer_normalization_forward_primitive_desc_create": (
        _STATUS,
        (_MADE, VOID, _ENUM, VOID, VOID, VOID, ctypes.c_float, ctypes.c_uint, VOID),
    ),
    "dnnl_softmax_forward_primitive_desc_create": (_STATUS, (_MADE, VOID, _ENUM, _ENUM, VOID, VOID, ctypes.c_int, VOID)),
    "dnnl_reorder_primitive_desc_create": (_STATUS, (_MADE, VOID, VOID, VOID, VOID, VOID)),
    # queries: (descriptor, what, index[, result])
    "dnnl_primitive_desc_query": (_STATUS, (VOID, _ENUM, ctypes.c_int, VOID)),
    "dnnl_primitive_desc_query_md": (VOID, (VOID, _ENUM, ctypes.c_int)),
    # primitives: created from a descriptor, run on a stream with (argument, memory) pairs
    "dnnl_primitive_create": (_STATUS, (_MADE, VOID)),
    "dnnl_primitive_execute": (_STATUS, (VOID, VOID, ctypes.c_int, VOID)),
    **{f"dnnl_{kind}_destroy": (_STATUS, (VOID,)) for kind in _DESTROYED},
}


class _Api:
    """libdnnl's functions in :data:`SIGNATURES`, declared with their restype and argtypes when
    the library loads; a function the table lacks is an AttributeError, never called with
    ctypes' default conversions."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
            setattr(self, name, function)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"libdnnl's {name} is not declared in onednn_primitive.SIGNATURES")


class _Library:
    """The loaded libdnnl (its functions as :data:`SIGNATURES` declares them), its CPU engine,
    and enum values resolved by name. OSError where the library is not oneDNN 3 on torch's
    OpenMP runtime; AttributeError where it lacks a declared function."""

    def __init__(self, path: Path) -> None:
        # Loaded after torch: its libgomp.so.1 dependency resolves to torch's, by soname.
        before = openmp_runtimes()
        self.lib = lib = _Api(path)
        self.openmp_added = openmp_runtimes() - before
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
        # The dnnl_cpu_isa_t value of the kernels oneDNN generates here (ONEDNN_MAX_CPU_ISA lowers it).
        self.isa = int(lib.dnnl_get_effective_cpu_isa())
        # convolution kinds from 1, eltwise ones from 0x20, pooling ones at 0x1ff, 0x2ff and
        # 0x3ff, binary ones from 0x1fff0, softmax ones from 0x30000 (dnnl_types.h)
        kinds = [*range(1, 0x100), *range(0x1FF, 0x400, 0x100), *range(0x1FFF0, 0x20000), *range(0x30000, 0x30010)]
        self.algorithms = _names(lib.dnnl_alg_kind2str, kinds)
        self.prop_kinds = _names(lib.dnnl_prop_kind2str, range(1, 0x100))
        self.tags = _names(lib.dnnl_fmt_tag2str, range(0, 64))
        self.types = _names(lib.dnnl_dt2str, range(0, 16))
        self.engine = VOID()
        self.check(lib.dnnl_engine_create(ctypes.byref(self.engine), _ENGINE_CPU, 0), "creating the CPU engine")

    def check(self, status: int, doing: str) -> None:
        if status != 0:
            raise HarnessError(f"oneDNN {self.version} failed {doing}: {self.lib.dnnl_status2str(status).decode()}")

    def desc(self, shape: Sequence[int], dtype: torch.dtype, tag: str) -> VOID:
        md = VOID()
        self.check(
            self.lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(md), len(shape), _DIMS(*shape), self._type(dtype), self.tags[tag]
            ),
            f"describing a {dtype_name(dtype)} {tuple(shape)} tensor",
        )
        return md

    def strided_desc(self, shape: Sequence[int], dtype: torch.dtype, strides: Sequence[int]) -> VOID:
        """A tensor's description by its strides (in elements), as torch gives them."""
        md = VOID()
        self.check(
            self.lib.dnnl_memory_desc_create_with_strides(
                ctypes.byref(md), len(shape), _DIMS(*shape), self._type(dtype), _DIMS(*strides)
            ),
            f"describing a {dtype_name(dtype)} {tuple(shape)} tensor of strides {tuple(strides)}",
        )
        return md

    def _type(self, dtype: torch.dtype) -> int:
        name = dtype_name(dtype)
        if name not in _DNNL_TYPES:
            raise HarnessError(f"oneDNN primitives here take {', '.join(_DNNL_TYPES)}, not {name}")
        return self.types[_DNNL_TYPES[name]]

    def memory(self, md: VOID | int, data: int = 0) -> VOID:
        mem, md = VOID(), _handle(md)
        self.check(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, VOID(data)), "creating memory")
        return mem

    def primitive(self, pd: VOID) -> VOID:
        prim = VOID()
        self.check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "creating a primitive")
        return prim

    def stream(self) -> VOID:
        """A new in-order stream (the caller frees it): streams are not shared between threads."""
        stream = VOID()
        self.check(self.lib.dnnl_stream_create(ctypes.byref(stream), self.engine, _STREAM_IN_ORDER), "creating a stream")
        return stream

    def execute(self, prim: VOID, args: ctypes.Array[Arg], doing: str) -> None:
        """Run ``prim`` once, on a stream of its own (a one-off: a weight's reorder)."""
        stream = self.stream()
        try:
            self.check(self.lib.dnnl_primitive_execute(prim, stream, len(args), ctypes.cast(args, VOID)), doing)
            self.check(self.lib.dnnl_stream_wait(stream), doing)
        finally:
            self.destroy("stream", stream)

    def attributes(self, post_ops: Sequence[Eltwise | BinaryPostOp] = ()) -> VOID:
        """Primitive attributes with ``post_ops`` in order and a scratchpad per thread (the
        caller frees them).

        Each thread gives a shared primitive a scratchpad of its own: with oneDNN's default
        (one scratchpad for every primitive of the library) a primitive must run in the
        thread that created it.
        """
        raw = self.lib
        for op in post_ops:
            if op.algorithm not in self.algorithms:
                raise HarnessError(f"oneDNN {self.version} has no post-op algorithm {op.algorithm!r}")
        attr, ops = VOID(), VOID()
        self.check(raw.dnnl_primitive_attr_create(ctypes.byref(attr)), "creating attributes")
        try:
            self.check(raw.dnnl_primitive_attr_set_scratchpad_mode(attr, SCRATCHPAD_USER), "setting the scratchpad")
            if post_ops:
                self.check(raw.dnnl_post_ops_create(ctypes.byref(ops)), "creating post-ops")
                for op in post_ops:
                    algorithm = self.algorithms[op.algorithm]
                    if isinstance(op, Eltwise):
                        status = raw.dnnl_post_ops_append_eltwise(ops, algorithm, op.alpha, op.beta)
                    else:
                        status = raw.dnnl_post_ops_append_binary(ops, algorithm, op.operand)
                    self.check(status, f"adding a {op.algorithm} post-op")
                self.check(raw.dnnl_primitive_attr_set_post_ops(attr, ops), "setting post-ops")
        except HarnessError:
            self.destroy("primitive_attr", attr)
            raise
        finally:
            self.destroy("post_ops", ops if ops.value else None)
        return attr

    def reorder_desc(self, source: VOID | int, target: VOID | int, attr: VOID | None = None) -> VOID:
        """A reorder's descriptor, from ``source``'s layout and type to ``target``'s (the caller frees it)."""
        pd = VOID()
        self.check(
            self.lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(pd), _handle(source), self.engine, _handle(target), self.engine, attr
            ),
            "describing a reorder",
        )
        return pd

    def reorder(self, source: VOID | int, target: VOID | int) -> tuple[VOID, VOID]:
        """A reorder primitive's descriptor and primitive, from ``source``'s layout to ``target``'s
        (the caller frees both)."""
        pd = self.reorder_desc(source, target)
        try:
            return pd, self.primitive(pd)
        except HarnessError:
            self.destroy("primitive_desc", pd)
            raise

    def destroy(self, kind: str, *handles: Any) -> None:
        """Free oneDNN objects (``kind``: memory_desc, primitive_desc, primitive_attr, post_ops,
        memory, primitive, stream); descriptors are copied by what is created from them."""
        free = getattr(self.lib, f"dnnl_{kind}_destroy")
        for handle in handles:
            if handle is not None:
                free(handle)

    def impl(self, pd: VOID) -> str:
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
        log.debug("no %s (%s): its primitive tactics are not offered", LIBRARY, install_command("onednn"))
        return None
    try:
        return _Library(LIBRARY)
    except (OSError, AttributeError, KeyError, HarnessError) as exc:
        log.warning("oneDNN at %s is not usable (%s); its primitive tactics are not offered", LIBRARY, exc)
        return None


# Set while :func:`kernel_of` makes an object that only describes its primitive.
_describing = threading.local()


def kernel_of(make: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """The implementation oneDNN picks (``brg:avx512_core``, ``ref:any``) for the primitive(s)
    ``make(*args, **kwargs)`` would create, at the current thread count, asked of the
    descriptors alone: nothing is created or JIT-compiled. None where oneDNN has no kernel
    for it, or the arguments make no primitive (the reason is logged at debug level).

    ``make`` is a primitive class of this module or of
    :mod:`harness.engines.cpu.onednn_attention`: one whose constructor creates nothing
    while :func:`describing` and whose ``impl()`` names the implementation.
    """
    _describing.on = True
    try:
        return str(make(*args, **kwargs).impl())
    except HarnessError as exc:
        log.debug("%s: %s", getattr(make, "tactic", make), exc)
        return None
    finally:
        _describing.on = False


def describing() -> bool:
    """Whether the object being made only describes its primitive (see :func:`kernel_of`)."""
    return bool(getattr(_describing, "on", False))


class _Primitive:
    """A oneDNN primitive for fixed shapes: a weight (if any) packed once, bias, residual and
    activation as post-ops; one primitive per thread count shared by every thread, memory
    objects per thread.

    Subclasses say which primitive (:meth:`_create`), the weight's plain layout
    (:meth:`_plain_weight`, where there is a weight), how oneDNN sees an
    activation (:meth:`_dims`), the layouts of the input and result
    (``input_layout``, ``layout``) and whether a plain input is reordered by
    oneDNN (:meth:`_takes_plain_input`). The result has ``dtype``: oneDNN
    accumulates in fp32 and rounds once, after the bias, residual and activation.

    ``result``: where a thread's results go when nothing reads a result after
    its last reader in the caller's run (the engine's program decides that and
    plans the memory, shared with other layers' results once dead: see
    :func:`harness.engines.cpu.program.private_results`). Called once in each
    thread with the result's shape, strides and dtype, it gives the tensor
    that receives every result of that thread; without it each call
    allocates a new tensor.
    """

    tactic = ""  # the engine's name of the tactic running it
    kind = ""  # the primitive, as harness.engines.capability names it
    layout = torch.contiguous_format  # of the result and the second input
    input_layout = torch.contiguous_format
    # The second input (given as ``residual``): oneDNN's argument for it, and what errors call it.
    # By default the operand of a binary-add post-op, of the result's shape.
    second_arg = ARG_POST_OP_0 | ARG_SRC_1
    second_name = "residual"

    def __init__(
        self,
        dtype: torch.dtype,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        eltwise: Eltwise | None = None,
        residual: torch.dtype | None = None,
        result: ResultSlot | None = None,
        input_dtype: torch.dtype | None = None,
    ) -> None:
        lib = library()
        if lib is None:
            raise HarnessError(f"oneDNN primitives need the library at {LIBRARY}: {install_command('onednn')}")
        self._lib = lib
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self._dst_dims = self._dims(self.out_shape)
        self.dtype = dtype
        self.input_dtype = dtype if input_dtype is None else input_dtype
        self._weight = None if weight is None else weight.detach().contiguous()
        self._bias = None if bias is None else bias.detach().contiguous()
        self._eltwise, self._residual, self._result = eltwise, residual, result
        # thread count -> its primitive descriptor, primitive and packed weight (buffer, memory)
        self._shared: dict[int, tuple[VOID, VOID, torch.Tensor | None, VOID | None]] = {}
        self._local = threading.local()  # .runs: this thread's ThreadRuns
        self._lock = threading.Lock()
        # The shared primitives, descriptors and weight memories, freed with this object.
        self._owned: list[tuple[str, VOID]] = []
        weakref.finalize(self, free_owned, lib, self._owned)
        # Created now, not on the first call: that call would pay the kernel's JIT generation
        # (milliseconds), which the builder's whole-run timing must not see, and an engine
        # that cannot create its primitive fails where it is built or loaded.
        if not describing():
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
            run = self._local.runs.calls[torch.get_num_threads()].run
        except (AttributeError, KeyError):  # this thread's first call at this thread count
            run = self._state().run
        return run(x, residual)

    def thread_run(self) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """This thread's call at the current thread count, ``run(x, residual_or_None)``: a call
        without looking up the thread's memory objects, for a caller that keeps one per thread
        and thread count."""
        return self._thread().run

    def thread_result(self) -> torch.Tensor | None:
        """The tensor this thread's results go into (see ``result``); None without a result slot."""
        return self._thread().result

    def pinned(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Callable[[], int] | None:
        """This thread's bare call of the primitive on ``x`` (and ``residual``), into
        :meth:`thread_result`, for a caller whose operands never move: results planned in
        the same arena. The call returns oneDNN's status (see :meth:`failed`).

        It skips the per-call checks and pointer updates, so it is only given
        for operands that fit: the right dtype and size, in
        the primitive's layouts, with a result slot. None otherwise. The
        operands are held as long as the primitive, and the latest pin stands:
        a normal call from this thread afterwards puts its handles back after
        running, and a new pin replaces the bare call's operands.
        """
        return self._thread().pin(x, residual)

    def failed(self, status: int) -> None:
        """Raise the error of a failed call's ``status`` (a pinned call's return value)."""
        self._lib.check(status, f"running a {type(self).__name__.lower()}")

    def _thread(self) -> _ThreadCall:
        try:
            return self._local.runs.calls[torch.get_num_threads()]  # type: ignore[no-any-return]
        except (AttributeError, KeyError):
            return self._state()

    def _dims(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """How oneDNN sees an activation of ``shape`` (the input's, the result's)."""
        return shape

    def _second_shape(self) -> tuple[int, ...]:
        """The second input's shape: a residual has the result's."""
        return self.out_shape

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        """The primitive descriptor with ``attr``; descriptors it creates go in ``descs`` (freed by the caller)."""
        raise NotImplementedError

    def _plain_weight(self) -> tuple[tuple[int, ...], str]:
        """The weight's dims and tag as oneDNN describes ``self._weight``'s memory."""
        raise NotImplementedError

    def _desc(self) -> VOID:
        """The primitive descriptor, weights in the layout oneDNN prefers (the caller frees it)."""
        lib = self._lib
        descs: list[VOID | None] = []
        post_ops: list[Eltwise | BinaryPostOp] = []
        attr = None
        try:
            if self._residual is not None and self.second_arg & ARG_POST_OP_0:
                residual = lib.desc(self._dst_dims, self._residual, layout_tag(self.layout, len(self._dst_dims)))
                descs.append(residual)
                post_ops.append(BinaryPostOp("binary_add", residual))
            if self._eltwise is not None:
                post_ops.append(self._eltwise)
            attr = lib.attributes(post_ops)
            return self._create(attr, descs)
        finally:
            lib.destroy("memory_desc", *descs)
            lib.destroy("primitive_attr", attr)

    def _state(self) -> _ThreadCall:
        """This thread's calls of the current thread count's primitive, each created once."""
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
            runs = self._local.runs = ThreadRuns(lib)

        def memory(arg: int, data: int = 0) -> VOID:
            md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, arg)
            return owned_memory(lib, runs.owned, md, data)

        src, dst = memory(ARG_SRC), memory(ARG_DST)
        args = [Arg(ARG_SRC, src), Arg(ARG_DST, dst)]
        if weights is not None:
            args.append(Arg(ARG_WEIGHTS, weights))
        for arg, tensor in self._constants():
            args.append(Arg(arg, memory(arg, tensor.data_ptr())))
        residual = None
        if self._residual is not None:
            residual = memory(self.second_arg)
            args.append(Arg(self.second_arg, residual))
        scratchpad = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, ARG_SCRATCHPAD)
        if size := lib.lib.dnnl_memory_desc_get_size(scratchpad):
            runs.buffers.append(buffer := torch.empty(size, dtype=torch.uint8))
            args.append(Arg(ARG_SCRATCHPAD, owned_memory(lib, runs.owned, scratchpad, buffer.data_ptr())))
        array = (Arg * len(args))(*args)
        runs.arrays.append(array)  # held as long as the memory objects it names
        staging = None
        if self._takes_plain_input():
            md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, ARG_SRC)
            reorder, plain = self._input_reorder(md, runs.owned)
            runs.arrays.append(staged := (Arg * 2)(Arg(ARG_SRC, plain), Arg(ARG_DST, src)))
            staging = (reorder, plain, staged)
        call = runs.calls[threads] = self._runner(primitive, runs.stream, src, dst, residual, array, staging)
        return call

    def _constants(self) -> list[tuple[int, torch.Tensor]]:
        """The operands every call reads as they are, by oneDNN's argument (this object holds them)."""
        return [] if self._bias is None else [(ARG_BIAS, self._bias)]

    def _takes_plain_input(self) -> bool:
        """Whether the input may arrive plain, to be reordered by oneDNN (see :meth:`_input_reorder`)."""
        return False

    def _input_reorder(self, md: int, owned: list[tuple[str, VOID]]) -> tuple[VOID, VOID]:
        """A reorder primitive from a plain input to ``md`` (the primitive's input), and a memory
        object for the plain input, both listed in ``owned``. Made per thread: a reorder runs
        on the library's scratchpad, so in the thread that created it."""
        lib = self._lib
        plain_md = lib.desc(self.in_shape, self.input_dtype, layout_tag(torch.contiguous_format, len(self.in_shape)))
        try:
            reorder_pd, reorder = lib.reorder(plain_md, md)
            owned += [("primitive_desc", reorder_pd), ("primitive", reorder)]
            return reorder, owned_memory(lib, owned, plain_md, 0)
        finally:
            lib.destroy("memory_desc", plain_md)

    def _runner(
        self,
        primitive: VOID,
        stream: VOID,
        src: VOID,
        dst: VOID,
        residual: VOID | None,
        args: ctypes.Array[Arg],
        staging: tuple[VOID, VOID, ctypes.Array[Arg]] | None,
    ) -> _ThreadCall:
        """The per-call path, everything it touches bound as locals (on a small layer,
        attribute lookups and argument conversions cost as much as the kernel), and the
        pinned path (see :meth:`pinned`) on the same memory objects.

        No ``dnnl_stream_wait``: on oneDNN's OpenMP runtime a CPU primitive has
        finished when ``dnnl_primitive_execute`` returns. The operands are
        checked first (dtype, element count, the residual's presence), as oneDNN
        would read whatever memory their pointers lead to, then given the
        primitive's layout.
        """
        lib, shape, dtype, in_dtype, tactic = self._lib, self.out_shape, self.dtype, self.input_dtype, self.tactic
        set_handle, execute = lib.lib.dnnl_memory_set_data_handle, lib.lib.dnnl_primitive_execute
        count, pointer = len(args), ctypes.cast(args, VOID)
        memories = (src, dst) if residual is None else (src, dst, residual)
        sizes = (math.prod(self.in_shape), math.prod(self._second_shape()))
        wants_residual, residual_dtype = residual is not None, self._residual
        wanted = f"{dtype_name(in_dtype)} {self.in_shape}"
        if residual_dtype is not None:
            wanted += f" and a {dtype_name(residual_dtype)} {self._second_shape()} {self.second_name}"
        input_layout = self.input_layout
        as_input, as_result = _to_layout(input_layout), _to_layout(self.layout)
        result = _allocator(shape, dtype, self.layout)
        fixed = None
        if self._result is not None:  # this thread's one result tensor, written again by every call
            fixed = self._result(shape, _strides(shape, self.layout), dtype)
            result = itertools.repeat(fixed).__next__
        # The data pointers last set: the allocator often hands a run the same addresses.
        last = [0, 0, 0]
        # The bare call's pointers and operands (see pin), held alive: a normal call that moves
        # the handles puts them back once it has run, so the bare call stays right.
        pinned: list[Any] = []
        if staging is not None:
            reorder, plain, staged = staging[0], staging[1], ctypes.cast(staging[2], VOID)
            staged_input = _allocator(self.in_shape, in_dtype, input_layout)

            def stage(x: torch.Tensor) -> torch.Tensor:
                """A plain ``x`` in the input layout, by oneDNN's reorder (set as the input)."""
                y = staged_input()
                set_handle(plain, x.data_ptr())
                last[0] = y.data_ptr()
                set_handle(src, last[0])
                lib.check(execute(reorder, stream, 2, staged), "reordering the input")
                return y

        def run(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
            if x.dtype is not in_dtype or x.numel() != sizes[0] or (r is not None) is not wants_residual:
                _refuse(tactic, wanted, x, r, self.second_name)
            if staging is not None and not x.is_contiguous(memory_format=input_layout) and x.is_contiguous():
                x = stage(x)
            else:
                x = as_input(x)
            if r is not None:
                if r.dtype is not residual_dtype or r.numel() != sizes[1]:
                    _refuse(tactic, wanted, x, r, self.second_name)
                r = as_result(r)  # held until the primitive has run
            y = result()
            pointers = [x.data_ptr(), y.data_ptr(), 0 if r is None else r.data_ptr()]
            if pointers != last:  # one comparison where the allocator gave the last call's addresses
                for i, memory in enumerate(memories):
                    if pointers[i] != last[i]:
                        set_handle(memory, pointers[i])
                        last[i] = pointers[i]
            status = execute(primitive, stream, count, pointer)
            if pinned and last != pinned[0]:
                for memory, address in zip(memories, pinned[0], strict=False):
                    set_handle(memory, address)
                last[:] = pinned[0]
            if status:
                self.failed(status)
            return y

        def pin(x: torch.Tensor, r: torch.Tensor | None) -> Callable[[], int] | None:
            operands: list[tuple[torch.Tensor, int, torch.dtype | None, torch.memory_format]]
            operands = [(x, sizes[0], in_dtype, input_layout)]
            if r is not None:
                operands.append((r, sizes[1], residual_dtype, self.layout))
            if fixed is None or (r is not None) is not wants_residual or not all(
                t.dtype is want and t.numel() == size and t.is_contiguous(memory_format=layout)
                for t, size, want, layout in operands
            ):
                return None
            last[:] = [x.data_ptr(), fixed.data_ptr(), 0 if r is None else r.data_ptr()]
            for memory, address in zip(memories, last, strict=False):
                set_handle(memory, address)
            pinned[:] = [list(last), x, r]
            return functools.partial(execute, primitive, stream, count, pointer)

        return _ThreadCall(run, pin, fixed)

    def _pack(self, pd: VOID) -> tuple[torch.Tensor | None, VOID | None]:
        """The weight reordered once into the primitive's layout, in a buffer this object owns."""
        lib = self._lib
        if self._weight is None:
            return None, None
        packed_md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_EXEC_ARG_MD, ARG_WEIGHTS)
        buffer = torch.empty(lib.lib.dnnl_memory_desc_get_size(packed_md), dtype=torch.uint8)
        packed = owned_memory(lib, self._owned, packed_md, buffer.data_ptr())
        dims, tag = self._plain_weight()
        plain_md = lib.desc(dims, self.dtype, tag)
        reorder_pd, reorder, plain = None, None, None
        try:
            reorder_pd, reorder = lib.reorder(plain_md, packed_md)
            plain = lib.memory(plain_md, self._weight.data_ptr())
            lib.execute(reorder, (Arg * 2)(Arg(ARG_SRC, plain), Arg(ARG_DST, packed)), "reordering the weight")
        finally:
            lib.destroy("primitive", reorder)
            lib.destroy("memory", plain)
            lib.destroy("primitive_desc", reorder_pd)
            lib.destroy("memory_desc", plain_md)
        return buffer, packed


class Matmul(_Primitive):
    """``act(x @ weight.T + bias [+ residual])`` as a oneDNN matmul primitive, for fixed shapes.

    ``x`` is ``input_shape`` (any leading dimensions; the rows are their
    product), ``weight`` is [N, K] as in ``torch.nn.functional.linear``, and
    the residual, when given, has the result's shape and ``residual`` dtype.
    """

    tactic = "gemm_dnnl"
    kind = "matmul"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_shape: Sequence[int],
        eltwise: Eltwise | None,
        residual: torch.dtype | None,
        result: ResultSlot | None = None,
    ) -> None:
        n, k = self._weight_shape = tuple(weight.shape)
        if input_shape[-1] != k:
            raise HarnessError(f"{self.tactic}: input {tuple(input_shape)} does not end in the weight's K={k}")
        super().__init__(
            weight.dtype,
            input_shape,
            (*input_shape[:-1], n),
            weight=weight,
            # The bias in fp32 whatever the layer's type: oneDNN adds it to its fp32 accumulator
            # either way (exact from bf16 and fp16), and 3.2's fp16 matmul kernels take no
            # other, falling back to a reference loop for an fp16 bias. (Its fp16
            # depthwise convolution is the other way round: brdgmm_dw takes an fp16 bias only.)
            bias=None if bias is None else bias.float(),
            eltwise=eltwise,
            residual=residual,
            result=result,
        )

    def _dims(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape[:-1]), shape[-1]  # rows by columns

    def _plain_weight(self) -> tuple[tuple[int, ...], str]:
        n, k = self._weight_shape
        return (k, n), "ba"  # [N, K] row-major: oneDNN's {K, N} in "ba"

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib, (n, k) = self._lib, self._weight_shape
        operands = [
            lib.desc(self._dims(self.in_shape), self.dtype, "ab"),
            lib.desc((k, n), self.dtype, "any"),
            None if self._bias is None else lib.desc((1, n), self._bias.dtype, "ab"),
            lib.desc(self._dst_dims, self.dtype, "ab"),
        ]
        descs += operands
        pd = VOID()
        lib.check(
            lib.lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), lib.engine, *operands, attr),
            f"creating a {dtype_name(self.dtype)} matmul ({self._dst_dims[0]}x{k} by {k}x{n})",
        )
        return pd


class Convolution(_Primitive):
    """``act(conv2d(x, weight, bias, stride, padding, dilation, groups) [+ residual])`` as a oneDNN
    convolution primitive on channels-last tensors, for a fixed input shape.

    Channels-last is the layout oneDNN's convolution kernels for these
    networks take and give (``brgconv``, ``brdgmm_dw``: the kernels PyTorch's
    oneDNN Graph partitions run), so a chain of them needs no reorder between
    layers. Padding is symmetric, as ``conv2d``'s: the right padding is what
    the output size leaves of it (0 for a stride-2 3x3 layer on an even size).
    """

    tactic = "conv_dnnl"
    kind = "convolution"
    layout = input_layout = torch.channels_last

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_shape: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        groups: int,
        eltwise: Eltwise | None,
        residual: torch.dtype | None,
        result: ResultSlot | None = None,
    ) -> None:
        n, c, h, w = input_shape
        out_c, _, kh, kw = self._weight_shape = tuple(weight.shape)
        self._geometry = tuple(stride), tuple(padding), tuple(dilation), groups
        out = [
            (size + 2 * pad - dil * (k - 1) - 1) // st + 1
            for size, k, st, pad, dil in zip((h, w), (kh, kw), stride, padding, dilation, strict=True)
        ]
        if min(out) < 1 or c != weight.shape[1] * groups or out_c % groups:
            raise HarnessError(
                f"{self.tactic}: weight {tuple(weight.shape)} with groups={groups}, stride {tuple(stride)}, "
                f"padding {tuple(padding)}, dilation {tuple(dilation)} does not fit input {tuple(input_shape)}"
            )
        super().__init__(
            weight.dtype,
            input_shape,
            (n, out_c, *out),
            weight=weight,
            bias=bias,
            eltwise=eltwise,
            residual=residual,
            result=result,
        )

    def _takes_plain_input(self) -> bool:
        """An image-like input (at most 4 channels: the first layer's) arrives plain from the
        caller; oneDNN's reorder gives it channels-last strides faster than ATen's copy."""
        return self.in_shape[1] <= _PLAIN_INPUT_CHANNELS

    def _plain_weight(self) -> tuple[tuple[int, ...], str]:
        groups, shape = self._geometry[3], tuple(self._weight_shape)
        if groups == 1:
            return shape, "abcd"
        return (groups, shape[0] // groups, *shape[1:]), "abcde"  # the same memory, groups first

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib = self._lib
        stride, padding, dilation, _ = self._geometry
        dims, _ = self._plain_weight()
        operands = [
            lib.desc(self.in_shape, self.dtype, layout_tag(self.input_layout, 4)),
            lib.desc(dims, self.dtype, "any"),
            None if self._bias is None else lib.desc(self._bias.shape, self._bias.dtype, "a"),
            lib.desc(self.out_shape, self.dtype, layout_tag(self.layout, 4)),
        ]
        descs += operands
        kernel = self._weight_shape[2:]
        right = [
            (out - 1) * st + dil * (k - 1) + 1 - size - pad
            for out, size, k, st, pad, dil in zip(
                self.out_shape[2:], self.in_shape[2:], kernel, stride, padding, dilation, strict=True
            )
        ]
        pd = VOID()
        lib.check(
            lib.lib.dnnl_convolution_forward_primitive_desc_create(
                ctypes.byref(pd),
                lib.engine,
                lib.prop_kinds["forward_inference"],
                lib.algorithms["convolution_direct"],
                *operands,
                _DIMS(*stride),
                _DIMS(*(d - 1 for d in dilation)),  # oneDNN counts the gaps: 0 is dense
                _DIMS(*padding),
                _DIMS(*right),
                attr,
            ),
            f"creating a {dtype_name(self.dtype)} convolution ({tuple(self.in_shape)} by {tuple(self._weight_shape)}, "
            f"stride {stride}, padding {padding}, dilation {dilation}, groups {self._geometry[3]})",
        )
        return pd


class Pooling(_Primitive):
    """A fixed-window average pooling without padding (``avg_pool2d(x, window, window)``) as
    oneDNN's pooling primitive, channels-last in and out: a squeeze-excite block's global
    pooling between its producer's and its reader's primitives."""

    tactic = "pool_dnnl"
    kind = "pooling"
    layout = input_layout = torch.channels_last

    def __init__(
        self, dtype: torch.dtype, input_shape: Sequence[int], window: Sequence[int], result: ResultSlot | None = None
    ) -> None:
        n, c, h, w = input_shape
        if len(window) != 2 or min(window) < 1 or h % window[0] or w % window[1]:
            raise HarnessError(f"{self.tactic}: window {tuple(window)} does not tile input {tuple(input_shape)}")
        self._window = tuple(window)
        super().__init__(dtype, input_shape, (n, c, h // window[0], w // window[1]), result=result)

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib = self._lib
        operands = [lib.desc(shape, self.dtype, layout_tag(self.layout, 4)) for shape in (self.in_shape, self.out_shape)]
        descs += operands
        pd = VOID()
        lib.check(
            lib.lib.dnnl_pooling_forward_primitive_desc_create(
                ctypes.byref(pd),
                lib.engine,
                lib.prop_kinds["forward_inference"],
                lib.algorithms["pooling_avg_exclude_padding"],
                *operands,
                _DIMS(*self._window),  # strides
                _DIMS(*self._window),  # kernel
                _DIMS(0, 0),  # dilation
                _DIMS(0, 0),  # padding, left and right
                _DIMS(0, 0),
                attr,
            ),
            f"creating a {dtype_name(self.dtype)} pooling ({self.in_shape} by a {self._window} window)",
        )
        return pd


class Binary(_Primitive):
    """``x * s`` (or another of oneDNN's binary algorithms, by its name: ``binary_mul``) as oneDNN's
    binary primitive, channels-last in and out, for an ``s`` of ``x``'s shape or broadcast over
    some of its dimensions (a squeeze-excite block's per-channel scale, [N, C, 1, 1]).

    The rescale of a squeeze-excite block sits between primitives (the
    depthwise convolution and the excitation's last convolution before it, the
    projection after), so on one the three stay in oneDNN's layout and in the
    arena. In bf16 it also skips ATen's conversion to fp32 and back around
    each vector. ATen's kernel can be the faster on narrow channels, so it is
    one more tactic to time. The product is rounded once, as ATen's is: the
    same bits.

    ``scale_first``: the layer's operands come as ``(s, x)`` (``scale * input``,
    as torchvision's squeeze-excite writes it); the primitive still reads ``x``
    as its first input.
    """

    tactic = "binary_dnnl"
    kind = "binary"
    layout = input_layout = torch.channels_last
    second_arg = ARG_SRC_1
    second_name = "second operand"

    def __init__(
        self,
        algorithm: str,
        dtype: torch.dtype,
        input_shape: Sequence[int],
        second_shape: Sequence[int],
        result: ResultSlot | None = None,
        *,
        scale_first: bool = False,
    ) -> None:
        if not broadcasts(input_shape, second_shape):
            raise HarnessError(
                f"{self.tactic}: a {tuple(second_shape)} operand does not broadcast over a 4-D "
                f"{tuple(input_shape)} one (each dimension equal or 1)"
            )
        self._algorithm, self._second, self._scale_first = algorithm, tuple(second_shape), scale_first
        super().__init__(dtype, input_shape, input_shape, residual=dtype, result=result)

    def _second_shape(self) -> tuple[int, ...]:
        return self._second

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib = self._lib
        if self._algorithm not in lib.algorithms:
            raise HarnessError(f"oneDNN {lib.version} has no binary algorithm {self._algorithm!r}")
        tag = layout_tag(self.layout, 4)
        operands = [lib.desc(shape, self.dtype, tag) for shape in (self.in_shape, self._second, self.out_shape)]
        descs += operands
        pd = VOID()
        lib.check(
            lib.lib.dnnl_binary_primitive_desc_create(
                ctypes.byref(pd), lib.engine, lib.algorithms[self._algorithm], *operands, attr
            ),
            f"creating a {dtype_name(self.dtype)} {self._algorithm} ({self.in_shape} by {self._second})",
        )
        return pd

    def _runner(self, *args: Any) -> _ThreadCall:
        call = super()._runner(*args)
        if not self._scale_first:
            return call
        return _ThreadCall(
            lambda s, x: call.run(x, s), lambda s, x: call.pin(x, s), call.result  # type: ignore[arg-type]
        )


class Cast(_Primitive):
    """``x.to(dtype)`` between float types as oneDNN's reorder, plain layout in and out.

    The rounding is ATen's, to the same bits, but for fp32 subnormals (below
    1.2e-38) converted to bf16: the reorder's AVX-512 BF16 instruction reads
    them as zero, as the bf16 kernels of oneDNN's other primitives read every
    subnormal input, and ATen keeps them.

    A cast layer between primitives (a strongly typed bf16 network's input,
    its fp32 result) would otherwise be the one ATen call among bare ones, and
    ATen's call is slow there: the kernels before it have pushed its dispatch
    path out of the caches, and its result is a new tensor of its own, where
    the reorder writes into the arena.
    """

    tactic = "cast_dnnl"
    kind = "reorder"

    def __init__(
        self, input_dtype: torch.dtype, dtype: torch.dtype, shape: Sequence[int], result: ResultSlot | None = None
    ) -> None:
        if not 1 <= len(shape) <= MAX_DIMS:
            raise HarnessError(f"{self.tactic}: a {len(shape)}-D tensor; oneDNN takes 1 to {MAX_DIMS} dimensions")
        super().__init__(dtype, shape, shape, result=result, input_dtype=input_dtype)

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib, tag = self._lib, layout_tag(self.layout, len(self.in_shape))
        source, target = lib.desc(self.in_shape, self.input_dtype, tag), lib.desc(self.out_shape, self.dtype, tag)
        descs += [source, target]
        try:
            return lib.reorder_desc(source, target, attr)
        except HarnessError as exc:
            raise HarnessError(
                f"{self.tactic}: no oneDNN reorder from {dtype_name(self.input_dtype)} to "
                f"{dtype_name(self.dtype)} {self.in_shape}: {exc}"
            ) from exc


class LayerNorm(_Primitive):
    """``layer_norm(x, [C], weight, bias, eps)`` over the last dimension as oneDNN's layer
    normalization primitive, plain layout in and out.

    oneDNN's kernel is faster than ATen's CPU kernel for the layer norms of
    transformers. The statistics are computed in fp32 and the result rounded
    once, as ATen computes them. oneDNN takes the scale and shift in fp32 only; a bf16 or fp16
    weight converts to it exactly.
    """

    tactic = "layernorm_dnnl"
    kind = "layernorm"

    def __init__(
        self,
        dtype: torch.dtype,
        shape: Sequence[int],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        result: ResultSlot | None = None,
    ) -> None:
        if not 2 <= len(shape) <= MAX_DIMS:
            raise HarnessError(f"{self.tactic}: a {len(shape)}-D input; oneDNN normalizes 2- to {MAX_DIMS}-D ones")
        for name, operand in (("weight", weight), ("bias", bias)):
            if operand is not None and tuple(operand.shape) != (shape[-1],):
                raise HarnessError(
                    f"{self.tactic}: a {name} of shape {tuple(operand.shape)}; expected ({shape[-1]},), "
                    f"the last dimension of the {tuple(shape)} input"
                )
        self._eps = float(eps)
        self._scale = None if weight is None else weight.detach().float().contiguous()
        self._shift = None if bias is None else bias.detach().float().contiguous()
        super().__init__(dtype, shape, shape, result=result)

    def _constants(self) -> list[tuple[int, torch.Tensor]]:
        return [(arg, t) for arg, t in ((ARG_SCALE, self._scale), (ARG_SHIFT, self._shift)) if t is not None]

    def _create(self, attr: VOID, descs: list[VOID | None]) -> VOID:
        lib = self._lib
        tag = layout_tag(self.layout, len(self.in_shape))
        source, target = lib.desc(self.in_shape, self.input_dtype, tag), lib.desc(self.out_shape, self.dtype, tag)
        descs += [source, target]
        flags = (_USE_SCALE if self._scale is not None else 0) | (_USE_SHIFT if self._shift is not None else 0)
        pd = VOID()
        lib.check(
            lib.lib.dnnl_layer_normalization_forward_primitive_desc_create(
                ctypes.byref(pd), lib.engine, lib.prop_kinds["forward_inference"], source, target,
                None, self._eps, flags, attr,
            ),
            f"creating a {dtype_name(self.dtype)} layer normalization of {self.in_shape}",
        )  # fmt: skip
        return pd


def broadcasts(shape: Sequence[int], second: Sequence[int]) -> bool:
    """Whether ``second`` broadcasts over a 4-D ``shape`` as :class:`Binary` takes it: the same
    rank, each dimension equal or 1."""
    return len(shape) == len(second) == 4 and all(b in (a, 1) for a, b in zip(shape, second, strict=True))


def _handle(value: VOID | int) -> VOID:
    """A oneDNN handle as ctypes passes it (queries return plain ints)."""
    return value if isinstance(value, VOID) else VOID(value)


def layout_tag(layout: torch.memory_format, ndim: int) -> str:
    """oneDNN's name (``dnnl_fmt_tag2str``) of a ``layout``-contiguous tensor of ``ndim`` dimensions."""
    return "acdb" if layout == torch.channels_last else "abcdefghijkl"[:ndim]


def _allocator(shape: tuple[int, ...], dtype: torch.dtype, layout: torch.memory_format) -> Callable[[], torch.Tensor]:
    """A new ``layout``-contiguous tensor per call, by torch's cheapest call for it: the sizes
    unpacked (cheaper than a shape tuple to parse), or the strides given (``empty_strided``
    is cheaper than ``memory_format``)."""
    if layout == torch.contiguous_format:
        return functools.partial(torch.empty, *shape, dtype=dtype)
    return functools.partial(torch.empty_strided, shape, _strides(shape, layout), dtype=dtype)


def _strides(shape: tuple[int, ...], layout: torch.memory_format) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta", memory_format=layout).stride())


def _to_layout(layout: torch.memory_format) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tensor with ``layout``'s strides (itself if it has them)."""
    if layout == torch.contiguous_format:
        return torch.Tensor.contiguous  # without the keyword: the cheaper call
    return operator.methodcaller("contiguous", memory_format=layout)


def _refuse(tactic: str, wanted: str, x: torch.Tensor, r: torch.Tensor | None, second: str) -> None:
    got = f"{x.dtype} {tuple(x.shape)}" + ("" if r is None else f" and a {r.dtype} {tuple(r.shape)} {second}")
    raise HarnessError(f"{tactic}: expected {wanted}, got {got}")


@dataclass(frozen=True)
class _ThreadCall:
    """A thread's ways to call a primitive at one thread count (see :meth:`_Primitive._runner`)."""

    run: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    pin: Callable[[torch.Tensor, torch.Tensor | None], Callable[[], int] | None]
    result: torch.Tensor | None  # where the results go, with a result slot


class ThreadRuns:
    """One thread's calls of a primitive (per thread count), its stream, and the memory
    objects, scratchpads and argument arrays they use, freed when the thread ends or the
    primitive goes."""

    def __init__(self, lib: _Library) -> None:
        self.calls: dict[int, _ThreadCall] = {}
        self.arrays: list[ctypes.Array[Arg]] = []
        self.buffers: list[torch.Tensor] = []
        self.stream = lib.stream()
        self.owned: list[tuple[str, VOID]] = [("stream", self.stream)]
        weakref.finalize(self, free_owned, lib, self.owned)


def owned_memory(lib: _Library, owned: list[tuple[str, VOID]], md: VOID | int, data: int) -> VOID:
    """A memory object on ``md`` (and ``data``), listed in ``owned`` to be freed with its owner."""
    memory = lib.memory(md, data)
    owned.append(("memory", memory))
    return memory


def free_owned(lib: _Library, owned: list[tuple[str, VOID]]) -> None:
    """Free what ``owned`` lists, newest first (memory objects before the primitives they serve)."""
    for kind, handle in reversed(owned):
        lib.destroy(kind, handle)
