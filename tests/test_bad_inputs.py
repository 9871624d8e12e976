"""Every reader and every command, fed damaged, crafted and wrong inputs.

Each case runs the real ``harness`` entry point in-process and requires what
the harness promises for bad input: exit code 2, one ``error:`` line naming
the file, no traceback, the input left byte for byte as it was, and nothing
written (no output, no temporary file, no staging directory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.bench.results import content_digest
from harness.cli.main import main
from harness.fileio import canonical_json, digest

Damage = Callable[[Path], None]


def _rewrite(change: Callable[[Any], Any]) -> Damage:
    def damage(path: Path) -> None:
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return damage


def _resign_cache(doc: dict[str, Any]) -> dict[str, Any]:
    """The digest a forger would compute: the cache's content with its entries sorted by key."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    body["entries"] = sorted(body["entries"], key=lambda e: e["key"])
    return {**doc, "digest": digest(canonical_json(body))}


def _resign_results(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "digest": content_digest(doc)}


def _resign_plan(doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k not in ("fingerprint", "weights_digest")}
    return {**doc, "fingerprint": digest(canonical_json(body))}


def _nan(path: Path) -> None:
    doc = json.loads(path.read_text())
    doc["schema_version" if "schema_version" in doc else next(iter(doc))] = "__NAN__"
    path.write_text(json.dumps(doc).replace('"__NAN__"', "NaN"))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


# Damage every JSON reader must refuse.
GENERIC: dict[str, Damage] = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"\x00\x01\xff not json at all"),
    "wrong-type": lambda p: p.write_text("[1, 2, 3]"),
    "wrong-schema": lambda p: p.write_text('{"schema_version": 2, "hello": "world"}'),
    "nan": _nan,
    "huge-int": lambda p: p.write_text('{"schema_version": ' + "9" * 400 + "}"),
    "deep": lambda p: p.write_text("[" * 50_000 + "]" * 50_000),
    "directory": _directory,
    "fifo": _fifo,
}

