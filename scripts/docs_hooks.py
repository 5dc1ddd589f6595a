"""The documentation site's build-time hooks (mkdocs.yml `hooks:`), and the generators of
its reference pages.

A reference page holds a marker line, `<!-- fedlb-reference: NAME -->`, which the build
replaces with what `GENERATORS[NAME]()` (scripts/docs_reference.py) writes from the code
as it is now. Nothing of it is pasted.

A link from a page to a file of the repository outside docs/ (`../server/README.md`,
`../examples/cluster_train.py`) is checked here (the file must exist) and pointed at the
site's own copy of it (`repository/...`, copied at build time), so it opens from the site
itself, wherever the site is served; a folder gets a page listing its copied files.

tests/test_docs_site.py imports this file to check the reference covers every public name
and every command without building the site.
"""

from __future__ import annotations

import logging
import posixpath
import re
import shutil
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
SITE_LIMIT = 10 * 2**20  # the built site's size, at most
PAGE_LIMIT = 40_000  # a Markdown page's size, at most (tests/test_docs_site.py)

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


REPOSITORY = "repository"  # where the site keeps its copies of the files its pages link to
COPY_LIMIT = 512 * 1024  # a file or folder copied whole, at most; larger: named by path


def repository_target(page_path: str, target: str) -> str | None:
    """The repository path (`server/server.toml`) a page's relative link leaves docs/ for,
    or None (a link inside docs/)."""
    path = target.partition("#")[0]
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), path))
    return joined[3:].rstrip("/") if joined.startswith("../") else None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def site_copy(in_repo: str) -> str | None:
    """Where the site keeps its copy of a repository file or folder (a docs-relative
    path: `repository/server/server.toml`, a folder's listing `repository/scenarios/index.md`,
    a Markdown file as `.md.txt`, shown as text); None for what it does not copy (missing,
    too large, docs/ itself, caches)."""
    file = ROOT / in_repo
    if not file.exists() or in_repo.startswith("docs") or _size(file) > COPY_LIMIT:
        return None
    if file.is_dir():
        return f"{REPOSITORY}/{in_repo}/index.md"
    return f"{REPOSITORY}/{in_repo}" + (".txt" if in_repo.endswith(".md") else "")


def _copied_files(folder: Path) -> list[Path]:
    """A folder's files the repository tracks (git ls-files), not caches or work in
    progress; without git, every file but caches."""
    import subprocess

    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", str(folder.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return sorted(ROOT / name for name in listed.split("\0") if name)


