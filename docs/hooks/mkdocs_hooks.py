"""MkDocs hooks (``hooks:`` in mkdocs.yml): the generated pages, and the navigation they need.

- ``on_config``: the benchmark pages (one per machine with committed results)
  go into the navigation under "Benchmarks"; a page the navigation lists as
  written by someone else (:data:`OPTIONAL_PAGES`) is left out of it, with a
  note, while it does not exist yet.
- ``on_files``: the pages :mod:`docs_gen` makes from the code and the committed
  results are added to the site, as if they were files under ``docs/``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).parent))
import docs_gen  # noqa: E402  (a sibling module: MkDocs loads hooks by path)

log = logging.getLogger("mkdocs.hooks.harness")

# Pages written elsewhere, listed in the navigation and left out of it while they do not exist:
# page -> the file it is, or is made from (relative to the repository).
OPTIONAL_PAGES = {
    "numerics.md": "docs/numerics.md",
    docs_gen.CPU_ENGINE_PAGE: "harness/engines/cpu/README.md",
}

_generated: tuple[dict[str, str], dict[str, str]] | None = None


def _pages() -> tuple[dict[str, str], dict[str, str]]:
    """The generated pages, made once per build (``mkdocs serve`` rebuilds them on each change)."""
    global _generated
    if _generated is None:
        _generated = docs_gen.all_pages()
    return _generated


def _prune(nav: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            kept.append({next(iter(item)): _prune(value)})
        elif isinstance(value, str) and value in OPTIONAL_PAGES and not (docs_gen.REPO / OPTIONAL_PAGES[value]).is_file():
            log.info("%s does not exist yet: left out of the navigation", OPTIONAL_PAGES[value])
        else:
            kept.append(item)
    return kept


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    global _generated
    _generated = None
    nav = _prune(list(config.nav or []))
    machine_pages = [{m.id: m.page} for m in docs_gen.machines()]
    for item in nav:
        if isinstance(item, dict) and "Benchmarks" in item:
            item["Benchmarks"] = [*item["Benchmarks"], *machine_pages]
    config.nav = nav
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages, copied = _pages()
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    for path, source in copied.items():
        files.append(File.generated(config, path, abs_src_path=source))
    return files
