"""``harness compile`` end to end through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.cli.main import main


def test_table_for_the_seed_example(capsys):
    assert main(["compile", "--model", "lenet", "--exclude", "^conv2d$"]) == 0
    out = capsys.readouterr().out
    assert "matches nodes_to_exclude '^conv2d$'" in out
    assert "nodes_to_exclude" in out and "autocast_region" in out


@pytest.mark.parametrize("low", ["fp16", "bf16"])
def test_the_summary_names_the_low_precision_type_weights_are_clipped_to(low, capsys):
    assert main(["compile", "--model", "lenet", "--low", low]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"low precision {low}:" in summary
    assert f"weight values clipped to the {low} range" in summary


def test_json_output(capsys):
    assert main(["compile", "--model", "digits", "--low", "bf16", "--policy", "amp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "digits" and doc["policy"] == "amp" and doc["low_precision_type"] == "bf16"
    assert doc["counts"]["amp:lower_precision_fp"] >= 2
    assert {"name", "op", "module", "precision", "reason", "input_dtypes", "output_dtypes"} <= set(doc["rows"][0])


@pytest.mark.parametrize("argv, message", [
    (["--exclude", "(bad"], "invalid regular expression '(bad'"),
    (["--exclude-op", "aten.nosuch"], "no operator 'nosuch'"),
    (["--low", "fp8"], "unknown dtype 'fp8'"),
    (["--max-reduction-depth", "0"], "--max-reduction-depth 0: expected a positive finite number, or 'off'"),
    (["--max-reduction-depth", "1.5"], "--max-reduction-depth '1.5': expected a positive number"),
    (["--data-max", "nan"], "--data-max nan: expected a positive finite number, or 'off'"),
    (["--data-max", "0"], "--data-max 0.0: expected a positive finite number, or 'off'"),
    (["--init-max", "inf"], "--init-max inf: expected a positive finite number"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    assert main(["compile", "--model", "lenet", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # the CLI in a process of its own
def test_unknown_model_and_unexportable_model_exit_2(tmp_path, capsys):
    assert main(["compile", "--model", "nosuch"]) == 2
    assert "valid names: digits, hf-bart, hf-bert" in capsys.readouterr().err
    f = tmp_path / "dyn.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * 2 if x.sum() > 0 else x\n"
        "def make():\n"
        "    return M(), (torch.randn(3),)\n"
    )
    assert main(["compile", "--model", f"{f}:make"]) == 2
    assert "failed to export with torch.export" in capsys.readouterr().err
    # torch.export's own log and graph dumps stay off the terminal: one line, the error.
    r = subprocess.run(
        [sys.executable, "-m", "harness", "compile", "--model", f"{f}:make"], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: model M failed")


def test_a_bare_op_name_means_every_overload(capsys):
    assert main(["compile", "--model", "transformer", "--policy", "rule", "--low", "bf16",
                 "--exclude-op", "aten.layer_norm", "--exclude-op", "aten.softmax", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    norms = [r for r in rows if r["op"].startswith("aten.layer_norm")]
    assert norms and all(r["precision"] == "fp32" and r["rule"] == "targets_to_exclude" for r in norms)


@pytest.mark.slow  # the CLI in a process of its own
def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "harness", "compile", "--model", "digits", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "digits"