def repository_links(markdown: str, page_path: str) -> str:
    """Relative links that leave docs/ pointed at the site's own copy of their file (or
    folder), checked: a file that is not in the repository fails the build; one the site
    does not copy (docs/results' raw runs) is named by its path instead of linked."""
    here = posixpath.dirname(page_path)

    def one(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        in_repo = repository_target(page_path, target)
        if in_repo is None:
            return match.group(0)
        if not (ROOT / in_repo).exists():
            log.warning("%s: a link to %s, which is not in the repository", page_path, in_repo)
            return match.group(0)
        copy = site_copy(in_repo)
        if copy is None:
            shown = in_repo + ("/" if (ROOT / in_repo).is_dir() else "")
            return text if text.strip("`") == shown else f"{text} (`{shown}` in the repository)"
        return f"[{text}]({posixpath.relpath(copy, here or '.')})"

    return LINK.sub(one, markdown)


def repository_files(config: Any) -> list[Any]:
    """The site's copies of every repository file and folder a page links to (a folder as
    a page listing its files, each copied too), as mkdocs Files."""
    from mkdocs.structure.files import File, InclusionLevel

    wanted: set[str] = set()
    for page in DOCS.rglob("*.md"):
        page_path = str(page.relative_to(DOCS))
        text = page.read_text()
        for match in LINK.finditer(text):
            in_repo = repository_target(page_path, match.group(2))
            if in_repo is not None and site_copy(in_repo) is not None:
                wanted.add(in_repo)
    made: dict[str, Any] = {}
    for in_repo in sorted(wanted):
        path = ROOT / in_repo
        if path.is_dir():
            inside = _copied_files(path)
            folder_copy = f"{REPOSITORY}/{in_repo}"
            listing = "\n".join(
                f"- [`{p.relative_to(path)}`]"
                f"({posixpath.relpath(str(site_copy(str(p.relative_to(ROOT)))), folder_copy)})"
                for p in inside
            )
            content = (
                f"# `{in_repo}/`\n\nThe files of fedlb's repository in `{in_repo}/`, "
                f"as this site copies them:\n\n{listing}\n"
            )
            uri = f"{REPOSITORY}/{in_repo}/index.md"
            made[uri] = File.generated(
                config, uri, content=content, inclusion=InclusionLevel.NOT_IN_NAV
            )
            files = inside
        else:
            files = [path]
        for file in files:
            uri = str(site_copy(str(file.relative_to(ROOT))))
            made.setdefault(uri, File.generated(config, uri, abs_src_path=str(file)))
    return list(made.values())


# ---------------------------------------------------------------------------------------
# pages split into a folder of pages: docs/benchmarks.md keeps its introduction and a list,
# docs/benchmarks/*.md one study each. A link written to the old place of a section
# (`benchmarks.md#soak-...`, or `#soak-...` on the old page) is pointed at its page.

SPLIT = ("benchmarks", "experiments", "flower")
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*(?:\{\s*#([\w.-]+)[^}]*\})?\s*$")


def _slug(text: str) -> str:
    from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

    return str(slugify(re.sub(r"[`*]", "", text), "-"))


def moved_anchors() -> dict[tuple[str, str], str]:
    """{(old page, anchor): 'folder/page.md' or 'folder/page.md#anchor'} for every heading
    of every page of a split page's folder."""
    moved: dict[tuple[str, str], str] = {}
    for name in SPLIT:
        for page in sorted((DOCS / name).glob("*.md")):
            fence = False
            for line in page.read_text().splitlines():
                if line.lstrip().startswith("```"):
                    fence = not fence
                match = None if fence else HEADING.match(line)
                if not match:
                    continue
                anchor = match.group(3) or _slug(match.group(2))
                where = f"{name}/{page.name}"
                moved.setdefault(
                    (f"{name}.md", anchor), where if match.group(1) == "#" else f"{where}#{anchor}"
                )
    return moved


def split_links(markdown: str, page_path: str, moved: dict[tuple[str, str], str]) -> str:
    """Links to a section's old place pointed at the page it is on now."""
    here = posixpath.dirname(page_path)

    def one(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        path, hash_, anchor = target.partition("#")
        if not hash_:
            return match.group(0)
        joined = posixpath.normpath(posixpath.join(here, path)) if path else page_path
        new = moved.get((joined, anchor))
        if new is None:
            return match.group(0)
        file, _, new_anchor = new.partition("#")
        if file == page_path:
            return f"[{text}](#{new_anchor or anchor})"
        relative = posixpath.relpath(file, here or ".")
        return f"[{text}]({relative}" + (f"#{new_anchor}" if new_anchor else "") + ")"

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
    moved = moved_anchors()
    markdown = _code_spans_kept(markdown, lambda text: split_links(text, path, moved))
    return _code_spans_kept(markdown, lambda text: repository_links(text, path))


def on_files(files: Any, config: Any) -> Any:
    for file in repository_files(config):
        files.append(file)
    return files


def iter_markers(text: str) -> Iterator[str]:
    """The reference markers in a page's text."""
    return (m.group(1) for m in MARKER.finditer(text))


def on_post_build(config: Any) -> None:
    """The theme's source maps (1.3 MB, for debugging its minified scripts) left out: the
    site stays under 10 MB (tests/test_docs_site.py)."""
    site = Path(config["site_dir"])
    for path in site.rglob("*.map"):
        path.unlink()
    # the search's other languages (0.9 MB): its worker loads them only for a language
    # besides English, and this site's search is in English alone
    search = config["plugins"].get("material/search") or config["plugins"].get("search")
    theme_language = config["theme"].get("language") or "en"
    languages = list(search.config.get("lang") or [theme_language]) if search else []
    if languages == ["en"]:
        shutil.rmtree(site / "assets" / "javascripts" / "lunr", ignore_errors=True)
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    if size > SITE_LIMIT:
        log.warning(
            "the site is %.1f MB, over %d MB: results belong in docs/results, "
            "named by path, not copied into the site",
            size / 2**20,
            SITE_LIMIT // 2**20,
        )
