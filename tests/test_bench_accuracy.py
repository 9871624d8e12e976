"""Accuracy metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from harness.bench.accuracy import (
    TaskAccuracy,
    compare_outputs,
    output_digest,
)
from harness.errors import HarnessError


def test_hand_computed_metrics() -> None:
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.tensor([1.0, 2.5, 3.0, 3.0])
    d = compare_outputs(out, ref).to_dict()
    # |diff| = [0, .5, 0, 1]
    assert d["max_abs_error"] == 1.0
    assert d["mean_abs_error"] == pytest.approx(0.375)
    # relative: .5/2 and 1/4; the floor 1e-3 * 4 is below every |ref|
    assert d["max_rel_error"] == pytest.approx(0.25)
    # out.ref = 27, |out|^2 = 25.25, |ref|^2 = 30
    assert d["cosine"] == pytest.approx(27 / math.sqrt(25.25 * 30), rel=1e-15)
    # signal 30, noise 0.25 + 1 = 1.25
    assert d["snr_db"] == pytest.approx(10 * math.log10(24), rel=1e-15)
    assert d["nan_count"] == 0 and d["inf_count"] == 0 and d["identical"] is False
    assert d["top1_agreement"] is None  # only for logits


def test_relative_error_floor() -> None:
    ref = torch.tensor([0.0, 1000.0])
    out = torch.tensor([1.0, 1000.0])
    # denominator of the first element is floored at 1e-3 * max|ref| = 1
    assert compare_outputs(out, ref).max_rel_error == pytest.approx(1.0)
    assert compare_outputs(out, ref, rel_floor=1e-2).max_rel_error == pytest.approx(0.1)


def test_metrics_are_float64_not_output_dtype() -> None:
    ref = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32)  # exact in fp32
    out = ref.to(torch.float16)  # rounds to 1.0
    acc = compare_outputs(out, ref)
    assert acc.max_abs_error == 2.0**-12
    assert acc.outputs[0].dtype == "float16"
    bf = compare_outputs(ref.to(torch.bfloat16), ref)
    assert bf.max_abs_error == 2.0**-12


def test_identical_outputs() -> None:
    ref = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    d = compare_outputs(ref.clone(), ref, logits=True).to_dict()
    assert d["identical"] is True and d["max_abs_error"] == 0.0 and d["max_rel_error"] == 0.0
    assert d["cosine"] == pytest.approx(1.0) and d["snr_db"] is None and d["top1_agreement"] == 1.0


def test_nan_and_inf_are_counted_and_excluded() -> None:
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.tensor([float("nan"), 2.0, float("inf"), 4.5])
    d = compare_outputs(out, ref).to_dict()
    assert d["nan_count"] == 1 and d["inf_count"] == 1 and d["identical"] is False
    m = d["outputs"][0]
    assert m["compared"] == 2 and m["count"] == 4
    assert d["max_abs_error"] == 0.5 and d["mean_abs_error"] == pytest.approx(0.25)
    all_bad = compare_outputs(torch.full((2,), float("nan")), ref[:2])
    assert (
        all_bad.max_abs_error is None
        and all_bad.cosine is None
        and all_bad.to_dict()["nan_count"] == 2
    )


def test_top1_agreement_over_last_dim() -> None:
    ref = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    out = ref.clone()
    out[1] = torch.tensor([0.1, 0.8, 0.1])  # argmax 0 -> 1
    assert compare_outputs(out, ref, logits=True).top1_agreement == pytest.approx(0.75)
    # leading dims are flattened into rows: (2, 2, 3) is four rows
    assert compare_outputs(
        out.reshape(2, 2, 3), ref.reshape(2, 2, 3), logits=True
    ).top1_agreement == pytest.approx(0.75)


def test_cosine_edge_cases() -> None:
    zeros = torch.zeros(3)
    assert compare_outputs(zeros, zeros).cosine == 1.0
    d = compare_outputs(torch.ones(3), zeros).to_dict()
    assert d["cosine"] == 0.0 and d["snr_db"] is None  # no signal: SNR undefined
    assert compare_outputs(-torch.ones(3), torch.ones(3)).cosine == pytest.approx(-1.0)


def test_multiple_outputs_report_the_worst() -> None:
    ref = (
        torch.tensor([1.0, 1.0]),
        {"b": torch.tensor([2.0, 2.0, 2.0, 2.0]), "a": torch.tensor([5.0])},
    )
    # The engine's dict lists its keys in another order: outputs pair by path, not position.
    out = (
        torch.tensor([1.0, 1.5]),
        {"a": torch.tensor([5.0]), "b": torch.tensor([2.0, 2.0, 2.0, 2.1])},
    )
    acc = compare_outputs(out, ref)
    assert [m.path for m in acc.outputs] == ["[0]", "[1]['b']", "[1]['a']"]
    assert acc.outputs[1].shape == [4] and acc.outputs[2].shape == [1]
    assert acc.max_abs_error == pytest.approx(0.5)
    # mean over all 7 compared elements: (0.5 + 0.1) / 7
    assert acc.mean_abs_error == pytest.approx(0.6 / 7)
    first, last = acc.outputs[0].cosine, acc.outputs[1].cosine
    assert first is not None and last is not None
    assert acc.cosine == first < last


def test_structure_errors_name_the_output() -> None:
    with pytest.raises(HarnessError, match=r"only the engine has \[0\], \[1\]; only the reference has "):
        compare_outputs((torch.zeros(2), torch.zeros(2)), torch.zeros(2))
    with pytest.raises(HarnessError, match=r"only the engine has \['logits'\]; only the reference has \['last'\]"):
        compare_outputs({"logits": torch.zeros(2)}, {"last": torch.zeros(2)})
    with pytest.raises(
        HarnessError, match=r"output \[0\]: shape \(3,\) differs from the reference shape \(2,\)"
    ):
        compare_outputs((torch.zeros(3),), (torch.zeros(2),))
    with pytest.raises(HarnessError, match=r"output\[1\] is a str"):
        compare_outputs((torch.zeros(1), "x"), (torch.zeros(1), "x"))


def test_output_digest_is_bit_exact() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert output_digest(x) == output_digest(x.clone())
    assert output_digest((x,)) != output_digest(x)  # the structure is part of the output
    assert output_digest(x).startswith("sha256:") and len(output_digest(x)) == 7 + 64
    y = x.clone()
    y[2] = torch.nextafter(y[2], torch.tensor(10.0))  # one ulp
    assert output_digest(y) != output_digest(x)
    assert output_digest(x.reshape(2, 2)) != output_digest(x)  # same bytes, other shape
    assert output_digest(x.view(torch.int32)) != output_digest(x)  # same bytes, other dtype
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert output_digest(bf) == output_digest(bf.clone())
    assert output_digest(x[::2]) == output_digest(torch.tensor([1.0, 3.0]))  # strided view


def test_task_accuracy_record() -> None:
    assert TaskAccuracy(name="top1", value=0.8, samples=5).to_dict() == {
        "name": "top1",
        "value": 0.8,
        "samples": 5,
    }
