"""What an outside probe broke (issue 18), each reproduced and guarded: results lost or
taken for another run's, processes outliving what started them, a partition counted
twice, failed runs reported as successes, damaged files read without a word."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from flwr.app import Array, ArrayRecord
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.deploy import ConfigError, RunOutcome, check_run_folder
from fedlb.deploy.federation import RoundWatcher
from fedlb.deploy.operations import SERVER_FILE, stop_left_behind
from fedlb.deploy.processes import FlowerProcess, stop_leftover
from fedlb.flower import (
    Checkpoint,
    CheckpointError,
    RoundRecord,
    load_checkpoint,
    records_from_json_lines,
    save_checkpoint,
)
from fedlb.flower.checkpoint import start_run_identity

runner = CliRunner()


def said(result) -> str:
    """The output as one line, without the usage box rich draws around errors."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


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


# ---- a checkpoint belongs to its run; damage is detected ---------------------------------
def checkpoint(settings=None, round_=1):
    arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32))})
    return Checkpoint(round_, 3, arrays, {"pending": None}, settings or {"seed": 1})


def test_a_checkpoint_from_another_runs_folder_is_refused(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    start_run_identity(ours, {"seed": 1})
    start_run_identity(theirs, {"seed": 1})
    save_checkpoint(theirs, checkpoint())
    assert load_checkpoint(theirs).round == 1
    (ours / "checkpoint.npz").write_bytes((theirs / "checkpoint.npz").read_bytes())
    with pytest.raises(CheckpointError, match="copied from another run"):
        load_checkpoint(ours)
    bare = tmp_path / "bare"  # a folder without a run.json: no run to belong to
    bare.mkdir()
    (bare / "checkpoint.npz").write_bytes((theirs / "checkpoint.npz").read_bytes())
    with pytest.raises(CheckpointError, match="copied from another run"):
        load_checkpoint(bare)
    # the same run's id with other settings: refused too
    save_checkpoint(ours, checkpoint({"seed": 2}))
    with pytest.raises(CheckpointError, match="settings"):
        load_checkpoint(ours)
    # and the resume path says so as a usage error
    result = runner.invoke(app, ["server", "--resume", str(ours)])
    assert result.exit_code == 2
    assert "settings" in said(result)


def test_a_damaged_checkpoint_is_refused(tmp_path):
    start_run_identity(tmp_path, {"seed": 1})
    save_checkpoint(tmp_path, checkpoint())
    path = tmp_path / "checkpoint.npz"
    with np.load(path) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    entries["array-0"][2] += 1e-3  # one value changed, the file re-saved whole
    np.savez(path, **entries)
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(tmp_path)


def test_decrypt_refuses_a_model_with_a_flipped_bit_and_a_damaged_file(tmp_path):
    from fedlb.flower import save_encrypted
    from fedlb.flower.he import encrypt_record
    from fedlb.he import load_context, write_keys
    from fedlb.security.digests import write_digest

    keys = write_keys(tmp_path / "keys")
    record = encrypt_record(
        load_context(keys.secret, "silo"),
        ArrayRecord({"w": Array(np.linspace(-1, 1, 32, dtype=np.float32))}),
    )
    model = save_encrypted(record, tmp_path / "model.ckks.npz")
    write_digest(model)
    ok = runner.invoke(
        app, ["decrypt", str(model), "--context", str(keys.secret), "--out", str(tmp_path / "a.pt")]
    )
    assert ok.exit_code == 0, ok.output
    with np.load(model) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    entries["ckks/0"][200] ^= 0x01  # one bit of one ciphertext
    with model.open("wb") as handle:
        np.savez(handle, **entries)
    result = runner.invoke(
        app, ["decrypt", str(model), "--context", str(keys.secret), "--out", str(tmp_path / "b.pt")]
    )
    assert result.exit_code == 2, result.output
    assert "does not match its digest" in said(result)
    assert not (tmp_path / "b.pt").exists()
    model.write_bytes(b"PK\x03\x04 not really a zip")  # damaged, without a digest
    (tmp_path / "model.ckks.npz.sha256").unlink()
    result = runner.invoke(app, ["decrypt", str(model), "--context", str(keys.secret)])
    assert result.exit_code == 2
    assert "damaged" in said(result)
    assert "Traceback" not in result.output


# ---- a run that trained nothing, or fewer rounds than asked, is a failure -----------------
def record(number, silos=True, failed=()):
    from fedlb.flower.records import SiloRound

    silo = SiloRound("silo-0", 1, 16, 5, 1.0, 0.0, 1.0, 0.0, 0.5, 100, 0.0, 16)
    return RoundRecord(
        number,
        "measured",
        [silo] if silos else [],
        1.0,
        1.0,
        1.0,
        0.0,
        1.0,
        failed=list(failed),
    )


def test_rounds_without_updates_are_on_record_and_fail_the_run(tmp_path):
    lost = record(2, silos=False, failed=["node-7: ClientApp raised: std::bad_alloc"])
    lines = record(1).json_lines() + lost.json_lines()
    back = records_from_json_lines(lines, complete_only=True)
    assert [r.round for r in back] == [1, 2]
    assert back[1].silos == []
    assert back[1].failed == lost.failed
    outcome = RunOutcome("1", "finished:completed", back, num_rounds=2)
    assert not outcome.ok
    assert "std::bad_alloc" in outcome.problem
    short = RunOutcome("1", "finished:completed", [record(1)], num_rounds=3)
    assert not short.ok
    assert "[2, 3]" in short.problem
    assert RunOutcome("1", "finished:completed", [record(2)], first_round=2, num_rounds=2).ok
    assert "ended as finished:failed" in RunOutcome("1", "finished:failed").problem


def test_the_round_watcher_shows_each_of_this_runs_rounds_once(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(line + "\n" for k in (1, 2, 3) for line in record(k).json_lines()))
    watcher = RoundWatcher(path, first_round=3)  # a resume after round 2
    assert [r.round for r in watcher.poll()] == [3]
    path.write_text("".join(line + "\n" for k in (1, 2) for line in record(k).json_lines()))
    assert watcher.poll() == []  # trimmed by the resume: nothing new
    with path.open("a") as handle:
        handle.write("".join(line + "\n" for line in record(4).json_lines()))
    assert [r.round for r in watcher.poll()] == [4]
    assert watcher.poll() == []


# ---- TLS files that no silo would accept are refused before a SuperLink starts -------------
def test_server_certificates_silos_would_refuse_are_refused_up_front(tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from fedlb.deploy import ServerSettings
    from fedlb.security import TlsError, make_certificates

    good = make_certificates(tmp_path / "good", ["127.0.0.1", "localhost"])
    good.check("127.0.0.1")
    good.check("0.0.0.0")  # a wildcard address: names not checked
    with pytest.raises(TlsError, match=r"not 10\.1\.2\.3.*--host 10\.1\.2\.3"):
        good.check("10.1.2.3")
    other = make_certificates(tmp_path / "other", ["127.0.0.1"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.crt").write_bytes(other.ca.read_bytes())  # another federation's CA
    (mixed / "server.crt").write_bytes(good.cert.read_bytes())
    (mixed / "server.key").write_bytes(good.key.read_bytes())
    result = runner.invoke(
        app, ["server", "--certs", str(mixed), "--num-silos", "1", "--port", "0"]
    )
    assert result.exit_code == 2
    assert "was not signed by" in said(result)
    (mixed / "ca.crt").write_bytes(good.ca.read_bytes())
    (mixed / "server.key").write_bytes(other.key.read_bytes())  # another certificate's key
    with pytest.raises(ConfigError, match="is not the key of"):
        ServerSettings.from_mapping({"certs": str(mixed)})
    # expired: the same certificate re-signed with a validity that ended yesterday
    from cryptography.hazmat.primitives import serialization

    ca_key = serialization.load_pem_private_key((tmp_path / "good" / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate(good.cert.read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, False
        )
        .sign(ca_key, hashes.SHA256())
    )
    (mixed / "server.crt").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    (mixed / "server.key").write_bytes(good.key.read_bytes())
    with pytest.raises(ConfigError, match="not now: make new certificates"):
        ServerSettings.from_mapping({"certs": str(mixed)})


def test_runs_side_by_side_on_the_wall_clock():
    """`fedlb demo --compare`'s table: the time to the accuracy both runs reached."""
    from rich.console import Console

    from fedlb.flower import compare_runs
    from fedlb.flower.records import wall_to

    def run(walls, accuracies):
        records = []
        for number, (wall, accuracy) in enumerate(zip(walls, accuracies, strict=True), 1):
            r = record(number)
            r.wall_s, r.accuracy = wall, accuracy
            records.append(r)
        return records

    fedavg = run([20.0, 20.0, 20.0, 20.0], [0.3, 0.6, 0.7, 0.8])
    fedlb = run([12.0, 12.0, 12.0, 12.0], [0.3, 0.5, 0.7, 0.85])
    assert wall_to(fedavg, 0.8) == 80.0
    assert wall_to(fedlb, 0.8) == 48.0
    assert wall_to(fedlb, 0.9) is None
    console = Console(width=200, record=True)
    console.print(compare_runs({"FedAvg": fedavg, "fedlb": fedlb, "none": []}))
    text = console.export_text()
    assert "the same accuracy: 0.800" in text
    assert "1.67x" in text  # 80 s against 48 s


def test_a_long_reason_does_not_wrap_the_round_table_one_word_per_row():
    """Issue 35: a silo's reason for sending no update filled the round table's silo
    column, one word per row. The table names the silo; the reason follows it, whole
    (the record as it prints itself: fedlb server's console and the ServerApp's log)."""
    from rich.console import Console

    reason = (
        "node-5021877373327894310: ClientApp raised ValueError: /data/hospital-3.npz: x and "
        "y differ in length (100 samples and 99 labels): give one label per sample"
    )
    console = Console(record=True, width=100)
    console.print(record(4, failed=[reason]))
    lines = console.export_text().splitlines()
    below = next(i for i, line in enumerate(lines) if "no update:" in line)
    table = lines[:below]
    assert [line.split()[:2] for line in table if "node-" in line] == [
        ["node-5021877373327894310", "–"]
    ]
    assert not [line for line in table if "ClientApp" in line or "labels" in line]
    assert " ".join(" ".join(lines[below:]).split()) == f"no update: {reason}"


def test_rounds_written_before_the_timeline_fields_still_read():
    line = json.loads(record(1).json_lines()[0])
    for key in ("start_s", "silo_wall_s"):
        line.pop(key)
    (back,) = records_from_json_lines([json.dumps(line)])
    assert back.silos[0].start_s is None
    assert back.silos[0].wall_s is None


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


def test_a_batch_no_silo_can_fill_is_refused_before_anything_starts(tmp_path):
    """Before: --batch-size 1000000000 was accepted, each silo's ClientApp grew to ~7 GB."""
    for flags, limit in (
        (["--batch-size", "1000000000"], "batch-size 1000000000 is more than any silo's"),
        (["--max-batch", "1000000000"], "max-batch 1000000000 is more than the federation's"),
    ):
        out = tmp_path / flags[0].strip("-")
        result = runner.invoke(app, ["server", "--port", "0", "--out-dir", str(out), *flags])
        assert result.exit_code == 2, result.output
        assert limit in said(result)
        assert "give " in said(result)
        assert not out.exists()


def test_decrypt_checks_a_model_that_lost_its_digest_file(tmp_path):
    """Before: a bit-flipped model.ckks.npz without its .sha256 decrypted, exit 0, to
    weights off by 6.8e7. Its digest now travels inside the file; a file with neither
    digest (an older fedlb's) is refused unless --unchecked."""
    from fedlb.flower import save_encrypted
    from fedlb.flower.he import INNER_DIGEST, encrypt_record
    from fedlb.he import load_context, write_keys

    keys = write_keys(tmp_path / "keys")
    record = encrypt_record(
        load_context(keys.secret, "silo"),
        ArrayRecord({"w": Array(np.linspace(-1, 1, 32, dtype=np.float32))}),
    )
    model = save_encrypted(record, tmp_path / "model.ckks.npz")  # no .sha256 beside it

    def decrypt(*extra):
        return runner.invoke(
            app,
            [
                "decrypt",
                str(model),
                "--context",
                str(keys.secret),
                "--out",
                str(tmp_path / "m.pt"),
                *extra,
            ],
        )

    assert decrypt().exit_code == 0  # the digest inside vouches for it
    with np.load(model) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    flipped = dict(entries)
    flipped["ckks/0"] = flipped["ckks/0"].copy()
    flipped["ckks/0"][200] ^= 0x01
    with model.open("wb") as handle:
        np.savez(handle, **flipped)
    result = decrypt()
    assert result.exit_code == 2, result.output
    assert "does not match the digest written inside it" in said(result)
    older = {k: v for k, v in entries.items() if k != INNER_DIGEST}  # as an older fedlb wrote
    with model.open("wb") as handle:
        np.savez(handle, **older)
    result = decrypt()
    assert result.exit_code == 2, result.output
    assert "carries no digest" in said(result)
    assert "--unchecked" in said(result)
    assert decrypt("--unchecked").exit_code == 0


def test_a_folder_that_cannot_be_made_is_one_line_with_its_path():
    """Before: a traceback. /proc refuses new folders even to root (os.access says yes)."""
    import errno
    import subprocess
    import sys

    from fedlb.cli.common import file_error

    for command in (
        ["server", "--port", "0", "--out-dir"],
        ["experiment", "--rounds", "1", "--out"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "fedlb.cli", *command, "/proc/fedlb-no-such-folder"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        text = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1, text
        assert "fedlb stopped: /proc/fedlb-no-such-folder" in text
        assert "Traceback" not in text
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/rounds.jsonl")
    assert file_error(full).startswith("the disk is full at /data/run/rounds.jsonl")
    read_only = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x")
    assert "read-only filesystem" in file_error(read_only)
