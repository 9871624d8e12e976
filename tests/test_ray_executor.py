"""``harness bench --executor ray`` on local Ray clusters started by the tests.

The cluster tests compare a Ray run with a serial run of the same matrix, kill
a worker in the middle of a case (once: retried; twice: recorded failed), and
simulate two machine kinds by two nodes whose workers carry different
``HARNESS_MACHINE_ID``. Nothing here depends on timing: the Ray run builds
with the serial run's timing caches, so both pick the same tactics.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from harness.bench.results import write_results
from harness.bench.runner import cache_file
from harness.cli import main as cli_main
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig

ray = pytest.importorskip("ray")

MATRIX = ("--models", "lenet,digits", "--modes", "fp32,fp16", "--quick", "--threads", "1", "--no-plots")


def bench(capsys, *argv: object) -> tuple[int, str, str]:
    code = cli_main.main(["bench", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def cases(path: Path) -> dict[tuple, dict]:
    doc = json.loads(path.read_text())
    assert doc["complete"] is True
    return {
        (c["model"], c["mode"], c["backend"], c["batch"], (c.get("scenario") or {}).get("label", "single-stream")): c
        for c in doc["cases"]
    }


def only_file(root: Path) -> Path:
    files = sorted(root.glob("*/*.json"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster (two CPUs) for the module's single-kind tests; the two-kinds test
    (last in the file) shuts it down and starts its own."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# --- refusals (no cluster) -----------------------------------------------------------------


def test_an_unknown_executor_is_one_error_line_naming_the_flag_and_the_extra(capsys, tmp_path):
    code, out, err = bench(capsys, "--executor", "dask", "-o", tmp_path / "run.json")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --executor 'dask': unknown executor; valid: local, ray")
    assert "'ray' extra" in err and "[ray]" in err
    assert not (tmp_path / "run.json").exists()


def test_ray_missing_is_one_error_line_naming_the_flag_and_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    code, _, err = bench(capsys, "--executor", "ray", "-o", tmp_path / "run.json")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --executor ray needs ray, which is not installed; it comes with the 'ray' extra: ")
    assert "[ray]" in err


def test_ray_address_needs_the_ray_executor(capsys, tmp_path):
    code, _, err = bench(capsys, "--ray-address", "auto", "-o", tmp_path / "run.json")
    assert code == 2 and err == "error: --ray-address auto: only with --executor ray (the cluster it connects to)\n"


def test_a_case_asks_for_its_cores_or_its_gpu_and_a_node_runs_as_many_as_fit():
    from harness.bench.ray_executor import node_capacity, task_resources

    assert task_resources("cpu", 3) == {"num_cpus": 3.0, "num_gpus": 0}
    assert task_resources("tensorrt", 3) == {"num_cpus": 1, "num_gpus": 1}
    assert node_capacity({"CPU": 8.0, "GPU": 2.0}, task_resources("cpu", 3)) == 2
    assert node_capacity({"CPU": 8.0, "GPU": 2.0}, task_resources("tensorrt", 1)) == 2
    assert node_capacity({"CPU": 8.0}, task_resources("tensorrt", 1)) == 0
    assert node_capacity({"CPU": 1.0}, task_resources("cpu", 2)) == 0


def test_a_peer_case_sent_to_a_worker_gets_onnx_exports_of_its_own():
    import pickle

    from harness.bench.peers import OnnxExports

    exports = OnnxExports()
    exports._paths[("lenet", None)] = Path("/nowhere/model-0.onnx")
    copy = pickle.loads(pickle.dumps(exports))
    assert isinstance(copy, OnnxExports) and copy._paths == {} and copy._dir.name != exports._dir.name


# --- a local cluster ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_ray_run_records_the_same_cases_as_a_serial_run(capsys, tmp_path, local_ray):
    serial = tmp_path / "serial" / "run.json"
    code, _, err = bench(capsys, *MATRIX, "--no-progress", "--cache-dir", tmp_path / "serial-caches", "-o", serial)
    assert code == 0, err
    # the Ray run starts from the serial run's caches (kept per machine kind under --cache-dir):
    # the same tactics, so the same engines, whatever the timings of this run
    serial_doc = json.loads(serial.read_text())
    machine = serial_doc["machine"]["id"]
    shutil.copytree(tmp_path / "serial-caches", tmp_path / "ray-caches" / machine)
    code, out, err = bench(
        capsys, *MATRIX, "--executor", "ray", "--cache-dir", tmp_path / "ray-caches", "-o", tmp_path / "ray" / "run.json"
    )
    assert code == 0, err
    output = tmp_path / "ray" / machine / "run.json"
    assert only_file(tmp_path / "ray") == output and f"results: {output}" in out
    # progress: done, running and queued, one line per change (stderr is no terminal here)
    progress = [line for line in err.splitlines() if line.startswith("bench (ray): ")]
    assert progress[-1] == "bench (ray): 4 of 4 cases done, 0 running, 0 queued"
    assert len(progress) == len(set(progress)) >= 3
    a, b = cases(serial), cases(output)
    assert sorted(a) == sorted(b) and len(a) == 4
    for key, case in a.items():
        other = b[key]
        assert sorted(other) == sorted(case), key
        assert sorted(other["build"]) == sorted(case["build"]), key
        assert other["status"] == case["status"] == "ok", key
        assert other["engine_fingerprint"] == case["engine_fingerprint"], key
        assert other["output_digest"] == case["output_digest"], key
        assert other["from_cache"] is True and other["build"]["cache_misses"] == 0, key
        # the entry names the driver's cache file, not the worker's temporary copy
        assert Path(other["build"]["cache_file"]).parent == tmp_path / "ray-caches" / machine, key
    doc = json.loads(output.read_text())
    assert doc["machine"]["id"] == machine and doc["settings"]["models"] == serial_doc["settings"]["models"]
    # resumable as a local run: a complete file is refused; an interrupted one (two cases kept) is
    # finished, its kept cases untouched and only the two missing ones run
    resume = (*MATRIX, "--executor", "ray", "--cache-dir", tmp_path / "ray-caches", "--resume", "-o", tmp_path / "ray" / "run.json")
    code, _, err = bench(capsys, *resume)
    assert code == 2 and "is complete; there is nothing to resume" in err
    kept = doc["cases"][:2]
    write_results(output, {**{k: v for k, v in doc.items() if k != "finished"}, "complete": False, "cases": kept})
    code, _, err = bench(capsys, *resume)
    assert code == 0, err
    assert "bench (ray): 2 of 2 cases done, 0 running, 0 queued" in err
    assert sorted(cases(output)) == sorted(b) and json.loads(output.read_text())["cases"][:2] == kept


CRASHY = """
import os
import sys
from pathlib import Path