SPECIFIC: dict[str, dict[str, Damage]] = {
    "cache": {
        "wrong-version": _rewrite(lambda d: {**d, "schema_version": 99}),
        "tampered": _rewrite(lambda d: {**d, "entries": d["entries"][:-1]}),
        "tampered-resigned": _rewrite(lambda d: _resign_cache({**d, "entries": d["entries"] + d["entries"][:1]})),
        "negative-time": _rewrite(lambda d: _resign_cache({**d, "entries": [{**d["entries"][0], "time_ms": -1.0}, *d["entries"][1:]]})),
    },
    "results": {
        "wrong-version": _rewrite(lambda d: {**d, "schema_version": 1}),
        "tampered": _rewrite(lambda d: {**d, "complete": not d["complete"]}),
        "summary-resigned": _rewrite(lambda d: _resign_results({**d, "cases": [
            {**c, "latency": {**c["latency"], "samples_ns": [s * 10 for s in c["latency"]["samples_ns"]]}}
            for c in d["cases"]]})),  # fmt: skip
        "zero-median-resigned": _rewrite(lambda d: _resign_results({**d, "cases": [
            {**c, "latency": {**c["latency"], "summary": {**c["latency"]["summary"], "median": 0}}}
            for c in d["cases"]]})),  # fmt: skip
        "machine-newline-resigned": _rewrite(lambda d: _resign_results({**d, "machine": {**d["machine"], "id": "x\n"}})),
    },
    "plan": {
        "wrong-version": _rewrite(lambda d: {**d, "version": 99}),
        "tampered": _rewrite(lambda d: {**d, "mode": "bf16"}),
        "stride-zero-resigned": _rewrite(lambda d: _resign_plan({**d, "nodes": [
            {**n, "args": n["args"][:3] + [[0, 0]] + n["args"][4:]} if n["op"] == "aten::conv2d.default" else n
            for n in d["nodes"]]})),  # fmt: skip
        "unknown-op-resigned": _rewrite(lambda d: _resign_plan({**d, "nodes": [
            {**d["nodes"][0], "op": "aten::as_strided.default"}, *d["nodes"][1:]]})),  # fmt: skip
    },
    "explicit": {"bad-regex": lambda p: p.write_text('{"(": "fp16"}'), "bad-dtype": lambda p: p.write_text('{"x": "int8"}')},
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """One valid file of every kind, made by the harness itself."""
    base = tmp_path_factory.mktemp("good")
    os.environ["HARNESS_MACHINE_ID"] = "bad-input-machine"
    try:
        assert main(["build", "--model", "lenet", "--mode", "fp32", "--cache", str(base / "cache.json"),
                     "-o", str(base / "engine"), "--option", "timing_runs=1"]) == 0  # fmt: skip
        assert main(["bench", "--quick", "--no-progress", "--no-plots", "--models", "digits", "--modes", "fp32",
                     "--cache-dir", str(base / "caches"), "-o", str(base / "run.json")]) == 0  # fmt: skip
    finally:
        del os.environ["HARNESS_MACHINE_ID"]
    (base / "explicit.json").write_text('{"^conv2d$": "fp16"}')
    return {"cache": base / "cache.json", "results": base / "run.json", "engine": base / "engine",
            "explicit": base / "explicit.json"}  # fmt: skip


# kind -> commands reading that kind of file ({bad} is the damaged file, {good.x} valid ones, {out} a fresh path)
COMMANDS: dict[str, list[list[str]]] = {
    "cache": [
        ["cache", "show", "{bad}"],
        ["cache", "diff", "{bad}", "{good.cache}"],
        ["cache", "pin", "{bad}", "--layer", "conv2d=conv_nchw[fp32]"],
        ["cache", "pin", "{good_copy.cache}", "--from", "{bad}", "-o", "{out}"],
        ["cache", "merge", "{bad}", "{good.cache}", "-o", "{out}"],
        ["cache", "verify", "{bad}", "--engine", "{good.engine}"],
        ["build", "--model", "lenet", "--mode", "fp32", "--cache", "{bad}", "-o", "{out}"],
        ["rebuild", "--model", "lenet", "--mode", "fp32", "--cache", "{bad}", "--times", "2"],
    ],
    "results": [
        ["report", "{bad}", "--no-plots"],
        ["compare", "{bad}", "{good.results}"],
        ["gate", "--baseline", "{bad}", "--current", "{good.results}"],
        ["merge", "{bad}", "-o", "{out}"],
        ["baseline", "promote", "{bad}", "--root", "{out}", "--force"],
    ],
    "plan": [["inspect", "{bad_dir}"], ["cache", "verify", "{good.cache}", "--engine", "{bad_dir}"]],
    "explicit": [["build", "--model", "lenet", "--mode", "explicit", "--explicit", "{bad}", "-o", "{out}"]],
}


def _cases() -> list[tuple[str, str, int]]:
    cases = []
    for kind, commands in COMMANDS.items():
        damages = list(SPECIFIC.get(kind, {})) + list(GENERIC)
        cases += [(kind, damage, i) for damage in damages for i in range(len(commands))]
    return cases


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if not p.is_fifo()
    }


@pytest.mark.parametrize(("kind", "damage", "command"), _cases(), ids=lambda v: str(v))
def test_bad_input_is_one_clear_error_and_changes_nothing(tmp_path, capsys, good, kind, damage, command):
    import shutil

    work = tmp_path / "work"
    work.mkdir()
    if kind == "plan":
        bad_dir = work / "engine"
        shutil.copytree(good["engine"], bad_dir)
        bad = bad_dir / "plan.json"
    else:
        bad = work / good[kind].name
        shutil.copy(good[kind], bad)
        bad_dir = work
    good_copy = tmp_path / "good_copy.json"
    shutil.copy(good["cache"], good_copy)
    (SPECIFIC.get(kind, {}).get(damage) or GENERIC[damage])(bad)
    before = _snapshot(work)
    values = {"bad": bad, "bad_dir": bad_dir, "out": work / "out", "good_copy.cache": good_copy,
              **{f"good.{k}": v for k, v in good.items()}}  # fmt: skip
    argv = [str(values[a[1:-1]]) if a.startswith("{") else a for a in COMMANDS[kind][command]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    named = bad_dir if kind == "plan" else bad
    assert str(named) in err or str(named.parent) in err, err
    assert _snapshot(work) == before, "the bad input or its directory changed"
