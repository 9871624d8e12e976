"""Accuracy of an engine's outputs against the fp32 eager reference.

All metrics are computed in float64 so the comparison adds no rounding of
its own. Outputs may be a tensor or any pytree of tensors (tuples, lists,
dicts, ``transformers`` ``ModelOutput``); an engine's output is paired with
the reference's by its *path* (``['logits']``, ``[1][0]``), never by position
in a flattening order, and outputs that exist on one side only are an error.

Non-finite values are counted (``nan_count``, ``inf_count`` of the output
under test) and the error metrics are computed over the positions where
both output and reference are finite, so one NaN does not turn every other
number into NaN (and the results stay valid JSON). A NaN appearing is
caught by the counts, which the gate treats as a regression of their own.

Relative error uses a floor on the denominator: ``|out - ref| /
max(|ref|, rel_floor * max|ref|)``. Without it a reference element near zero
makes the maximum relative error meaningless; with the default
``rel_floor=1e-3`` (about fp16's unit roundoff) elements smaller than 0.1%
of the tensor's largest magnitude are judged relative to that 0.1%.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from harness.errors import HarnessError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that compare tensors, not here: the result
# types (AccuracyResult, TaskAccuracy) are read by harness.bench.results, and
# `harness gate` loads results where torch is not installed.

DEFAULT_REL_FLOOR = 1e-3


@dataclass(frozen=True)
class OutputMetrics:
    """Metrics of one output tensor.

    Error fields are None when nothing finite was compared; ``snr_db`` is
    also None when the output equals the reference (infinite) or the
    reference is all zeros (no signal).
    """

    path: str
    shape: list[int]
    dtype: str
    count: int
    compared: int
    nan_count: int
    inf_count: int
    reference_nonfinite: int
    identical: bool
    max_abs_error: float | None
    mean_abs_error: float | None
    max_rel_error: float | None
    cosine: float | None
    snr_db: float | None
    top1_agreement: float | None


def _metrics(
    path: str, out: torch.Tensor, ref: torch.Tensor, logits: bool, rel_floor: float
) -> OutputMetrics:
    import torch

    o = out.detach().to("cpu", torch.float64).reshape(-1)
    r = ref.detach().to("cpu", torch.float64).reshape(-1)
    mask = torch.isfinite(o) & torch.isfinite(r)
    o_f, r_f = o[mask], r[mask]
    compared = int(o_f.numel())
    identical = bool(torch.equal(o, r))  # NaN != NaN, so any NaN makes this False
    max_abs = mean_abs = max_rel = cosine = snr = None
    if compared:
        diff = (o_f - r_f).abs()
        max_abs = float(diff.max())
        mean_abs = float(diff.mean())
        ref_abs = r_f.abs()
        floor = max(rel_floor * float(ref_abs.max()), torch.finfo(torch.float64).tiny)
        max_rel = float((diff / ref_abs.clamp_min(floor)).max())
        norm_o, norm_r = float(o_f.norm()), float(r_f.norm())
        if norm_o == 0.0 and norm_r == 0.0:
            cosine = 1.0
        elif norm_o == 0.0 or norm_r == 0.0:
            cosine = 0.0
        else:
            cosine = float(torch.dot(o_f, r_f)) / (norm_o * norm_r)
        noise = float((diff * diff).sum())
        signal = float((r_f * r_f).sum())
        if noise > 0.0 and signal > 0.0:
            snr = 10.0 * math.log10(signal / noise)
    top1 = None
    if logits and out.dim() >= 1 and out.shape[-1] > 0 and out.numel() > 0:
        rows_o = out.detach().reshape(-1, out.shape[-1]).to("cpu", torch.float64)
        rows_r = ref.detach().reshape(-1, ref.shape[-1]).to("cpu", torch.float64)
        top1 = float((rows_o.argmax(-1) == rows_r.argmax(-1)).double().mean())
    return OutputMetrics(
        path=path,
        shape=list(out.shape),
        dtype=str(out.dtype).removeprefix("torch."),
        count=int(o.numel()),
        compared=compared,
        nan_count=int(o.isnan().sum()),
        inf_count=int(o.isinf().sum()),
        reference_nonfinite=int((~torch.isfinite(r)).sum()),
        identical=identical,
        max_abs_error=max_abs,
        mean_abs_error=mean_abs,
        max_rel_error=max_rel,
        cosine=cosine,
        snr_db=snr,
        top1_agreement=top1,
    )


def _worst(
    values: Iterable[float | None], pick: Callable[[Iterable[float]], float]
) -> float | None:
    present = [v for v in values if v is not None]
    return pick(present) if present else None


@dataclass(frozen=True)
class AccuracyResult:
    """Per-output metrics and the worst case over outputs.

    The aggregate is the worst output (largest error, smallest cosine, SNR
    and top-1 agreement) because a gate must trip when any one output goes
    bad. ``mean_abs_error`` is averaged over all compared elements.
    ``snr_db`` is None when it is undefined for every output: outputs equal
    to the reference (infinite SNR) or an all-zero reference.
    """

    outputs: list[OutputMetrics]

    @property
    def max_abs_error(self) -> float | None:
        return _worst((m.max_abs_error for m in self.outputs), max)

    @property
    def mean_abs_error(self) -> float | None:
        compared = sum(m.compared for m in self.outputs)
        if not compared:
            return None
        return sum((m.mean_abs_error or 0.0) * m.compared for m in self.outputs) / compared

    @property
    def max_rel_error(self) -> float | None:
        return _worst((m.max_rel_error for m in self.outputs), max)

    @property
    def cosine(self) -> float | None:
        return _worst((m.cosine for m in self.outputs), min)

    @property
    def snr_db(self) -> float | None:
        return _worst((m.snr_db for m in self.outputs), min)

    @property
    def top1_agreement(self) -> float | None:
        return _worst((m.top1_agreement for m in self.outputs), min)

    def to_dict(self) -> dict[str, Any]:
        """The ``accuracy`` field of a results case."""
        return {
            "max_abs_error": self.max_abs_error,
            "mean_abs_error": self.mean_abs_error,
            "max_rel_error": self.max_rel_error,
            "cosine": self.cosine,
            "snr_db": self.snr_db,
            "nan_count": sum(m.nan_count for m in self.outputs),
            "inf_count": sum(m.inf_count for m in self.outputs),
            "identical": all(m.identical for m in self.outputs),
            "top1_agreement": self.top1_agreement,
            "outputs": [asdict(m) for m in self.outputs],
        }


def compare_outputs(
    output: Any, reference: Any, *, logits: bool = False, rel_floor: float = DEFAULT_REL_FLOOR
) -> AccuracyResult:
    """Compare an engine's outputs with the fp32 reference, output by output.

    ``logits=True`` adds top-1 agreement: the fraction of rows (all leading
    dimensions flattened) whose argmax over the last dimension matches.
    """
    from harness.outputs import tensor_paths

    outs = dict(tensor_paths(output))
    refs = dict(tensor_paths(reference, "reference"))
    if outs.keys() != refs.keys():
        only_out = sorted(outs.keys() - refs.keys())
        only_ref = sorted(refs.keys() - outs.keys())
        raise HarnessError(
            "the engine's outputs and the reference's differ in structure: "
            f"only the engine has {', '.join(only_out) or 'nothing more'}; "
            f"only the reference has {', '.join(only_ref) or 'nothing more'}"
        )
    for path, r in refs.items():
        if outs[path].shape != r.shape:
            raise HarnessError(
                f"output {path or '(the only one)'}: shape {tuple(outs[path].shape)} differs from the reference "
                f"shape {tuple(r.shape)}"
            )
    return AccuracyResult([_metrics(p, outs[p], r, logits, rel_floor) for p, r in refs.items()])


def output_digest(output: Any) -> str:
    """sha256 over every output tensor's dtype, shape and raw bytes.

    Equal digests mean bit-identical outputs: the determinism check.
    """
    import torch

    from harness.outputs import tensor_paths

    h = hashlib.sha256()
    for path, t in sorted(tensor_paths(output), key=lambda pair: pair[0]):
        c = t.detach().to("cpu").contiguous()
        h.update(f"{path}{c.dtype}{tuple(c.shape)};".encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class TaskAccuracy:
    """A model's own metric on labelled data (``value`` in 0..1 for accuracies)."""

    name: str
    value: float
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "samples": self.samples}
