"""The ``harness`` entry point itself: version, help, pipes, Ctrl-C, verbose logging."""

from __future__ import annotations

import argparse
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


def _subparsers(parser, path=("harness",)):
    """Every parser of the real CLI with its command path, subcommands of subcommands included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _subparsers(child, (*path, name))


def test_every_option_with_a_default_shows_it_in_help():
    """Walks the real parser: an option whose default is a value shows ``(default: ...)`` in its help.

    Flags that take no argument (``store_true``, ``--help``, ``--version``) are
    left out: their default is "not given", which the flag itself says. An
    option without help text prints no help line at all, so its default
    would be invisible: it fails here too.
    """
    missing, no_help = [], []
    parsers = list(_subparsers(cli_main.build_parser()))
    assert len(parsers) > 10  # compile, build, rebuild, bench, gate, cache show/pin/..., baseline promote, ...
    for path, parser in parsers:
        for action in parser._actions:
            if action.option_strings and not action.help:
                no_help.append(f"{' '.join(path)} {'/'.join(action.option_strings)}")
            if not action.option_strings or action.nargs == 0:
                continue
            if action.default is None or action.default is argparse.SUPPRESS:
                continue
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            rendered = " ".join(formatter.format_help().split())
            if "(default:" not in rendered:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings)}: {rendered!r}")
    assert not missing, "\n".join(missing)
    assert not no_help, f"options without help text: {no_help}"


def test_a_zero_default_is_shown_and_a_flag_default_is_not():
    # 0 == False in Python: a membership test against (None, False) hid "(default: 0)".
    parser = argparse.ArgumentParser(formatter_class=cli_main.HelpFormatter)
    parser.add_argument("--retries", type=int, default=0, help="how often to retry")
    parser.add_argument("--scale", type=float, default=0.0, help="scale")
    parser.add_argument("--dry-run", action="store_true", help="do nothing")
    text = " ".join(parser.format_help().split())
    assert "how often to retry (default: 0)" in text and "scale (default: 0.0)" in text
    assert "do nothing (default" not in text
