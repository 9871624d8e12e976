"""A small pass manager for FX graph passes.

A pass takes a ``GraphModule`` and returns torch's
:class:`~torch.fx.passes.infra.pass_base.PassResult`: the graph module (changed
in place or new) and ``modified``, whether the pass changed anything. The
manager runs its passes in order and, after each one, lints and recompiles the
graph, so that a broken pass is caught where it broke the graph rather than
several passes later: the graph stays valid and callable after every pass. A
pass that reports ``modified=False`` but changed the number of nodes is
refused, naming it. A pass that returns a bare ``GraphModule`` is counted as
modified, as torch's ``pass_result_wrapper`` counts it.

Every pass run logs one DEBUG line on this module's logger (a child of the
``harness`` logger, which ``harness -v`` sends to stderr)::

    lowering: remove_dropout modified=yes nodes 57 -> 55 (0.4 ms)

Graph dumps: the printed graph after chosen passes, for debugging a pass. Give
``PassManager(dump_after=...)`` (pass names, or ``"all"``) and ``dump_dir``,
or set the environment variables

- ``HARNESS_DUMP_GRAPH``: comma-separated pass names, or ``all``;
- ``HARNESS_DUMP_DIR``: the directory the dumps go to, one file per pass run
  named ``NNNN-<manager>-<pass>.txt`` (``NNNN`` counts pass runs in this
  process, so a listing sorts in run order). Without a directory each dump is
  logged at DEBUG instead, after the pass's own line.

The environment is read when a manager runs, so managers created at import
(the cast clean-up) honour it too; arguments given to a manager win over it.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.fx.passes.infra.pass_base import PassResult

from harness.errors import HarnessError
from harness.lowering.passes import registered_passes
from harness.lowering.registry import GraphPass, register_pass

__all__ = [
    "DEFAULT_PASSES",
    "DUMP_DIR_ENV",
    "DUMP_GRAPH_ENV",
    "INFERENCE_PASSES",
    "GraphPass",
    "PassManager",
    "PassResult",
    "default_pass_manager",
    "register_pass",
    "registered_passes",
    "validate",
]

logger = logging.getLogger(__name__)

DUMP_GRAPH_ENV = "HARNESS_DUMP_GRAPH"
DUMP_DIR_ENV = "HARNESS_DUMP_DIR"

_RUNS = itertools.count(1)  # numbers dump files in the order passes ran


def validate(gm: torch.fx.GraphModule | PassResult) -> torch.fx.GraphModule:
    """Lint the graph and regenerate its code; raises where the graph is broken.

    Takes a graph module or a pass's result (``validate(some_pass(gm))``) and
    returns the graph module.
    """
    if isinstance(gm, PassResult):
        gm = gm.graph_module
    if not isinstance(gm, torch.fx.GraphModule):
        raise HarnessError(f"expected a GraphModule to validate, got {type(gm).__name__}")
    gm.graph.lint()
    gm.recompile()
    return gm


def node_count(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def _env_dump_after() -> Collection[str] | Literal["all"]:
    raw = os.environ.get(DUMP_GRAPH_ENV, "").strip()
    if raw.lower() == "all":
        return "all"
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _env_dump_dir() -> Path | None:
    raw = os.environ.get(DUMP_DIR_ENV, "").strip()
    return Path(raw) if raw else None


@dataclass
class PassManager:
    """Run named passes in order, validating the graph after each.

    ``name`` prefixes the log lines and dump files (``lowering``, ``cleanup``).
    ``dump_after`` (pass names, or ``"all"``) and ``dump_dir`` choose graph
    dumps; ``None`` means "as the environment says" (see the module docstring).
    """

    passes: list[tuple[str, GraphPass]] = field(default_factory=list)
    name: str = "passes"
    dump_after: Collection[str] | Literal["all"] | None = None
    dump_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.dump_after is not None and self.dump_after != "all":
            known = {name for name, _ in self.passes}
            unknown = sorted(set(self.dump_after) - known)
            if unknown:
                raise HarnessError(
                    f"cannot dump the graph after {', '.join(map(repr, unknown))}: "
                    f"{self.name} runs only {', '.join(name for name, _ in self.passes)}"
                )

    @classmethod
    def from_names(cls, names: Iterable[str], name: str = "lowering") -> PassManager:
        available = registered_passes()
        chosen = []
        for pass_name in names:
            if pass_name not in available:
                raise HarnessError(f"unknown lowering pass {pass_name!r}; valid: {', '.join(sorted(available))}")
            chosen.append((pass_name, available[pass_name]))
        return cls(chosen, name=name)

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """The graph after every pass (see :meth:`run` for whether any changed it)."""
        result = self.run(gm)
        assert isinstance(result.graph_module, torch.fx.GraphModule)
        return result.graph_module

    def run(self, gm: torch.fx.GraphModule) -> PassResult:
        """Run every pass; ``modified`` is whether any of them changed the graph."""
        dump_after = self.dump_after if self.dump_after is not None else _env_dump_after()
        dump_dir = self.dump_dir if self.dump_dir is not None else _env_dump_dir()
        modified = False
        for pass_name, fn in self.passes:
            before = node_count(gm)
            start = time.perf_counter()
            result = fn(gm)
            if isinstance(result, torch.fx.GraphModule):
                # A pass that does not return a PassResult yet: counted as modified, as torch's
                # own pass_result_wrapper (torch.fx.passes.infra.pass_manager) counts it.
                result = PassResult(result, True)
            if not isinstance(result, PassResult) or not isinstance(result.graph_module, torch.fx.GraphModule):
                raise HarnessError(
                    f"{self.name} pass {pass_name!r} returned {type(result).__name__}, "
                    "not a PassResult holding a GraphModule"
                )
            gm = validate(result.graph_module)
            ms = (time.perf_counter() - start) * 1e3
            after = node_count(gm)
            if not result.modified and after != before:
                raise HarnessError(
                    f"{self.name} pass {pass_name!r} reported modified=False but changed the graph "
                    f"from {before} to {after} nodes"
                )
            modified = modified or bool(result.modified)
            logger.debug(
                "%s: %s modified=%s nodes %d -> %d (%.1f ms)",
                self.name,
                pass_name,
                "yes" if result.modified else "no",
                before,
                after,
                ms,
            )
            if dump_after == "all" or pass_name in dump_after:
                self._dump(gm, pass_name, dump_dir)
        return PassResult(gm, modified)

    def _dump(self, gm: torch.fx.GraphModule, pass_name: str, dump_dir: str | os.PathLike[str] | None) -> None:
        text = str(gm.graph)
        if dump_dir is None:
            logger.debug("%s: graph after %s:\n%s", self.name, pass_name, text)
            return
        directory = Path(dump_dir)
        directory.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.name}-{pass_name}")
        path = directory / f"{next(_RUNS):04d}-{safe}.txt"
        path.write_text(text, encoding="utf-8")
        logger.debug("%s: graph after %s written to %s", self.name, pass_name, path)


# functionalize_inplace runs before remove_detach: the latter drops lift_fresh_copy, after
# which a write into a fresh copy of a constant (``t = torch.tensor(...); t[0] = x``) would
# look like a write into the constant itself, which functionalization refuses.
# pin_strided_layouts runs after functionalize_inplace, which emits as_strided_scatter.
DEFAULT_PASSES = ("remove_asserts", "remove_dropout", "functionalize_inplace", "remove_detach", "pin_strided_layouts")


# Passes that change the last bits (never run in the exact modes amp / fp32).
INFERENCE_PASSES = DEFAULT_PASSES + ("fold_batch_norm",)


def default_pass_manager(exact: bool = True) -> PassManager:
    return PassManager.from_names(DEFAULT_PASSES if exact else INFERENCE_PASSES)
