"""Where a message points the user in the documentation.

:func:`doc_ref` is how harness code names a documentation page in text a user
reads (an error, a warning, a note). ``tests/test_docs_links.py`` reads every
call of it in ``harness/**`` and checks that the page exists under ``docs/``
and has that heading, so a message never sends the user to a section that is
not there. Give both arguments as string literals: the test reads them
without running the code.
"""

from __future__ import annotations

DOCS_DIR = "docs"


def doc_ref(page: str, heading: str) -> str:
    """``see docs/<page>, '<heading>'``: ``page`` relative to ``docs/``, ``heading`` a section's title."""
    return f"see {DOCS_DIR}/{page}, '{heading}'"
