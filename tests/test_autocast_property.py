"""Property test of the autocast compiler on generated small graphs.

Hypothesis builds small programs from a vocabulary of ops (linear, conv2d,
activations, elementwise arithmetic, softmax, layer_norm, reductions, cumsum,
cat, matmul/bmm, max_pool2d, reshapes), wraps each in an ``nn.Module`` and
compiles it in modes ``rule`` (with random settings), ``full`` and ``amp``, for
fp16 and bf16. For every compiled graph:

- it runs, and every node's real value has the dtype and shape its
  ``meta["val"]`` claims (checked node by node with ``torch.fx.Interpreter``);
- no cast converts a tensor to the type it already has, and no tensor is cast
  twice to the same type;
- nodes a keep-fp32 rule decided run in fp32 and nodes lowered by default run
  in the low type;
- rule/full keep the public output dtypes; amp's output dtypes equal eager
  ``torch.autocast`` and its outputs are bit-identical to it (fp32 mode
  likewise bit-identical to the plain eager module);
- the outputs stay within an error bound of the fp32 eager outputs.

The error bound (``_step_error``) is a forward rounding-error analysis in the
low type's machine epsilon ``u = torch.finfo(low).eps``, with the magnitudes
taken from the fp32 run. Every value is assumed to be rounded once to the low
type (``u * |value|``; ``u`` is twice the unit roundoff, which leaves room for
a cast on top of a rounded result), and every op propagates the error of its
inputs by its own growth factor: 1 for relu/max_pool/reshapes, 1/4 for sigmoid,
1.13 for gelu (max |gelu'|), ``exp(|x| + e)`` for exp, the row sum of ``|W|``
for linear/conv (plus the rounding of the weights), ``K`` for a sum or cumsum
over ``K`` elements, ``K * |operand|`` for a matmul with inner size ``K``,
``exp(2e) - 1`` relative for softmax, 2 for log_softmax, and ``(2/s) (1 +
|x - mean| / s)`` for layer_norm over rows with standard deviation ``s``. The
accumulating kernels (matmul, conv, sum, cumsum, softmax, layer_norm)
accumulate in fp32 on CPU and round once, so accumulation adds only one output
rounding. Errors thus grow with the output magnitude and with graph depth
through the per-op factors; the assertion allows twice the bound. Measured on
728 generated outputs (full and amp, fp16 and bf16), the real error was at
most 0.31 of the bound and typically 0.04: the bound holds with margin, and
is loose only where worst-case accumulation (a sum or matmul of correlated
errors) does not happen. Where an
intermediate value could reach the low type's overflow threshold the accuracy
property is not asserted (overflow to inf in fp16 is the defined behaviour of
the full and amp modes, not a compiler error).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from torch import nn

from harness.autocast import AutocastSettings, compile

aten = torch.ops.aten
LOW_TYPES = (torch.float16, torch.bfloat16)
MAX_NUMEL = 64 * 64
MAX_STEPS = 10
MAX_OPS = 14  # aten ops per graph; a matmul step costs two (it transposes its second operand)
SAFETY = 2.0
# Rules that keep a node in fp32 under the rule policy; "default"/"full" lower it.
KEEP_FP32_RULES = {"nodes_to_exclude", "data_max", "max_depth_of_reduction", "init_max"}
LOWERING_RULES = {"default", "full"}

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """One op of a generated program: ``args`` index earlier values."""

    op: str
    args: tuple[int, ...]
    param: int = 0


@dataclass(frozen=True)
class Program:
    input_shapes: tuple[Shape, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    seed: int


UNARY = ("relu", "gelu", "sigmoid", "tanh")
BINARY = ("add", "mul", "sub")
# Ops whose output is within [-1, 1] (or keeps its input's bound): exp stays small on them.
BOUNDING = {"sigmoid", "tanh", "softmax"}
KEEPS_BOUND = {"relu", "max_pool2d", "flatten", "reshape", "transpose"}
ALL_OPS = UNARY + BINARY + (
    "exp", "linear", "conv2d", "max_pool2d", "flatten", "reshape", "transpose", "softmax",
    "log_softmax", "layer_norm", "sum", "mean", "cumsum", "cat", "matmul",
)  # fmt: skip


# --- shapes ---------------------------------------------------------------------------


def _out_shape(step: Step, shapes: Sequence[Shape]) -> Shape:
    a = shapes[step.args[0]]
    op = step.op
    if op == "linear":
        return a[:-1] + (step.param,)
    if op == "conv2d":  # param = out_channels * 2 + (kernel 3?); padding keeps H, W
        return (a[0], step.param // 2, a[2], a[3])
    if op == "max_pool2d":
        return (a[0], a[1], a[2] // 2, a[3] // 2)
    if op == "flatten":
        return (a[0], math.prod(a[1:]))
    if op == "reshape":
        return (a[0], 2, a[1] // 2)
    if op == "transpose":
        return a[:-2] + (a[-1], a[-2])
    if op in ("sum", "mean"):
        return tuple(1 if d == step.param else n for d, n in enumerate(a))
    if op == "cat":
        return a[:-1] + (a[-1] + shapes[step.args[1]][-1],)
    if op == "matmul":
        return a[:-1] + (shapes[step.args[1]][-2],)
    return a


def _candidates(op: str, shapes: Sequence[Shape], bounded: Sequence[bool]) -> list[tuple[int, ...]]:
    """Argument index tuples ``op`` can take among the values so far."""
    idx = range(len(shapes))
    if op in BINARY:
        return [(i, j) for i in idx for j in idx if shapes[i] == shapes[j]]
    if op == "cat":
        return [(i, j) for i in idx for j in idx if shapes[i][:-1] == shapes[j][:-1]]
    if op == "matmul":  # a @ b.transpose(-1, -2): batch dims and inner size agree
        return [
            (i, j) for i in idx for j in idx
            if shapes[i][:-2] == shapes[j][:-2] and shapes[i][-1] == shapes[j][-1]
        ]  # fmt: skip
    rank_ok = {
        "conv2d": lambda s: len(s) == 4,
        "max_pool2d": lambda s: len(s) == 4 and min(s[2:]) >= 2,
        "flatten": lambda s: len(s) >= 3,
        "reshape": lambda s: len(s) == 2 and s[1] % 2 == 0,
    }
    ok = rank_ok.get(op, lambda s: True)
    return [(i,) for i in idx if ok(shapes[i]) and (op != "exp" or bounded[i])]


def _param(op: str, shape: Shape) -> st.SearchStrategy[int]:
    if op == "linear":
        return st.integers(1, 32)
    if op == "conv2d":
        return st.integers(2, 33)  # out_channels 1..16, low bit: kernel 3 (else 1)
    if op in ("softmax", "log_softmax", "sum", "mean", "cumsum"):
        return st.integers(0, len(shape) - 1)
    return st.just(0)


@st.composite
def _input_shape(draw: st.DrawFn) -> Shape:
    if draw(st.booleans()):
        return (draw(st.integers(1, 8)), draw(st.integers(1, 32)))
    return (draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(2, 8)), draw(st.integers(2, 8)))


@st.composite
def programs(draw: st.DrawFn) -> Program:
    first = draw(_input_shape())
    inputs = [first]
    if draw(st.booleans()):
        inputs.append(draw(st.one_of(st.just(first), _input_shape())))
    shapes: list[Shape] = list(inputs)
    bounded = [True] * len(inputs)
    steps: list[Step] = []
    ops_left = MAX_OPS
    for _ in range(draw(st.integers(1, MAX_STEPS))):
        options = {op: c for op in ALL_OPS if (c := _candidates(op, shapes, bounded))}
        op = draw(st.sampled_from(sorted(options)))
        args = draw(st.sampled_from(options[op]))
        step = Step(op, args, draw(_param(op, shapes[args[0]])))
        shape = _out_shape(step, shapes)
        cost = 2 if op == "matmul" else 1
        if math.prod(shape) > MAX_NUMEL or cost > ops_left:
            continue
        ops_left -= cost
        steps.append(step)
        shapes.append(shape)
        bounded.append(op in BOUNDING or (op in KEEPS_BOUND and bounded[args[0]]))
    last = len(shapes) - 1
    extra = draw(st.lists(st.integers(0, last), max_size=1))
    return Program(tuple(inputs), tuple(steps), (last, *extra), draw(st.integers(0, 2**16)))


# --- the generated module -------------------------------------------------------------


def _layer(step: Step, shape: Shape) -> nn.Module:
    if step.op == "linear":
        return nn.Linear(shape[-1], step.param)
    if step.op == "conv2d":
        kernel = 3 if step.param % 2 else 1
        return nn.Conv2d(shape[1], step.param // 2, kernel, padding=kernel // 2)
    if step.op == "layer_norm":
        norm = nn.LayerNorm(shape[-1])
        with torch.no_grad():  # not the identity affine: its rounding must show
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        return norm
    return nn.Identity()  # keeps layer i aligned with step i


def _apply(step: Step, xs: list[torch.Tensor], layer: nn.Module) -> torch.Tensor:
    op, p = step.op, step.param
    x = xs[0]
    simple: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "relu": F.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp,
        "linear": layer, "conv2d": layer, "layer_norm": layer,
        "max_pool2d": lambda t: F.max_pool2d(t, 2), "flatten": lambda t: torch.flatten(t, 1),
        "reshape": lambda t: t.reshape(t.shape[0], 2, t.shape[1] // 2), "transpose": lambda t: t.transpose(-1, -2),
        "softmax": lambda t: torch.softmax(t, p), "log_softmax": lambda t: torch.log_softmax(t, p),
        "sum": lambda t: t.sum(p, keepdim=True), "mean": lambda t: t.mean(p, keepdim=True),
        "cumsum": lambda t: torch.cumsum(t, p),
    }  # fmt: skip
    if op in simple:
        return simple[op](x)
    y = xs[1]
    if op == "add":
        return x + y
    if op == "mul":
        return x * y
    if op == "sub":
        return x - y
    if op == "cat":
        return torch.cat([x, y], -1)
    if op == "matmul":
        return torch.bmm(x, y.transpose(1, 2)) if x.dim() == 3 else torch.matmul(x, y.transpose(-1, -2))
    raise AssertionError(f"no rule for {op}")


class Generated(nn.Module):
    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        shapes = list(program.input_shapes)
        layers = []
        with torch.random.fork_rng():
            torch.manual_seed(program.seed)
            for step in program.steps:
                layers.append(_layer(step, shapes[step.args[0]]))
                shapes.append(_out_shape(step, shapes))
        self.layers = nn.ModuleList(layers)

    def values(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every value of the program: the inputs, then one per step."""
        vals = list(inputs)
        for step, layer in zip(self.program.steps, self.layers, strict=True):
            vals.append(_apply(step, [vals[i] for i in step.args], layer))
        return vals

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = self.values(inputs)
        return tuple(vals[i] for i in self.program.outputs)


