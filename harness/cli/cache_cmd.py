"""``harness cache``: show, diff, pin, merge and verify timing caches.

Exit codes: 0 success (``diff`` also exits 0 when caches differ: a difference
is information, not a failure), 1 when ``verify`` finds the engine disagreeing
with the cache, 2 on bad input. Every command loads and validates all inputs
before writing anything, and writes atomically, so a corrupt cache is never
overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any

from tabulate import tabulate

from harness.cache.operations import diff, merge, pin, pin_from, verify
from harness.cache.timing_cache import TimingCache
from harness.errors import HarnessError
from harness.fileio import check_writable, locked


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cache", help="inspect and edit timing caches (JSON)")
    sub = parser.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    show = sub.add_parser("show", help="list a cache's provenance and per-layer tactics")
    show.add_argument("file")
    show.add_argument("--json", action="store_true", help="print the validated cache as JSON")
    show.set_defaults(func=_show)

    d = sub.add_parser("diff", help="compare two caches layer by layer (exit 0 either way)")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_diff)

    p = sub.add_parser("pin", help="fix tactics: per layer, or copied from another cache")
    p.add_argument("file")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--layer",
        action="append",
        metavar="NAME=TACTIC",
        help="layer name (or key) and a candidate's tactic name or hash; repeatable",
    )
    how.add_argument(
        "--from", dest="source", metavar="OTHER", help="copy OTHER's selections for shared keys"
    )
    p.add_argument("-o", "--output", help="write here instead of replacing FILE")
    p.add_argument(
        "--ignore-mismatch",
        action="store_true",
        help="with --from: accept a cache recorded for a different configuration",
    )
    p.set_defaults(func=_pin)

    m = sub.add_parser("merge", help="A plus B's keys that A lacks (A wins conflicts)")
    m.add_argument("a")
    m.add_argument("b")
    m.add_argument("-o", "--output", required=True, help="the merged cache file to write")
    m.add_argument(
        "--ignore-mismatch", action="store_true", help="accept caches from different configurations"
    )
    m.set_defaults(func=_merge)

    v = sub.add_parser(
        "verify", help="check that an engine uses the cache's tactics (exit 1 if not)"
    )
    v.add_argument("file")
    v.add_argument("--engine", required=True, help="engine directory or its plan.json")
    v.set_defaults(func=_verify)


def _fmt_time(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _show(args: argparse.Namespace) -> int:
    cache = TimingCache.load(args.file)
    if args.json:
        print(json.dumps(cache.to_json(), indent=2))
        return 0
    prov = cache.provenance
    print(f"{args.file}: {len(cache)} entries, {cache.digest()}")
    print(f"backend: {prov.backend} {prov.backend_version}  device: {prov.device}")
    for name, value in sorted(prov.builder_options.items()):
        print(f"builder option {name}: {value}")
    for name, value in sorted(prov.device_details.items()):
        print(f"device detail {name}: {value}")
    rows = [
        [
            e.layer,
            e.key,
            e.tactic,
            e.tactic_hash,
            _fmt_time(e.time_ms),
            len(e.candidates),
            "yes" if e.pinned else "",
        ]
        for e in cache.entries()
    ]
    print(tabulate(rows, headers=["layer", "key", "tactic", "hash", "ms", "candidates", "pinned"]))
    return 0


def _diff(args: argparse.Namespace) -> int:
    a = TimingCache.load(args.a)
    b = TimingCache.load(args.b)
    rows = diff(a, b)
    provenance = a.provenance.mismatches(b.provenance)
    details = a.provenance.detail_differences(b.provenance)
    if args.json:
        print(
            json.dumps(
                {
                    "provenance": provenance,
                    "device_details": details,
                    "layers": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
        return 0
    for line in provenance + details:
        print(f"provenance {line}")
    table = [
        [
            r.layer,
            r.key,
            r.status,
            r.tactic_a or "-",
            _fmt_time(r.time_ms_a),
            r.tactic_b or "-",
            _fmt_time(r.time_ms_b),
        ]
        for r in rows
    ]
    print(
        tabulate(table, headers=["layer", "key", "status", "tactic A", "ms A", "tactic B", "ms B"])
    )
    counts = {s: sum(r.status == s for r in rows) for s in ("same", "changed", "only-a", "only-b")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0


def _parse_layer_spec(spec: str) -> tuple[str, str]:
    # Layer names may contain "=" (TensorRT names are free text); tactic names
    # and hashes never do, so split on the last one.
    layer, sep, tactic = spec.rpartition("=")
    if not sep or not layer or not tactic:
        raise HarnessError(f"--layer expects NAME=TACTIC, got {spec!r}")
    return layer, tactic


def _pin(args: argparse.Namespace) -> int:
    out = check_writable(args.output or args.file, "-o" if args.output else "timing cache")
    specs = [_parse_layer_spec(s) for s in args.layer] if args.source is None else []
    # Read, change and write back under the file's lock: two pins at once both stay.
    with locked(out):
        cache = TimingCache.load(args.file)
        if args.source is not None:
            other = TimingCache.load(args.source)
            source = f"timing cache {args.source} (pinned into {args.file})"
            layers = pin_from(cache, other, args.ignore_mismatch, source)
            if not layers:
                raise HarnessError(f"{args.source} shares no key with {args.file}; nothing to pin")
            summary = layers
        else:
            try:
                pinned = [pin(cache, n, t) for n, t in specs]
            except HarnessError as exc:
                raise HarnessError(f"timing cache {args.file}: {exc}") from None
            summary = [f"{e.layer}: {e.tactic} ({e.tactic_hash})" for e in pinned]
        cache.save(out)
    print(f"pinned {len(summary)} entr{'y' if len(summary) == 1 else 'ies'} -> {out}")
    for line in summary:
        print(f"  {line}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    output = check_writable(args.output, "-o")
    # The inputs are read under the output's lock: `-o` may name an input (merging
    # into A), or a cache other commands change at the same time (`cache pin A`,
    # another merge into it); reading first and locking only the write would drop
    # whatever they wrote in between.
    with locked(output):
        a = TimingCache.load(args.a)
        b = TimingCache.load(args.b)
        merged = merge(a, b, args.ignore_mismatch, f"timing cache {args.b} (merged into {args.a})")
        conflicts = sum(r.status == "changed" for r in diff(a, b))
        merged.save(output)
    print(
        f"merged {len(a)} entries from {args.a} and {len(merged) - len(a)} from {args.b} "
        f"-> {args.output} ({conflicts} conflicting keys kept from {args.a})"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    cache = TimingCache.load(args.file)
    backend, layers = load_engine_layers(args.engine, cache)
    if backend != cache.provenance.backend:
        raise HarnessError(
            f"engine {args.engine} was built by backend {backend}, but {args.file} records "
            f"backend {cache.provenance.backend}'s tactics; verify it against a cache recorded by backend {backend}"
        )
    problems = verify(cache, layers)
    if problems:
        print(
            f"engine {args.engine} disagrees with {args.file} on {len(problems)} of {len(layers)} layers:"
        )
        for line in problems:
            print(f"  {line}")
        return 1
    print(f"engine {args.engine} agrees with {args.file} ({len(layers)} layers checked)")
    return 0


def load_engine_layers(
    path: str | os.PathLike[str], cache: TimingCache | None = None
) -> tuple[str, list[tuple[str, str, str]]]:
    """The backend of a saved engine and (layer, key, tactic) for every autotuned layer of it.

    With ``cache``, an engine compiled under other autocast settings than the
    cache was recorded for is refused, naming the settings: its layers are
    other layers, and comparing their tactics with the cache's says nothing.

    ``path`` is an engine directory or its ``plan.json``. The engine is loaded
    by the backend that saved it, which verifies the plan's fingerprint and
    its weights or model: a damaged or edited engine is an error, never
    silently verified. Layers without a key (nothing was timed for them) are
    skipped; an engine with no keyed layer at all cannot be verified.
    """
    from harness.engines.protocol import check_engine_settings
    from harness.engines.registry import get_backend
    from harness.engines.saved import plan_backend

    directory, backend = plan_backend(path)
    engine = get_backend(backend).load(directory)
    if cache is not None and cache.provenance.backend == backend and "autocast" in cache.provenance.builder_options:
        check_engine_settings(engine, cache.provenance.builder_options["autocast"], f"engine {directory}")
    layers = [(layer.name, layer.key, layer.tactic) for layer in engine.layers() if layer.key]
    if not layers:
        raise HarnessError(
            f"engine {directory}: no layer records a cache key and tactic, so there is nothing to "
            "verify (was the engine built with tactic selection?)"
        )
    return backend, layers
