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
        (["bench", "--help"], ["--threads THREADS", "else 1)", "else auto)", "else resnet,transformer,digits; digits only with the 'digits' extra installed)",
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
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    assert cli_main.main(["cache", "show", "x"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.slow  # the CLI in processes of their own
def test_piping_into_a_reader_that_stops_early_is_quiet():
    """``harness compile ... | head -0``: the reader is gone before the first write.

    Its read end is closed before the command starts, so the first print meets
    a broken pipe every time. (A reader that takes one line and then closes
    raced the command: under load the whole listing could fit in the pipe's
    buffer before the close, and the run exited 0 with nothing broken.)
    """
    code = (
        "import os, subprocess, sys\n"
        "r, w = os.pipe(); os.close(r)\n"
        "p = subprocess.Popen([sys.executable, '-m', 'harness', 'compile', '--model', 'transformer'],"
        " stdout=w, stderr=subprocess.PIPE)\n"
        "os.close(w)\n"
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


def test_a_command_imports_only_its_own_module():
    # `harness gate` (and its --help) must not import torch: nox -s gate runs without it.
    code = (
        "import sys, contextlib, io\n"
        "from harness.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['gate', '--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'harness.cli.bench_cmd', 'harness.cli.build_cmd', 'harness.cli.results_cmd')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['harness.cli.results_cmd']"


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name, _, help_text in cli_main.COMMANDS:
        assert name in text and " ".join(help_text.split()[:4]) in " ".join(text.split())


def test_the_listed_help_is_the_commands_own():
    # main.COMMANDS repeats each command's one-line help so that listing them imports nothing;
    # the full parser's help (given to add_parser) must say the same.
    parser = cli_main.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {action.dest: action.help for action in sub._choices_actions}
    assert listed == {name: help_text for name, _, help_text in cli_main.COMMANDS}
    assert set(sub.choices) == set(listed)
    for name in listed:
        assert sub.choices[name].prog == f"harness {name}"


def test_an_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["bench", "--threads", "0"], "argument --threads: 0 is out of range; valid: 1..1024"),
        (["bench", "--threads", "two"], "argument --threads: 'two' is not an integer; valid: 1..1024"),
        (["bench", "--shard", "3/2"], "argument --shard: '3/2': need 1 <= i <= n and n >= 1"),
        (["bench", "--shard", "x"], "argument --shard: 'x': expected i/n"),
        (["bench", "--batch-sizes", "0,8"], "argument --batch-sizes: '0,8': 0 is out of range; valid: 1..4096"),
        (["bench", "--batch-sizes", "1,1"], "argument --batch-sizes: '1,1': a batch size appears twice"),
        (["bench", "--batch-sizes", "a"], "argument --batch-sizes: 'a': 'a' is not an integer"),
        (["bench", "--spread-threshold", "25"], "argument --spread-threshold: '25': read as the fraction 25"),
        (["bench", "--spread-threshold", "abc"], "argument --spread-threshold: 'abc': expected a percentage"),
        (["gate", "--alpha", "1.5"], "argument --alpha: '1.5': expected a number strictly between 0 and 1"),
        (["gate", "--latency-threshold", "5"], "argument --latency-threshold: '5': read as the fraction 5"),
        (["gate", "--cosine-drop", "-1"], "argument --cosine-drop: '-1': expected a finite number >= 0"),
        (["gate", "--top1-drop", "nan"], "argument --top1-drop: 'nan': expected a finite number"),
        (["build", "--model", "lenet", "--mode", "fp32", "-o", "x", "--threads", "2000"],
         "argument --threads: 2000 is out of range; valid: 1..1024"),
        (["rebuild", "--model", "lenet", "--mode", "fp32", "--times", "1"],
         "argument --times: 1 is out of range; valid: 2..100"),
        (["inspect", "x", "--profile", "--iters", "0"], "argument --iters: 0 is out of range; valid: 1..1000000"),
        (["inspect", "x", "--profile", "--warmup", "-1"], "argument --warmup: -1 is out of range; valid: 0..1000000"),
        (["inspect", "x", "--profile", "--top", "0"], "argument --top: 0 is out of range; valid: an integer >= 1"),
        (["debug", "layers", "--model", "lenet", "--mode", "fp32", "--top", "0"], "argument --top: 0 is out of range"),
        (["debug", "precision", "--model", "lenet", "--low", "bf16", "--target", "cosine>=0.99", "--seconds", "0"],
         "argument --seconds: '0': expected a number of seconds above 0 and at most 600"),
        (["debug", "precision", "--model", "lenet", "--low", "bf16", "--target", "cosine>=0.99",
          "--min-speedup", "3"], "argument --min-speedup: '3': read as the fraction 3"),
    ],
)
def test_bad_flag_values_fail_at_parse_time(capsys, argv, fragment):
    """argparse's usage error (exit 2) naming the flag and what is valid, before anything loads."""
    with pytest.raises(SystemExit) as exc:
        cli_main.main(argv)
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"usage: harness {argv[0]}")
    assert " ".join(fragment.split()) in err, err
