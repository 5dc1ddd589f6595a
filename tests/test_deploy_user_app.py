"""A user's own Flower app deployed by fedlb: `fedlb server --app DIR` and `fedlb silo --app
DIR` (fedlb.deploy.user_app). Quick: the settings each command refuses, and what the
server and a silo hand Flower's processes. Slow: Flower's quickstart-pytorch (its
strategy wrapped in LoadBalanced, its ClientApp with balance_mod) run by a real `fedlb
server --app` and three `fedlb silo --app` processes on 127.0.0.1; and the same server
killed after round 1 and resumed with `--resume`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedlb.cli import app as cli
from fedlb.deploy import ConfigError, server_settings, silo_settings
from tests.apps.adopt import adopt
from tests.dropin_helpers import wait_listening

runner = CliRunner()
FEDLB = [sys.executable, "-m", "fedlb.cli"]
SPEEDS = (240.0, 120.0, 60.0)  # samples/s by partition-id: 4 : 2 : 1


def said(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def quickstart(tmp_path) -> Path:
    """Flower's quickstart-pytorch, its FedAdam wrapped in LoadBalanced (tests/apps)."""
    app, _ = adopt("quickstart_pytorch", tmp_path, strategy="fedadam")
    return app


@pytest.fixture
def nothing_starts(monkeypatch):
    import fedlb.cli.federation
    import fedlb.cli.silo

    def started(*args, **kwargs):
        raise AssertionError(f"started with {args}")

    monkeypatch.setattr(fedlb.cli.federation, "run_server", started)
    monkeypatch.setattr(fedlb.cli.silo, "start_silo", started)


def refused(args: list[str], words: str) -> str:
    result = runner.invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "".join(words.split()) in "".join(said(result.output).split()), result.output
    return result.output


# quick: what the server refuses with --app, before anything starts


def test_fedlbs_own_run_settings_are_refused_with_an_app(quickstart, nothing_starts):
    output = refused(
        ["server", "--app", str(quickstart), "--dataset", "digits", "--learning-rate", "0.1"],
        "dataset, learning-rate: settings of fedlb's own app, which mean nothing to yours",
    )
    assert "--run-config" in output
    with pytest.raises(ConfigError, match="model: settings of fedlb's own app"):
        server_settings(None, {"app": str(quickstart)}, {"model": "lenet"})
    settings, run = server_settings(None, {"app": str(quickstart)}, {"num-silos": 4})
    assert run.num_silos == 4
    assert settings.user_app() is not None


