"""Entry point of ``harness`` / ``python -m harness``.

Each subcommand module exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed namespace and returning an exit
code. :class:`HarnessError` becomes ``error: ...`` and exit code 2.

Every parser is a :class:`Parser`: a flag is never taken for a longer one
it abbreviates (``--spread`` is not ``--spread-threshold``), and an unknown flag,
command or choice is refused with the nearest valid one suggested.

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
import difflib
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn

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
    ("report", "harness.cli.results_cmd",
     "print the table and write the plots of a stored, merged or old run (or of pytest-benchmark's JSON)"),
    ("baseline", "harness.cli.results_cmd", "manage per-machine baselines"),
    ("compare", "harness.cli.results_cmd",
     "per-case fingerprints, tactics, output digests, latency and accuracy of two runs"),
    ("gate", "harness.cli.results_cmd", "fail on latency, accuracy or determinism regressions against a baseline"),
    ("history", "harness.cli.history_cmd",
     "benchmark history as an HTML dashboard (and JSON, Markdown): steps, verdicts, changes"),
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


# The long flags of the command line being parsed that no parser knows (Parser.parse_command_line).
_TYPOS: ContextVar[tuple[str, ...]] = ContextVar("harness_unknown_flags", default=())


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that takes no abbreviation of a flag and suggests the nearest valid name.

    ``allow_abbrev`` is off: a prefix is refused rather than read as the one
    flag it happens to begin (``--spread`` for ``--spread-threshold``; a new flag could
    later change what a script's prefix means). An unknown flag is refused by
    the parser of the (sub)command it was given to, with that command's
    usage and, in every error of it, the closest of its flags; an invalid
    choice (a command, a backend) names the closest choice. Values are
    echoed cut short.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        from harness.fileio import shown

        choices = [str(c) for c in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise argparse.ArgumentError(action, f"invalid choice: {shown(value)} ({hint}choose from {', '.join(choices)})")

    def parse_command_line(self, argv: Sequence[str] | None) -> argparse.Namespace:
        """``parse_args``, with an unknown argument refused by the (sub)command it was given to."""
        words = list(sys.argv[1:] if argv is None else argv)
        words = words[: words.index("--")] if "--" in words else words
        known = {flag for parser in self._tree() for action in parser._actions for flag in action.option_strings}
        names = (word.partition("=")[0] for word in words if word.startswith("--"))
        token = _TYPOS.set(tuple(dict.fromkeys(name for name in names if name not in known)))
        try:
            parsed, unknown = self.parse_known_args(argv)
            if unknown:
                from harness.fileio import shown

                listed = " ".join(a if len(a) <= 80 else shown(a) for a in unknown)
                self._chosen(parsed).error(f"unrecognized arguments: {listed}")
            return parsed
        finally:
            _TYPOS.reset(token)

    def _tree(self) -> list[argparse.ArgumentParser]:
        """This parser and every subcommand parser below it."""
        found: list[argparse.ArgumentParser] = [self]
        for parser in found:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    found.extend(action.choices.values())
        return found

    def _chosen(self, parsed: argparse.Namespace) -> Parser:
        """The parser of the (sub)command ``parsed`` ran: its flags are the ones a typo meant."""
        parser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            child = sub.choices.get(str(getattr(parsed, sub.dest, ""))) if sub is not None else None
            if not isinstance(child, Parser):
                return parser
            parser = child

    def error(self, message: str) -> NoReturn:
        """argparse's usage error, naming for each unknown flag of the command line the closest of ours."""
        from harness.fileio import shown

        flags = [flag for action in self._actions for flag in action.option_strings]
        # the flags the error is about (a required one missing) first: `--modle` meant `--model`
        named = [flag for flag in flags if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message)]
        hints = []
        for typo in _TYPOS.get():
            # two at most, as near as each other can be: `--modle` is as near `--modes` as `--models`
            close = difflib.get_close_matches(typo, named, n=1) or difflib.get_close_matches(typo, flags, n=2)
            if close:
                hints.append(f"{' or '.join(close)} for {shown(typo)}")
        super().error(message + (f" (did you mean {', '.join(hints)}?)" if hints else ""))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mixed-precision-harness")
    except PackageNotFoundError:
        from harness import __version__

        return __version__