import torch

MARKERS = Path(__file__).with_name("crashes")


class Crashy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        # in a Ray worker only (never the driver): the process dies, once per marker file left
        if sys.argv[0].endswith("default_worker.py"):
            markers = sorted(MARKERS.glob("*"))
            if markers:
                markers[0].unlink()
                os._exit(1)
        return self.fc(x)


def crashy():
    return Crashy(), (torch.ones(2, 4),)
"""


def _crashy(tmp_path: Path, crashes: int) -> str:
    (tmp_path / "crashy.py").write_text(textwrap.dedent(CRASHY))
    (tmp_path / "crashes").mkdir()
    for i in range(crashes):
        (tmp_path / "crashes" / f"{i}").touch()
    return f"{tmp_path / 'crashy.py'}:crashy"


@pytest.mark.slow  # workers on a local Ray cluster
@pytest.mark.parametrize("crashes", [1, 2])
def test_a_lost_worker_is_retried_once_then_its_case_is_recorded_failed(capsys, tmp_path, local_ray, crashes):
    model = _crashy(tmp_path, crashes)
    code, _, err = bench(
        capsys, "--models", model, "--modes", "fp32", "--quick", "--threads", "1", "--no-plots", "--no-progress",
        "--executor", "ray", "-o", tmp_path / "out" / "run.json",
    )  # fmt: skip
    assert not list((tmp_path / "crashes").iterdir())  # every planted crash happened
    assert "its worker was lost (WorkerCrashedError: " in err and "retrying once" in err
    (case,) = cases(only_file(tmp_path / "out")).values()
    if crashes == 1:
        assert code == 0, err
        assert case["status"] == "ok"
    else:
        assert code == 1
        assert case["status"] == "failed"
        assert case["error"].startswith("ray: its worker was lost twice (retried once): ")
        assert case["error"].count("WorkerCrashedError") == 2
        assert "1 of 1 cases failed: crashy/fp32" in err


@pytest.fixture(scope="module")
def two_kinds():
    """Two nodes of one CPU each whose workers carry different machine ids: two machine kinds."""
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the module's single-node cluster, if a test started it
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "env_vars": {"HARNESS_MACHINE_ID": "kind-a"}},
    )
    cluster.add_node(num_cpus=1, env_vars={"HARNESS_MACHINE_ID": "kind-b"})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_two_machine_kinds_get_one_results_file_each(capsys, tmp_path, two_kinds, monkeypatch):
    monkeypatch.setenv("HARNESS_MACHINE_ID", "the-driver")  # the driver's own identity names no file
    (tmp_path / "results").mkdir()  # -o DIR: each kind's run-<time>.json in DIR/<machine id>/
    code, out, err = bench(
        capsys, "--models", "lenet", "--modes", "fp32", "--quick", "--threads", "1", "--no-plots",
        "--executor", "ray", "--summary-md", tmp_path / "summary.md", "-o", tmp_path / "results",
    )  # fmt: skip
    assert code == 0, err
    runs = sorted((tmp_path / "results").glob("*/run-*.json"))
    assert [p.parent.name for p in runs] == ["kind-a", "kind-b"]
    assert runs[0].name == runs[1].name  # one run, named once
    for path in runs:
        doc = json.loads(path.read_text())
        assert doc["machine"]["id"] == path.parent.name
        assert [(c["model"], c["mode"], c["status"]) for c in doc["cases"]] == [("lenet", "fp32", "ok")]
        # each kind's caches beside its file: the build's new entries came back and were merged
        caches = sorted((path.parent / "caches").glob("*.json"))
        assert [c.name for c in caches] == [cache_file("", "lenet", BuildConfig("fp32", threads=1), CpuBackend()).name]
        assert json.loads(caches[0].read_text())["entries"]
        assert doc["settings"]["cache_dir"].endswith(f"{path.parent.name}/caches")
        assert f"results: {path}" in out
    assert sorted(p.name for p in tmp_path.glob("summary*.md")) == ["summary-kind-a.md", "summary-kind-b.md"]
    assert not (tmp_path / "results" / "the-driver").exists()
