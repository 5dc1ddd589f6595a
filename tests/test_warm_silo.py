"""The warm path (fedlb.deploy.warm: silos and SuperLink) on real processes, and the Flower
behaviours it relies on: a Flower upgrade that changes one of them fails here, not in a
user's run."""

from __future__ import annotations

import os
import signal
import time
import types

import psutil
import pytest

from fedlb import _flower_internals as flower
from fedlb.deploy import RunConfig, prompt
from fedlb.deploy.federation import Federation
from fedlb.deploy.join import LOST_TASK, ClientAppFailures
from fedlb.deploy.prompt import (
    PULL_BACKOFF_S,
    SUPERNODE_SLEEPS,
    fast_object_pulls,
    fast_reply_pulls,
    prompt_supernode,
)
from fedlb.deploy.warm import (
    ACQUIRE_TASK,
    NODE_NAME,
    SERVER_NAME,
    isolated,
    launcher_command,
    make_secret,
    unsupported,
)
from fedlb.deploy.warm_tasks import TASK_NAME


def test_this_flower_runs_silos_warm_and_its_pulls_retry_after_20_ms():
    """The Flower details the warm path drives are there (tests/test_flower_internals_*.py
    checks each by name); fedlb binds its own first retry (20 ms, not Flower's 1 s) to the
    ClientApp runtime's message pulls and the ServerApp grid's reply pulls."""
    assert unsupported() is None  # this Flower runs silos warm (else they start cold)
    for owner, name, bind in (
        (flower.CLIENTAPP_RUNTIME, "pull_and_inflate_object_from_tree", fast_object_pulls),
        (flower.SERVERAPP_GRID, "pull_objects", fast_reply_pulls),
    ):
        module = flower.module(owner)
        before = getattr(module, name)
        try:
            bind()
            bind()  # twice: still one partial over Flower's function
            assert getattr(module, name).keywords == {"initial_backoff": PULL_BACKOFF_S}
            assert getattr(module, name).func is before
        finally:
            setattr(module, name, before)


def test_the_supernode_loop_it_shortens_sleeps_where_it_expects():
    """Flower's SuperNode loop pauses 3 s after an empty pull and 0.5 s while a reply is
    not there yet, through its module's `time`; prompt_supernode shortens those two only."""
    loop = flower.module(flower.SUPERNODE_LOOP)
    idle, reply = SUPERNODE_SLEEPS
    assert loop.time is time
    pull_objects = loop.pull_objects
    try:
        prompt_supernode(0.01, 0.02)
        prompt_supernode(0.01, 0.02)  # twice: still one partial over Flower's function
        assert loop.pull_objects.keywords == {"initial_backoff": 0.02}
        assert loop.pull_objects.func is pull_objects
        slept: list[float] = []
        with pytest.MonkeyPatch.context() as patch:  # what reaches time.sleep, not how long
            patch.setattr(prompt, "time", types.SimpleNamespace(sleep=slept.append))
            loop.time.sleep(idle)
            loop.time.sleep(reply)
            loop.time.sleep(7.0)  # any other pause: as Flower wrote it
        assert slept == [0.01, 0.02, 7.0]
        assert loop.time.monotonic() > 0
        assert loop.time.time() > 0
    finally:
        loop.time = time
        loop.pull_objects = pull_objects


def test_the_secret_is_the_users_own_and_the_supernode_runs_isolated(tmp_path):
    secret = make_secret(tmp_path / "home" / "superexec.secret")
    assert secret.stat().st_mode & 0o777 == 0o600
    assert len(secret.read_bytes()) == 32
    first = secret.read_bytes()
    make_secret(secret)
    assert secret.read_bytes() != first  # a fresh one each start
    command = launcher_command("127.0.0.1:9", secret, ["flower-supernode", "--insecure"])
    tail = command[command.index("--") + 1 :]
    assert tail[:2] == ["flower-supernode", "--insecure"]
    assert command[command.index("--idle-pull") + 1] == "0.2"
    assert tail[-4:] == ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    # a user's own SuperNode command: what the warm path needs is added only where missing
    own = ["flower-supernode", "--isolation", "process", "--superlink", "s:9092"]
    assert isolated(own, secret) == [*own, "--superexec-auth-secret-file", str(secret)]
    assert isolated(isolated(own, secret), secret) == isolated(own, secret)


