"""Model zoo and registry: shapes, determinism, export, and the failure messages."""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F
from harness.zoo import digits as digits_model
from harness.zoo import overflow as overflow_model
from harness.zoo import resnet as resnet_model
from harness.zoo import transformer as transformer_model
from harness.zoo.thirdparty import THIRD_PARTY

from harness import models as registry
from harness.errors import HarnessError
from harness.models import ModelSpec, available, load, register

ZOO = ["digits", "lenet", "mobilenet", "overflow", "resnet", "transformer"]
M = TypeVar("M", bound=torch.nn.Module)


def _factory(name: str) -> registry.Factory:
    """The uncached factory of a built-in model (load() memoizes)."""
    return importlib.import_module(f"harness.zoo.{name}").build


def _typed(module: torch.nn.Module, cls: type[M]) -> M:
    assert isinstance(module, cls)
    return module


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_available_lists_every_builtin_sorted() -> None:
    assert available() == sorted(ZOO + list(THIRD_PARTY))


# --- every zoo model ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_runs_finite_in_eval_mode(name: str) -> None:
    spec = load(name)
    assert spec.name == name
    assert all(not m.training for m in spec.module.modules())
    assert all(p.dtype == torch.float32 for p in spec.module.parameters())
    with torch.no_grad():
        out = spec.module(*spec.example_inputs)
    assert out.shape == (spec.example_inputs[0].shape[0], 10)
    assert torch.isfinite(out).all()
    assert out.std() > 0  # not a degenerate constant output


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_exports_and_matches_eager(name: str) -> None:
    spec = load(name)
    exported = torch.export.export(spec.module, spec.example_inputs)
    batch = spec.calibration_data[0]
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(*batch), spec.module(*batch))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_calibration_batches_match_example_inputs(name: str) -> None:
    spec = load(name)
    assert len(spec.calibration_data) >= 2
    for batch in spec.calibration_data:
        assert [(t.shape, t.dtype) for t in batch] == [
            (t.shape, t.dtype) for t in spec.example_inputs
        ]
    # Distinct batches, so calibration statistics see more than one input.
    assert not torch.equal(spec.calibration_data[0][0], spec.calibration_data[1][0])


@pytest.mark.parametrize("name", ZOO)
def test_zoo_build_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    rng_before = torch.get_rng_state()
    first, second = _factory(name)(), _factory(name)()
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert first.module is not second.module
    assert _same_state(first.module, second.module)
    for a, b in zip(first.example_inputs, second.example_inputs, strict=True):
        assert torch.equal(a, b)
    assert _same_state(first.module, load(name).module)


def test_load_hands_out_private_copies() -> None:
    first = load("resnet")
    first.module.half()
    first.example_inputs[0].zero_()
    second = load("resnet")
    assert all(p.dtype == torch.float32 for p in second.module.parameters())
    assert second.example_inputs[0].abs().sum() > 0
    assert _same_state(second.module, _factory("resnet")().module)


# --- lenet -------------------------------------------------------------------------------


def test_lenet_export_has_seed_node_names_and_autocast_region() -> None:
    spec = load("lenet")
    graph = torch.export.export(spec.module, spec.example_inputs).graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.name for n in calls[:7]] == [
        "conv2d",
        "relu",
        "max_pool2d",
        "conv2d_1",
        "relu_1",
        "max_pool2d_1",
        "flatten",
    ]
    (region,) = [n for n in calls if n.target is torch.ops.higher_order.wrap_with_autocast]
    assert region.args[0] == "cpu" and region.args[1] is torch.float32
    body = getattr(graph.owning_module, region.args[4].target).graph
    assert [n.target for n in body.nodes if n.op == "call_function"] == [
        torch.ops.aten.linear.default,
        torch.ops.aten.add.Tensor,
    ]


# --- resnet ------------------------------------------------------------------------------


