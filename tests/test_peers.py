"""Peers: plain runtimes measured in the same run as the engines, stored and shown as reference rows.

The peers run a tiny MLP (fast to export, compile and time); timings are
never asserted, only what was measured, how, and how it is stored and shown.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import pytest
import torch
from torch import nn

from harness.bench import peers as peers_mod
from harness.bench.gate import GateSettings, gate
from harness.bench.peers import (
    PEER_NAMES,
    EagerPeer,
    InductorPeer,
    OnnxRuntimePeer,
    OpenVinoPeer,
    PeerCase,
    PeerModel,
    PeerRun,
    ort_session_options,
    peer_cases,
    resolve_peers,
)
from harness.bench.results import PEER_PREFIX, ResultsWriter, is_peer, load_results, sealed
from harness.bench.results_doc import read_run
from harness.bench.runner import BenchRunner, MeasureSettings
from harness.bench.tables import results_rows, results_table
from harness.cli import main as cli_main
from harness.engines.cpu import CpuBackend
from harness.errors import HarnessError
from harness.extras import install_command
from harness.models import ModelSpec
from harness.precision import precision_of, run_precisions

TINY = MeasureSettings(warmup_s=0.01, min_iters=5, min_duration_s=0.02, max_iters=50, telemetry_interval_s=0.02)


def tiny_spec(name: str = "tiny", batch: int | None = None) -> ModelSpec:
    generator = torch.Generator().manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    x = torch.randn(batch or 4, 8, generator=generator)
    return ModelSpec(name=name, description="tiny MLP", module=module, example_inputs=(x,), calibration_data=[(x,)])


_SPECS: dict[tuple[str, int | None], ModelSpec] = {}


def load_tiny(name: str, batch: int | None = None) -> ModelSpec:
    """One spec object per (name, batch), as the zoo's cache gives every case the same model."""
    if (name, batch) not in _SPECS:
        _SPECS[name, batch] = tiny_spec(name, batch)
    return _SPECS[name, batch]


def output_scale() -> float:
    """The largest magnitude of the tiny model's fp32 output: what relative tolerances scale."""
    spec = load_tiny("tiny")
    with torch.inference_mode():
        return float(spec.module(*spec.example_inputs).abs().max())


def runner(tmp_path, threads: int = 1) -> BenchRunner:
    settings = MeasureSettings(**{**TINY.to_dict(), "threads": threads})
    return BenchRunner(CpuBackend(), cache_dir=tmp_path / "caches", settings=settings, load_model=load_tiny)


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """Engine cases (fp32, autocast-bf16) and eager/ORT/OpenVINO peers of the tiny model, in one run."""
    tmp = tmp_path_factory.mktemp("peers")
    bench = runner(tmp)
    peers = resolve_peers(["eager", "onnxruntime", "openvino"])
    extra, notes = peer_cases(["tiny"], peers, run_precisions(["fp32", "autocast-bf16"]))
    writer = ResultsWriter.create(tmp / "run.json", settings={"peers": ["eager", "onnxruntime", "openvino"]})
    order: list[str] = []
    doc = bench.run(
        [("tiny", "fp32", None), ("tiny", "autocast-bf16", None)], writer, progress=False, extra=extra,
        on_case=lambda case: order.append(f"{case['backend']}/{case['mode']}"),
    )  # fmt: skip
    return doc, order, notes, tmp / "run.json"


def cases_of(doc, backend: str) -> dict[str, dict]:
    return {c["mode"]: c for c in doc["cases"] if c["backend"] == backend}


def test_peers_are_stored_as_their_own_kind_with_the_pinned_threads(peer_run):
    doc, order, notes, path = peer_run
    assert load_results(path)["cases"] == doc["cases"]  # valid against the results schema
    # peers run just before the engine cases of their model, all in one run
    assert order == ["peer:eager/fp32", "peer:eager/bf16", "peer:onnxruntime/fp32", "peer:openvino/fp32",
                     *(["peer:openvino/bf16"] if "peer:openvino/bf16" in order else []),
                     "cpu/fp32", "cpu/autocast-bf16"]  # fmt: skip
    # ONNX Runtime runs no bf16 session: left out with the reason, never a failed case
    assert any("onnxruntime at bf16 left out" in n and "fp32 fallbacks" in n for n in notes)
    for case in doc["cases"]:
        assert case["status"] == "ok", case.get("error")
        assert case["threads"] == 1
        if is_peer(case):
            peer = case["peer"]
            assert case["backend"] == PEER_PREFIX + peer["name"] and case["mode"] == peer["precision"]
            assert peer["setup_seconds"] >= 0 and peer["details"]
            assert case["engine_fingerprint"] is None and "build" not in case
        else:
            assert "peer" not in case and case["build"]["seconds"] >= 0
    assert "1 intra-op thread(s)" in cases_of(doc, "peer:onnxruntime")["fp32"]["peer"]["details"]
    assert "INFERENCE_PRECISION_HINT=f32, 1 thread(s)" in cases_of(doc, "peer:openvino")["fp32"]["peer"]["details"]


