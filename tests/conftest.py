"""Hypothesis profile: CI runs the same examples every time (derandomized), so a
run on a clean checkout is reproducible; locally it explores new ones."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