def test_resnet_batchnorm_is_not_identity() -> None:
    module = load("resnet").module
    norms = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) >= 6
    for bn in norms:
        mean, var = bn.get_buffer("running_mean"), bn.get_buffer("running_var")
        assert mean.abs().min() > 0 and not torch.equal(var, torch.ones_like(var))
        x = torch.randn(2, bn.num_features, 4, 4)
        with torch.no_grad():
            y = bn(x)
        expected = (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + bn.eps)
        expected = expected * bn.weight[:, None, None] + bn.bias[:, None, None]
        torch.testing.assert_close(y, expected)
        assert (y - x).abs().max() > 0.1


def test_resnet_has_identity_and_downsample_shortcuts() -> None:
    blocks = list(_typed(load("resnet").module, resnet_model.ResNet).stages)
    assert len(blocks) == 3
    assert isinstance(blocks[0].shortcut, torch.nn.Identity)
    assert all(isinstance(b.shortcut, torch.nn.Sequential) for b in blocks[1:])


# --- transformer -------------------------------------------------------------------------


def test_transformer_takes_token_ids_and_exports_attention() -> None:
    spec = load("transformer")
    (ids,) = spec.example_inputs
    assert ids.dtype == torch.int64 and ids.shape == (8, 64)
    vocab = _typed(spec.module, transformer_model.Encoder).tokens.num_embeddings
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    graph = torch.export.export(spec.module, spec.example_inputs).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.scaled_dot_product_attention.default) == 2
    assert targets.count(torch.ops.aten.layer_norm.default) == 5


# --- overflow ----------------------------------------------------------------------------


