"""The model zoo, installed as ``harness.zoo``: each module registers its models on import.

This folder is not importable as ``models`` from an installed harness (a user's own
``import models`` must find the user's module); the harness finds the zoo through the
``harness.models`` entry point. Model files use :mod:`harness.models`.
"""

from . import digits, lenet, mobilenet, overflow, resnet, thirdparty, transformer  # noqa: F401  (registration)
