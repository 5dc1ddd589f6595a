"""The generators of the documentation site's reference pages, each writing Markdown from
the code as it is now (scripts/docs_hooks.py puts what they write in place of a page's
marker line): the public faces' names (their `__all__`, rendered by mkdocstrings from
their docstrings), every `fedlb` command and option (the typer app itself, through click),
every settings key (the settings dataclasses, their docstrings and `RUN_SETTING_HELP`),
and the files a run writes (`RUN_FILES`, `RoundRecord`, `SiloRound`, the summary's keys).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import re
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's fedlb, whichever environment builds it
    sys.path.insert(0, str(ROOT))
log = logging.getLogger("mkdocs.hooks.fedlb")  # under "mkdocs": --strict counts its warnings
FACES = (
    "fedlb.flower",
    "fedlb.balance",
    "fedlb.deploy",
    "fedlb.cluster",
    "fedlb.he",
    "fedlb.training",
    "fedlb.data",
    "fedlb.models",
    "fedlb.page",
    "fedlb.security",
)

# `import typer` itself: typer 0.20 re-exports click.utils names click 8.5 deprecates (as
# pyproject's pytest filter says); not fedlb's, and not the docs'
warnings.filterwarnings("ignore", message=".click.utils.get_.*", category=DeprecationWarning)


# ---------------------------------------------------------------------------------------
# the public faces


def public_names(face: str) -> list[str]:
    """A face's `__all__`, in its own order."""
    return list(importlib.import_module(face).__all__)


def inner_modules(face: str) -> dict[str, str]:
    """Where each public name of `face` is defined: {name: inner module ('strategy')}, from
    the face's own `from .module import name` lines (names it defines itself: '')."""
    path = ROOT / Path(*face.split(".")) / "__init__.py"
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            module = node.module or ""
            # a part inside the face with a face of its own (fedlb.flower.records): its
            # names grouped by the inner module that defines them there
            nested = bool(module) and (path.parent / module).is_dir()
            inner = inner_modules(f"{face}.{module}") if nested else {}
            for alias in node.names:
                name = alias.asname or alias.name
                below = inner.get(alias.name)
                found.setdefault(name, f"{module}.{below}" if below else module)
    return found


def groups(face: str) -> list[tuple[str, str, list[str]]]:
    """The face's names grouped by the task of the inner module that defines them:
    [(title, what, names)], the title and what from that module's docstring's first
    sentence, the groups in the order their first name comes in MAIN_FIRST, then in the
    face's own import order."""
    where = inner_modules(face)
    grouped: dict[str, list[str]] = {}
    for name in sorted(where, key=list(where).index):
        if name in public_names(face):
            grouped.setdefault(where[name], []).append(name)
    for name in public_names(face):  # defined in the face itself
        if name not in where:
            grouped.setdefault("", []).append(name)
    first = MAIN_FIRST.get(face, [])
    order = sorted(grouped, key=lambda m: first.index(m) if m in first else len(first))
    out = []
    for module in order:
        doc = ""
        if module:
            doc = inspect.getdoc(importlib.import_module(f"{face}.{module}")) or ""
        title, what = _group_title(face, module, doc.split("\n\n")[0])
        out.append((title, what, grouped[module]))
    return out


