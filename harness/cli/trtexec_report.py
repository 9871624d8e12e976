"""``harness inspect --trt-log LOG --trt-layers FILE``: a trtexec build's layers, joined to its log.

Per engine layer: name, type, precision, the kernel the engine uses, and each
autotuned op of the log joined to it, with the fastest tactic the log measured
for it (hash, kernel, time) and, from an editable-cache build, its timing-cache
key and selected tactic. ``--save-cache`` writes the build as a timing cache,
so that ``harness cache diff`` compares two builds (e.g. from two machines).
"""

from __future__ import annotations

import argparse
import json

from harness.engines.tensorrt.trtexec import read_trtexec_build
from harness.errors import HarnessError
from harness.fileio import check_writable


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g} ms"


def run_inspect_trtexec(args: argparse.Namespace) -> int:
    if not (args.trt_log and args.trt_layers):
        raise HarnessError("a trtexec build needs both --trt-log LOG and --trt-layers FILE")
    if args.engine is not None:
        raise HarnessError(
            f"give an engine directory ({args.engine}) or a trtexec build (--trt-log, --trt-layers), not both"
        )
    if args.save_cache:
        check_writable(args.save_cache, "--save-cache")
    build = read_trtexec_build(args.trt_log, args.trt_layers)
    skipped: list[str] = []
    if args.save_cache:
        cache, skipped = build.to_cache()
        cache.save(args.save_cache)
    if args.json:
        print(json.dumps({**build.to_json(), "left_out_of_cache": skipped}, indent=2))
        return 0
    unjoined = build.unjoined()
    print(
        f"trtexec build: TensorRT {build.backend_version} on {build.device}; {len(build.info.layers)} "
        f"layers ({build.info.layout} inspector layout), {len(build.joined)} autotuned ops, "
        + (f"{len(unjoined)} not joined to a layer" if unjoined else "all joined to layers")
    )
    for layer, ops in build.layer_ops():
        tactic = layer.tactic_name or "-"
        value = f" ({layer.tactic_value})" if layer.tactic_value else ""
        print(
            f"  {layer.name}  [{layer.layer_type}]  {','.join(layer.input_dtypes) or '-'} -> "
            f"{','.join(layer.output_dtypes) or '-'}  {tactic}{value}"
        )
        for op, how in ops:
            key = f" key {op.key}" if op.key else ""
            fastest = op.fastest
            measured = (
                f"fastest of {len(op.candidates)}: {fastest.tactic} ({fastest.tactic_hash}, {_ms(fastest.time_ms)})"
                if fastest
                else "nothing measured"
            )
            selected = (
                f"; selected {op.selected_name or op.selected_hash} ({op.selected_hash}, "
                f"{_ms(op.selected_time_ms)})"
                if op.selected_hash
                else ""
            )
            print(f"      op {op.layer!r} (by {how}){key}: {measured}{selected}")
    for line in build.problems + skipped:
        print(f"note: {line}")
    if args.save_cache:
        print(f"cache: {args.save_cache} ({len(cache)} entries)")
    return 0
