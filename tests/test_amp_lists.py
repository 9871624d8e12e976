"""The AMP op lists against the installed torch: its dispatcher and eager autocast.

Two independent references. Membership: the dispatcher knows exactly which op
overloads have an ``AutocastCPU`` / ``AutocastCUDA`` kernel (the CPU build
registers the CUDA table too). Policy: each kind leaves a distinct trace in what
reaches the kernels *below* autocast, which a ``TorchDispatchMode`` sees (the
Python dispatch key sits under the autocast keys): inputs cast to the low dtype,
cast to fp32, promoted, passed through with ``dtype=float32`` added, or
redispatched to another overload. CUDA autocast runs here on fake CUDA tensors:
the real ``AutocastCUDA`` kernels, with no GPU needed since only dtypes matter.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.autocast import amp_lists, compile, jit
from harness.autocast.amp_lists import (
    SUPPORTED_DEVICES,
    CastPolicy,
    PolicyEntry,
    autocast_registrations,
    check_amp_table,
    listed_ops,
    lower_precision_dtypes,
    policy_for,
    table_mismatch,
)
from harness.errors import HarnessError

aten = torch.ops.aten
F32 = torch.float32

_DISPATCH_KEY = {"cpu": torch._C.DispatchKey.AutocastCPU, "cuda": torch._C.DispatchKey.AutocastCUDA}


def _resolve(qualified: str) -> torch._ops.OpOverload:
    namespace, _, rest = qualified.partition("::")
    packet, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    assert isinstance(op, torch._ops.OpOverload)
    return op


# --- membership and naming ---------------------------------------------------------


@pytest.mark.parametrize("device", SUPPORTED_DEVICES)
def test_listed_ops_are_exactly_the_dispatcher_autocast_kernels(device: str) -> None:
    # the comparison the amp policy runs before its first use, on the installed torch
    mismatch = table_mismatch(device)
    assert mismatch.listed_only == (), "listed but no autocast kernel in this torch"
    assert mismatch.registered_only == (), "autocast kernel in this torch but not listed"
    assert not mismatch
    check_amp_table(device)


@pytest.mark.parametrize("device", SUPPORTED_DEVICES)
def test_the_dispatcher_view_is_every_op_overload_with_an_autocast_kernel(device: str) -> None:
    """The dispatcher's list of a key's registrations, against asking each op overload in turn."""
    key = _DISPATCH_KEY[device]
    per_op = {
        name for name in torch._C._dispatch_get_all_op_names() if _resolve(name).has_kernel_for_dispatch_key(key)
    }
    assert autocast_registrations(device) == per_op and len(per_op) > 100


@pytest.fixture
def changed_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The dispatcher of a torch that no longer autocasts ``mm`` and autocasts a new op; yields the devices asked."""
    real = amp_lists.autocast_registrations
    asked: list[str] = []

    def registrations(device: str) -> frozenset[str]:
        asked.append(device)
        return (real(device) - {"aten::mm"}) | {"aten::flash_new_op"}

    monkeypatch.setattr(amp_lists, "autocast_registrations", registrations)
    table_mismatch.cache_clear()
    yield asked
    table_mismatch.cache_clear()  # the next test compares with the real dispatcher again


def test_amp_mode_and_jit_refuse_a_torch_whose_autocast_lists_differ(changed_torch: list[str]) -> None:
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), torch.randn(2, 4)
    message = (
        rf"exact AMP is refused: its cpu autocast op lists are those of torch 2\.13, and the installed torch "
        rf"{re.escape(torch.__version__)} autocasts other ops \(listed here but not autocast by it: aten::mm; "
        r"autocast by it but not listed here: aten::flash_new_op\)"
    )
    with pytest.raises(HarnessError, match=message):
        compile(model, (x,), policy="amp", low_precision_type="bf16")
    with pytest.raises(HarnessError, match=message):
        jit(model, (x,))
    assert changed_torch == ["cpu"]  # compared once for the process, not per compile
    # modes that do not follow the AMP lists are unaffected
    assert compile(model, (x,), policy="rule", low_precision_type="bf16")(x).shape == (2, 4)


def test_a_long_difference_names_the_first_ops_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amp_lists, "autocast_registrations", lambda device: frozenset())
    table_mismatch.cache_clear()
    try:
        listed = sorted(listed_ops("cuda"))
        with pytest.raises(HarnessError, match=rf"{re.escape(', '.join(listed[:5]))} and {len(listed) - 5} more\)"):
            check_amp_table("cuda")
    finally:
        table_mismatch.cache_clear()