def build_parser(commands: Iterable[str] | None = None) -> Parser:
    """The parser, with the full arguments of ``commands`` (None: every command).

    The other commands are listed (name and help) but take no arguments of
    their own: registering them would import their modules. Only commands
    whose module is in :data:`SUBCOMMAND_MODULES` are there at all.
    """
    import importlib

    parser = Parser(
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
            scratch = Parser(prog=parser.prog).add_subparsers()
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


@contextlib.contextmanager
def _verbose_logging(verbose: bool) -> Iterator[None]:
    """With ``verbose``, the harness's DEBUG messages on stderr for the command, as
    ``name: message``: a console handler on the root logger (where a progress bar's
    ``logging_redirect_tqdm`` finds it) and the ``harness`` logger at DEBUG; both loggers are
    as they were after the command."""
    if not verbose:
        yield
        return
    import logging

    root, logger = logging.getLogger(), logging.getLogger("harness")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    level = logger.level
    root.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(handler)
        logger.setLevel(level)


def _interrupt_handled() -> None:
    """Tell CPython that the Ctrl-C just caught was handled.

    A KeyboardInterrupt raised inside ``PyRun_String`` (which pybind11 modules
    such as torch, onnx and onnxruntime call while they are imported) sets a
    flag that makes the interpreter kill itself with SIGINT at exit, whatever
    code the program exits with: a Ctrl-C during start-up then ended in -2,
    not 130. Every ``PyRun_String`` clears the flag before it runs its code,
    so one that evaluates ``None`` clears it, whichever CPython this is (the
    flag itself is a global up to 3.11, runtime state from 3.12; neither is
    API). On another interpreter there is no such flag.
    """
    import ctypes

    try:
        prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object)
        run_string = prototype(("PyRun_String", ctypes.pythonapi))
    except (AttributeError, OSError):  # not CPython
        return
    eval_input = 258  # Py_eval_input
    run_string(b"None", eval_input, {}, {})


class _CtrlC:
    """How many Ctrl-Cs (SIGINT) reached the running command, seen or not by what they interrupted."""

    count = 0


@contextlib.contextmanager
def _ctrl_c_counted() -> Iterator[_CtrlC]:
    """Count every Ctrl-C of the block, then raise KeyboardInterrupt as Python does.

    A library may swallow the KeyboardInterrupt (torch imports numpy in C++
    and drops whatever that import raised): numpy is then left half-loaded,
    and the next import of it fails with a RecursionError far from the
    Ctrl-C. Counted, that failure is still reported as the interrupt it is.
    Only Python's own handler in the main thread is replaced (an embedding
    program's handler, or a thread, is left alone) and it is put back after.
    """
    import signal
    import threading

    counted = _CtrlC()
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield counted
        return

    def on_sigint(signum: int, frame: Any) -> None:
        counted.count += 1
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield counted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted() -> int:
    _interrupt_handled()
    print("interrupted", file=sys.stderr)
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names: its exit code; 2 and one ``error:`` line for a HarnessError (a
    failed write leaving nothing of the command behind), 130 for Ctrl-C however early it comes (also
    when what it interrupted swallowed it and then failed)."""
    with _ctrl_c_counted() as ctrl_c:
        try:
            from harness.errors import HarnessError
            from harness.fileio import nothing_left_on_write_failure

            args = build_parser([command_of(argv)]).parse_command_line(argv)
            try:
                with _verbose_logging(args.verbose), _torch_state_kept(), nothing_left_on_write_failure():
                    return int(args.func(args))
            except HarnessError as exc:
                if ctrl_c.count:
                    return _interrupted()
                print(f"error: {exc}", file=sys.stderr)
                return exc.exit_code
        except KeyboardInterrupt:
            return _interrupted()
        except BrokenPipeError:
            # The reader of our output went away (`harness ... | head`): stop quietly, and
            # point stdout at /dev/null so the interpreter's final flush does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except Exception:
            if ctrl_c.count:  # the failure of what a swallowed Ctrl-C left half done
                return _interrupted()
            raise
