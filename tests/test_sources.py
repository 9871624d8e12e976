"""Model files as users hold them: ONNX files, torch.export archives, Hugging Face directories.

The models are small ``transformers`` architectures with random weights (torchvision does not
import on the CPU build of torch these tests run on), written here the way users write them:
``torch.onnx.export``, ``torch.export.save``, ``save_pretrained``. Accuracy is measured against
each file's own reference: ONNX Runtime's fp32 run of the same ONNX file, the eager program or
model otherwise.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.bench.accuracy import compare_outputs
from harness.build import build_engine
from harness.cli.main import main
from harness.engines.protocol import BuildConfig
from harness.engines.registry import get_backend
from harness.errors import HarnessError
from harness.sources import load_source, model_identity, reference_outputs, route
from harness.sources.inputs import input_options, parse_input_ranges, parse_input_shapes

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.slow  # model files exported, converted and benchmarked

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
VOCAB = 100


def _vit() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, num_labels=10, **SMALL)
    return transformers.ViTForImageClassification(config).eval()


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, num_labels=3, **SMALL)
    return transformers.BertForSequenceClassification(config).eval()


def _export_onnx(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str], path: Path, opset: int) -> Path:
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings(), torch.random.fork_rng():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, inputs, str(path), dynamo=True, opset_version=opset, input_names=names, output_names=["logits"],
            dynamic_shapes={n: {0: batch} for n in names}, external_data=False, verbose=False,
        )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    with torch.random.fork_rng():
        vit, bert = _vit(), _bert()
        image = (torch.randn(1, 3, 32, 32),)
        tokens = (torch.randint(0, VOCAB, (1, 16)), torch.ones(1, 16, dtype=torch.int64))
        out = {
            "vit": _export_onnx(vit, image, ["pixel_values"], root / "vit.onnx", 17),
            "vit20": _export_onnx(vit, image, ["pixel_values"], root / "vit20.onnx", 20),
            "bert": _export_onnx(bert, tokens, ["input_ids", "attention_mask"], root / "bert.onnx", 17),
        }
        vit.save_pretrained(root / "vit-hf")
        bert.save_pretrained(root / "bert-hf")
        logits = _Logits(vit)
        pair = (torch.randn(2, 3, 32, 32),)  # an example batch of 1 would pin the dynamic batch axis
        program = torch.export.export(logits, pair, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
        torch.export.save(program, root / "vit.pt2")
    out.update({"vit-hf": root / "vit-hf", "bert-hf": root / "bert-hf", "pt2": root / "vit.pt2"})
    return out


class _Logits(torch.nn.Module):
    """What a user exports: the model's logits as a plain tensor."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values).logits


def _accuracy(ref: str, backend: str, mode: str) -> tuple[float, float]:
    """(max abs error, cosine) of ``mode`` on ``backend`` against the file's own reference."""
    spec = load_source(ref)
    built = build_engine(spec, BuildConfig(mode=mode, threads=1), get_backend(backend), None)
    with torch.inference_mode():
        outputs = built.engine(*spec.example_inputs)
    expected = reference_outputs(spec)
    if expected is None:
        with torch.inference_mode():
            expected = spec.module(*spec.example_inputs)
    acc = compare_outputs(outputs, expected, logits=True)
    assert acc.max_abs_error is not None and acc.cosine is not None
    return acc.max_abs_error, acc.cosine


# --- ONNX files ---------------------------------------------------------------------------


def test_the_identity_of_an_onnx_file_is_its_content_not_its_path(files, tmp_path):
    copy = tmp_path / "elsewhere" / "vit.onnx"
    copy.parent.mkdir()
    shutil.copy(files["vit"], copy)
    a, b = load_source(str(files["vit"])), load_source(str(copy))
    assert model_identity(a) == model_identity(b) == a.source.digest
    assert a.name == b.name == "vit"
    import onnx
    import onnx.numpy_helper

    model = onnx.load(str(files["vit"]))
    weight = model.graph.initializer[0]
    values = onnx.numpy_helper.to_array(weight).copy()
    values.flat[0] += 1.0
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(model, str(tmp_path / "vit.onnx"))
    retrained = load_source(str(tmp_path / "vit.onnx"))
    assert retrained.name == "vit" and model_identity(retrained) != model_identity(a)


