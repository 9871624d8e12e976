"""The GPU smoke check (``nox -s gpu``): its steps, run for real on the CPU engine, and its refusal
to report anything where there is no GPU."""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import smoke


@pytest.fixture(scope="module")
def cpu_smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("smoke")
    checks = smoke.Smoke("cpu", work)
    for mode in checks.modes():
        checks.run(f"build {mode}", lambda mode=mode: checks.built(mode))
        checks.run(f"rebuild {mode}", lambda mode=mode: checks.rebuilt(mode))
    checks.run("repin", checks.repinned)
    checks.run("bench", checks.benched)
    return checks


def test_every_step_passes_on_an_engine_that_keeps_its_pins(cpu_smoke):
    verdicts = {c.name: c.verdict for c in cpu_smoke.checks}
    assert [m for m in ("fp32", "fp16", "bf16", "weak-fp16") if f"build {m}" in verdicts] == cpu_smoke.modes()
    assert set(verdicts.values()) == {"pass"}, [c for c in cpu_smoke.checks if c.verdict != "pass"]
    repin = next(c for c in cpu_smoke.checks if c.name == "repin")
    assert " -> " in repin.detail
    bench = next(c for c in cpu_smoke.checks if c.name == "bench")
    assert bench.detail.startswith("2 cases with telemetry; gate ")
    assert (cpu_smoke.work / "results").is_dir() and list((cpu_smoke.work / "results").glob("*/baseline.json"))


def test_a_pin_that_does_not_move_the_kernel_fails_the_check(cpu_smoke, monkeypatch):
    """The same step with a 'pin' that leaves the cache as it was: the layer runs its old kernel."""
    real = smoke.harness

    def unpinned(*argv: str) -> str:
        if argv[:2] == ("cache", "pin"):
            shutil.copy(argv[2], argv[-1])
            return ""
        return real(*argv)

    monkeypatch.setattr(smoke, "harness", unpinned)
    with pytest.raises(smoke.SmokeError, match=r"pinned to .* runs "):
        cpu_smoke.repinned()


def test_a_rebuild_whose_fingerprint_moved_fails_the_check(cpu_smoke, monkeypatch):
    prints = iter(["sha256:aaa", "sha256:bbb"])
    monkeypatch.setattr(cpu_smoke, "fingerprint", lambda engine_dir: next(prints))
    with pytest.raises(smoke.SmokeError, match="the pinned rebuild's fingerprint sha256:bbb is not the first build's sha256:aaa"):
        cpu_smoke.rebuilt("fp32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so_exits_2_and_reports_no_check(capsys):
    assert smoke.main(["--no-pytest"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "gpu smoke: not run: no CUDA GPU: torch.cuda.is_available() is False (a CPU build of PyTorch, or no "
        "GPU or driver); nothing was checked\n"
    )


def test_the_table_lists_each_check_with_its_verdict():
    text = smoke.table([smoke.Check("build fp16", "pass", "3 entries", 1.25), smoke.Check("pin", "unverifiable", "why", 0.5)])
    lines = text.splitlines()
    assert lines[0].split() == ["check", "verdict", "s", "detail"]
    assert lines[2].split()[:3] == ["build", "fp16", "pass"] and "1.2" in lines[2] and lines[3].split()[1] == "unverifiable"
