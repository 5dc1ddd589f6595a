"""End to end: a real SuperLink and real SuperNodes on loopback, fedlb's app submitted
with `flwr run`, everything stopped by PID afterwards."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedlb.deploy import RunConfig
from fedlb.deploy.federation import Federation

pytestmark = pytest.mark.slow

BASE_SPEED = 200.0  # samples/s of a factor-1 silo: sleep-padding dominates real compute


def silo_config(i, n, factor):
    return {
        "partition-id": i,
        "num-partitions": n,
        "emulated-speed": BASE_SPEED / factor,
        "threads": 1,
    }


def record_port(out_dir):
    """The SuperLink's public port, as the server recorded it in server.json."""
    return json.loads((out_dir / "server.json").read_text())["port"]


def run_settings(out_dir, **changes):
    values = {
        **RunConfig().to_mapping(),
        "num-silos": 3,
        "num-rounds": 3,
        "local-steps": 5,
        "batch-size": 16,
        "evaluate-every": 3,
        "learning-rate": 0.1,
        "out-dir": str(out_dir),
    }
    values.update(changes)
    return values


def probe_public_door(address, control_address, ca=None):
    """What a stranger who reaches the server's public port gets from the Control API
    during a live run, with the federation's CA when it has TLS (all it needs): nothing.
    Returns the live run's id (from the control door, on this machine)."""
    import ssl
    import urllib.error
    import urllib.request

    from fedlb.deploy.control import Control
    from fedlb.deploy.processes import DeployError

    with Control(control_address) as own:  # the loopback door answers on this machine
        live = [run for run, status in own.runs().items() if status == "running"]
    assert len(live) == 1, live
    with Control(address, root_certificates=ca) as stranger:
        for call in (stranger.runs, lambda: stranger.stop_run(live[0])):
            with pytest.raises(DeployError, match="not served on this port"):
                call()
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    scheme = "https" if ca is not None else "http"
    for method in ("list-runs", "list-nodes", "stop-run", "register-supernode"):
        request = urllib.request.Request(
            f"{scheme}://{address}/v1/control/{method}",
            data=b"{}",
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5, context=context)
        assert refused.value.code == 403
        assert b"Control API listens on 127.0.0.1:" in refused.value.read()
    return live[0]


