"""The ONNX hand-off against ModelOpt AutoCast: Cast count and error, model by model.

Both sides start from the same module with the same weights and end as an
fp16 ONNX file run by ONNX Runtime on CPU:

- **ours**: ``compile(policy="rule", low fp16)`` (its defaults, bias correction among them) with the model's calibration
  batches, then :func:`harness.engines.onnx_export.export_onnx`;
- **ModelOpt**: the fp32 module exported with ``torch.onnx.export`` (dynamo,
  opset 20), then ``modelopt.onnx.autocast.convert_to_mixed_precision`` with
  ``data_max=512``, fp16, the same calibration batches (``.npz`` files) and
  ``keep_io_types=True`` (fp32 inputs and outputs, as ours).

Errors are the worst and the mean absolute difference from eager fp32 over
the example and calibration batches and more drawn like them
(:data:`EVALUATION_BATCHES` in all); Casts are the file's ``Cast`` nodes.

The worst error of one weight draw is one element's: where two files compute
the same ops in the same precision up to a few roundings, which of them is
worse there is largely chance. ``--seeds N`` repeats the comparison on N
weight draws (the first the model's own weights, the others drawn anew with
each parameter's mean and spread) and adds, per model, on how many draws ours
has no more worst error, mean error and Casts than ModelOpt's.

ModelOpt is a large optional install (``pip install 'nvidia-modelopt[onnx]'``,
in an environment of its own with the CPU build of torch); it is imported
only here, when the script runs::

    python -m harness.benchmarks.modelopt_compare [--models mixer,reductions] [--seeds N] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from harness import models
from harness.autocast import compile
from harness.engines.onnx_export import export_onnx, quiet_exporter
from harness.errors import HarnessError
from harness.globalstate import preserved_global_state
from harness.outputs import tensor_paths

DATA_MAX = 512.0
MODELOPT_OPSET = 20


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token1, self.token2 = nn.Linear(tokens, hidden), nn.Linear(hidden, tokens)
        self.channel1, self.channel2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token2(nn.functional.gelu(self.token1(self.norm1(x).transpose(1, 2))))
        x = x + mixed.transpose(1, 2)
        out: torch.Tensor = x + self.channel2(nn.functional.gelu(self.channel1(self.norm2(x))))
        return out


class Mixer(nn.Module):
    """MLP-Mixer: 4x4 patches, two blocks of token and channel mixing, mean over tokens, head."""

    def __init__(self, dim: int = 64, hidden: int = 96) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(_MixerBlock(49, dim, hidden), _MixerBlock(49, dim, hidden))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.stem(images).flatten(2).transpose(1, 2)
        out: torch.Tensor = self.head(self.norm(self.blocks(tokens)).mean(1))
        return out


class Reductions(nn.Module):
    """A projection followed by cumulative sums, sums, absolute values and products."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        running = torch.cumsum(h, dim=-1) / 32
        total = h.abs().sum(-1, keepdim=True)
        product = (1 + 0.1 * h).prod(-1, keepdim=True)
        out: torch.Tensor = self.out(running * product + total)
        return out


def _made(name: str, make: Callable[[], nn.Module], shape: tuple[int, ...]) -> models.ModelSpec:
    torch.manual_seed(0)  # the weights
    module = make().eval()
    generator = torch.Generator().manual_seed(1)
    batches: list[tuple[torch.Tensor, ...]] = [(torch.randn(*shape, generator=generator),) for _ in range(5)]
    return models.ModelSpec(name, f"modelopt comparison: {name}", module, batches[0], batches[1:])


SUBJECTS: dict[str, Callable[[], models.ModelSpec]] = {
    "mixer": lambda: _made("mixer", Mixer, (2, 3, 28, 28)),
    "mobilenet": lambda: models.load("mobilenet"),
    "reductions": lambda: _made("reductions", Reductions, (8, 32)),
    "resnet": lambda: models.load("resnet"),
    "transformer": lambda: models.load("transformer"),
}


