"""Where the harness gets its models: zoo names or a user's own file.

A model is more than an ``nn.Module``: calibration and benchmarks need example
inputs, a few calibration batches shaped like them, and (where labelled data
exist) a task metric. :class:`ModelSpec` bundles those so every stage sees the
same inputs, and :func:`load` resolves either a registered name or
``path/to/file.py:factory`` into one.

The zoo itself (the repository's ``models/`` folder, installed as
``harness.zoo``) and any other collection of models register through the
``harness.models`` entry-point group: this module never imports a zoo by
name, so the zoo depends on the harness and never the reverse.

Reproducibility is part of the contract: factories, and the module-level code
of a user's model file, run on global generators seeded with ``FACTORY_SEED``
and restored afterwards; zoo factories build their weights from a local seeded
generator (:func:`seeded_init`), and each :func:`load` hands out a private copy
of a memoized spec so a caller converting the module in place (``.half()``)
cannot change what the next caller gets.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import math
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from harness.autocast.calibrate import (
    default_calibration_data as default_calibration_data,  # re-exported for model files
)
from harness.errors import HarnessError
from harness.fileio import PATH_CHARS, shown
from harness.globalstate import preserved_global_state
from harness.modelspec import ModelSpec as ModelSpec  # where every stage takes it from

Factory = Callable[..., "ModelSpec"]


class _MetaKernelFailure(logging.Filter):
    """Drops the record torch's fake-tensor pass logs, at ERROR and with its traceback, when a
    kernel of a model fails while torch.export traces it (a shape mismatch in ``forward``).

    torch raises the same error right after, and the harness reports it as
    one line naming the model; the record reached the terminal ahead of it,
    past the export's own silencing of torch's log (which stops at WARNING).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_MetaKernelFailure())

_FACTORIES: dict[str, Factory] = {}
# Zoo models of architectures this project did not write (transformers) are named hf-<name>.
THIRD_PARTY_PREFIX = "hf-"

_EXPECTED_RETURN = "a ModelSpec or a (torch.nn.Module, tuple of example input tensors) pair"


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator adding a zero-argument factory to the zoo under ``name``.

    The returned function is the factory wrapped so that it never moves the
    caller's global RNG (module constructors draw from it even when the
    factory re-initializes every weight afterwards).
    """

    def decorator(factory: Factory) -> Factory:
        if name in _FACTORIES:
            raise HarnessError(
                f"model name {name!r} is registered twice "
                f"(already by {_FACTORIES[name].__module__}); choose another name"
            )
        isolated = _rng_isolated(factory)
        _FACTORIES[name] = isolated
        return isolated

    return decorator


def available() -> list[str]:
    """Registered model names, sorted."""
    _load_zoos()
    return sorted(_FACTORIES)


@functools.cache
def _load_zoos() -> None:
    """Import every installed zoo (entry points of group ``harness.models``); each registers its models."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="harness.models"):
        entry.load()