def test_a_server_toml_names_the_app_and_its_run_config(quickstart, tmp_path):
    path = tmp_path / "server.toml"
    path.write_text(
        f'[server]\napp = "{quickstart}"\nrun-config = "num-server-rounds=2 local-epochs=2"\n'
        "[run]\nnum-silos = 3\n"
    )
    settings, _run = server_settings(path)
    app = settings.user_app()
    assert app is not None
    assert app.folder == quickstart.resolve()
    assert app.overrides == {"num-server-rounds": 2, "local-epochs": 2}
    assert app.num_rounds == 2
    assert app.clientapp_module == "pytorchexample.client_app"
    path.write_text(f'[server]\napp = "{quickstart}"\n[run]\nlocal-steps = 5\n')
    with pytest.raises(ConfigError, match="local-steps: settings of fedlb's own app"):
        server_settings(path)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--run-config", "num-server-rounds=2"],
            "run-config overrides the run config of your own app",
        ),
        (["--app", "{app}", "--run-config", "rounds=2"], "run-config rounds: not in the app's"),
        (["--app", "{app}", "--run-config", "garbage"], "sets nothing: give key=value pairs"),
        (["--app", "{app}", "--run-config", "a=b c"], "The provided configuration string"),
        (["--app", "{missing}"], "no such folder"),
        (["--app", "{empty}"], "no pyproject.toml in it"),
    ],
)
def test_an_app_the_server_cannot_run_is_refused(tmp_path, quickstart, args, words, nothing_starts):
    (tmp_path / "empty").mkdir()
    places = {"app": quickstart, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    refused(["server", *[a.format(**places) for a in args]], words)


def test_a_silo_refuses_a_folder_without_an_app_and_an_unknown_clock(tmp_path, nothing_starts):
    silo = ["silo", "--partition-id", "0", "--num-partitions", "3"]
    refused([*silo, "--app", str(tmp_path)], "no pyproject.toml in it")
    refused([*silo, "--emulated-clock", "virtual"], "emulated-clock must be one of measured, model")


def test_a_silo_with_an_app_preloads_its_clientapp_from_its_folder(quickstart, monkeypatch):
    """The silo's warm launcher gets the app's folder for its import path and the app's
    clientapp module to import once; its node config says the model clock."""
    from fedlb.deploy import operations, start_silo
    from fedlb.deploy.warm import launcher_command

    settings = silo_settings(
        None,
        {
            "partition-id": 1,
            "num-partitions": 3,
            "emulated-speed": 120.0,
            "emulated-clock": "model",
            "app": str(quickstart),
        },
    )
    assert settings.node_config()["emulated-clock"] == "model"
    assert "clock: model" in settings.emulation
    seen = {}

    def launched(*args, **kwargs):
        seen.update(kwargs)
        raise operations.JoinError("stop here")

    monkeypatch.setattr(operations, "start_supernode", launched)
    with pytest.raises(operations.JoinError):
        start_silo(settings)
    assert seen["preload"] == ["pytorchexample.client_app"]
    assert seen["import_paths"] == [quickstart.resolve()]
    command = launcher_command(
        "127.0.0.1:1", Path("s"), ["flower-supernode"], seen["preload"], import_paths=[quickstart]
    )
    assert command[command.index("--path") + 1] == str(quickstart)
    assert command.index("--path") < command.index("--preload")


def test_the_server_hands_its_app_the_names_fedlb_flower_reads():
    from fedlb.deploy import user_app
    from fedlb.flower import run_dir

    assert user_app.RUN_DIR_ENV == run_dir.RUN_DIR_ENV
    assert user_app.RESUME_ENV == run_dir.RESUME_ENV


def test_a_resume_keeps_the_app_it_was_started_with(quickstart, tmp_path, monkeypatch):
    """--resume of an --app run takes the app and run-config from its app.json: another
    app, other overrides or --num-rounds are refused; a changed app is said."""
    from fedlb.deploy import operations, resume_settings
    from fedlb.deploy.user_app import UserApp

    out = tmp_path / "out"
    app = UserApp.read(quickstart, "num-server-rounds=3")
    app.keep(out, 3)

    class Stopped:  # a checkpoint after round 1 of 3
        round, num_rounds = 1, 3

    monkeypatch.setattr(operations, "load_checkpoint", lambda folder: Stopped())
    settings, run = resume_settings(out)
    assert Path(settings.app) == quickstart.resolve()
    assert run.num_silos == 3
    assert run.resume == str(out.resolve())
    kept = settings.user_app()
    assert kept is not None
    assert kept.changed_since(out) is None
    same = {"app": str(quickstart), "run-config": "num-server-rounds=3"}
    assert resume_settings(out, server=same)[0].app == settings.app
    with pytest.raises(ConfigError, match="goes on with the app and run-config it was started"):
        resume_settings(out, server={**same, "run-config": "num-server-rounds=4"})
    with pytest.raises(ConfigError, match="drop --num-rounds"):
        resume_settings(out, 5)
    (quickstart / "pytorchexample" / "task.py").write_text("# changed\n", "utf-8")
    assert "changed since the run started" in (kept.changed_since(out) or "")


# slow: real processes on 127.0.0.1


def _silos(app: Path, port: int, where: Path) -> list[subprocess.Popen[bytes]]:
    """Three `fedlb silo --app` processes at 4 : 2 : 1 on the model clock."""
    return [
        subprocess.Popen(
            [
                *FEDLB,
                "silo",
                "--app",
                str(app),
                "--server",
                f"127.0.0.1:{port}",
                "--partition-id",
                str(i),
                "--num-partitions",
                "3",
                "--emulated-speed",
                str(speed),
                "--emulated-clock",
                "model",
                "--threads",
                "1",
                "--workdir",
                str(where / f"silo-{i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=ENV,
        )
        for i, speed in enumerate(SPEEDS)
    ]


def _stop(silos: list[subprocess.Popen[bytes]]) -> list[str]:
    outputs = []
    for silo in silos:
        silo.send_signal(signal.SIGTERM)
    for silo in silos:
        try:
            outputs.append(silo.communicate(timeout=60)[0].decode())
        except subprocess.TimeoutExpired:
            os.killpg(silo.pid, signal.SIGKILL)
            outputs.append(silo.communicate()[0].decode())
    return outputs


def _server(app: Path, port: int, out: Path, rounds: int) -> list[str]:
    return [
        *FEDLB,
        "server",
        "--app",
        str(app),
        "--run-config",
        f"num-server-rounds={rounds}",
        "--port",
        str(port),
        "--out-dir",
        str(out),
        "--num-silos",
        "3",
        "--run-timeout",
        "400",
    ]


ENV = {**os.environ, "COLUMNS": "200"}  # the round tables unwrapped


def federation(app: Path, where: Path, rounds: int, timeout: float = 480):
    """`fedlb server --app APP` for `rounds` and three `fedlb silo --app APP` (SPEEDS),
    run to the server's end on free ports of 127.0.0.1: (the server's exit code, its
    output, the silos' outputs, its out-dir); everything started is stopped by pid."""
    from fedlb.deploy.processes import free_port

    port, out = free_port(), where / "out"
    server = subprocess.Popen(
        _server(app, port, out, rounds),
        cwd=where,  # the app saves final_model.pt where its ServerApp runs
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=ENV,
    )
    silos = []
    try:
        wait_listening(port, server)
        silos = _silos(app, port, where)
        output = server.communicate(timeout=timeout)[0]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        outputs = _stop(silos)
    return server.returncode, output, outputs, out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _sizes(rows: list[dict], k: int) -> dict[str, int]:
    return {r["silo"]: r["batch_size"] for r in rows if r["round"] == k}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fedlb_server_runs_a_users_app_on_its_silos(tmp_path, quickstart):
    """quickstart-pytorch with LoadBalanced(FedAdam) under `fedlb server --app`, three
    `fedlb silo --app` at 4 : 2 : 1: it completes, its rounds are on the console and in
    the out-dir's rounds.jsonl, round 2 is the guard's look (every silo at its B0, the
    slow silos' steps cut) and the sizes it hands round 3 follow the speeds, X = 96 kept,
    summary.json is written; the silos' warm servers imported the app's ClientApp."""
    code, raw, outputs, out = federation(quickstart, tmp_path, 2)
    output = raw.decode()
    text = said(output)
    assert code == 0, output[-4000:]
    assert "your app:" in text
    assert "FAB sha256" in text
    assert "round 1 — clock: model" in text, text
    assert "round 2 — clock: model" in text, text
    assert "completed: rounds 1-2" in text, text
    rows = _rows(out)
    assert sorted({r["round"] for r in rows}) == [1, 2]
    assert set(_sizes(rows, 1).values()) == {32}
    assert set(_sizes(rows, 2).values()) == {32}  # the look
    steps = {r["silo"]: r["local_steps"] for r in rows if r["round"] == 2}
    assert steps["silo-0"] > steps["silo-2"], steps
    following = {r["silo"]: r["next_batch_size"] for r in rows if r["round"] == 2}
    events = " ".join(e for r in rows if r["round"] == 2 for e in r["events"])
    if "the stability guard's look: calm" in events:  # the probe's sizes next
        assert following["silo-0"] > following["silo-1"] > following["silo-2"], following
    assert sum(following.values()) == 96
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert json.loads((out / "app.json").read_text())["run-config"] == {"num-server-rounds": 2}
    assert (tmp_path / "final_model.pt").exists()  # the app's own file, where it runs
    assert all("FAB sha256" in o for o in outputs), outputs
    log = (tmp_path / "silo-0" / "silo-0.log").read_text()
    assert "pytorchexample.client_app" in log  # the warm server imported it once


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_users_app_goes_on_after_its_server_is_killed(tmp_path):
    """LoadBalancedFedAvg in quickstart-pytorch, 3 rounds: `fedlb server --app` SIGKILLed
    once round 1 is checkpointed (what it started dies with it), `fedlb server --resume`
    goes on with the same app and run-config from the checkpoint, and the silos rejoin:
    every round on record once, the resumed rounds at the checkpoint's sizes."""
    import psutil

    from fedlb.deploy.processes import free_port
    from fedlb.flower import load_checkpoint

    app, _ = adopt("quickstart_pytorch", tmp_path, strategy=None)
    port, out = free_port(), tmp_path / "out"
    first = subprocess.Popen(
        _server(app, port, out, 3),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=ENV,
    )
    silos = []
    try:
        wait_listening(port, first)
        silos = _silos(app, port, tmp_path)
        deadline, done = time.monotonic() + 400, 0
        while done < 1 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
            with contextlib.suppress(Exception):  # not written yet
                done = load_checkpoint(out).round
        assert done >= 1, first.stdout.read().decode() if first.poll() is not None else done
        link = json.loads((out / "server.json").read_text())["processes"][0]["pid"]
        group = [psutil.Process(link), *psutil.Process(link).children(recursive=True)]
        first.kill()
        first.wait(10)
        _, alive = psutil.wait_procs(group, timeout=30)
        assert not [p for p in alive if p.status() != "zombie"], alive
        stopped_at = load_checkpoint(out)
        assert stopped_at.round < 3
        resumed = subprocess.run(
            [*FEDLB, "server", "--resume", str(out), "--run-timeout", "400"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=480,
            check=False,
            env=ENV,
        )
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        _stop(silos)
    text = said(resumed.stdout)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert f"resuming {out}: round" in text, text
    assert "of 3 done" in text, text
    assert "your app:" in text
    rows = _rows(out)
    assert sorted({(r["round"], r["silo"]) for r in rows}) == [
        (k, f"silo-{i}") for k in (1, 2, 3) for i in range(3)
    ]
    assert len(rows) == 9  # each round once
    # The new SuperLink's silos are matched to the checkpoint's balance by partition (the
    # strategy asks each its partition, 20 s at most): where all three answered in time,
    # the first resumed round runs at the checkpoint's sizes. On a loaded machine a
    # silo's warm server, restarted with its SuperNode, can miss that question: it then
    # joins at its B0 (fedlb.flower's carry-over; said in the round's events).
    labels = stopped_at.strategy["labels"]
    planned = {labels[n]: b for n, b in stopped_at.strategy["manager"]["sizes"].items()}
    events = " ".join(e for r in rows if r["round"] == stopped_at.round + 1 for e in r["events"])
    assert "the server restarted" in events, events
    if all(f"silo-{i} rejoined as" in events for i in range(3)):
        assert _sizes(rows, stopped_at.round + 1) == planned
    assert load_checkpoint(out).round == 3
    assert json.loads((out / "summary.json").read_text())["resumed_after"] == stopped_at.round


def test_a_failed_run_ends_non_zero_with_its_serverapp_logs_last_lines(tmp_path, capsys):
    """What `fedlb server` says when a run fails: the reason, then the ServerApp log's
    last lines (a user's app's own traceback ends there)."""
    import typer

    from fedlb.cli.federation import finish
    from fedlb.deploy import RunOutcome

    log = tmp_path / "serverapp-7.log"
    log.write_text("INFO : starting\nTraceback (most recent call last):\nKeyError: 'lr'\n")
    outcome = RunOutcome("7", "finished:failed", log_path=log, app=tmp_path)
    with pytest.raises(typer.Exit) as ended:
        finish(outcome)
    assert ended.value.exit_code == 1
    assert outcome.log_tail.endswith("KeyError: 'lr'")
    shown = said(capsys.readouterr().out)
    assert "failed (no rounds on record): it ended as finished:failed" in shown, shown
    assert "which ends with: INFO : starting Traceback" in shown
    assert "KeyError: 'lr'" in shown


def test_the_wait_app_returns_once_the_silos_joined_and_fails_with_the_reason():
    """fedlb's wait app, submitted before a user's app: done once num-silos silos are
    listed; after join-timeout, a failure that says how many joined and what to do."""
    from fedlb.deploy.waiting import wait_for_silos

    class Grid:
        def __init__(self, counts):
            self.counts = iter(counts)

        def get_node_ids(self):
            return list(range(next(self.counts, 0)))

    assert wait_for_silos(Grid([1, 2, 3]), 3, timeout=5, poll_s=0.01) == 3
    with pytest.raises(RuntimeError, match="only 0 of 3 silos joined within 0 s; start the"):
        wait_for_silos(Grid([]), 3, timeout=0.05, poll_s=0.01)
