"""The house rules of DESIGN.md, checked on the source: imports point down the layers
(the parts of one layer do not import each other), a part uses another only through its
face (its __init__), faces say what they export (what a user needs, no more and no less:
the old 30-name limit is withdrawn), no package holds more than a quarter of the code, and
no modules import each other round a cycle at import time."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedlb"
LAYERS = {
    "balance": 1,
    "he": 1,
    "data": 1,
    "models": 1,
    "security": 1,
    "training": 2,
    "flower": 3,
    "cluster": 3,
    "deploy": 4,
    "page": 4,
    "experiments": 5,
    "cli": 6,
}
# Modules other parts may import by name besides the faces, and why.
PUBLIC_MODULES = {
    "fedlb.flower.protocol": "the wire protocol: every key fedlb adds to Flower's messages",
    "fedlb.flower.identity": "a silo's identity (its node id) and the names derived from it",
    "fedlb.flower.verdicts": "the guard's remembered verdicts, which `fedlb verdicts` lists",
}
# fedlb/_flower_internals/ holds every private detail of Flower that fedlb relies on; its
# modules import nothing of fedlb but each other, and these layers may import its face.
INTERNALS = "fedlb._flower_internals"
INTERNALS_USERS = ("flower", "deploy", "experiments")
# flwr's modules that are not its public API (flwr.app, flwr.clientapp, flwr.serverapp,
# flwr.simulation, what flwr.common exports): reached only through INTERNALS.
FLWR_PRIVATE = (
    "flwr.supercore",
    "flwr.supernode",
    "flwr.superlink",
    "flwr.proto",
    "flwr.cli",
    "flwr.common.serde",
    "flwr.common.constant",
    "flwr.common.config",
    "flwr.common.logger",
    "flwr.clientapp.typing",
    "flwr.serverapp.strategy.strategy_utils",
)
ROOT = PACKAGE.parent


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """The fedlb modules `name` imports (relative imports resolved); with top_level_only,
    only those run at import time (not inside functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = _top_level(tree.body) if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("fedlb")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("fedlb"):
                found.add(module)
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    nodes: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            nodes += _top_level(node.body) + _top_level(getattr(node, "orelse", []))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes.append(node)
    return nodes


def part(module: str) -> str | None:
    """fedlb's part a module belongs to (None: not fedlb's, e.g. flwr.cli.utils)."""
    pieces = module.split(".")
    return pieces[1] if pieces[0] == "fedlb" and len(pieces) > 1 and pieces[1] in LAYERS else None


def test_imports_point_down_the_layers():
    wrong = []
    for name, path in modules().items():
        here = part(name)
        if here is None:
            continue
        for target in imports(name, path, top_level_only=False):
            there = part(target)
            if there is None or there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(
                    f"{name} imports {target} ({here} is layer {LAYERS[here]}, "
                    f"{there} layer {LAYERS[there]})"
                )
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    known = modules()
    graph = {
        name: {t for t in imports(name, path, top_level_only=True) if t in known and t != name}
        for name, path in known.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path, node, target]
            if target not in state and (cycle := visit(target, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]) :])


def test_parts_use_each_other_through_their_faces():
    wrong = []
    for name, path in modules().items():
        here = part(name)
        if here is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                there = part(target)
                if there is None or there == here or target in PUBLIC_MODULES:
                    continue
                if target.count(".") >= 2:  # fedlb.part.inner
                    wrong.append(f"{name} imports {target}: import it from fedlb.{there}")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_face_exports_what_it_lists(package):
    face = importlib.import_module(f"fedlb.{package}")
    exported = list(getattr(face, "__all__", []))
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert getattr(face, name) is not None, f"fedlb.{package}.{name}"


def test_no_package_holds_more_than_a_quarter_of_the_code():
    lines = {
        package: sum(len(p.read_text().splitlines()) for p in (PACKAGE / package).rglob("*.py"))
        for package in LAYERS
    }
    total = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    heavy = {p: n for p, n in lines.items() if n > total / 4}
    assert not heavy, f"{heavy} of {total} lines"


def test_a_silo_is_named_from_its_node_id_in_one_module_only():
    """The labels and the balancer's worker names are derived in fedlb/flower/identity.py;
    a label format or a node id <-> worker conversion typed elsewhere is a second copy."""
    import re

    copies = re.compile(r'f"(node|silo)-\{|str\(node\)|int\(worker\)|int\(w\)')
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "identity.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if copies.search(line)
    ]
    assert not found, "\n".join(found)


def test_a_silo_identity_survives_its_names():
    from hypothesis import given
    from hypothesis import strategies as st

    from fedlb.flower.identity import by_node, node_of, worker_name

    @given(st.dictionaries(st.integers(min_value=0, max_value=2**64 - 1), st.integers()))
    def round_trip(sizes):
        assert by_node({worker_name(n): b for n, b in sizes.items()}) == sizes
        assert all(node_of(worker_name(n)) == n for n in sizes)

    round_trip()
    with pytest.raises(ValueError, match="not a Flower node id"):
        node_of("rank-2")


def test_flowers_internals_are_reached_through_one_module():
    """No module of fedlb, its benchmarks or examples imports a private module of flwr
    (FLWR_PRIVATE) but the modules of fedlb/_flower_internals/, which import nothing of fedlb
    but each other; only the flower, deploy and experiments layers import it, through its
    face (one import path: a name patched there is the one used)."""
    wrong = []
    for path in sorted(
        p for folder in ("fedlb", "benchmarks", "examples") for p in (ROOT / folder).rglob("*.py")
    ):
        where = str(path.relative_to(ROOT))
        name = where.removesuffix(".py").replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [node.module]
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = targets = [alias.name for alias in node.names]
            else:
                continue
            inside = name.startswith(f"{INTERNALS}.")
            for target in named:
                if target.startswith(f"{INTERNALS}.") and not inside:
                    wrong.append(f"{where} imports {target}: import it from {INTERNALS}")
            for target in targets:
                private = any(target == p or target.startswith(f"{p}.") for p in FLWR_PRIVATE)
                if private and not inside:
                    wrong.append(f"{where} imports {target}: add it to {INTERNALS}")
                if inside and target.startswith("fedlb"):
                    wrong.append(f"{where} imports {target}: it depends on flwr only")
                user = part(name) if name.startswith("fedlb.") else None
                if target.startswith(INTERNALS) and user and user not in INTERNALS_USERS:
                    wrong.append(f"{where} imports {INTERNALS} (layers: {INTERNALS_USERS})")
    assert not wrong, "\n".join(sorted(set(wrong)))
