"""Entry point of ``harness`` / ``python -m harness``.

Each subcommand module exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed namespace and returning an exit
code. :class:`HarnessError` becomes ``error: ...`` and exit code 2.

Modules are imported when their command runs, not before: :data:`COMMANDS`
names every command with its module and one-line help, the command line is
read once to learn which command it names (:func:`command_of`), and only
that command's module registers its full parser (:func:`build_parser`). So
``harness gate`` imports no torch (``nox -s gate`` runs without it), and
nothing heavy is imported here at all: everything is imported inside
:func:`main`, where Ctrl-C during start-up is caught like Ctrl-C anywhere else.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Sequence

# (command, module that registers it, help), in the order `harness --help` lists them.
COMMANDS = (
    ("compile", "harness.cli.compile_cmd", "run the autocast compiler and print the precision report"),
    ("cache", "harness.cli.cache_cmd", "inspect and edit timing caches (JSON)"),
    ("build", "harness.cli.build_cmd", "build an engine for a model in a precision mode"),
    ("rebuild", "harness.cli.build_cmd", "build N times and report fingerprints, tactic flips, output bits"),
    ("inspect", "harness.cli.build_cmd",
     "list the layers and tactics of a saved engine, or of a trtexec build (--trt-log, --trt-layers)"),
    ("bench", "harness.cli.bench_cmd", "benchmark models x precision modes on one backend"),
    ("merge", "harness.cli.results_cmd", "join the shards of a run into one results file"),
    ("report", "harness.cli.results_cmd", "print the table and write the plots of a stored, merged or old run"),
    ("baseline", "harness.cli.results_cmd", "manage per-machine baselines"),
    ("compare", "harness.cli.results_cmd",
     "per-case fingerprints, tactics, output digests, latency and accuracy of two runs"),
    ("gate", "harness.cli.results_cmd", "fail on latency, accuracy or determinism regressions against a baseline"),
    ("debug", "harness.cli.debug_cmd", "precision debugging: per-layer error, and the fastest plan meeting a target"),
)
SUBCOMMAND_MODULES = tuple(dict.fromkeys(module for _, module, _ in COMMANDS))


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        # Identity, not ==: a default of 0 or 0.0 equals False but is a value worth showing.
        if (
            "%(default)" in text
            or "default:" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mixed-precision-harness")
    except PackageNotFoundError:
        from harness import __version__

        return __version__


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the full arguments of ``commands`` (None: every command).

    The other commands are listed (name and help) but take no arguments of
    their own: registering them would import their modules. Only commands
    whose module is in :data:`SUBCOMMAND_MODULES` are there at all.
    """
    import importlib

    parser = argparse.ArgumentParser(
        prog="harness",
        description="Reproducible builds and benchmarks for mixed-precision inference: "
        "autocast compiler, engine builds with editable timing caches, benchmarks and a regression gate.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what every pass and build step does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = None if commands is None else set(commands)
    registered: dict[str, argparse._SubParsersAction] = {}  # type: ignore[type-arg]
    for name, module, help_text in COMMANDS:
        if module not in SUBCOMMAND_MODULES:
            continue
        placeholder = sub.add_parser(name, help=help_text, add_help=wanted is None or name in wanted)
        if wanted is not None and name not in wanted:
            continue
        if module not in registered:
            # The module adds its parsers to a scratch parser of the same name ("harness"),
            # so their usage lines read as before; the real one then takes the parser.
            scratch = argparse.ArgumentParser(prog=parser.prog).add_subparsers()
            importlib.import_module(module).register(scratch)
            registered[module] = scratch
        sub.choices[name] = registered[module].choices[name] if name in registered[module].choices else placeholder
    _set_formatter(parser)
    return parser


def command_of(argv: Sequence[str] | None) -> str:
    """The command ``argv`` names, read without importing any command's module.

    ``harness --help`` and ``--version`` are answered (and exit) here; an
    unknown or missing command is argparse's usage error, as before.
    """
    known, _ = build_parser(()).parse_known_args(argv)
    command: str = known.command  # the subcommands are required: argparse exits without one
    return command


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's --help shows defaults (the formatter is read when help is printed)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _set_formatter(child)


def _torch_state_kept() -> contextlib.AbstractContextManager[None]:
    """Restore torch's process state (grad mode, threads, RNG) after the command, if torch is loaded.

    A caller that never imported torch has no such state to keep, and a
    command that never imports it (``gate``) runs where torch is not installed.
    """
    if sys.modules.get("torch") is None:
        return contextlib.nullcontext()
    from harness.globalstate import preserved_global_state

    return preserved_global_state()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from harness.errors import HarnessError

        args = build_parser([command_of(argv)]).parse_args(argv)
        if args.verbose:
            import logging

            logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr)
            logging.getLogger("harness").setLevel(logging.DEBUG)
        try:
            with _torch_state_kept():
                return int(args.func(args))
        except HarnessError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`harness ... | head`): stop quietly, and
        # point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
