"""Every shell and Python example of the README and of docs/ runs as written.

Each fenced ``bash`` (``sh``, ``shell``) and ``python`` block of ``README.md`` and
``docs/**/*.md`` is an example. The blocks of one page run in order, in a fresh
copy of the repository (the files git tracks), with the project installed, so a
page's later blocks see what its earlier ones wrote: ``bash -e -o pipefail``
for shell blocks, this interpreter for Python blocks.

A block that cannot run here is marked by an HTML comment on the line before
it, ``<!-- example: KIND[, KIND] -->``, and the text before it (back to the
previous block or heading) must say so (:data:`KINDS`: the word it must use).
A marked block is not run, but like every block its command lines are checked:
each ``harness`` command line parses with the real parser, each ``nox -s``
names a session of noxfile.py, each ``pip install '.[...]'`` names extras of
pyproject.toml, each ``python -m`` names a module that exists, and Python
blocks compile. ``test_every_example_is_accounted_for`` prints how many blocks
run and how many are skipped, and why; ``test_examples_run`` runs them (slow:
minutes, it builds and benchmarks models).

Every ``harness`` command and Python block runs as a process of its own,
started from a fork server (tests/forkserver.py) that has imported torch
once, so that each does not pay that import again.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.forkserver import ForkServer

REPO = Path(__file__).resolve().parents[1]
SHELL = ("bash", "sh", "shell")
PYTHON = ("python", "py")
# marker -> the word the text before a block so marked must contain (case-insensitive), and why
KINDS = {
    "gpu": ("gpu", "needs a GPU or TensorRT"),
    "placeholder": ("placeholder", "names a file or value of the reader's"),
    "install": ("install", "installs packages into the environment"),
    "long": ("minutes", "runs for minutes (the whole suite, the full benchmark)"),
}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<kinds>[\w\s,-]+?)\s*-->\s*$")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
BLOCK_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kinds: tuple[str, ...]
    context: str  # the text before the block, back to the previous block or heading

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in SHELL or self.lang in PYTHON


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with its marker and the text before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    context_start = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        if HEADING.match(line):
            context_start = i
        opening = FENCE.match(line)
        if opening is None:
            i += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        before = [k for k in range(context_start, i) if lines[k].strip()]
        marker = MARKER.match(lines[before[-1]]) if before else None
        kinds = tuple(k.strip() for k in marker["kinds"].split(",")) if marker else ()
        context = "\n".join(lines[k] for k in range(context_start, i) if not MARKER.match(lines[k]))
        found.append(Block(path.relative_to(REPO).as_posix(), i + 1, lang, "\n".join(body) + "\n", kinds, context))
        context_start = j + 1
        i = j + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks_of(page) if b.runnable]


# ---------------------------------------------------------------------------------------------
# What every block's command lines must name


def command_lines(code: str) -> list[list[str]]:
    """The simple commands of a shell block, each as its words (redirections and env assignments dropped)."""
    joined = re.sub(r"\\\n", " ", code)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        skip_next = False
        for token in list(lexer) + [";"]:
            if skip_next:
                skip_next = False
                continue
            if token in (">", ">>", "<", "2>", "&>"):
                skip_next = True
                continue
            if set(token) <= set(";&|") and token:
                if words:
                    commands.append(words)
                words = []
                continue
            if not words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
                continue  # an environment assignment before the command
            words.append(token)
    return commands


_parser = None


def harness_parser():  # type: ignore[no-untyped-def]
    global _parser
    if _parser is None:
        from harness.cli.main import build_parser

        _parser = build_parser()
    return _parser


def nox_sessions() -> set[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("session" in ast.unparse(d) for d in node.decorator_list)
    }


def extras() -> set[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def problems_of(block: Block) -> list[str]:
    """What in a block names something that does not exist (a command, flag, session, extra, module)."""
    if block.lang in PYTHON:
        try:
            ast.parse(block.code)
        except SyntaxError as exc:
            return [f"does not compile: {exc}"]
        return []
    found = []
    for words in command_lines(block.code):
        program, args = words[0], words[1:]
        if program == "harness":
            try:
                harness_parser().parse_command_line(args)
            except SystemExit as exc:
                if exc.code:
                    found.append(f"`{' '.join(words)}` does not parse (harness's own error is above)")
        elif program == "nox" and "-s" in args:
            session = args[args.index("-s") + 1]
            if session not in nox_sessions():
                found.append(f"`nox -s {session}`: no such session in noxfile.py")
        elif program == "pip" and "install" in args:
            for arg in args:
                named = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
                for extra in named[1].split(",") if named else ():
                    if extra not in extras():
                        found.append(f"`{arg}`: no extra {extra!r} in pyproject.toml")
        elif program in ("python", "python3") and args[:1] == ["-m"]:
            module = args[1]
            if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None
            ):
                found.append(f"`python -m {module}`: no such module")
    return found


def test_every_example_is_accounted_for(capsys: pytest.CaptureFixture[str]) -> None:
    """Every block runs or is marked, every mark is a known kind and the text says so; the count is printed."""
    blocks = all_blocks()
    assert blocks, "no examples found"
    wrong = []
    for block in blocks:
        for kind in block.kinds:
            if kind not in KINDS:
                wrong.append(f"{block.where}: unknown marker {kind!r} (valid: {', '.join(KINDS)})")
            elif KINDS[kind][0] not in block.context.lower():
                wrong.append(
                    f"{block.where}: marked {kind!r} ({KINDS[kind][1]}), but the text before it does not say "
                    f"so (it must mention {KINDS[kind][0]!r})"
                )
    assert not wrong, "\n".join(wrong)
    run = [b for b in blocks if not b.kinds]
    why = Counter(", ".join(b.kinds) for b in blocks if b.kinds)
    lines = [
        f"documentation examples: {len(blocks)} blocks in {len({b.page for b in blocks})} pages; "
        f"{len(run)} run, {len(blocks) - len(run)} skipped"
    ]
    for kinds, count in sorted(why.items()):
        reasons = "; ".join(KINDS[k][1] for k in kinds.split(", "))
        lines.append(f"  skipped, marked {kinds}: {count} ({reasons})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_every_example_names_real_commands_flags_sessions_and_extras() -> None:
    """Run or not, no block names a harness command or flag, nox session, extra or module that is not there."""
    found = [f"{b.where}: {problem}" for b in all_blocks() for problem in problems_of(b)]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_should() -> None:
    """The checks themselves: a typo of a flag, a session or an extra is caught; a redirection is not a word."""
    block = Block("x.md", 1, "bash", "harness bench --modle lenet > out.txt\nnox -s bnech\npip install '.[nope]'\n", (), "")
    found = problems_of(block)
    assert len(found) == 3, found
    assert command_lines("A=1 harness gate --json > v.json || echo \"exit $?\"\n") == [
        ["harness", "gate", "--json"],
        ["echo", "exit $?"],
    ]


# ---------------------------------------------------------------------------------------------
# Running them


def _copy_of_repository(dest: Path) -> Path:
    """What a fresh clone holds (the files git tracks, staged ones included: ``git add`` a new file
    an example needs), except the packages the venv has installed already (a copy of ``harness/``
    in the working directory would shadow the installed one)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached"],
        cwd=REPO, capture_output=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:
        skipped = shutil.ignore_patterns(".git", ".nox", "build", "__pycache__", "*.egg-info")
        shutil.copytree(REPO, dest, ignore=skipped)
        names = [p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()]
    else:
        names = [n for n in listed.stdout.decode().split("\0") if n]
        for name in names:
            source = REPO / name
            if source.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    for package in ("harness", "models"):
        shutil.rmtree(dest / package, ignore_errors=True)
    return dest


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    env.pop("PYTHONPATH", None)
    return env