def _inputs(program: Program) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(program.seed + 1)
    return tuple(torch.rand(s, generator=gen) * 2 - 1 for s in program.input_shapes)


# --- the error bound (derivation in the module docstring) -----------------------------


def _absmax(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _row_abs_sum(weight: torch.Tensor) -> float:
    return float(weight.detach().abs().flatten(1).sum(1).max())


def _layer_norm_growth(x: torch.Tensor, e: float) -> float:
    """Worst row of ``(2e / s_lo) (1 + |x - mean| / s)``; inf when ``e`` could swamp the spread."""
    c = x - x.mean(-1, keepdim=True)
    s = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    s_lo = s - 2 * e
    if bool((s_lo <= 0).any()):
        return math.inf
    growth = (2 * e / s_lo) * (1 + c.abs().amax(-1, keepdim=True) / s)
    return float(growth.max())


def _step_error(step: Step, xs: list[torch.Tensor], errs: list[float], out: torch.Tensor, layer: nn.Module, u: float) -> float:
    op, e = step.op, errs[0]
    if op in ("relu", "max_pool2d", "flatten", "reshape", "transpose"):
        return e  # exact on their (already rounded) inputs
    if op == "cat":
        return max(errs)
    if op == "gelu":
        p = 1.13 * e
    elif op == "sigmoid":
        p = 0.25 * e
    elif op == "tanh":
        p = e
    elif op == "exp":
        p = math.exp(_absmax(xs[0]) + e) * e
    elif op in ("add", "sub"):
        p = errs[0] + errs[1]
    elif op == "mul":
        p = _absmax(xs[0]) * errs[1] + _absmax(xs[1]) * errs[0] + errs[0] * errs[1]
    elif op in ("linear", "conv2d"):
        r = _row_abs_sum(layer.weight)  # type: ignore[arg-type]
        p = r * e + u * r * (_absmax(xs[0]) + e) + u * _absmax(layer.bias)  # type: ignore[arg-type]
    elif op == "layer_norm":
        g = _absmax(layer.weight)  # type: ignore[arg-type]
        p = g * _layer_norm_growth(xs[0], e) + u * (g * math.sqrt(xs[0].shape[-1]) + _absmax(layer.bias))  # type: ignore[arg-type]
    elif op == "softmax":
        # exp of an input error e moves probabilities by a factor up to e^(2e); past
        # float range the bound is simply unbounded (no assertion is possible there).
        p = _absmax(out) * math.expm1(2 * e) if 2 * e < 700 else math.inf
    elif op == "log_softmax":
        p = 2 * e
    elif op in ("sum", "cumsum"):
        p = xs[0].shape[step.param] * e
    elif op == "mean":
        p = e
    elif op == "matmul":
        k = xs[0].shape[-1]
        p = k * (_absmax(xs[0]) * errs[1] + _absmax(xs[1]) * errs[0] + errs[0] * errs[1])
    else:
        raise AssertionError(f"no error rule for {op}")
    return p + u * (_absmax(out) + p)


def _error_bounds(module: Generated, values: list[torch.Tensor], low: torch.dtype) -> list[float]:
    u, tiny = torch.finfo(low).eps, torch.finfo(low).tiny
    errs = [u * _absmax(v) + tiny for v in values[: len(module.program.input_shapes)]]
    for step, layer, out in zip(module.program.steps, module.layers, values[len(errs) :], strict=True):
        xs = [values[i] for i in step.args]
        errs.append(_step_error(step, xs, [errs[i] for i in step.args], out, layer, u) + tiny)
    return errs


# --- checks ----------------------------------------------------------------------------


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.real: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        self.real[n] = result
        return result


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _run_recorded(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[torch.fx.Node, Any]:
    recorder = _Recorder(gm)
    with torch.autocast("cpu", enabled=False), torch.inference_mode():
        recorder.run(*inputs)
    return recorder.real


def _check_meta_matches_real(gm: torch.fx.GraphModule, real: dict[torch.fx.Node, Any], where: str) -> None:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        metas, reals = _leaves(node.meta.get("val")), _leaves(real[node])
        assert len(metas) == len(reals), f"{where}: node {node.name} has {len(reals)} tensors, meta {len(metas)}"
        for m, r in zip(metas, reals, strict=True):
            assert (r.dtype, tuple(r.shape)) == (m.dtype, tuple(m.shape)), (
                f"{where}: node {node.name} ({node.target}) runs as {r.dtype}{list(r.shape)}, "
                f"meta says {m.dtype}{list(m.shape)}"
            )


def _check_casts(gm: torch.fx.GraphModule, real: dict[torch.fx.Node, Any], where: str) -> None:
    """No same-type cast; one cast per tensor per type; one converted copy per weight per type."""
    seen: set[tuple[Any, str]] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            key = (node.meta.get("weight_name", node.target), str(real[node].dtype))
            assert key not in seen, f"{where}: weight {key[0]} has two {key[1]} copies"
        elif node.target is aten._to_copy.default:
            src = node.args[0]
            dtype = node.kwargs.get("dtype")
            assert real[src].dtype != dtype, f"{where}: cast {node.name} converts {src.name} to the type it has ({dtype})"
            key = (src, repr(sorted(node.kwargs.items())))
            assert key not in seen, f"{where}: {src.name} is cast to {dtype} twice"
        else:
            continue
        seen.add(key)


def _check_rule_precisions(cg: Any, low: torch.dtype, where: str) -> None:
    for row in cg.report.rows:
        floats = [d for d in row.output_dtypes if d in ("fp16", "bf16", "fp32")]
        if row.rule in KEEP_FP32_RULES:
            assert floats and set(floats) == {"fp32"}, f"{where}: {row.name} kept fp32 by {row.rule} runs as {floats}"
        if row.rule in LOWERING_RULES and floats:
            want = "fp16" if low == torch.float16 else "bf16"
            assert set(floats) == {want}, f"{where}: {row.name} lowered by {row.rule} runs as {floats}"


def _note(text: str) -> None:
    if currently_in_test_context():
        event(text)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, with every NaN made one (NaN payloads are not a type decision)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.masked_fill(torch.isnan(t), float("nan")).contiguous().view(ints)


def _assert_bit_identical(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], where: str) -> None:
    assert [g.dtype for g in got] == [w.dtype for w in want], f"{where}: output dtypes differ from eager"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same = torch.equal(_bits(g), _bits(w))
        assert same, f"{where}: output {i} differs from eager (max diff {float((g.double() - w.double()).abs().max()):.3g})"


def _check_accuracy(
    got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], tol: Sequence[float], where: str
) -> None:
    for i, (g, r, t) in enumerate(zip(got, ref, tol, strict=True)):
        finite = torch.isfinite(r)
        err = (g.double() - r.double()).abs()[finite]
        worst = float(err.max()) if err.numel() else 0.0
        assert not math.isnan(worst) and worst <= SAFETY * t, (
            f"{where}: output {i} error {worst:.3g} exceeds {SAFETY:g} x bound {t:.3g}"
        )


