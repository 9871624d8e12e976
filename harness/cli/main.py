"""Entry point of ``harness`` / ``python -m harness``.

Each subcommand module exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed namespace and returning an exit
code. :class:`HarnessError` becomes ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from harness.errors import HarnessError
from harness.globalstate import preserved_global_state

SUBCOMMAND_MODULES = ("harness.cli.compile_cmd", "harness.cli.cache_cmd", "harness.cli.build_cmd", "harness.cli.bench_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Reproducible builds and benchmarks for mixed-precision inference: "
        "autocast compiler, engine builds with editable timing caches, benchmarks and a regression gate.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with preserved_global_state():
            return int(args.func(args))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