# Each group's heading: the task of the inner module its names come from (a face's new
# module needs one: tests/test_docs_site.py); the module docstring's first paragraph goes
# under it.
GROUP_TITLES = {
    "fedlb.flower": {
        "strategy": "Balance any strategy",
        "fedavg": "Balanced FedAvg",
        "options": "LoadBalancedFedAvg's options",
        "dropin": "The ClientApp side",
        "he": "Encrypted updates",
        "records.files": "A run's files",
        "records.record": "Round records",
        "records.checkpoint": "Checkpoints and resuming",
        "grid": "Waiting for replies",
        "records.rounds_file": "Reading rounds.jsonl",
    },
    "fedlb.balance": {
        "manager": "The manager",
        "names": "Tuners and estimators by name",
        "pooled": "The pooled tuner",
        "curved": "The default tuner: pooled, on step-time curves",
        "tuners": "Other tuners",
        "leader": "LB-BSP Algorithm 2",
        "estimators": "Speed estimators",
        "narx": "NARX prediction",
        "guard": "The stability guard",
        "": "Defaults",
        "curves": "Step-time curves",
        "ideal": "T*, E and idle time",
        "reports": "Reports",
        "steps": "Local steps per worker",
        "traces": "Speed traces for tests",
    },
    "fedlb.deploy": {
        "operations": "Run a server, start a silo",
        "settings": "Server and silo settings",
        "run_config": "Run settings",
        "federation": "A federation on this machine",
        "errors": "Errors",
        "join": "Joining the SuperLink",
        "processes": "Flower's processes",
        "ray_nodes": "Ray nodes for simulation",
        "server_app": "fedlb's ServerApp",
        "silo_app": "fedlb's ClientApp",
        "task": "What is trained",
    },
    "fedlb.cluster": {
        "balancer": "Balance a DDP job",
        "policies": "Policies by name",
        "coordinator": "The coordinator",
        "service": "The manager as a gRPC service",
        "service_auth": "Who may call the service",
        "service_requests": "The service's requests",
        "hook": "The weighted allreduce hook",
        "local": "Local SGD",
        "orchestra": "Orchestra",
        "partition": "Data-partition manager",
        "ps": "Parameter-server schemes",
        "eager": "eager-SGD",
    },
    "fedlb.he": {"keys": "Keys and contexts", "packing": "Encrypt, decrypt, average"},
    "fedlb.training": {
        "local": "Local training",
        "sampler": "A resizable batch sampler",
        "device": "Devices and timing",
        "curves": "Step-time curves",
        "pairing": "Models and datasets",
        "resources": "Resource probes",
    },
    "fedlb.data": {
        "registry": "Datasets by name",
        "partition": "Partitions",
        "cache": "Caches on disk",
        "digits": "The embedded digits",
        "files": "Your own files",
        "images": "Image datasets",
        "tabular": "Heart Disease",
        "text": "Shakespeare",
        "types": "The data type",
    },
    "fedlb.models": {
        "": "Models by name",
        "mlp": "MLP",
        "small": "Small CNN and LSTM",
        "lenet": "LeNet-5",
        "logistic": "Logistic regression",
    },
    "fedlb.page": {"app": "The page's server", "state": "What the page shows"},
    "fedlb.security": {
        "run_lock": "One run per folder",
        "digests": "Digests and seals",
        "stored": "Reading stored files",
        "tls": "TLS and silo keys",
    },
}


# The groups each face's page starts with: what a user needs first.
MAIN_FIRST = {
    "fedlb.flower": [
        "strategy",
        "fedavg",
        "options",
        "dropin",
        "he",
        "records.files",
        "records.record",
    ],
    "fedlb.balance": ["manager", "names", "curved", "pooled", "tuners", "estimators", "guard"],
    "fedlb.deploy": ["operations", "settings", "run_config", "federation"],
    "fedlb.cluster": ["balancer", "policies", "coordinator", "service"],
    "fedlb.he": ["keys", "packing"],
    "fedlb.training": ["local", "sampler", "device"],
    "fedlb.data": ["registry", "partition", "cache"],
    "fedlb.security": ["run_lock", "digests", "stored", "tls"],
}


def _group_title(face: str, module: str, paragraph: str) -> tuple[str, str]:
    """A group's heading (GROUP_TITLES) and its line (the module docstring's first
    paragraph)."""
    title = GROUP_TITLES.get(face, {}).get(module)
    if title is None:
        log.warning("API reference: %s.%s has no group title (GROUP_TITLES)", face, module)
        title = module or face
    return title, " ".join(paragraph.split())


def constant_block(face: str, name: str) -> list[str]:
    """A public constant as a reader wants it: its value (a table for a mapping or a
    dataclass), and the comment its definition carries."""
    value = getattr(importlib.import_module(face), name)
    module = inner_modules(face).get(name, "")
    comment = _definition_comment(f"{face}.{module}" if module else face, name)
    out = [f"### `{face}.{name}` {{ #{face}.{name} }}", ""]
    kind = type(value).__name__
    out += [f"*constant* · `{kind}`" + (f" · defined in `{face}.{module}`" if module else ""), ""]
    if comment:
        out += [_escape_html(comment), ""]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out += ["| attribute | value |", "| --- | --- |"]
        for field in dataclasses.fields(value):
            out.append(f"| `{field.name}` | `{_cell(repr(getattr(value, field.name)))}` |")
    elif isinstance(value, dict):
        out += ["| name | what |", "| --- | --- |"]
        for key, item in value.items():
            out.append(f"| `{key}` | {_cell(_item_text(item))} |")
    else:
        out += [f"`{name} = {value!r}`"]
    return [*out, ""]


def _item_text(item: Any) -> str:
    if isinstance(item, str):
        return item
    description = getattr(item, "description", None)
    if isinstance(description, str):
        return description
    points = getattr(item, "points", None)
    if points:
        sizes = [p[0] for p in points]
        return f"a measured step-time curve, {len(points)} points, B = {sizes[0]}..{sizes[-1]}"
    return repr(item)


