"""A TensorRT build made elsewhere (``trtexec`` on a GPU runner), read from its two artifacts.

* the verbose log: ``trtexec --verbose`` (add ``--editableTimingCache`` for
  timing-cache keys and the selected tactics);
* the layer information: ``--exportLayerInfo=FILE --profilingVerbosity=detailed``
  (inspector JSON), or ONELINE ``Name: ..., LayerType: ...`` lines such as
  ``--dumpLayerInfo`` prints into the log itself.

The log's autotuned ops are joined to the engine's layers
(:mod:`harness.engines.tensorrt.join`); :meth:`TrtexecBuild.to_cache` turns the
build into the project's timing-cache JSON, so that ``harness cache diff``
compares two such builds (say the same model built on two machines).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cache.timing_cache import (
    UNKNOWN_HASH,
    CacheEntry,
    Candidate,
    Provenance,
    TimingCache,
    normalize_hash,
)
from harness.engines.tensorrt.builder import kept_tactic
from harness.engines.tensorrt.cache_bridge import BACKEND
from harness.engines.tensorrt.inspector import (
    EngineInformation,
    InspectedLayer,
    read_engine_information,
)
from harness.engines.tensorrt.join import Joined, join_ops, ops_by_layer
from harness.engines.tensorrt.log_parser import ParsedLayer, ParsedLog, parse_log
from harness.errors import HarnessError
from harness.fileio import read_text_file

# Prefix of the cache keys of ops the log gives no timing-cache key: such entries can be
# compared with `harness cache diff`, never pinned into TensorRT (not 0x + 32 hex digits).
KEYLESS_PREFIX = "op:"
# The version trtexec prints, or the one in the name of the builder resource library it loads.
_VERSIONS = (
    re.compile(r"TensorRT version: (?P<v>\d+\.\d+\.\d+)"),
    re.compile(r"libnvinfer_builder_resource(?:_sm\d+)?\.so\.(?P<v>\d+\.\d+\.\d+(?:\.\d+)?)"),
)
_DEVICE = re.compile(r"Selected Device: (?P<name>.+?)\s*$")
_CAPABILITY = re.compile(r"Compute Capability: (?P<major>\d+)\.(?P<minor>\d+)")
_RESOURCE_SM = re.compile(r"libnvinfer_builder_resource_sm(?P<sm>\d+)\.so")


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> str | None:
    for pattern in patterns:
        match = pattern.search(text)
        if match is not None:
            return match["v"]
    return None


def _device(text: str) -> str:
    """"NAME (sm_XY)" as the backend records devices; parts the log does not say are "unknown"."""
    name = _DEVICE.search(text)
    capability = _CAPABILITY.search(text)
    sm = f"{capability['major']}{capability['minor']}" if capability else None
    if sm is None:
        resource = _RESOURCE_SM.search(text)
        sm = resource["sm"] if resource else None
    return f"{name['name'] if name else 'unknown'} (sm_{sm or 'unknown'})"


def _op_json(op: ParsedLayer, how: str) -> dict[str, Any]:
    fastest = op.fastest
    return {
        "op": op.layer,
        "log_line": op.line,
        "joined_by": how,
        "key": op.key,
        "onnx_layers": list(op.onnx_layers),
        "measured": len(op.candidates),
        "fastest": None if fastest is None else _candidate_json(fastest),
        "selected": None
        if op.selected_hash is None
        else {"tactic": op.selected_name, "tactic_hash": op.selected_hash, "time_ms": op.selected_time_ms},
    }


def _candidate_json(candidate: Candidate) -> dict[str, Any]:
    return {"tactic": candidate.tactic, "tactic_hash": candidate.tactic_hash, "time_ms": candidate.time_ms}


@dataclass
class TrtexecBuild:
    log_path: Path
    layers_path: Path
    parsed: ParsedLog
    info: EngineInformation
    joined: list[Joined[ParsedLayer]]
    problems: list[str]
    backend_version: str
    device: str

    def layer_ops(self) -> list[tuple[InspectedLayer, list[tuple[ParsedLayer, str]]]]:
        """Every engine layer with the ops joined to it and how each was joined."""
        how = {id(item.op): item.how for item in self.joined}
        by_layer = ops_by_layer(self.joined)
        return [
            (layer, [(op, how[id(op)]) for op in by_layer.get(layer.name, [])])
            for layer in self.info.layers
        ]

    def unjoined(self) -> list[ParsedLayer]:
        return [item.op for item in self.joined if not item.layers]

    def to_json(self) -> dict[str, Any]:
        return {
            "log": str(self.log_path),
            "layer_information": str(self.layers_path),
            "inspector_layout": self.info.layout,
            "tensorrt_version": self.backend_version,
            "device": self.device,
            "autotuned_ops": len(self.joined),
            "unjoined_ops": [op.layer for op in self.unjoined()],
            "problems": list(self.problems),
            "layers": [
                {
                    "name": layer.name,
                    "layer_type": layer.layer_type,
                    "input_dtypes": list(layer.input_dtypes),
                    "output_dtypes": list(layer.output_dtypes),
                    "tactic": layer.tactic_name,
                    "tactic_value": layer.tactic_value,
                    "onnx_layers": list(layer.onnx_layers),
                    "ops": [_op_json(op, how) for op, how in ops],
                }
                for layer, ops in self.layer_ops()
            ],
        }

    def to_cache(self) -> tuple[TimingCache, list[str]]:
        """The build as a timing cache, and a line for each joined op left out of it.

        An op with a key and a selection is its own entry. An op without a key
        is entered under ``op:<name>`` with the kernel its engine layer runs,
        timed as the log measured that kernel. Where the hash of that kernel is
        unknown (no ``TacticValue``, as on Myelin layers and every TensorRT 11
        layer, and several measured variants share the kernel's name) the entry
        still says the kernel, with :data:`UNKNOWN_HASH` and the fastest time
        measured under that name, so ``harness cache diff`` compares it by name
        rather than missing the layer. Only an op whose kernel the log did not
        measure (or whose layer names no kernel) is left out, and named.
        """
        provenance = Provenance(
            BACKEND,
            self.backend_version,
            self.device,
            {"source": "trtexec", "log": str(self.log_path), "layer_information": str(self.layers_path)},
        )
        cache = TimingCache(provenance)
        skipped = []
        layers = {layer.name: layer for layer in self.info.layers}
        for item in self.joined:
            op = item.op
            if op.key is not None and op.selected_hash is not None:
                cache.update(op.to_entry())
                continue
            if op.key is not None or not item.layers:
                continue  # reported as a problem already (cut-off block, or unjoined)
            tactic, tactic_hash = kept_tactic(op, layers[item.layers[0]])
            measured = _measured_as(op, tactic, tactic_hash)
            if not measured:
                why = (
                    f"the log measured no candidate with its tactic ({tactic} {tactic_hash or 'hash unknown'})"
                    if tactic
                    else "its engine layer names no kernel"
                )
                skipped.append(f"op {op.layer!r} (layer {item.layers[0]!r}) is not in the cache: {why}")
                continue
            cache.update(
                CacheEntry(
                    KEYLESS_PREFIX + op.layer,
                    op.layer,
                    tactic,
                    tactic_hash or UNKNOWN_HASH,
                    min(c.time_ms for c in measured),
                    op.candidates,
                )
            )
        return cache, skipped


def _measured_as(op: ParsedLayer, tactic: str, tactic_hash: str) -> list[Candidate]:
    """The op's measured candidates that are the engine's kernel: by hash where it is known,
    else every variant of that kernel name (one of which the engine runs)."""
    if tactic_hash:
        return [c for c in op.candidates if normalize_hash(c.tactic_hash) == normalize_hash(tactic_hash)]
    return [c for c in op.candidates if tactic and c.tactic == tactic]


def read_trtexec_build(
    log_path: str | os.PathLike[str], layers_path: str | os.PathLike[str]
) -> TrtexecBuild:
    """Read and join a verbose build log and the same build's layer information."""
    log_file, layers_file = Path(log_path), Path(layers_path)
    text = read_text_file(log_file, "--trt-log")
    info = read_engine_information(read_text_file(layers_file, "--trt-layers"), f"--trt-layers {layers_file}")
    parsed = parse_log(text)
    if not parsed.layers:
        raise HarnessError(
            f"--trt-log {log_file}: no autotuned op in the log; give the log of `trtexec --verbose` "
            "(with --editableTimingCache for timing-cache keys)"
        )
    joined, join_problems = join_ops(parsed.layers, info.layers)
    return TrtexecBuild(
        log_file,
        layers_file,
        parsed,
        info,
        joined,
        [*parsed.problems, *join_problems],
        _first(_VERSIONS, text) or "unknown",
        _device(text),
    )