def test_the_launcher_gives_a_users_own_supernode_a_fresh_secret(tmp_path, monkeypatch):
    import fedlb.deploy.warm as warm

    started = {}
    monkeypatch.setattr(warm, "launch", lambda *args: started.setdefault("args", args) and 0)
    secret = tmp_path / "new" / "superexec.secret"
    arguments = ["--runtime-api-address", "127.0.0.1:9", "--secret-file", str(secret)]
    assert warm.main([*arguments, "--", "flower-supernode", "--insecure"]) == 0
    assert secret.stat().st_mode & 0o777 == 0o600  # written, the user's own
    supernode = started["args"][2]
    assert supernode[:2] == ["flower-supernode", "--insecure"]
    assert supernode[-2:] == ["--superexec-auth-secret-file", str(secret)]


def silo_config(i: int) -> dict[str, object]:
    return {"partition-id": i, "num-partitions": 2, "emulated-speed": 400.0, "threads": 1}


def run_settings(out_dir, **changes):
    return {
        **RunConfig().to_mapping(),
        "num-silos": 2,
        "num-rounds": 2,
        "local-steps": 3,
        "batch-size": 8,
        "evaluate-every": 2,
        "out-dir": str(out_dir),
        **changes,
    }


def foreign_acquire(address: str, secret: bytes | None, task: str = "flwr-clientapp") -> None:
    """AcquireTask as another caller would: unsigned, or signed with another secret."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if secret is not None:
        interceptors.append(
            SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE_TASK})
        )
    client = RuntimeHttpClient.from_server_address(address, True, None, interceptors)
    try:
        client.AcquireTask(AcquireTaskRequest(supported_task_types=[task]))
    finally:
        client.close()


def warm_server(node) -> psutil.Process:
    """The warm server of a silo (or of the SuperLink): the launcher's child that serves."""
    launcher = psutil.Process(node.pid).children()[0]
    deadline = time.monotonic() + 60  # forked once the launcher has imported torch
    while time.monotonic() < deadline:
        for child in launcher.children():
            if child.name() == SERVER_NAME:
                return child
        time.sleep(0.1)
    raise AssertionError(f"no warm server under {launcher.cmdline()}")


@pytest.mark.slow
def test_warm_silos_serve_every_message_from_one_warm_server(tmp_path):
    """Two warm silos and a warm SuperLink: a run completes; each silo imported torch
    once (one server) and ran each message in a fork of it, the SuperLink each run; an
    unsigned caller is refused their tasks; a silo's server killed between runs is
    restarted, said so, and the next run completes."""
    with Federation(tmp_path / "procs") as federation:
        # a fork per message (what this tests), also on a GPU machine (auto: resident there)
        nodes = federation.add_silos(
            {f"silo-{i}": silo_config(i) for i in range(2)}, warm=True, resident="off"
        )
        servers = [warm_server(node) for node in nodes]
        warm_server(federation.link)
        for node in [*nodes, federation.link]:  # Flower's SuperNode (SuperLink), forked
            launcher = psutil.Process(node.pid).children()[0]  # by fedlb's launcher
            names = sorted(child.name() for child in launcher.children())
            assert names == sorted([NODE_NAME, SERVER_NAME]), names
        outcome = federation.run(run_settings(tmp_path / "one"), timeout=240)
        assert outcome.status == "finished:completed", outcome.problem()
        assert [r.round for r in outcome.records] == [1, 2]
        for record in outcome.records:  # each silo's timeline: its start-up, its wall
            for silo in record.silos:
                assert silo.start_s is not None
                assert 0 <= silo.start_s < 3.0  # a fork: no imports (a cold start: ~4 s)
                assert silo.wall_s is not None
                assert silo.round_s <= silo.wall_s <= record.wall_s + 0.5
        for node, server in zip(nodes, servers, strict=True):
            log = node.log_path.read_text()
            assert log.count("warm: torch") == 1  # imported once, for every message
            assert log.count("warm: task") >= 2  # a fork per message
            assert "Loading ClientApp" not in log  # Flower's DEBUG line: not the app's output
            assert server.is_running()
            assert warm_server(node).pid == server.pid

        # The runtime APIs hand tasks only to a caller signed with the owner's secret: the
        # silo's (ClientApps) and the server's (ServerApps), at both of its doors.
        for address, task in (
            (f"127.0.0.1:{nodes[0].port}", "flwr-clientapp"),
            (federation.address, "flwr-serverapp"),
            (federation.control_address, "flwr-serverapp"),
        ):
            for secret in (None, b"not the owner's secret, 32 bytes"):
                with pytest.raises(Exception, match=r"(?i)unauthenticated|401|403|auth"):
                    foreign_acquire(address, secret, task)

        os.kill(servers[0].pid, signal.SIGKILL)  # a crash of the warm server
        deadline = time.monotonic() + 30
        while "restarting it" not in nodes[0].log_path.read_text():
            assert time.monotonic() < deadline, "the launcher did not restart the server"
            time.sleep(0.2)
        outcome = federation.run(run_settings(tmp_path / "two"), timeout=240)
        assert outcome.status == "finished:completed", outcome.problem()
        assert warm_server(nodes[0]).pid != servers[0].pid
        # The SuperLink's ServerApps: both runs forked from one warm server that imported
        # torch once; each run's own output still reached its log (Flower's log upload).
        assert federation.link is not None
        assert federation.link.log_path.read_text().count("warm: torch") == 1
        assert warm_server(federation.link).is_running()
        for run_log in federation.workdir.glob("serverapp-*.log"):
            assert "Starting LoadBalancedFedAvg strategy" in run_log.read_text()
        assert len(list(federation.workdir.glob("serverapp-*.log"))) == 2


