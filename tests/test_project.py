"""The project file and the one route of the autocast settings: file < flags, to the engine and results."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness.bench.results import load_results
from harness.cli.main import main
from harness.errors import HarnessError
from harness.project import load_project

USER_MODEL = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))

def make():
    return Net(), (torch.randn(1, 3, 8, 8),)
"""


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    """A team's directory: a model file, an explicit precision file, and harness.toml; cwd is it."""
    (tmp_path / "net.py").write_text(USER_MODEL)
    (tmp_path / "precisions").mkdir()
    (tmp_path / "precisions" / "net.json").write_text('{"^conv2d": "bf16"}')
    (tmp_path / "harness.toml").write_text(textwrap.dedent("""
        models = ["net.py:make"]
        modes = ["fp32", "autocast-bf16", "explicit"]
        backend = "cpu"
        threads = 1

        [autocast]
        exclude_op = ["aten.linear"]
        data_max = "off"

        [model."net.py:make"]
        explicit = "precisions/net.json"
        autocast = { exclude = ["^conv2d$"] }

        [timing]
        warmup_s = 0.01
        min_iters = 5
        min_duration_s = 0.02
        max_iters = 50

        [gate]
        latency_threshold = "50%"
        allow_missing = true
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_MACHINE_ID", "project-test")
    return tmp_path


def test_a_bench_driven_only_by_the_project_file(project, capsys):
    assert main(["bench", "--no-progress", "--no-plots", "-o", "run.json"]) == 0
    doc = load_results(project / "run.json")
    assert [(c["model"], c["mode"]) for c in doc["cases"]] == [("make", "fp32"), ("make", "autocast-bf16"), ("make", "explicit")]
    settings = doc["settings"]
    assert settings["project_file"] == str(project / "harness.toml") and settings["threads"] == 1
    assert settings["measure"]["min_iters"] == 5
    used = settings["model_settings"]["make"]
    assert used["reference"] == f"{project / 'net.py'}:make"
    assert used["explicit"] == str(project / "precisions" / "net.json")
    assert used["autocast"]["nodes_to_exclude"] == ["^conv2d$"] and used["autocast"]["data_max"] is None
    assert "aten.linear.default" in used["autocast"]["targets_to_exclude"]
    # the settings reached the engine: conv2d and the linear layer stayed fp32 in autocast-bf16
    rule = next(c for c in doc["cases"] if c["mode"] == "autocast-bf16")
    kept = {layer["name"] for layer in rule["layers"] if layer["tactic"].endswith("[fp32]")}
    assert {"conv2d", "linear"} <= kept


def test_flags_override_the_file_and_change_the_cache_and_engine(project, capsys):
    common = ["bench", "--no-progress", "--no-plots", "--modes", "autocast-bf16", "--cache-dir", "caches"]
    assert main([*common, "-o", "a.json"]) == 0
    assert main([*common, "-o", "b.json", "--exclude", "^nothing$", "--data-max", "256"]) == 0
    a, b = (load_results(project / f)["cases"][0] for f in ("a.json", "b.json"))
    assert a["engine_fingerprint"] != b["engine_fingerprint"]
    assert len(list((project / "caches").iterdir())) == 2  # one cache per settings digest
    used = load_results(project / "b.json")["settings"]["model_settings"]["make"]["autocast"]
    assert used["nodes_to_exclude"] == ["^nothing$"] and used["data_max"] == 256.0


def test_the_gate_reads_its_table_and_flags_win(project, capsys):
    assert main(["bench", "--no-progress", "--no-plots", "--modes", "fp32", "-o", "a.json"]) == 0
    assert main(["bench", "--no-progress", "--no-plots", "--modes", "fp32", "-o", "b.json"]) == 0
    capsys.readouterr()
    assert main(["gate", "--baseline", "a.json", "--current", "b.json", "--json"]) in (0, 1)
    used = json.loads(capsys.readouterr().out)["settings"]
    assert used["latency_threshold"] == 0.5 and used["allow_missing"] is True
    main(["gate", "--baseline", "a.json", "--current", "b.json", "--json", "--latency-threshold", "7%"])
    assert json.loads(capsys.readouterr().out)["settings"]["latency_threshold"] == pytest.approx(0.07)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modes = ['fp32']\nbatchsizes = [1]\n", "Additional properties are not allowed ('batchsizes' was unexpected)"),
        ("[autocast]\ndata_maks = 3\n", "invalid at autocast: Additional properties are not allowed ('data_maks'"),
        ("[autocast]\ndata_max = -1\n", "invalid at autocast/data_max"),
        ("threads = 0\n", "invalid at threads"),
        ("[timing]\nmin_iters = 'many'\n", "invalid at timing/min_iters"),
        ("[model.x]\nexplicit = 3\n", "invalid at model/x/explicit"),
        ("models = [", "not valid TOML"),
    ],
)
def test_schema_errors_name_the_file_and_the_key(tmp_path, monkeypatch, capsys, text, message):
    (tmp_path / "harness.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: project file {tmp_path / 'harness.toml'}") and message in err, err


def test_pyproject_tool_harness_and_no_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_project().path is None  # nothing here: defaults
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert load_project().path is None  # a pyproject without [tool.harness]: no project
    (tmp_path / "pyproject.toml").write_text("[tool.harness]\nthreads = 3\n")
    project = load_project()
    assert project.get("threads") == 3 and project.path == tmp_path / "pyproject.toml"
    other = tmp_path / "sub" / "pyproject.toml"
    other.parent.mkdir()
    other.write_text("[project]\nname = 'y'\n")
    with pytest.raises(HarnessError, match=r"no \[tool.harness\] table"):  # asked for explicitly
        load_project(other)


def test_a_user_model_is_the_same_model_by_any_path(project, capsys):
    common = ["bench", "--no-progress", "--no-plots", "--modes", "fp32", "--config", str(project / "harness.toml")]
    assert main([*common, "--models", "net.py:make", "-o", "rel.json"]) == 0
    assert main([*common, "--models", f"{project / 'net.py'}:make", "-o", "abs.json"]) == 0
    rel, ab = (load_results(project / f) for f in ("rel.json", "abs.json"))
    assert rel["cases"][0]["model"] == ab["cases"][0]["model"] == "make"
    assert rel["cases"][0]["model_weights_digest"] == ab["cases"][0]["model_weights_digest"]
    capsys.readouterr()
    assert main(["gate", "--baseline", "rel.json", "--current", "abs.json", "--latency-threshold", "900%"]) == 0


def test_two_models_with_one_name_are_refused(project, capsys):
    (project / "other.py").write_text(USER_MODEL)
    assert main(["bench", "--no-progress", "--models", "net.py:make,other.py:make"]) == 2
    assert "both named 'make'" in capsys.readouterr().err


BATCHED_MODEL = """
import torch
from torch import nn

def make(batch_size=2):
    return nn.Linear(4, 3), (torch.ones(batch_size, 4),)

def fixed():
    return nn.Linear(4, 3), (torch.ones(2, 4),)
"""


def test_a_batch_sweep_records_latency_and_throughput_per_size(tmp_path, monkeypatch, capsys):
    from harness.bench.gate import gate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_MACHINE_ID", "sweep-test")
    (tmp_path / "m.py").write_text(BATCHED_MODEL)
    argv = ["bench", "--quick", "--no-progress", "--models", "m.py:make,digits", "--modes", "fp32,bf16",
            "--batch-sizes", "1,4", "-o", "sweep.json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = load_results(tmp_path / "sweep.json")
    cases = {(c["model"], c["mode"], c["batch"]): c for c in doc["cases"]}
    assert len(cases) == 8 and doc["settings"]["batch_sizes"] == [1, 4]
    # the factory's own batch_size argument, and digits' declared batch dimension
    assert cases["make", "fp32", 4]["latency"]["batch_size"] == 4
    assert cases["digits", "fp32", 1]["latency"]["batch_size"] == 1
    assert cases["digits", "fp32", 4]["task_accuracy"] is None  # its evaluation feeds its own batch size
    four, one = cases["make", "fp32", 4]["latency"], cases["make", "fp32", 1]["latency"]
    assert four["throughput_per_s"] == pytest.approx(4e9 / four["summary"]["mean"])
    assert one["throughput_per_s"] == pytest.approx(1e9 / one["summary"]["mean"])
    assert "batch" in out.splitlines()[2] and "items/s" in out
    assert (tmp_path / "sweep-make-throughput.png").is_file()
    assert {c["engine_fingerprint"] for k, c in cases.items() if k[:2] == ("make", "fp32")}.__len__() == 2
    # keys carry the batch size: a sweep gates against a sweep
    report = gate(doc, doc)
    assert {v.key[3] for v in report.cases} == {1, 4} and "make/fp32/cpu/b4" in [
        f"{v.key[0]}/{v.key[1]}/{v.key[2]}/b{v.key[3]}" for v in report.cases
    ]


def test_a_model_without_a_batch_dimension_is_refused_up_front(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(BATCHED_MODEL)
    assert main(["bench", "--quick", "--no-progress", "--models", "m.py:fixed", "--batch-sizes", "2,8"]) == 2
    assert "has no batch dimension to sweep" in capsys.readouterr().err
    assert main(["bench", "--quick", "--no-progress", "--models", "digits", "--batch-sizes", "0"]) == 2
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_the_example_team_project_runs_as_the_readme_shows(tmp_path, monkeypatch, capsys):
    example = Path(__file__).parents[1] / "examples" / "team_project" / "harness.toml"
    monkeypatch.setenv("HARNESS_MACHINE_ID", "example")
    assert main(["bench", "--config", str(example), "--quick", "--no-progress", "--no-plots",
                 "--batch-sizes", "1,4", "--modes", "fp32,explicit", "-o", str(tmp_path / "run.json")]) == 0  # fmt: skip
    doc = load_results(tmp_path / "run.json")
    assert {(c["model"], c["mode"], c["batch"]) for c in doc["cases"]} == {
        ("classifier", m, b) for m in ("fp32", "explicit") for b in (1, 4)
    }
    assert doc["settings"]["model_settings"]["classifier"]["autocast"]["data_max"] == 256.0
