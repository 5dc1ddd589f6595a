"""The documentation site, checked without building it (./scripts/docs.sh builds it, with
warnings as errors, in ./scripts/test.sh): its reference covers every public name of the
faces and every `fedlb` command, every page is in the navigation, the guides stay short,
the README stays short, and every docs/ path the repository names exists."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_PATH = r"(?<![\w/.])docs/[\w.-]+(?:/[\w.-]+)*\.(?:md|png|json|jsonl)"  # docs/he.md


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_hooks", module)
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists (its `- Title: path.md` and `- path.md` lines)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", nav, re.MULTILINE)


def page_with_marker(name: str) -> Path:
    pages = [p for p in DOCS.rglob("*.md") if name in hooks.iter_markers(p.read_text())]
    assert len(pages) == 1, f"marker {name!r} is on {len(pages)} pages, not one"
    return pages[0]


@pytest.mark.parametrize("face", hooks.FACES)
def test_the_api_reference_renders_every_public_name_of_each_face(face):
    page = page_with_marker(f"api-{face}")
    assert str(page.relative_to(DOCS)) in nav_pages()
    rendered = hooks.expand(page.read_text())
    module = importlib.import_module(face)
    assert module.__all__, face
    for name in module.__all__:
        shown = f"::: {face}.{name}\n" in rendered or f"{{ #{face}.{name} }}" in rendered
        assert shown, f"{face}.{name} is not in {page}"


def test_every_public_package_has_a_reference_page():
    packages = {
        f"fedlb.{p.parent.name}"
        for p in (ROOT / "fedlb").glob("*/__init__.py")
        if not p.parent.name.startswith("_") and p.parent.name not in {"cli", "experiments"}
    }
    assert packages <= set(hooks.FACES)


@pytest.mark.parametrize("face", hooks.FACES)
def test_every_group_of_a_face_has_a_title(face):
    from docs_reference import GROUP_TITLES, groups

    titles = [title for title, _, _ in groups(face)]
    assert set(titles) <= set(GROUP_TITLES[face].values())
    assert len(set(titles)) == len(titles)


def test_every_docstring_section_parses():
    """The reference reads docstrings as Google style: an `Args:` block that does not
    parse (an entry naming two parameters, `a, b: ...`) renders as one run-on paragraph."""
    griffe = pytest.importorskip("griffe")
    warned: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    handler = Collect()
    logging.getLogger("griffe").addHandler(handler)
    try:
        package = griffe.load("fedlb", search_paths=[str(ROOT)], docstring_parser="google")
        unparsed: list[str] = []

        def walk(obj: Any) -> None:
            for member in obj.members.values():
                if member.is_alias:
                    continue
                if member.docstring is not None:
                    for section in member.docstring.parsed:
                        text = section.value if section.kind.value == "text" else ""
                        if re.search(r"^\s*(Args|Returns|Raises|Yields|Example):\s*$", text, re.M):
                            unparsed.append(member.path)
                if member.is_module or member.is_class:
                    walk(member)

        walk(package)
    finally:
        logging.getLogger("griffe").removeHandler(handler)
    assert unparsed == []
    assert [w for w in warned if "does not appear in the function signature" in w] == []


def test_the_environment_page_names_every_variable():
    from docs_reference import ENVIRONMENT, environment_names

    assert environment_names() <= set(ENVIRONMENT)
    rendered = hooks.expand(page_with_marker("environment").read_text())
    for name in environment_names():
        assert f"`{name}`" in rendered


def test_the_cli_reference_has_every_command_and_option():
    page = page_with_marker("cli")
    assert str(page.relative_to(DOCS)) in nav_pages()
    rendered = hooks.expand(page.read_text())
    commands = hooks.cli_commands()
    assert {"fedlb server", "fedlb silo", "fedlb demo", "fedlb experiment"} <= set(commands)
    for path, command in commands.items():
        if path != "fedlb":
            assert re.search(rf"^## {re.escape(path)} \{{", rendered, re.MULTILINE), path
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert f"`{opt}`" in rendered, f"{path} {opt}"


def test_the_settings_reference_has_every_key():
    page = page_with_marker("config")
    assert str(page.relative_to(DOCS)) in nav_pages()
    rendered = hooks.expand(page.read_text())
    for cls, keys in hooks.settings_keys().items():
        for key in keys:
            assert f"| `{key}` |" in rendered, f"{cls}: {key}"


def test_the_run_files_reference_has_every_file_and_field():
    from fedlb.flower import RUN_FILES, RoundRecord
    from fedlb.flower.records import SiloRound

    page = page_with_marker("run-files")
    assert str(page.relative_to(DOCS)) in nav_pages()
    rendered = hooks.expand(page.read_text())
    for field in dataclasses.fields(RUN_FILES):
        assert f"`{getattr(RUN_FILES, field.name)}`" in rendered
    for cls in (RoundRecord, SiloRound):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}`" in rendered, f"{cls.__name__}.{field.name}"


def test_every_page_is_in_the_navigation():
    """mkdocs --strict refuses a page missing from the nav; said here without a build."""
    listed = set(nav_pages())
    pages = {
        str(p.relative_to(DOCS))
        for p in DOCS.rglob("*.md")
        if not (p.parts[len(DOCS.parts)] == "results" and p.name != "index.md")
    }
    assert pages - listed == set()
    assert listed - pages == set(), "the nav lists pages that do not exist"


def test_the_guides_are_short():
    """A how-to guide is one task, read in a few minutes; measurements go to Results."""
    for page in sorted((DOCS / "how-to").glob("*.md")):
        lines = page.read_text().count("\n")
        assert lines <= 160, f"{page.name}: {lines} lines"


def test_the_readme_is_short_and_links_into_the_docs():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 150
    for target in re.findall(r"\]\((docs/[^)#\s]+)", text):
        assert (ROOT / target).exists(), target


def test_every_docs_path_the_repository_names_exists():
    """Code, tests, benchmarks, scripts and operator material name doc files by path
    (`docs/flower.md`, `docs/results/gpu/...`): each must be there."""
    named: set[str] = set()
    for folder in ("fedlb", "tests", "benchmarks", "scripts", "server", "silos", "scenarios"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".md", ".toml", ".sh"} or "apps" in path.parts:
                continue
            text = path.read_text(errors="replace")
            named.update(re.findall(DOC_PATH, text))
    assert named, "no docs/ path found: the pattern is wrong"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def test_no_page_is_over_40_kb():
    """A page is one topic: results one page per study, history in the release notes."""
    big = {
        str(p.relative_to(DOCS)): p.stat().st_size
        for p in DOCS.rglob("*.md")
        if p.stat().st_size > hooks.PAGE_LIMIT
    }
    assert big == {}


def test_a_link_to_a_moved_section_finds_its_page():
    moved = hooks.moved_anchors()
    assert moved, "no split pages found"
    for (old, anchor), new in moved.items():
        file = new.partition("#")[0]
        assert (DOCS / file).exists(), (old, anchor, new)
    link = "[x](../flower.md#when-things-go-wrong)"
    assert hooks.split_links(link, "how-to/faults.md", moved) == link  # kept in place
    target = next(k for k, v in moved.items() if k[0] == "benchmarks.md" and "#" not in v)
    out = hooks.split_links(f"[x](../benchmarks.md#{target[1]})", "how-to/x.md", moved)
    assert out == f"[x](../{moved[target]})"


def test_the_tutorial_starts_from_flwr_new():
    text = (DOCS / "getting-started" / "tutorial.md").read_text()
    assert "getting-started/tutorial.md" in nav_pages()
    assert text.index("flwr new") < text.index("LoadBalancedFedAvg")
    for step in (
        "balance_mod()",
        "balanced_loader(msg, trainloader)",
        "flwr run .",
        "--stream",
        "num-supernodes=3",
        "fedlb server --app",
        "fedlb silo --app",
    ):
        assert step in text, step


def test_the_run_files_reference_says_every_file_of_a_run_folder():
    rendered = hooks.expand(page_with_marker("run-files").read_text())
    for name in ("server.json", "processes/", "model.pt.sha256", ".fedlb.lock", "app.json"):
        assert f"`{name}`" in rendered, name
    for key in ("steady_balance_efficiency", "stability", "final_sizes", "settings"):
        assert re.search(rf"^\| `{key}` \| [^|]+ \| \S", rendered, re.M), key


def test_a_link_to_a_repository_file_opens_the_sites_own_copy():
    """No address of the repository is assumed: the site copies the files it links to."""
    link = hooks.repository_links("[toml](../../server/server.toml)", "how-to/deploy.md")
    assert link == "[toml](../repository/server/server.toml)"
    assert (ROOT / "server" / "server.toml").exists()
    folder = hooks.repository_links("[s](../../scenarios/)", "how-to/compare-policies.md")
    assert folder == "[s](../repository/scenarios/index.md)"
    raw = hooks.repository_links("[r](../../docs/results/)", "results/index.md")
    assert "](" not in raw  # 35 MB: named, not copied
    assert "docs/results/" in raw
    assert "github.com" not in (ROOT / "mkdocs.yml").read_text()
