"""The project file and the one route of the autocast settings: file < flags, to the engine and results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.bench.results import load_results
from harness.cli.main import main
from harness.engines.protocol import BuildConfig, builds_batch_profiles
from harness.engines.registry import get_backend
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest
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
    assert settings["threads"] == 1 and settings["measure"]["min_iters"] == 5
    # the file's effective contents, and every path relative to the current directory
    assert settings["project"]["file"] == "harness.toml" and settings["project"]["models"] == ["net.py:make"]
    assert settings["project"]["gate"] == {"latency_threshold": "50%", "allow_missing": True}
    assert settings["cache_dir"] == "caches"
    used = settings["model_settings"]["make"]
    assert used["reference"] == "net.py:make"
    assert used["explicit"] == "precisions/net.json"
    assert used["autocast"]["nodes_to_exclude"] == ["^conv2d$"] and used["autocast"]["data_max"] is None
    assert "aten.linear.default" in used["autocast"]["targets_to_exclude"]
    # the settings reached the engine: conv2d and the linear layer stayed fp32 in autocast-bf16
    rule = next(c for c in doc["cases"] if c["mode"] == "autocast-bf16")
    kept = {layer["name"] for layer in rule["layers"] if layer["tactic"].endswith("[fp32]")}
    assert {"conv2d", "linear"} <= kept


def test_the_results_name_the_settings_each_engine_was_compiled_under(project, capsys):
    """Per mode: the settings the mode really compiles with (bf16 for a bf16 mode, never the
    user-level default fp16) and their digest, which is the one in the case's cache file name."""
    assert main(["bench", "--no-progress", "--no-plots", "--modes", "fp32,autocast-bf16,autocast-fp16", "-o", "run.json"]) == 0
    doc = load_results(project / "run.json")
    used = doc["settings"]["model_settings"]["make"]
    assert "low_precision_type" not in used["autocast"]  # the mode decides it
    modes = used["modes"]
    assert modes["fp32"] == {"compiler_settings": None, "autocast_digest": None}
    assert modes["autocast-bf16"]["compiler_settings"]["low_precision_type"] == "bf16"
    assert modes["autocast-fp16"]["compiler_settings"]["low_precision_type"] == "fp16"
    for case in doc["cases"]:
        recorded = modes[case["mode"]]
        assert case["build"]["autocast_digest"] == recorded["autocast_digest"]
        if recorded["compiler_settings"] is not None:
            assert recorded["autocast_digest"] == digest(canonical_json(recorded["compiler_settings"]))
            assert recorded["autocast_digest"].removeprefix("sha256:")[:10] in Path(case["build"]["cache_file"]).name


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
    # any verdict (3: a busy machine's unstable cases left nothing judged): the settings it used are the point
    assert main(["gate", "--baseline", "a.json", "--current", "b.json", "--json"]) in (0, 1, 3)
    used = json.loads(capsys.readouterr().out)["settings"]
    assert used["latency_threshold"] == 0.5 and used["allow_missing"] is True
    main(["gate", "--baseline", "a.json", "--current", "b.json", "--json", "--latency-threshold", "7%"])
    assert json.loads(capsys.readouterr().out)["settings"]["latency_threshold"] == pytest.approx(0.07)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modes = ['fp32']\nbatchsizes = [1]\n", "Additional properties are not allowed ('batchsizes' was unexpected)"),
        ("[autocast]\ndata_maks = 3\n", "invalid at autocast: Additional properties are not allowed ('data_maks'"),
        ("[autocast]\ndata_max = -1\n", "invalid at [autocast] data_max"),
        ("threads = 0\n", "invalid at threads"),
        ("[timing]\nmin_iters = 'many'\n", "invalid at [timing] min_iters"),
        ("[model.x]\nexplicit = 3\n", "invalid at [model.x] explicit"),
        ('[model."net.py:make"]\nautocast = { data_max = nan }\n', '[model."net.py:make".autocast] data_max = nan: not a finite'),
        ("batch_sizes = [1, 8, 1]\n", "invalid at batch_sizes: 1 is given twice"),
        ("[timing]\nwarmup_s = 1e400\n", "[timing] warmup_s = inf: not a finite number"),
        ("models = [", "not valid TOML"),
    ],
)
def test_schema_errors_name_the_file_and_the_key(tmp_path, monkeypatch, capsys, text, message):
    (tmp_path / "harness.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: project file {tmp_path / 'harness.toml'}") and message in err, err


