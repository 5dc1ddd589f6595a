"""What an outside probe broke (issue 18), each reproduced and guarded, for runs and their
processes: a fresh run never replaces an earlier one's results, a resume stops what the
old server left, processes never outlive what started them, a second server on a live
server's port stops nothing, Ctrl-C of the server says how to go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fedlb.cli import app
from fedlb.deploy import ConfigError, check_run_folder
from fedlb.deploy.operations import SERVER_FILE, stop_left_behind
from fedlb.deploy.processes import FlowerProcess, stop_leftover
from tests.reliability_helpers import runner, said


# ---- a fresh run never replaces an earlier one's results -------------------------------
def test_a_fresh_run_into_a_folder_with_an_earlier_run_is_refused(tmp_path):
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n')
    (tmp_path / "model.pt").write_bytes(b"earlier model")
    result = runner.invoke(
        app, ["server", "--out-dir", str(tmp_path), "--num-silos", "1", "--port", "0"]
    )
    assert result.exit_code == 2, result.output
    text = said(result)
    for words in ("holds an earlier run", "--resume", "--overwrite"):
        assert words in text
    assert (tmp_path / "model.pt").read_bytes() == b"earlier model"  # nothing touched
    # the demo too, and before it writes fresh HE keys over the ones the model needs
    result = runner.invoke(app, ["demo", "--out-dir", str(tmp_path), "--he"])
    assert result.exit_code == 2
    assert "holds an earlier run" in said(result)
    assert not (tmp_path / "keys").exists()
    with pytest.raises(ConfigError, match="is a file"):
        check_run_folder(tmp_path / "model.pt")
    check_run_folder(tmp_path, overwrite=True)  # allowed when asked for
    check_run_folder(tmp_path / "new")


@pytest.mark.slow
def test_a_resume_refuses_while_the_old_server_runs_and_stops_what_it_left(tmp_path):
    """server.json lists the server and the processes it started (PID + start time): a
    live server refuses the resume; a guarded group it left behind is stopped."""
    me = psutil.Process()
    (tmp_path / SERVER_FILE).write_text(
        json.dumps(
            {"server": {"pid": os.getppid(), "started": psutil.Process(os.getppid()).create_time()}}
        )
    )
    with pytest.raises(ConfigError, match="still runs"):
        stop_left_behind(tmp_path)
    leftover = FlowerProcess.start(
        "SuperLink",
        # what a SuperLink's command line says (fedlb stops only what it recognises)
        [sys.executable, "-c", "import time; time.sleep(60)", "flower-superlink", "--port", "0"],
        tmp_path / "h",
        tmp_path / "l.log",
        0,
    )
    (tmp_path / SERVER_FILE).write_text(
        json.dumps(
            {"server": {"pid": me.pid + 10**6, "started": 1.0}, "processes": [leftover.identity()]}
        )
    )
    stop_left_behind(tmp_path)
    assert leftover.process.wait(5) is not None
    assert not stop_leftover(leftover.identity())  # gone: nothing to stop twice


# ---- processes never outlive what started them ------------------------------------------
ORPHAN_MAKER = """
import subprocess, sys, time
from pathlib import Path
from fedlb.deploy.processes import FlowerProcess
# a "SuperLink" that starts a child in a session of its own, as Flower starts a ServerApp
child = (
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(120)'], start_new_session=True); print(p.pid, flush=True); "
    "time.sleep(120)"
)
work = Path(sys.argv[1])
command = [sys.executable, "-c", child]
node = FlowerProcess.start("SuperLink", command, work / "home", work / "link.log", 0)
print(node.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_what_fedlb_starts_dies_with_it_even_outside_its_process_group(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_MAKER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    guard = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (tmp_path / "link.log").read_text().strip():
        time.sleep(0.1)
    escaped = psutil.Process(int((tmp_path / "link.log").read_text().split()[0]))
    assert os.getpgid(escaped.pid) != os.getpgid(guard.pid)  # out of killpg's reach
    time.sleep(1.0)  # the guard has seen it
    parent.send_signal(signal.SIGKILL)  # the owner dies without stopping anything
    parent.wait(5)
    _, alive = psutil.wait_procs([guard, escaped], timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert "is gone: stopping" in (tmp_path / "link.log").read_text()


def test_stopping_a_process_stops_what_escaped_its_group(tmp_path):
    child = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(120)'], start_new_session=True); print(p.pid, flush=True);"
        " time.sleep(120)"
    )
    node = FlowerProcess.start(
        "node", [sys.executable, "-c", child], tmp_path / "h", tmp_path / "n.log", 0
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (tmp_path / "n.log").read_text().strip():
        time.sleep(0.1)
    escaped = psutil.Process(int((tmp_path / "n.log").read_text().split()[0]))
    time.sleep(1.0)
    node.stop()
    _, alive = psutil.wait_procs([escaped], timeout=10)
    assert not alive


@pytest.mark.slow
def test_a_second_server_on_a_live_servers_port_is_refused_and_stops_nothing(tmp_path):
    """Before: the second SuperLink failed to bind, the health check and `flwr` reached
    the live one, and its run was stopped as "left unfinished by an earlier server"."""
    from fedlb.deploy import Federation

    with Federation(tmp_path / "live") as live:
        assert live.link is not None
        port = live.link.port
        result = runner.invoke(
            app, ["server", "--port", str(port), "--out-dir", str(tmp_path / "second")]
        )
        assert result.exit_code == 1, result.output
        text = said(result)
        assert f"port 127.0.0.1:{port} is in use" in text
        assert "Nothing was started or stopped" in text
        assert "Traceback" not in result.output
        assert live.link.alive()  # the live server's SuperLink is untouched
        assert not (tmp_path / "second").exists()  # refused before its out-dir was made


@pytest.mark.slow
def _where_it_hangs(process, out) -> str:
    """A hung process's tree (each process's state and command) and its run's logs' ends."""
    import psutil

    lines = []
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(True)]
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            lines.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:200]}")
            lines += [f"    thread {t.id}" for t in p.threads()][:10]
        except psutil.Error:
            continue
    for log in sorted((out / "processes").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        lines += [f"--- {log.name}", *tail]
    return "\n".join(lines)


@pytest.mark.slow
def test_ctrl_c_of_the_server_says_how_to_go_on(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    server = subprocess.Popen(
        [sys.executable, "-m", "fedlb.cli", "server", "--port", "0", "--out-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C as in a terminal's foreground: a suite run as a background job (`cmd &`
        # in a script: CI, the fresh-clone check) hands its children SIGINT ignored, and
        # Python then never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "server.json").exists():  # its SuperLink is up, waiting for silos
            assert time.monotonic() < deadline, "its SuperLink did not start"
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            time.sleep(0.2)
        time.sleep(1.0)
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it is, not only that it hangs
            pytest.fail(f"fedlb server did not stop on Ctrl-C:\n{_where_it_hangs(server, out)}")
    finally:
        if server.poll() is None:
            server.kill()
    text = " ".join(output.split())
    assert server.returncode == 130, text
    assert f"fedlb server --resume {out.resolve()}" in text
    assert "Traceback" not in text
