"""Run settings, node settings, the shipped app's defaults, and config files: bad input is
refused with the key named."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.deploy import ConfigError, RunConfig, server_settings, silo_settings
from fedlb.deploy.processes import app_dir, node_config_text
from fedlb.deploy.silo_app import node_settings

runner = CliRunner()


def flat(output: str) -> str:
    """The CLI's error box as one line: box drawing and wrapping removed."""
    return " ".join(output.replace("│", " ").split())


def test_the_shipped_app_defaults_are_runconfig_defaults():
    shipped = tomllib.loads((app_dir() / "pyproject.toml").read_text())
    assert shipped["tool"]["flwr"]["app"]["config"] == RunConfig().to_mapping()
    assert RunConfig.from_mapping(shipped["tool"]["flwr"]["app"]["config"]) == RunConfig()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"num-round": 3}, "unknown setting(s) num-round"),
        ({"num-rounds": "3"}, "num-rounds must be int"),
        ({"num-rounds": 2.5}, "num-rounds must be int"),
        ({"learning-rate": True}, "learning-rate must be float"),
        ({"local-steps": 0}, "local-steps must be >= 1"),
        ({"batch-size": -4}, "batch-size must be >= 1"),
        ({"learning-rate": 0.0}, "learning-rate must be a finite number > 0"),
        ({"tuner": "magic"}, "tuner must be one of"),
        ({"partition": "shards"}, "unknown partition 'shards': use 'iid', 'classes:K'"),
        ({"max-batch": 4, "batch-size": 8}, "max-batch must be 0"),
        ({"server-test-fraction": 1.0}, "server-test-fraction must be in [0, 1)"),
        ({"poll-interval": -1.0}, "poll-interval must be a finite number >= 0"),
        ({"model": "lenet5"}, "lenet5 needs 28x28 or 32x32 images"),
        ({"model": "lstm"}, "model lstm and dataset shakespeare go together"),
        ({"dataset": "shakespeare"}, "model lstm and dataset shakespeare go together"),
        ({"partition": "natural"}, "partition natural needs a dataset with natural silos"),
    ],
)
def test_bad_run_settings_are_refused_with_the_key(values, message):
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping(values)
    assert message in str(caught.value)


def test_ints_are_accepted_for_float_settings():
    assert RunConfig.from_mapping({"learning-rate": 1}).learning_rate == 1.0


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"partition-id": 0}, "needs partition-id and num-partitions"),
        ({"partition-id": "0", "num-partitions": 3}, "partition-id must be a number"),
        ({"partition-id": 0.5, "num-partitions": 3}, "must be a whole number"),
        ({"partition-id": 0, "num-partitions": 3, "emulated-speed": -1.0}, ">= 0"),
        ({"partition-id": 3, "num-partitions": 3}, "partition-id 3 is outside 0..2"),
        ({"partition-id": -1, "num-partitions": 3}, "partition-id -1 is outside 0..2"),
    ],
)
def test_bad_node_settings_are_refused(node, message):
    with pytest.raises(ValueError, match=message):
        node_settings(node)


def test_node_config_text_is_typed_toml():
    text = node_config_text({"partition-id": 1, "emulated-speed": 2.0, "path": 'a "b" c'})
    assert text == 'partition-id=1 emulated-speed=2.0 path="a \\"b\\" c"'
    parsed = tomllib.loads(text.replace(" ", "\n", 2))
    assert parsed == {"partition-id": 1, "emulated-speed": 2.0, "path": 'a "b" c'}


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("[server]\nport = 'x'\n", [], "port must be int"),
        ("[server]\nhots = '1'\n", [], "unknown [server] key(s) hots"),
        ("[server]\npage-port = 70000\n", [], "[server] page-port must be in 0..65535"),
        ("[server]\npage = 'yes'\n", [], "page must be bool"),
        ("[server]\npage-host = ' '\n", [], "page-host is empty"),
        ("[server]\npage-token = 'a-long-secret-1'\n", [], "not read from a settings file"),
        ("[sever]\n", [], "unknown section(s) ['sever']"),
        ("[run]\nnum-rounds = 0\n", [], "num-rounds must be >= 1"),
        ("[run]\nnum-roundz = 3\n", [], "unknown setting(s) num-roundz"),
        ("[run\n", [], "is not valid TOML"),
        ("", ["--local-steps", "0"], "local-steps must be >= 1"),
        ("", ["--num-silos", "2000"], "1438 samples cannot be split among 2000 silos"),
        ("", ["--partition", "classes:11"], "classes_per_silo must be in [1, 10]"),
    ],
)
def test_server_config_errors_stop_before_anything_starts(tmp_path, content, args, message):
    config = tmp_path / "server.toml"
    config.write_text(content)
    result = runner.invoke(app, ["server", "--config", str(config), *args])
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--partition-id", "0"], "needs partition-id and num-partitions"),
        (["--partition-id", "3", "--num-partitions", "3"], "outside 0..2"),
        (
            ["--partition-id", "0", "--num-partitions", "3", "--slowdown", "0.5"],
            "slowdown must be >= 1",
        ),
    ],
)
def test_silo_refuses_bad_settings(args, message):
    result = runner.invoke(app, ["silo", *args])
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)


def test_demo_refuses_bad_slowdowns():
    result = runner.invoke(app, ["demo", "--slowdowns", "1,x"])
    assert result.exit_code == 2
    assert "--slowdowns must be numbers" in " ".join(result.output.split())


def test_example_configs_parse():
    server, run = server_settings(Path("server/server.toml"))
    assert run.num_silos == 3
    assert server.port == 8000
    assert (server.page, server.page_host, server.page_port) == (True, "127.0.0.1", 0)
    for i in range(3):
        silo = silo_settings(Path(f"silos/silo-{i}.toml"))
        assert silo.partition_id == i
        assert silo.node_config()["partition-id"] == i