def test_onnx_runtime_takes_the_file_as_given_in_fp32_and_lowered_in_fp16(files):
    ref = str(files["vit"])
    spec = load_source(ref)
    assert (route(spec, "onnxruntime", "fp32"), route(spec, "onnxruntime", "fp16")) == ("given", "lowered")
    assert route(spec, "cpu", "fp32") == route(spec, "onnxruntime", "autocast-fp16") == "graph"
    error, cosine = _accuracy(ref, "onnxruntime", "fp32")
    assert error == 0.0  # the very file the reference ran, in the same runtime
    error, cosine = _accuracy(ref, "onnxruntime", "fp16")
    assert 0 < error < 0.05 and cosine > 0.999


def test_the_compilers_modes_run_the_converted_graph_against_ort_fp32(files):
    ref = str(files["vit"])
    assert load_source(ref).source.conversion_error is None
    error, cosine = _accuracy(ref, "cpu", "fp32")
    assert error < 1e-5
    error, cosine = _accuracy(ref, "cpu", "autocast-bf16")
    assert 0 < error < 0.05 and cosine > 0.999  # bf16 rounding, measured against ORT's fp32 run
    error, cosine = _accuracy(ref, "cpu", "weak-bf16")
    assert cosine > 0.999


def test_an_op_onnx2torch_cannot_convert_is_named_with_the_modes_that_remain(files):
    ref = str(files["vit20"])  # opset 20 keeps Gelu as one op, which onnx2torch has no converter for
    spec = load_source(ref)
    error = spec.source.conversion_error
    assert error is not None and "Gelu" in error and "weak-fp16" in error and "onnxruntime" in error
    with pytest.raises(HarnessError, match="Gelu"):
        build_engine(spec, BuildConfig(mode="fp32", threads=1), get_backend("cpu"), None)
    max_error, _ = _accuracy(ref, "onnxruntime", "fp32")  # the file as given still runs
    assert max_error == 0.0


def test_integer_inputs_stay_within_the_vocabulary_the_file_declares(files):
    spec = load_source(str(files["bert"]))
    ids_decl, mask_decl = spec.source.inputs
    assert (ids_decl.name, ids_decl.vocabulary, mask_decl.vocabulary) == ("input_ids", VOCAB, None)
    ids, mask = spec.example_inputs
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < VOCAB and int(ids.max()) > 1
    assert torch.equal(mask, torch.ones_like(mask))
    error, cosine = _accuracy(str(files["bert"]), "cpu", "autocast-bf16")
    assert cosine > 0.999


def test_input_shapes_fix_the_open_dimensions_and_refuse_what_does_not_fit(files):
    ref = str(files["bert"])
    spec = load_source(ref, options=input_options("input_ids:2x16,attention_mask:2x16"))
    assert [tuple(t.shape) for t in spec.example_inputs] == [(2, 16), (2, 16)]
    assert [tuple(t.shape) for t in load_source(ref, 4).example_inputs] == [(4, 16), (4, 16)]
    with pytest.raises(HarnessError, match="does not take; its inputs: input_ids"):
        load_source(ref, options=input_options("ids:1x16"))
    with pytest.raises(HarnessError, match="does not fit input pixel_values"):
        load_source(str(files["vit"]), options=input_options("pixel_values:1x3x64x64"))
    with pytest.raises(HarnessError, match="NAME:DIMxDIMx"):
        parse_input_shapes("pixel_values=1x3")
    with pytest.raises(HarnessError, match="LOW < HIGH"):
        parse_input_ranges("uniform(1,0)")


def test_generated_values_follow_the_declared_distribution(files):
    spec = load_source(str(files["vit"]), options=input_options(ranges="pixel_values=uniform(2,3)"))
    (x,) = spec.example_inputs
    assert 2 <= float(x.min()) and float(x.max()) < 3
    again = load_source(str(files["vit"]), options=input_options(ranges="pixel_values=uniform(2,3)"))
    assert torch.equal(again.example_inputs[0], x)  # seeded: every process benchmarks the same inputs
    ids = load_source(str(files["bert"]), options=input_options(ranges="input_ids=uniform(5,7)")).example_inputs[0]
    assert set(ids.unique().tolist()) <= {5, 6}
    with pytest.raises(HarnessError, match="integer input"):
        load_source(str(files["bert"]), options=input_options(ranges="input_ids=normal(0,1)"))


