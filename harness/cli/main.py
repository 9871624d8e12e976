"""Entry point of ``harness`` / ``python -m harness``.

Each subcommand module exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed namespace and returning an exit
code. :class:`HarnessError` becomes ``error: ...`` and exit code 2.

This module imports nothing heavy at import time: everything (torch among
it) is imported inside :func:`main`, where Ctrl-C during start-up is caught
like Ctrl-C anywhere else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

SUBCOMMAND_MODULES = (
    "harness.cli.compile_cmd", "harness.cli.cache_cmd", "harness.cli.build_cmd", "harness.cli.bench_cmd",
    "harness.cli.debug_cmd",
)


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


def build_parser() -> argparse.ArgumentParser:
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
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _set_formatter(parser)
    return parser


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's --help shows defaults (the formatter is read when help is printed)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _set_formatter(child)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from harness.errors import HarnessError
        from harness.globalstate import preserved_global_state

        args = build_parser().parse_args(argv)
        if args.verbose:
            import logging

            logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr)
            logging.getLogger("harness").setLevel(logging.DEBUG)
        try:
            with preserved_global_state():
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