def _definition_comment(module_name: str, name: str) -> str:
    """The comment lines right above `name = ...` in its module, and its trailing comment."""
    try:
        source = inspect.getsource(importlib.import_module(module_name))
    except (OSError, TypeError):
        return ""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^{re.escape(name)}\s*(:[^=]*)?=", line):
            block: list[str] = []
            above = i - 1
            while above >= 0 and lines[above].startswith("#"):
                block.insert(0, lines[above].lstrip("#").strip())
                above -= 1
            trailing = _trailing_comment(line)
            return " ".join([*block, trailing]).strip()
    return ""


def is_constant(value: Any) -> bool:
    return not (callable(value) or isinstance(value, type) or inspect.ismodule(value))


def api_page(face: str) -> str:
    """The face's public names grouped by task (`groups`), a table of contents first;
    classes and functions rendered by mkdocstrings from their docstrings (parameter
    tables from `Args:`), constants by `constant_block`."""
    module = importlib.import_module(face)
    names = public_names(face)
    lines = [f"`import {face}`: {len(names)} public names, by task.", ""]
    for title, _, members in groups(face):
        links = ", ".join(f"[`{n}`](#{face}.{n})" for n in members)
        lines.append(f"- **{title}**: {links}")
    lines.append("")
    for title, what, members in groups(face):
        lines += [f"## {title}", ""]
        if what:
            lines += [_escape_html(what), ""]
        for name in members:
            if is_constant(getattr(module, name)):
                lines += constant_block(face, name)
            else:
                lines += [f"::: {face}.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the command line


def cli_commands() -> dict[str, Any]:
    """Every `fedlb` command as click sees it: {'fedlb server': command, ...}, the group
    first."""
    import click
    import typer.main

    from fedlb.cli import app

    found: dict[str, Any] = {}

    def walk(command: click.Command, path: str) -> None:
        found[path] = command
        if isinstance(command, click.Group):
            for name in sorted(command.commands):
                walk(command.commands[name], f"{path} {name}")

    walk(typer.main.get_command(app), "fedlb")
    return found


def shown_help(text: str | None) -> str:
    """A help text as `--help` shows it: typer reads help as rich markup, so a bracket
    meant to be seen is escaped in the source (`\\[server]`) and shown bare here."""
    from rich.text import Text

    return Text.from_markup(text or "").plain


DEFAULT_IN_HELP = re.compile(r"\s*\[default: ([^\]]*)\]\s*$")


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _option_default(param: Any) -> str:
    if param.required:
        return "(required)"
    if getattr(param, "show_default", True) is False or param.default is None:
        return ""
    default = param.default
    if callable(default):
        return "(computed)"
    if isinstance(default, (list, tuple)):
        default = ", ".join(map(str, default))
    if isinstance(default, bool) and getattr(param, "secondary_opts", None):
        flag = param.opts[0] if default else param.secondary_opts[0]
        return f"`{flag}`"
    if isinstance(default, bool) and getattr(param, "is_flag", False):
        return "on" if default else "off"
    text = str(default)
    return f"`{text}`" if text != "" else "`''`"


def cli_page() -> str:
    """Every command: what it does (its help), its usage, its arguments and options."""
    import click

    commands = cli_commands()
    out: list[str] = []
    root = commands.pop("fedlb")
    out += ["## fedlb", "", _help_text(root), ""]
    out += ["```text", "fedlb [OPTIONS] COMMAND [ARGS]...", "```", ""]
    out += _options_table(root)
    out += ["| command | what it does |", "| --- | --- |"]
    for path, command in commands.items():
        anchor = path.replace(" ", "-")
        summary = command.get_short_help_str(limit=120)
        out.append(f"| [`{path}`](#{anchor}) | {_cell(summary)} |")
    out.append("")
    for path, command in commands.items():
        anchor = path.replace(" ", "-")
        out += [f"## {path} {{ #{anchor} }}", ""]
        out += [_help_text(command), ""]
        context = click.Context(command, info_name=path)
        usage = " ".join(command.collect_usage_pieces(context))
        out += ["```text", f"{path} {usage}".rstrip(), "```", ""]
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        if arguments:
            out += ["| argument | type | what |", "| --- | --- | --- |"]
            for p in arguments:
                help_text = shown_help(getattr(p, "help", None))
                out.append(
                    f"| `{p.human_readable_name}` | {_cell(p.type.name)} | {_cell(help_text)} |"
                )
            out.append("")
        out += _options_table(command)
    return "\n".join(out)


def _options_table(command: Any) -> list[str]:
    """A command's options (its visible ones, --help included), one row each."""
    import click

    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    help_option = command.get_help_option(click.Context(command))
    if help_option is not None:
        options.append(help_option)
    if not options:
        return []
    out = ["| option | type | default | what |", "| --- | --- | --- | --- |"]
    for p in options:
        names = " / ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
        kind = "flag" if p.is_flag else _cell(p.type.name)
        help_text = shown_help(p.help)
        said = DEFAULT_IN_HELP.search(help_text)  # a default the help says: its column
        if said:
            help_text = help_text[: said.start()]
        if p.envvar:
            envvars = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
            help_text += " (env: " + ", ".join(envvars) + ")"
        default = "" if p is help_option else _option_default(p)
        if said and not default:
            default = f"`{said.group(1)}`"
        out.append(f"| {names} | {kind} | {_cell(default)} | {_cell(help_text)} |")
    out.append("")
    return out


def _help_text(command: Any) -> str:
    text = shown_help(inspect.cleandoc(command.help or ""))
    text = text.split("\f")[0]  # click's cut: what follows \f is not help
    return _escape_html(text)


def _escape_html(text: str) -> str:
    """Markdown text with `<` and `>` shown as written (a `<run>` is no HTML tag)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(
        p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts
    )


# ---------------------------------------------------------------------------------------
# environment variables and the state kept outside a run's folder

# Every FEDLB_* variable fedlb's code names, what it does and who sets it: the page lists
# these, and a name found in fedlb/ but missing here fails the build (--strict).
ENVIRONMENT = {
    "FEDLB_PROFILE_DIR": (
        "you",
        "Where silos keep their speed profiles and the server its guard verdicts and the "
        "models it has balanced before. Default `$XDG_CACHE_HOME/fedlb/profiles`, else "
        "`~/.cache/fedlb/profiles`; `off`: none kept (every run starts as a first run: "
        "round 1 at B0, then the guard's probe).",
    ),
    "FEDLB_CACHE_DIR": (
        "you",
        "Where silos keep their (train, test) partitions, so the next ClientApp process "
        "reads its part instead of rebuilding it. Default `$XDG_CACHE_HOME/fedlb/partitions`, "
        "else `~/.cache/fedlb/partitions`; empty: the default; `off`: no cache.",
    ),
    "FEDLB_CACHE_MAX_MB": (
        "you",
        "The partition cache's size limit in MiB (default {max_mb}): the oldest entries "
        "are deleted after each write to keep under it.",
    ),
    "FEDLB_PAGE_TOKEN": (
        "you",
        "The live page's token (as `--page-token`), needed when the page listens on an "
        "address other than this machine's loopback.",
    ),
    "FEDLB_MANAGER_TOKEN": (
        "you",
        "The token every call to `fedlb manager`'s gRPC service must carry (when no "
        "`--token-file` is given); its clients send it too.",
    ),
    "FEDLB_RUN_DIR": (
        "fedlb server",
        "Set by `fedlb server --app` for your ServerApp: the run's out-dir, where a "
        "`LoadBalanced` strategy with no reporter of its own writes rounds.jsonl, the "
        "checkpoint and summary.json. Not set in any other run.",
    ),
    "FEDLB_RESUME": (
        "fedlb server",
        "Set by `fedlb server --app ... --resume`: the same folder, whose checkpoint the "
        "strategy goes on from.",
    ),
    "FEDLB_TASK_STARTED": (
        "a warm silo",
        "Set by a warm silo in the ClientApp process it forks: when the fork happened, "
        "which the balancing mod reports as the ClientApp's start-up. Internal.",
    ),
}
OTHER_ENVIRONMENT = {
    "XDG_CACHE_HOME": "Where the caches above go when their own variable is not set "
    "(`$XDG_CACHE_HOME/fedlb/...`; unset: `~/.cache`).",
}


def environment_names() -> set[str]:
    """Every FEDLB_* name in fedlb's code."""
    found: set[str] = set()
    for path in (ROOT / "fedlb").rglob("*.py"):
        found |= set(re.findall(r"\bFEDLB_[A-Z_]*[A-Z]\b", path.read_text()))
    return found


def environment_page() -> str:
    from fedlb.data.cache import DEFAULT_MAX_MB

    for name in sorted(environment_names() - set(ENVIRONMENT)):
        log.warning("environment reference: %s is read by fedlb but not documented", name)
    out = ["| variable | set by | what |", "| --- | --- | --- |"]
    for name, (who, what) in ENVIRONMENT.items():
        out.append(f"| `{name}` | {who} | {_cell(what.format(max_mb=DEFAULT_MAX_MB))} |")
    for name, what in OTHER_ENVIRONMENT.items():
        out.append(f"| `{name}` | you | {_cell(what)} |")
    return "\n".join(out)


def state_page() -> str:
    """The folders and files fedlb keeps outside a run's out-dir, from the code's names."""
    from fedlb.data.cache import DEFAULT_MAX_MB
    from fedlb.flower.profiles import MAX_AGE_S, SEEN_FILE, STALE
    from fedlb.flower.verdicts import VERDICTS_FILE

    days = MAX_AGE_S / 86400
    rows = [
        (
            "`profiles/profile-<key>.json`",
            "each silo",
            "its measured speed (samples/s, fixed seconds, its B0 and τ), keyed by the model's "
            "layout, the silo's label and its hardware; written after every train round",
            f"round 1 starts balanced from it; ignored after {days:g} days, and called stale "
            f"when round 1 measures a speed off by more than {STALE:.0%}",
        ),
        (
            f"`profiles/{SEEN_FILE}`",
            "the server",
            "the models it has balanced before",
            "only a model seen before asks the silos for their profiles before round 1",
        ),
        (
            f"`profiles/{VERDICTS_FILE}`",
            "the server (fedlb's own ServerApp with profiles on)",
            "the stability guard's last verdict per app (stable or edge) with its evidence",
            "a stable app's next run starts fully balanced, an edge app's runs at its own "
            f"B0 with no probe; ignored after {days:g} days; `fedlb verdicts` lists and "
            "forgets them",
        ),
        (
            "`partitions/partition-<sha256>.npz`",
            "each silo",
            "its (train, test) part of the dataset",
            f"read instead of rebuilt; kept under {DEFAULT_MAX_MB} MiB, oldest deleted first",
        ),
    ]
    out = ["| file | written by | what | changes the next run |", "| --- | --- | --- | --- |"]
    out += [f"| {a} | {b} | {_cell(c)} | {_cell(d)} |" for a, b, c, d in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# the demo


def demo_script_args() -> list[str]:
    """The arguments ./scripts/demo.sh gives `fedlb demo` (its exec line's, "$@" aside)."""
    import shlex

    text = (ROOT / "scripts" / "demo.sh").read_text()
    line = next(x for x in text.splitlines() if x.startswith("exec ") and " demo" in x)
    words = shlex.split(line)
    return [w for w in words[words.index("demo") + 1 :] if w != "$@"]


def demo_run() -> dict[str, Any]:
    """The run settings ./scripts/demo.sh's demo runs with: its flags over `fedlb demo`'s
    own defaults (`fedlb.cli.demo.DEMO_RUN`) over RunConfig's."""
    from fedlb.cli.demo import DEMO_RUN
    from fedlb.deploy import RunConfig

    settings: dict[str, Any] = {**RunConfig().to_mapping(), **DEMO_RUN}
    args = demo_script_args()
    for flag, value in zip(args[::2], args[1::2], strict=True):
        settings[flag.removeprefix("--")] = value
    settings["num-silos"] = len(str(settings.get("slowdowns", "1,2,4")).split(","))
    return settings


def demo_page() -> str:
    """What ./scripts/demo.sh runs, said from the script and the demo's own defaults."""
    from fedlb.cli.demo import DEMO_RUN
    from fedlb.deploy import RunConfig

    run = demo_run()
    own = ", ".join(f"`--{k} {v}`" for k, v in DEMO_RUN.items())
    return (
        f"`./scripts/demo.sh` runs `fedlb demo {' '.join(demo_script_args())}`: "
        f"{run['num-silos']} silos, {run['num-rounds']} rounds of τ = {run['local-steps']} "
        f"local steps, every silo starting at B0 = {run['batch-size']} (X = "
        f"{run['num-silos'] * int(run['batch-size'])} samples a step, shared), learning rate "
        f"η = {run['learning-rate']}, on the `{run['dataset']}` dataset with the "
        f"`{run['model']}` model. `fedlb demo` alone runs the same but at η = "
        f"{RunConfig().learning_rate}: its own defaults ({own}) make a short run; "
        "every other setting is `fedlb server`'s "
        "([Settings](../reference/settings.md#run-settings))."
    )


# ---------------------------------------------------------------------------------------
# settings files


def docstring_entries(cls: type) -> dict[str, str]:
    """`name: text` entries of a settings dataclass's docstring, by field name (an entry
    'a, b: text' or 'a / b: text' gives each of a and b the text)."""
    doc = _attributes_dedented(inspect.cleandoc(cls.__doc__ or ""))
    entries: dict[str, str] = {}
    names: list[str] = []
    text: list[str] = []
    field_names = {f.name for f in dataclasses.fields(cls)}

    def close() -> None:
        for name in names:
            entries.setdefault(name, " ".join(" ".join(text).split()))

    for line in doc.splitlines():
        match = re.match(r"^(?:or\s+)?([a-z_]+(?:\s*(?:,|/|and)\s*[a-z_]+)*):\s*(.*)$", line)
        candidates = re.split(r"\s*(?:,|/|\band\b)\s*", match.group(1)) if match else []
        if match and candidates and all(c in field_names for c in candidates):
            close()
            names, text = candidates, [match.group(2)]
        elif names and line.startswith(" "):
            text.append(line.strip())
        else:
            close()
            names, text = [], []
    close()
    return entries


def _attributes_dedented(doc: str) -> str:
    """A docstring with its Google-style `Attributes:` block dedented to the entries' own
    margin (`name: text`, continuation lines indented), the form docstring_entries reads."""
    out: list[str] = []
    inside = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        out.append(line[4:] if inside and line.startswith("    ") else line)
    return "\n".join(out)


def shared_entries(cls: type) -> set[str]:
    """The fields whose docstring entry they share with other fields."""
    entries = docstring_entries(cls)
    texts = list(entries.values())
    return {name for name, text in entries.items() if texts.count(text) > 1}


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text.replace("None", "none")


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value is None:
        return "(none)"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def settings_table(
    cls: type,
    help_lines: dict[str, str] | None = None,
    options_of: str | None = None,
    demo: dict[str, Any] | None = None,
) -> str:
    """A settings dataclass's keys (`-` for `_`): type, default and meaning, from its
    docstring, else `help_lines`, else the help of the `fedlb` command's option of that
    name (`options_of`: 'fedlb experiment'); `demo`: the keys `fedlb demo` runs with
    otherwise, said beside the default."""
    entries, grouped = docstring_entries(cls), shared_entries(cls)
    option_help: dict[str, str] = {}
    if options_of:
        command = cli_commands()[options_of]
        for p in command.params:
            for opt in getattr(p, "opts", []):
                if opt.startswith("--"):
                    option_help.setdefault(opt[2:], shown_help(p.help))
    out = ["| key | type | default | what |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        key = field.name.replace("_", "-")
        own = (help_lines or {}).get(key) or option_help.get(key)
        docstring = entries.get(field.name)
        # a docstring entry shared by several keys ('page, page_host, page_port: ...')
        # gives way to the key's own line where it has one
        meaning = (own if field.name in grouped else docstring or own) or docstring or ""
        if not meaning:
            log.warning("settings reference: %s.%s has no description", cls.__name__, key)
        default = _default(field)
        if demo and key in demo:
            default += f" (`fedlb demo`: `{demo[key]}`)"
        out.append(
            f"| `{key}` | {_cell(_type_name(field.type))} | {_cell(default)} | {_cell(meaning)} |"
        )
    return "\n".join(out)


def config_page() -> str:
    from fedlb.cli.demo import DEMO_RUN
    from fedlb.deploy import RunConfig, ServerSettings, SiloSettings
    from fedlb.deploy.run_config import RUN_SETTING_HELP
    from fedlb.experiments.cluster_scenario import ClusterScenario
    from fedlb.experiments.scenario import Scenario

    sections = [
        (
            "server-settings",
            "The server: `[server]`",
            "server.toml's `[server]` table, and `fedlb server`'s flags of the same names "
            "(`fedlb.deploy.ServerSettings`).",
            settings_table(ServerSettings, options_of="fedlb server"),
        ),
        (
            "run-settings",
            "The run: `[run]`",
            "server.toml's `[run]` table, `fedlb server`'s and `fedlb demo`'s flags of the "
            "same names, and the run config of fedlb's own Flower app "
            "(`fedlb.deploy.RunConfig`; `RUN_SETTING_HELP` is the flags' help). "
            "`fedlb demo` runs a short federation: where its defaults differ "
            "(`fedlb.cli.demo.DEMO_RUN`), the default column says so.",
            settings_table(RunConfig, RUN_SETTING_HELP, demo=DEMO_RUN),
        ),
        (
            "silo-settings",
            "A silo: `[silo]`",
            "a silo file's `[silo]` table (silos/silo-N.toml) and `fedlb silo`'s flags of "
            "the same names (`fedlb.deploy.SiloSettings`).",
            settings_table(SiloSettings, options_of="fedlb silo"),
        ),
        (
            "scenario-keys",
            "An experiment's scenario",
            "a scenario file's keys (scenarios/*.toml) and `fedlb experiment`'s flags of "
            "the same names (`fedlb.experiments.scenario.Scenario`).",
            settings_table(Scenario, options_of="fedlb experiment"),
        ),
        (
            "cluster-scenario-keys",
            "A cluster scenario",
            "a cluster scenario's keys (scenarios/cluster/*.toml) and `fedlb cluster`'s "
            "flags of the same names (`fedlb.experiments.cluster_scenario.ClusterScenario`).",
            settings_table(ClusterScenario, options_of="fedlb cluster"),
        ),
    ]
    out: list[str] = []
    for anchor, title, where, table in sections:
        out += [f"## {title} {{ #{anchor} }}", "", f"Where: {where}", "", table, ""]
    return "\n".join(out)


def settings_keys() -> dict[str, list[str]]:
    """Each settings class's keys, for the tests."""
    from fedlb.deploy import RunConfig, ServerSettings, SiloSettings

    return {
        cls.__name__: [f.name.replace("_", "-") for f in dataclasses.fields(cls)]
        for cls in (ServerSettings, RunConfig, SiloSettings)
    }


# ---------------------------------------------------------------------------------------
# the files a run writes


def field_comments(cls: type) -> dict[str, str]:
    """The comments a dataclass's fields carry in its source: the one at the end of the
    field's line, and the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    comments: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = lines[node.lineno - 1]
        parts: list[str] = []
        above = node.lineno - 2
        block: list[str] = []
        while above >= 0 and lines[above].strip().startswith("#"):
            block.insert(0, lines[above].strip().lstrip("#").strip())
            above -= 1
        parts += block
        if "#" in line:
            trailing = _trailing_comment(line)
            if trailing:
                parts.append(trailing)
        comments[node.target.id] = " ".join(parts)
    return comments


def _trailing_comment(line: str) -> str:
    import io
    import tokenize

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError):
        return ""
    return next((t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT), "")


def fields_table(cls: type, prefix_clashes: set[str] | None = None) -> str:
    comments = field_comments(cls)
    out = ["| field | type | what |", "| --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        name = field.name
        if prefix_clashes and name in prefix_clashes:
            name = f"{name}` (as `silo_{name}` in rounds.jsonl)"
            shown = f"`{name}"
        else:
            shown = f"`{name}`"
        out.append(
            f"| {shown} | {_cell(_type_name(field.type))} | {_cell(comments.get(field.name, ''))} |"
        )
    return "\n".join(out)


def returned_keys(function: Callable[..., Any]) -> list[str]:
    """The string keys of the dict literal a function returns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    keys: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            keys += [
                k.value
                for k in node.value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
    return keys


def run_files_page() -> str:
    from fedlb.flower import RUN_FILES, RoundRecord, summarise_rounds
    from fedlb.flower.records import Checkpoint, SiloRound
    from fedlb.flower.records.files import RunFiles

    round_fields = {f.name for f in dataclasses.fields(RoundRecord)} | {"round_silos"}
    comments = field_comments(RunFiles)
    out = ["## The files {: #files }", ""]
    out += ["`fedlb.flower.RUN_FILES`: every file of a run's out-dir is named there.", ""]
    out += ["| attribute | file | what |", "| --- | --- | --- |"]
    for field in dataclasses.fields(RunFiles):
        value = getattr(RUN_FILES, field.name)
        out.append(f"| `{field.name}` | `{value}` | {_cell(comments.get(field.name, ''))} |")
    out += ["", "## rounds.jsonl: a round {: #rounds-jsonl }", ""]
    out += [
        "One JSON line per silo and round: the round's fields (`RoundRecord`) and the "
        "silo's (`SiloRound`) side by side; a silo field whose name the round has too is "
        "prefixed `silo_` (`silo_round_s`, `silo_accuracy`), and `round_silos` says how "
        "many lines the round has. A round in which no silo sent an update is one line, "
        "`round_silos: 0`, with the round's fields alone. "
        "`fedlb.flower.records_from_json_lines` reads a file back.",
        "",
        "### The round's fields (`RoundRecord`)",
        "",
        fields_table(RoundRecord),
        "",
        "### Each silo's fields (`SiloRound`)",
        "",
        fields_table(SiloRound, round_fields),
        "",
    ]
    out += ["## summary.json {: #summary-json }", ""]
    out += [
        "What the rounds add up to (`fedlb.flower.summarise_rounds`), in every summary, "
        "then what `fedlb server` adds of the run's own. An experiment's summary.json is "
        "per policy: [Compare policies](../how-to/compare-policies.md#what-it-writes).",
        "",
        "| key | from | what |",
        "| --- | --- | --- |",
    ]
    for key in returned_keys(summarise_rounds):
        out.append(f"| `{key}` | every summary | {_cell(_summary_meaning(key))} |")
    for key in _server_summary_keys():
        out.append(f"| `{key}` | `fedlb server` | {_cell(_summary_meaning(key))} |")
    out.append("")
    out += _other_files()
    out += ["## checkpoint.npz {: #checkpoint-npz }", ""]
    out += [
        "Replaced atomically after every round and sealed with a digest of all its bytes; "
        "what `fedlb server --resume` goes on from (`fedlb.flower.load_checkpoint` reads "
        "it as a `Checkpoint`):",
        "",
        fields_table(Checkpoint),
        "",
    ]
    return "\n".join(out)


def _summary_meaning(key: str) -> str:
    from fedlb.flower.records.record import STEADY_FROM_ROUND

    meanings = {
        "clock": "what the seconds are: `measured` (the wall; `(emulated speeds)` where "
        "silos pad their steps) or `model` (a speed model's virtual time)",
        "rounds": "rounds on record",
        "mean_balance_efficiency": "E = T*/T_round, averaged over every round",
        "steady_balance_efficiency": f"E averaged from round {STEADY_FROM_ROUND} on, once "
        "the sizes have settled",
        "idle_fraction": "the share of silo-seconds spent waiting, averaged over the rounds",
        "final_accuracy": "the last round's accuracy (the server's test set where it has "
        "one, else the silos')",
        "best_accuracy": "the best round's accuracy, as final_accuracy",
        "final_federated_accuracy": "the last federated evaluation's (the silos' test "
        "sets, weighted by their sizes)",
        "final_mean_silo_accuracy": "the last round's silo accuracies, each silo counted "
        "once (FLamby's average over centres)",
        "stability": "the stability guard's verdict: `regime` (stable, edge, fixed), "
        "`decided_in_round`, `overturned_in_round` (a stable verdict's trial found the "
        "edge), the probe's `probe_dispersion`, `probe_growth` and "
        "`probe_noise_exponent`, `final_floor`, and `remembered` (a kept verdict it "
        "started from); null without the guard",
        "uniform_balance_efficiency": f"the E uniform sizes (FedAvg's) would have had at "
        f"the speeds each round measured, from round {STEADY_FROM_ROUND} on: the baseline",
        "wall_s": "the rounds' wall over the whole run, a resumed run's earlier rounds included",
        "process_wall_s": "this server process's share of it",
        "resumed_after": "the checkpoint's round a resumed run went on from (null: not resumed)",
        "final_sizes": "each silo's batch size at the end, by label",
        "settings": "the run's settings ([Settings](settings.md#run-settings))",
    }
    if key not in meanings:
        log.warning("run files reference: summary.json's key %r is not described", key)
    return meanings.get(key, "")


def _other_files() -> list[str]:
    """The files in a run's folder besides RUN_FILES', each from the constant naming it."""
    from fedlb.deploy.operations import SERVER_FILE
    from fedlb.deploy.user_app import APP_FILE
    from fedlb.flower import RUN_FILES
    from fedlb.security import LOCK_FILE
    from fedlb.security.digests import SUFFIX

    rows = [
        (
            f"`{RUN_FILES.model}{SUFFIX}`, `{RUN_FILES.encrypted_model}{SUFFIX}`",
            "the model file's SHA-256 beside it (`fedlb.security.write_digest`), so a "
            "copy can be checked (`sha256sum -c`); `fedlb decrypt` checks the encrypted "
            "model's",
        ),
        (
            f"`{SERVER_FILE}`",
            "`fedlb server`'s: where it listened (`host`, `port`, the loopback `control` "
            "address) and every process it started (`processes`: name, pid, start time, "
            "port), so `--resume` can stop what a killed server left running",
        ),
        (
            f"`{APP_FILE}`",
            "`fedlb server --app`'s: the app the run was started with, which `--resume` "
            "compares with the app it is given (a changed app is said, not refused)",
        ),
        (
            "`processes/`",
            "the logs of the processes the server started (`superlink.log`, "
            "`serverapp-RUN.log`, `silo-N.log` for local silos) and their Flower homes "
            "(`home-*`; `home-cli` is what `FLWR_HOME=... flwr ls` reads)",
        ),
        (
            f"`{LOCK_FILE}`",
            "held while a fedlb run uses the folder (`fedlb.security.claim_folder`): "
            "a second run there is refused, naming the first",
        ),
        (
            "`updates/`",
            "with `--keep-updates 1`: every round's updates and aggregate",
        ),
        ("`keys/`", "`fedlb demo --he`'s fresh CKKS keys"),
    ]
    out = ["## Also in the folder {: #other-files }", ""]
    out += ["| file | what |", "| --- | --- |"]
    out += [f"| {name} | {_cell(what)} |" for name, what in rows]
    return [*out, ""]


def _server_summary_keys() -> list[str]:
    """The keys fedlb's ServerApp adds to a run's summary.json beside the rounds'."""
    import fedlb.deploy.server_app as server_app

    tree = ast.parse(inspect.getsource(server_app))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "summary" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return [
                k.value
                for k in node.value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
    log.warning("run files reference: fedlb.deploy.server_app writes no summary dict")
    return []


GENERATORS: dict[str, Callable[[], str]] = {
    **{f"api:{face}": (lambda face=face: api_page(face)) for face in FACES},  # type: ignore[misc]
    "cli": cli_page,
    "demo": demo_page,
    "environment": environment_page,
    "state": state_page,
    "config": config_page,
    "run-files": run_files_page,
}