def test_three_silos_with_speed_factors_1_2_4(tmp_path):
    """From Python, without the CLI (the deployment as a library): the server's and the
    silos' settings from the example files with the caller's values on top, the silos
    started once the SuperLink is up, `run_server` blocking until the run ends and
    stopping what it started."""
    from pathlib import Path

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

    out = tmp_path / "out"
    silos = []

    def start_silos(ready):  # once the SuperLink is up, before round 1; side by side
        from concurrent.futures import ThreadPoolExecutor

        settings = [
            silo_settings(
                Path(f"silos/silo-{i}.toml"),
                {
                    "server": ready.address,
                    "slowdown": float(factor),
                    "base-speed": BASE_SPEED,
                    "workdir": str(tmp_path / f"silo-{i}"),
                },
            )
            for i, factor in enumerate((1, 2, 4))
        ]
        with ThreadPoolExecutor(len(settings)) as pool:
            silos.extend(pool.map(start_silo, settings))

    rounds = []
    probed = []

    def on_round(record):  # a stranger on the public port tries to list and stop the run
        rounds.append(record)
        if record.round == 1:
            control = json.loads((out / "server.json").read_text())["control"]
            probed.append(probe_public_door(f"127.0.0.1:{record_port(out)}", control))

    server, run = server_settings(
        Path("server/server.toml"),
        {"port": 0, "out-dir": str(out), "run-timeout": 400.0},
        {k: v for k, v in run_settings(out, **{"keep-updates": 1}).items() if k != "out-dir"},
    )
    try:
        outcome = run_server(server, run, on_ready=start_silos, on_round=on_round)
    finally:
        for silo in silos:
            silo.stop()
    assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
    assert probed == [outcome.run_id]  # the live run, which the stranger did not stop
    assert len(outcome.records) == 3
    assert [r.round for r in rounds] == [1, 2, 3]
    assert outcome.model_path == out / "model.pt"
    pids = [p["pid"] for p in json.loads((out / "server.json").read_text())["processes"]]
    pids += [silo.pid for silo in silos]

    sizes = {r.round: {s.silo: s.batch_size for s in r.silos} for r in outcome.records}
    assert sizes[1] == {"silo-0": 16, "silo-1": 16, "silo-2": 16}  # uniform start
    for by_silo in sizes.values():
        assert sum(by_silo.values()) == 48  # X preserved
    last = sizes[3]
    assert last["silo-0"] > last["silo-1"] > last["silo-2"]
    assert last["silo-0"] / last["silo-2"] >= 2.5  # toward 4 : 2 : 1
    assert min(last.values()) >= 8  # the stability guard: no silo below half the mean B
    assert outcome.records[-1].efficiency > 0.8  # 27:14:7 is E = 1; the floor's 26:14:8 ~0.86
    assert all(not r.rejected and not r.failed for r in outcome.records)
    assert outcome.records[-1].accuracy is not None

    # The aggregate is the dataset-size-weighted mean of the updates the server received.
    for k in (1, 2, 3):
        with np.load(out / "updates" / f"round-{k}.npz") as saved:
            nodes = [name.split("/")[1] for name in saved.files if name.startswith("weight/")]
            weights = {n: float(saved[f"weight/{n}"]) for n in nodes}
            assert len(set(weights.values())) >= 1
            keys = [n.split("/", 1)[1] for n in saved.files if n.startswith("aggregate/")]
            total = sum(weights.values())
            for key in keys:
                expected = sum(saved[f"update/{n}/{key}"] * weights[n] / total for n in nodes)
                np.testing.assert_allclose(
                    saved[f"aggregate/{key}"], expected, rtol=1e-5, atol=1e-6
                )

    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert set(summary["final_sizes"]) == {"silo-0", "silo-1", "silo-2"}
    assert sum(summary["final_sizes"].values()) == 48
    for pid in pids:  # everything we started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_next_run_starts_balanced_at_the_first_runs_verdict(tmp_path, monkeypatch):
    """Real processes, run twice with one profiles folder (as a deployment would be): the
    second run's guard takes up the first run's verdict instead of probing, though its
    out-dir and seed differ; stable, its round 1 is balanced from the silos' stored
    profiles at full balance, at the edge it runs at B0 as a first run's."""
    from pathlib import Path

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))  # every process's

    def run(name, seed):
        out, silos = tmp_path / name, []

        def start_silos(ready):
            for i, factor in enumerate((1, 2, 4)):
                values = {
                    "server": ready.address,
                    "slowdown": float(factor),
                    "base-speed": BASE_SPEED,
                    "workdir": str(tmp_path / f"{name}-silo-{i}"),
                }
                silos.append(start_silo(silo_settings(Path(f"silos/silo-{i}.toml"), values)))

        server, settings = server_settings(
            Path("server/server.toml"),
            {"port": 0, "out-dir": str(out), "run-timeout": 400.0},
            {k: v for k, v in run_settings(out, seed=seed).items() if k != "out-dir"},
        )
        try:
            outcome = run_server(server, settings, on_ready=start_silos)
        finally:
            for silo in silos:
                silo.stop()
        assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
        return outcome, json.loads((out / "summary.json").read_text())["stability"]

    first, judged = run("first", seed=0)
    assert judged["regime"] in ("stable", "edge")
    assert judged["remembered"] is None
    assert {s.batch_size for s in first.records[0].silos} == {16}  # round 1 uniform
    second, taken = run("second", seed=1)
    assert taken["remembered"].startswith(f"{judged['regime']}, found ")
    assert taken["decided_in_round"] is None  # no probe ran
    said = [e for e in second.records[0].events if "takes up the last run's verdict" in e]
    assert len(said) == 1  # in round 1's table, as the log says it
    sizes = {s.silo: s.batch_size for s in second.records[0].silos}
    if judged["regime"] == "stable":  # balanced from round 1, below the floor's 8: 27:14:7
        assert sizes["silo-0"] > sizes["silo-1"] > sizes["silo-2"]
        assert 4 <= sizes["silo-2"] < 8
    else:
        assert set(sizes.values()) == {16}


