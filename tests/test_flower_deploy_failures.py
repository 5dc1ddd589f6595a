"""End to end on real SuperLink and SuperNode processes on loopback, with a process killed
mid-run: a silo is left out and rejoins, fedlb's server resumes from its checkpoint;
everything stopped by PID afterwards."""

from __future__ import annotations

import json

import pytest

from fedlb.deploy.federation import Federation
from tests.flower_deploy_helpers import run_settings, silo_config

pytestmark = pytest.mark.slow


def test_a_silo_killed_mid_run_is_left_out_and_rejoins(tmp_path):
    """SIGKILL one SuperNode: the round goes on without it after the timeout, its B0
    leaves X and the rest is re-divided among the two left, and a restarted SuperNode for
    the same silo rejoins with its B0 (X = Σ B0 of the silos present). Meanwhile a second
    SuperNode claims partition 1 all along: one partition, one vote."""
    out = tmp_path / "out"
    with Federation(tmp_path / "procs") as federation:
        silos = {f"silo-{i}": silo_config(i, 3, 1) for i in range(3)}
        federation.add_silos({**silos, "twin": silo_config(1, 3, 1)})  # silo-1 twice
        victim = federation.silos["silo-2"]

        def on_round(record):
            if record.round == 1:
                victim.kill()
            if any(" left" in e for e in record.events) and "again" not in federation.silos:
                federation.add_silo("again", silo_config(2, 3, 1))  # a new node id

        outcome = federation.run(
            # rounds on warm silos take about a second here: enough of them after the
            # timed-out one for the restarted silo to connect (a few seconds) and rejoin
            run_settings(out, **{"round-timeout": 10.0, "num-rounds": 12, "evaluate-every": 20}),
            on_round=on_round,
            timeout=500,
        )
    assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
    records = outcome.records
    assert [r.round for r in records] == list(range(1, 13))
    for record in records:  # silo-1 counted once, every round
        labels = [s.silo for s in record.silos]
        assert len(labels) == len(set(labels)), (record.round, labels)
    assert any("claims partition 1" in f for f in records[0].failed), records[0].failed
    missed = next(r for r in records if any("no reply" in f for f in r.failed))
    assert any("no reply within the round timeout" in f for f in missed.failed)
    assert any("silo-2 left" in e for e in missed.events), missed.events
    without = next(r for r in records if r.round > missed.round)
    assert {s.silo for s in without.silos} == {"silo-0", "silo-1"}
    assert sum(s.batch_size for s in without.silos) == 32  # 48 less the B0 that left
    back = next(r for r in records if any("joined" in e for e in r.events))
    assert {s.silo: s.batch_size for s in back.silos}["silo-2"] == 16  # its B0 again
    assert sum(s.batch_size for s in back.silos) == 48
    assert {s.silo for s in records[-1].silos} == {"silo-0", "silo-1", "silo-2"}
    assert records[-1].accuracy is not None  # the last round evaluates on all three


def test_fedlb_server_killed_mid_run_resumes_from_its_checkpoint(tmp_path):
    """The operator's path, `fedlb server` and two `fedlb silo` processes, and the server
    machine lost: SIGKILL `fedlb server`, its SuperLink and its ServerApp after round 2 of
    3; the silos keep running and rejoin the new SuperLink (its state in memory: new node
    ids); `fedlb server --resume` goes on from round 3 with the checkpoint's batch sizes,
    by partition; the silos stop cleanly on SIGTERM."""
    import contextlib
    import signal
    import socket
    import subprocess
    import sys
    import time

    import psutil

    from fedlb.deploy.processes import free_port
    from fedlb.flower import load_checkpoint

    port = free_port()
    out = tmp_path / "out"
    fedlb = [sys.executable, "-m", "fedlb.cli"]

    def start_silos():
        # once the SuperLink listens: a silo's SuperNode takes a free port for its own API
        # and could take the server's, were it only chosen and not yet bound
        return [
            subprocess.Popen(
                [
                    *fedlb,
                    "silo",
                    "--server",
                    f"127.0.0.1:{port}",
                    "--partition-id",
                    str(i),
                    "--num-partitions",
                    "2",
                    "--slowdown",
                    str(1 + 2 * i),
                    "--threads",
                    "1",
                    "--workdir",
                    str(tmp_path / f"silo-{i}"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for i in range(2)
        ]

    silos = []
    server_args = ["--round-timeout", "60", "--evaluate-every", "2", "--run-timeout", "300"]
    try:
        first = subprocess.Popen(
            [
                *fedlb,
                "server",
                "--port",
                str(port),
                "--out-dir",
                str(out),
                "--num-silos",
                "2",
                "--num-rounds",
                "3",
                "--local-steps",
                "5",
                "--batch-size",
                "16",
                *server_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        listening = time.monotonic() + 60
        while time.monotonic() < listening:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.2)
        silos = start_silos()
        deadline = time.monotonic() + 240
        done = 0
        while done < 2 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
            try:
                done = load_checkpoint(out).round
            except Exception:  # not written yet
                done = 0
        assert done == 2, first.stdout.read().decode() if first.poll() is not None else done
        listed = json.loads((out / "server.json").read_text())["processes"]
        link_pid = listed[0]["pid"]
        group = [psutil.Process(link_pid), *psutil.Process(link_pid).children(recursive=True)]
        assert any("serverapp" in " ".join(p.cmdline()) for p in group)
        # `fedlb server` alone dies (SIGKILL: nothing of it runs again); what it started
        # (the SuperLink, and the ServerApp in a session of Flower's own) must follow
        # rather than finish the run unseen.
        first.kill()
        first.wait(10)
        _, alive = psutil.wait_procs(group, timeout=30)
        assert not [p for p in alive if p.status() != "zombie"], alive
        stopped_at = load_checkpoint(out)

        resumed = subprocess.run(
            [*fedlb, "server", "--resume", str(out), "--run-timeout", "300"],
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
    finally:
        outputs = []
        for silo in silos:
            silo.send_signal(signal.SIGTERM)
            outputs.append(silo.communicate(timeout=60)[0].decode())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = " ".join(resumed.stdout.split())
    assert f"resuming {out}: rounds 1-{stopped_at.round} of 3 done" in said, said
    assert "completed: round" in said, said
    assert "round 3" in said
    assert all(silo.returncode == 0 for silo in silos), outputs
    assert all("stopped" in output for output in outputs)
    rows = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert sorted({(r["round"], r["silo"]) for r in rows}) == [
        (k, f"silo-{i}") for k in (1, 2, 3) for i in (0, 1)
    ]
    assert len(rows) == 6  # each round once
    # The new SuperLink keeps its state in memory: the silos rejoined under new node ids,
    # and round 3 starts from the checkpoint's balance (by partition), not from B0 again.
    labels = stopped_at.strategy["labels"]
    planned = {labels[n]: b for n, b in stopped_at.strategy["manager"]["sizes"].items()}
    third = {r["silo"]: r["batch_size"] for r in rows if r["round"] == 3}
    assert third == planned
    assert third != {n: 16 for n in third}
    assert not {str(r["node"]) for r in rows if r["round"] == 3} & set(labels)
    assert any("rejoined as" in e for r in rows if r["round"] == 3 for e in r["events"])
    assert load_checkpoint(out).round == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_after"] == stopped_at.round
    walls = {r["round"]: r["wall_s"] for r in rows}
    assert summary["wall_s"] >= sum(walls.values())  # every round's, not only this process's
    assert summary["process_wall_s"] < summary["wall_s"] + 60