@pytest.mark.slow
def test_a_task_lost_mid_round_fails_at_once_and_the_silo_stays_in(tmp_path):
    """Before: a silo whose warm server was killed mid-task dropped out for the rest of the
    run, silently: its SuperNode waited for the lost task's reply for ever, the round for
    its timeout (600 s by default), and the silo was never sampled again. Now a task lost
    to its warm server's death (round 1) or to its own (SIGKILL, round 3) is answered with
    an error at once: the round goes on without that reply, the silo trains in the next,
    and what happened is in the silo's log as the console reads it. A silo lost whole
    (round 5) ends its round after ~20 s of missed heartbeats, not Flower's ~60."""
    import threading

    kills: dict[int, float] = {}  # round -> when its task (or server) was killed

    def next_task(node, after: int = 0) -> psutil.Process:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for child in warm_server(node).children():
                if child.name() == TASK_NAME and child.pid != after:
                    return child
            time.sleep(0.05)
        raise AssertionError("no task was forked")

    with Federation(tmp_path / "procs") as federation:
        configs = {f"silo-{i}": {**silo_config(i), "emulated-speed": 20.0} for i in range(2)}
        nodes = federation.add_silos(configs, warm=True, resident="off")  # forks, also on a GPU
        failures = ClientAppFailures(nodes[0].log_path)

        def kill() -> None:  # round 1: the warm server; round 3: the task's own process
            task = next_task(nodes[0])  # round 1's training (~4 s at 20 samples/s)
            time.sleep(1.0)
            kills[1] = time.monotonic()
            os.kill(warm_server(nodes[0]).pid, signal.SIGKILL)
            for _ in range(2):  # round 2's task, then round 3's
                task.wait(60)
                task = next_task(nodes[0], task.pid)
            time.sleep(1.0)
            kills[3] = time.monotonic()
            task.kill()
            task = next_task(nodes[0], task.pid)  # round 4's task runs to its end
            task.wait(60)
            task = next_task(nodes[0], task.pid)  # round 5's: the whole silo goes
            time.sleep(1.0)
            kills[5] = time.monotonic()
            nodes[0].kill()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        ended: dict[int, float] = {}

        def on_round(record) -> None:
            ended[record.round] = time.monotonic()

        settings = {"num-rounds": 5, "local-steps": 10, "round-timeout": 300.0}
        outcome = federation.run(
            run_settings(tmp_path / "out", **settings), on_round=on_round, timeout=500
        )
        killer.join(5)
    assert outcome.status == "finished:completed", outcome.problem()
    assert sorted(kills) == [1, 3, 5]
    taking_part = {r.round: sorted(s.silo for s in r.silos) for r in outcome.records}
    assert taking_part == {
        1: ["silo-1"],
        2: ["silo-0", "silo-1"],
        3: ["silo-1"],
        4: ["silo-0", "silo-1"],
        5: ["silo-1"],
    }
    for number in (1, 3):
        record = outcome.records[number - 1]
        assert len(record.failed) == 1, record.failed
        assert "ClientApp failed" in record.failed[0], record.failed
        assert ended[number] - kills[number] < 30  # its round did not wait for the timeout
    # Round 5: the silo's machine gone (SuperNode and all): the SuperLink declares the node
    # unavailable after 2 of its heartbeat intervals (fedlb's 10 s; Flower's are 30 s)
    assert any("Node Unavailable" in f for f in outcome.records[4].failed), outcome.records[4]
    assert ended[5] - kills[5] < 2 * 10 + 10
    log = nodes[0].log_path.read_text()
    assert log.count(LOST_TASK) == 2, log[-3000:]
    assert "its process was killed by SIGKILL" in log
    said = failures.new()  # what `fedlb silo` prints on the silo's console
    assert any("warm ClientApp server exited" in line for line in said), said
    assert sum("ClientApp ended without a reply" in line for line in said) == 2, said