def test_real_inputs_load_from_npz_and_safetensors_without_pickle(files, tmp_path):
    from safetensors.numpy import save_file

    image = np.linspace(-1, 1, 2 * 3 * 32 * 32, dtype=np.float32).reshape(2, 3, 32, 32)
    np.savez(tmp_path / "in.npz", pixel_values=image)
    save_file({"pixel_values": image}, str(tmp_path / "in.safetensors"))
    for name in ("in.npz", "in.safetensors"):
        spec = load_source(str(files["vit"]), options=input_options(load=str(tmp_path / name)))
        assert np.array_equal(spec.example_inputs[0].numpy(), image)
    np.savez(tmp_path / "pickled.npz", pixel_values=np.array([object()], dtype=object))
    with pytest.raises(HarnessError, match="pickled.npz cannot be read"):
        load_source(str(files["vit"]), options=input_options(load=str(tmp_path / "pickled.npz")))
    np.savez(tmp_path / "wrong.npz", pixel_values=image[:, :, :16])
    with pytest.raises(HarnessError, match="wrong.npz.*does not fit input pixel_values"):
        load_source(str(files["vit"]), options=input_options(load=str(tmp_path / "wrong.npz")))
    np.savez(tmp_path / "other.npz", images=image)
    with pytest.raises(HarnessError, match="lacks input.*'pixel_values'.*holds 'images'"):
        load_source(str(files["vit"]), options=input_options(load=str(tmp_path / "other.npz")))