def load(name_or_path: str, batch_size: int | None = None) -> ModelSpec:
    """Resolve a zoo name, ``path/to/file.py:factory`` or a model file (``x.onnx``, ``x.pt2``,
    ``hf:DIR``: :func:`harness.sources.load_source`) into a private ModelSpec copy.

    With ``batch_size``, a factory that takes a ``batch_size`` argument builds
    the model for it; otherwise the inputs are resized along the declared
    ``batch_dim`` (repeating the examples), and a model that declares neither
    is refused. Inference mode is switched off while building and copying:
    specs are memoized, and tensors created under the first caller's
    ``inference_mode`` could never take part in autograd or export tracing.
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise HarnessError(f"batch size {batch_size!r}: expected a positive integer")
    from harness.sources import is_source_reference

    if is_source_reference(name_or_path):  # a model file: x.onnx, x.pt2, hf:DIR (their inputs by default)
        from harness.sources import load_source

        return load_source(name_or_path, batch_size)
    with torch.inference_mode(False):
        if ":" in name_or_path:
            path_text, _, factory_name = name_or_path.rpartition(":")
            spec = _built_from_file(*_file_key(path_text, factory_name, name_or_path), batch_size)
        elif name_or_path in available():
            spec = _built_registered(name_or_path, batch_size)
        else:
            valid = ", ".join(available()) or "(none registered)"
            raise HarnessError(
                f"unknown model {shown(name_or_path)}; valid names: {valid}; "
                "or give a user model as path/to/file.py:factory, path/model.onnx, path/model.pt2 or hf:path/to/dir"
            )
        return copy.deepcopy(spec)


def seeded_init(module: torch.nn.Module, generator: torch.Generator, gain: float = 1.0) -> None:
    """Re-draw every weight matrix/kernel (and its bias) from ``generator``.

    Weights are uniform in +-gain/sqrt(fan_in) (gain 1 is PyTorch's Linear
    default, sqrt(6) is He-uniform for ReLU stacks). Drawing from a local
    generator in module order makes the zoo bit-identical across processes
    without touching global RNG state. 1-D parameters that are not biases of
    such a weight (norm scales and shifts) keep their constructor values.
    """
    with torch.no_grad():
        for sub in module.modules():
            own = dict(sub.named_parameters(recurse=False))
            for param in own.values():
                if param.dim() >= 2:
                    param.uniform_(-_bound(param, gain), _bound(param, gain), generator=generator)
            weight, bias = own.get("weight"), own.get("bias")
            if weight is not None and bias is not None and weight.dim() >= 2:
                bias.uniform_(-_bound(weight, gain), _bound(weight, gain), generator=generator)


def _bound(weight: torch.Tensor, gain: float) -> float:
    return gain / math.sqrt(weight[0].numel())


# Every factory starts from this seed, so one that draws random weights from
# the global generators builds the same model in every process (rebuilds and
# cross-machine comparisons then compare the same model).
FACTORY_SEED = 0


@contextmanager
def _seeded_generators() -> Iterator[None]:
    """Seed torch's, Python's and NumPy's global generators with ``FACTORY_SEED``; restore them after.

    User code that draws random numbers, in a factory or while its file is
    imported, then builds the same model in every process, and the caller's
    generators (and the rest of its global state) are as they were.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]), preserved_global_state():
            torch.manual_seed(FACTORY_SEED)
            random.seed(FACTORY_SEED)
            np.random.seed(FACTORY_SEED)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _rng_isolated(factory: Factory) -> Factory:
    """Run ``factory`` on freshly seeded global generators, restoring the caller's afterwards."""

    @functools.wraps(factory)
    def wrapper(**kwargs: Any) -> ModelSpec:
        with _seeded_generators():
            return factory(**kwargs)

    return wrapper


def _takes_batch_size(factory: Callable[..., Any]) -> bool:
    return "batch_size" in inspect.signature(factory).parameters


def _for_batch(
    factory: Callable[..., Any], batch_size: int | None, build: Callable[..., ModelSpec], culprit: str
) -> ModelSpec:
    """Build with the factory's own ``batch_size`` argument, or resize along ``batch_dim``."""
    if batch_size is not None and _takes_batch_size(factory):
        return build(batch_size=batch_size)
    spec = build()
    return spec if batch_size is None else resized(spec, batch_size, culprit)