def test_he_fedavg_over_tls_with_silo_authentication(tmp_path):
    """One federation set up as a deployment across organisations would be, serving the
    assertions of all three layers.
    TLS and silo keys (`fedlb certs`, `fedlb silo-key`): the SuperLink serves HTTPS and
    admits only registered silo keys; two registered silos train, a silo trusting another
    CA and a silo with an unregistered key never join.
    CKKS: the server holds the public context only; every round's aggregate (computed on
    ciphertexts) decrypts to the dataset-size-weighted mean of the decrypted updates; the
    final model stays encrypted and `fedlb decrypt` opens it at a silo. Then a run whose
    silos all fail is a failure with their reason."""
    from collections import OrderedDict

    import typer
    from flwr.app import Array, ArrayRecord
    from typer.testing import CliRunner

    from fedlb.cli import app
    from fedlb.cli.federation import finish
    from fedlb.deploy.processes import launch_supernode
    from fedlb.flower import decrypt_record
    from fedlb.he import load_context, write_keys
    from fedlb.security import make_certificates, make_silo_key

    keys = write_keys(tmp_path / "keys")
    secret = load_context(keys.secret, "silo")
    tls = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    other = make_certificates(tmp_path / "other-ca", ["127.0.0.1"])
    silo_keys = [make_silo_key(tmp_path / "silo-keys", f"silo-{i}") for i in range(2)]
    stranger_key, _ = make_silo_key(tmp_path / "stranger", "stranger")
    out = tmp_path / "out"
    with Federation(
        tmp_path / "procs", tls=tls, silo_keys=[public for _, public in silo_keys]
    ) as federation:
        assert "--ssl-certfile" in federation.link.command
        assert "--enable-supernode-auth" in federation.link.command
        federation.add_silos(
            {
                f"silo-{i}": {**silo_config(i, 2, factor), "he-context": str(keys.secret)}
                for i, factor in enumerate((1, 3))
            },
            {f"silo-{i}": private for i, (private, _) in enumerate(silo_keys)},
        )
        # launched, not waited for: Flower may refuse one before its local API is up
        intruders = [
            launch_supernode(
                tmp_path / "procs",
                "wrong-ca",
                federation.address,
                silo_config(0, 2, 1),
                root_certificates=other.ca,
                extra_args=["--auth-supernode-private-key", str(silo_keys[0][0])],
            ),
            launch_supernode(
                tmp_path / "procs",
                "unregistered",
                federation.address,
                silo_config(1, 2, 1),
                root_certificates=tls.ca,
                extra_args=["--auth-supernode-private-key", str(stranger_key)],
            ),
        ]
        settings = {
            "num-silos": 2,
            "partition": "dirichlet:0.5",  # unequal dataset sizes: the weights matter
            "keep-updates": 1,
            "he-context": str(keys.public),
        }
        probed = []

        def probe(record):  # with the CA every silo has, a stranger gets no Control API
            if record.round == 1:
                address = federation.address
                probed.append(probe_public_door(address, federation.control_address, tls.ca))

        try:
            outcome = federation.run(run_settings(out, **settings), on_round=probe, timeout=400)
            # The same silos in a run that splits the data otherwise (num-silos 1, their
            # num-partitions 2): each fails every round. Flower calls that run completed;
            # fedlb calls it a failure, with the silos' reason, and `fedlb server` exits 1.
            failing = {**settings, "num-silos": 1, "num-rounds": 1, "local-steps": 1}
            failed = federation.run(run_settings(tmp_path / "out-2", **failing), timeout=200)
        finally:
            for node in intruders:
                node.stop()
    wrong_ca = intruders[0].log_path.read_text(errors="replace")
    assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca, wrong_ca[-2000:]
    unregistered = intruders[1].log_path.read_text(errors="replace")
    assert "could not establish a connection" in unregistered.lower() or (
        "failed to activate" in unregistered.lower()
    ), unregistered[-2000:]
    assert failed.status == "finished:completed"
    assert not failed.ok
    assert "1 of 1 rounds trained nothing" in failed.problem
    assert "num-partitions 2, but the run has num-silos 1" in failed.problem
    rows = (tmp_path / "out-2" / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(r)["round_silos"] for r in rows] == [0]  # on record, with why
    with pytest.raises(typer.Exit) as exit_:
        finish(failed)
    assert exit_.value.exit_code == 1

    assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
    assert probed == [outcome.run_id]  # the live run, which the stranger did not stop
    assert "HE on" in outcome.log_path.read_text()
    assert [r.round for r in outcome.records] == [1, 2, 3]
    assert all(not r.failed and not r.rejected for r in outcome.records)
    assert all(len(r.silos) == 2 for r in outcome.records)  # no intruder took part
    assert outcome.records[-1].accuracy is not None  # federated evaluation under HE
    for record in outcome.records:
        for silo in record.silos:
            assert 0 < silo.he_s <= silo.fixed_s  # HE time counts as the fixed cost
    assert not (out / "model.pt").exists()

    def open_record(saved, prefix):
        names = [n for n in saved.files if n.startswith(prefix)]
        arrays = OrderedDict((n[len(prefix) :], Array(saved[n])) for n in names)
        return decrypt_record(secret, ArrayRecord(arrays))

    for k in (1, 2, 3):
        with np.load(out / "updates" / f"round-{k}.npz") as saved:
            nodes = [name.split("/")[1] for name in saved.files if name.startswith("weight/")]
            weights = {n: float(saved[f"weight/{n}"]) for n in nodes}
            assert len(set(weights.values())) == 2
            updates = {n: open_record(saved, f"update/{n}/") for n in nodes}
            aggregate = open_record(saved, "aggregate/")
        total = sum(weights.values())
        for key, array in aggregate.items():
            expected = sum(updates[n][key].numpy() * weights[n] / total for n in nodes)
            np.testing.assert_allclose(array.numpy(), expected, rtol=0, atol=1e-4)

    result = CliRunner().invoke(
        app,
        [
            "decrypt",
            str(out / "model.ckks.npz"),
            "--context",
            str(keys.secret),
            "--out",
            str(tmp_path / "model.pt"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "model.pt").stat().st_size > 0
    refused = CliRunner().invoke(
        app, ["decrypt", str(out / "model.ckks.npz"), "--context", str(keys.public)]
    )
    assert refused.exit_code == 2
    assert "has no secret key" in refused.output


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


def test_fedlb_demo_on_measured_step_time_curves(tmp_path):
    """`fedlb demo --curves`: real SuperLink and SuperNode processes, the silos emulating
    the H200 and the CPU at 4 and 1 threads on the cnn's curves (× 20: this machine is
    slower than an H200), the run training the curves' model. Every output names the
    clock and the curves, and each silo's steps lasted at least its curve's time."""
    import subprocess
    import sys

    from fedlb.training import step_curve

    specs = ("h200/cnn*20", "cpu4/cnn*20", "cpu1/cnn*20")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "fedlb.cli", "demo", "--curves", ",".join(specs)),
            *("--num-rounds", "2", "--local-steps", "4", "--evaluate-every", "2"),
            *("--out-dir", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    clock = "measured (curves: silo-0 h200/cnn*20, silo-1 cpu4/cnn*20, silo-2 cpu1/cnn*20)"
    for i, spec in enumerate(specs):
        assert f"local silo-{i}: emulated curve {spec} (clock: measured, sleep-padded)" in said
    assert " ".join(said.split()).count(f"clock: {clock}") == 2  # each round's table title
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert {row["clock"] for row in rows} == {clock}
    for row in rows:
        curve = step_curve(row["emulated_curve"])
        assert row["emulated_curve"] == specs[int(row["silo"].removeprefix("silo-"))]
        assert row["compute_s"] >= 4 * curve.seconds(row["batch_size"]) * 0.999
        assert row["efficiency"] <= 1.0 + 1e-9  # T* over the curves bounds every round
    assert "cnn" in said
