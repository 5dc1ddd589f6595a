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
FACES = ("fedlb.flower", "fedlb.balance", "fedlb.deploy", "fedlb.cluster", "fedlb.he")

# `import typer` itself: typer 0.20 re-exports click.utils names click 8.5 deprecates (as
# pyproject's pytest filter says); not fedlb's, and not the docs'
warnings.filterwarnings("ignore", message=".click.utils.get_.*", category=DeprecationWarning)


# ---------------------------------------------------------------------------------------
# the public faces


def public_names(face: str) -> list[str]:
    """A face's `__all__`, in its own order."""
    return list(importlib.import_module(face).__all__)


def api_page(face: str) -> str:
    """One section per public name of `face`, each rendered by mkdocstrings."""
    module = importlib.import_module(face)
    names = ", ".join(f"[`{name}`](#{face}.{name})" for name in module.__all__)
    lines = [f"`import {face}`: {len(module.__all__)} public names: {names}.", ""]
    for name in module.__all__:
        lines += [f"::: {face}.{name}", ""]
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
    doc = inspect.cleandoc(cls.__doc__ or "")
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
            f"| `{key}` | {_cell(_type_name(field.type))} | {_cell(default)} "
            f"| {_cell(meaning)} |"
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
    from fedlb.flower.checkpoint import Checkpoint
    from fedlb.flower.records import SiloRound
    from fedlb.flower.run_files import RunFiles

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
        "What the rounds add up to (`fedlb.flower.summarise_rounds`), in every summary: "
        + ", ".join(f"`{k}`" for k in returned_keys(summarise_rounds))
        + ". `fedlb server` adds the run's own: "
        + ", ".join(f"`{k}`" for k in _server_summary_keys())
        + ". An experiment's summary.json is per policy: [Compare policies]"
        "(../how-to/compare-policies.md#what-it-writes).",
        "",
    ]
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
    "config": config_page,
    "run-files": run_files_page,
}