def _overflow_intermediates(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m = _typed(module, overflow_model.Overflow)
    h = F.relu(m.linear1(x))
    z = m.linear2(h)
    y = z * overflow_model.SCALE
    n = m.norm(y)
    return {
        "linear1": m.linear1(x),
        "relu": h,
        "linear2": z,
        "mul": y,
        "norm": n,
        "out": m.linear3(n),
    }


def test_overflow_fp16_is_nonfinite_and_fp32_is_finite() -> None:
    spec = load("overflow")
    with torch.no_grad():
        for (x,) in [spec.example_inputs, *spec.calibration_data]:
            assert torch.isfinite(spec.module(x)).all()
            assert not torch.isfinite(load("overflow").module.half()(x.half())).all()
    big = _typed(spec.module, overflow_model.Overflow).linear2.weight
    assert big.abs().max() < torch.finfo(torch.float16).max


def test_overflow_only_linear2_and_its_scaling_exceed_data_max() -> None:
    spec = load("overflow")
    with torch.no_grad():
        for (x,) in spec.calibration_data:
            values = _overflow_intermediates(spec.module, x)
            torch.testing.assert_close(values["out"], spec.module(x))
            assert values["linear2"].abs().max() > torch.finfo(torch.float16).max
            for small in ("linear1", "relu", "mul", "norm", "out"):
                assert values[small].abs().max() < 512, small


def test_overflow_fp16_except_big_nodes_is_accurate() -> None:
    """linear2 and mul (input > 512) in fp32, everything else in fp16: what data_max=512 yields."""
    spec = load("overflow")
    m = _typed(spec.module, overflow_model.Overflow)
    with torch.no_grad():
        for (x,) in [spec.example_inputs, *spec.calibration_data]:
            reference = m(x)
            h = F.relu(F.linear(x.half(), m.linear1.weight.half(), m.linear1.bias.half()))
            y = F.linear(h.float(), m.linear2.weight, m.linear2.bias) * overflow_model.SCALE
            n = F.layer_norm(
                y.half(), m.norm.normalized_shape, m.norm.weight.half(), m.norm.bias.half()
            )
            out = F.linear(n, m.linear3.weight.half(), m.linear3.bias.half()).float()
            assert torch.isfinite(out).all()
            assert F.cosine_similarity(out.flatten(), reference.flatten(), dim=0) >= 0.999


# --- digits ------------------------------------------------------------------------------


def test_digits_accuracy_matches_direct_computation_and_is_high() -> None:
    spec = load("digits")
    assert spec.evaluate is not None
    _, _, x_test, y_test = digits_model.load_split()
    with torch.no_grad():
        direct = (spec.module(x_test).argmax(1) == y_test).double().mean().item()
    accuracy = spec.evaluate(spec.module)
    assert accuracy == pytest.approx(direct)
    assert accuracy > 0.9
    assert torch.equal(spec.example_inputs[0], x_test[: digits_model.BATCH])


def test_digits_evaluate_scores_a_constant_predictor_by_class_frequency() -> None:
    spec = load("digits")
    assert spec.evaluate is not None
    y_test = digits_model.load_split()[3]
    seen: list[tuple[int, ...]] = []

    def always_three(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(tuple(x.shape))
        return (F.one_hot(torch.full((len(x),), 3), 10).float(),)

    assert spec.evaluate(always_three) == pytest.approx((y_test == 3).double().mean().item())
    assert set(seen) == {tuple(spec.example_inputs[0].shape)}


def test_digits_evaluate_rejects_wrong_output_shape() -> None:
    spec = load("digits")
    assert spec.evaluate is not None
    with pytest.raises(HarnessError, match=r"logits of shape \(64, 10\)"):
        spec.evaluate(lambda x: x)


def test_digits_training_is_bit_identical_and_restores_threads() -> None:
    x, y, _, _ = digits_model.load_split()
    threads = torch.get_num_threads()
    first = digits_model.train(x, y)
    with torch.inference_mode():  # a caller's inference mode must not break training
        second = digits_model.build().module
    assert torch.get_num_threads() == threads
    assert _same_state(first, second)
    assert not _same_state(first, digits_model.train(x, y, seed=digits_model.SEED + 1))


# --- loading user files ------------------------------------------------------------------

USER_MODEL = """
import dataclasses
import torch

@dataclasses.dataclass
class Config:  # dataclasses need their module in sys.modules while the file imports
    vocab: int = 10

class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(Config().vocab, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, ids):
        return self.drop(x) + self.embed(ids).sum(1)

def pair():
    torch.nn.Linear(3, 3)  # draws from the global RNG
    return TwoInputs(), (torch.full((2, 4), 3.0), torch.tensor([[1, 2], [3, 4]]))
"""


def _write(tmp_path: Path, text: str, name: str = "user_model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_load_file_factory_returning_pair_gets_default_calibration(tmp_path: Path) -> None:
    path = _write(tmp_path, USER_MODEL)
    rng_before = torch.get_rng_state()
    spec = load(f"{path}:pair")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert spec.name == "pair" and spec.evaluate is None
    assert not spec.module.training  # dropout off: outputs are deterministic
    x, ids = spec.example_inputs
    assert len(spec.calibration_data) == 4
    for bx, bids in spec.calibration_data:
        assert bx.shape == x.shape and bx.dtype == x.dtype
        assert bx.abs().max() < 1 and not torch.equal(bx, x)
        assert torch.equal(bids, ids)
    assert not torch.equal(spec.calibration_data[0][0], spec.calibration_data[1][0])
    with torch.no_grad():
        torch.testing.assert_close(
            spec.module(x, ids), x + spec.module.get_parameter("embed.weight")[ids].sum(1)
        )


def test_load_under_inference_mode_builds_ordinary_tensors(tmp_path: Path) -> None:
    path = _write(tmp_path, USER_MODEL)
    with torch.inference_mode():
        spec = load(f"{path}:pair")
    assert not any(p.is_inference() for p in spec.module.parameters())
    assert not any(t.is_inference() for t in spec.example_inputs)
    exported = torch.export.export(spec.module, spec.example_inputs)
    torch.testing.assert_close(
        exported.module()(*spec.example_inputs), spec.module(*spec.example_inputs)
    )


def test_load_file_factory_returning_modelspec(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch
        from harness.models import ModelSpec

        def spec():
            x = torch.ones(2, 3)
            return ModelSpec(
                name="mine",
                description="user spec",
                module=torch.nn.Linear(3, 1).train(),
                example_inputs=(x,),
                calibration_data=[(x * 0.5,)],
                evaluate=lambda fn: 0.25,
            )
        """,
    )
    spec = load(f"{path}:spec")
    assert isinstance(spec, ModelSpec)
    assert (spec.name, spec.description) == ("mine", "user spec")
    assert not spec.module.training
    assert torch.equal(spec.calibration_data[0][0], torch.full((2, 3), 0.5))
    assert spec.evaluate is not None and spec.evaluate(spec.module) == 0.25


def test_load_file_rebuilds_after_the_file_changes(tmp_path: Path) -> None:
    template = """
    import torch
    def f():
        return torch.nn.Identity(), (torch.zeros({n}),)
    """
    path = _write(tmp_path, template.format(n=2))
    assert load(f"{path}:f").example_inputs[0].shape == (2,)
    path.write_text(textwrap.dedent(template.format(n=5)))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load(f"{path}:f").example_inputs[0].shape == (5,)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(HarnessError) as err:
        load("resnet50")
    message = str(err.value)
    assert "'resnet50'" in message and "path/to/file.py:factory" in message
    assert all(name in message for name in ZOO)


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("{dir}/missing.py:build", r"missing\.py'? does not exist.*path/to/file\.py:factory"),
        ("{dir}/user_model.txt:build", r"user_model\.txt'? is not a \.py file"),
        ("{dir}/user_model.py:", r"bad model reference.*path/to/file\.py:factory"),
        (":build", r"bad model reference"),
        ("{dir}/user_model.py:nope", r"no callable factory 'nope'.*functions defined there: pair"),
        ("{dir}/user_model.py:USER_CONSTANT", r"no callable factory 'USER_CONSTANT'"),
    ],
)
def test_bad_file_reference_names_the_culprit(
    tmp_path: Path, reference: str, expected: str
) -> None:
    _write(tmp_path, USER_MODEL + "\nUSER_CONSTANT = 3\n")
    _write(tmp_path, "", name="user_model.txt")
    with pytest.raises(HarnessError, match=expected):
        load(reference.format(dir=tmp_path))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "def f():\n    return 3\n",
            r"factory 'f' in .*bad\.py returned int; expected a ModelSpec or a \(torch\.nn\.Module, tuple",
        ),
        (
            "import torch\ndef f():\n    return torch.nn.Identity(), (3,)\n",
            r"returned tuple; expected a ModelSpec",
        ),
        (
            "def f():\n    raise ValueError('no weights')\n",
            r"factory 'f' in .*bad\.py raised ValueError: no weights",
        ),
        ("def f(:\n", r"model file .*bad\.py failed to import: SyntaxError"),
        (
            "import torch\nfrom harness.models import ModelSpec\n"
            "def f():\n    x = torch.ones(2, 3)\n"
            "    return ModelSpec('m', 'd', torch.nn.Identity(), (x,), [(x.double(),)], None)\n",
            r"calibration batch 0 does not match example_inputs; expected a tuple of torch\.float32 \(2, 3\)",
        ),
        (
            "import torch\nfrom harness.models import ModelSpec\n"
            "def f():\n    return ModelSpec('m', 'd', torch.nn.Identity(), (), [], None)\n",
            r"example_inputs must be a non-empty tuple of tensors",
        ),
    ],
)
def test_bad_factory_names_the_culprit(tmp_path: Path, body: str, expected: str) -> None:
    path = _write(tmp_path, body, name="bad.py")
    with pytest.raises(HarnessError, match=expected):
        load(f"{path}:f")


def test_register_adds_a_name_and_rejects_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))

    @register("tiny")
    def tiny() -> ModelSpec:
        x = torch.zeros(1, 2)
        return ModelSpec("tiny", "test", torch.nn.Identity(), (x,), [(x,)], None)

    assert "tiny" in available()
    assert torch.equal(load("tiny").example_inputs[0], torch.zeros(1, 2))
    with pytest.raises(HarnessError, match="'tiny' is registered twice"):
        register("tiny")(tiny)


def test_default_calibration_data_is_seeded_and_keeps_dtypes() -> None:
    example = (torch.zeros(3, 2, dtype=torch.float64), torch.tensor([7, 8]), torch.tensor([True]))
    first = registry.default_calibration_data(example, batches=3, seed=1)
    assert len(first) == 3
    for x, ids, mask in first:
        assert x.dtype == torch.float64 and x.shape == (3, 2) and 0 < x.abs().max() < 1
        assert torch.equal(ids, example[1]) and torch.equal(mask, example[2])
    again = registry.default_calibration_data(example, batches=3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    other = registry.default_calibration_data(example, batches=3, seed=2)
    assert not torch.equal(first[0][0], other[0][0])


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ("import sys\nsys.exit(3)\ndef f():\n    pass\n", r"exit\.py called sys\.exit\(3\) while being imported"),
        ("import sys\ndef f():\n    sys.exit('bye')\n", r"factory 'f' in .*exit\.py called sys\.exit\('bye'\)"),
    ],
)
def test_sys_exit_in_a_model_file_is_an_error_not_an_exit(tmp_path: Path, body: str, where: str) -> None:
    path = _write(tmp_path, body, name="exit.py")
    with pytest.raises(HarnessError, match=where):
        load(f"{path}:f")


RANDOM_FACTORY = """
import torch

def make():
    # Weights drawn from the global generator, as many user factories do.
    return torch.nn.Linear(4, 3), (torch.ones(1, 4),)
"""

RANDOM_AT_IMPORT = """
import random

import numpy as np
import torch

# Drawn while the file is imported, before any factory runs.
INIT = torch.randn(3, 4) + random.random() + float(np.random.rand())

def make():
    linear = torch.nn.Linear(4, 3)
    with torch.no_grad():
        linear.weight.copy_(INIT)
    return linear, (torch.ones(1, 4),)
"""


@pytest.mark.slow  # builds a model in processes of their own
@pytest.mark.parametrize("body", [RANDOM_FACTORY, RANDOM_AT_IMPORT], ids=["in-factory", "at-import"])
def test_a_random_model_file_builds_the_same_model_in_every_process(tmp_path: Path, body: str) -> None:
    """Two fresh processes, with different amounts of RNG use before loading, get one model."""
    path = _write(tmp_path, body, name="rand_model.py")
    script = (
        "import random, sys, numpy, torch\nfrom harness import models\n"
        "from harness.weights import module_weights_digest\n"
        "n = int(sys.argv[2]); torch.randn(n); random.random(); numpy.random.rand(n)\n"
        "print(module_weights_digest(models.load(sys.argv[1]).module))\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script, f"{path}:make", str(n)],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1],
        ).stdout.strip()
        for n in (1, 1000)
    }
    assert len(digests) == 1 and next(iter(digests)).startswith("sha256:")


def test_importing_a_model_file_leaves_the_callers_generators_alone(tmp_path: Path) -> None:
    import random

    import numpy as np

    path = _write(tmp_path, RANDOM_AT_IMPORT, name="rand_import.py")
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    load(f"{path}:make")
    assert (torch.rand(1), random.random(), np.random.rand()) == expected


def test_module_weights_digest_sees_values_names_and_dtypes() -> None:
    from harness.weights import module_weights_digest

    module = torch.nn.Linear(2, 2)
    base = module_weights_digest(module)
    assert module_weights_digest(copy.deepcopy(module)) == base
    with torch.no_grad():
        module.bias[0] += 1
    assert module_weights_digest(module) != base
    assert module_weights_digest(module.double()) != module_weights_digest(module.float())