def test_a_forked_child_ends_as_a_started_one_would():
    """The launcher's children are forks (fedlb.deploy.forked): their exit codes, signals
    and names read as a started process's would."""
    import subprocess
    import sys

    from fedlb.deploy.forked import Forked

    assert Forked(lambda: 3, "fedlb-test").wait(10) == 3
    assert Forked(lambda: sys.exit(4), "fedlb-test").wait(10) == 4
    assert Forked(lambda: None, "fedlb-test").wait(10) == 0
    assert Forked(lambda: 1 // 0, "fedlb-test").wait(10) == 1  # its traceback on stderr
    sleeper = Forked(lambda: time.sleep(60), "fedlb-sleeper")
    deadline = time.monotonic() + 10  # the child names itself first thing
    while psutil.Process(sleeper.pid).name() != "fedlb-sleeper":
        assert time.monotonic() < deadline, psutil.Process(sleeper.pid).name()
        time.sleep(0.02)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.terminate()
    assert sleeper.wait(10) == -signal.SIGTERM
    sleeper.kill()  # gone already: nothing to signal, no error


def test_the_supernode_pushes_the_reply_of_the_run_it_handles():
    """Flower's SuperNode loop pushes whichever reply comes first. A ClientApp of a run
    whose server died (its message ignored, the app already started) replies late: a fast
    restart's next message then got that stale reply as its own, and its real reply
    waited a round. With replies_of_the_current_run the push step takes the reply of the
    run it pulled a message of, and drops the stale one."""
    import types

    from fedlb.deploy.prompt import replies_of_the_current_run

    def reply(run_id: int, name: str):
        return types.SimpleNamespace(
            metadata=types.SimpleNamespace(
                run_id=run_id, message_id=name, reply_to_message_id=f"to-{name}"
            )
        )

    class State:  # Flower's NodeState as the push step uses it (retrieval marks a message)
        def __init__(self, messages):
            self.messages = {m.metadata.message_id: [m, False] for m in messages}

        def get_messages_legacy(self, *, run_ids=None, is_reply=None, limit=None):
            found = []
            for entry in self.messages.values():
                message, retrieved = entry
                if retrieved or (run_ids is not None and message.metadata.run_id not in run_ids):
                    continue
                entry[1] = True
                found.append(message)
            return found

        def delete_messages(self, *, message_ids=None):
            for name in message_ids or []:
                self.messages.pop(name, None)

    pushed, deleted = [], []

    def flower_push(*, state, object_store, send, push_object):  # the part that matters
        for message in state.get_messages_legacy(is_reply=True):
            pushed.append(message.metadata.message_id)
            state.delete_messages(message_ids=[message.metadata.message_id])

    loop = types.SimpleNamespace(_pull_and_store_message=lambda **_: 2, _push_messages=flower_push)
    replies_of_the_current_run(loop)
    replies_of_the_current_run(loop)  # twice: still one wrapper
    state = State([reply(1, "stale"), reply(2, "current")])
    store = types.SimpleNamespace(delete=deleted.append)
    assert loop._pull_and_store_message() == 2  # a message of run 2 is being handled
    loop._push_messages(state=state, object_store=store, send=None, push_object=None)
    assert pushed == ["current"]  # not the stale reply of run 1 ...
    assert deleted == ["stale"]  # ... which is dropped
    assert state.messages == {}


def test_a_failed_clientapp_tasks_message_is_answered_before_its_task_finishes(capsys, monkeypatch):
    """failed_clientapps_reply, on this Flower's own node state and loop steps: a ClientApp
    that took its message and reported FAILED gets its message answered with
    CLIENT_APP_CRASHED ("ClientApp failed: ..."), said in the silo's log, and the loop's
    push step pushes that answer (on a Flower whose push step stops waiting once no task
    is active, the answer is there before the task is finished)."""
    from flwr.common.constant import ErrorCode

    from fedlb.deploy.prompt import failed_clientapps_reply
    from tests.flower_internals_helpers import Node

    state_class = flower.node_state_class()
    finish = getattr(state_class.finish_task, "__wrapped__", state_class.finish_task)
    monkeypatch.setattr(state_class, "finish_task", finish)  # Flower's own; put back after
    failed_clientapps_reply()
    failed_clientapps_reply()  # twice: one wrapper
    assert state_class.finish_task.__wrapped__ is finish
    node = Node()
    message, task = node.receive(run_id=7)
    node.clientapp_pulls(task)
    node.fail(task, "its process was killed by SIGKILL")
    sent = node.push()
    assert len(sent) == 1
    assert sent[0].error.code == ErrorCode.CLIENT_APP_CRASHED
    assert sent[0].error.reason == "ClientApp failed: its process was killed by SIGKILL"
    assert sent[0].metadata.reply_to_message_id == message.metadata.message_id
    assert LOST_TASK in capsys.readouterr().out
