"""PyTorch autocast (AMP) op lists as data: which ops each device casts, and how.

The AMP compiler has to reproduce eager ``torch.autocast`` exactly, and eager
autocast is nothing more than a per-device table of kernels registered under the
``AutocastCPU`` / ``AutocastCUDA`` dispatch keys, each wrapping one op overload
with one ``CastPolicy``. Everything not in the table falls through and runs in
whatever dtype its inputs already have. Registration is per *overload*
(``aten::conv2d`` and ``aten::conv2d.padding`` are separate entries), so the
table is keyed by overload names exactly as the dispatcher spells them
(``OpOverload.name()``: the default overload is the bare name).

Sources (transcribed by hand, order kept; the tests check the result for set
equality against the installed torch's dispatcher, and sample each policy kind
against eager autocast):

- Lists shared by CUDA and the other accelerators (``AT_FORALL_LOWER_PRECISION_FP``,
  ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
  ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``): the
  ``ATen/autocast_mode.h`` header shipped inside the torch 2.13.0 wheel
  (``torch/include/ATen/autocast_mode.h``), i.e. exactly the installed version.
- CPU lists and the CUDA-only extras (``cudnn_convolution*``, the banned
  ``binary_cross_entropy``): ``pytorch/pytorch`` ``aten/src/ATen/autocast_mode.cpp``
  at commit 008ec6b1840c94ff6d0f685bc10fbf585167c673 (the .cpp is not shipped in
  the wheel). That revision still lists the named-tensor overloads
  ``prod.dim_Dimname`` and ``index_copy.dimname``; torch 2.13 no longer has
  those overloads at all, so they are left out.

Another torch release may list other ops, and exact AMP would then silently
differ from eager. So before the amp policy (and :func:`harness.autocast.jit`) is
first used, :func:`check_amp_table` compares the table with the running
dispatcher's autocast registrations, once per process and device, and refuses
AMP on a mismatch naming the ops.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from harness.errors import HarnessError


class CastPolicy(enum.Enum):
    """How an autocast kernel treats its floating-point tensor arguments.

    Mirrors ``at::autocast::CastPolicy`` plus ``BANNED`` for the ops the CUDA
    table registers as raising (they have no cast policy, they refuse to run).
    """

    LOWER_PRECISION_FP = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    PROMOTE = "promote"
    BANNED = "banned"


@dataclass(frozen=True)
class PolicyEntry:
    """One autocast registration.

    ``redispatch`` is set only for ``FP32_APPEND_DTYPE``: the kernel registered on
    a dtype-less overload appends ``dtype=float32`` and calls a *different*
    overload, which is the op that actually runs and that a compiled graph must
    contain to match eager bit for bit.
    """

    policy: CastPolicy
    redispatch: str | None = None


# --- Lists shared by CUDA and other accelerators (ATen/autocast_mode.h, 2.13.0) ---

_SHARED_LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)

_SHARED_FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

_SHARED_FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)

# Registered overload -> overload the kernel redispatches to. The header names the
# target by C++ signature (at::norm with a trailing ScalarType); these are the
# schema overloads with exactly that signature.
_SHARED_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}

_SHARED_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

# --- CUDA-only registrations (autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, Autocast)) ---

_CUDA_EXTRA_LOWER_PRECISION_FP = ("cudnn_convolution", "cudnn_convolution_transpose")
_CUDA_BANNED = ("binary_cross_entropy",)

# --- CPU (autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU)) ---

_CPU_LOWER_PRECISION_FP = (
    "conv1d",
    "conv1d.padding",
    "conv2d",
    "conv2d.padding",
    "conv3d",
    "conv3d.padding",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "_addmm_activation",
    "addbmm",
    "linear",
    "_convolution.deprecated",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
)

_CPU_FP32 = (
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "prod.dim_int",
    "quantile",
    "quantile.scalar",
    "nanquantile",
    "nanquantile.scalar",
    "stft",
    "stft.center",
    "cdist",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "trace",
    "view_as_complex",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss.IntList",
    "ctc_loss.Tensor",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "fft_fft",
    "fft_ifft",
    "fft_fft2",
    "fft_ifft2",
    "fft_fftn",
    "fft_ifftn",
    "fft_rfft",
    "fft_irfft",
    "fft_rfft2",
    "fft_irfft2",
    "fft_rfftn",
    "fft_irfftn",
    "fft_hfft",
    "fft_ihfft",
    "linalg_cond",
    "linalg_cond.p_str",
    "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float",
    "linalg_solve",
    "linalg_cholesky",
    "linalg_svdvals",
    "linalg_eigvals",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_householder_product",
    "linalg_tensorinv",
    "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine",
    "geqrf",
    "_lu_with_info",
    "qr",
    "svd",
    "triangular_solve",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "adaptive_max_pool3d",
    "multilabel_margin_loss_forward",
    "linalg_qr",
    "linalg_cholesky_ex",
    "linalg_svd",
    "linalg_eig",
    "linalg_eigh",
    "linalg_lstsq",
    "linalg_inv_ex",
)

_CPU_PROMOTE = ("stack", "cat", "index_copy")


def _qualified(name: str) -> str:
    return f"aten::{name}"


def _build(
    groups: Iterable[tuple[CastPolicy, Iterable[str]]],
    append_dtype: Mapping[str, str] | None = None,
) -> Mapping[str, PolicyEntry]:
    """Merge policy groups into one read-only table, refusing duplicates.

    A name listed under two policies would silently take the later one in a plain
    dict; eager autocast would then disagree with us in a way no set-equality
    check can see, so a clash is a bug in the data and fails at import.
    """
    table: dict[str, PolicyEntry] = {}

    def add(name: str, entry: PolicyEntry) -> None:
        key = _qualified(name)
        if key in table:
            raise RuntimeError(f"autocast op {key} listed twice ({table[key]} and {entry})")
        table[key] = entry

    for policy, names in groups:
        for name in names:
            add(name, PolicyEntry(policy))
    for name, target in (append_dtype or {}).items():
        add(name, PolicyEntry(CastPolicy.FP32_APPEND_DTYPE, _qualified(target)))
    return MappingProxyType(table)


_TABLES: Mapping[str, Mapping[str, PolicyEntry]] = {
    "cpu": _build(
        [
            (CastPolicy.LOWER_PRECISION_FP, _CPU_LOWER_PRECISION_FP),
            (CastPolicy.FP32, _CPU_FP32),
            (CastPolicy.PROMOTE, _CPU_PROMOTE),
        ]
    ),
    "cuda": _build(
        [
            (CastPolicy.LOWER_PRECISION_FP, _SHARED_LOWER_PRECISION_FP),
            (CastPolicy.LOWER_PRECISION_FP, _CUDA_EXTRA_LOWER_PRECISION_FP),
            (CastPolicy.FP32, _SHARED_FP32),
            (CastPolicy.FP32_SET_OPT_DTYPE, _SHARED_FP32_SET_OPT_DTYPE),
            (CastPolicy.PROMOTE, _SHARED_PROMOTE),
            (CastPolicy.BANNED, _CUDA_BANNED),
        ],
        _SHARED_FP32_APPEND_DTYPE,
    ),
}

SUPPORTED_DEVICES: tuple[str, ...] = tuple(_TABLES)

# The first dtype is what torch.autocast picks when none is given on that device.
_LOWER_PRECISION_DTYPES: Mapping[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.bfloat16, torch.float16),
    "cuda": (torch.float16, torch.bfloat16),
}


def _table(device: str) -> Mapping[str, PolicyEntry]:
    if device not in _TABLES:
        raise HarnessError(
            f"unknown autocast device {device!r}; valid devices: {', '.join(SUPPORTED_DEVICES)}"
        )
    return _TABLES[device]


def policy_for(op: torch._ops.OpOverload, device: str) -> PolicyEntry | None:
    """The autocast registration for ``op`` on ``device``; ``None`` if it falls through.

    Lookup is by exact overload: ``aten.conv2d.default`` and ``aten.conv2d.padding``
    are distinct, and an op autocast does not list runs in its inputs' dtypes.
    """
    table = _table(device)
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            f"policy_for needs an OpOverload such as torch.ops.aten.mm.default, got {op!r}"
        )
    return table.get(op.name())  # type: ignore[no-untyped-call]  # torch leaves OpOverload.name unannotated


def listed_ops(device: str) -> dict[str, PolicyEntry]:
    """Every op ``device`` autocasts, keyed like ``aten::conv2d`` / ``aten::prod.dim_int``."""
    return dict(_table(device))


def lower_precision_dtypes(device: str) -> tuple[torch.dtype, ...]:
    """Dtypes ``torch.autocast`` accepts as the lower precision on ``device``, default first."""
    _table(device)  # validates the device name
    return _LOWER_PRECISION_DTYPES[device]


# The torch release the tables above were transcribed from.
TABLE_TORCH_VERSION = "2.13"
_DISPATCH_KEYS: Mapping[str, str] = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_SHOWN = 5  # differing ops named in an error; the rest are counted


def autocast_registrations(device: str) -> frozenset[str]:
    """The running torch's view: every op overload with a kernel under ``device``'s autocast key.

    Named as the tables are (``aten::conv2d.padding``). torch has no public
    API that lists a dispatch key's registrations; this is the dispatcher's
    own list (one call, well under a millisecond), the same set as asking
    ``OpOverload.has_kernel_for_dispatch_key`` of every op (the tests compare
    the two). CPU builds register the CUDA table too.
    """
    _table(device)  # validates the device name
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(_DISPATCH_KEYS[device]))


@dataclass(frozen=True)
class TableMismatch:
    """How the table of a device differs from the running dispatcher's registrations."""

    device: str
    listed_only: tuple[str, ...]  # in the table, but this torch autocasts no such op
    registered_only: tuple[str, ...]  # autocast by this torch, missing from the table

    def __bool__(self) -> bool:
        return bool(self.listed_only or self.registered_only)

    def describe(self) -> str:
        parts = []
        for label, names in (("listed here but not autocast by it", self.listed_only),
                             ("autocast by it but not listed here", self.registered_only)):  # fmt: skip
            if names:
                more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
                parts.append(f"{label}: {', '.join(names[:_SHOWN])}{more}")
        return "; ".join(parts)


@functools.cache
def table_mismatch(device: str) -> TableMismatch:
    """The table of ``device`` against :func:`autocast_registrations`, computed once per process.

    The one comparison: the tests assert it is empty on the installed torch,
    and :func:`check_amp_table` refuses AMP when it is not.
    """
    listed, registered = set(_table(device)), autocast_registrations(device)
    return TableMismatch(device, tuple(sorted(listed - registered)), tuple(sorted(registered - listed)))


def check_amp_table(device: str) -> None:
    """Refuse exact AMP when the installed torch autocasts other ops than the table says.

    The amp policy promises eager ``torch.autocast``'s types bit for bit; with a
    table from another torch release it would type some ops differently and
    say nothing. Cheap after the first call (:func:`table_mismatch` is cached).
    """
    mismatch = table_mismatch(device)
    if mismatch:
        raise HarnessError(
            f"exact AMP is refused: its {device} autocast op lists are those of torch {TABLE_TORCH_VERSION}, "
            f"and the installed torch {torch.__version__} autocasts other ops ({mismatch.describe()}); "
            f"exact AMP would not match eager torch.autocast. Use torch {TABLE_TORCH_VERSION}.x, or the rule policy"
        )