@dataclass(frozen=True)
class Side:
    """One file: worst and mean absolute error against eager fp32, and its Cast count."""

    max_error: float
    mean_error: float
    casts: int


@dataclass(frozen=True)
class Row:
    model: str
    ours: Side
    modelopt: Side


EVALUATION_BATCHES = 16


def _like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A tensor drawn like ``t``: floats with its mean and spread, integers in its range."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=generator) * t.std() + t.mean()
    return torch.randint(int(t.min()), int(t.max()) + 1, t.shape, generator=generator, dtype=t.dtype)


def _batches(spec: models.ModelSpec) -> list[tuple[torch.Tensor, ...]]:
    """The calibration batches, then more drawn like the example inputs (the error is a worst case over them)."""
    given = [tuple(spec.example_inputs), *(tuple(b) for b in spec.calibration_data or [])]
    generator = torch.Generator().manual_seed(2)
    drawn = [tuple(_like(t, generator) for t in spec.example_inputs) for _ in range(EVALUATION_BATCHES - len(given))]
    return given + drawn


def _calibration(spec: models.ModelSpec) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(spec.example_inputs), *(tuple(b) for b in spec.calibration_data or [])]


def _run_onnx(path: Path, names: Sequence[str], batch: Sequence[torch.Tensor]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {name: t.numpy() for name, t in zip(names, batch, strict=True)}
    return [np.asarray(o) for o in session.run(None, feeds)]


def _differences(outputs: Sequence[np.ndarray], eager: Any) -> np.ndarray:
    """Every output element's absolute difference from eager fp32, flat."""
    want = [t for _, t in tensor_paths(eager)]
    if len(want) != len(outputs):
        raise HarnessError(f"ONNX model returns {len(outputs)} outputs, eager {len(want)}")
    return np.concatenate(
        [np.abs(o.astype(np.float64) - w.double().numpy()).ravel() for o, w in zip(outputs, want, strict=True)]
    )


def _side(path: Path, names: Sequence[str], feeds: Sequence[Sequence[torch.Tensor]], eager: Sequence[Any]) -> Side:
    diffs = np.concatenate([_differences(_run_onnx(path, names, b), e) for b, e in zip(feeds, eager, strict=True)])
    return Side(float(diffs.max()), float(diffs.mean()), _casts(path))


def _casts(path: Path) -> int:
    import onnx

    return sum(1 for node in onnx.load(str(path)).graph.node if node.op_type == "Cast")


def _ours(spec: models.ModelSpec, work: Path, eager: Sequence[Any]) -> Side:
    compiled = compile(
        spec.module, spec.example_inputs, policy="rule", low_precision_type="fp16",
        calibration_data=spec.calibration_data,
    )  # fmt: skip
    path = work / f"{spec.name}-ours.onnx"
    record = export_onnx(compiled, path)
    feeds = [compiled.typed_inputs(b) for b in _batches(spec)]
    return _side(path, [s.name for s in record.inputs], feeds, eager)


def _quiet_modelopt() -> None:
    """ModelOpt's loggers at ERROR: each of its modules sets its own level to INFO, logging to stdout, on import."""
    for name in list(logging.root.manager.loggerDict):
        if name == "modelopt" or name.startswith("modelopt."):
            logging.getLogger(name).setLevel(logging.ERROR)


def _modelopt(spec: models.ModelSpec, work: Path, eager: Sequence[Any]) -> Side:
    import onnx
    from modelopt.onnx.autocast import convert_to_mixed_precision

    _quiet_modelopt()
    fp32 = work / f"{spec.name}-fp32.onnx"
    names = [f"input{i}" for i in range(len(spec.example_inputs))]
    with quiet_exporter():
        torch.onnx.export(spec.module, tuple(spec.example_inputs), str(fp32), dynamo=True, opset_version=MODELOPT_OPSET,
                          input_names=names, verbose=False)  # fmt: skip
    calibration = work / f"{spec.name}-calibration"
    calibration.mkdir()
    for i, batch in enumerate(_calibration(spec)):
        arrays: dict[str, Any] = {n: t.numpy() for n, t in zip(names, batch, strict=True)}
        np.savez(calibration / f"{i:03d}.npz", **arrays)
    converted = convert_to_mixed_precision(
        str(fp32), low_precision_type="fp16", data_max=DATA_MAX, keep_io_types=True,
        calibration_data=str(calibration), providers=["cpu"],
    )  # fmt: skip
    path = work / f"{spec.name}-modelopt.onnx"
    onnx.save(converted, str(path))
    return _side(path, names, _batches(spec), eager)


def reseeded(spec: models.ModelSpec, seed: int) -> models.ModelSpec:
    """``spec`` with its parameters drawn anew from ``seed`` (each with its own mean and spread); seed 0: as it is.

    Constant parameters (a norm's ones, a zero bias) and buffers stay.
    """
    if seed == 0:
        return spec
    module = copy.deepcopy(spec.module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 1 and float(p.std()) > 0:
                p.copy_(torch.randn(p.shape, generator=generator) * p.std() + p.mean())
    return models.ModelSpec(spec.name, spec.description, module.eval(), spec.example_inputs, spec.calibration_data)


def compare(name: str, seed: int = 0) -> Row:
    spec = reseeded(SUBJECTS[name](), seed)
    with torch.inference_mode():
        eager = [spec.module(*b) for b in _batches(spec)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours = _ours(spec, work, eager)
        modelopt = _modelopt(spec, work, eager)
    return Row(name, ours, modelopt)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | our max error | our mean error | our casts | ModelOpt max error | ModelOpt mean error | ModelOpt casts |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    lines += [
        f"| {r.model} | {r.ours.max_error:.3g} | {r.ours.mean_error:.3g} | {r.ours.casts} "
        f"| {r.modelopt.max_error:.3g} | {r.modelopt.mean_error:.3g} | {r.modelopt.casts} |"
        for r in rows
    ]
    return "\n".join(lines)


def tally(draws: dict[str, Sequence[Row]]) -> str:
    """Per model: on how many weight draws ours has no more worst error, mean error and Casts than ModelOpt's."""
    lines = [
        "| model | draws | our max error <= ModelOpt's | our mean error <= ModelOpt's | our casts <= ModelOpt's |",
        "|---|--:|--:|--:|--:|",
    ]
    for model, rows in draws.items():
        count = len(rows)
        wins = [
            sum(1 for r in rows if getattr(r.ours, f) <= getattr(r.modelopt, f)) for f in ("max_error", "mean_error", "casts")
        ]
        lines.append(f"| {model} | {count} | " + " | ".join(f"{w}/{count}" for w in wins) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SUBJECTS), help=f"comma-separated, of: {', '.join(SUBJECTS)}")
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="weight draws per model (default 1: the model's own weights); with more, "
                        "a table per draw and how often ours is no worse")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    chosen = [m for m in args.models.split(",") if m]
    unknown = [m for m in chosen if m not in SUBJECTS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; valid: {', '.join(SUBJECTS)}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"error: --seeds must be at least 1, got {args.seeds}", file=sys.stderr)
        return 2
    try:
        import modelopt.onnx.autocast  # noqa: F401
    except ImportError:
        print("error: ModelOpt is not installed: pip install 'nvidia-modelopt[onnx]'", file=sys.stderr)
        return 2
    _quiet_modelopt()
    warnings.filterwarnings("ignore")
    with preserved_global_state():
        torch.set_num_threads(1)
        draws = [[compare(m, seed) for m in chosen] for seed in range(args.seeds)]
    if args.json:
        print(json.dumps([{"seed": seed, **asdict(r)} for seed, rows in enumerate(draws) for r in rows], indent=1))
        return 0
    for seed, rows in enumerate(draws):
        if args.seeds > 1:
            print(f"weight draw {seed}" + (" (the model's own weights)" if seed == 0 else "") + ":\n")
        print(table(rows) + "\n")
    if args.seeds > 1:
        print(tally({m: [rows[i] for rows in draws] for i, m in enumerate(chosen)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