def test_peer_accuracy_is_measured_against_eager_fp32_like_the_engines(peer_run):
    doc = peer_run[0]
    scale = output_scale()
    eager = cases_of(doc, "peer:eager")
    assert eager["fp32"]["accuracy"]["identical"] and eager["fp32"]["accuracy"]["max_abs_error"] == 0
    assert 0 < eager["bf16"]["accuracy"]["max_abs_error"] < 0.05 * scale  # autocast really ran in bf16
    assert cases_of(doc, "peer:onnxruntime")["fp32"]["accuracy"]["max_abs_error"] <= 1e-5 * scale
    assert cases_of(doc, "peer:openvino")["fp32"]["accuracy"]["max_abs_error"] <= 1e-5 * scale
    # the engine's autocast-bf16 and eager autocast bf16 compare against the same reference
    assert cases_of(doc, "cpu")["autocast-bf16"]["accuracy"]["max_abs_error"] > 0


def test_tables_show_peers_as_reference_rows_relative_to_the_fastest_peer(peer_run):
    doc = peer_run[0]
    header, rows = results_rows(read_run(doc))
    column = header.index("vs best peer")
    backends = [row[header.index("backend")] for row in rows]
    assert backends[:2] == ["cpu", "cpu"] and all(b.startswith(PEER_PREFIX) for b in backends[2:])
    by_case = {(row[header.index("backend")], row[header.index("mode")]): row[column] for row in rows}
    for precision in ("fp32", "bf16"):
        peer_medians = {
            c["backend"]: c["latency"]["summary"]["median"] for c in doc["cases"] if is_peer(c) and c["mode"] == precision
        }
        fastest = min(peer_medians, key=peer_medians.__getitem__)
        assert by_case[fastest, precision] == "x1.00"
        assert all(by_case[b, precision].startswith("x") for b in peer_medians)
    assert by_case["cpu", "fp32"] and by_case["cpu", "autocast-bf16"]  # engines compared at their precision
    assert "peer:* rows are reference runtimes" in results_table(doc)
    without = {**doc, "cases": [c for c in doc["cases"] if not is_peer(c)]}
    assert "vs best peer" not in results_rows(read_run(without))[0]


def test_the_gate_skips_peer_rows_in_both_runs(peer_run):
    doc = peer_run[0]
    engines_only = sealed({**doc, "cases": [c for c in doc["cases"] if not is_peer(c)]}, "test")
    slower = copy.deepcopy(doc)
    for case in slower["cases"]:
        if is_peer(case):  # a 10x slower peer is no regression of the harness
            case["latency"]["samples_ns"] = [s * 10 for s in case["latency"]["samples_ns"]]
            case["latency"]["summary"]["median"] *= 10
    # every case counts as judged enough: the rows of a real run may be unstable under load
    settings = GateSettings(min_judged=0)
    for baseline, current in ((doc, engines_only), (engines_only, doc), (doc, slower)):
        report = gate(baseline, current, settings)
        assert report.exit_code == 0, report.summary()
        assert all(not key[2].startswith(PEER_PREFIX) for key in (v.key for v in report.cases))
        assert len(report.cases) == 2
    assert any("peer reference row(s) not gated" in n for n in gate(doc, slower).notes)


