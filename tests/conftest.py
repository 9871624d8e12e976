"""Hypothesis profile: CI runs the same examples every time (derandomized), so a
run on a clean checkout is reproducible; locally it explores new ones.

Under xdist, each worker's intra-op threads are its share of the cores this
process may run on (``OMP_NUM_THREADS`` for the processes its tests start, and
torch's own count): workers that each start a thread per core oversubscribe
them, and OpenMP threads that spin at a barrier while another is descheduled
make every parallel op several times slower. A thread count the caller set
is kept.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402
import torch  # noqa: E402

from harness.globalstate import GlobalState  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