def resized(spec: ModelSpec, batch_size: int, culprit: str) -> ModelSpec:
    """``spec`` with every input repeated or cut to ``batch_size`` along its ``batch_dim``.

    The evaluation on labelled data is dropped: it feeds inputs of the
    model's own batch size, which an engine built for another one refuses.
    """
    dim = spec.batch_dim
    if dim is None:
        raise HarnessError(
            f"{culprit} has no batch dimension to sweep: declare ModelSpec.batch_dim, or give the "
            "factory a batch_size argument"
        )

    def batch(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = []
        for t in inputs:
            if not -t.dim() <= dim < t.dim() or t.shape[dim] == 0:
                raise HarnessError(f"{culprit}: an input of shape {tuple(t.shape)} has no batch_dim {dim}")
            reps = -(-batch_size // t.shape[dim])
            out.append(torch.cat([t] * reps, dim=dim).narrow(dim, 0, batch_size).contiguous())
        return tuple(out)

    return dataclasses.replace(
        spec,
        example_inputs=batch(spec.example_inputs),
        calibration_data=[batch(b) for b in spec.calibration_data],
        evaluate=None,
    )


@functools.cache
def _built_registered(name: str, batch_size: int | None = None) -> ModelSpec:
    culprit = f"model {name!r}"
    factory = _FACTORIES[name]
    return _checked(_for_batch(factory, batch_size, factory, culprit), culprit)


def _file_key(path_text: str, factory_name: str, original: str) -> tuple[str, int, str]:
    """Validate ``path:factory`` and key the build cache on the file's mtime (edits rebuild)."""
    form = f"expected path/to/file.py:factory, got {shown(original, PATH_CHARS)}"
    if not path_text or not factory_name.isidentifier():
        raise HarnessError(f"bad model reference: {form}")
    try:
        path = Path(path_text).expanduser().resolve()
        if path.suffix != ".py":
            raise HarnessError(f"model file {shown(path_text, PATH_CHARS)} is not a .py file; {form}")
        if not path.is_file():
            problem = "is not a regular file" if path.exists() else "does not exist"
            raise HarnessError(f"model file {shown(path_text, PATH_CHARS)} {problem}; {form}")
        return str(path), path.stat().st_mtime_ns, factory_name
    except OSError as exc:  # a name longer than the filesystem takes, a loop of links
        raise HarnessError(f"model file {shown(path_text, PATH_CHARS)}: {exc.strerror or exc}; {form}") from None


@functools.cache
def _built_from_file(path: str, mtime_ns: int, factory_name: str, batch_size: int | None = None) -> ModelSpec:
    del mtime_ns  # only part of the cache key
    module = _import_file(Path(path))
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        defined = sorted(
            n
            for n, obj in vars(module).items()
            if inspect.isfunction(obj)
            and obj.__module__ == module.__name__
            and not n.startswith("_")
        )
        raise HarnessError(
            f"model file {path} has no callable factory {factory_name!r}; "
            f"functions defined there: {', '.join(defined) or '(none)'}"
        )
    culprit = f"factory {factory_name!r} in {path}"

    def build(**kwargs: Any) -> ModelSpec:
        try:
            result = _rng_isolated(factory)(**kwargs)
        except HarnessError:
            raise
        except SystemExit as exc:
            raise HarnessError(f"{culprit} called sys.exit({exc.code!r}); a factory must return a model") from None
        except Exception as exc:
            raise HarnessError(f"{culprit} raised {type(exc).__name__}: {exc}") from exc
        return _checked(_as_spec(result, factory_name, culprit), culprit)

    return _checked(_for_batch(factory, batch_size, build, culprit), culprit)


def _import_file(path: Path) -> ModuleType:
    """Import a user's model file under a private module name derived from its path."""
    module_name = "harness_user_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise HarnessError(f"model file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(import_spec)
    # Registered before execution: dataclasses (and anything else resolving
    # cls.__module__) in the user's file look their module up in sys.modules.
    sys.modules[module_name] = module
    try:
        # Module-level code runs seeded too: a file drawing its weights at import time
        # (``W = torch.randn(...)``) builds the same model in every process.
        with _seeded_generators():
            import_spec.loader.exec_module(module)
    except SystemExit as exc:
        del sys.modules[module_name]
        raise HarnessError(
            f"model file {path} called sys.exit({exc.code!r}) while being imported; "
            "a model file must only define its factory (guard scripts with if __name__ == '__main__')"
        ) from None
    except Exception as exc:
        del sys.modules[module_name]
        raise HarnessError(
            f"model file {path} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _as_spec(result: object, name: str, culprit: str) -> ModelSpec:
    """Accept a ModelSpec as is, or wrap a bare (module, example_inputs) pair."""
    if isinstance(result, ModelSpec):
        return result
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], torch.nn.Module)
        and isinstance(result[1], (tuple, list))
        and all(isinstance(t, torch.Tensor) for t in result[1])
    ):
        inputs = tuple(result[1])
        return ModelSpec(
            name=name,
            description=f"user model from {culprit}",
            module=result[0],
            example_inputs=inputs,
            calibration_data=default_calibration_data(inputs),
            evaluate=None,
        )
    raise HarnessError(f"{culprit} returned {type(result).__name__}; expected {_EXPECTED_RETURN}")


def _checked(spec: ModelSpec, culprit: str) -> ModelSpec:
    """Enforce the invariants later stages rely on, and put the module in eval mode."""
    if not isinstance(spec.module, torch.nn.Module):
        raise HarnessError(
            f"{culprit}: module is {type(spec.module).__name__}; expected a torch.nn.Module"
        )
    inputs = spec.example_inputs
    if (
        not isinstance(inputs, tuple)
        or not inputs
        or not all(isinstance(t, torch.Tensor) for t in inputs)
    ):
        raise HarnessError(
            f"{culprit}: example_inputs must be a non-empty tuple of tensors, "
            f"got {type(inputs).__name__}"
        )
    if not spec.calibration_data:
        raise HarnessError(f"{culprit}: calibration_data is empty; give at least one batch")
    for i, batch in enumerate(spec.calibration_data):
        if (
            not isinstance(batch, tuple)
            or len(batch) != len(inputs)
            or any(
                not isinstance(t, torch.Tensor) or t.shape != e.shape or t.dtype != e.dtype
                for t, e in zip(batch, inputs, strict=True)
            )
        ):
            raise HarnessError(
                f"{culprit}: calibration batch {i} does not match example_inputs; "
                f"expected a tuple of {_describe(inputs)}"
            )
    spec.module.eval()
    return spec


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors)