def test_another_tools_broken_pyproject_is_left_alone_and_ours_is_not(tmp_path, monkeypatch):
    """A pyproject.toml that does not parse stops the harness only when it could hold [tool.harness]."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.black\nline-length = 100\n")
    assert load_project().path is None
    (tmp_path / "pyproject.toml").write_text("[tool.harness\nthreads = 2\n")
    with pytest.raises(HarnessError, match=r"pyproject.toml: not valid TOML"):
        load_project()
    with pytest.raises(HarnessError, match=r"not valid TOML"):  # named with --config: always read
        load_project(tmp_path / "pyproject.toml")


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
    # the same case in both (nothing missing); --min-judged 0: a busy machine's unstable case is not judged,
    # and whether it is judged is not what this test is about
    assert main(["gate", "--baseline", "rel.json", "--current", "abs.json", "--latency-threshold", "900%",
                 "--min-judged", "0"]) == 0


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
    assert four["throughput_per_s"] == pytest.approx(4e9 / four["summary"]["median"])
    assert one["throughput_per_s"] == pytest.approx(1e9 / one["summary"]["median"])
    assert "batch" in out.splitlines()[2] and "items/s" in out
    assert (tmp_path / "sweep-make-throughput.png").is_file()
    # One engine per size here; a backend that builds batch profiles (TensorRT) builds one for the
    # sweep, whose fingerprint every size then shares (test_bench_runner's build-once tests).
    engines = 1 if builds_batch_profiles(get_backend(doc["settings"]["backend"])) else 2
    assert len({c["engine_fingerprint"] for k, c in cases.items() if k[:2] == ("make", "fp32")}) == engines
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
    with pytest.raises(SystemExit) as exc:  # refused by the parser, naming the flag and the range
        main(["bench", "--quick", "--no-progress", "--models", "digits", "--batch-sizes", "0"])
    assert exc.value.code == 2
    assert "argument --batch-sizes: '0': 0 is out of range; valid: 1..4096" in capsys.readouterr().err


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


# --- the settings reach the engine: the first Must-show -------------------------------

FAST = ["--option", "timing_runs=1", "--option", "warmup_runs=0"]


def inspected(directory: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["inspect", directory, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_excluded_node_is_fp32_in_the_engine_and_a_default_cache_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    build = ["build", "--model", "lenet", "--mode", "autocast-fp16", *FAST]
    assert main([*build, "--cache", "default.json", "-o", "default"]) == 0
    assert main([*build, "--exclude", "^conv2d$", "-o", "excluded"]) == 0
    default, excluded = inspected("default", capsys), inspected("excluded", capsys)
    conv = {layer["name"]: layer for layer in excluded["layers"]}["conv2d"]
    assert conv["input_dtypes"] == ["fp32", "fp32", "fp32"] and conv["output_dtypes"] == ["fp32"]
    assert {layer["name"]: layer for layer in default["layers"]}["conv2d"]["output_dtypes"] == ["fp16"]
    assert excluded["fingerprint"] != default["fingerprint"]
    # the engine names the settings it was compiled under, in full
    assert excluded["compiler_settings"]["nodes_to_exclude"] == ["^conv2d$"]
    assert default["compiler_settings"]["nodes_to_exclude"] == []
    # a cache made with the default settings is refused for this build, naming the setting
    assert main([*build, "--exclude", "^conv2d$", "--cache", "default.json", "-o", "refused"]) == 2
    err = capsys.readouterr().err
    assert "builder_options.autocast.nodes_to_exclude: [] != ['^conv2d$']" in err and not (tmp_path / "refused").exists()
    # and an engine made under other settings than a cache's is refused by `cache verify`, naming them
    assert main(["cache", "verify", "default.json", "--engine", "excluded"]) == 2
    assert "autocast.nodes_to_exclude: ['^conv2d$'] != []" in capsys.readouterr().err
    assert main(["cache", "verify", "default.json", "--engine", "default"]) == 0


def test_a_setting_that_leaves_the_graph_alone_still_changes_the_fingerprint(tmp_path, monkeypatch, capsys):
    """Both engines take every tactic from one cache (read-only under --ignore-mismatch): same graph,
    same layers, same tactics; only the settings digest in the fingerprint tells them apart."""
    monkeypatch.chdir(tmp_path)
    build = ["build", "--model", "lenet", "--mode", "autocast-fp16", *FAST]
    assert main([*build, "--cache", "c.json", "-o", "first"]) == 0
    tactics = ["--cache", "c.json", "--error-on-cache-miss", "--ignore-mismatch"]
    assert main([*build, *tactics, "-o", "default"]) == 0
    assert main([*build, *tactics, "--exclude", "^nothing$", "-o", "nothing"]) == 0
    default, nothing = inspected("default", capsys), inspected("nothing", capsys)
    assert default["layers"] == nothing["layers"]
    assert nothing["compiler_settings"]["nodes_to_exclude"] == ["^nothing$"]
    assert nothing["fingerprint"] != default["fingerprint"]


# --- one canonical digest ---------------------------------------------------------------------

DIGEST_OF_A_SET = """
from harness.autocast.settings import AutocastSettings
names = {"^conv2d$", "^linear", "relu_1", "head", "^pool", "attn", "mlp", "norm", "embed", "out"}
settings = AutocastSettings(nodes_to_exclude=names, nodes_to_include={"^a$", "^b$", "^c$"},
                            targets_to_exclude={"aten.softmax", "aten.linear", "aten.conv2d", "aten.gelu"})
