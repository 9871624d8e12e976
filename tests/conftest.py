"""Hypothesis profile: CI runs the same examples every time (derandomized), so a
run on a clean checkout is reproducible; locally it explores new ones."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402

from harness.globalstate import GlobalState  # noqa: E402


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
