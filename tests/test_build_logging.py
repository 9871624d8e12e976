"""A build logs every step at DEBUG: lowering passes, compiler phases, the typed graph, the engine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.models import ModelSpec

FAST = {"timing_runs": 2, "warmup_runs": 1}


def _spec() -> ModelSpec:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 32)
    return ModelSpec("mlp", "test MLP", module, (x,), [(x,)])


def test_build_engine_logs_each_step(caplog, tmp_path):
    with caplog.at_level(logging.DEBUG, logger="harness"):
        result = build_engine(_spec(), BuildConfig(mode="weak-bf16", options=FAST), CpuBackend(), tmp_path / "c.json")
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    build = [m for name, m in messages if name == "harness.build"]
    lowering = [m for name, m in messages if name == "harness.lowering.pass_manager"]

    assert build[0] == f"build: timing cache {tmp_path / 'c.json'}: new, empty"
    assert any(m.startswith("build: compile mlp: export (") for m in build)
    assert any(m.startswith("build: compile mlp: lowering (") for m in build)
    compiled = next(m for m in build if m.startswith("build: compiled mlp"))
    assert compiled.startswith("build: compiled mlp mode=weak-bf16: policy fp32, ")
    assert " 0 casts inserted, " in compiled
    engine_line = next(m for m in build if m.startswith("build: engine"))
    assert engine_line.startswith(f"build: engine backend=cpu mode=weak-bf16: {len(result.log.layers)} layers, 0 from the cache, ")
    assert build[-1] == f"build: timing cache {tmp_path / 'c.json'}: {result.cache_entries_added} new entries written"

    # the lowering pass manager ran inside the compile and removed the dropout
    assert any(m.startswith("lowering: remove_dropout modified=yes nodes ") for m in lowering)
    assert any(m.startswith("lowering: remove_asserts modified=no ") for m in lowering)


@pytest.mark.slow  # a build in a process of its own
def test_cli_verbose_flag_prints_the_build_steps_on_stderr(tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def tiny():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.1), nn.Linear(8, 2)).eval(), (torch.randn(2, 16),)\n"
    )
    cmd = [sys.executable, "-m", "harness", "-v", "build", "--model", f"{model}:tiny", "--mode", "fp32",
           "-o", str(tmp_path / "e"), "--option", "timing_runs=2", "--option", "warmup_runs=1"]  # fmt: skip
    env = {**os.environ, "HARNESS_DUMP_GRAPH": "remove_dropout"}
    env.pop("HARNESS_DUMP_DIR", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "harness.lowering.pass_manager: lowering: remove_dropout modified=yes nodes " in err
    assert "harness.lowering.pass_manager: lowering: graph after remove_dropout:" in err
    assert "harness.build: build: compiled tiny mode=fp32: policy fp32, " in err
    assert "harness.build: build: engine backend=cpu mode=fp32: " in err
    # without -v the library is silent
    quiet_cmd = [c for c in cmd if c != "-v"]
    quiet_cmd[quiet_cmd.index("-o") + 1] = str(tmp_path / "quiet")
    quiet = subprocess.run(quiet_cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert quiet.returncode == 0, quiet.stderr
    assert "harness.build" not in quiet.stderr and "lowering:" not in quiet.stderr


def test_verbose_logging_ends_with_the_command(tmp_path, capsys):
    """``-v`` shows the harness's DEBUG messages while the command runs; a program that calls
    main gets its loggers back as they were (level and handlers, the root's too)."""
    import logging

    from harness.cli.main import main

    model = tmp_path / "tiny.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def tiny():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 2)).eval(), (torch.randn(2, 16),)\n"
    )
    harness_logger, root = logging.getLogger("harness"), logging.getLogger()
    before = (harness_logger.level, list(harness_logger.handlers), root.level, list(root.handlers))
    args = ["build", "--model", f"{model}:tiny", "--mode", "fp32", "--option", "timing_runs=2", "--option", "warmup_runs=1"]
    assert main(["-v", *args, "-o", str(tmp_path / "e")]) == 0
    assert "harness.build: build: compiled tiny mode=fp32" in capsys.readouterr().err
    assert (harness_logger.level, harness_logger.handlers, root.level, root.handlers) == before
    assert main([*args, "-o", str(tmp_path / "quiet")]) == 0
    assert "harness.build" not in capsys.readouterr().err