print(list(names), settings.digest())
"""


@pytest.mark.slow  # the CLI in a process of its own
def test_the_settings_digest_does_not_depend_on_the_order_of_flags_or_sets(tmp_path, monkeypatch, capsys):
    from harness.autocast import options
    from harness.autocast.settings import AutocastSettings

    ab = options.settings_from({"exclude": ["a", "b"], "include_op": ["aten.relu", "aten.gelu"]})
    ba = options.settings_from({"exclude": ["b", "a", "b"], "include_op": ["aten.gelu", "aten.relu"]})
    assert ab.digest() == ba.digest() and ab.to_json() == ba.to_json()
    assert ba.nodes_to_exclude == ("a", "b")  # sorted and deduplicated in the settings themselves
    assert AutocastSettings(nodes_to_exclude={"b", "a"}).to_json()["nodes_to_exclude"] == ["a", "b"]
    # a Python set iterates in an order PYTHONHASHSEED decides: two seeds, one digest
    seen = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", DIGEST_OF_A_SET], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, cwd=Path(__file__).parents[1], check=True)  # fmt: skip
        seen.append(done.stdout.strip().rpartition(" "))
    (order_1, _, digest_1), (order_2, _, digest_2) = seen
    assert order_1 != order_2  # the sets did iterate differently...
    assert digest_1 == digest_2  # ...and the settings are the same
    # the same from the command line: --exclude a --exclude b is --exclude b --exclude a
    monkeypatch.chdir(tmp_path)
    build = ["build", "--model", "lenet", "--mode", "autocast-fp16", *FAST, "--cache", "c.json"]
    assert main([*build, "--exclude", "^conv2d$", "--exclude", "^linear$", "-o", "ab"]) == 0
    assert main([*build, "--exclude", "^linear$", "--exclude", "^conv2d$", "--error-on-cache-miss", "-o", "ba"]) == 0
    assert inspected("ab", capsys)["fingerprint"] == inspected("ba", capsys)["fingerprint"]


def test_the_precision_report_is_the_same_whatever_the_order_of_the_patterns():
    """A node matching any exclusion is kept fp32 whatever the order (the classifier's rule), and
    the pattern its reason names is the first in sorted order, so the whole report is one."""
    from harness import models
    from harness.autocast import AutocastSettings, compile

    spec = models.load("lenet")

    def decided(patterns):
        return compile(spec.module, spec.example_inputs, policy="rule",
                       settings=AutocastSettings(nodes_to_exclude=patterns)).report.to_json()  # fmt: skip

    one, other = decided(["^conv", "conv2d$"]), decided(["conv2d$", "^conv"])
    assert one == other


# --- per-model tables and the backend, for every command ----------------------------------------


def test_a_model_table_may_name_the_model_for_compile_and_build(project, capsys):
    """``[model.make]`` (the ModelSpec name, as results name the model) works as its reference does."""
    toml = project / "harness.toml"
    toml.write_text(toml.read_text().replace('[model."net.py:make"]', "[model.make]"))
    assert main(["compile", "--model", "net.py:make", "--low", "bf16", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert (rows["conv2d"]["precision"], rows["conv2d"]["rule"]) == ("fp32", "nodes_to_exclude")
    assert main(["build", "--model", "net.py:make", "--mode", "explicit", *FAST, "-o", "e"]) == 0  # its explicit file
    layers = {layer["name"]: layer for layer in inspected("e", capsys)["layers"]}
    assert layers["conv2d"]["tactic"].endswith("[bf16]")
    # the table's explicit file belongs to mode explicit; another mode builds without it
    assert main(["build", "--model", "net.py:make", "--mode", "autocast-bf16", *FAST, "-o", "r"]) == 0
    assert inspected("r", capsys)["compiler_settings"]["nodes_to_exclude"] == ["^conv2d$"]  # [model.make]'s


@pytest.mark.parametrize("command", [
    ["bench", "--no-progress", "--modes", "fp32"],
    ["build", "--model", "net.py:make", "--mode", "fp32", "-o", "e"],
    ["compile", "--model", "lenet"],
])  # fmt: skip
def test_a_model_table_that_matches_no_model_is_an_error_naming_it(project, capsys, command):
    toml = project / "harness.toml"
    toml.write_text(toml.read_text() + '\n[model."nett.py:make"]\nexplicit = "precisions/net.json"\n')
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: project file {toml}: [model."nett.py:make"] matches no model'), err
    assert "a model table is keyed by a model's reference or name: " in err and "make, net.py:make" in err
    assert not (project / "e").exists()


def test_build_and_rebuild_take_the_backend_from_the_file(project, capsys):
    toml = project / "harness.toml"
    toml.write_text(toml.read_text().replace('backend = "cpu"', 'backend = "onnxruntime"'))
    assert main(["build", "--model", "lenet", "--mode", "fp16", "-o", "e"]) == 0
    assert "on onnxruntime" in capsys.readouterr().out
    assert json.loads((project / "e" / "plan.json").read_text())["backend"] == "onnxruntime"
    assert main(["rebuild", "--model", "lenet", "--mode", "fp16", "--times", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "onnxruntime"
    assert main(["build", "--model", "lenet", "--mode", "fp32", "--backend", "cpu", *FAST, "-o", "c"]) == 0  # the flag wins
    assert inspected("c", capsys)["backend"] == "cpu"
    toml.write_text(toml.read_text().replace('backend = "onnxruntime"', 'backend = "tensorrrt"'))
    assert main(["build", "--model", "lenet", "--mode", "fp16", "-o", "x"]) == 2
    assert "invalid at backend" in capsys.readouterr().err


# --- the gate's booleans: flags win both ways ---------------------------------------------------


@pytest.mark.parametrize("key", ["allow_missing", "fail_on_unstable", "ignore_isa"])
def test_a_gate_flag_turns_off_the_files_true(project, capsys, key):
    toml = project / "harness.toml"
    toml.write_text(toml.read_text().replace("allow_missing = true", f"{key} = true"))
    assert main(["bench", "--no-progress", "--no-plots", "--modes", "fp32", "-o", "a.json"]) == 0
    assert main(["bench", "--no-progress", "--no-plots", "--modes", "fp32", "-o", "b.json"]) == 0
    gate = ["gate", "--baseline", "a.json", "--current", "b.json", "--json", "--latency-threshold", "900%"]
    capsys.readouterr()
    main(gate)
    assert json.loads(capsys.readouterr().out)["settings"][key] is True
    main([*gate, f"--no-{key.replace('_', '-')}"])
    assert json.loads(capsys.readouterr().out)["settings"][key] is False


# --- a sweep the file alone drives ----------------------------------------------------------------


def test_the_file_alone_sets_the_batch_sizes_and_modes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_MACHINE_ID", "file-sweep")
    (tmp_path / "m.py").write_text(BATCHED_MODEL)
    (tmp_path / "harness.toml").write_text(textwrap.dedent("""
        models = ["m.py:make"]
        modes = ["fp32", "bf16"]
        batch_sizes = [3, 1]
        threads = 1
    """))
    assert main(["bench", "--quick", "--no-progress", "--no-plots", "-o", "run.json"]) == 0
    doc = load_results(tmp_path / "run.json")
    assert [(c["model"], c["mode"], c["batch"]) for c in doc["cases"]] == [
        ("make", "fp32", 3), ("make", "bf16", 3), ("make", "fp32", 1), ("make", "bf16", 1)
    ]  # fmt: skip
    assert [c["latency"]["batch_size"] for c in doc["cases"]] == [3, 3, 1, 1]
    assert doc["settings"]["batch_sizes"] == [3, 1] and doc["settings"]["modes"] == ["fp32", "bf16"]


# --- shards of one run from two checkouts ---------------------------------------------------------


def test_shards_run_in_two_checkouts_merge(project, tmp_path, monkeypatch, capsys):
    """Results store paths relative to the current directory, so the settings of a run started
    at the root of each of two checkouts are equal, and their shards merge."""
    import shutil

    other = tmp_path / "checkout-b"
    shutil.copytree(project, other)
    shard = ["bench", "--no-progress", "--no-plots", "--modes", "fp32,explicit"]
    assert main([*shard, "--shard", "1/2", "-o", "a.json"]) == 0
    monkeypatch.chdir(other)
    assert main([*shard, "--shard", "2/2", "-o", "b.json"]) == 0
    a, b = load_results(project / "a.json"), load_results(other / "b.json")
    assert a["settings"] == b["settings"]
    assert a["settings"]["model_settings"]["make"]["reference"] == "net.py:make" and a["settings"]["cache_dir"] == "caches"
    assert main(["merge", str(project / "a.json"), str(other / "b.json"), "-o", str(tmp_path / "all.json")]) == 0
    assert len(load_results(tmp_path / "all.json")["cases"]) == 2


@pytest.mark.parametrize(("backend", "mode"), [("cpu", "autocast-bf16"), ("onnxruntime", "autocast-fp16"), ("openvino", "autocast-bf16")])
def test_every_engine_records_the_settings_it_was_compiled_under(backend, mode):
    """In full, in its plan: what `inspect --json` shows and `cache verify` compares."""
    from harness import models
    from harness.autocast import AutocastSettings
    from harness.build import build_engine

    chosen = get_backend(backend)
    config = BuildConfig(mode, autocast=AutocastSettings(nodes_to_exclude=["^linear", "^conv2d$"]), threads=1)
    try:
        chosen.check_mode(mode)
    except HarnessError:  # OpenVINO probes the machine for the mode's kernels: the build refuses it the same way
        with pytest.raises(HarnessError, match=f"cannot build {mode}"):
            build_engine(models.load("lenet"), config, chosen)
        return
    engine = build_engine(models.load("lenet"), config, chosen).engine
    expected = config.compiler_settings()
    assert expected is not None and expected["nodes_to_exclude"] == ["^conv2d$", "^linear"]
    assert engine.compiler_settings() == expected
    assert json.loads(engine.files()["plan.json"])["compiler_settings"] == expected


def test_calibration_data_in_the_file_is_relative_to_it_and_a_flag_replaces_it(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    (tmp_path / "team").mkdir()
    batches = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 1, 3, 8, 8)
    save_file({"input0": batches}, tmp_path / "team" / "cal.safetensors")
    save_file({"input0": batches[:1]}, tmp_path / "one.safetensors")
    (tmp_path / "team" / "harness.toml").write_text('[autocast]\ncalibration_data = "cal.safetensors"\ndata_max = 8\n')
    monkeypatch.chdir(tmp_path)
    project = load_project("team/harness.toml")
    settings = project.autocast_settings("lenet", {})
    assert len(settings.calibration_data) == 2 and torch.equal(settings.calibration_data[1][0], batches[1])
    assert settings.data_max == 8.0  # every other setting kept alongside the file's calibration data
    flagged = project.autocast_settings("lenet", {"calibration_data": "one.safetensors"})  # relative to the cwd
    assert len(flagged.calibration_data) == 1 and flagged.data_max == 8.0


def test_two_tables_for_one_model_are_refused(project, capsys):
    toml = project / "harness.toml"
    toml.write_text(toml.read_text() + "\n[model.make]\nautocast = { exclude = ['^linear'] }\n")
    assert main(["compile", "--model", "net.py:make"]) == 2
    assert 'error: project file ' in (err := capsys.readouterr().err) and '[model."net.py:make"], [model."make"] all name model' in err

