"""The ``harness`` entry point itself: version, help, pipes, Ctrl-C, verbose logging."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from harness.cli import main as cli_main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"harness {version('mixed-precision-harness')}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--help"], ["--threads THREADS", "else 1)", "else auto)", "else resnet,transformer,digits)",
                               "--data-max X|off", "(default: 512)", "--keep-io-types, --no-keep-io-types"]),
        (["gate", "--help"], ["(default: 5%)", "(default: 0.01)", "--allow-missing", "(default: 0.0001)"]),
        (["compile", "--help"], ["(default: rule)", "--max-reduction-depth N", "keep in fp32 every reduction"]),
        (["baseline", "promote", "--help"], ["(default: results)"]),
    ],
)
def test_every_help_shows_its_defaults(capsys, argv, expected):
    with pytest.raises(SystemExit):
        cli_main.main(argv)
    text = " ".join(capsys.readouterr().out.split())
    for fragment in expected:
        assert " ".join(fragment.split()) in text, fragment


def test_ctrl_c_during_start_up_is_a_message_not_a_traceback(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    assert cli_main.main(["cache", "show", "x"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_piping_into_a_reader_that_stops_early_is_quiet():
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'harness', 'compile', '--model', 'transformer'],"
        " stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
        "p.stdout.readline(); p.stdout.close()\n"
        "err = p.stderr.read().decode(); print(p.wait()); print(repr(err))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    returncode, err = out.splitlines()
    assert returncode == "141" and "BrokenPipeError" not in err and "Traceback" not in err


def test_the_entry_module_imports_nothing_heavy():
    code = "import sys, harness.cli.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
