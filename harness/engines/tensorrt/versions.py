"""Which TensorRT is installed, and what that version can and cannot do.

Enum integer values changed between TensorRT 10 and 11, so the harness stores
and passes flag *names* and turns them into enum members only at the last
moment, against the TensorRT that is actually loaded (:func:`flag_bits`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, SupportsInt

from harness.errors import HarnessError
from harness.extras import install_command, tensorrt_extra
from harness.precision import PrecisionMode

if TYPE_CHECKING:
    import tensorrt


class TrtApi(Protocol):
    """The parts of the ``tensorrt`` module the harness calls.

    Returning the real module as this protocol makes mypy check every name
    used here against the TensorRT type stubs; tests pass a small namespace.
    """

    BuilderFlag: type[tensorrt.BuilderFlag]
    NetworkDefinitionCreationFlag: type[tensorrt.NetworkDefinitionCreationFlag]
    LayerInformationFormat: type[tensorrt.LayerInformationFormat]
    TimingCacheKey: type[tensorrt.TimingCacheKey]
    TimingCacheValue: type[tensorrt.TimingCacheValue]


def load_tensorrt(trt_module: TrtApi | None = None) -> TrtApi:
    """``trt_module`` if given, else the installed ``tensorrt`` bindings.

    Installing only ``tensorrt-stubs`` leaves a ``tensorrt`` directory with a
    ``.pyi`` file that Python imports as an empty namespace package, so a
    successful import proves nothing; check for a real attribute.
    """
    if trt_module is not None:
        return trt_module
    try:
        import tensorrt
    except ImportError:
        raise HarnessError(f"the TensorRT backend needs the `tensorrt` Python package (GPU machines only): {_how()}") from None
    if not hasattr(tensorrt, "Builder"):
        raise HarnessError(
            "`import tensorrt` found only type stubs or an empty namespace package, not the "
            f"TensorRT bindings: {_how()}"
        )
    api: TrtApi = tensorrt  # checked against the protocol where the stubs type the module
    return api


def _how() -> str:
    """How to install TensorRT for the installed torch."""
    import torch

    try:
        extra = tensorrt_extra(torch.version.cuda)
    except HarnessError as exc:
        return str(exc)
    return f"{install_command(extra)} (the extra for the CUDA {torch.version.cuda} of the installed torch)"


_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class TrtVersion:
    major: int
    minor: int
    patch: int = 0
    build: int = 0

    @classmethod
    def parse(cls, text: str) -> TrtVersion:
        """Parse ``tensorrt.__version__`` ("10.13.0.35", "11.0.0", "10.8.0.43.post1")."""
        m = _VERSION.match(text.strip())
        if m is None:
            raise HarnessError(
                f"cannot parse TensorRT version {text!r} (expected MAJOR.MINOR[.PATCH[.BUILD]])"
            )
        return cls(*(int(g) if g is not None else 0 for g in m.groups()))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}.{self.build}"


def installed_version(trt_module: object) -> TrtVersion:
    version = getattr(trt_module, "__version__", None)
    if not isinstance(version, str):
        raise HarnessError("the loaded tensorrt module has no __version__")
    return TrtVersion.parse(version)


EDITABLE_TIMING_CACHE_SINCE = TrtVersion(10, 8)
WEAK_TYPING_DEPRECATED_SINCE = TrtVersion(10, 12)


def supports_weak_typing(v: TrtVersion) -> bool:
    """Builder-chosen precision (``BuilderFlag.FP16``/``BF16``) exists up to 10.x, removed in 11."""
    return v.major <= 10


def supports_editable_timing_cache(v: TrtVersion) -> bool:
    return v >= EDITABLE_TIMING_CACHE_SINCE


def require_weak_typing(v: TrtVersion, mode: PrecisionMode | str) -> None:
    """Refuse a weak mode on TensorRT 11+ (naming the replacements); warn on 10.12+."""
    low = PrecisionMode.parse(mode).low
    if not supports_weak_typing(v):
        raise HarnessError(
            f"weak typing (mode {mode}) was removed in TensorRT {v.major}; use autocast-{low} "
            f"(rule-based mixed precision) or {low} (whole graph, strongly typed) instead"
        )
    if v >= WEAK_TYPING_DEPRECATED_SINCE:
        warnings.warn(
            f"weak typing (mode {mode}) is deprecated since TensorRT 10.12 and gone in 11; "
            f"prefer autocast-{low}",
            DeprecationWarning,
            stacklevel=2,
        )


# BuilderFlag / NetworkDefinitionCreationFlag member names.
STRONGLY_TYPED = "STRONGLY_TYPED"
TF32 = "TF32"
EDITABLE_TIMING_CACHE = "EDITABLE_TIMING_CACHE"
ERROR_ON_TIMING_CACHE_MISS = "ERROR_ON_TIMING_CACHE_MISS"
# Keeps compiled kernels out of the timing cache, so that it holds tactic decisions only
# (as NVIDIA's TensorRT-Model-Connect does for its pinned builds).
DISABLE_COMPILATION_CACHE = "DISABLE_COMPILATION_CACHE"
# Weak typing lets the builder lower layers to these types; OBEY keeps the
# explicit per-layer constraints (casts set by the harness) authoritative.
WEAK_TYPING_FLAGS = {"weak-fp16": ("FP16",), "weak-bf16": ("BF16",)}
OBEY_PRECISION_CONSTRAINTS = "OBEY_PRECISION_CONSTRAINTS"


def network_flag_names(mode: PrecisionMode | str) -> tuple[str, ...]:
    """Network creation flags: strong typing for every mode but the weak ones.

    TensorRT 11 is always strongly typed and accepts (ignores) the flag, so it
    is passed on every version for uniform build records. Whether a weak mode
    is possible at all is :func:`builder_flag_names`' business.
    """
    return () if PrecisionMode.parse(mode).weak else (STRONGLY_TYPED,)


def builder_flag_names(
    v: TrtVersion,
    mode: PrecisionMode | str,
    *,
    tf32: bool,
    editable_timing_cache: bool,
    error_on_cache_miss: bool,
) -> tuple[str, ...]:
    """``BuilderFlag`` names for a build; refuses what this version cannot do."""
    names: list[str] = []
    if tf32:
        names.append(TF32)
    if PrecisionMode.parse(mode).weak:
        require_weak_typing(v, mode)
        names += [*WEAK_TYPING_FLAGS[mode], OBEY_PRECISION_CONSTRAINTS]
    if editable_timing_cache:
        if not supports_editable_timing_cache(v):
            raise HarnessError(
                f"editable timing caches need TensorRT {EDITABLE_TIMING_CACHE_SINCE.major}."
                f"{EDITABLE_TIMING_CACHE_SINCE.minor} or newer (found {v}); tactic pinning "
                "is unavailable"
            )
        names += [EDITABLE_TIMING_CACHE, DISABLE_COMPILATION_CACHE]
    if error_on_cache_miss:
        names.append(ERROR_ON_TIMING_CACHE_MISS)
    return tuple(names)


def flag_bits(members: Mapping[str, SupportsInt], names: Iterable[str], enum_name: str) -> int:
    """Bit mask of the named members (``trt.BuilderFlag.__members__`` etc.) of the loaded TensorRT."""
    bits = 0
    for name in names:
        if name not in members:
            raise HarnessError(
                f"{enum_name}.{name} does not exist in the installed TensorRT; valid names: "
                + ", ".join(sorted(members))
            )
        bits |= 1 << int(members[name])
    return bits
