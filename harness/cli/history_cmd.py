"""``harness history``: a machine's benchmark history as an HTML dashboard, JSON and Markdown.

``harness history results/<machine>/ [more directories or files]`` reads every
run (and the baseline) there, validated, and writes

* ``-o FILE`` (default ``history.html``): the dashboard, one self-contained
  page (plotly.js inlined: no network needed to view it; the ``history``
  extra installs plotly), unless ``--no-html``;
* ``--json FILE``: the same data for other tools (``history_version`` 1);
* ``--summary-md FILE``: a Markdown summary for a CI job summary.

It prints one line per step found. Like the other commands on results
files it imports no torch. Exit codes: 0 written (whatever the history
shows), 2 bad input (a path that holds no runs, a corrupt or unreadable
results file, named; an output that cannot be written), refused before any
output is written.
"""

from __future__ import annotations

import argparse

from harness.cli import argtypes

DEFAULT_ROOT = "results"
DEFAULT_OUTPUT = "history.html"
# The one-line help, as harness.cli.main.COMMANDS must repeat it.
HELP = "benchmark history as an HTML dashboard (and JSON, Markdown): steps, verdicts, changes"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``history`` command to ``sub`` (``harness.cli.main`` calls this)."""
    from harness.bench.gate import GateSettings

    h = sub.add_parser("history", help=HELP)
    h.add_argument(
        "paths", nargs="*", default=[DEFAULT_ROOT], metavar="PATH",
        help="results/<machine>/ directories, results roots or results files (default: results)",
    )  # fmt: skip
    h.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="FILE", help="the HTML dashboard to write")
    h.add_argument("--no-html", action="store_true", help="write no dashboard (only --json / --summary-md)")
    h.add_argument("--json", default=None, metavar="FILE", help="also write the history as JSON")
    h.add_argument("--summary-md", default=None, metavar="FILE", help="also write a Markdown summary")
    h.add_argument(
        "--min-step", type=argtypes.threshold, default=GateSettings().latency_threshold, metavar="PCT",
        help="smallest change of a case's median reported as a step, 5%% or 0.05; a step must also exceed "
        "the runs' recorded spread (default: the gate's latency threshold, %(default)s)",
    )  # fmt: skip
    h.add_argument("--title", default="Benchmark history", help="the dashboard's title")
    h.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Collect the history and write what was asked; every output path is checked before any work."""
    from harness.bench.history import collect, markdown_summary
    from harness.errors import HarnessError
    from harness.fileio import atomic_write_bytes, check_writable, json_bytes

    if args.no_html and args.json is None and args.summary_md is None:
        raise HarnessError("--no-html with neither --json nor --summary-md: nothing to write")
    outputs = {"--json": args.json, "--summary-md": args.summary_md}
    if not args.no_html:
        outputs["-o"] = args.output
        from harness.extras import require

        require("plotly", "history", "the history dashboard")  # missing: refused before any work
    for flag, path in outputs.items():
        if path is not None:
            check_writable(path, flag)
    history = collect(args.paths, min_step=args.min_step)
    for machine, series, step in history.steps():
        before, after = machine.runs[step.last_before], machine.runs[step.first_after]
        print(
            f"{step.kind}: {machine.id} {series.name} x{step.ratio:.3f} between {before.short_commit} "
            f"({before.date}) and {after.short_commit} ({after.date})"
        )
    cases = sum(len(m.series) for m in history.machines)
    print(f"history: {history.run_count} runs, {cases} cases on {len(history.machines)} machine(s), "
          f"{len(history.steps())} step(s)")  # fmt: skip
    if args.json is not None:
        atomic_write_bytes(args.json, json_bytes(history.to_dict()))
        print(f"json: {args.json}")
    if args.summary_md is not None:
        atomic_write_bytes(args.summary_md, markdown_summary(history).encode())
        print(f"markdown summary: {args.summary_md}")
    if not args.no_html:
        from harness.bench.dashboard import render_html

        atomic_write_bytes(args.output, render_html(history, args.title).encode())
        print(f"dashboard: {args.output}")
    return 0

