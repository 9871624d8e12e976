"""No entry point changes the caller's grad mode, autocast state, RNG or thread count.

Each test captures the whole state, calls an entry point (on success and on
failure, including failures halfway through export or a user factory), and
requires every setting back as it was, the CPU RNG included.
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from harness import models
from harness.autocast import compile, jit
from harness.bench.runner import QUICK, BenchRunner
from harness.build import build_engine
from harness.engines.cpu import CpuBackend
from harness.engines.protocol import BuildConfig
from harness.errors import HarnessError
from harness.frontend.export import export_program, load_graph
from harness.globalstate import GlobalState, preserved_global_state


@pytest.fixture()
def unchanged():
    """Fails the test if anything differs afterwards (the thread count starts off its default)."""
    original = torch.get_num_threads()
    torch.set_num_threads(3)
    before = GlobalState.capture()
    yield
    after = GlobalState.capture()
    diff = before.differences(after)
    torch.set_num_threads(original)
    assert not diff, f"changed: {diff}"


def _rand(*shape: int) -> torch.Tensor:
    """Inputs from a private generator: the test itself must not move the global RNG."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _built(cls: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng():  # module constructors draw from the global RNG
        return cls().eval()


class Rotary(nn.Module):
    @torch.no_grad()
    def forward(self, x):
        return x.sin() * 2


class WithNoGradMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) + self.rotary(x)


class Meddler(nn.Module):
    """Changes global state inside forward, then fails to export (data-dependent branch)."""

    def forward(self, x):
        torch.set_grad_enabled(False)
        torch.manual_seed(123)
        if x.sum() > 0:
            return x * 2
        return x


@pytest.mark.parametrize("mode", ["fp32", "amp", "rule", "full"])
def test_a_no_grad_method_compiles_in_every_mode(unchanged, mode):
    x = _rand(2, 4)
    module = _built(WithNoGradMethod)
    compiled = compile(module, (x,), policy=mode, low_precision_type="bf16")
    assert not any("set_grad" in str(n.target) for n in compiled.graph_module.graph.nodes)
    if mode == "fp32":
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_a_failing_compile_restores_the_state(unchanged):
    with pytest.raises(HarnessError, match="failed to export"):
        compile(Meddler(), (_rand(3),))


def test_jit_and_its_specializations_restore_the_state(unchanged):
    module = jit(_built(WithNoGradMethod), (_rand(2, 4),))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(_rand(2, 4))
        assert torch.is_autocast_enabled("cpu")  # the caller's own state inside its block


def test_other_higher_order_ops_are_refused_by_name(unchanged):
    class Branchy(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))

    with pytest.raises(HarnessError, match=r"higher-order ops .*cond \(higher_order\.cond\)"):
        compile(Branchy(), (_rand(3),))


def test_user_factory_that_meddles_is_isolated(unchanged, tmp_path):
    path = tmp_path / "meddling.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            torch.set_num_threads(1)

            def make():
                torch.set_num_threads(2)
                torch.set_grad_enabled(False)
                torch.set_autocast_enabled("cpu", True)
                torch.manual_seed(7)
                return torch.nn.Linear(2, 2), (torch.randn(1, 2),)
            """
        )
    )
    assert models.load(f"{path}:make").module.weight.shape == (2, 2)


def test_engine_builds_and_bench_cases_restore_the_state(unchanged, tmp_path):
    spec = models.load("digits")
    build_engine(spec, BuildConfig(mode="weak-bf16", options={"timing_runs": 1}), CpuBackend())
    runner = BenchRunner(CpuBackend(), cache_dir=tmp_path, settings=QUICK)
    assert runner.run_case("digits", "fp32")["status"] == "ok"
    assert runner.run_case("digits", "no-such-mode")["status"] == "failed"


class SideEffects(nn.Module):
    """A forward that reseeds the global RNG, pins the thread count and turns grad mode off.

    With ``fail`` it then branches on a value, which torch.export cannot trace:
    the side effects happen, then the export fails.
    """

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)
        torch.set_num_threads(1)
        torch.set_grad_enabled(False)
        y = self.linear(x)
        if self.fail and y.sum() > 0:
            return y * 2
        return y


def _training(module: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in module.named_modules()}


ENTRY_POINTS = {
    "jit": lambda module, inputs: jit(module, inputs),
    "export_program": export_program,
    "load_graph": load_graph,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_entry_point_whose_forward_meddles_restores_the_state(unchanged, entry):
    module = _built(SideEffects).train()
    ENTRY_POINTS[entry](module, (_rand(2, 4),))
    assert all(_training(module).values()), "the caller's training flags must survive"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_entry_point_failing_after_its_forward_meddled_restores_the_state(unchanged, entry):
    module = _built(lambda: SideEffects(fail=True))
    module.train()
    module.linear.eval()  # a mixed tree: every flag comes back as it was
    before = _training(module)
    with pytest.raises(HarnessError, match="failed to export"):
        ENTRY_POINTS[entry](module, (_rand(2, 4),))
    assert _training(module) == before


def test_export_still_traces_the_inference_graph_of_a_training_module(unchanged):
    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x) * 2

    module = _built(Dropping).train()
    x = _rand(4, 8)
    gm = load_graph(module, (x,))
    assert module.training and module.drop.training
    with torch.inference_mode():
        torch.testing.assert_close(gm(x)[0], x * 2, rtol=0, atol=0)


def _together(*fns: Callable[[], None]) -> None:
    """Run ``fns`` on threads of their own, started at once, and wait for all of them."""
    workers = [threading.Thread(target=fn) for fn in fns]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not any(worker.is_alive() for worker in workers)


def test_two_threads_inside_entry_points_at_once_give_back_the_rng_and_each_its_thread_count(unchanged):
    """Forced interleaving: A enters and draws, B enters, A leaves, B draws and leaves. Each
    call restoring what it saw would leave the RNG where A had moved it (B saw it there);
    the process's RNG comes back as it was before A, and A's thread count as A had it while
    B is still inside."""
    before = torch.random.get_rng_state()
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a() -> None:
        threads = torch.get_num_threads()
        with preserved_global_state():
            torch.set_num_threads(1)
            torch.rand(1)
            a_inside.set()
            assert b_inside.wait(30)
        seen["a threads"] = (torch.get_num_threads(), threads)
        a_left.set()

    def b() -> None:
        assert a_inside.wait(30)
        with preserved_global_state():
            b_inside.set()
            assert a_left.wait(30)
            torch.rand(1)

    _together(a, b)
    assert seen["a threads"][0] == seen["a threads"][1]
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_nested_call_leaving_while_another_thread_is_inside_does_not_rewind_that_threads_draws(
    unchanged,
):
    """A is inside two nested calls, B draws, A's inner call leaves, B draws again: B's second
    draw must be a new number (an inner call giving back what it found would rewind the RNG
    under B), and the process's RNG comes back as it was before A."""
    before = torch.random.get_rng_state()
    b_drew, a_inner_left, b_done = threading.Event(), threading.Event(), threading.Event()
    draws: list[float] = []

    def a() -> None:
        with preserved_global_state():
            with preserved_global_state():
                assert b_drew.wait(30)
            a_inner_left.set()
            assert b_done.wait(30)

    def b() -> None:
        with preserved_global_state():
            draws.append(float(torch.rand(1)))
            b_drew.set()
            assert a_inner_left.wait(30)
            draws.append(float(torch.rand(1)))
        b_done.set()

    _together(a, b)
    assert len(draws) == 2 and draws[0] != draws[1]
    assert torch.equal(torch.random.get_rng_state(), before)
