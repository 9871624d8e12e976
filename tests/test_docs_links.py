"""The README's links, the documentation references in the code, and the facts the docs must keep.

- Every relative link of README.md resolves: the file exists and, for ``#anchor``,
  the heading exists (GitHub's anchors). No network: external links are not fetched.
- Every ``harness.docs_links.doc_ref(page, heading)`` call in ``harness/**``, read as
  syntax, names a page under ``docs/`` and a heading of it; no other message
  string points at the README; and every ``docs/<page>.md, "<heading>"`` a
  docstring cites exists.
- The README stays a README: at most :data:`README_MAX_LINES` lines; its extras
  table and the install page's list every extra of pyproject.toml.
- The generated reference pages list every command and flag of the real parsers,
  and every key of the project file's schema.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 250
LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<a\s[^>]*href=\"([^\"]+)\"")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)\s*\)")


def _without_code(text: str) -> str:
    """Markdown without fenced blocks and code spans, where brackets are not links."""
    text = re.sub(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(path: Path) -> list[str]:
    """The text of every heading of a Markdown page (outside fenced blocks), formatting and attributes removed."""
    text = re.sub(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    found = [m[1] for m in re.finditer(r"^\s{0,3}#{1,6}\s+(.*?)\s*$", text, flags=re.M)]
    return [re.sub(r"\s*\{[^}]*\}$", "", h).replace("`", "").strip() for h in found]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        base = github_anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = _without_code(path.read_text(encoding="utf-8"))
    found = [m[1] or m[2] for m in LINK.finditer(text)]
    return found + [m[1] for m in IMAGE.finditer(text)]


def test_every_relative_link_of_the_readme_resolves() -> None:
    readme = REPO / "README.md"
    found = links(readme)
    assert found, "the README links nothing?"
    broken = []
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not fetched
            continue
        path_part, _, anchor = target.partition("#")
        dest = (readme.parent / path_part).resolve() if path_part else readme
        if not dest.exists():
            broken.append(f"{target}: {path_part} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading\n\n[a](#a-code-heading) [b](other.md#x) `[c](nowhere.md)`\n")
    assert links(page) == ["#a-code-heading", "other.md#x"]
    assert anchors(page) == {"title", "a-code-heading"}


def test_the_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def _extras() -> set[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_extras_tables_list_every_extra(page: str) -> None:
    rows = [line for line in (REPO / page).read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w-]+)`", row.split("|")[1])}
    assert _extras() <= listed, f"{page}: extras missing from the table: {sorted(_extras() - listed)}"


def test_the_project_file_page_shows_the_example_in_full_and_the_rules() -> None:
    """The guide includes examples/team_project/harness.toml itself (snippets), never a copy that can drift."""
    page = (DOCS / "guide" / "project-file.md").read_text(encoding="utf-8")
    assert '```toml\n--8<-- "examples/team_project/harness.toml"\n```' in page
    assert (REPO / "examples" / "team_project" / "harness.toml").is_file()
    for text in ("--config", "nox -s bench -- --config", "--batch-sizes", "--data-max X|off",
                 "--keep-io-types/--no-keep-io-types", "--calibration-data FILE", "flags > file > defaults"):  # fmt: skip
        assert text in page, text


# ---------------------------------------------------------------------------------------------
# Documentation references in the code


def _python_files() -> list[Path]:
    return sorted((REPO / "harness").rglob("*.py"))


def doc_ref_calls() -> list[tuple[str, int, list[ast.expr]]]:
    """(file, line, arguments) of every ``doc_ref(...)`` call in harness/**."""
    found = []
    for path in _python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name == "doc_ref":
                    found.append((path.relative_to(REPO).as_posix(), node.lineno, list(node.args)))
    return found


def test_every_doc_ref_names_a_page_and_a_heading_that_exist() -> None:
    calls = doc_ref_calls()
    assert calls, "no doc_ref call in harness/**: has every message stopped pointing at the docs?"
    wrong = []
    for where, line, args in calls:
        literal = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if len(args) != 2 or len(literal) != 2:
            wrong.append(f"{where}:{line}: doc_ref takes two string literals (page, heading), so this test can read them")
            continue
        page, heading = literal
        path = DOCS / page
        if not path.is_file():
            wrong.append(f"{where}:{line}: docs/{page} does not exist")
        elif heading not in headings(path):
            wrong.append(f"{where}:{line}: docs/{page} has no heading {heading!r} (it has: {headings(path)})")
    assert not wrong, "\n".join(wrong)


def test_doc_ref_reads_as_the_messages_use_it() -> None:
    from harness.docs_links import doc_ref

    assert doc_ref("guide/gate.md", "Promote a baseline") == "see docs/guide/gate.md, 'Promote a baseline'"


def _strings(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, is_docstring) of every string constant of a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value, id(node) in docstrings)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_message_points_at_the_readme() -> None:
    """A message that sends the user to documentation does it through doc_ref, to a page that exists."""
    found = [
        f"{path.relative_to(REPO)}:{line}: {text.strip()[:100]!r}"
        for path in _python_files()
        for line, text, is_doc in _strings(path)
        if not is_doc and re.search(r"\bREADME\b", text)
    ]
    assert not found, "use harness.docs_links.doc_ref instead:\n" + "\n".join(found)


def test_the_sections_docstrings_cite_exist() -> None:
    """``docs/design.md, "Autocast compiler"`` in a docstring or comment names a page and heading that exist."""
    cite = re.compile(r"docs/([\w/.-]+\.md)(?:,\s*[\"'“]([^\"'”]+)[\"'”])?")
    wrong = []
    for path in _python_files():
        text = path.read_text(encoding="utf-8")
        for match in cite.finditer(text):
            page, heading = match[1], match[2]
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(REPO)}:{line}"
            if not (DOCS / page).is_file():
                wrong.append(f"{where}: docs/{page} does not exist")
            elif heading is not None:
                wanted = " ".join(re.sub(r"\n\s*(#\s*)?", " ", heading).split())
                if wanted not in headings(DOCS / page):
                    wrong.append(f"{where}: docs/{page} has no heading {wanted!r}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# The generated reference pages


def _docs_gen():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import docs_gen
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    return docs_gen


def test_the_cli_reference_lists_every_command_and_flag() -> None:
    docs_gen = _docs_gen()
    page = docs_gen.cli_reference()
    for command in docs_gen.commands():
        assert f"{{ #{command.anchor} }}" in page, command.name
        for flag in docs_gen.flags_of(command.parser):
            if flag not in ("-h", "--help"):
                assert re.search(rf"`[^`]*(?<![\w-]){re.escape(flag)}(?![\w-])[^`]*`", page), f"{command.name} {flag}"


def test_the_project_file_reference_lists_every_key() -> None:
    from harness.project import schema

    page = _docs_gen().project_file_reference()
    props = schema()["properties"]
    keys = [k for k in props if k not in ("autocast", "model", "timing", "gate")]
    keys += list(props["autocast"]["properties"]) + list(props["timing"]["properties"]) + list(props["gate"]["properties"])
    for key in keys:
        assert f"| `{key}` |" in page, key


def test_the_benchmark_guide_names_every_zoo_model() -> None:
    from harness import models

    page = (DOCS / "guide" / "benchmark.md").read_text(encoding="utf-8")
    zoo = page[page.index("## The zoo") : page.index("## Your model file")]
    missing = [name for name in models.available() if f"`{name}`" not in zoo]
    assert not missing, f"docs/guide/benchmark.md, 'The zoo', does not name {missing}"
