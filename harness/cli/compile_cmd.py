"""``harness compile``: print a model's precision table, or the same as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json

from harness.errors import HarnessError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compile", help="run the autocast compiler and print the precision report")
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:factory")
    p.add_argument("--mode", choices=("rule", "amp", "full", "fp32"), default="rule",
                   help="rule: rule-based classifier; amp: PyTorch AMP policy; full: all low; fp32: nothing lowered")
    p.add_argument("--low", default="fp16", help="low precision type: fp16 or bf16")
    p.add_argument("--exclude", action="append", default=[], metavar="REGEX", help="keep nodes matching REGEX in fp32")
    p.add_argument("--exclude-op", action="append", default=[], metavar="OP", help="keep ops such as aten.conv2d in fp32")
    p.add_argument("--include", action="append", default=[], metavar="REGEX", help="force nodes matching REGEX low")
    p.add_argument("--include-op", action="append", default=[], metavar="OP", help="force ops low")
    p.add_argument("--data-max", type=float, default=512.0, help="activation absmax above which a node stays fp32 (<=0: off)")
    p.add_argument("--init-max", type=float, default=65504.0, help="weight absmax above which a node stays fp32 (<=0: off)")
    p.add_argument("--max-reduction-depth", type=int, default=None, metavar="N",
                   help="keep in fp32 every reduction that sums more than N values (conv, matmul K, sum, softmax ...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import models
    from harness.autocast import AutocastSettings, compile

    if args.max_reduction_depth is not None and args.max_reduction_depth <= 0:
        raise HarnessError(f"--max-reduction-depth must be a positive integer, got {args.max_reduction_depth}")
    settings = AutocastSettings(
        low_precision_type=args.low,
        nodes_to_exclude=args.exclude,
        targets_to_exclude=args.exclude_op,
        nodes_to_include=args.include,
        targets_to_include=args.include_op,
        data_max=args.data_max if args.data_max > 0 else None,
        init_max=args.init_max if args.init_max > 0 else None,
        max_depth_of_reduction=args.max_reduction_depth,
    )  # validated before the model is built, so a bad flag fails fast
    spec = models.load(args.model)
    settings = dataclasses.replace(settings, calibration_data=spec.calibration_data)
    compiled = compile(spec.module, spec.example_inputs, mode=args.mode, settings=settings)
    if args.json:
        print(json.dumps({"model": spec.name, **compiled.report.to_json()}, indent=2))
    else:
        print(f"model {spec.name}: {spec.description}\n")
        print(compiled.report.table())
    return 0