@pytest.mark.parametrize("device", SUPPORTED_DEVICES)
def test_every_listed_name_round_trips_through_its_op_overload(device: str) -> None:
    for name, entry in listed_ops(device).items():
        op = _resolve(name)
        assert op.name() == name
        assert policy_for(op, device) == entry


@pytest.mark.parametrize("device", SUPPORTED_DEVICES)
def test_redispatch_targets_are_the_registered_schema_plus_a_dtype(device: str) -> None:
    for name, entry in listed_ops(device).items():
        if entry.policy is not CastPolicy.FP32_APPEND_DTYPE:
            assert entry.redispatch is None, name
            continue
        assert entry.redispatch is not None, name
        registered = _resolve(name)._schema
        target = _resolve(entry.redispatch)._schema
        assert [a.name for a in target.arguments] == [a.name for a in registered.arguments] + [
            "dtype"
        ]
        dtype = target.arguments[-1]
        # C++ redispatch signature ends in a plain ScalarType: required, not optional.
        assert not isinstance(dtype.type, torch.OptionalType) and not dtype.has_default_value()


def test_cuda_append_dtype_entries_name_their_redispatch_overload() -> None:
    assert policy_for(aten.norm.Scalar, "cuda") == PolicyEntry(
        CastPolicy.FP32_APPEND_DTYPE, "aten::norm.ScalarOpt_dtype"
    )
    assert policy_for(aten.norm.Scalar, "cpu") is None


def test_overloads_are_looked_up_individually() -> None:
    # conv2d.padding is a CPU registration of its own; CUDA lists only the default.
    assert policy_for(aten.conv2d.padding, "cpu") == PolicyEntry(CastPolicy.LOWER_PRECISION_FP)
    assert policy_for(aten.conv2d.padding, "cuda") is None
    assert policy_for(aten.conv2d.default, "cuda") == PolicyEntry(CastPolicy.LOWER_PRECISION_FP)


def test_listed_ops_returns_a_copy() -> None:
    table = listed_ops("cpu")
    table.clear()
    assert policy_for(aten.mm.default, "cpu") is not None


# --- devices -----------------------------------------------------------------------


def test_supported_devices_and_lower_precision_dtypes() -> None:
    assert SUPPORTED_DEVICES == ("cpu", "cuda")
    assert lower_precision_dtypes("cpu") == (torch.bfloat16, torch.float16)
    assert lower_precision_dtypes("cuda") == (torch.float16, torch.bfloat16)
    # torch.autocast defaults to the first one on each device.
    assert torch.get_autocast_dtype("cpu") == lower_precision_dtypes("cpu")[0]
    assert torch.get_autocast_dtype("cuda") == lower_precision_dtypes("cuda")[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: policy_for(aten.mm.default, "gpu"),
        lambda: listed_ops("xpu"),
        lambda: lower_precision_dtypes("CUDA"),
    ],
)
def test_unknown_device_raises_harness_error_listing_valid_devices(
    call: Callable[[], object],
) -> None:
    with pytest.raises(HarnessError, match=r"valid devices: cpu, cuda"):
        call()


def test_non_overload_target_is_rejected() -> None:
    with pytest.raises(TypeError, match="OpOverload"):
        policy_for(aten.mm, "cpu")  # type: ignore[arg-type]


# --- behaviour against eager autocast ------------------------------------------------


