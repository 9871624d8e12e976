"""``harness compile``: print a model's precision table, or the same as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json

from harness.autocast import options


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compile", help="run the autocast compiler and print the precision report")
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:factory")
    p.add_argument("--policy", choices=("rule", "amp", "full", "fp32"), default="rule",
                   help="rule: rule-based classifier; amp: PyTorch AMP policy; full: all low; fp32: nothing lowered")
    p.add_argument("--low", default="fp16", help="low precision type: fp16 or bf16")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", metavar="FILE",
                   help="project file (default: ./harness.toml, else [tool.harness] in ./pyproject.toml)")
    options.add_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.autocast import compile
    from harness.project import load_project

    project = load_project(args.config)
    given = options.given(args)
    # validated before the model is built, so a bad flag fails fast
    project.autocast_settings(args.model, given, low_precision_type=args.low)
    # then again with the model's name: its [model."<key>"] table may use either
    spec = project.load_model(args.model)
    settings = project.autocast_settings(
        args.model, given, spec.name, example_inputs=spec.example_inputs, low_precision_type=args.low
    )
    if settings.calibration_data is None:
        settings = dataclasses.replace(settings, calibration_data=spec.calibration_data)
    compiled = compile(spec.module, spec.example_inputs, policy=args.policy, settings=settings)
    if args.json:
        print(json.dumps({"model": spec.name, **compiled.report.to_json()}, indent=2))
    else:
        print(f"model {spec.name}: {spec.description}\n")
        print(compiled.report.table())
    return 0
