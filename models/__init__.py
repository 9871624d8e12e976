"""Model zoo: built-in models register themselves on import; see :mod:`models.registry`."""

from models import digits, lenet, overflow, resnet, thirdparty, transformer  # noqa: F401  (registration)
from models.registry import ModelSpec, available, load, register

__all__ = ["ModelSpec", "available", "load", "register"]