def test_an_unreadable_model_file_is_one_error_naming_it(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf \xff\xfe")
    with pytest.raises(HarnessError, match="junk.onnx is not an ONNX model"):
        load_source(str(tmp_path / "junk.onnx"))
    with pytest.raises(HarnessError, match="no such file"):
        load_source(str(tmp_path / "absent.onnx"))


# --- torch.export archives --------------------------------------------------------------------


def test_a_pt2_archive_is_benchmarked_against_its_eager_program(files, tmp_path):
    spec = load_source(str(files["pt2"]))
    assert spec.name == "vit" and spec.batch_dim == 0 and tuple(spec.example_inputs[0].shape) == (2, 3, 32, 32)
    error, _ = _accuracy(str(files["pt2"]), "cpu", "fp32")
    assert error < 1e-5
    error, cosine = _accuracy(str(files["pt2"]), "cpu", "autocast-bf16")
    assert 0 < error and cosine > 0.999
    shutil.copy(files["pt2"], tmp_path / "copy.pt2")
    assert model_identity(load_source(str(tmp_path / "copy.pt2"))) == model_identity(spec)


def _rewritten(source: Path, dest: Path, change: dict[str, bytes | None]) -> Path:
    """A copy of a zip archive with members (by their path below the root folder) replaced or added."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as new:
        root = old.namelist()[0].split("/")[0]
        for item in old.infolist():
            rel = item.filename.split("/", 1)[1]
            data = change.pop(rel, old.read(item))
            if data is not None:
                new.writestr(item, data)
        for rel, data in change.items():
            if data is not None:
                new.writestr(f"{root}/{rel}", data)
    return dest


class Payload:
    """Any class: the restricted unpickler refuses it, where torch's own fallback would unpickle it."""


def test_a_pt2_archive_that_would_unpickle_is_refused_before_loading(files, tmp_path):
    with zipfile.ZipFile(files["pt2"]) as archive:
        root = archive.namelist()[0].split("/")[0]
        config = json.loads(archive.read(f"{root}/data/weights/model_weights_config.json"))
    first = next(iter(config["config"]))
    config["config"][first]["use_pickle"] = True
    pickled = _rewritten(files["pt2"], tmp_path / "pickled.pt2", {"data/weights/model_weights_config.json": json.dumps(config).encode()})
    with pytest.raises(HarnessError, match="stored pickled"):
        load_source(str(pickled))
    buffer = io.BytesIO()
    torch.save(((Payload(),), {}), buffer)
    sample = _rewritten(files["pt2"], tmp_path / "sample.pt2", {"data/sample_inputs/model.pt": buffer.getvalue()})
    with pytest.raises(HarnessError, match="not plain tensors"):
        load_source(str(sample))
    legacy = _rewritten(files["pt2"], tmp_path / "legacy.pt2", {"data/weights/model.pt": b"\x80\x04N."})
    with pytest.raises(HarnessError, match="legacy pickled format"):
        load_source(str(legacy))
    aoti = _rewritten(files["pt2"], tmp_path / "aoti.pt2", {"data/aotinductor/model/model.so": b"\x7fELF"})
    with pytest.raises(HarnessError, match="AOTInductor"):
        load_source(str(aoti))


# --- Hugging Face directories -----------------------------------------------------------------


def test_a_hugging_face_directory_loads_from_its_config_and_safetensors(files, tmp_path):
    ref = f"hf:{files['bert-hf']}"
    spec = load_source(ref)
    ids, mask = spec.example_inputs
    assert spec.name == "bert-hf" and tuple(ids.shape) == (1, 64)  # the config's 64 positions cap the 128 tokens
    assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB
    error, _ = _accuracy(ref, "cpu", "fp32")
    assert error < 1e-5
    error, cosine = _accuracy(ref, "cpu", "autocast-bf16")
    assert 0 < error and cosine > 0.999
    vit = load_source(f"hf:{files['vit-hf']}", options=input_options("pixel_values:2x3x32x32"))
    assert tuple(vit.example_inputs[0].shape) == (2, 3, 32, 32)
    shutil.copytree(files["bert-hf"], tmp_path / "moved")
    assert model_identity(load_source(f"hf:{tmp_path / 'moved'}")) == model_identity(spec)


def test_a_hugging_face_directory_with_pickled_weights_or_its_own_code_is_refused(files, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(files["bert-hf"] / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04N.")
    with pytest.raises(HarnessError, match="only as pytorch_model.bin"):
        load_source(f"hf:{pickled}")
    remote = tmp_path / "remote"
    shutil.copytree(files["bert-hf"], remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_mine.MyModel"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(HarnessError, match="auto_map"):
        load_source(f"hf:{remote}")
    with pytest.raises(HarnessError, match="no such directory"):
        load_source(f"hf:{tmp_path / 'absent'}")


# --- the command line ---------------------------------------------------------------------


def test_harness_bench_runs_an_onnx_file_and_records_its_digest_not_its_path(files, tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main([
        "bench", "--model", str(files["vit"]), "--backend", "cpu", "--modes", "fp32,autocast-bf16",
        "--quick", "--no-plots", "--no-progress", "--disable-cache", "-o", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    digest = load_source(str(files["vit"])).source.digest
    assert {c["model_weights_digest"] for c in doc["cases"]} == {digest}
    assert {c["source"]["file"] for c in doc["cases"]} == {"vit.onnx"}
    assert str(files["vit"].parent) not in json.dumps(doc["cases"])
    acc = {c["mode"]: c["accuracy"] for c in doc["cases"]}
    assert acc["fp32"]["max_abs_error"] < 1e-5 and 0 < acc["autocast-bf16"]["max_abs_error"] < 0.05


def test_input_flags_for_a_zoo_model_are_refused_naming_the_flag(tmp_path, capsys):
    code = main(["bench", "--model", "lenet", "--input-shapes", "x:1x1x28x28", "--quick", "-o", str(tmp_path / "r.json")])
    assert code == 2
    assert "--input-shapes: the flag shapes the inputs of model files" in capsys.readouterr().err


def test_a_model_files_inputs_can_live_in_the_project_file(files, tmp_path, capsys):
    shutil.copy(files["bert"], tmp_path / "bert.onnx")
    config = tmp_path / "harness.toml"
    config.write_text('models = ["bert.onnx"]\n[model."bert.onnx"]\ninput_shapes = "input_ids:2x16,attention_mask:2x16"\n')
    out = tmp_path / "run.json"
    argv = ["bench", "--config", str(config), "--backend", "onnxruntime", "--modes", "fp32", "--quick",
            "--no-plots", "--no-progress", "--disable-cache", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["settings"]["inputs"]["bert"]["shapes"] == {"input_ids": [2, 16], "attention_mask": [2, 16]}
    assert doc["cases"][0]["latency"]["batch_size"] == 2 and doc["cases"][0]["accuracy"]["max_abs_error"] == 0.0
    config.write_text('models = ["bert.onnx"]\n[model."bert.onnx"]\ninput_shapes = "ids:2x16"\n')
    assert main(argv) == 2
    assert "--input-shapes names 'ids', which ONNX file" in capsys.readouterr().err
