"""The change that makes a stock Flower PyTorch app load-balanced, applied to a copy of it:
three changed lines plus imports, as docs/flower.md shows them.

    server_app.py  strategy = FedAvg(...)           ->  LoadBalancedFedAvg(...)
      (an app whose strategy.py subclasses FedAvg: class X(FedAvg) -> X(LoadBalancedFedAvg))
    client_app.py  app = ClientApp()                ->  ClientApp(mods=[balance_mod()])
                   trainloader, _ = load_data(...)  +   trainloader = balanced_loader(msg, ...)
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from fedlb.deploy import read_toml

APPS = Path(__file__).parent
IMPORT = re.compile(r"^\s*(from \S+ )?import ")


def _replace_once(text: str, old: str, new: str, where: Path) -> str:
    count = text.count(old)
    if count != 1:
        raise AssertionError(f"{where}: expected one {old!r}, found {count}")
    return text.replace(old, new)


def adopt(name: str, destination: Path, balanced: bool = True) -> tuple[Path, list[str]]:
    """A copy of tests/apps/NAME in destination (made load-balanced unless `balanced` is
    False); (the app folder, the non-import lines the change touched)."""
    app = destination / name
    shutil.copytree(APPS / name, app, ignore=shutil.ignore_patterns("__pycache__"))
    package = next(p.parent for p in app.glob("*/server_app.py"))
    if not balanced:
        return app, []
    subclass = package / "strategy.py"
    server = subclass if subclass.exists() else package / "server_app.py"
    client = package / "client_app.py"
    before = {path: path.read_text() for path in (server, client)}
    if server is subclass:  # the app's own FedAvg subclass inherits fedlb's instead
        text = _replace_once(
            before[server],
            "from flwr.serverapp.strategy import FedAvg, Result\n",
            "from flwr.serverapp.strategy import Result\n\n"
            "from fedlb.flower import LoadBalancedFedAvg\n",
            server,
        )
        server.write_text(_replace_once(text, "(FedAvg):", "(LoadBalancedFedAvg):", server))
    else:
        text = _replace_once(
            before[server],
            "from flwr.serverapp.strategy import FedAvg\n",
            "from fedlb.flower import LoadBalancedFedAvg\n",
            server,
        )
        server.write_text(
            _replace_once(text, "strategy = FedAvg(", "strategy = LoadBalancedFedAvg(", server)
        )
    text = _replace_once(
        before[client],
        "from flwr.clientapp import ClientApp\n",
        "from flwr.clientapp import ClientApp\n\n"
        "from fedlb.flower import balance_mod, balanced_loader\n",
        client,
    )
    text = _replace_once(text, "app = ClientApp()", "app = ClientApp(mods=[balance_mod()])", client)
    loading = re.search(r"^( *)trainloader, _ = load_data\(.*\)\n", text, re.MULTILINE)
    if loading is None:
        raise AssertionError(f"{client}: no `trainloader, _ = load_data(...)` line")
    text = (
        text[: loading.end()]
        + f"{loading.group(1)}trainloader = balanced_loader(msg, trainloader)\n"
        + text[loading.end() :]
    )
    client.write_text(text)
    touched = [
        line
        for path, old in before.items()
        for line in difflib.unified_diff(old.splitlines(), path.read_text().splitlines(), n=0)
        if line[:1] in "+-"
        and not line.startswith(("+++", "---"))
        and line[1:].strip()
        and not IMPORT.match(line[1:])
    ]
    return app, touched


@contextlib.contextmanager
def imported(app: Path) -> Iterator[dict[str, ModuleType]]:
    """The app's server_app, client_app and task modules, imported from `app` (and
    forgotten afterwards: the stock and the adopted copies share their package's name)."""
    package = next(p.parent.name for p in app.glob("*/server_app.py"))
    sys.path.insert(0, str(app))
    try:
        yield {
            name: importlib.import_module(f"{package}.{name}")
            for name in ("server_app", "client_app", "task")
        }
    finally:
        sys.path.remove(str(app))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


def app_config(app: Path, **overrides: Any) -> dict[str, Any]:
    """The app's run config (its pyproject's [tool.flwr.app.config]) with `overrides`."""
    config = read_toml(app / "pyproject.toml")["tool"]["flwr"]["app"]["config"]
    return {**config, **overrides}