def _rule_settings(data: st.DataObject, low: torch.dtype, node_names: list[str]) -> AutocastSettings:
    def pattern(name: str) -> st.SearchStrategy[str]:
        stem = re.sub(r"_\d+$", "", name)
        return st.sampled_from([f"^{re.escape(name)}$", f"^{re.escape(stem)}"])

    names = st.sampled_from(node_names).flatmap(pattern) if node_names else st.nothing()
    return AutocastSettings(
        low_precision_type=low,
        nodes_to_exclude=data.draw(st.lists(names, max_size=2), label="nodes_to_exclude"),
        data_max=data.draw(st.one_of(st.none(), st.floats(0.05, 1000.0)), label="data_max"),
        max_depth_of_reduction=data.draw(st.one_of(st.none(), st.integers(1, 64)), label="max_depth_of_reduction"),
    )


# Hand-written programs that together use every op of the vocabulary.
EVERY_OP = Program(
    input_shapes=((2, 3, 4, 4), (4, 8)),
    steps=(
        Step("conv2d", (0,), 9),  # (2,4,4,4), kernel 3
        Step("max_pool2d", (2,)),  # (2,4,2,2)
        Step("flatten", (3,)),  # (2,16)
        Step("linear", (4,), 8),  # (2,8)
        Step("gelu", (5,)),
        Step("cat", (6, 5)),  # (2,16)
        Step("reshape", (7,)),  # (2,2,8)
        Step("matmul", (8, 8)),  # bmm -> (2,2,2)
        Step("sigmoid", (1,)),  # (4,8)
        Step("exp", (10,)),
    ),
    outputs=(9, 11),
    seed=7,
)
EVERY_OP_2 = Program(
    input_shapes=((4, 8),),
    steps=(
        Step("layer_norm", (0,)),
        Step("tanh", (1,)),
        Step("softmax", (2,), 1),
        Step("log_softmax", (1,), 0),
        Step("mul", (3, 4)),
        Step("sub", (5, 0)),
        Step("add", (6, 6)),
        Step("relu", (7,)),
        Step("cumsum", (8,), 1),
        Step("transpose", (9,)),
        Step("matmul", (10, 10)),  # 2-D matmul -> (8,8)
        Step("sum", (11,), 0),
        Step("mean", (11,), 1),
    ),
    outputs=(12, 13),
    seed=11,
)
# Found by the property test: a linear on a non-contiguous 4-D input runs through
# aten.matmul, whose folding choice depends on whether the weight requires grad.
TRANSPOSED_LINEAR = Program(input_shapes=((1, 1, 2, 4),), steps=(Step("transpose", (0,)), Step("linear", (1,), 1)), outputs=(2,), seed=0)


