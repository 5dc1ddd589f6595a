"""What `fedlb --help`, `fedlb COMMAND --help` and `fedlb --version` say, against the code:
the demo's defaults are the ones it runs with (and the reference says the same), help
texts keep their brackets (typer reads them as rich markup), none names a repository path
a wheel install does not have, and --version is the installed package's."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from rich.text import Text
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.cli.demo import DEMO_RUN
from fedlb.deploy import RunConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402

runner = CliRunner()


def help_of(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_the_demo_runs_with_the_defaults_its_help_and_the_reference_show(monkeypatch, tmp_path):
    import fedlb.cli.federation

    started = {}

    def run_server(settings, run, *, local_silos, **kwargs):
        started.update(run=run)
        raise KeyboardInterrupt  # nothing more: the settings are what is checked

    monkeypatch.setattr(fedlb.cli.federation, "run_server", run_server)
    result = runner.invoke(app, ["demo", "--no-page", "--out-dir", str(tmp_path / "run")])
    assert result.exit_code == 130, result.output
    ran = started["run"].to_mapping()
    assert DEMO_RUN, "the demo has defaults of its own"
    for key, value in DEMO_RUN.items():
        assert ran[key] == value, key
        assert value != RunConfig().to_mapping()[key], f"{key}: not the demo's own"
        assert f"--{key}" in help_of("demo")
        assert re.search(rf"--{key} .*?\[default: {value}\]", help_of("demo")), key
    cli = docs_reference.cli_page()
    demo_section = cli[cli.index("## fedlb demo") : cli.index("## fedlb experiment")]
    server_section = cli[cli.index("## fedlb server") : cli.index("## fedlb silo ")]
    settings = docs_reference.config_page()
    for key, value in DEMO_RUN.items():
        assert re.search(rf"^\| `--{key}` \| \w+ \| `{value}` \|", demo_section, re.M), key
        server_default = RunConfig().to_mapping()[key]
        assert re.search(rf"^\| `--{key}` \| \w+ \| `{server_default}` \|", server_section, re.M)
        assert f"| `{key}` | int | `{server_default}` (`fedlb demo`: `{value}`) |" in settings
    started_page = docs_reference.demo_page()
    assert f"{DEMO_RUN['num-rounds']} rounds" in started_page
    assert f"τ = {DEMO_RUN['local-steps']} local steps" in started_page
    assert f"B0 = {DEMO_RUN['batch-size']}" in started_page
    getting_started = (ROOT / "docs" / "getting-started" / "index.md").read_text()
    assert "<!-- fedlb-reference: demo -->" in getting_started
    for b0 in re.findall(r"B0 = (\d+)", getting_started):
        assert int(b0) == DEMO_RUN["batch-size"]


def test_the_help_keeps_its_brackets():
    server = help_of("server")
    assert "TOML file ([server] and [run] tables)." in server
    assert f"Federated rounds. [default: {RunConfig().num_rounds}]" in server
    assert "TOML file ([silo] table)." in help_of("silo")
    assert "[default: 1,2,4]" in help_of("demo")


def test_no_help_text_is_eaten_by_markup():
    """typer shows help texts as rich markup: a `[word]` not escaped would vanish."""
    for path, command in docs_reference.cli_commands().items():
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        for text in texts:
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (path, text)


def test_no_help_text_names_a_repository_path():
    """A wheel install has no docs/ folder: the help names the site's pages."""
    paths = re.compile(r"\bdocs/[\w./-]+|\b\w+\.md\b")
    for path, command in docs_reference.cli_commands().items():
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        for text in texts:
            assert not paths.search(text), (path, text)


@pytest.mark.parametrize("args", [["--version"], ["--version", "server"]])
def test_version_is_the_installed_packages(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"fedlb {importlib.metadata.version('fedlb')}"