class _ThreadProbe:
    """A peer recording torch's thread count where it prepares and where it is timed."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def check_installed(self) -> None:
        pass

    def refusal(self, precision: str) -> str | None:
        return None

    def prepare(self, model: PeerModel, precision: str, threads: int) -> PeerRun:
        self.seen.add(torch.get_num_threads())
        module = model.spec.module

        def call() -> torch.Tensor:
            self.seen.add(torch.get_num_threads())
            return module(*model.inputs)

        return PeerRun(call, call, f"probe with {threads} threads")


def test_a_peer_runs_under_the_runs_pinned_threads_and_they_are_restored(tmp_path):
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 3
    probe = _ThreadProbe()
    case = PeerCase("tiny", None, probe, "fp32", peers_mod.OnnxExports())
    entry = case.run(runner(tmp_path, threads=wanted))
    assert entry["status"] == "ok" and entry["threads"] == wanted
    assert probe.seen == {wanted} and entry["peer"]["details"] == f"probe with {wanted} threads"
    assert torch.get_num_threads() == before


@pytest.mark.slow  # an inductor compile
def test_inductor_peer_compiles_once_and_reports_compile_time_apart(tmp_path):
    """torch.compile of the tiny MLP, fp32 and under bf16 autocast (seconds with inductor's cache warm)."""
    resolve_peers(["inductor"])
    bench = runner(tmp_path)
    extra, _ = peer_cases(["tiny"], [InductorPeer()], ["fp32", "bf16"])
    entries = [case.run(bench) for case in extra]
    for entry in entries:
        assert entry["status"] == "ok", entry.get("error")
        assert entry["backend"] == "peer:inductor" and entry["peer"]["setup_seconds"] > 0
        assert "torch.compile" in entry["peer"]["details"]
        # compiling is setup: no timed sample holds it
        assert max(entry["latency"]["samples_ns"]) < entry["peer"]["setup_seconds"] * 1e9
    fp32, bf16 = entries
    assert fp32["accuracy"]["max_abs_error"] <= 1e-5 * output_scale()
    assert bf16["accuracy"]["max_abs_error"] > 0 and "autocast" in bf16["peer"]["details"]


def test_an_inductor_case_leaves_the_callers_compiled_code_as_it_was(tmp_path):
    """The caller compiled a model of the class the peer compiles too (nn.Sequential, whose
    forward is one code object for every instance): after the case it runs without compiling
    again. ``torch._dynamo.reset()`` would have emptied its cache."""
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles.append(gm)
        return gm.forward

    spec = tiny_spec("mine")
    mine = torch.compile(spec.module, backend=counting, dynamic=False)
    with torch.no_grad():
        expected = mine(*spec.example_inputs)
    assert len(compiles) == 1
    extra, _ = peer_cases(["tiny"], [InductorPeer()], ["fp32"])
    assert [case.run(runner(tmp_path))["status"] for case in extra] == ["ok"]
    with torch.no_grad():
        assert torch.equal(mine(*spec.example_inputs), expected)
    assert len(compiles) == 1


def test_precisions_of_modes_decide_the_peer_precisions():
    assert [precision_of(m) for m in ("fp32", "weak-bf16", "amp-fp16", "autocast-bf16", "explicit")] == [
        "fp32", "bf16", "fp16", "bf16", None,
    ]  # fmt: skip
    assert run_precisions(["amp-fp16", "explicit", "fp32", "bf16"]) == ["fp32", "bf16", "fp16"]
    assert run_precisions(["explicit"]) == []
    assert EagerPeer().refusal("fp16") is None and OnnxRuntimePeer().refusal("bf16") is not None
    assert OpenVinoPeer().refusal("fp32") is None


def test_plain_onnxruntime_session_options_are_the_documented_ones():
    import onnxruntime as ort

    options = ort_session_options(3)
    assert options.intra_op_num_threads == 3
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_peer_cases_are_sharded_like_the_matrix():
    peers = [EagerPeer(), OnnxRuntimePeer()]
    full, _ = peer_cases(["a", "b"], peers, ["fp32", "bf16"])
    assert [(c.model, c.peer.name, c.precision) for c in full] == [
        ("a", "eager", "fp32"), ("a", "eager", "bf16"), ("a", "onnxruntime", "fp32"),
        ("b", "eager", "fp32"), ("b", "eager", "bf16"), ("b", "onnxruntime", "fp32"),
    ]  # fmt: skip
    parts = [peer_cases(["a", "b"], peers, ["fp32", "bf16"], shard=(i, 2))[0] for i in (1, 2)]
    assert sorted(c.label for part in parts for c in part) == sorted(c.label for c in full)


def test_unknown_and_repeated_peers_are_refused_naming_the_valid_ones():
    with pytest.raises(HarnessError, match=r"--peers: unknown peer\(s\) 'tvm'; valid peers: eager, inductor, onnxruntime, openvino, eager-cuda"):
        resolve_peers(["eager", "tvm"])
    with pytest.raises(HarnessError, match="named twice"):
        resolve_peers(["eager", "eager"])
    assert [p.name for p in resolve_peers(["eager", "onnxruntime"])] == ["eager", "onnxruntime"]
    assert set(PEER_NAMES) == {"eager", "inductor", "onnxruntime", "openvino", "eager-cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_eager_cuda_peer_without_a_gpu_is_refused_or_left_out_with_the_reason():
    with pytest.raises(HarnessError, match=r"--peers: peer 'eager-cuda' needs a CUDA GPU, and PyTorch sees none"):
        resolve_peers(["eager", "eager-cuda"])
    skipped: list[str] = []
    assert [p.name for p in resolve_peers(["eager", "eager-cuda"], skipped=skipped)] == ["eager"]
    assert skipped == [
        "peer eager-cuda skipped: peer 'eager-cuda' needs a CUDA GPU, and PyTorch sees none "
        "(torch.cuda.is_available() is False)"
    ]


def _without_openvino(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    monkeypatch.delitem(sys.modules, "harness.engines.openvino.runtime", raising=False)


def _without_compiler(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder

    def missing() -> str:
        raise RuntimeError("No working C compiler found in cpp_compiler_search")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)


def bench(capsys, tmp_path, *argv: object) -> tuple[int, str, str]:
    output = tmp_path / "out" / "run.json"
    code = cli_main.main(["bench", "--quick", "--no-progress", "--no-plots", "--backend", "onnxruntime",
                          "--models", "digits", "--modes", "fp32", "-o", str(output), *map(str, argv)])  # fmt: skip
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--peers", "eager,tvm"), "--peers: unknown peer(s) 'tvm'; valid peers: eager, inductor, onnxruntime, openvino, eager-cuda"),
        (("--peers", "eager,eager"), "--peers 'eager,eager': a name appears twice"),
        (("--config", "{project}"), "'tvm' is not one of ['eager', 'inductor', 'onnxruntime', 'openvino', 'eager-cuda']"),
    ],
)
def test_unknown_peers_exit_2_before_any_work(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("HARNESS_MACHINE_ID", "test-machine")
    (tmp_path / "harness.toml").write_text('peers = ["eager", "tvm"]\n')
    code, _, err = bench(capsys, tmp_path, *(str(a).format(project=tmp_path / "harness.toml") for a in argv))
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("break_it", "note"),
    [
        (_without_openvino, "note: peer openvino skipped: peer 'openvino' needs openvino, which is not installed; "
                            "it comes with the 'openvino' extra: " + install_command("openvino")),
        (_without_compiler, "note: peer inductor skipped: peer 'inductor' cannot work here"),
    ],
)
def test_a_peer_that_cannot_run_here_is_skipped_with_the_reason(monkeypatch, break_it, note):
    """The run's other cases go on; the note says which peer is missing and what installs it."""
    break_it(monkeypatch)
    skipped: list[str] = []
    peers = resolve_peers(["eager", "inductor", "openvino"], "--peers", skipped)
    assert [p.name for p in peers] == [n for n in ("eager", "inductor", "openvino") if n not in note.split()[2]]
    assert len(skipped) == 1 and f"note: {skipped[0]}".startswith(note)
    with pytest.raises(HarnessError, match=r"--peers: peer '(openvino|inductor)'"):  # without a list: refused
        resolve_peers(["eager", "inductor", "openvino"])


def test_bench_runs_the_project_files_peers_next_to_the_backend(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_MACHINE_ID", "test-machine")
    (tmp_path / "harness.toml").write_text('peers = ["eager", "onnxruntime"]\n')
    code, out, _ = bench(capsys, tmp_path, "--config", tmp_path / "harness.toml")
    assert code == 0
    doc = load_results(tmp_path / "out" / "run.json")
    assert doc["settings"]["peers"] == ["eager", "onnxruntime"]
    assert sorted((c["backend"], c["mode"]) for c in doc["cases"]) == [
        ("onnxruntime", "fp32"), ("peer:eager", "fp32"), ("peer:onnxruntime", "fp32"),
    ]
    assert "vs best peer" in out and "peer:onnxruntime" in out
    json.dumps(doc)  # stays plain JSON