def _exported_ops(program: Program) -> set[str]:
    module = Generated(program).eval()
    ep = torch.export.export(module, _inputs(program))
    return {n.target._schema.name.split("::")[-1] for n in ep.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}


def test_the_fixed_examples_cover_the_vocabulary() -> None:
    """The generator's ops reach the graph as the aten ops the compiler must handle."""
    ops = _exported_ops(EVERY_OP) | _exported_ops(EVERY_OP_2)
    expected = {
        "conv2d", "max_pool2d", "flatten", "linear", "gelu", "cat", "reshape", "bmm", "sigmoid", "exp",
        "layer_norm", "tanh", "softmax", "log_softmax", "mul", "sub", "add", "relu", "cumsum", "transpose",
        "matmul", "sum", "mean",
    }  # fmt: skip
    assert expected <= ops, f"missing from the exported graphs: {sorted(expected - ops)}"
    assert {s.op for s in EVERY_OP.steps + EVERY_OP_2.steps} == set(ALL_OPS)


def _check_program(program: Program, rule_settings: Callable[[torch.dtype, list[str]], AutocastSettings]) -> set[str]:
    """Every property, for rule (settings from ``rule_settings``), full and amp, fp16 and bf16.

    Returns the rules that decided some node under the rule policy.
    """
    rules: set[str] = set()
    module = Generated(program).eval()
    inputs = _inputs(program)
    with torch.inference_mode():
        values = module.values(inputs)
    reference = tuple(values[i] for i in program.outputs)

    fp32 = compile(module, inputs, policy="fp32")
    _assert_bit_identical(fp32(*inputs), reference, "fp32")
    node_names = [n.name for n in fp32.graph_module.graph.nodes if n.op == "call_function"]

    for low in LOW_TYPES:
        bounds = _error_bounds(module, values, low)
        tolerances = [bounds[i] for i in program.outputs]
        can_overflow = any(_absmax(v) + e > torch.finfo(low).max / 4 for v, e in zip(values, bounds, strict=True))
        with torch.autocast("cpu", dtype=low), torch.no_grad():
            eager_amp = module(*inputs)
        for mode in ("rule", "full", "amp"):
            where = f"{mode}/{low}"
            if mode == "rule":
                cg = compile(module, inputs, policy=mode, settings=rule_settings(low, node_names))
                rules |= set(cg.report.counts())
            else:
                cg = compile(module, inputs, policy=mode, low_precision_type=low)
            got = cg(*inputs)
            real = _run_recorded(cg.graph_module, inputs)
            _check_meta_matches_real(cg.graph_module, real, where)
            _check_casts(cg.graph_module, real, where)
            if mode == "amp":
                _assert_bit_identical(got, eager_amp, where)
            else:
                _check_rule_precisions(cg, low, where)
                assert [g.dtype for g in got] == [r.dtype for r in reference], f"{where}: public output dtypes changed"
            if can_overflow:
                _note(f"{where}: may overflow, accuracy not asserted")
            else:
                _check_accuracy(got, reference, tolerances, where)
    return rules


@pytest.mark.slow  # 30 generated programs, each compiled, built and run
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(), data=st.data())
def test_compiled_graphs_are_typed_clean_exact_and_accurate(program: Program, data: st.DataObject) -> None:
    _check_program(program, lambda low, names: _rule_settings(data, low, names))


@pytest.mark.parametrize(
    ("program", "data_max", "max_depth"),
    [(EVERY_OP, 2.0, 8), (EVERY_OP_2, 100.0, 4), (TRANSPOSED_LINEAR, None, None)],
    ids=["every_op_1", "every_op_2", "transposed_linear"],
)
def test_fixed_programs(program: Program, data_max: float | None, max_depth: int | None) -> None:
    def rule_settings(low: torch.dtype, names: list[str]) -> AutocastSettings:
        return AutocastSettings(
            low_precision_type=low,
            nodes_to_exclude=[f"^{re.escape(names[0])}$"],
            data_max=data_max,
            max_depth_of_reduction=max_depth,
        )

    rules = _check_program(program, rule_settings)
    if data_max is not None:  # thresholds chosen so that every keep-fp32 rule decides some node
        assert {"nodes_to_exclude", "data_max", "max_depth_of_reduction", "default"} <= rules, rules