@dataclass(frozen=True)
class Runner:
    """How the examples run: their environment (``harness`` on its PATH is the fork server's) and the
    program that runs a Python block's script."""

    env: dict[str, str]
    python: Path


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    directory = tmp_path_factory.mktemp("forkserver")
    env = _env()
    env["PATH"] = f"{directory / 'bin'}{os.pathsep}{env['PATH']}"
    server = ForkServer(directory, env)
    try:
        server.client("harness", "harness")
        yield Runner(env, server.client("python", "python-script"))
    finally:
        server.close()


RUNNABLE_PAGES = sorted({b.page for b in all_blocks() if not b.kinds})


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_examples_run(page: str, runner: Runner, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The page's unmarked blocks, in order, in a fresh copy of the repository: each exits 0."""
    work = _copy_of_repository(tmp_path / "repo")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    blocks = [b for b in blocks_of(REPO / page) if b.runnable]
    ran = 0
    for number, block in enumerate(blocks):
        if block.kinds:
            continue
        if block.lang in PYTHON:
            script = scripts / f"block{number}.py"
            script.write_text(block.code, encoding="utf-8")
            argv = [str(runner.python), str(script)]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
        done = subprocess.run(
            argv, cwd=work, env=runner.env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
        )
        assert done.returncode == 0, (
            f"{block.where}: the example exited {done.returncode}\n--- example ---\n{block.code}"
            f"--- stdout (end) ---\n{done.stdout[-4000:]}\n--- stderr (end) ---\n{done.stderr[-4000:]}"
        )
        ran += 1
    with capsys.disabled():
        print(f"\n{page}: {ran} example(s) ran, {len(blocks) - ran} skipped (marked)")
