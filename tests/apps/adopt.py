"""The change that makes a stock Flower PyTorch app load-balanced, applied to a copy of it:
three changed lines plus imports, as docs/how-to/flower-app.md shows them.

    server_app.py  strategy = FedAvg(...)           ->  LoadBalancedFedAvg(...)
      (an app whose strategy.py subclasses FedAvg: class X(FedAvg) -> X(LoadBalancedFedAvg))
    client_app.py  app = ClientApp()                ->  ClientApp(mods=[balance_mod()])
                   trainloader, _ = load_data(...)  +   trainloader = balanced_loader(msg, ...)

With `strategy=NAME` (the quickstart only) its FedAvg is first replaced by another strategy
of Flower's, as a deployment that runs FedAdam, FedProx, server-side DP or its own
aggregation would have it (STRATEGIES), and the balanced copy wraps that one:
`strategy = LoadBalanced(<that strategy>)`.
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


# name -> (what server_app.py imports and defines, the strategy it builds instead of FedAvg)
STRATEGIES: dict[str, tuple[str, str]] = {
    "fedavg": (
        "from flwr.serverapp.strategy import FedAvg\n",
        "FedAvg(fraction_evaluate=fraction_evaluate)",
    ),
    "fedadam": (
        "from flwr.serverapp.strategy import FedAdam\n",
        "FedAdam(fraction_evaluate=fraction_evaluate)",
    ),
    "fedprox": (
        "from flwr.serverapp.strategy import FedProx\n",
        "FedProx(fraction_evaluate=fraction_evaluate, proximal_mu=0.1)",
    ),
    "dp-server-fixed": (
        "from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg\n",
        "DifferentialPrivacyServerSideFixedClipping(\n"
        "        FedAvg(fraction_evaluate=fraction_evaluate),\n"
        "        noise_multiplier=0.001,\n"
        "        clipping_norm=5.0,\n"
        "        num_sampled_clients=3,\n"
        "    )",
    ),
    "own-aggregation": (
        "from flwr.serverapp.strategy import FedAvg\n"
        "from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords\n"
        "\n\n"
        "class OwnFedAvg(FedAvg):\n"
        '    """A deployment\'s own aggregation: every silo the same say, no super()."""\n'
        "\n"
        "    def aggregate_train(self, server_round, replies):\n"
        '        print(f"OwnFedAvg.aggregate_train: round {server_round}", flush=True)\n'
        "        contents = [m.content for m in replies if not m.has_error()]\n"
        "        if not contents:\n"
        "            return None, None\n"
        "        for content in contents:\n"
        '            content["metrics"]["num-examples"] = 1\n'
        '        metrics = self.train_metrics_aggr_fn(contents, "num-examples")\n'
        '        return aggregate_arrayrecords(contents, "num-examples"), metrics\n',
        "OwnFedAvg(fraction_evaluate=fraction_evaluate)",
    ),
}


def _replace_once(text: str, old: str, new: str, where: Path) -> str:
    count = text.count(old)
    if count != 1:
        raise AssertionError(f"{where}: expected one {old!r}, found {count}")
    return text.replace(old, new)


def with_strategy(server: Path, name: str, balanced: bool) -> None:
    """server_app.py building STRATEGIES[name] instead of FedAvg (wrapped in LoadBalanced
    where `balanced`)."""
    imports, built = STRATEGIES[name]
    text = _replace_once(
        server.read_text(), "from flwr.serverapp.strategy import FedAvg\n", "", server
    )
    marker = "\n# Create ServerApp\n"
    fedlb = "from fedlb.flower import LoadBalanced\n" if balanced else ""
    text = _replace_once(text, marker, f"\n{fedlb}{imports}{marker}", server)
    built = f"LoadBalanced({built})" if balanced else built
    server.write_text(
        _replace_once(
            text,
            "strategy = FedAvg(fraction_evaluate=fraction_evaluate)",
            f"strategy = {built}",
            server,
        )
    )


def adopt(
    name: str,
    destination: Path,
    balanced: bool = True,
    strategy: str | None = None,
    wrap: bool = False,
) -> tuple[Path, list[str]]:
    """A copy of tests/apps/NAME in destination (made load-balanced unless `balanced` is
    False; its FedAvg replaced by STRATEGIES[strategy] first, where given; an app with a
    strategy subclass of its own keeps it as it is and wraps it where `wrap`:
    `LoadBalanced(CustomFedAvg(...))`); (the app folder, the non-import lines the change
    touched)."""
    app = destination / name
    shutil.copytree(APPS / name, app, ignore=shutil.ignore_patterns("__pycache__"))
    package = next(p.parent for p in app.glob("*/server_app.py"))
    if strategy is not None:
        with_strategy(package / "server_app.py", strategy, balanced)
    if not balanced:
        return app, []
    subclass = package / "strategy.py"
    server = subclass if subclass.exists() else package / "server_app.py"
    client = package / "client_app.py"
    before = {path: path.read_text() for path in (server, client)}
    if strategy is not None:
        pass  # the server's change is made: the strategy wrapped in LoadBalanced
    elif server is subclass and wrap:  # the app's own subclass, as it is, wrapped
        server = package / "server_app.py"
        before = {path: path.read_text() for path in (server, client)}
        text = _replace_once(
            before[server],
            "from pytorch_example.strategy import CustomFedAvg\n",
            "from pytorch_example.strategy import CustomFedAvg\n\n"
            "from fedlb.flower import LoadBalanced\n",
            server,
        )
        text = _replace_once(
            text,
            "    strategy = CustomFedAvg(\n"
            "        fraction_train=fraction_train, fraction_evaluate=fraction_eval\n"
            "    )\n",
            "    strategy = LoadBalanced(\n"
            "        CustomFedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_eval)\n"
            "    )\n",
            server,
        )
        server.write_text(text)
    elif server is subclass:  # the app's own FedAvg subclass inherits fedlb's instead
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


def published_server(app: Path, name: str = "quickstart_pytorch") -> None:
    """The adopted copy `app` of tests/apps/NAME with its server_app.py as published: its
    stock strategy beside the drop-in's client lines, which then only emulate speeds (a
    stock strategy sends no orders)."""
    package = next(p.parent for p in app.glob("*/server_app.py"))
    source = next((APPS / name).glob("*/server_app.py"))
    (package / "server_app.py").write_text(source.read_text())


def declare_emulation(app: Path) -> None:
    """The app's pyproject declares `fedlb-emulated-speeds` (Flower takes --run-config
    only for keys an app declares): the documented line."""
    project = app / "pyproject.toml"
    text = project.read_text()
    declared = text.replace(
        "[tool.flwr.app.config]\n", '[tool.flwr.app.config]\nfedlb-emulated-speeds = ""\n'
    )
    if declared == text:
        raise ValueError(f"{project} has no [tool.flwr.app.config] table to declare it in")
    project.write_text(declared)
