"""The documentation pages made from the code and the committed results when the site is built.

Nothing here is typed by hand: the CLI reference is read off the argparse
parsers ``harness.cli.main.build_parser`` builds, the project-file keys off
``harness.project.schema()`` (with the flag each key stands for, read off the
same parsers), the JSON schemas off the modules that validate those files, and
the benchmark pages off the results JSON committed under ``results/<machine>/``.
``docs/hooks/mkdocs_hooks.py`` adds these pages to the site; the docs tests
import this module too.

Every function returns Markdown (or JSON) text; nothing is written to disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import html
import importlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"

# Where the generated pages go, relative to docs/.
CLI_PAGE = "reference/cli.md"
PROJECT_PAGE = "reference/project-file.md"
SCHEMAS_PAGE = "reference/schemas.md"
SCHEMA_FILES = "reference/schemas"
BENCHMARKS_DIR = "benchmarks"
# What docs/hooks/record_benchmark.py writes under results/<machine>/, one file a recording.
RECORDINGS = "benchmarks"

GENERATED_NOTE = (
    '!!! info "Generated"\n    This page is generated when the site is built, from {source}: '
    "it cannot disagree with what it describes.\n"
)


def md(text: str) -> str:
    """``text`` as literal Markdown inline text (also inside a table cell)."""
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", html.escape(text, quote=False))


def code(text: str) -> str:
    """``text`` as a code span (a backtick inside it is impossible in what we show)."""
    return f"`{text}`"


@contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps usage lines at $COLUMNS: a fixed width gives the same page on every machine."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


# ---------------------------------------------------------------------------------------------
# CLI reference


@dataclass(frozen=True)
class Command:
    """One (sub)command of ``harness``: its words (``("cache", "pin")``), one-line help, parser."""

    words: tuple[str, ...]
    help: str
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return " ".join(("harness", *self.words))

    @property
    def anchor(self) -> str:
        return "-".join(("harness", *self.words))


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every command of the ``harness`` parser (every command's full parser), in ``--help`` order.

    A command with actions (``cache``, ``baseline``, ``debug``) comes before its actions.
    """
    if parser is None:
        from harness.cli.main import build_parser

        parser = build_parser()
    found: list[Command] = []

    def walk(words: tuple[str, ...], help_text: str, node: argparse.ArgumentParser) -> None:
        found.append(Command(words, help_text, node))
        sub = _subparsers(node)
        if sub is None:
            return
        helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
        for name, child in sub.choices.items():
            walk((*words, name), helps.get(name, ""), child)

    walk((), "", parser)
    return found


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` (its own, not its subcommands')."""
    return {flag for action in parser._actions for flag in action.option_strings}


def _argument(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """How the argument is written: ``--data-max X|off``, ``-o DIR, --output DIR``, ``RUN``."""
    if not action.option_strings:
        return formatter._format_args(action, formatter._get_default_metavar_for_positional(action))
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if not actions:
            continue
        lines += ["", f"**{md(group.title or 'arguments')}**", ""]
        for action in actions:
            help_text = formatter._expand_help(action) if action.help else ""
            help_text = " ".join(help_text.split())
            lines.append(f"- {code(_argument(formatter, action))}" + (f": {md(help_text)}" if help_text else ""))
    return lines


def cli_reference() -> str:
    """The CLI reference page: every command, its usage and every flag with its help and default."""
    from harness.cli.main import _version

    found = commands()
    top = found[0].parser
    lines = [
        "# CLI reference",
        "",
        GENERATED_NOTE.format(source="the argparse parsers of `harness.cli` (`harness COMMAND --help` prints the same)"),
        f"`harness` {md(_version())}. {md(top.description or '')}",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [{code(c.name)}](#{c.anchor}) | {md(c.help)} |" for c in found[1:]]
    for command in found:
        with _columns(100):
            usage = command.parser.format_usage().strip()
        heading = "#" * min(2 + max(len(command.words) - 1, 0), 3)
        lines += ["", f"{heading} {code(command.name)} {{ #{command.anchor} }}", ""]
        if command.help:
            lines += [md(command.help[0].upper() + command.help[1:]) + ".", ""]
        if command.parser.description and command.words:
            lines += [md(" ".join(command.parser.description.split())), ""]
        lines += ["```text", usage, "```"]
        lines += _arguments(command.parser)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Project-file keys


def describe(schema: Mapping[str, Any]) -> str:
    """A JSON schema in words, for one table cell."""
    if "enum" in schema:
        return "one of " + ", ".join(code(str(v)) for v in schema["enum"])
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    if "anyOf" in schema:
        return " or ".join(describe(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "array":
        text = f"list of {describe(schema.get('items', {}))}"
        if schema.get("minItems"):
            text += f", at least {schema['minItems']}"
        if schema.get("uniqueItems"):
            text += ", each once"
        return text
    if kind in ("integer", "number"):
        text = "integer" if kind == "integer" else "number"
        bounds = []
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
            if key in schema:
                bounds.append(f"{sign} {schema[key]:g}")
        return text + (f" {' and '.join(bounds)}" if bounds else "")
    if kind == "string":
        if "pattern" in schema:
            return f"string matching {code(schema['pattern'])}"
        return "string"
    if kind == "boolean":
        return "`true` or `false`"
    if kind == "object":
        return "table"
    return "any value"


def _options_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _flag_cells(action: argparse.Action | None, parser: argparse.ArgumentParser) -> tuple[str, str]:
    if action is None:
        return "", ""
    formatter = parser._get_formatter()
    help_text = " ".join((formatter._expand_help(action) if action.help else "").split())
    return " ".join(code(f) for f in action.option_strings if f.startswith("--")), md(help_text)


def project_file_reference() -> str:
    """Every key of the project file: its value, the flag that overrides it and what it sets."""
    from harness.bench.runner import QUICK, MeasureSettings
    from harness.project import schema

    by_name = {c.name: c.parser for c in commands()}
    bench, gate = by_name["harness bench"], by_name["harness gate"]
    bench_flags, gate_flags = _options_by_dest(bench), _options_by_dest(gate)
    props = schema()["properties"]
    measure = {f.name: f.default for f in dataclasses.fields(MeasureSettings)}
    quick = dataclasses.asdict(QUICK)

    lines = [
        "# Project file keys",
        "",
        GENERATED_NOTE.format(
            source="the project file's JSON schema (`harness.project.schema()`) and the flags of "
            "`harness bench` and `harness gate`"
        ),
        "Where the file is read from, how flags and the file combine and a full example: "
        "[the project file](../guide/project-file.md). A key the table does not list is an error "
        "naming it; so is a value outside what its row allows.",
        "",
    ]

    def table(rows: Sequence[tuple[str, Mapping[str, Any], argparse.Action | None, argparse.ArgumentParser]]) -> None:
        lines.extend(["| key | value | flag | what it sets |", "|---|---|---|---|"])
        for key, key_schema, action, parser in rows:
            flag, help_text = _flag_cells(action, parser)
            lines.append(f"| {code(key)} | {describe(key_schema)} | {flag} | {help_text} |")
        lines.append("")

    tables = {"autocast", "model", "timing", "gate"}
    lines += ["## Top level", ""]
    table([(k, s, bench_flags.get(k), bench) for k, s in props.items() if k not in tables])

    lines += [
        "## `[autocast]`",
        "",
        "The autocast compiler's settings for every model (the same keys, and flags, as "
        "`harness compile`, `build`, `rebuild`, `bench` and `debug` take).",
        "",
    ]
    autocast = props["autocast"]["properties"]
    table([(k, s, bench_flags.get(k), bench) for k, s in autocast.items()])

    model = props["model"]["additionalProperties"]["properties"]
    lines += [
        '## `[model."<reference>"]`',
        "",
        "One table per model, keyed by its reference as the file's `models` writes it "
        '(`[model."my_model.py:classifier"]`) or by its name (`[model.classifier]`).',
        "",
    ]
    table(
        [("explicit", model["explicit"], bench_flags.get("explicit"), bench)]
        + [("autocast", model["autocast"], None, bench)]
    )
    lines += ["`autocast` takes the keys of `[autocast]` above; they apply to this model after those.", ""]

    lines += ["## `[timing]`", "", "The benchmark's timing windows, per case.", ""]
    lines += ["| key | value | default | with `--quick` | flag | what it sets |", "|---|---|---|---|---|---|"]
    for key, key_schema in props["timing"]["properties"].items():
        flag, help_text = _flag_cells(bench_flags.get(key), bench)
        default = measure.get(key)
        lines.append(
            f"| {code(key)} | {describe(key_schema)} | {md('' if default is None else str(default))} | "
            f"{md('' if quick.get(key) is None else str(quick[key]))} | {flag} | {help_text} |"
        )
    lines += ["", "## `[gate]`", "", "The regression gate's settings (`harness gate`, `nox -s gate`).", ""]
    table([(k, s, gate_flags.get(k), gate) for k, s in props["gate"]["properties"].items()])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# JSON schemas


@dataclass(frozen=True)
class SchemaDoc:
    """A JSON schema the code validates a file with: where it lives and what the file is."""

    slug: str
    title: str
    # module:attribute (a schema, or a document class: its generated schema; dotted names reach into
    # a module's objects), or module:function() for one built on use
    where: str
    what: str


SCHEMAS = (
    SchemaDoc(
        "results", "Results file", "harness.bench.results_doc:RESULTS_SCHEMA",
        "One `harness bench` run: `results/<machine>/run-<time>.json`, `baseline.json`, shards and "
        "merged runs; generated from the classes of `harness.bench.results_doc`, which readers get. "
        "See [the results format](../concepts/results-format.md).",
    ),
    SchemaDoc(
        "timing-cache", "Timing cache", "harness.cache.timing_cache:SCHEMA",
        "The backend-neutral timing cache (`--cache FILE`, `caches/*.json`); generated from its classes "
        "(`CacheEntry`, `Candidate`, `Provenance`). See [timing caches](../concepts/timing-caches.md).",
    ),
    SchemaDoc(
        "project", "Project file", "harness.project:schema()",
        "`harness.toml`, or `[tool.harness]` in `pyproject.toml`, read as TOML and checked against this. "
        "See [the project file keys](project-file.md).",
    ),
    SchemaDoc(
        "autocast", "Autocast settings", "harness.autocast.options:SCHEMA",
        "The `[autocast]` table of a project file, and each model table's `autocast`.",
    ),
    SchemaDoc(
        "explicit", "Explicit precision file", "harness.engines.modes:EXPLICIT_SCHEMA",
        "`--explicit FILE` of mode `explicit`, and what `harness debug precision` writes: node-name "
        "regular expressions to a precision, the first match wins.",
    ),
    SchemaDoc(
        "engine-layer", "Engine layer record", "harness.engines.protocol:LayerRecord",
        "One layer of a saved engine's `plan.json` (every backend's; OpenVINO's add `precision` and "
        "`origins`), generated from its class.",
    ),
    SchemaDoc(
        "cpu-plan", "CPU engine plan", "harness.engines.cpu.plan:PLAN.schema",
        "The `plan.json` of an engine saved by backend `cpu` (beside `weights.safetensors`); generated "
        "from its class, `harness.engines.cpu.plan.CpuPlan`, which the loader reads.",
    ),
    SchemaDoc(
        "peer-ratios", "Engine benchmark ratios", "harness.benchmarks.peer_bench:RATIOS_SCHEMA",
        "What `python -m harness.benchmarks.engine_bench --json FILE` writes.",
    ),
)  # fmt: skip


def schema_of(doc: SchemaDoc) -> dict[str, Any]:
    module_name, _, attribute = doc.where.partition(":")
    module = importlib.import_module(module_name)
    if attribute.endswith("()"):
        value = getattr(module, attribute[:-2])()
    else:
        value = functools.reduce(getattr, attribute.split("."), module)
    if isinstance(value, type):
        from harness.documents import schema_of as document_schema

        value = document_schema(value, doc.title)
    if not isinstance(value, dict):
        raise TypeError(f"{doc.where} is not a JSON schema (a dict)")
    return value


def schema_json(doc: SchemaDoc) -> str:
    return json.dumps(schema_of(doc), indent=2, sort_keys=False, default=list) + "\n"


def schemas_reference() -> str:
    lines = [
        "# JSON schemas",
        "",
        GENERATED_NOTE.format(source="the schemas the code validates these files with"),
        "Every file the harness reads is validated against its schema before any work; a file that "
        "does not match is one error naming the file and the place in it (exit code 2). Each schema "
        "below is also a file to download, for editors and other tools.",
    ]
    for doc in SCHEMAS:
        text = schema_json(doc)
        lines += [
            "",
            f"## {doc.title} {{ #{doc.slug} }}",
            "",
            doc.what,
            "",
            f"Defined at {code(doc.where)}; download [{doc.slug}.schema.json](schemas/{doc.slug}.schema.json).",
            "",
            f'??? note "{doc.title} schema ({len(text.splitlines())} lines)"',
            "",
            "    ```json",
            *(f"    {line}" if line else "" for line in text.rstrip("\n").splitlines()),
            "    ```",
        ]
    return "\n".join(lines) + "\n"


def schema_files() -> dict[str, str]:
    return {f"{SCHEMA_FILES}/{doc.slug}.schema.json": schema_json(doc) for doc in SCHEMAS}


# ---------------------------------------------------------------------------------------------
# Benchmark pages from committed results


@dataclass(frozen=True)
class Run:
    path: Path
    doc: dict[str, Any]


@dataclass(frozen=True)
class Recording:
    """A file docs/hooks/record_benchmark.py wrote: one benchmark module's output, with provenance."""

    path: Path
    doc: dict[str, Any]


@dataclass(frozen=True)
class Machine:
    id: str
    runs: list[Run]  # newest first
    baseline: Run | None
    recordings: list[Recording]  # newest first

    @property
    def page(self) -> str:
        return f"{BENCHMARKS_DIR}/{self.id}.md"


def machines(root: Path = RESULTS) -> list[Machine]:
    """Every machine with committed results under ``root``; each run file is validated on load."""
    from harness.bench.results import load_results

    found = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        runs = [Run(p, load_results(p)) for p in sorted(directory.glob("run-*.json"))]
        runs = [r for r in runs if not re.search(r"-shard\d+of\d+\.json$", r.path.name)]
        runs.sort(key=lambda r: r.doc["created"], reverse=True)
        base_path = directory / "baseline.json"
        baseline = Run(base_path, load_results(base_path)) if base_path.is_file() else None
        recordings = [
            Recording(p, json.loads(p.read_text(encoding="utf-8")))
            for p in sorted((directory / RECORDINGS).glob("*.json"))
        ]
        recordings.sort(key=lambda r: str(r.doc.get("created", "")), reverse=True)
        if runs or baseline or recordings:
            found.append(Machine(directory.name, runs, baseline, recordings))
    return found


def _when(stamp: str) -> str:
    moment = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def _commit(git: Mapping[str, Any]) -> str:
    commit = git.get("commit")
    text = code(str(commit)[:12]) if commit else "no git commit"
    if git.get("dirty"):
        text += " (uncommitted changes in the tree)"
    return text


def _machine_lines(machine: Mapping[str, Any]) -> list[str]:
    cpu = machine.get("cpu") or {}
    gpu = machine.get("gpu") or {}
    devices = gpu.get("devices") or []
    torch_info = machine.get("torch") or {}
    lines = [
        f"- machine id: {code(machine['id'])}",
        f"- CPU: {md(str(cpu.get('model', '?')))}, {cpu.get('logical_cores', '?')} logical cores; "
        f"ISA: {md(', '.join(cpu.get('isa_flags', [])) or 'none recorded')}",
        f"- GPU: {md(', '.join(d.get('name', '?') for d in devices)) if devices else 'none'}",
        f"- torch {md(str(torch_info.get('version', '?')))}",
    ]
    if machine.get("tensorrt"):
        lines.append(f"- TensorRT {md(str(machine['tensorrt']))}")
    return lines


# The columns of `harness report` that compare cases (`backend` only where a run has several:
# peers); the rest are in the results file.
_SHOWN = ("model", "batch", "mode", "backend", "median", "speed-up", "vs best peer", "IQR/median", "max abs err", "status")


def run_table(doc: Mapping[str, Any]) -> list[str]:
    """The run's per-case table (the columns of ``harness report`` that compare cases), in Markdown."""
    from harness.bench.results_doc import read_run
    from harness.bench.tables import busy_note, results_rows

    run = read_run(doc)
    header, rows = results_rows(run)
    shown = set(_SHOWN) - ({"backend"} if len({c.backend for c in run.cases}) == 1 else set())
    keep = [i for i, name in enumerate(header) if name in shown]
    lines = [
        "| " + " | ".join(md(header[i]) for i in keep) + " |",
        "|" + "---|" * len(keep),
    ]
    lines += ["| " + " | ".join(md(" ".join(row[i].split())) for i in keep) + " |" for row in rows]
    busy = busy_note(run.cases)
    if busy:
        lines += ["", md(busy)]
    return lines


def build_table(doc: Mapping[str, Any]) -> list[str]:
    """How long each case's engine build took, and how much of it came from the timing cache."""
    lines = ["| model | mode | backend | build | layers from the cache | layers timed |", "|---|---|---|---|---|---|"]
    for case in doc["cases"]:
        build = case.get("build")
        if not build or build.get("seconds") is None:
            continue
        lines.append(
            f"| {md(case['model'])} | {md(case['mode'])} | {md(case['backend'])} | {build['seconds']:.2f} s | "
            f"{build.get('cache_hits', '')} | {build.get('cache_misses', '')} |"
        )
    return lines


def _run_section(machine: Machine, run: Run, extra: dict[str, str]) -> list[str]:
    doc = run.doc
    settings = doc["settings"]
    is_baseline = machine.baseline is not None and machine.baseline.doc.get("digest") == doc.get("digest")
    title = f"Run of {_when(doc['created'])}" + (" (the baseline)" if is_baseline else "")
    rel = run.path.relative_to(REPO).as_posix()
    lines = [
        "",
        f"## {title}",
        "",
        f"- file: {code(rel)}; reprint it with {code(f'harness report {rel}')}",
        f"- date: {_when(doc['created'])}",
        f"- commit: {_commit(doc['git'])}",
        f"- backend {code(str(settings.get('backend')))}, {settings.get('threads')} thread(s)"
        + (", **--quick** (timing windows too short for numbers)" if settings.get("quick") else ""),
        f"- complete: {'yes' if doc['complete'] else 'no (interrupted)'}",
        "",
        *_machine_lines(doc["machine"]),
        "",
        "### Latency and accuracy",
        "",
        "Speed-up is against the same model's fp32 engine; errors against eager fp32 PyTorch on fixed "
        "inputs; IQR/median is the spread of the case's samples (see "
        "[what is measured](../concepts/measurement.md)).",
        "",
        *run_table(doc),
    ]
    plots = sorted(run.path.parent.glob(run.path.stem + "-*.png"))
    if plots:
        lines += ["", "### Latency against error", ""]
        for plot in plots:
            target = f"{BENCHMARKS_DIR}/{machine.id}/{plot.name}"
            extra[target] = str(plot)
            lines += [f"![{md(plot.stem)}]({machine.id}/{plot.name})", ""]
    builds = build_table(doc)
    if len(builds) > 2:
        lines += [
            "",
            "### Build times",
            "",
            "Each case's engine build in this run; a build whose layers all came from the committed "
            "timing cache (`layers timed` 0) is a warm, pinned build.",
            "",
            *builds,
        ]
    return lines


RECORDING_KINDS = {
    "engine": "Engine against eager PyTorch and the peers",
    "build": "Build times, cold and warm",
    "conformance": "Conformance on third-party architectures",
}


def _recording_section(recording: Recording) -> list[str]:
    doc = recording.doc
    kind = str(doc.get("kind", "?"))
    rel = recording.path.relative_to(REPO).as_posix()
    lines = [
        "",
        f"## {md(RECORDING_KINDS.get(kind, kind))}, {_when(str(doc['created']))}",
        "",
        f"- file: {code(rel)}",
        f"- date: {_when(str(doc['created']))}",
        f"- commit: {_commit(doc.get('git') or {})}",
        f"- command: {code(' '.join(doc.get('command', [])))}",
        "",
        *_machine_lines(doc["machine"]),
        "",
    ]
    if kind == "conformance" and isinstance(doc.get("data"), list):
        from harness.benchmarks.conformance_bench import conformance_table

        lines += [conformance_table(doc["data"]), ""]
    else:
        lines += ["```text", str(doc.get("report", "")).rstrip(), "```"]
    return lines


def machine_page(machine: Machine, extra: dict[str, str]) -> str:
    lines = [
        f"# {md(machine.id)}",
        "",
        GENERATED_NOTE.format(source=f"the results committed under `results/{machine.id}/`"),
        "Figures from one machine, on one day, at one commit: compare them within this page, not "
        "with another machine's.",
    ]
    for run in machine.runs:
        lines += _run_section(machine, run, extra)
    for recording in machine.recordings:
        lines += _recording_section(recording)
    return "\n".join(lines) + "\n"


def benchmark_pages(root: Path = RESULTS) -> tuple[dict[str, str], dict[str, str]]:
    """The benchmark pages (path under docs/ -> Markdown) and the files they show (path -> source)."""
    found = machines(root)
    extra: dict[str, str] = {}
    pages: dict[str, str] = {}
    lines = [
        "# Benchmarks",
        "",
        GENERATED_NOTE.format(source="the results JSON committed under `results/<machine>/`"),
        "Every figure on these pages comes from a results file in the repository, and each page names "
        "the machine, the date and the commit it was measured at. To add a machine, commit a run of "
        "it (see [compare two machines](../guide/compare-machines.md)); to record the engine, build and "
        "conformance benchmarks, see [recording a benchmark](#recording-a-benchmark).",
        "",
        "| machine | newest run | commit | cases | baseline | recorded benchmarks |",
        "|---|---|---|---|---|---|",
    ]
    for machine in found:
        newest = machine.runs[0].doc if machine.runs else None
        kinds = sorted({str(r.doc.get("kind")) for r in machine.recordings})
        lines.append(
            f"| [{md(machine.id)}]({machine.id}.md) | {_when(newest['created']) if newest else ''} | "
            f"{_commit(newest['git']) if newest else ''} | {len(newest['cases']) if newest else ''} | "
            f"{'yes' if machine.baseline else 'no'} | {', '.join(kinds) or 'none yet'} |"
        )
        pages[machine.page] = machine_page(machine, extra)
    lines += [
        "",
        "## Recording a benchmark",
        "",
        "`harness bench` writes its results file itself. The other benchmarks print a report; "
        "`docs/hooks/record_benchmark.py` runs one of them and keeps its output with the machine, "
        "date and commit under `results/<machine>/benchmarks/`, where these pages pick it up:",
        "",
        "| kind | runs |",
        "|---|---|",
        "| `engine` | `python -m harness.benchmarks.engine_bench` (the CPU engine against eager PyTorch and the peers) |",
        "| `build` | `python -m harness.benchmarks.build_bench` (cold and warm build times) |",
        "| `conformance` | `python -m harness.benchmarks.conformance_bench --conformance-table` (the conformance suite) |",
        "",
        "For example `python docs/hooks/record_benchmark.py engine -- --threads 1 --repeat 3` or "
        "`python docs/hooks/record_benchmark.py conformance`. Record on a quiet machine (nothing else "
        "CPU-heavy running), then commit the file.",
    ]
    pages[f"{BENCHMARKS_DIR}/index.md"] = "\n".join(lines) + "\n"
    return pages, extra


# ---------------------------------------------------------------------------------------------
# Pages kept elsewhere in the repository

CPU_ENGINE_README = REPO / "harness" / "engines" / "cpu" / "README.md"
CPU_ENGINE_PAGE = "internals/cpu-engine-code.md"


def cpu_engine_code() -> str | None:
    """The CPU engine's own README (the map of its modules), as a page; None while it does not exist."""
    if not CPU_ENGINE_README.is_file():
        return None
    text = CPU_ENGINE_README.read_text(encoding="utf-8")
    body = re.sub(r"\A# [^\n]*\n", "", text)
    return (
        "# The CPU engine's code\n\n"
        + GENERATED_NOTE.format(source="`harness/engines/cpu/README.md`, which lives beside the code")
        + "\n"
        + body
    )


def all_pages() -> tuple[dict[str, str], dict[str, str]]:
    """Every generated page and data file (path under docs/ -> text), and files copied in (path -> source)."""
    pages = {CLI_PAGE: cli_reference(), PROJECT_PAGE: project_file_reference(), SCHEMAS_PAGE: schemas_reference()}
    code_page = cpu_engine_code()
    if code_page is not None:
        pages[CPU_ENGINE_PAGE] = code_page
    pages.update(schema_files())
    bench_pages, copied = benchmark_pages()
    pages.update(bench_pages)
    return pages, copied
