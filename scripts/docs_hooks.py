"""The documentation site's build-time hooks (mkdocs.yml `hooks:`), and the generators of
its reference pages.

A reference page holds a marker line, `<!-- fedlb-reference: NAME -->`, which the build
replaces with what `GENERATORS[NAME]()` (scripts/docs_reference.py) writes from the code
as it is now. Nothing of it is pasted.

A link from a page to a file of the repository outside docs/ (`../server/README.md`,
`../examples/cluster_train.py`) is checked here (the file must exist) and pointed at the
repository's copy of it, so it works on the site as it does when browsing the repository.

tests/test_docs_site.py imports this file to check the reference covers every public name
and every command without building the site.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's fedlb, whichever environment builds it
    sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- fedlb-reference: ([a-z0-9.-]+) -->$", re.MULTILINE)

log = logging.getLogger("mkdocs.hooks.fedlb")  # under "mkdocs": --strict counts its warnings

# the generators, beside this file (mkdocs loads hooks by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_reference import FACES as FACES  # noqa: E402 (re-exported for the tests)
from docs_reference import GENERATORS  # noqa: E402
from docs_reference import cli_commands as cli_commands  # noqa: E402
from docs_reference import settings_keys as settings_keys  # noqa: E402


def expand(markdown: str) -> str:
    """`markdown` with every reference marker replaced by what its generator writes."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name.startswith("api-"):
            name = "api:" + name[4:]
        generator = GENERATORS.get(name)
        if generator is None:
            log.warning("unknown reference marker %r", match.group(0))
            return match.group(0)
        return generator()

    return MARKER.sub(one, markdown)


# ---------------------------------------------------------------------------------------
# links to the repository's files outside docs/

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\((?!https?:|mailto:|#)([^)\s]+)\)")


def repository_links(markdown: str, page_path: str, repo_url: str, branch: str = "main") -> str:
    """Relative links that leave docs/ pointed at the repository's copy, checked."""

    def one(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        path, _, anchor = target.partition("#")
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), path))
        if not joined.startswith("../"):
            return match.group(0)  # inside docs/: mkdocs checks it
        in_repo = joined[3:]
        file = ROOT / in_repo
        if not file.exists():
            log.warning("%s: a link to %s, which is not in the repository", page_path, in_repo)
            return match.group(0)
        kind = "tree" if file.is_dir() else "blob"
        url = f"{repo_url.rstrip('/')}/{kind}/{branch}/{in_repo}" + (f"#{anchor}" if anchor else "")
        return f"[{text}]({url})"

    return LINK.sub(one, markdown)


def _code_spans_kept(markdown: str, change: Callable[[str], str]) -> str:
    """`change` applied outside fenced code blocks."""
    parts = re.split(r"(^```.*?^```[ \t]*$)", markdown, flags=re.MULTILINE | re.DOTALL)
    return "".join(p if p.startswith("```") else change(p) for p in parts)


# ---------------------------------------------------------------------------------------
# mkdocs events


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    path = page.file.src_uri
    markdown = expand(markdown)
    return _code_spans_kept(
        markdown, lambda text: repository_links(text, path, config["repo_url"] or "")
    )


def iter_markers(text: str) -> Iterator[str]:
    """The reference markers in a page's text."""
    return (m.group(1) for m in MARKER.finditer(text))
