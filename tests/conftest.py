"""Hypothesis profile: CI runs the same examples every time (derandomized), so a
run on a clean checkout is reproducible; locally it explores new ones."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402
import torch  # noqa: E402

from harness.globalstate import GlobalState  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with TorchDynamo's caches empty.

    torch.export keeps the frames it traced, with their guards, in Dynamo's caches (shared code
    such as ``nn.Module.__call__`` gathers an entry per module traced); each later export checks
    them again, so a worker's exports grew slower test after test (the shifted-window
    re-creation's 10 draws: 3.5 s alone, 43 s late in a full run).
    """
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _global_state_untouched():
    """No test, and so no entry point it calls, may leave grad mode, autocast or threads changed.

    The RNG is left out here because tests draw their own random inputs;
    tests/test_global_state.py holds every entry point to the RNG as well.
    """
    before = GlobalState.capture()
    yield
    after = GlobalState.capture()
    changed = [name for name in before.differences(after) if name != "cpu_rng"]
    before.restore()
    assert not changed, f"the test left global state changed: {', '.join(changed)}"