class _KernelCalls(TorchDispatchMode):
    """Records every op that reaches the dispatcher below the autocast keys."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def first_compute(self) -> tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]]:
        """The first call that is neither a cast nor a device query: the op itself
        (or, for composite ops, the first piece of their decomposition)."""
        for func, args, kwargs in self.calls:
            if func is not aten._to_copy.default and func.namespace != "prim":
                return func, args, kwargs
        raise AssertionError(f"no compute op recorded: {self.calls}")


def _float_dtypes(tree: Any) -> list[torch.dtype]:
    return [
        t.dtype for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


@contextlib.contextmanager
def _autocast(device: str, low: torch.dtype) -> Iterator[None]:
    if device == "cpu":
        with torch.autocast("cpu", dtype=low):
            yield
        return
    # torch.autocast("cuda") switches itself off without a GPU, so set the same
    # thread-local state it would set; the AutocastCUDA kernels do the rest.
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", low)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
        torch.clear_autocast_cache()


Make = Callable[[Callable[..., torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]]


def _case(op: torch._ops.OpOverload, policy: CastPolicy | None, make: Make) -> Any:
    return pytest.param(
        op, policy, make, id=f"{op.name()}-{policy.value if policy else 'unlisted'}"
    )


def _assert_behaves_as(
    entry: PolicyEntry | None,
    op: torch._ops.OpOverload,
    make: Make,
    device: str,
    low: torch.dtype,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> None:
    """Run ``op`` under autocast and check the trace its policy kind must leave."""
    it = iter([dtypes[0], dtypes[1]] * 4)

    def t(*shape: int, rand: bool = False) -> torch.Tensor:
        x = torch.rand(shape, device=device) if rand else torch.randn(shape, device=device)
        return x.to(next(it))

    args, kwargs = make(t)
    inputs = _float_dtypes((args, kwargs))
    recorder = _KernelCalls()
    with _autocast(device, low):
        if entry is not None and entry.policy is CastPolicy.BANNED:
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                op(*args, **kwargs)
            return
        with recorder:
            out = op(*args, **kwargs)
    func, seen_args, seen_kwargs = recorder.first_compute()
    seen = _float_dtypes(seen_args)
    out_dtype = next(iter(_float_dtypes(out)))

    if entry is None:
        assert seen == inputs and "dtype" not in seen_kwargs
        return
    policy = entry.policy
    if policy is CastPolicy.LOWER_PRECISION_FP:
        assert set(seen) == {low} and out_dtype == low
    elif policy is CastPolicy.FP32:
        assert set(seen) == {F32} and out_dtype == F32
    elif policy is CastPolicy.PROMOTE:
        widest = F32 if F32 in inputs else low
        assert set(seen) == {widest} and out_dtype == widest
    elif policy is CastPolicy.FP32_SET_OPT_DTYPE:
        assert func is op
        assert seen == inputs and seen_kwargs.get("dtype") == F32 and out_dtype == F32
    elif policy is CastPolicy.FP32_APPEND_DTYPE:
        assert func.name() == entry.redispatch
        assert seen == inputs and seen_kwargs.get("dtype") == F32 and out_dtype == F32
    else:
        raise AssertionError(f"unhandled policy {policy}")


# Per-device samples: (op, the kind the AMP docs/sources give it, argument factory).
# Factories draw float tensors from ``t``, which alternates the two dtypes under test.
CPU_CASES = [
    _case(aten.mm.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(4, 4), t(4, 4)), {})),
    _case(
        aten.conv2d.default,
        CastPolicy.LOWER_PRECISION_FP,
        lambda t: ((t(1, 2, 5, 5), t(3, 2, 3, 3)), {}),
    ),
    _case(
        aten.conv2d.padding,
        CastPolicy.LOWER_PRECISION_FP,
        lambda t: ((t(1, 2, 5, 5), t(3, 2, 3, 3), None, [1, 1], "same"), {}),
    ),
    _case(
        aten.linear.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(2, 4), t(3, 4), t(3)), {})
    ),
    _case(
        aten.addmm.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(4), t(4, 4), t(4, 4)), {})
    ),
    _case(
        aten.bmm.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(2, 3, 4), t(2, 4, 3)), {})
    ),
    _case(aten.prelu.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(2, 3), t(3)), {})),
    _case(aten.cdist.default, CastPolicy.FP32, lambda t: ((t(3, 4), t(5, 4)), {})),
    _case(aten.prod.default, CastPolicy.FP32, lambda t: ((t(4),), {})),
    _case(aten.prod.dim_int, CastPolicy.FP32, lambda t: ((t(3, 4), 1), {})),
    _case(aten.trace.default, CastPolicy.FP32, lambda t: ((t(4, 4),), {})),
    _case(aten.mse_loss.default, CastPolicy.FP32, lambda t: ((t(4), t(4)), {})),
    _case(
        aten.binary_cross_entropy.default,
        CastPolicy.FP32,
        lambda t: ((t(4, rand=True), t(4, rand=True)), {}),
    ),
    _case(aten.avg_pool3d.default, CastPolicy.FP32, lambda t: ((t(1, 1, 4, 4, 4), [2, 2, 2]), {})),
    _case(aten.cat.default, CastPolicy.PROMOTE, lambda t: (([t(2, 3), t(2, 3)],), {})),
    _case(aten.stack.default, CastPolicy.PROMOTE, lambda t: (([t(2, 3), t(2, 3)],), {})),
    _case(
        aten.index_copy.default,
        CastPolicy.PROMOTE,
        lambda t: ((t(4, 3), 0, torch.tensor([0, 2]), t(2, 3)), {}),
    ),
    _case(aten.relu.default, None, lambda t: ((t(4),), {})),
    _case(aten.softmax.int, None, lambda t: ((t(4), 0), {})),
    _case(aten.exp.default, None, lambda t: ((t(4),), {})),
    _case(aten.add.Tensor, None, lambda t: ((t(4), t(4)), {})),
]

CUDA_CASES = [
    _case(aten.mm.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(4, 4), t(4, 4)), {})),
    _case(
        aten.conv2d.default,
        CastPolicy.LOWER_PRECISION_FP,
        lambda t: ((t(1, 2, 5, 5), t(3, 2, 3, 3)), {}),
    ),
    _case(aten.addmv.default, CastPolicy.LOWER_PRECISION_FP, lambda t: ((t(4), t(4, 4), t(4)), {})),
    _case(aten.exp.default, CastPolicy.FP32, lambda t: ((t(4),), {})),
    _case(aten.pow.Tensor_Scalar, CastPolicy.FP32, lambda t: ((t(4), 2), {})),
    _case(aten.mse_loss.default, CastPolicy.FP32, lambda t: ((t(4), t(4)), {})),
    _case(aten.sum.default, CastPolicy.FP32_SET_OPT_DTYPE, lambda t: ((t(4),), {})),
    _case(aten.sum.dim_IntList, CastPolicy.FP32_SET_OPT_DTYPE, lambda t: ((t(3, 4), [0]), {})),
    _case(aten.cumsum.default, CastPolicy.FP32_SET_OPT_DTYPE, lambda t: ((t(4), 0), {})),
    _case(aten.prod.dim_int, CastPolicy.FP32_SET_OPT_DTYPE, lambda t: ((t(3, 4), 1), {})),
    _case(aten.norm.Scalar, CastPolicy.FP32_APPEND_DTYPE, lambda t: ((t(4), 2), {})),
    _case(aten.norm.ScalarOpt_dim, CastPolicy.FP32_APPEND_DTYPE, lambda t: ((t(3, 4), 2, [0]), {})),
    _case(aten.addcmul.default, CastPolicy.PROMOTE, lambda t: ((t(4), t(4), t(4)), {})),
    _case(aten.atan2.default, CastPolicy.PROMOTE, lambda t: ((t(4), t(4)), {})),
    _case(aten.dot.default, CastPolicy.PROMOTE, lambda t: ((t(4), t(4)), {})),
    _case(
        aten.binary_cross_entropy.default,
        CastPolicy.BANNED,
        lambda t: ((t(4, rand=True), t(4, rand=True)), {}),
    ),
    _case(aten.relu.default, None, lambda t: ((t(4),), {})),
    _case(aten.cat.default, None, lambda t: (([t(2, 3), t(2, 3)],), {})),
    _case(aten.add.Tensor, None, lambda t: ((t(4), t(4)), {})),
]


def _dtype_pairs(low: torch.dtype) -> list[tuple[torch.dtype, torch.dtype]]:
    # fp32 inputs expose lower_precision_fp, low inputs expose the fp32 kinds and
    # pass-through, mixed inputs expose promote.
    return [(F32, F32), (low, low), (F32, low)]


@pytest.mark.parametrize("low", lower_precision_dtypes("cpu"))
@pytest.mark.parametrize(("op", "policy", "make"), CPU_CASES)
def test_cpu_policy_matches_eager_autocast(
    op: torch._ops.OpOverload, policy: CastPolicy | None, make: Make, low: torch.dtype
) -> None:
    entry = policy_for(op, "cpu")
    assert (entry.policy if entry else None) is policy
    for dtypes in _dtype_pairs(low):
        _assert_behaves_as(entry, op, make, "cpu", low, dtypes)


@pytest.mark.parametrize("low", lower_precision_dtypes("cuda"))
@pytest.mark.parametrize(("op", "policy", "make"), CUDA_CASES)
def test_cuda_policy_matches_autocast_cuda_kernels(
    op: torch._ops.OpOverload, policy: CastPolicy | None, make: Make, low: torch.dtype
) -> None:
    entry = policy_for(op, "cuda")
    assert (entry.policy if entry else None) is policy
    with FakeTensorMode():
        for dtypes in _dtype_pairs(low):
            _assert_behaves_as(entry, op, make, "cuda", low, dtypes)


def test_cuda_set_opt_dtype_respects_an_explicit_dtype() -> None:
    with FakeTensorMode():
        x = torch.randn(4, device="cuda").half()
        with _autocast("cuda", torch.float16):
            assert aten.sum.default(x).dtype == F32
            assert aten.sum.default(x, dtype=torch.float16).dtype == torch.float16
