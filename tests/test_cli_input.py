"""Bad command-line input is a one-line usage error (exit code 2) that says what is wrong
and what to do, found before anything starts: never a traceback. No server is started:
where the input is valid up to the point tested, run_server / start_silo are replaced."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.deploy import ConfigError, RunConfig, read_toml, server_settings, silo_settings
from fedlb.deploy.settings import check_out_dir

runner = CliRunner()
SILO = ["silo", "--partition-id", "0", "--num-partitions", "2"]
as_root = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere"
)


def said(output: str) -> str:
    """The CLI's error box without box drawing, wrapping or spaces (paths wrap anywhere)."""
    return "".join(output.replace("│", "").split())


def refused(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "".join(message.split()) in said(result.output), result.output


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the CLI gets as far as starting a server or a silo."""
    import fedlb.cli.federation
    import fedlb.cli.silo

    def started(*args, **kwargs):
        raise AssertionError(f"started with {args}")

    monkeypatch.setattr(fedlb.cli.federation, "run_server", started)
    monkeypatch.setattr(fedlb.cli.silo, "start_silo", started)


@pytest.fixture
def binary(tmp_path) -> Path:
    path = tmp_path / "settings.toml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\xf0\xff\xfe")
    return path


# 1. a --config that is a folder or not a text file


@pytest.mark.parametrize("command", [["server"], SILO])
def test_a_config_that_is_a_directory_is_refused(tmp_path, command, nothing_starts):
    refused([*command, "--config", str(tmp_path)], f"config file {tmp_path} is a directory")
    with pytest.raises(ConfigError, match="is a directory: give the TOML file itself"):
        read_toml(tmp_path)


@pytest.mark.parametrize("command", [["server"], SILO])
def test_a_config_that_is_binary_is_refused(binary, command, nothing_starts):
    refused([*command, "--config", str(binary)], f"config file {binary} is not a UTF-8 TOML file")
    with pytest.raises(ConfigError, match="is not a UTF-8 TOML file"):
        server_settings(binary)
    with pytest.raises(ConfigError, match="is not a UTF-8 TOML file"):
        silo_settings(binary)


# 2. an out-dir the results cannot be written to


def test_an_out_dir_that_is_a_file_is_refused(tmp_path, nothing_starts):
    file = tmp_path / "afile"
    file.write_text("")
    refused(["server", "--out-dir", str(file)], f"out-dir {file} is a file, not a folder")
    inside = file / "sub"
    refused(["server", "--out-dir", str(inside)], f"out-dir {inside}: {file} is a file")
    config = tmp_path / "server.toml"  # a settings file's [run] out-dir too
    config.write_text(f"[run]\nout-dir = '{file}'\n")
    refused(["server", "--config", str(config)], f"out-dir {file} is a file")
    refused([*SILO, "--workdir", str(file)], f"workdir {file} is a file, not a folder")
    with pytest.raises(ConfigError, match="is a file, not a folder: give a folder"):
        check_out_dir(file)
    check_out_dir(tmp_path / "new" / "folder")  # made by the run: fine
    assert not (tmp_path / "new").exists()


@as_root
def test_an_out_dir_without_write_permission_is_refused(tmp_path, nothing_starts):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        refused(["server", "--out-dir", str(locked / "run")], "no permission to write in")
        with pytest.raises(ConfigError, match=f"no permission to write in {locked}"):
            check_out_dir(locked)
    finally:
        locked.chmod(0o700)


def test_out_dir_permission_is_what_the_os_says(tmp_path, monkeypatch):
    """The permission case as root too (root may write anywhere: the OS is asked)."""
    import fedlb.deploy.settings

    monkeypatch.setattr(fedlb.deploy.settings.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=f"out-dir {tmp_path}: no permission to write in"):
        check_out_dir(tmp_path)


# 3. fedlb certs and fedlb silo-key


@pytest.mark.parametrize("days", ["-5", "0", "36501"])
def test_certs_refuses_a_validity_that_is_not_positive(tmp_path, days):
    refused(["certs", "--out", str(tmp_path / "c"), "--days", days], "--days must be in 1..36500")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("host", ["", "my host", "é.example", "h" * 65])
def test_certs_refuses_a_host_a_certificate_cannot_name(tmp_path, host):
    refused(["certs", "--out", str(tmp_path / "c"), "--host", host], "--host")


def test_certs_and_silo_key_refuse_an_out_that_is_a_file(tmp_path):
    file = tmp_path / "afile"
    file.write_text("")
    refused(["certs", "--out", str(file)], f"--out {file} is a file, not a folder")
    refused(["silo-key", "--out", str(file), "--name", "a"], f"--out {file} is a file")


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "a b", "x\\y"])
def test_silo_key_refuses_a_name_that_is_not_a_plain_file_name(tmp_path, name):
    refused(["silo-key", "--out", str(tmp_path), "--name", name], "--name must be a plain file")
    assert list(tmp_path.iterdir()) == []


# 4. --port 0: a free port, not 8000


def test_port_0_means_a_free_port(tmp_path, monkeypatch):
    import fedlb.cli.federation
    from fedlb.deploy import processes as deploy
    from fedlb.deploy import run_server

    handed = []
    monkeypatch.setattr(
        fedlb.cli.federation, "run_server", lambda settings, run, **kw: handed.append(settings)
    )
    monkeypatch.setattr(fedlb.cli.federation, "finish", lambda outcome: None)
    result = runner.invoke(app, ["server", "--port", "0", "--out-dir", str(tmp_path), "--no-page"])
    assert result.exit_code == 0, result.output
    assert handed[0].port == 0
    asked = []

    class StopError(Exception):
        pass

    def start_superlink(workdir, host, port, **kwargs):
        asked.append(port)
        raise StopError

    monkeypatch.setattr(deploy, "start_superlink", start_superlink)
    with pytest.raises(StopError):
        run_server(handed[0], RunConfig(num_silos=1))
    assert asked[0] in (None, 0)  # start_superlink: `port or free_port(host)`


# 5. impossible server settings stop the command before run_server


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "port must be in 0..65535, got 70000"),
        (["--port", "-1"], "port must be in 0..65535, got -1"),
        (["--run-timeout", "-1"], "run-timeout must be >= 0 (0: none), got -1.0"),
        (["--run-timeout", "nan"], "run-timeout must be >= 0"),
    ],
)
def test_impossible_server_settings_are_refused_first(args, message, nothing_starts):
    refused(["server", "--num-silos", "1", *args], message)


# 6. a silo's partition


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--partition-id", "0", "--num-partitions", "0"], "num-partitions must be >= 1"),
        (["--partition-id", "-1", "--num-partitions", "3"], "partition-id must be >= 0"),
        (
            ["--partition-id", "3", "--num-partitions", "3"],
            "partition-id 3 is outside 0..2 (num-partitions 3; ids count from 0)",
        ),
    ],
)
def test_a_silo_partition_outside_its_range_is_refused(args, message, nothing_starts):
    refused(["silo", *args], message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "10.0.0.5"], "server must be the fedlb server's host:port"),
        (["--server", "10.0.0.5:70000"], "server must be the fedlb server's host:port"),
        (["--port", "70000"], "port must be in 0..65535 (0: a free one), got 70000"),
        (["--slowdown", "inf"], "slowdown must be >= 1 and finite"),
        (["--slowdown", "nan"], "slowdown must be >= 1 and finite"),
    ],
)
def test_other_impossible_silo_settings_are_refused(args, message, nothing_starts):
    refused([*SILO, *args], message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK not a zip", "not a readable .npz file"),
        ({"x": np.zeros((0, 4)), "y": np.zeros(0)}, "holds no samples (x and y are empty)"),
        (
            {"x": np.zeros((5, 4)), "y": np.zeros(4)},
            "x and y differ in length (5 samples and 4 labels): give one label per sample",
        ),
        ({"y": np.zeros(4)}, "needs arrays x (samples) and y (labels), missing ['x']"),
    ],
)
def test_a_silos_data_file_is_checked_when_it_starts(tmp_path, content, message, nothing_starts):
    """Before: only its first message failed, in its ClientApp. Now `fedlb silo` refuses
    it before its SuperNode starts (or its work dir is made): the file, what is wrong,
    what to do; the ClientApp reads it with the same checks (fedlb.data.load_npz)."""
    data = tmp_path / "hospital.npz"
    if isinstance(content, bytes):
        data.write_bytes(content)
    else:
        np.savez(data, **content)
    work = tmp_path / "work"
    refused(["silo", "--data-path", str(data), "--workdir", str(work)], f"data-path {data}: ")
    refused(["silo", "--data-path", str(data), "--workdir", str(work)], message)
    assert not work.exists()
    with pytest.raises(ConfigError, match=re.escape(message)):
        silo_settings(None, {"data-path": str(data)})


# the run's settings (fedlb server, fedlb demo)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-1"], "seed must be in 0..4294967295"),
        (["--seed", str(2**32)], "seed must be in 0..4294967295"),
        (["--num-rounds", str(2**63)], "num-rounds must fit in 64 bits"),
        (["--learning-rate", "nan"], "learning-rate must be a finite number > 0"),
        (["--round-timeout", "inf"], "round-timeout must be a finite number > 0"),
        (["--silo-test-fraction", "nan"], "silo-test-fraction must be in [0, 1)"),
        (["--min-share", "nan"], "min-share must be in [0, 1]"),
    ],
)
@pytest.mark.parametrize("command", ["server", "demo"])
def test_impossible_run_settings_are_refused(command, args, message, nothing_starts):
    refused([command, *args], message)


def test_demo_refuses_an_infinite_slowdown(nothing_starts):
    refused(["demo", "--slowdowns", "1,inf"], "slowdown must be >= 1 and finite")


# ---- silos on measured step-time curves: a curve is one model's ------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["demo", "--curves", "h200/cnn,cpu1/cnn", "--model", "mlp"],
            "--curves h200/cnn,cpu1/cnn were measured on model cnn, but --model is mlp",
        ),
        (["demo", "--curves", "h200/cnn,cpu1/lenet5"], "curves of models cnn, lenet5"),
        (["demo", "--curves", "h100/cnn"], "unknown step-time curve 'h100/cnn'"),
        (["demo", "--curves", "h200/cnn*0"], "K of NAME*K must be a number > 0"),
        (["demo", "--curves", "h200/cnn", "--slowdowns", "1"], "--slowdowns or --curves, not both"),
        (["demo", "--curves", "h200/cnn,cpu1/cnn", "--num-silos", "3"], "but 2 --curves"),
        # the curves' model must fit the data: LeNet-5 needs 28x28 images, digits are 8x8
        (["demo", "--curves", "h200/lenet5"], "model lenet5 needs 28x28 or 32x32 images"),
        (
            ["experiment", "--silos", "2", "--speeds", "curve:h200/cnn,curve:cpu1/cnn"],
            "measured on model cnn, but the scenario trains mlp",
        ),
        ([*SILO, "--emulated-curve", "h200"], "unknown step-time curve 'h200'"),
        ([*SILO, "--emulated-curve", "h200/cnn", "--slowdown", "2"], "not both"),
    ],
)
def test_a_curve_of_another_model_or_of_none_is_refused(args, message, nothing_starts):
    refused(args, message)


def test_demo_on_curves_trains_their_model_on_silos_that_emulate_them(monkeypatch, tmp_path):
    import fedlb.cli.federation

    started = {}

    def run_server(settings, run, *, local_silos, **kwargs):
        started.update(run=run, silos=local_silos)
        raise KeyboardInterrupt  # nothing more: the settings are what is checked

    monkeypatch.setattr(fedlb.cli.federation, "run_server", run_server)
    result = runner.invoke(
        app, ["demo", "--curves", "h200/cnn*20,cpu1/cnn*20", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 130, result.output
    assert started["run"].model == "cnn"
    assert started["run"].num_silos == 2
    assert [s.emulated_curve for s in started["silos"]] == ["h200/cnn*20", "cpu1/cnn*20"]
    assert [s.emulation for s in started["silos"]] == [
        "emulated curve h200/cnn*20 (clock: measured, sleep-padded)",
        "emulated curve cpu1/cnn*20 (clock: measured, sleep-padded)",
    ]