def test_the_silo_module_imports_only_what_a_message_needs():
    """Flower starts a fresh process per message: the ClientApp must not drag in the
    server side, the experiments or plotting."""
    import subprocess

    code = (
        "import sys, fedlb.deploy.client_app as c; assert c.app is not None; "
        "print(sorted(m for m in ['fedlb.flower.strategy', "
        "'fedlb.flower.records', 'fedlb.experiments', 'fedlb.cli', 'matplotlib', 'tenseal'] "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_failed_run_makes_the_command_exit_non_zero(tmp_path):
    import typer

    from fedlb.cli.federation import finish
    from fedlb.deploy.federation import RunOutcome

    log = tmp_path / "serverapp.log"
    with pytest.raises(typer.Exit) as caught:
        finish(RunOutcome("7", "finished:failed", out_dir=tmp_path, log_path=log))
    assert caught.value.exit_code == 1
    finish(RunOutcome("8", "finished:completed", out_dir=tmp_path, log_path=log))  # no exit


def test_wrong_he_key_files_are_refused_before_anything_starts(tmp_path):
    from fedlb.he import write_keys

    keys = write_keys(tmp_path / "keys")
    result = runner.invoke(app, ["server", "--he-context", str(keys.secret)])
    assert result.exit_code == 2, result.output
    assert "holds a secret key: the server must never have it" in flat(result.output)
    silo_args = ["silo", "--partition-id", "0", "--num-partitions", "2", "--he-context"]
    result = runner.invoke(app, [*silo_args, str(keys.public)])
    assert result.exit_code == 2, result.output
    assert "has no secret key" in flat(result.output)
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00" * 64)
    result = runner.invoke(app, [*silo_args, str(junk)])
    assert result.exit_code == 2, result.output
    assert "not a TenSEAL context" in flat(result.output)
    assert str(junk) in "".join(flat(result.output).split())  # a long path wraps anywhere


def test_tls_and_silo_key_files_are_checked_before_anything_starts(tmp_path):
    assert (
        runner.invoke(app, ["silo-key", "--out", str(tmp_path / "k"), "--name", "a"]).exit_code == 0
    )
    assert (tmp_path / "k" / "a.key").stat().st_mode & 0o077 == 0
    assert (tmp_path / "k" / "a.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    result = runner.invoke(app, ["server", "--silo-keys", str(tmp_path / "k")])
    assert result.exit_code == 2, result.output
    assert "silo-keys needs certs" in flat(result.output)
    result = runner.invoke(app, ["server", "--certs", str(tmp_path / "none")])
    assert result.exit_code == 2, result.output
    assert "missing TLS file(s)" in flat(result.output)
    assert runner.invoke(app, ["certs", "--out", str(tmp_path / "c")]).exit_code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["server", "--certs", str(tmp_path / "c"), "--silo-keys", str(empty)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "no *.pub files" in flat(result.output)
    silo = ["silo", "--partition-id", "0", "--num-partitions", "2"]
    result = runner.invoke(app, [*silo, "--auth-key", str(tmp_path / "nope.key")])
    assert result.exit_code == 2, result.output
    assert "is not a file" in flat(result.output)


def test_resume_is_checked_before_anything_starts(tmp_path):
    from flwr.app import ArrayRecord

    from fedlb.flower import Checkpoint, save_checkpoint

    result = runner.invoke(app, ["server", "--resume", str(tmp_path)])
    assert result.exit_code != 0
    assert "no checkpoint in" in flat(result.output)
    settings = {**RunConfig().to_mapping(), "num-rounds": 5}
    save_checkpoint(tmp_path, Checkpoint(3, 5, ArrayRecord(), {}, settings))
    result = runner.invoke(app, ["server", "--resume", str(tmp_path), "--tuner", "static"])
    assert result.exit_code != 0
    assert "--resume takes the run's settings from its checkpoint; drop tuner" in flat(
        result.output
    )
    config = tmp_path / "server.toml"
    config.write_text("[server]\nport = 9001\n[run]\ntuner = 'static'\n")
    result = runner.invoke(app, ["server", "--resume", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2
    assert "a resumed run takes its settings from its checkpoint; drop tuner" in flat(result.output)
    result = runner.invoke(app, ["server", "--resume", str(tmp_path), "--num-rounds", "2"])
    assert result.exit_code != 0
    assert "num-rounds 2 is below the 3 rounds" in flat(result.output)


def test_the_server_app_refuses_to_resume_with_other_settings(tmp_path):
    from flwr.app import ArrayRecord

    from fedlb.deploy.server_app import checkpoint_to_resume
    from fedlb.flower import Checkpoint, save_checkpoint

    save_checkpoint(tmp_path, Checkpoint(3, 5, ArrayRecord(), {}, RunConfig().to_mapping()))
    changed = RunConfig.from_mapping({"resume": str(tmp_path), "learning-rate": 0.5})
    with pytest.raises(ConfigError, match=r"learning-rate was 0\.05, now 0\.5"):
        checkpoint_to_resume(changed)
    longer = RunConfig.from_mapping({"resume": str(tmp_path), "num-rounds": 20})
    assert checkpoint_to_resume(longer).round == 3  # num-rounds may grow


def test_a_bad_key_in_a_settings_file_names_the_file(tmp_path):
    silo = tmp_path / "silo.toml"
    silo.write_text("[silo]\npartition-id = 0\nnum-partitons = 3\n")
    result = runner.invoke(app, ["silo", "--config", str(silo)])
    assert result.exit_code == 2, result.output
    said = flat(result.output).replace(" ", "")
    assert f"{silo}:unknown[silo]key(s)num-partitons" in said
